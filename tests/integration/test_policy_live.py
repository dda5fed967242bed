"""The policy language in the running proxy: hot reload (edits, rename-over,
ConfigMap symlink swaps, deletion, bad edits, SIGHUP, under load), report
mode, client profiles by username and by source address, methods."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from harness import default_policy
from harness.wait import wait_until
from sluice.policy.loader import hash_password

pytestmark = pytest.mark.netns

FAST_POLL = ("--set", "sluice_policy_poll=0.2")


def write_policy(path: Path, policy: dict | str) -> None:
    """Write like an editor: to a temp file, then rename over the original."""
    text = policy if isinstance(policy, str) else yaml.safe_dump(policy, sort_keys=False)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def get(proxy, url: str, **kw) -> httpx.Response:
    with httpx.Client(proxy=proxy.proxy_url, trust_env=False, timeout=10) as c:
        return c.get(url, **kw)



@pytest.fixture
def reloading(sluice_factory):
    return sluice_factory(default_policy(), name="reload", extra_args=FAST_POLL)


def test_an_edit_is_picked_up_and_audited(reloading):
    assert get(reloading, "http://public.example/").status_code == 200
    mark = reloading.audit_mark()
    write_policy(reloading.policy_file, default_policy(deny=["public.example"]))
    assert wait_until(lambda: get(reloading, "http://public.example/").status_code == 403)
    r = get(reloading, "http://public.example/")
    assert r.headers["sluice-reason"] == "host_denied"
    reloading.wait_audit(lambda e: e["event"] == "reload" and e["decision"] == "ok", since=mark)
    line = reloading.wait_audit(lambda e: e.get("reason") == "host_denied", since=mark)
    deny_line = reloading.policy_file.read_text().splitlines().index("- public.example") + 1
    assert line["rule"] == f"{reloading.policy_file}:{deny_line}"  # file:line of the deny entry


def test_a_bad_edit_keeps_the_last_good_policy(reloading):
    write_policy(reloading.policy_file, default_policy(deny=["public.example"]))
    assert wait_until(lambda: get(reloading, "http://public.example/").status_code == 403)
    mark, err_mark = reloading.audit_mark(), reloading.stderr_mark()
    write_policy(reloading.policy_file, "version: 1\nports: [80, 443]\nalow: [x.example]\n")
    failed = reloading.wait_audit(lambda e: e["event"] == "reload" and e["decision"] == "failed", since=mark)
    assert "did you mean 'allow'" in failed["detail"]
    assert wait_until(lambda: f"{reloading.policy_file}:3:1:" in reloading.stderr_since(err_mark))
    # still enforcing the last good policy: the deny rule holds, the rest works
    assert get(reloading, "http://public.example/").headers["sluice-reason"] == "host_denied"
    assert get(reloading, "http://one.example/").status_code == 200
    assert get(reloading, "http://169.254.169.254/").status_code == 403


def test_a_deleted_file_keeps_the_last_good_policy_and_a_new_one_is_read(reloading):
    write_policy(reloading.policy_file, default_policy(deny=["one.example"]))
    assert wait_until(lambda: get(reloading, "http://one.example/").status_code == 403)
    mark = reloading.audit_mark()
    reloading.policy_file.unlink()
    reloading.wait_audit(lambda e: e["event"] == "reload" and e["decision"] == "failed", since=mark)
    assert get(reloading, "http://one.example/").headers["sluice-reason"] == "host_denied"
    assert get(reloading, "http://public.example/").status_code == 200
    write_policy(reloading.policy_file, default_policy())
    assert wait_until(lambda: get(reloading, "http://one.example/").status_code == 200)


def test_configmap_symlink_swap_is_picked_up(sluice_factory, tmp_path):
    # Kubernetes mounts a ConfigMap as policy.yaml -> ..data/policy.yaml and
    # swaps ..data (a symlink to a timestamped directory) atomically.
    root = tmp_path / "cm"
    (root / "v1").mkdir(parents=True)
    (root / "v1" / "policy.yaml").write_text(yaml.safe_dump(default_policy()))
    os.symlink("v1", root / "..data")
    os.symlink("..data/policy.yaml", root / "policy.yaml")
    proxy = sluice_factory(default_policy(), name="configmap",
                           extra_args=(*FAST_POLL, "--policy", str(root / "policy.yaml")))
    assert get(proxy, "http://public.example/").status_code == 200
    (root / "v2").mkdir()
    (root / "v2" / "policy.yaml").write_text(yaml.safe_dump(default_policy(deny=["public.example"])))
    os.symlink("v2", root / "..data_tmp")
    os.replace(root / "..data_tmp", root / "..data")
    assert wait_until(lambda: get(proxy, "http://public.example/").status_code == 403)


def test_sighup_reloads_when_polling_is_off(sluice_factory):
    proxy = sluice_factory(default_policy(), name="sighup", extra_args=("--set", "sluice_policy_poll=0"))
    proxy.policy_file.write_text(yaml.safe_dump(default_policy(deny=["public.example"])))
    time.sleep(1.5)
    assert get(proxy, "http://public.example/").status_code == 200  # not polled
    proxy.proc.send_signal(signal.SIGHUP)
    assert wait_until(lambda: get(proxy, "http://public.example/").status_code == 403)


def test_reload_under_load_loses_no_request(reloading):
    results: list[int | str] = []
    stop = threading.Event()

    def hammer():
        with httpx.Client(proxy=reloading.proxy_url, trust_env=False, timeout=10) as c:
            while not stop.is_set():
                try:
                    results.append(c.get("http://public.example/load").status_code)
                except httpx.HTTPError as e:
                    results.append(repr(e))

    threads = [threading.Thread(target=hammer) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        for i in range(8):  # eight reloads, each changing something unrelated
            write_policy(reloading.policy_file, default_policy(deny=[f"other{i}.example"]))
            time.sleep(0.35)
    finally:
        stop.set()
        for t in threads:
            t.join(15)
    reloads = [e for e in reloading.audit() if e["event"] == "reload" and e["decision"] == "ok"]
    assert len(reloads) >= 4
    assert len(results) > 50
    assert set(results) == {200}, [r for r in results if r != 200][:5]


def test_report_mode_lets_host_rules_through_but_never_address_rules(sluice_factory):
    policy = default_policy(action="report", allow=["only.example"], methods=["GET"])
    proxy = sluice_factory(policy, name="report")
    r = get(proxy, "http://public.example/")
    assert r.status_code == 200
    line = proxy.wait_audit(lambda e: e.get("host") == "public.example" and e["event"] == "request")
    assert line["decision"] == "allow" and line["would_refuse"] is True and line["reason"] == "host_not_allowed"
    r = get(proxy, "http://169.254.169.254/")
    assert r.status_code == 403 and r.headers["sluice-reason"] == "address_not_public"
    with httpx.Client(proxy=proxy.proxy_url, trust_env=False, timeout=10) as c:
        assert c.post("http://only.example.invalid/").headers.get("sluice-reason") == "internal_hostname"


@pytest.fixture(scope="module")
def profiles(sluice_factory, fake_dns):
    fake_dns.set("api.example", a=["8.8.8.8"])
    policy = default_policy(
        allow=["public.example", "api.example"],
        clients=[
            {"name": "reader", "users": {"alice": {"password_hash": hash_password("alice-pw", iterations=10_000)}},
             "methods": ["GET", "HEAD"]},
            {"name": "builder", "sources": ["127.0.0.2/32"], "allow": ["*"]},
        ],
    )
    return sluice_factory(policy, name="profiles")


def test_username_profile_applies_its_rules(profiles):
    url = f"http://alice:alice-pw@127.0.0.1:{profiles.port}"
    with httpx.Client(proxy=url, trust_env=False, timeout=10) as c:
        assert c.get("http://public.example/").status_code == 200
        r = c.post("http://public.example/")
        assert r.status_code == 403 and r.headers["sluice-reason"] == "method_not_allowed"
    line = profiles.wait_audit(lambda e: e.get("reason") == "method_not_allowed")
    assert line["profile"] == "reader"


def test_wrong_password_gets_407_and_is_not_forwarded(profiles, net):
    url = f"http://alice:wrong@127.0.0.1:{profiles.port}"
    with httpx.Client(proxy=url, trust_env=False, timeout=10) as c:
        r = c.get("http://public.example/pw")
    assert r.status_code == 407 and r.headers["sluice-reason"] == "client_unknown"
    assert r.headers["proxy-authenticate"].startswith("Basic")
    assert not any(req.path.endswith("/pw") for req in net.origin("8.8.8.8", 80).requests)


def test_source_address_profile_applies_its_rules(profiles):
    def from_source(source: str, host: str) -> bytes:
        with socket.create_connection(profiles.address, timeout=10, source_address=(source, 0)) as s:
            s.sendall(f"GET http://{host}/ HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
            return s.recv(4096)

    assert from_source("127.0.0.2", "one.example").startswith(b"HTTP/1.1 200")  # builder: allow *
    refused = from_source("127.0.0.3", "one.example")  # top level: allow list only
    assert refused.startswith(b"HTTP/1.1 403") and b"host_not_allowed" in refused
    line = profiles.wait_audit(lambda e: e.get("host") == "one.example" and e.get("decision") == "allow")
    assert line["profile"] == "builder"


def test_require_client_refuses_unknown_clients_with_407(sluice_factory):
    policy = default_policy(
        require_client=True,
        clients=[{"name": "agent", "users": {"bot": {"password_hash": hash_password("s3cret", iterations=10_000)}}}],
    )
    proxy = sluice_factory(policy, name="required")
    r = get(proxy, "http://public.example/")
    assert r.status_code == 407 and r.headers["sluice-reason"] == "client_unknown"
    with httpx.Client(proxy=f"http://bot:s3cret@127.0.0.1:{proxy.port}", trust_env=False, timeout=10) as c:
        assert c.get("http://public.example/").status_code == 200


def test_restoring_the_last_good_file_after_a_failed_reload_is_audited_ok(reloading):
    good = reloading.policy_file.read_text()
    mark = reloading.audit_mark()
    write_policy(reloading.policy_file, "version: 1\nports: [80, 'x']\n")
    reloading.wait_audit(lambda e: e["event"] == "reload" and e["decision"] == "failed", since=mark)
    mark = reloading.audit_mark()
    write_policy(reloading.policy_file, good)
    line = reloading.wait_audit(lambda e: e["event"] == "reload" and e["decision"] == "ok", since=mark)
    assert "restored" in line["detail"]
