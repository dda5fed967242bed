"""One audit line per decision, with no gaps and no doubles.

Every case opens ONE client connection (from its own source address, so the
audit line's `client` field names it), does one thing, closes, and then the
audit log must hold exactly the lines that connection's decisions call for:
one for a plain request, a refused CONNECT or a tunnel; two for an
intercepted tunnel that carried a request (the tunnel's decision and the
request's). Modes: regular HTTP, CONNECT (plain and intercepted), SOCKS5.
Refusals: the policy's (address_not_public, host_not_allowed,
port_not_allowed, method_not_allowed, client_unknown), caps
(request_too_large, tunnel_too_large), mitmproxy's own 400s (bad_request;
not_http inside an intercepted tunnel), SOCKS4 / BIND / UDP ASSOCIATE /
garbage and the HTTP/2 preface (client_protocol_refused), and connections
back to the proxy's own ports (proxy_loop).

The proxy listens on 1.1.1.1, a "public" address of the test namespace, so a
request naming the proxy's own address passes the address rules and reaches
mitmproxy's self-connect check (a loopback proxy address would be refused
earlier, as address_not_public). Its ports are chosen before it starts so
the policy can allow them.

When has a connection's last line been written? The client half-closes and
reads until the proxy closes its side (so the proxy is done with the
connection), then an unrelated request on a fresh connection is made and its
line awaited: the proxy's event loop has by then run the first connection's
disconnect hooks (which write tunnel lines) many times over.
"""

from __future__ import annotations

import socket
import ssl
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from harness import SluiceProcess, default_policy, free_port
from harness.clients import _Reader, read_response

pytestmark = pytest.mark.netns

PROXY_HOST = "1.1.1.1"
MAIN = "127.0.0.1"  # profile `main`: the top-level rules
STRICT = "127.0.0.2"  # profile `strict`: allow [public.example, example.com], methods [GET, CONNECT]
UNKNOWN = "127.0.0.3"  # matches no profile, and require_client is on
CAPPED = "127.0.0.4"  # profile `capped`: tiny request and tunnel caps
BARRIER = "127.0.0.5"  # profile `main` too: the barrier requests


class PublicSluice(SluiceProcess):
    """`sluice proxy` on a public test address, on ports chosen in advance."""

    def __init__(self, *args, host: str, port: int, socks_port: int, **kwargs):
        super().__init__(*args, socks=True, **kwargs)
        self._fixed = (host, port, socks_port)

    def command(self) -> list[str]:
        # start() picks free loopback ports; these were picked (and put in the
        # policy) before it ran.
        self.host, self.port, self.socks_port = self._fixed
        return super().command()


@pytest.fixture(scope="module")
def proxy(netns, fake_dns, net, tls_ca, sluice_home, tmp_path_factory):
    port = free_port(PROXY_HOST)
    while (socks_port := free_port(PROXY_HOST)) == port:
        pass
    policy = default_policy(ports=[80, 443, port, socks_port])
    policy["intercept"] = ["example.com"]
    policy["require_client"] = True
    policy["clients"] = [
        {"name": "main", "sources": [f"{MAIN}/32", f"{BARRIER}/32"]},
        {"name": "strict", "sources": [f"{STRICT}/32"], "allow": ["public.example", "example.com"],
         "methods": ["GET", "CONNECT"]},
        {"name": "capped", "sources": [f"{CAPPED}/32"],
         "limits": {"max_request_bytes": "1KiB", "tunnel_max_bytes": "4KiB"}},
    ]
    proc = PublicSluice(
        tmp_path_factory.mktemp("auditlines"), policy, name="auditlines", home=sluice_home,
        host=PROXY_HOST, port=port, socks_port=socks_port,
        extra_args=("--set", f"ssl_verify_upstream_trusted_ca={tls_ca.cafile}"),
    )
    proc.start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def sluice_ca(proxy, sluice_home) -> str:
    return str(Path(sluice_home) / ".sluice" / "ca" / "mitmproxy-ca-cert.pem")


# ----------------------------------------------------------------- the client


class Client:
    """One client connection from a chosen source address."""

    def __init__(self, address: tuple[str, int], source: str):
        self.sock: socket.socket | ssl.SSLSocket = socket.create_connection(address, timeout=15,
                                                                            source_address=(source, 0))
        self.raw = self.sock
        self.name = f"{source}:{self.sock.getsockname()[1]}"
        self.reader = _Reader(self.sock)

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def response(self, method: str = "GET", connect: bool = False):
        return read_response(self.reader, method=method, connect=connect)

    def exactly(self, n: int) -> bytes:
        return self.reader.exactly(n)

    def start_tls(self, server_hostname: str, cafile: str) -> None:
        ctx = ssl.create_default_context(cafile=cafile)
        assert not self.reader.buf, "unexpected bytes before TLS"
        self.sock = ctx.wrap_socket(self.raw, server_hostname=server_hostname)
        self.reader = _Reader(self.sock)

    def finish(self) -> None:
        """Half-close, then read until the proxy closes its side: after that
        the proxy is done with this connection."""
        try:
            if isinstance(self.sock, ssl.SSLSocket):
                self.sock = self.sock.unwrap()
            self.sock.shutdown(socket.SHUT_WR)
            while self.sock.recv(65536):
                pass
        except (OSError, ssl.SSLError, ValueError):
            pass  # the proxy closed (or reset) first: done as well
        finally:
            self.raw.close()


def http(client: Client, request: bytes, method: str = "GET"):
    client.send(request)
    return client.response(method=method)


def connect(client: Client, authority: str):
    client.send(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
    return client.response(method="CONNECT", connect=True)


def socks_greet(client: Client) -> None:
    client.send(b"\x05\x01\x00")
    assert client.exactly(2) == b"\x05\x00"


def socks_request(client: Client, cmd: int, host: str, port: int) -> int | None:
    """A SOCKS5 request (after the greeting); the reply code, or None if closed."""
    name = host.encode()
    client.send(bytes([5, cmd, 0, 3, len(name)]) + name + struct.pack("!H", port))
    head = client.exactly(4)
    if len(head) < 4:
        return None
    bound = {1: 4, 4: 16}.get(head[3], 0)
    client.exactly(bound + 2)
    return head[1]


def get(host: str, path: str = "/", extra: str = "") -> bytes:
    return f"GET http://{host}{path} HTTP/1.1\r\nHost: {host}\r\n{extra}\r\n".encode()


# ----------------------------------------------------------------- the cases


@dataclass
class Case:
    source: str
    run: Callable  # (client, proxy, ctx) -> the HTTP status the client got (None: no HTTP answer)
    lines: list[tuple[str, str | None]]  # the expected (decision, reason) lines, any order
    socks: bool = False  # connect to the SOCKS5 port instead of the HTTP one


def _regular_allowed(c, p, x):
    assert http(c, get("public.example")).status == 200
    return 200


def _regular_refused(host, path="/", method="GET", status=403):
    def run(c, p, x):
        r = http(c, f"{method} http://{host}{path} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode(), method=method)
        assert r.status == status, r
        return status
    return run


def _regular_proxy_loop(c, p, x):
    # The gate allowed it (a public address, an allowed port); mitmproxy
    # refuses the dial itself, and the client gets Sluice's refusal in place
    # of mitmproxy's 502 page.
    r = http(c, get(f"{PROXY_HOST}:{p.port}"))
    assert (r.status, r.sluice_reason) == (403, "proxy_loop") and "server" not in r.headers, r
    return 403


def _regular_too_large(c, p, x):
    body = b"x" * 5000
    r = http(c, b"POST http://public.example/ HTTP/1.1\r\nHost: public.example\r\nContent-Length: 5000\r\n\r\n" + body,
             "POST")
    assert r.status == 413, r
    return 413


def _bad(raw: bytes):
    def run(c, p, x):
        r = http(c, raw)
        assert r.status == 400, r
        return 400
    return run


CL_TE = (b"POST http://public.example/ HTTP/1.1\r\nHost: public.example\r\nContent-Length: 5\r\n"
         b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n")
DUP_CL = (b"POST http://public.example/ HTTP/1.1\r\nHost: public.example\r\nContent-Length: 5\r\n"
          b"Content-Length: 6\r\n\r\nhello!")
CONNECT_CL_TE = (b"CONNECT public.example:443 HTTP/1.1\r\nHost: public.example:443\r\nContent-Length: 5\r\n"
                 b"Transfer-Encoding: chunked\r\n\r\n")


def _connect_allowed(c, p, x):
    assert connect(c, "public.example:80").status == 200
    c.send(b"GET / HTTP/1.1\r\nHost: public.example\r\n\r\n")
    assert c.response().status == 200


def _connect_answer(authority, status=403):
    def run(c, p, x):
        r = connect(c, authority)
        assert r.status == status, r
        return status if status != 200 else None  # a tunnel's line has no status
    return run


def _connect_proxy_loop(c, p, x):
    r = connect(c, f"{PROXY_HOST}:{p.port}")
    assert (r.status, r.sluice_reason) == (403, "proxy_loop"), r
    return 403


def _connect_too_large(c, p, x):
    assert connect(c, "public.example:80").status == 200
    c.send(b"GET /bytes/20000 HTTP/1.1\r\nHost: public.example\r\n\r\n")
    c.response()  # cut short; whatever arrived


def _connect_bad(c, p, x):
    c.send(CONNECT_CL_TE)
    assert c.response(method="CONNECT", connect=True).status == 400
    return 400


def _intercepted(request: bytes | None, status: int | None = None):
    def run(c, p, x):
        assert connect(c, "example.com:443").status == 200
        c.start_tls("example.com", x["ca"])
        if request is not None:
            c.send(request)
            r = c.response()
            assert r.status == status, r
        return status
    return run


def _socks_allowed(c, p, x):
    socks_greet(c)
    assert socks_request(c, 1, "public.example", 80) == 0
    c.send(b"GET / HTTP/1.1\r\nHost: public.example\r\n\r\n")
    assert c.response().status == 200


def _socks_refused(host, port):
    def run(c, p, x):
        socks_greet(c)
        assert socks_request(c, 1, host, port) == 2
    return run


def _socks_proxy_loop(c, p, x):
    socks_greet(c)
    assert socks_request(c, 1, PROXY_HOST, p.port) == 2  # "not allowed by ruleset", as for every refusal


def _socks_too_large(c, p, x):
    socks_greet(c)
    assert socks_request(c, 1, "public.example", 80) == 0
    c.send(b"GET /bytes/20000 HTTP/1.1\r\nHost: public.example\r\n\r\n")
    c.response()


def _socks_command(cmd):
    def run(c, p, x):
        socks_greet(c)
        assert socks_request(c, cmd, "public.example", 80) not in (0, None)
    return run


def _socks_raw(data: bytes):
    def run(c, p, x):
        c.send(data)
        c.reader.rest()  # the proxy closes (with or without a reply)
    return run


ALLOW = [("allow", None)]


def refuse(reason):
    return [("refuse", reason)]


CASES = {
    # regular HTTP
    "http-allowed": Case(MAIN, _regular_allowed, ALLOW),
    "http-address_not_public": Case(MAIN, _regular_refused("10.0.0.1"), refuse("address_not_public")),
    "http-host_not_allowed": Case(STRICT, _regular_refused("one.example"), refuse("host_not_allowed")),
    "http-port_not_allowed": Case(MAIN, _regular_refused("public.example:8080"), refuse("port_not_allowed")),
    "http-method_not_allowed": Case(STRICT, _regular_refused("public.example", method="DELETE"),
                                    refuse("method_not_allowed")),
    "http-client_unknown": Case(UNKNOWN, _regular_refused("public.example", status=407), refuse("client_unknown")),
    "http-request_too_large": Case(CAPPED, _regular_too_large, refuse("request_too_large")),
    "http-bad_request-cl-te": Case(MAIN, _bad(CL_TE), refuse("bad_request")),
    "http-bad_request-duplicate-cl": Case(MAIN, _bad(DUP_CL), refuse("bad_request")),
    "http-bad_request-request-line": Case(MAIN, _bad(b"HELLO THERE\r\n\r\n"), refuse("bad_request")),
    "http-bad_request-no-host": Case(MAIN, _bad(b"GET / HTTP/1.1\r\n\r\n"), refuse("bad_request")),
    "http-proxy_loop": Case(MAIN, _regular_proxy_loop, refuse("proxy_loop")),
    "http-h2-prior-knowledge": Case(MAIN, _bad(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"), refuse("client_protocol_refused")),
    # CONNECT, plain tunnel
    "connect-allowed": Case(MAIN, _connect_allowed, ALLOW),
    "connect-allowed-no-bytes": Case(MAIN, _connect_answer("public.example:443", status=200), ALLOW),
    "connect-address_not_public": Case(MAIN, _connect_answer("10.0.0.1:443"), refuse("address_not_public")),
    "connect-host_not_allowed": Case(STRICT, _connect_answer("one.example:443"), refuse("host_not_allowed")),
    "connect-port_not_allowed": Case(MAIN, _connect_answer("public.example:8080"), refuse("port_not_allowed")),
    "connect-client_unknown": Case(UNKNOWN, _connect_answer("public.example:443", status=407),
                                   refuse("client_unknown")),
    "connect-tunnel_too_large": Case(CAPPED, _connect_too_large, refuse("tunnel_too_large")),
    "connect-bad_request": Case(MAIN, _connect_bad, refuse("bad_request")),
    "connect-proxy_loop": Case(MAIN, _connect_proxy_loop, refuse("proxy_loop")),
    # CONNECT, intercepted: the tunnel is one decision, each request inside another
    "intercept-allowed": Case(MAIN, _intercepted(b"GET / HTTP/1.1\r\nHost: example.com\r\n\r\n", 200), ALLOW + ALLOW),
    "intercept-no-request": Case(MAIN, _intercepted(None), ALLOW),
    "intercept-method_not_allowed": Case(
        STRICT, _intercepted(b"DELETE / HTTP/1.1\r\nHost: example.com\r\n\r\n", 403), ALLOW
        + refuse("method_not_allowed")),
    "intercept-host_mismatch": Case(
        MAIN, _intercepted(b"GET / HTTP/1.1\r\nHost: public.example\r\n\r\n", 403), ALLOW + refuse("host_mismatch")),
    "intercept-bad_request": Case(
        MAIN, _intercepted(b"POST / HTTP/1.1\r\nHost: example.com\r\nContent-Length: 5\r\n"
                           b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400), ALLOW + refuse("bad_request")),
    "intercept-not_http": Case(MAIN, _intercepted(b"HELLO THERE\r\n\r\n", 400), ALLOW + refuse("not_http")),
    # SOCKS5
    "socks-allowed": Case(MAIN, _socks_allowed, ALLOW, socks=True),
    "socks-address_not_public": Case(MAIN, _socks_refused("10.0.0.1", 80), refuse("address_not_public"), socks=True),
    "socks-host_not_allowed": Case(STRICT, _socks_refused("one.example", 80), refuse("host_not_allowed"), socks=True),
    "socks-port_not_allowed": Case(MAIN, _socks_refused("public.example", 8080), refuse("port_not_allowed"),
                                   socks=True),
    "socks-client_unknown": Case(UNKNOWN, _socks_refused("public.example", 80), refuse("client_unknown"), socks=True),
    "socks-tunnel_too_large": Case(CAPPED, _socks_too_large, refuse("tunnel_too_large"), socks=True),
    "socks-proxy_loop": Case(MAIN, _socks_proxy_loop, refuse("proxy_loop"), socks=True),
    "socks-bind": Case(MAIN, _socks_command(2), refuse("client_protocol_refused"), socks=True),
    "socks-udp_associate": Case(MAIN, _socks_command(3), refuse("client_protocol_refused"), socks=True),
    "socks4": Case(MAIN, _socks_raw(b"\x04\x01\x00\x50\x08\x08\x08\x08agent\x00"), refuse("client_protocol_refused"),
                   socks=True),
    "socks-garbage": Case(MAIN, _socks_raw(b"GET / HTTP/1.1\r\nHost: public.example\r\n\r\n"),
                          refuse("client_protocol_refused"), socks=True),
    "socks-bad-address-type": Case(MAIN, _socks_raw(b"\x05\x01\x00" + b"\x05\x01\x00\x09\x00\x50"),
                                   refuse("client_protocol_refused"), socks=True),
}


def lines_of(proxy: SluiceProcess, client: str) -> list[dict]:
    return [e for e in proxy.audit() if e.get("client") == client]


def barrier(proxy: SluiceProcess) -> None:
    """A fresh, unrelated request whose line we wait for (see the module docstring)."""
    c = Client(proxy.address, BARRIER)
    assert http(c, get("public.example", "/barrier", "Connection: close\r\n")).status == 200
    c.finish()
    proxy.wait_audit(lambda e: e.get("client") == c.name, what=f"the barrier's line ({c.name})")


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_one_line_per_decision(proxy, sluice_ca, case: Case):
    c = Client(proxy.socks_address if case.socks else proxy.address, case.source)
    try:
        status = case.run(c, proxy, {"ca": sluice_ca})
    finally:
        c.finish()
    try:
        proxy.wait_audit(lambda e: len(lines_of(proxy, c.name)) >= len(case.lines),
                         what=f"{len(case.lines)} line(s) for {c.name}")
    except AssertionError:
        pass  # too few: the count below says so
    barrier(proxy)
    lines = lines_of(proxy, c.name)
    got = sorted(((e.get("decision"), e.get("reason")) for e in lines), key=str)
    assert got == sorted(case.lines, key=str), (
        f"{c.name}: expected {case.lines}, the audit log has:\n" + "\n".join(map(str, lines)))
    for e in lines:
        assert e["time"] and e["event"], e
        if e["status"] is not None:
            assert e["status"] == status, f"the line says {e['status']}, the client got {status}: {e}"
        if e["decision"] == "refuse":
            assert isinstance(e["detail"], str) and 0 < len(e["detail"]) <= 300 and e["detail"].isprintable(), e
