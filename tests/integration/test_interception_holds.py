"""Interception that holds (issue 9): attacks inside intercepted tunnels.

One origin (tests/harness/vhosts.py) serves two virtual hosts on one address,
1.1.1.1: `a.example` (allowed and intercepted) and `b.example` (refused by the
policy, and the origin's default virtual host, as nginx's `default_server`).
It routes by an absolute-form target's authority, else by Host, like RFC 9112
origins, skips leading empty lines like nginx, and records every request, so
each test can assert that b.example never received anything, that no refused
method arrived, and which headers did.

The attacks: inside an intercepted TLS CONNECT tunnel (8443), an intercepted
plaintext CONNECT tunnel (8081), and SOCKS5 to the intercepted host (TLS and
plaintext), a client
- sends first bytes that do not look like HTTP (leading CRLFs, the first one
  or two bytes alone, garbage) before a request naming b.example or a refused
  method: mitmproxy used to fall back to raw TCP and nothing applied;
- names another virtual host in an absolute-form target, or the tunnel's own
  host (which must reach the origin in origin-form);
- keeps a tunnel open across a reload that refuses the method or the tunnel;
- sends Proxy-Authorization, in every mode.
Bugs this module found (a leading CRLF left the request unparsed, requests
without Host reached the default virtual host, cap refusals inside TLS were
unreadable, reloads missed CONNECT-method and WebSocket tunnels) are fixed;
their tests stay as regressions.
"""

from __future__ import annotations

import json
import os
import socket
import ssl
from pathlib import Path

import httpx
import pytest
import yaml

from harness import curl, default_policy, http_request
from harness.vhosts import (
    A, B, C, MODES, ORIGIN_IP, PLAIN_PORT, TLS_PORT, VhostOrigin, exchange, mode_port, mode_scheme, open_tunnel,
    start_vhost_origin,
)

pytestmark = pytest.mark.netns

COOKIE = "session=agent-secret"
PROXY_AUTH = "Basic c2x1aWNlOnByb3h5LXNlY3JldA=="  # sluice:proxy-secret
REFUSAL_STATUSES = {400, 403, 408, 413, 431}
FAST_POLL = ("--set", "sluice_policy_poll=0.2")


# ------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def origin(net, tls_ca, fake_dns):
    server = start_vhost_origin(tls_ca, fake_dns)
    yield server
    server.stop()


@pytest.fixture(autouse=True)
def fresh(origin):
    origin.reset()
    yield


def policy(**overrides) -> dict:
    p = default_policy(ports=[80, 443, PLAIN_PORT, TLS_PORT])
    p.update({
        "allow": [A],
        "intercept": [A],
        "methods": ["GET", "HEAD"],
        "strip_request_headers": ["Cookie"],
        "limits": {"max_request_bytes": "1KiB", "tunnel_max_bytes": "256KiB", "request_timeout": "5s"},
    })
    p.update(overrides)
    return p


def upstream_trust(tls_ca) -> tuple[str, ...]:
    return ("--set", f"ssl_verify_upstream_trusted_ca={tls_ca.cafile}")


@pytest.fixture(scope="module")
def proxy(sluice_factory, origin, tls_ca):
    return sluice_factory(policy(), socks=True, name="holds", extra_args=upstream_trust(tls_ca))


@pytest.fixture(scope="module")
def sluice_ca(proxy, sluice_home) -> str:
    return str(Path(sluice_home) / ".sluice" / "ca" / "mitmproxy-ca-cert.pem")


# ------------------------------------------------------------------ checks


def request(method: str, target: str, host: str | None, extra: str = "") -> bytes:
    head = f"{method} {target} HTTP/1.1\r\n"
    if host is not None:
        head += f"Host: {host}\r\n"
    head += f"Cookie: {COOKIE}\r\nProxy-Authorization: {PROXY_AUTH}\r\n{extra}\r\n"
    return head.encode()


def assert_origin_clean(origin: VhostOrigin) -> None:
    """b.example saw nothing, no refused method arrived, and neither the
    Cookie nor the proxy credentials reached the origin."""
    seen = origin.seen()
    assert not origin.seen(B), f"b.example received requests: {origin.seen(B)}"
    assert all(s.method in ("GET", "HEAD") for s in seen), f"a refused method reached the origin: {seen}"
    for s in seen:
        assert "cookie" not in s.headers, f"the Cookie reached the origin: {s}"
        assert "proxy-authorization" not in s.headers, f"Proxy-Authorization reached the origin: {s}"


def assert_refused(outcome, reasons: set[str]) -> None:
    """An HTTP refusal (403 with one of `reasons`, or a 4xx from the parser)
    or a closed connection; never the origin's answer."""
    assert not outcome.from_origin, f"the origin answered: {outcome}"
    assert outcome.kind in ("response", "closed"), f"neither a refusal nor a close: {outcome}"
    if outcome.kind == "response":
        assert outcome.status in REFUSAL_STATUSES, outcome
        if outcome.status == 403:
            assert outcome.response.sluice_reason in reasons, outcome


def wait_refusal_line(proxy, mark: int, reasons: set[str]) -> dict:
    line = proxy.wait_audit(
        lambda e: e["event"] == "request" and e["decision"] == "refuse" and e["reason"] in reasons,
        since=mark, what=f"a refusal line with a reason in {sorted(reasons)}",
    )
    assert line["host"] == A, line
    return line


def assert_no_ip_allow_lines(proxy, mark: int) -> None:
    """The raw-fallback signature: an allow line naming the IP as its host."""
    for e in proxy.audit()[mark:]:
        assert not (e["decision"] == "allow" and e["host"] == ORIGIN_IP), e


def settle(proxy, mark: int) -> None:
    """Wait for the tunnel line of a closed tunnel (its final audit line)."""
    proxy.wait_audit(lambda e: e["event"] == "tunnel", since=mark, what="the tunnel's line")


# ------------------------------------------------------------------ 1. first bytes that are not HTTP

ATTACKS = {
    # request bytes, the reasons a refusal may carry
    "other-vhost": (request("GET", "/x", B), {"host_mismatch"}),
    "refused-method": (request("DELETE", "/admin", A), {"method_not_allowed"}),
}

# Each variant: how the request's bytes go on the wire (a list of writes,
# with a pause between them).
VARIANTS = {
    "one-byte-then-rest": lambda req: [req[:1], req[1:]],
    "two-bytes-then-rest": lambda req: [req[:2], req[2:]],
    "crlf-alone-then-request": lambda req: [b"\r\n", req],
    # A leading CRLF in the same write as the request (mitmproxy alone sat on
    # the request until more bytes came, one read per empty line; see
    # test_a_leading_crlf_request_is_answered_without_more_bytes), also
    # followed by as many later empty lines.
    "leading-crlf-then-nudge": lambda req: [b"\r\n" + req, b"\r\n"],
    "double-crlf-then-nudge": lambda req: [b"\r\n\r\n" + req, b"\r\n", b"\r\n"],
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("attack", list(ATTACKS))
def test_odd_first_bytes_never_fall_back_to_raw(proxy, origin, sluice_ca, mode, variant, attack):
    raw, reasons = ATTACKS[attack]
    mark = proxy.audit_mark()
    outcome = exchange(open_tunnel(proxy, mode, sluice_ca), VARIANTS[variant](raw))
    assert outcome.kind == "response" and outcome.status == 403, outcome  # parsed as HTTP and refused
    assert_refused(outcome, reasons)
    wait_refusal_line(proxy, mark, reasons)
    settle(proxy, mark)
    assert origin.seen() == []
    assert_origin_clean(origin)
    assert_no_ip_allow_lines(proxy, mark)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("variant", ["one-byte-then-rest", "two-bytes-then-rest", "leading-crlf-then-nudge"])
def test_allowed_request_after_odd_first_bytes_is_still_filtered(proxy, origin, sluice_ca, mode, variant):
    """The same odd first bytes before an allowed request: it passes, as HTTP,
    with Cookie and Proxy-Authorization stripped and the host's name audited."""
    mark = proxy.audit_mark()
    outcome = exchange(open_tunnel(proxy, mode, sluice_ca), VARIANTS[variant](request("GET", "/ok", A)))
    assert outcome.kind == "response" and outcome.status == 200 and outcome.from_origin, outcome
    assert json.loads(outcome.response.body)["vhost"] == A
    [seen] = origin.seen()
    assert (seen.vhost, seen.method, seen.target) == (A, "GET", "/ok")
    assert_origin_clean(origin)
    line = proxy.wait_audit(lambda e: e["event"] == "request" and e["decision"] == "allow", since=mark)
    assert line["host"] == A and line["status"] == 200
    settle(proxy, mark)
    assert_no_ip_allow_lines(proxy, mark)


GARBAGE = {
    "binary": b"\x00\xff\x13\x37 not http\r\n",
    "word": b"HELLO\r\n",
    "space": b" ",
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("garbage", list(GARBAGE))
@pytest.mark.parametrize("attack", list(ATTACKS))
def test_garbage_before_a_request_is_refused_not_carried_raw(proxy, origin, sluice_ca, mode, garbage, attack):
    raw, reasons = ATTACKS[attack]
    mark = proxy.audit_mark()
    outcome = exchange(open_tunnel(proxy, mode, sluice_ca), [GARBAGE[garbage] + raw])
    assert_refused(outcome, reasons)
    settle(proxy, mark)
    assert origin.seen() == []
    assert_origin_clean(origin)
    assert_no_ip_allow_lines(proxy, mark)
    tunnel = [e for e in proxy.audit()[mark:] if e["event"] == "tunnel"]
    assert tunnel and all(e["host"] == A for e in tunnel), tunnel


@pytest.mark.parametrize("mode", MODES)
def test_garbage_inside_an_intercepted_tunnel_is_audited_with_a_reason(proxy, origin, sluice_ca, mode):
    mark = proxy.audit_mark()
    outcome = exchange(open_tunnel(proxy, mode, sluice_ca), [GARBAGE["binary"] + ATTACKS["other-vhost"][0]])
    assert_refused(outcome, set())
    settle(proxy, mark)
    assert origin.seen() == []
    line = proxy.wait_audit(lambda e: e["reason"] == "not_http", since=mark, what="a not_http line")
    # (The line is written where mitmproxy's parser gave up, which knows no
    # tunnel: it may not name the host, but never the IP.)
    assert line["decision"] == "refuse" and line["status"] == 400 and line["host"] in (None, A), line
    assert_no_ip_allow_lines(proxy, mark)


def test_a_leading_crlf_request_is_answered_without_more_bytes(proxy, origin, sluice_ca):
    # Both tunnels at once: one wait bounds the whole test.
    socks = [open_tunnel(proxy, mode, sluice_ca, timeout=4) for mode in ("connect-tls", "connect-plain")]
    for s in socks:
        s.sendall(b"\r\n" + ATTACKS["refused-method"][0])
    outcomes = [exchange(s, []) for s in socks]
    assert origin.seen() == []
    for outcome in outcomes:  # parsed and refused by the policy (not a 408 at the header timeout)
        assert outcome.status == 403 and outcome.response.sluice_reason == "method_not_allowed", outcome


# ------------------------------------------------------------------ 2. absolute-form inside the tunnel


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("host_header", [A, None, B], ids=["host-a", "no-host", "host-b"])
def test_absolute_form_naming_another_vhost_is_refused(proxy, origin, sluice_ca, mode, host_header):
    mark = proxy.audit_mark()
    target = f"{mode_scheme(mode)}://{B}/x"
    outcome = exchange(open_tunnel(proxy, mode, sluice_ca), [request("GET", target, host_header)])
    assert outcome.kind == "response" and outcome.status == 403, outcome
    assert outcome.response.sluice_reason == "host_mismatch"
    line = wait_refusal_line(proxy, mark, {"host_mismatch"})
    assert B in line["detail"]
    assert origin.seen() == []


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("authority", [A, f"{A}:{TLS_PORT}", f"{A}:22", "A.EXAMPLE."],
                         ids=["name", "name-port", "name-other-port", "spelling"])
def test_absolute_form_naming_the_tunnels_host_reaches_it_in_origin_form(proxy, origin, sluice_ca, mode, authority):
    target = f"{mode_scheme(mode)}://{authority}/x?q=1"
    outcome = exchange(open_tunnel(proxy, mode, sluice_ca), [request("GET", target, A)])
    assert outcome.kind == "response" and outcome.status == 200 and outcome.from_origin, outcome
    [seen] = origin.seen()
    assert seen.target == "/x?q=1" and seen.vhost == A, seen
    assert seen.port == mode_port(mode), seen  # the tunnel's own port, whatever the target said
    assert_origin_clean(origin)


@pytest.mark.parametrize("mode", MODES)
def test_other_vhost_by_host_header_or_sni_is_refused(proxy, origin, sluice_ca, mode):
    outcome = exchange(open_tunnel(proxy, mode, sluice_ca), [request("GET", "/x", f"{B}:{mode_port(mode)}")])
    assert outcome.status == 403 and outcome.response.sluice_reason == "host_mismatch", outcome
    if mode.endswith("-tls"):
        sock = open_tunnel(proxy, mode, sluice_ca, sni=B)  # TLS naming b.example inside a.example's tunnel
        outcome = exchange(sock, [request("GET", "/x", A)])
        assert_refused(outcome, {"host_mismatch"})
        assert B not in origin.tls_server_names, origin.tls_server_names  # upstream TLS names the tunnel's host
    assert origin.seen() == []


@pytest.mark.parametrize("mode", ["connect-tls", "socks-plain"])
@pytest.mark.parametrize("raw", [
    request("GET", "/x", f"{A}\r\nHost: {B}"),              # two Host fields
    request("GET", "/x", f"{A}\r\n {B}"),                   # a folded Host
    request("GET", "/x", f"{A}@{B}"),                       # userinfo in Host
    f"CONNECT {B}:{TLS_PORT} HTTP/1.1\r\nHost: {B}:{TLS_PORT}\r\n\r\n".encode(),  # a tunnel in the tunnel
], ids=["two-hosts", "folded-host", "userinfo-host", "nested-connect"])
def test_other_ways_to_name_another_vhost_are_refused(proxy, origin, sluice_ca, mode, raw):
    outcome = exchange(open_tunnel(proxy, mode, sluice_ca), [raw])
    assert_refused(outcome, {"host_mismatch", "method_not_allowed"})
    assert origin.seen() == []


NO_HOST = {
    "http10-no-host": b"GET /x HTTP/1.0\r\n\r\n",
    "http11-no-host": b"GET /x HTTP/1.1\r\n\r\n",
    "empty-host": b"GET /x HTTP/1.1\r\nHost:\r\n\r\n",
    "absolute-own-host-no-host": None,  # filled per mode below
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", list(NO_HOST))
def test_a_request_naming_no_host_never_reaches_another_vhost(proxy, origin, sluice_ca, mode, case):
    raw = NO_HOST[case] or f"GET {mode_scheme(mode)}://{A}/x HTTP/1.1\r\n\r\n".encode()
    outcome = exchange(open_tunnel(proxy, mode, sluice_ca), [raw])
    assert not origin.seen(B), f"b.example answered a request sent into {A}'s tunnel: {origin.seen(B)} {outcome}"
    for seen in origin.seen():
        assert seen.vhost == A and seen.headers.get("host", "").lower().startswith(A), seen


# ------------------------------------------------------------------ caps inside intercepted tunnels


@pytest.mark.parametrize("mode", MODES)
def test_tunnel_byte_cap_holds_inside_intercepted_tunnels(proxy, origin, sluice_ca, mode):
    mark = proxy.audit_mark()
    sock = open_tunnel(proxy, mode, sluice_ca)
    outcome = exchange(sock, [request("GET", "/bytes/600000", A)])
    received = len(outcome.response.body) if outcome.response is not None else 0
    assert received <= 256 * 1024, outcome.kind  # never the whole 600,000 bytes
    line = proxy.wait_audit(lambda e: e["event"] == "tunnel" and e["reason"] == "tunnel_too_large", since=mark)
    assert line["host"] == A and line["decision"] == "refuse"


@pytest.mark.parametrize("mode", MODES)
def test_request_body_cap_holds_inside_intercepted_tunnels(proxy, origin, sluice_ca, mode):
    mark = proxy.audit_mark()
    raw = request("GET", "/upload", A, extra="Content-Length: 4000\r\n") + b"z" * 4000
    outcome = exchange(open_tunnel(proxy, mode, sluice_ca), [raw[:3], raw[3:]])
    assert not outcome.from_origin and outcome.kind != "timeout", outcome
    wait_refusal_line(proxy, mark, {"request_too_large"})
    assert origin.seen() == []


@pytest.mark.parametrize("mode", ["connect-tls", "socks-tls"])
def test_a_cap_refusal_inside_an_intercepted_tls_tunnel_is_readable(proxy, origin, sluice_ca, mode):
    raw = request("GET", "/upload", A, extra="Content-Length: 4000\r\n") + b"z" * 4000
    outcome = exchange(open_tunnel(proxy, mode, sluice_ca), [raw])
    assert origin.seen() == []
    assert outcome.kind == "response" and outcome.status == 413, outcome
    assert outcome.response.sluice_reason == "request_too_large"


# ------------------------------------------------------------------ 3. reloads reach open tunnels


def write_policy(path: Path, new: dict) -> None:
    """Write like an editor: to a temp file, then rename over the original."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(yaml.safe_dump(new, sort_keys=False))
    os.replace(tmp, path)


def reload_to(proxy, new: dict) -> None:
    mark = proxy.audit_mark()
    write_policy(proxy.policy_file, new)
    proxy.wait_audit(lambda e: e["event"] == "reload" and e["decision"] == "ok", since=mark, what="the reload line")


@pytest.fixture
def reloading(sluice_factory, origin, tls_ca):
    """A proxy of its own (its policy is rewritten): a.example intercepted,
    every method allowed, c.example allowed and not intercepted."""
    first = policy(allow=[A, C], methods=["GET", "HEAD", "DELETE", "CONNECT"])
    proxy = sluice_factory(first, socks=True, name="reloading", extra_args=(*FAST_POLL, *upstream_trust(tls_ca)))
    yield proxy
    proxy.stop()


@pytest.mark.parametrize("mode", ["connect-tls", "socks-plain"])
def test_a_reload_applies_to_requests_in_an_open_intercepted_tunnel(reloading, origin, sluice_home, mode):
    ca = str(Path(sluice_home) / ".sluice" / "ca" / "mitmproxy-ca-cert.pem")
    sock = open_tunnel(reloading, mode, ca)
    before = exchange(sock, [request("DELETE", "/first", A)], method="DELETE", close=False)
    assert before.status == 200 and before.from_origin, before
    assert [s.method for s in origin.seen()] == ["DELETE"]

    reload_to(reloading, policy(allow=[A, C], methods=["GET", "HEAD", "CONNECT"]))
    mark = reloading.audit_mark()
    after = exchange(sock, [request("DELETE", "/second", A)], method="DELETE", close=False)
    assert after.status == 403 and after.response.sluice_reason == "method_not_allowed", after
    wait_refusal_line(reloading, mark, {"method_not_allowed"})
    still = exchange(sock, [request("GET", "/third", A)])  # the tunnel itself is still allowed
    assert still.status == 200 and still.from_origin, still
    assert [(s.method, s.target) for s in origin.seen()] == [("DELETE", "/first"), ("GET", "/third")]


@pytest.mark.parametrize("how", ["connect", "socks"])
def test_a_reload_that_refuses_an_open_plain_tunnel_closes_it(reloading, origin, how):
    from harness import connect, socks5_connect

    if how == "connect":
        response, tunnel = connect(reloading.address, f"{C}:{PLAIN_PORT}")
        assert response.status == 200, response
    else:
        result = socks5_connect(reloading.socks_address, C, PLAIN_PORT)
        assert result.ok, result
        tunnel = result.tunnel
    sock = tunnel.sock
    sock.settimeout(5)
    first = exchange(sock, [b"GET /before HTTP/1.1\r\nHost: c.example\r\n\r\n"], close=False)
    assert first.status == 200 and first.from_origin, first  # a raw tunnel: the origin answers

    mark = reloading.audit_mark()
    write_policy(reloading.policy_file, policy(allow=[A], methods=["GET", "HEAD", "CONNECT"]))
    line = reloading.wait_audit(lambda e: e["reason"] == "tunnel_revoked", since=mark, what="a tunnel_revoked line")
    assert line["event"] == "tunnel" and line["decision"] == "refuse" and line["host"] == C, line
    assert "host_not_allowed" in line["detail"]
    after = exchange(sock, [b"GET /after HTTP/1.1\r\nHost: c.example\r\n\r\n"])
    assert after.kind == "closed", after
    assert [s.target for s in origin.seen()] == ["/before"]


def test_a_reload_that_refuses_connect_closes_open_connect_tunnels(reloading, origin):
    from harness import connect

    response, tunnel = connect(reloading.address, f"{C}:{PLAIN_PORT}")
    assert response.status == 200, response
    sock = tunnel.sock
    sock.settimeout(5)
    first = exchange(sock, [b"GET /before HTTP/1.1\r\nHost: c.example\r\n\r\n"], close=False)
    assert first.status == 200 and first.from_origin, first
    reload_to(reloading, policy(allow=[A, C], methods=["GET", "HEAD"]))
    refused, _ = connect(reloading.address, f"{C}:{PLAIN_PORT}")
    assert refused.status == 403 and refused.sluice_reason == "method_not_allowed", refused  # a new one is refused
    after = exchange(sock, [b"GET /after HTTP/1.1\r\nHost: c.example\r\n\r\n"])
    assert [s.target for s in origin.seen()] == ["/before"], f"the open tunnel still reaches {C}: {after}"


def test_a_reload_that_denies_the_intercepted_host_stops_its_open_tunnel(reloading, origin, sluice_home):
    ca = str(Path(sluice_home) / ".sluice" / "ca" / "mitmproxy-ca-cert.pem")
    sock = open_tunnel(reloading, "connect-plain", ca)
    first = exchange(sock, [request("GET", "/before", A)], close=False)
    assert first.status == 200, first
    mark = reloading.audit_mark()
    reload_to(reloading, policy(allow=[C], methods=["GET", "HEAD", "CONNECT"]))
    line = reloading.wait_audit(lambda e: e["reason"] == "tunnel_revoked", since=mark, what="a tunnel_revoked line")
    assert line["event"] == "tunnel" and line["host"] == A and "host_not_allowed" in line["detail"], line
    after = exchange(sock, [request("GET", "/after", A)])
    assert after.kind == "closed", after
    assert [s.target for s in origin.seen()] == ["/before"]


def upgrade_to_websocket(sock: socket.socket, target: str, host: str) -> None:
    sock.sendall((f"GET {target} HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                  "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n").encode())
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(1)
        assert chunk, f"closed before the 101: {head!r}"
        head += chunk
    assert head.startswith(b"HTTP/1.1 101 "), head
    sock.sendall(b"ping-before")
    assert sock.recv(100) == b"ping-before"  # the origin echoes


def pipe_after_reload(sock: socket.socket) -> bytes:
    """Send on a WebSocket pipe after the reload; what came back (b"" once closed)."""
    try:
        sock.sendall(b"ping-after")
        return sock.recv(100)
    except OSError:
        return b""


def test_a_reload_that_refuses_an_open_websocket_closes_it(reloading, origin):
    sock = socket.create_connection(reloading.address, timeout=5)
    upgrade_to_websocket(sock, f"http://{A}:{PLAIN_PORT}/ws", f"{A}:{PLAIN_PORT}")
    mark = reloading.audit_mark()
    reload_to(reloading, policy(allow=[C], methods=["GET", "HEAD", "CONNECT"]))
    echoed = pipe_after_reload(sock)
    sock.close()
    assert origin.websocket_bytes == len(b"ping-before"), f"bytes reached {A} after the reload refused it"
    assert echoed == b""
    reloading.wait_audit(lambda e: e["reason"] == "tunnel_revoked", since=mark, what="a tunnel_revoked line")


def test_a_reload_that_refuses_a_websocket_inside_an_intercepted_tunnel_closes_it(reloading, origin, sluice_home):
    ca = str(Path(sluice_home) / ".sluice" / "ca" / "mitmproxy-ca-cert.pem")
    sock = open_tunnel(reloading, "connect-plain", ca)
    upgrade_to_websocket(sock, "/ws", A)
    mark = reloading.audit_mark()
    reload_to(reloading, policy(allow=[C], methods=["GET", "HEAD", "CONNECT"]))
    reloading.wait_audit(lambda e: e["reason"] == "tunnel_revoked", since=mark, what="a tunnel_revoked line")
    echoed = pipe_after_reload(sock)
    sock.close()
    assert echoed == b""
    assert origin.websocket_bytes == len(b"ping-before"), f"bytes reached {A} after the reload refused it"


@pytest.fixture(scope="module")
def timed(sluice_factory, origin, tls_ca):
    limits = {"tunnel_max_seconds": "1s", "request_timeout": "5s"}
    return sluice_factory(policy(limits=limits), socks=True, name="timed", extra_args=upstream_trust(tls_ca))


@pytest.mark.parametrize("mode", ["connect-tls", "socks-plain"])
def test_tunnel_time_cap_holds_inside_intercepted_tunnels(timed, origin, sluice_home, mode):
    ca = str(Path(sluice_home) / ".sluice" / "ca" / "mitmproxy-ca-cert.pem")
    mark = timed.audit_mark()
    sock = open_tunnel(timed, mode, ca)
    first = exchange(sock, [request("GET", "/first", A)], close=False)
    assert first.status == 200, first
    line = timed.wait_audit(lambda e: e["reason"] == "tunnel_timeout", since=mark, what="a tunnel_timeout line")
    assert line["event"] == "tunnel" and line["host"] == A, line
    after = exchange(sock, [request("GET", "/after", A)])
    assert after.kind == "closed", after
    assert [s.target for s in origin.seen()] == ["/first"]


# ------------------------------------------------------------------ 4. Proxy-Authorization never reaches an origin


def only_seen(origin) -> dict[str, str]:
    [seen] = origin.seen()
    assert seen.vhost == A, seen
    return seen.headers


def assert_no_proxy_credentials(headers: dict[str, str]) -> None:
    assert "proxy-authorization" not in headers, headers
    assert "proxy-secret" not in json.dumps(headers) and "c2x1aWNl" not in json.dumps(headers), headers


PA_TWICE = f"Proxy-Authorization: {PROXY_AUTH}\r\nproxy-authorization: Basic dHdvOnR3bw==\r\n"


def test_proxy_authorization_is_dropped_from_absolute_form(proxy, origin):
    raw = (f"GET http://{A}:{PLAIN_PORT}/pa HTTP/1.1\r\nHost: {A}:{PLAIN_PORT}\r\n{PA_TWICE}"
           "Connection: close\r\n\r\n").encode()
    r = http_request(proxy.address, raw)
    assert r.status == 200, r
    assert_no_proxy_credentials(only_seen(origin))


def test_proxy_authorization_is_dropped_from_origin_form(proxy, origin):
    raw = f"GET /pa HTTP/1.1\r\nHost: {A}:{PLAIN_PORT}\r\n{PA_TWICE}Connection: close\r\n\r\n".encode()
    r = http_request(proxy.address, raw)
    assert r.status == 200, r
    assert_no_proxy_credentials(only_seen(origin))


@pytest.mark.parametrize("mode", MODES)
def test_proxy_authorization_is_dropped_inside_intercepted_tunnels(proxy, origin, sluice_ca, mode):
    raw = f"GET /pa HTTP/1.1\r\nHost: {A}\r\n{PA_TWICE}\r\n".encode()
    outcome = exchange(open_tunnel(proxy, mode, sluice_ca), [raw])
    assert outcome.status == 200 and outcome.from_origin, outcome
    assert_no_proxy_credentials(only_seen(origin))


def test_proxy_authorization_from_curl_never_reaches_the_origin(proxy, origin, sluice_ca):
    creds_proxy = f"http://sluice:proxy-secret@{proxy.host}:{proxy.port}"
    plain = curl("-x", creds_proxy, f"http://{A}:{PLAIN_PORT}/curl-plain")
    assert plain.status == 200, plain.stderr
    tls = curl("-x", creds_proxy, "--cacert", sluice_ca, "-H", f"Proxy-Authorization: {PROXY_AUTH}",
               f"https://{A}:{TLS_PORT}/curl-tls")
    assert tls.status == 200, tls.stderr
    assert [s.target for s in origin.seen()] == ["/curl-plain", "/curl-tls"]
    for seen in origin.seen():
        assert_no_proxy_credentials(seen.headers)


def test_proxy_authorization_from_httpx_never_reaches_the_origin(proxy, origin, sluice_ca):
    creds_proxy = f"http://sluice:proxy-secret@{proxy.host}:{proxy.port}"
    with httpx.Client(proxy=creds_proxy, verify=ssl.create_default_context(cafile=sluice_ca), trust_env=False,
                      timeout=10) as c:
        assert c.get(f"http://{A}:{PLAIN_PORT}/httpx-plain", headers={"Cookie": COOKIE}).status_code == 200
        r = c.get(f"https://{A}:{TLS_PORT}/httpx-tls", headers={"Proxy-Authorization": PROXY_AUTH, "Cookie": COOKIE})
        assert r.status_code == 200 and r.json()["vhost"] == A
        fronted = c.get(f"https://{A}:{TLS_PORT}/httpx-fronted", headers={"Host": B})
        assert fronted.status_code == 403 and fronted.headers["sluice-reason"] == "host_mismatch"
    assert [s.target for s in origin.seen()] == ["/httpx-plain", "/httpx-tls"]
    assert_origin_clean(origin)


@pytest.mark.parametrize("mode", MODES)
def test_a_malformed_proxy_authorization_field_is_refused_not_forwarded(proxy, origin, sluice_ca, mode):
    """`Proxy-Authorization :` (space before the colon) is not the field the
    gate strips; a lenient origin would still read it. It must never pass."""
    mark = proxy.audit_mark()
    raw = f"GET /pa HTTP/1.1\r\nHost: {A}\r\nProxy-Authorization : {PROXY_AUTH}\r\n\r\n".encode()
    outcome = exchange(open_tunnel(proxy, mode, sluice_ca), [raw])
    assert outcome.status == 400 and not outcome.from_origin, outcome
    line = proxy.wait_audit(lambda e: e["reason"] == "bad_request", since=mark, what="a bad_request line")
    assert line["host"] == A and line["decision"] == "refuse", line
    assert origin.seen() == []
