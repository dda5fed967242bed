"""Two Sluice processes sharing one state store (a real redis-server on
loopback, issue 23): one client's rate, tunnels and transfer are held
together across both; the store killed mid-run leaves both serving
(`on_error: local`) with a stderr line and an audit line each, or (`closed`)
refusing what needs a shared limit with `state_store_unavailable`, and
sharing resumes once it is back; wrong proxy passwords counted by one throttle the
address on the other; a process killed with a tunnel open frees its
slot within the heartbeat's TTL."""

from __future__ import annotations

import base64
import signal
import socket
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness import default_policy
from harness.clients import _Reader, connect, read_response, socks5_connect
from harness.redis_server import RedisServer
from harness.wait import wait_until
from sluice.policy.loader import hash_password

pytestmark = pytest.mark.netns

RATE, TUNNELS, BYTES, KILLED, GUESSER = "127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5", "127.0.0.9"
# Proxy users (a cheap hash: these tests count guesses, not hashing cost).
USERS = {user: {"password_hash": hash_password(f"{user}-pw", iterations=10_000)} for user in ("alice", "carol", "dave")}
QUOTA = 600 * 1024  # bytes_per_hour: a few batches, so the slack (a batch a process) is visible


@pytest.fixture(scope="module")
def store():
    with RedisServer() as server:
        yield server


def _policy(store, **state):
    return default_policy(
        state={"store": {"url": store.url}, "timeout": "200ms", **state},
        clients=[
            {"name": "rate", "sources": [f"{RATE}/32"], "limits": {"requests_per_second": 0.01, "burst": 4}},
            {"name": "tunnels", "sources": [f"{TUNNELS}/32"], "limits": {"max_tunnels": 2}},
            {"name": "transfer", "sources": [f"{BYTES}/32"], "limits": {"bytes_per_hour": QUOTA}},
            {"name": "killed", "sources": [f"{KILLED}/32"], "limits": {"max_tunnels": 1}},
            {"name": "login", "users": USERS},
        ])


@pytest.fixture(scope="module")
def pair(sluice_factory, store):
    return sluice_factory(_policy(store), name="shared-a"), sluice_factory(_policy(store), name="shared-b")


def _get(proxy, source: str, url: str = "http://8.8.8.8/", login: tuple[str, str] | None = None):
    auth = ""
    if login is not None:
        auth = "Proxy-Authorization: Basic " + base64.b64encode(":".join(login).encode()).decode() + "\r\n"
    with socket.create_connection(proxy.address, timeout=15, source_address=(source, 0)) as s:
        s.sendall(f"GET {url} HTTP/1.1\r\nHost: {url.split('/')[2]}\r\n{auth}Connection: close\r\n\r\n".encode())
        return read_response(_Reader(s))


def _tunnel(proxy, source: str):
    return connect(proxy.address, "8.8.8.8:80", source=source)


def test_one_clients_rate_is_held_across_both_processes(pair):
    a, b = pair
    statuses = [_get(p, RATE).status for p in (a, b, a, b, a, b)]
    assert statuses == [200, 200, 200, 200, 429, 429]  # a burst of 4 over both, not 4 each


def test_one_clients_tunnels_are_held_across_both_processes(pair):
    a, b = pair
    first, t1 = _tunnel(a, TUNNELS)
    second, t2 = _tunnel(b, TUNNELS)
    assert (first.status, second.status) == (200, 200)
    third, _ = _tunnel(a, TUNNELS)
    fourth, _ = _tunnel(b, TUNNELS)
    assert (third.status, fourth.status) == (429, 429)
    assert third.headers.get("sluice-reason") == "too_many_tunnels"
    t1.close()
    wait_until(lambda: _tunnel(b, TUNNELS)[0].status == 200, timeout=10, what="the closed tunnel's slot freed")
    t2.close()


def test_one_clients_transfer_is_held_across_both_processes_within_the_slack(pair):
    a, b = pair
    passed = 0
    for _ in range(12):
        for proxy in (a, b):
            response = _get(proxy, BYTES, "http://8.8.8.8/bytes/65536")
            passed += len(response.body) if response.status == 200 else 0
    # a batch (256 KiB) a process, the documented slack; without sharing each would pass the whole quota
    assert QUOTA <= passed + 65536 and passed <= QUOTA + 2 * 256 * 1024
    assert _get(a, BYTES).status == _get(b, BYTES).status == 429


def test_a_login_throttle_on_one_process_holds_on_the_other(pair):
    a, b = pair
    # The address's burst of wrong passwords (5), spread over both processes.
    assert [_get(p, GUESSER, login=("alice", f"guess-{i}")).sluice_reason for i, p in enumerate((a, b) * 2 + (a,))] == [
        "client_unknown"] * 5
    for proxy in (b, a):  # each throttles the address now, though it saw only 2 or 3 of the guesses
        refused = _get(proxy, GUESSER, login=("alice", "one-more"))
        assert (refused.status, refused.sluice_reason) == (407, "auth_throttled")
        assert int(refused.headers["retry-after"]) >= 1


def test_the_store_killed_mid_run_leaves_both_serving_and_sharing_resumes(pair, store):
    a, b = pair
    marks = [(p.stderr_mark(), p.audit_mark()) for p in pair]
    store.stop()
    try:
        for proxy, (stderr, audit) in zip(pair, marks):
            assert _get(proxy, "127.0.0.1").status == 200  # on_error: local keeps serving
            wait_until(lambda p=proxy, m=stderr: "counting in this process" in p.stderr_since(m), timeout=10,
                       what="the store-down line on stderr")
            assert any(line["event"] == "state_store" and line["decision"] == "down"
                       for line in proxy.audit()[audit:])
            assert _store_up(proxy) == 0
    finally:
        store.start()
    for proxy, (stderr, _) in zip(pair, marks):
        wait_until(lambda p=proxy, m=stderr: "shared again" in p.stderr_since(m), timeout=15,
                   what="the store-back line on stderr")
    # a new, empty store: one burst of 4 shared again
    assert [_get(p, RATE).status for p in (a, b, a, b, a)] == [200, 200, 200, 200, 429]


def test_a_process_killed_with_a_tunnel_open_frees_its_slot_within_the_ttl(sluice_factory, store, pair):
    _, b = pair
    doomed = sluice_factory(_policy(store), name="shared-doomed")
    response, tunnel = _tunnel(doomed, KILLED)
    assert response.status == 200
    assert _tunnel(b, KILLED)[0].status == 429  # the one slot is held by the doomed process
    doomed.proc.send_signal(signal.SIGKILL)
    doomed.proc.wait(timeout=10)
    tunnel.close()
    t0 = time.monotonic()
    freed = wait_until(lambda: _tunnel(b, KILLED)[1], timeout=25, what="the killed process's slot freed")
    assert time.monotonic() - t0 <= 20  # the heartbeat's TTL (15 s), and a poll's time
    freed.close()


# ---- on_error: closed ------------------------------------------------------------

CLOSED_RATE, CLOSED_TUNNELS, UNLIMITED = "127.0.0.6", "127.0.0.7", "127.0.0.8"


def _closed_policy(store):
    return default_policy(
        state={"store": {"url": store.url}, "timeout": "200ms", "on_error": "closed"},
        clients=[
            {"name": "closed-rate", "sources": [f"{CLOSED_RATE}/32"],
             "limits": {"requests_per_second": 0.01, "burst": 4}},
            {"name": "closed-tunnels", "sources": [f"{CLOSED_TUNNELS}/32"], "limits": {"max_tunnels": 4}},
            {"name": "login", "users": USERS},
        ])  # UNLIMITED matches no profile: the top level sets no limit


def _store_up(proxy) -> float:
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(f"{proxy.admin_url}/metrics",
                                                                            timeout=5) as r:
        text = r.read().decode()
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == "sluice_state_store_up")


def test_on_error_closed_refuses_what_needs_a_shared_limit_while_the_store_is_down(sluice_factory, store, pair):
    closed = (sluice_factory(_closed_policy(store), socks=True, name="closed-a"),
              sluice_factory(_closed_policy(store), socks=True, name="closed-b"))
    assert [_get(p, CLOSED_RATE).status for p in closed] == [200, 200]  # the store answers: limits are shared
    assert [_store_up(p) for p in closed] == [1, 1]
    assert [_get(p, UNLIMITED, login=("carol", "carol-pw")).status for p in closed] == [200, 200]  # remembered
    marks = [(p.stderr_mark(), p.audit_mark()) for p in (*closed, *pair)]
    store.stop()
    try:
        for proxy, (stderr, audit) in zip(closed, marks):
            refused = _get(proxy, CLOSED_RATE)
            assert (refused.status, refused.sluice_reason, refused.headers.get("retry-after")) == (
                503, "state_store_unavailable", "5")
            assert "shared limit store is unreachable" in refused.text and "Retry after 5 s." in refused.text
            response, _ = _tunnel(proxy, CLOSED_TUNNELS)  # max_tunnels needs the store too
            assert (response.status, response.reason) == (503, "Sluice state_store_unavailable")
            assert socks5_connect(proxy.socks_address, "8.8.8.8", 80, atyp="ip", source=CLOSED_TUNNELS).reply == 2
            assert _get(proxy, UNLIMITED).status == 200  # no limit to check: passes
            # A password not yet checked here needs the shared throttle of wrong passwords: refused, unhashed;
            # one this process already accepted needs none.
            login = _get(proxy, UNLIMITED, login=("dave", "dave-pw"))
            assert (login.status, login.sluice_reason, login.headers.get("retry-after")) == (
                503, "state_store_unavailable", "5")
            assert "throttle of wrong passwords" in login.text
            assert _get(proxy, UNLIMITED, login=("carol", "carol-pw")).status == 200
            wait_until(lambda p=proxy, m=stderr: "refusing what needs a shared limit" in p.stderr_since(m),
                       timeout=10, what="the store-down line on stderr")
            lines = proxy.audit()[audit:]
            assert any(line["event"] == "state_store" and line["decision"] == "down" for line in lines)
            assert {line["event"] for line in lines if line.get("reason") == "state_store_unavailable"} == {
                "request", "connect"}  # the refusals' own lines (a refused CONNECT's is a request line too)
            assert _store_up(proxy) == 0
    finally:
        store.start()
    for proxy, (stderr, _) in zip((*closed, *pair), marks):
        wait_until(lambda p=proxy, m=stderr: "shared again" in p.stderr_since(m), timeout=15,
                   what="the store-back line on stderr")
    assert [_store_up(p) for p in closed] == [1, 1]
    # a new, empty store: one burst of 4 shared again
    assert [_get(p, CLOSED_RATE).status for p in (*closed, *closed, closed[0])] == [200, 200, 200, 200, 429]
