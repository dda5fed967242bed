"""Approvals in the state store (issue 23): two Sluice processes on one real
redis-server on loopback. An ask raised through A is listed by B and
approved through B's admin; A and B both use the grant; a revoke through one
cuts the other's next request; a restarted process keeps the grant; no
approvals.sqlite3 is made; the store down keeps the grants as last read,
the verbs answer 503 with a sentence and an ask made meanwhile is recorded
once it is back; `--workers 2`'s supervisor answers from the store; a
reload that adds `state` moves approvals there."""

from __future__ import annotations

import json
import signal
import subprocess

import pytest
import yaml

from harness import absolute_form, default_policy
from harness.clients import clean_env
from harness.redis_server import RedisServer
from harness.sluice import sluice_executable
from harness.wait import wait_until

pytestmark = pytest.mark.netns

ORIGIN_IP = "8.8.8.8"  # the harness origin on :80
TOKEN = "ops-token-0123456789abcdef"
HOSTS = [f"shared{i}.example" for i in range(1, 12)]
SQLITE = "approvals.sqlite3"


@pytest.fixture(scope="module")
def names(netns, fake_dns):
    for host in HOSTS:
        fake_dns.set(host, a=[ORIGIN_IP])


@pytest.fixture(scope="module")
def store(names):
    with RedisServer() as server:
        yield server


def policy_text(store: RedisServer | None) -> str:
    base = default_policy(ports=[80])
    base["allow"] = ["allowed.example"]
    if store is not None:
        base["state"] = {"store": {"url": store.url}, "timeout": "200ms"}
    base["approvals"] = {"ask": ["host_not_allowed"], "grant_for": "1h"}
    return yaml.safe_dump(base, sort_keys=False)


def start(sluice_factory, tmp_path_factory, store, *, name: str, extra=()):
    work = tmp_path_factory.mktemp(f"{name}-files")
    (work / "tokens").write_text(f"ops {TOKEN}\n")
    state = work / "state"
    state.mkdir()
    proxy = sluice_factory(policy_text(store), name=name,
                           extra_args=["--state-dir", str(state), "--admin-token-file", str(work / "tokens"), *extra])
    proxy.state_dir = state
    return proxy


@pytest.fixture(scope="module")
def pair(sluice_factory, tmp_path_factory, store):
    return (start(sluice_factory, tmp_path_factory, store, name="grants-a"),
            start(sluice_factory, tmp_path_factory, store, name="grants-b"))


def cli(proxy, *args: str) -> subprocess.CompletedProcess:
    env = clean_env()
    env["SLUICE_ADMIN_TOKEN"] = TOKEN
    return subprocess.run([sluice_executable(), "approvals", "--admin", proxy.admin_url.removeprefix("http://"),
                           *args], env=env, capture_output=True, text=True, timeout=30)


def listing(proxy) -> dict:
    result = cli(proxy, "list", "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def ask(proxy, host: str) -> str:
    response = absolute_form(proxy.address, f"http://{host}/")
    assert response.status == 403 and response.sluice_reason == "approval_pending", response
    return response.text.split("approval request ", 1)[1][:12]


def status(proxy, host: str) -> int:
    return absolute_form(proxy.address, f"http://{host}/").status


def listed(proxy, ident: str) -> bool:
    return ident in [a["id"] for a in listing(proxy)["pending"]]


def test_an_ask_through_a_approved_through_b_is_used_by_both(pair):
    a, b = pair
    assert "approvals in the state store redis://127.0.0.1:" in a.ready_line
    ident = ask(a, "shared1.example")
    assert ask(b, "shared1.example") == ident  # one id, whichever process is asked
    wait_until(lambda: listed(b, ident), timeout=5, what="A's ask listed by B")
    assert [p["id"] for p in listing(b)["pending"]].count(ident) == 1
    approved = cli(b, "approve", ident)
    assert approved.returncode == 0, approved.stderr
    wait_until(lambda: status(a, "shared1.example") == 200, timeout=5, what="A uses B's grant")
    wait_until(lambda: status(b, "shared1.example") == 200, timeout=5, what="B uses its grant")
    assert [g["id"] for g in listing(a)["grants"]] == [ident]
    # One approval_requested and one approval_granted line across both audit logs.
    for event in ("approval_requested", "approval_granted"):
        wait_until(lambda event=event: [e for p in pair for e in p.audit() if e["event"] == event and e["id"] == ident],
                   timeout=5, what=event)
        assert len([e for p in pair for e in p.audit() if e["event"] == event and e["id"] == ident]) == 1
    again = cli(a, "approve", ident)  # decided once
    assert again.returncode == 1 and "no pending approval request" in again.stderr


def test_a_revoke_through_one_cuts_the_others_next_request(pair):
    a, b = pair
    ident = ask(b, "shared2.example")
    wait_until(lambda: listed(a, ident), timeout=5, what="B's ask listed by A")
    assert cli(a, "approve", ident).returncode == 0
    wait_until(lambda: status(b, "shared2.example") == 200, timeout=5, what="B uses A's grant")
    revoked = cli(a, "revoke", ident)
    assert revoked.returncode == 0, revoked.stderr
    wait_until(lambda: status(b, "shared2.example") == 403, timeout=5, what="B refuses after A's revoke")
    assert status(a, "shared2.example") == 403


def test_no_sqlite_file_is_made_with_a_store(pair):
    a, b = pair
    ask(a, "shared3.example")
    assert not list(a.state_dir.iterdir()) and not list(b.state_dir.iterdir())


def test_a_restarted_process_keeps_the_grant(sluice_factory, tmp_path_factory, store):
    first = start(sluice_factory, tmp_path_factory, store, name="grants-before")
    ident = ask(first, "shared4.example")
    wait_until(lambda: listed(first, ident), timeout=5, what="the ask")
    assert cli(first, "approve", ident).returncode == 0
    wait_until(lambda: status(first, "shared4.example") == 200, timeout=5, what="the grant")
    first.stop()
    # A new process (a new --state-dir too): the grant is in the store, read before the ready line.
    second = start(sluice_factory, tmp_path_factory, store, name="grants-after")
    assert status(second, "shared4.example") == 200
    assert not list(second.state_dir.iterdir())


def test_the_store_down_keeps_the_grants_and_the_verbs_answer_503(sluice_factory, tmp_path_factory, names):
    with RedisServer() as own:
        proxy = start(sluice_factory, tmp_path_factory, own, name="grants-down")
        granted = ask(proxy, "shared5.example")
        wait_until(lambda: listed(proxy, granted), timeout=5, what="the ask")
        assert cli(proxy, "approve", granted).returncode == 0
        wait_until(lambda: status(proxy, "shared5.example") == 200, timeout=5, what="the grant")
        mark = proxy.stderr_mark()
        own.stop()
        wait_until(lambda: "the gate keeps the grants and denials as last read" in proxy.stderr_since(mark),
                   timeout=10, what="the store-down line")
        assert status(proxy, "shared5.example") == 200  # as last read
        down = cli(proxy, "approve", "0123456789ab")
        assert down.returncode == 1 and "is unavailable" in down.stderr and "try again once it is back" in down.stderr
        assert "Traceback" not in down.stderr
        listed_down = cli(proxy, "list")
        assert listed_down.returncode == 1 and "is unavailable" in listed_down.stderr
        waiting = ask(proxy, "shared6.example")  # answered at once, recorded when the store is back
        own.start()  # empty: nothing saved (--save '')
        wait_until(lambda: "answers again" in proxy.stderr_since(mark), timeout=10, what="the store-up line")
        wait_until(lambda: listed(proxy, waiting), timeout=5, what="the ask made while the store was down")
        text = proxy.stderr_since(mark)
        assert text.count("the gate keeps the grants and denials as last read") == 1 and "Traceback" not in text


def test_workers_with_a_store_answer_the_verbs_from_it(sluice_factory, tmp_path_factory, store):
    proxy = start(sluice_factory, tmp_path_factory, store, name="grants-workers", extra=("--workers", "2"))
    ids = {ask(proxy, "shared7.example") for _ in range(4)}
    assert len(ids) == 1
    ident = ids.pop()
    wait_until(lambda: listed(proxy, ident), timeout=5, what="the ask")
    assert cli(proxy, "approve", ident).returncode == 0
    wait_until(lambda: all(status(proxy, "shared7.example") == 200 for _ in range(6)), timeout=5,
               what="the grant in every worker")
    assert not list(proxy.state_dir.iterdir())


def test_a_reload_that_adds_state_moves_approvals_to_the_store(sluice_factory, tmp_path_factory, store, pair):
    a, _ = pair
    ident = ask(a, "shared8.example")
    wait_until(lambda: listed(a, ident), timeout=5, what="the ask in the store")
    local = start(sluice_factory, tmp_path_factory, None, name="grants-reload")
    assert (local.state_dir / SQLITE).exists() and not listed(local, ident)
    mark = local.stderr_mark()
    local.policy_file.write_text(policy_text(store))
    local.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: "approvals: now in the state store" in local.stderr_since(mark), timeout=10,
               what="the switch line")
    assert listed(local, ident)  # the store's asks, not the file's
    assert cli(local, "approve", ident).returncode == 0
    wait_until(lambda: status(a, "shared8.example") == 200, timeout=5, what="A uses the grant")
