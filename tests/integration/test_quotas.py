"""Quotas (policy `limits`) against the real proxy, with real clients: one
runaway agent hits its own limit and nobody else's.

One proxy holds a client profile per limit, each matched by its own
loopback source address (127.0.0.1 itself is the top level, with no
limits), plus two users sharing an address; a second proxy tests the
global `max_total_connections`.
"""

from __future__ import annotations

import base64
import re
import socket
import struct
import time

import pytest

from harness import default_policy
from harness.clients import _Reader, connect, read_response
from sluice.policy.loader import hash_password

pytestmark = pytest.mark.netns

PASSWORD = "quota-pw"
RATE, HOSTS, CONNS, BYTES_A, BYTES_B, TUNNELS, SOCKS_RATE, USERS = (
    "127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5", "127.0.0.6", "127.0.0.7", "127.0.0.8", "127.0.0.9")
UPLOADS = "127.0.0.10"
RATE_CONNECT = "127.0.0.13"  # its own bucket: no test depends on another's use of one (see --reverse)
QUOTA = 20 * 1024


def _profile(name: str, sources: list[str], **limits) -> dict:
    return {"name": name, "sources": [f"{s}/32" for s in sources], "limits": limits}


@pytest.fixture(scope="module")
def proxy(sluice_factory):
    verifier = hash_password(PASSWORD, iterations=10_000)
    policy = default_policy(clients=[
        _profile("rate", [RATE], requests_per_second=1, burst=2),
        _profile("rate-connect", [RATE_CONNECT], requests_per_second=1, burst=2),
        _profile("hosts", [HOSTS], max_requests_per_host_per_minute=2),
        _profile("conns", [CONNS], max_connections=2),
        _profile("transfer", [BYTES_A, BYTES_B], bytes_per_hour="20KiB"),
        _profile("tunnels", [TUNNELS], max_tunnels=1),
        _profile("uploads", [UPLOADS], bytes_per_hour="20KiB"),
        _profile("socks-rate", [SOCKS_RATE], requests_per_second=0.2, burst=1),
        {"name": "users", "users": {"alice": {"password_hash": verifier}, "bob": {"password_hash": verifier}},
         "limits": {"requests_per_second": 0.2, "burst": 1}},
    ])
    return sluice_factory(policy, socks=True, name="quotas")


def _connect(proxy, source: str) -> socket.socket:
    return socket.create_connection(proxy.address, timeout=15, source_address=(source, 0))


def _auth(user: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{PASSWORD}".encode()).decode()


def _get(proxy, source: str, url: str = "http://8.8.8.8/", *, user: str | None = None):
    host = url.split("/")[2]
    auth = f"Proxy-Authorization: {_auth(user)}\r\n" if user else ""
    with _connect(proxy, source) as s:
        s.sendall(f"GET {url} HTTP/1.1\r\nHost: {host}\r\n{auth}Connection: close\r\n\r\n".encode())
        return read_response(_Reader(s))


class KeepAlive:
    def __init__(self, proxy, source: str):
        self.sock = _connect(proxy, source)
        self.reader = _Reader(self.sock)

    def get(self, path: str):
        self.sock.sendall(f"GET http://8.8.8.8{path} HTTP/1.1\r\nHost: 8.8.8.8\r\n\r\n".encode())
        return read_response(self.reader)

    def close(self):
        self.sock.close()


def _connect_tunnel(proxy, source: str, authority: str = "8.8.8.8:80"):
    return connect(proxy.address, authority, source=source)


def _socks(proxy, source: str, host: str = "8.8.8.8", port: int = 80):
    """SOCKS5 CONNECT from `source` to an IPv4 address: (REP, socket or None)."""
    s = socket.create_connection(proxy.socks_address, timeout=15, source_address=(source, 0))
    reader = _Reader(s)
    s.sendall(b"\x05\x01\x00")
    assert reader.exactly(2) == b"\x05\x00"
    s.sendall(b"\x05\x01\x00\x01" + socket.inet_aton(host) + struct.pack("!H", port))
    head = reader.exactly(10)
    if len(head) < 2 or head[1] != 0:
        s.close()
        return (head[1] if len(head) >= 2 else None), None
    return 0, s


def _retry_after(response) -> int:
    value = response.headers.get("retry-after", "")
    assert value.isdigit(), response
    return int(value)


def test_over_the_rate_gets_429_with_an_honest_retry_after(proxy, net):
    mark = proxy.audit_mark()
    first = [_get(proxy, RATE, f"http://8.8.8.8/rate/{i}") for i in range(2)]
    assert [r.status for r in first] == [200, 200]
    over = _get(proxy, RATE, "http://8.8.8.8/rate/over")
    assert over.status == 429 and over.sluice_reason == "rate_limited", over
    wait = _retry_after(over)
    assert 1 <= wait <= 2
    assert "rate limit of 1 requests a second" in over.text and f"Retry after {wait} s" in over.text
    assert not any(r.path == "/rate/over" for r in net.origin("8.8.8.8", 80).requests)
    line = proxy.wait_audit(lambda e: e["reason"] == "rate_limited", since=mark)
    assert (line["decision"], line["status"], line["profile"], line["event"]) == ("refuse", 429, "rate", "request")

    # Another client (here the top level, from 127.0.0.1) is not affected.
    assert _get(proxy, "127.0.0.1", "http://8.8.8.8/rate/other").status == 200

    time.sleep(wait)
    again = _get(proxy, RATE, "http://8.8.8.8/rate/after-wait")
    assert again.status == 200, again


def test_a_connect_over_the_rate_gets_the_429_itself(proxy):
    statuses = []
    for _ in range(3):
        response, tunnel = _connect_tunnel(proxy, RATE_CONNECT)
        statuses.append((response.status, response.sluice_reason))
        if tunnel is not None:
            tunnel.close()
    assert statuses[:2] == [(200, None), (200, None)]
    assert statuses[2] == (429, "rate_limited")


def test_max_connections_refuses_the_extra_connection_not_the_others(proxy):
    mark = proxy.audit_mark()
    a, b = KeepAlive(proxy, CONNS), KeepAlive(proxy, CONNS)
    try:
        assert a.get("/conns/a1").status == 200
        assert b.get("/conns/b1").status == 200
        extra = KeepAlive(proxy, CONNS)
        try:
            refused = extra.get("/conns/extra")
            assert refused.status == 429 and refused.sluice_reason == "too_many_connections", refused
            assert refused.headers.get("connection", "").lower() == "close"
            assert "already has 2 connections open" in refused.text
            assert extra.sock.recv(1) == b""  # and closed
        finally:
            extra.close()
        # the first two keep working
        assert a.get("/conns/a2").status == 200
        assert b.get("/conns/b2").status == 200
        # another address is not counted with them
        assert _get(proxy, "127.0.0.1", "http://8.8.8.8/conns/other").status == 200
        line = proxy.wait_audit(lambda e: e["reason"] == "too_many_connections", since=mark)
        assert line["status"] == 429 and line["client"].startswith(CONNS)
    finally:
        a.close()
    # once one closes, a new connection is admitted (bounded wait for the close to be seen)
    deadline = time.monotonic() + 5
    while True:
        c = KeepAlive(proxy, CONNS)
        response = c.get("/conns/c1")
        c.close()
        if response.status == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    b.close()
    assert response.status == 200, response


def test_per_host_limits_apply_per_host(proxy):
    statuses = [_get(proxy, HOSTS, "http://8.8.8.8/h/1").status, _get(proxy, HOSTS, "http://8.8.8.8/h/2").status]
    assert statuses == [200, 200]
    over = _get(proxy, HOSTS, "http://8.8.8.8/h/3")
    assert over.status == 429 and over.sluice_reason == "host_rate_limited", over
    assert 1 <= _retry_after(over) <= 30  # one more every 30 s
    assert "2 requests a minute to 8.8.8.8" in over.text
    assert _get(proxy, HOSTS, "http://1.1.1.1/h/1").status == 200  # another host
    assert _get(proxy, "127.0.0.1", "http://8.8.8.8/h/4").status == 200  # another client


def test_per_host_limits_count_the_host_as_the_gate_canonicalised_it(proxy):
    """`public.example.`, `PUBLIC.example` and `public.example` are one host
    (the gate's canonical name), so one bucket: a trailing dot or another
    spelling is not a second per-host allowance."""
    spellings = ["public.example", "public.example.", "PUBLIC.Example."]
    answers = [_get(proxy, HOSTS, f"http://{host}/canonical/{i}") for i, host in enumerate(spellings)]
    assert [r.status for r in answers[:2]] == [200, 200], answers
    assert (answers[2].status, answers[2].sluice_reason) == (429, "host_rate_limited"), answers[2]
    assert "2 requests a minute to public.example;" in answers[2].text


def test_bytes_per_hour_counts_http_and_refuses_new_requests(proxy):
    mark = proxy.audit_mark()
    first = _get(proxy, BYTES_B, "http://8.8.8.8/bytes/15000")
    assert first.status == 200 and len(first.body) == 15000
    # 15,000 < 20 KiB: still admitted, but charged as it streams and cut
    # where the quota runs out (not completed past it).
    crossing = _get(proxy, BYTES_B, "http://8.8.8.8/bytes/10000")
    assert crossing.status == 200 and len(crossing.body) == QUOTA - 15000, len(crossing.body)
    line = proxy.wait_audit(lambda e: e.get("reason") == "quota_exceeded", since=mark)
    assert (line["event"], line["status"]) == ("request", 200) and "used up its hourly transfer quota" in line["detail"]
    over = _get(proxy, BYTES_B, "http://8.8.8.8/bytes/10")
    assert over.status == 429 and over.sluice_reason == "quota_exceeded", over
    assert 3500 <= _retry_after(over) <= 3600
    assert "used its hourly transfer quota of 20 KiB; it resets in 60 minutes" in over.text
    response, tunnel = _connect_tunnel(proxy, BYTES_B)
    assert (response.status, response.sluice_reason) == (429, "quota_exceeded")


def _post(proxy, path: str, body: bytes, *, chunked: bool = False):
    framing = "Transfer-Encoding: chunked" if chunked else f"Content-Length: {len(body)}"
    payload = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body) if chunked else body
    with _connect(proxy, UPLOADS) as s:
        s.sendall(f"POST http://8.8.8.8{path} HTTP/1.1\r\nHost: 8.8.8.8\r\n{framing}\r\nConnection: "
                  "close\r\n\r\n".encode())
        try:
            s.sendall(payload)
        except OSError:
            pass
        return read_response(_Reader(s))


def test_bytes_per_hour_counts_uploads_before_they_go_upstream(proxy, net):
    """A request body is charged before it leaves: one that does not fit in
    what is left is refused and never reaches the origin (it used to be
    sent whole and charged afterwards)."""
    origin = net.origin("8.8.8.8", 80)
    mark = proxy.audit_mark()
    assert _post(proxy, "/upload/1", b"u" * 15000).status == 200
    refused = _post(proxy, "/upload/2", b"u" * 10000)
    assert (refused.status, refused.sluice_reason) == (429, "quota_exceeded"), refused
    assert ("10000-byte body does not fit in what is left of this agent's hourly transfer quota of 20 KiB"
            in refused.text)
    left = int(re.search(r"\((\d+) bytes left\)", refused.text).group(1))
    assert QUOTA - 15000 - 100 < left < QUOTA - 15000  # the first upload and its response, not the refused body
    assert not any(r.path == "/upload/2" for r in origin.requests)
    line = proxy.wait_audit(lambda e: e.get("reason") == "quota_exceeded", since=mark)
    assert (line["event"], line["method"], line["status"]) == ("request", "POST", 429)
    # The refused body was not charged: what is left still goes, and uses the quota up.
    assert _post(proxy, "/upload/rest", b"u" * left).status == 200
    # Used up: a chunked upload is refused before it starts too.
    chunked = _post(proxy, "/upload/3", b"u" * 100, chunked=True)
    assert (chunked.status, chunked.sluice_reason) == (429, "quota_exceeded"), chunked
    assert not any(r.path == "/upload/3" for r in origin.requests)


def test_bytes_per_hour_cuts_an_open_tunnel(proxy):
    mark = proxy.audit_mark()
    response, tunnel = _connect_tunnel(proxy, BYTES_A)
    assert response.status == 200 and tunnel is not None
    request = b"GET /bytes/200000 HTTP/1.1\r\nHost: public.example\r\n\r\n"
    tunnel.sock.sendall(request)
    received = tunnel.reader.buf + tunnel.reader.rest()  # until the proxy closes it
    tunnel.close()
    assert 0 < len(received) and len(request) + len(received) <= QUOTA
    line = proxy.wait_audit(lambda e: e["event"] == "tunnel" and e["reason"] == "quota_exceeded", since=mark)
    assert line["decision"] == "refuse" and line["bytes_out"] + line["bytes_in"] == QUOTA
    assert "used up its hourly transfer quota of 20 KiB" in line["detail"]
    # new requests from that client are refused; another client's are not
    assert _get(proxy, BYTES_A, "http://8.8.8.8/after").sluice_reason == "quota_exceeded"
    assert _get(proxy, "127.0.0.1", "http://8.8.8.8/bytes/30000").status == 200


def test_max_tunnels(proxy):
    response, first = _connect_tunnel(proxy, TUNNELS)
    assert response.status == 200
    try:
        response, second = _connect_tunnel(proxy, TUNNELS)
        assert (response.status, response.sluice_reason) == (429, "too_many_tunnels"), response
        assert "already has 1 tunnels open" in response.text
        rep, sock = _socks(proxy, TUNNELS)
        assert rep == 2 and sock is None  # SOCKS5 tunnels count too
        other, tunnel = _connect_tunnel(proxy, "127.0.0.1")
        assert other.status == 200
        tunnel.close()
    finally:
        first.close()
    deadline = time.monotonic() + 5
    while True:
        response, tunnel = _connect_tunnel(proxy, TUNNELS)
        if tunnel is not None:
            tunnel.close()
        if response.status == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert response.status == 200, response


def test_socks5_gets_its_refusal_reply(proxy):
    mark = proxy.audit_mark()
    rep, sock = _socks(proxy, SOCKS_RATE)
    assert rep == 0
    sock.sendall(b"GET /socks HTTP/1.1\r\nHost: 8.8.8.8\r\nConnection: close\r\n\r\n")
    assert read_response(_Reader(sock)).status == 200
    sock.close()
    rep, sock = _socks(proxy, SOCKS_RATE)
    assert rep == 2 and sock is None  # "connection not allowed by ruleset"
    line = proxy.wait_audit(lambda e: e["reason"] == "rate_limited", since=mark)
    assert (line["event"], line["decision"], line["profile"], line["host"]) == \
        ("connect", "refuse", "socks-rate", "8.8.8.8")
    assert "rate limit of 0.2 requests a second" in line["detail"]


def test_users_sharing_an_address_are_counted_apart(proxy):
    assert _get(proxy, USERS, user="alice").status == 200
    over = _get(proxy, USERS, user="alice")
    assert (over.status, over.sluice_reason) == (429, "rate_limited")
    assert 1 <= _retry_after(over) <= 5
    assert _get(proxy, USERS, user="bob").status == 200  # same address, another user


def test_max_total_connections_closes_at_accept(sluice_factory):
    proxy = sluice_factory(default_policy(limits={"max_total_connections": 2}), name="quotas-total")
    # From two sources: one source may hold all slots but a reserve (here 1 of 2).
    held = [KeepAlive(proxy, source) for source in ("127.0.0.1", "127.0.0.10")]
    try:
        assert [k.get(f"/total/{i}").status for i, k in enumerate(held)] == [200, 200]
        mark = proxy.audit_mark()
        extra = socket.create_connection(proxy.address, timeout=15)
        try:
            extra.sendall(b"GET http://8.8.8.8/total/x HTTP/1.1\r\nHost: 8.8.8.8\r\n\r\n")
            try:
                data = extra.recv(100)
            except ConnectionResetError:
                data = b""
            assert data == b""  # closed before any answer
        finally:
            extra.close()
        line = proxy.wait_audit(lambda e: e["reason"] == "too_many_connections", since=mark)
        assert (line["event"], line["decision"]) == ("connection", "refuse")
        assert "max_total_connections" in line["detail"]
        assert held[0].get("/total/again").status == 200  # the others are untouched
    finally:
        for k in held:
            k.close()
    deadline = time.monotonic() + 5
    while True:
        response = _get(proxy, "127.0.0.1", "http://8.8.8.8/total/after")
        if response.status == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert response.status == 200


# ---- transparent mode (an agent namespace redirected by nftables, as in test_transparent.py)


def test_transparent_connections_over_the_rate_are_closed(netns, fake_dns, net, tmp_path_factory, sluice_home):
    from harness.agentns import AgentNamespace, missing_tools, nft, redirect_to_sluice, transparent_gateway

    missing = missing_tools("nft", "curl")
    if missing:
        pytest.skip(f"transparent mode needs {', '.join(missing)}; untested without it")
    with AgentNamespace("tq", "10.199.3") as agent:
        proc = transparent_gateway(agent, tmp_path_factory.mktemp("quota-transparent"),
                                   default_policy(limits={"requests_per_second": 0.2, "burst": 1}),
                                   name="quota-transparent", home=sluice_home)
        proc.start()
        loaded = redirect_to_sluice(agent, proc.port, "sluice_quota_transparent")
        try:
            assert loaded.returncode == 0, loaded.stderr

            def agent_curl(path: str) -> str:
                out = agent.run(["curl", "-q", "-sS", "--noproxy", "*", "--max-time", "10", "-o", "/dev/null",
                                 "-w", "%{http_code}\n", f"http://8.8.8.8{path}"], env={"PATH": "/usr/bin:/bin"})
                return out.stdout.strip()

            mark = proc.audit_mark()
            assert agent_curl("/tq/1") == "200"
            assert agent_curl("/tq/2") == "000"  # closed: no proxy to answer as
            entry = proc.wait_audit(lambda e: e.get("reason") == "rate_limited", since=mark)
            assert (entry["event"], entry["decision"], entry["host"]) == ("connect", "refuse", "8.8.8.8")
            assert entry["client"].startswith(agent.inner_ip)
            assert not any(r.path == "/tq/2" for r in net.origin("8.8.8.8", 80).requests)
        finally:
            nft("delete", "table", "inet", "sluice_quota_transparent")
            proc.stop()


def test_one_source_holds_max_total_connections_less_a_reserve(sluice_factory):
    """max_total_connections 40: the reserve is 16 (max(16, 5%)), so one
    source holds at most 24 and another source still connects."""
    proxy = sluice_factory(default_policy(limits={"max_total_connections": 40}), name="quotas-share")
    mark = proxy.audit_mark()
    held = [KeepAlive(proxy, "127.0.0.11") for _ in range(24)]
    try:
        assert held[-1].get("/share/24th").status == 200
        extra = KeepAlive(proxy, "127.0.0.11")
        try:
            extra.sock.sendall(b"GET http://8.8.8.8/share/x HTTP/1.1\r\nHost: 8.8.8.8\r\n\r\n")
            try:
                data = extra.sock.recv(100)
            except ConnectionResetError:
                data = b""
            assert data == b""  # closed at accept
        finally:
            extra.close()
        line = proxy.wait_audit(lambda e: e["reason"] == "too_many_connections", since=mark)
        assert line["event"] == "connection" and "kept for other sources" in line["detail"], line
        other = KeepAlive(proxy, "127.0.0.12")
        assert other.get("/share/other").status == 200
        other.close()
    finally:
        for k in held:
            k.close()
