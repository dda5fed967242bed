"""Caps, TLS interception and redirect revalidation, end to end.

A special-purpose origin on 93.184.215.14 (port 80 plain, 443 TLS with a
trustme certificate, 81 a blackhole whose accept queue is full) serves
streamed, oversized, slow, hanging and redirecting responses. Everything runs
inside the private network namespace; canaries must stay untouched.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import socket
import ssl
import threading
import time
from pathlib import Path

import httpx
import pytest

from harness import default_policy
from harness.http import read_request_head
from harness.loops import stop_loop_thread

pytestmark = pytest.mark.netns

SPECIAL = "93.184.215.14"
MIB = 1024 * 1024


# ------------------------------------------------------------------ the origin


class SpecialOrigin:
    """Plain HTTP on :80 and TLS on :443 with path-selected behaviours."""

    def __init__(self, server_ctx: ssl.SSLContext):
        self.server_ctx = server_ctx
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.seen: list[tuple[str, dict]] = []
        self.bytes_sent: dict[str, int] = {}
        self.blackhole: socket.socket | None = None
        self.fillers: list[socket.socket] = []

    def start(self) -> SpecialOrigin:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)
        # A listener whose accept queue is full drops new SYNs: connects hang.
        self.blackhole = socket.socket()
        self.blackhole.bind((SPECIAL, 81))
        self.blackhole.listen(0)
        for _ in range(3):
            s = socket.socket()
            s.setblocking(False)
            try:
                s.connect((SPECIAL, 81))
            except BlockingIOError:
                pass
            self.fillers.append(s)
        time.sleep(0.2)
        return self

    async def _start(self):
        self.servers = [
            await asyncio.start_server(self._handle, SPECIAL, 80),
            await asyncio.start_server(self._handle, SPECIAL, 443, ssl=self.server_ctx),
        ]

    def stop(self):
        for s in self.fillers:
            s.close()
        if self.blackhole:
            self.blackhole.close()
        # Handlers still waiting (a hanging response, a kept-alive connection)
        # are cancelled and finish on the running loop, not at garbage collection.
        stop_loop_thread(self.loop, self.thread, self.servers)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        try:
            while True:
                method, target, headers = await read_request_head(reader)
                body_len = await self._drain_body(reader, headers)
                self.seen.append((target, headers))
                if not await self._respond(writer, method, target, headers, body_len):
                    return
        except (asyncio.IncompleteReadError, ConnectionError, OSError, ssl.SSLError):
            return
        finally:
            writer.close()

    @staticmethod
    async def _drain_body(reader, headers) -> int:
        if "content-length" in headers:
            return len(await reader.readexactly(int(headers["content-length"])))
        if "chunked" in headers.get("transfer-encoding", ""):
            total = 0
            while True:
                size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
                if size == 0:
                    await reader.readuntil(b"\r\n")
                    return total
                total += len(await reader.readexactly(size))
                await reader.readexactly(2)
        return 0

    async def _respond(self, writer, method, target, headers, body_len) -> bool:
        path, _, query = target.partition("?")
        if path.startswith("/stream/"):  # chunked, no Content-Length
            total = int(path.split("/")[2])
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Type: "
                         b"application/octet-stream\r\n\r\n")
            chunk = b"x" * (64 * 1024)
            sent = 0
            while sent < total:
                n = min(len(chunk), total - sent)
                writer.write(b"%x\r\n" % n + chunk[:n] + b"\r\n")
                await writer.drain()
                sent += n
                self.bytes_sent[path] = sent
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            return True
        if path.startswith("/cl/"):  # a Content-Length over any cap, body never needed
            n = int(path.split("/")[2])
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % n)
            writer.write(b"y" * min(n, 1024))
            await writer.drain()
            await asyncio.sleep(5)
            return False
        if path == "/gzipbomb":
            body = gzip.compress(b"\0" * (64 * MIB), compresslevel=9)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
            await writer.drain()
            return True
        if path == "/drip":  # headers at once, then a byte every 0.2 s, forever
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            for _ in range(600):
                writer.write(b"1\r\nz\r\n")
                await writer.drain()
                await asyncio.sleep(0.2)
            return False
        if path == "/hang":  # never answers
            await asyncio.sleep(60)
            return False
        if path == "/redirect":
            location = query.split("to=", 1)[1] if "to=" in query else "/"
            from urllib.parse import unquote

            location = unquote(location)
            writer.write(f"HTTP/1.1 302 Found\r\nLocation: {location}\r\nContent-Length: "
                         "5\r\n\r\nmoved".encode("latin-1"))
            await writer.drain()
            return True
        body = json.dumps({"path": target, "host": headers.get("host"), "body_len": body_len,
                           "headers": sorted(headers)}).encode()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
                     + body)
        await writer.drain()
        return True


@pytest.fixture(scope="module")
def special(net, tls_ca, fake_dns):
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls_ca.ca.issue_cert("special.example", "redirect.example", "other.example").configure_cert(ctx)
    for name in ("special.example", "redirect.example", "other.example"):
        fake_dns.set(name, a=[SPECIAL], ttl=300)
    origin = SpecialOrigin(ctx).start()
    yield origin
    origin.stop()


def caps_policy(**limits) -> dict:
    policy = default_policy(ports=[80, 81, 443])
    policy["limits"] = {
        "connect_timeout": "1s", "request_timeout": "3s", "idle_timeout": "30s",
        "max_response_bytes": "8MiB", "max_request_bytes": "64KiB", **limits,
    }
    return policy


@pytest.fixture(scope="module")
def proxy(sluice_factory, special):
    return sluice_factory(caps_policy(), name="caps")


@pytest.fixture(scope="module")
def tunnel_proxy(sluice_factory, special):
    return sluice_factory(caps_policy(tunnel_max_bytes="1MiB", tunnel_max_seconds="2s"), name="tunnelcaps")


@pytest.fixture(scope="module")
def intercept_proxy(sluice_factory, special, tls_ca, sluice_home):
    policy = caps_policy()
    policy["intercept"] = ["redirect.example", "special.example", "other.example", "public.example"]
    policy["clients"] = [{"name": "strict", "sources": ["127.0.0.2/32"], "strip_request_headers": ["Cookie"]}]
    return sluice_factory(policy, name="intercept",
                          extra_args=("--set", f"ssl_verify_upstream_trusted_ca={tls_ca.cafile}"))


def sluice_ca(sluice_home: Path) -> str:
    return str(sluice_home / ".sluice" / "ca" / "mitmproxy-ca-cert.pem")


def client(proxy, **kw) -> httpx.Client:
    return httpx.Client(proxy=proxy.proxy_url, trust_env=False, timeout=20, **kw)


def audit_for(proxy, path_or_reason: str, *, wait: float = 3.0) -> list[dict]:
    deadline = time.time() + wait
    while True:
        lines = [json.loads(line) for line in Path(proxy.audit_file).read_text().splitlines() if line.strip()]
        found = [line for line in lines if line.get("reason") == path_or_reason]
        if found or time.time() > deadline:
            return found
        time.sleep(0.1)


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


# ------------------------------------------------------------------ sizes


def test_streamed_1gib_chunked_response_is_cut_at_the_cap_with_flat_memory(proxy, special):
    before = rss_kib(proxy.proc.pid)
    received = 0
    error = None
    with client(proxy) as c:
        try:
            with c.stream("GET", "http://special.example/stream/1073741824") as r:
                assert r.status_code == 200
                for chunk in r.iter_raw():
                    received += len(chunk)
        except httpx.HTTPError as e:
            error = e
    print("received", received, "error", repr(error), open(proxy.audit_file).read()[-600:])
    assert error is not None
    after = rss_kib(proxy.proc.pid)
    assert 8 * MIB - 128 * 1024 <= received <= 8 * MIB
    assert special.bytes_sent["/stream/1073741824"] < 64 * MIB  # the origin was stopped, not drained
    assert after - before < 40 * 1024, f"proxy RSS grew {after - before} KiB"
    lines = audit_for(proxy, "response_too_large")
    assert lines and lines[-1]["decision"] == "refuse"


def test_large_body_under_the_cap_streams_with_flat_memory(sluice_factory, special):
    big = sluice_factory(caps_policy(max_response_bytes="2GiB", request_timeout="60s"), name="bigcap")
    before = rss_kib(big.proc.pid)
    received = 0
    with client(big) as c, c.stream("GET", "http://special.example/stream/268435456") as r:
        for chunk in r.iter_raw():
            received += len(chunk)
    assert received == 256 * MIB
    assert rss_kib(big.proc.pid) - before < 40 * 1024


def test_content_length_over_the_cap_is_refused_before_any_body(proxy, special):
    with client(proxy) as c:
        r = c.get("http://special.example/cl/1073741824")
    assert r.status_code == 502
    assert r.headers["sluice-reason"] == "response_too_large"
    assert "8 MiB" in r.text


def test_gzip_bomb_is_forwarded_raw_and_counted_on_the_wire(proxy, special):
    with client(proxy) as c, c.stream("GET", "http://special.example/gzipbomb") as r:
        raw = b"".join(r.iter_raw())
    assert r.headers["content-encoding"] == "gzip"
    assert len(raw) < MIB  # compressed size on the wire, well under the 8 MiB cap
    assert len(gzip.decompress(raw)) == 64 * MIB


def test_request_body_over_the_cap_gets_413(proxy, special):
    with client(proxy) as c:
        r = c.post("http://special.example/echo", content=b"a" * (65 * 1024))
        assert r.status_code == 413
        assert r.headers["sluice-reason"] == "request_too_large"
    assert not any(t == "/echo" and h.get("content-length") == str(65 * 1024) for t, h in special.seen)


def test_chunked_request_body_over_the_cap_is_stopped(proxy, special):
    def body():
        for _ in range(64):
            yield b"b" * 4096  # 256 KiB in chunks, no Content-Length

    with client(proxy) as c:
        try:
            r = c.post("http://special.example/echo-chunked", content=body())
            assert r.status_code == 413 and r.headers["sluice-reason"] == "request_too_large"
        except httpx.HTTPError:
            pass  # the connection was closed mid-upload: also a refusal
    assert audit_for(proxy, "request_too_large")
    assert not any(t == "/echo-chunked" for t, _ in special.seen)  # the origin never saw it complete


def test_small_request_bodies_pass(proxy, special):
    with client(proxy) as c:
        r = c.post("http://special.example/echo", content=b"a" * 1000)
    assert r.status_code == 200 and r.json()["body_len"] == 1000


# ------------------------------------------------------------------ time


def test_hanging_origin_gets_504_request_timeout(proxy, special):
    started = time.time()
    with client(proxy) as c:
        r = c.get("http://special.example/hang")
    assert r.status_code == 504 and r.headers["sluice-reason"] == "request_timeout"
    assert 2.5 <= time.time() - started < 10


def test_slow_drip_is_cut_at_request_timeout(proxy, special):
    started = time.time()
    with client(proxy) as c:
        with pytest.raises(httpx.HTTPError):
            with c.stream("GET", "http://special.example/drip") as r:
                assert r.status_code == 200
                for _ in r.iter_raw():
                    pass
    assert 2.5 <= time.time() - started < 10
    assert audit_for(proxy, "request_timeout")


def test_blackholed_connect_hits_connect_timeout(proxy, special):
    started = time.time()
    with client(proxy) as c:
        r = c.get(f"http://{SPECIAL}:81/")
    assert r.status_code == 504 and r.headers["sluice-reason"] == "connect_timeout"
    assert time.time() - started < 6


def test_blackholed_connect_through_connect_tunnel(proxy, special):
    with socket.create_connection(proxy.address, timeout=10) as s:
        s.sendall(f"CONNECT {SPECIAL}:81 HTTP/1.1\r\nHost: {SPECIAL}:81\r\n\r\n".encode())
        head = s.recv(4096).decode("latin-1")
    assert head.startswith("HTTP/1.1 504") and "connect_timeout" in head


def test_idle_slow_clients_do_not_stop_normal_requests(proxy, special):
    idlers = []
    try:
        for _ in range(200):
            s = socket.create_connection(proxy.address, timeout=5)
            s.sendall(b"GET http://special.example/ HTTP/1.1\r\nHost: spec")  # never finished
            idlers.append(s)
        started = time.time()
        with client(proxy) as c:
            r = c.get("http://special.example/ok")
        assert r.status_code == 200
        assert time.time() - started < 3
    finally:
        for s in idlers:
            s.close()


# ------------------------------------------------------------------ tunnels


def _tunnel(proxy, authority: str) -> socket.socket:
    s = socket.create_connection(proxy.address, timeout=10)
    s.sendall(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        head += s.recv(1)
    assert head.startswith(b"HTTP/1.1 200"), head
    return s


def test_tunnel_is_closed_at_its_byte_cap(tunnel_proxy, special):
    s = _tunnel(tunnel_proxy, "special.example:80")
    s.sendall(b"GET /stream/20000000 HTTP/1.1\r\nHost: special.example\r\n\r\n")
    got = 0
    s.settimeout(10)
    while True:
        data = s.recv(65536)
        if not data:
            break
        got += len(data)
    assert got <= MIB
    assert got > MIB - 256 * 1024
    lines = audit_for(tunnel_proxy, "tunnel_too_large")
    assert lines and lines[-1]["event"] == "tunnel"


def test_tunnel_is_closed_at_its_time_cap(tunnel_proxy, special):
    s = _tunnel(tunnel_proxy, "special.example:80")
    started = time.time()
    s.settimeout(10)
    assert s.recv(10) == b""  # closed by the proxy, not by us
    assert 1.5 <= time.time() - started < 6
    assert audit_for(tunnel_proxy, "tunnel_timeout")


# ------------------------------------------------------------------ redirects


@pytest.mark.parametrize(
    "location",
    [
        "http://169.254.169.254/latest/meta-data/",
        "//169.254.169.254/",
        "http:\\\\169.254.169.254\\",
        "http://0xa9fea9fe/",
        "http://localhost/",
        "http://[::ffff:127.0.0.1]/",
        "http://%31%32%37.0.0.1/",
        "\t http://10.0.0.1/ ",
        "http://special.example:8080/",
    ],
)
def test_plain_http_redirect_to_a_refused_destination_is_403(proxy, special, location):
    from urllib.parse import quote

    with client(proxy) as c:
        r = c.get(f"http://redirect.example/redirect?to={quote(location)}")
    assert r.status_code == 403, r.text
    assert r.headers["sluice-reason"] == "redirect_refused"
    assert "redirects to" in r.text


def test_redirect_to_an_allowed_destination_passes_untouched(proxy, special):
    with client(proxy) as c:
        r = c.get("http://redirect.example/redirect?to=/elsewhere")
    assert r.status_code == 302 and r.headers["location"] == "/elsewhere"


def test_intercepted_https_redirect_to_metadata_is_refused(intercept_proxy, special, sluice_home):
    with httpx.Client(proxy=intercept_proxy.proxy_url, verify=sluice_ca(sluice_home), trust_env=False, timeout=20) as c:
        ok = c.get("https://special.example/hello")
        assert ok.status_code == 200 and ok.json()["host"] == "special.example"
        r = c.get("https://redirect.example/redirect?to=http://169.254.169.254/")
    assert r.status_code == 403 and r.headers["sluice-reason"] == "redirect_refused"


def test_domain_fronting_is_refused(intercept_proxy, special, sluice_home):
    with httpx.Client(proxy=intercept_proxy.proxy_url, verify=sluice_ca(sluice_home), trust_env=False, timeout=20) as c:
        r = c.get("https://special.example/x", headers={"Host": "other.example"})
    assert r.status_code == 403 and r.headers["sluice-reason"] == "host_mismatch"


def test_sni_naming_another_host_is_refused(intercept_proxy, special, sluice_home):
    s = _tunnel(intercept_proxy, "special.example:443")
    ctx = ssl.create_default_context(cafile=sluice_ca(sluice_home))
    with ctx.wrap_socket(s, server_hostname="other.example") as tls:
        tls.sendall(b"GET / HTTP/1.1\r\nHost: special.example\r\nConnection: close\r\n\r\n")
        head = tls.recv(4096).decode("latin-1")
    assert " 403 " in head.split("\r\n")[0] and "host_mismatch" in head


def test_untrusted_upstream_certificate_is_not_made_trusted(sluice_factory, special, sluice_home):
    policy = caps_policy()
    policy["intercept"] = ["*"]
    strict = sluice_factory(policy, name="strictverify")  # the trustme CA is NOT trusted upstream
    with httpx.Client(proxy=strict.proxy_url, verify=sluice_ca(sluice_home), trust_env=False, timeout=20) as c:
        r = c.get("https://special.example/")
    assert r.status_code == 502


def test_proxy_authorization_and_hop_by_hop_headers_are_not_forwarded(proxy, special):
    with client(proxy) as c:
        r = c.get("http://special.example/headers", headers={
            "Proxy-Authorization": "Basic dXNlcjpwYXNz", "Keep-Alive": "timeout=5",
            "Proxy-Connection": "keep-alive", "Connection": "keep-alive, X-Secret", "X-Secret": "1",
        })
    assert r.status_code == 200, r.text
    seen = r.json()["headers"]
    for name in ("proxy-authorization", "keep-alive", "proxy-connection", "x-secret"):
        assert name not in seen


def test_idle_client_connections_are_closed_at_idle_timeout(sluice_factory, special):
    idle = sluice_factory(caps_policy(idle_timeout="2s"), name="idle")
    with socket.create_connection(idle.address, timeout=15) as s:
        s.sendall(b"GET http://special.example/ok HTTP/1.1\r\nHost: special.example\r\n\r\n")
        first = s.recv(65536)
        assert first.startswith(b"HTTP/1.1 200")
        started = time.time()
        while s.recv(65536):
            pass  # the proxy closes the idle keep-alive connection
        assert 1.5 <= time.time() - started < 8


def test_profile_strips_named_request_headers(intercept_proxy, special):
    def headers_seen(source: str) -> list[str]:
        with socket.create_connection(intercept_proxy.address, timeout=10, source_address=(source, 0)) as s:
            s.sendall(b"GET http://special.example/h HTTP/1.1\r\nHost: special.example\r\n"
                      b"Cookie: session=secret\r\nX-Keep: 1\r\nConnection: close\r\n\r\n")
            data = b""
            while chunk := s.recv(65536):
                data += chunk
        return json.loads(data.split(b"\r\n\r\n", 1)[1])["headers"]

    stripped = headers_seen("127.0.0.2")  # the `strict` profile strips Cookie
    assert "cookie" not in stripped and "x-keep" in stripped
    assert "cookie" in headers_seen("127.0.0.1")  # the top level does not


def test_tls_to_a_plain_port_is_bounded_by_request_timeout(proxy, special):
    # An absolute-form https:// URL to a port that speaks plain HTTP: the
    # upstream TLS handshake never completes; the exchange still ends in time.
    started = time.time()
    with socket.create_connection(proxy.address, timeout=15) as s:
        s.sendall(b"GET https://special.example:80/ HTTP/1.1\r\nHost: special.example\r\nConnection: close\r\n\r\n")
        head = s.recv(4096)
    assert time.time() - started < 10
    assert head.startswith(b"HTTP/1.1 50"), head[:200]
