"""The running proxy reads its policy file safely: a policy path turned into a
FIFO or a character device is refused (audited, last good policy kept, the
proxy keeps serving), and a path pointed at some other file (a shadow file)
never has its lines copied into stderr, the audit log or `sluice policy check`."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml

from harness import default_policy
from harness.sluice import sluice_executable
from harness.wait import wait_until

pytestmark = pytest.mark.netns

HASH = "Yp1" + "AbCdEfGhIjKlMnOpQrStUvWxYz0123456789./" * 2 + "zZ"
SHADOW_LINES = [f"root:$6$saltsalt${HASH}:19000:0:99999:7:::", "daemon:*:19000:0:99999:7:::"]
SECRETS = [HASH[i:i + 24] for i in range(len(HASH) - 24)] + SHADOW_LINES + [
    line.rstrip(":") for line in SHADOW_LINES] + ["saltsalt"]

GOOD = default_policy(deny=["one.example"])


def get(proxy, url: str) -> httpx.Response:
    with httpx.Client(proxy=proxy.proxy_url, trust_env=False, timeout=10) as c:
        return c.get(url)



def point_at(path: Path, target: str | Path) -> None:
    """Make `path` a symlink to `target`, atomically (rename over it)."""
    tmp = path.with_name(path.name + ".lnk")
    os.symlink(target, tmp)
    os.replace(tmp, path)


def write_good(path: Path, policy: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(yaml.safe_dump(policy, sort_keys=False))
    os.replace(tmp, path)


def assert_serving_last_good(proxy) -> None:
    assert get(proxy, "http://public.example/").status_code == 200  # an origin is still reached
    refused = get(proxy, "http://one.example/")
    assert refused.status_code == 403 and refused.headers["sluice-reason"] == "host_denied"


@pytest.fixture
def polled(sluice_factory):
    return sluice_factory(GOOD, name="polled", extra_args=("--set", "sluice_policy_poll=0.2"))


@pytest.fixture
def hupped(sluice_factory):
    return sluice_factory(GOOD, name="hupped", extra_args=("--set", "sluice_policy_poll=0"))


def special_file(kind: str, tmp_path: Path) -> tuple[str, str]:
    """(target path, the kind the refusal names)."""
    if kind == "fifo":
        fifo = tmp_path / "policy.fifo"
        os.mkfifo(fifo)
        return str(fifo), "a FIFO"
    return kind, "a character device"


def check_refused_then_restored(proxy, kind: str, tmp_path: Path, trigger) -> None:
    assert_serving_last_good(proxy)
    target, named = special_file(kind, tmp_path)
    mark, err_mark = proxy.audit_mark(), proxy.stderr_mark()
    point_at(proxy.policy_file, target)
    trigger()
    failed = proxy.wait_audit(lambda e: e["event"] == "reload" and e["decision"] == "failed", since=mark, timeout=10)
    assert failed["detail"] == (f"{proxy.policy_file}:1:1: cannot read the policy: it is {named}, "
                                "not a regular file (symlinks followed); refusing to read it")
    assert wait_until(lambda: f"it is {named}, not a regular file" in proxy.stderr_since(err_mark))
    assert_serving_last_good(proxy)
    assert proxy.alive()
    if kind == "fifo":
        # Nothing holds the FIFO open for reading: the proxy never waits on it.
        with pytest.raises(OSError) as info:
            os.open(target, os.O_WRONLY | os.O_NONBLOCK)
        assert info.value.errno == errno.ENXIO
    # A good file again: read, swapped in and audited.
    mark = proxy.audit_mark()
    write_good(proxy.policy_file, default_policy(deny=["public.example"]))
    trigger()
    ok = proxy.wait_audit(lambda e: e["event"] == "reload" and e["decision"] == "ok", since=mark, timeout=10)
    assert "generation" in ok["detail"]
    assert wait_until(lambda: get(proxy, "http://public.example/").status_code == 403)
    assert get(proxy, "http://one.example/").status_code == 200


@pytest.mark.parametrize("kind", ["fifo", "/dev/zero", "/dev/urandom"])
def test_a_fifo_or_device_found_by_the_poller_keeps_the_last_good_policy(polled, kind, tmp_path):
    write_good(polled.policy_file, GOOD)
    assert wait_until(lambda: get(polled, "http://one.example/").status_code == 403)
    check_refused_then_restored(polled, kind, tmp_path, trigger=lambda: None)


@pytest.mark.parametrize("kind", ["fifo", "/dev/zero", "/dev/urandom"])
def test_a_fifo_or_device_on_sighup_keeps_the_last_good_policy(hupped, kind, tmp_path):
    write_good(hupped.policy_file, GOOD)
    hupped.proc.send_signal(signal.SIGHUP)
    assert wait_until(lambda: get(hupped, "http://one.example/").status_code == 403)
    check_refused_then_restored(hupped, kind, tmp_path, trigger=lambda: hupped.proc.send_signal(signal.SIGHUP))


def assert_no_secret(text: str, where: str) -> None:
    for secret in SECRETS:
        assert secret not in text, f"{secret!r} leaked into {where}"


def test_a_shadow_file_as_the_policy_never_leaks(polled, tmp_path):
    shadow = tmp_path / "shadow"
    shadow.write_text("".join(line + "\n" for line in SHADOW_LINES))
    mark, err_mark = polled.audit_mark(), polled.stderr_mark()
    point_at(polled.policy_file, shadow)
    failed = polled.wait_audit(lambda e: e["event"] == "reload" and e["decision"] == "failed", since=mark, timeout=10)
    # What is wrong, and where...
    assert f"{polled.policy_file}:1:1: unknown key of 116 characters starting 'root' in the policy" in failed["detail"]
    assert f"{polled.policy_file}:2:1: unknown key of 26 characters starting 'daemon'" in failed["detail"]
    assert wait_until(lambda: f"{polled.policy_file}: reload refused" in polled.stderr_since(err_mark))
    assert_serving_last_good(polled)
    # ...and nothing of the file itself, anywhere.
    assert_no_secret(polled.audit_file.read_text(), "the audit log")
    assert_no_secret(polled.stderr_text(), "stderr")
    assert_no_secret(polled.stdout_file.read_text(), "stdout")
    check = subprocess.run([sluice_executable(), "policy", "check", str(polled.policy_file)],
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 1
    assert f"{polled.policy_file}:1:1: unknown key of 116 characters" in check.stderr
    assert_no_secret(check.stdout + check.stderr, "`sluice policy check`")
    # Started on it, the proxy refuses to start, and says why without the lines.
    start = subprocess.run([sluice_executable(), "proxy", "--policy", str(shadow), "--listen", "127.0.0.1:0",
                            "--audit-log", str(tmp_path / "start-audit.jsonl")],
                           capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert start.returncode != 0 and f"{shadow}:1:1: unknown key of 116 characters" in start.stderr
    assert_no_secret(start.stdout + start.stderr, "the failed start's output")
    audit = tmp_path / "start-audit.jsonl"
    assert_no_secret(audit.read_text() if audit.exists() else "", "the failed start's audit log")
