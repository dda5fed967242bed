"""Request-head attacks (issue 8): endless headers at speed, field floods,
slowloris heads, and a flood pipelined behind a pending response.

Regression (found by the issue 8 review): mitmproxy buffered an incomplete
request head without bound and without a time limit, so one endless header
grew the proxy's RSS by whatever the client sent, and a dribbling client kept
the idle timer from ever firing. Now every such head is cut (431
`request_headers_too_large`, 408 `header_timeout`, or a close mid-response),
the proxy's RSS stays flat while hundreds of MiB are thrown at it, its fds
come back, and it keeps serving. Every loop is bounded in bytes and steps.
"""

from __future__ import annotations

import select
import threading

import pytest

from harness import default_policy
from harness.clients import _Reader, open_socket, read_response
from relkit import FAULT_IP, FAULT_PORT, quiet_fds, rss_kib, scaled, settle_fds, wait_until

pytestmark = pytest.mark.netns

MIB = 1024 * 1024
FLOOD_LIMIT = 32 * MIB  # per connection: far over the 64 KiB cap, bounded
CHUNK = b"a" * 65536
CLIENTS = 8
ROUNDS = scaled(8, 32)
RSS_GROWTH_BOUND_KIB = 16 * 1024  # seen: under 2 MiB; without the cap one round alone buffers 8 x 32 MiB
FD_TOLERANCE = 10
HEADER_TIMEOUT = 2.0
HANG_NAME = "hang.heads.rel.example"


@pytest.fixture(scope="module")
def proxy(sluice_factory, fake_dns, fault_origin):
    fake_dns.set(HANG_NAME, a=[FAULT_IP], ttl=300)
    policy = default_policy(ports=[80, 443, FAULT_PORT])
    # Default size and count caps (64 KiB, 100 fields); a short head timeout
    # keeps the slowloris test short; a long request timeout keeps a
    # response pending while a client pipelines a flood behind it.
    policy["limits"] = {"header_timeout": f"{HEADER_TIMEOUT:g}s", "request_timeout": "30s"}
    return sluice_factory(policy, name="headflood")


def proxy_closed_or_answered(sock) -> bool:
    return bool(select.select([sock], [], [], 0)[0])


def flood(address, prefix: bytes, limit: int = FLOOD_LIMIT, sock=None) -> tuple[int, bytes]:
    """One connection (a new one, or `sock`): prefix, then 64 KiB chunks with
    no blank line until the proxy answers or closes, or `limit` bytes went
    out. Returns (bytes sent, what came back)."""
    sock = sock or open_socket(address, timeout=15)
    sent = 0
    try:
        sock.sendall(prefix)
        sent = len(prefix)
        while sent < limit and not proxy_closed_or_answered(sock):
            try:
                sock.sendall(CHUNK)
            except OSError:
                break
            sent += len(CHUNK)
        reader = _Reader(sock)
        try:
            return sent, reader.rest()
        except (ConnectionResetError, TimeoutError):
            return sent, reader.buf
    finally:
        sock.close()


def status_line(answer: bytes) -> bytes:
    return answer.split(b"\r\n", 1)[0]


def warm_up(proxy) -> None:
    for _ in range(20):
        sock = open_socket(proxy.address)
        sock.sendall(b"GET http://public.example/warm HTTP/1.1\r\nHost: public.example\r\nConnection: close\r\n\r\n")
        assert read_response(_Reader(sock)).status == 200
        sock.close()


def still_serving(proxy) -> None:
    sock = open_socket(proxy.address)
    sock.sendall(b"GET http://public.example/after HTTP/1.1\r\nHost: public.example\r\nConnection: close\r\n\r\n")
    assert read_response(_Reader(sock)).status == 200
    sock.close()
    assert proxy.alive()
    assert "Traceback" not in proxy.stderr_text()


def test_endless_headers_at_speed_are_cut_with_rss_flat(proxy):
    pid = proxy.proc.pid
    warm_up(proxy)
    fds_before = quiet_fds(pid)
    rss_before = rss_kib(pid)
    mark = proxy.audit_mark()
    results: list[tuple[int, bytes]] = []
    lock = threading.Lock()

    def attacker(n: int) -> None:
        for _ in range(ROUNDS):
            prefix = b"GET http://public.example/ HTTP/1.1\r\nHost: public.example\r\nX-Endless-%d: " % n
            outcome = flood(proxy.address, prefix)
            with lock:
                results.append(outcome)

    threads = [threading.Thread(target=attacker, args=(n,)) for n in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "an attacker is still running"
    rss_after = rss_kib(pid)

    assert len(results) == CLIENTS * ROUNDS
    refused = [answer for _, answer in results if status_line(answer).startswith(b"HTTP/1.1 431 ")]
    assert len(refused) == len(results), [status_line(a) for _, a in results
                                          if not status_line(a).startswith(b"HTTP/1.1 431 ")][:5]
    assert all(b"Sluice-Reason: request_headers_too_large" in a for a in refused)
    assert all(sent < FLOOD_LIMIT for sent, _ in results), "a connection was never cut"
    total = sum(sent for sent, _ in results)
    growth = rss_after - rss_before
    print(f"head flood: {len(results)} connections, {total / MIB:.0f} MiB sent, RSS {rss_before} -> {rss_after} KiB")
    assert growth < RSS_GROWTH_BOUND_KIB, f"RSS grew by {growth} KiB while {total / MIB:.0f} MiB of head were sent"
    lines = [e for e in proxy.audit()[mark:] if e["reason"] == "request_headers_too_large"]
    assert len(lines) == len(results) and all(e["status"] == 431 for e in lines)
    assert settle_fds(pid, fds_before + FD_TOLERANCE) <= fds_before + FD_TOLERANCE, "connections were not closed"
    still_serving(proxy)


def test_field_floods_are_cut(proxy):
    pid = proxy.proc.pid
    rss_before = rss_kib(pid)
    # Endless tiny fields: cut by size long before any blank line.
    sent, answer = flood(proxy.address, b"GET http://public.example/ HTTP/1.1\r\nHost: public.example\r\n",
                         limit=FLOOD_LIMIT)
    assert status_line(answer).startswith(b"HTTP/1.1 431 "), status_line(answer)
    assert sent < FLOOD_LIMIT
    # A complete head of 5,000 small fields (under the size cap): cut by count.
    for _ in range(scaled(20, 200)):
        sock = open_socket(proxy.address)
        sock.sendall(b"GET http://public.example/ HTTP/1.1\r\nHost: public.example\r\n" + b"X: a\r\n" * 5000 + b"\r\n")
        response = read_response(_Reader(sock))
        sock.close()
        assert response.status == 431 and response.sluice_reason == "request_headers_too_large"
        assert "limits.max_header_count" in response.text
    assert rss_kib(pid) - rss_before < RSS_GROWTH_BOUND_KIB
    still_serving(proxy)


def test_slowloris_heads_all_get_408(proxy):
    pid = proxy.proc.pid
    fds_before = quiet_fds(pid)
    mark = proxy.audit_mark()
    count = scaled(20, 100)
    steps_cap = int(HEADER_TIMEOUT / 0.2) * 10  # ten times the head timeout
    outcomes: list[tuple[int, bytes]] = []
    lock = threading.Lock()

    def slow(n: int) -> None:
        sock = open_socket(proxy.address, timeout=15)
        steps = 0
        try:
            sock.sendall(b"GET http://public.example/ HTTP/1.1\r\nHost: public.example\r\nX-Slow-%d: " % n)
            while steps < steps_cap and not select.select([sock], [], [], 0.2)[0]:
                try:
                    sock.sendall(b"a")
                except OSError:  # the proxy answered and closed as we sent: read its answer
                    break
                steps += 1
            reader = _Reader(sock)
            try:
                answer = reader.rest()
            except ConnectionResetError:
                answer = reader.buf
        finally:
            sock.close()
        with lock:
            outcomes.append((steps, answer))

    threads = [threading.Thread(target=slow, args=(n,)) for n in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(outcomes) == count
    wrong = [status_line(a) for _, a in outcomes if not status_line(a).startswith(b"HTTP/1.1 408 ")]
    assert not wrong, wrong[:5]
    assert all(0 < steps < steps_cap for steps, _ in outcomes)
    lines = [e for e in proxy.audit()[mark:] if e["reason"] == "header_timeout"]
    assert len(lines) == count and all(e["status"] == 408 for e in lines)
    assert settle_fds(pid, fds_before + FD_TOLERANCE) <= fds_before + FD_TOLERANCE
    still_serving(proxy)


def test_flood_pipelined_behind_a_pending_response_is_closed(proxy, fault_origin):
    fault_origin.reset_counts()  # /hang really hangs (until the proxy hangs up)
    pid = proxy.proc.pid
    rss_before = rss_kib(pid)
    mark = proxy.audit_mark()
    pending = b"GET http://%s:%d/hang HTTP/1.1\r\nHost: %s:%d\r\n\r\n" % (HANG_NAME.encode(), FAULT_PORT,
                                                                          HANG_NAME.encode(), FAULT_PORT)
    rounds = scaled(4, 16)
    for n in range(rounds):
        sock = open_socket(proxy.address, timeout=15)
        sock.sendall(pending)
        assert wait_until(lambda n=n: fault_origin.paths.count("/hang") == n + 1, 10), "the origin never got /hang"
        sent, answer = flood(proxy.address, b"GET http://public.example/ HTTP/1.1\r\nX: ", sock=sock)
        assert sent < FLOOD_LIMIT, "the pipelined flood was never cut"
        assert answer == b"", status_line(answer)  # nothing can be answered mid-response
    assert rss_kib(pid) - rss_before < RSS_GROWTH_BOUND_KIB
    lines = [e for e in proxy.audit()[mark:] if e["reason"] == "request_headers_too_large"]
    assert lines and all(e["status"] is None for e in lines)
    still_serving(proxy)
