"""A refused redirect always delivers its refusal, whole (Sluice issue 8, item 7).

A redirecting origin on 93.184.215.14 (":8087" plain HTTP/1.1, ":8447" TLS
speaking h2 or HTTP/1.1 by ALPN, certificate from the test CA) answers a
3xx whose Location comes from the `to=` query, in every body shape: empty
with `Content-Length: 0`, a `Content-Length` body, a chunked body (sent in
pieces), an empty chunked body, a body ended by closing the connection, a
HEAD request, and a 304 carrying a Location. For a refused Location (the
metadata address, an internal name) every client must get a 403
`redirect_refused` whose body is complete (its length is its
Content-Length) and names the target, without waiting for anything, with
keep-alive and with `Connection: close`, from raw sockets, httpx, curl, and
h2 inside an intercepted tunnel. The canaries must see nothing (the
autouse canary guard checks every test).
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import threading
from pathlib import Path
from urllib.parse import parse_qs, quote

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import httpx
import pytest

from harness import default_policy
from harness.clients import _Reader, curl, open_socket, read_response
from harness.loops import stop_loop_thread

pytestmark = pytest.mark.netns

ORIGIN_IP = "93.184.215.14"
PORT = 8087
TLS_PORT = 8447
NAME = "refusal-origin.example"
MOVED = b"<html><body>This resource has moved; follow the Location header.</body></html>\n"
HUGE = 1 << 30  # a 3xx body far bigger than anything the proxy may hold

# Every body shape the origin can give its 3xx: (path, method).
SHAPES = {
    "empty": ("/empty", "GET"),
    "content-length": ("/cl", "GET"),
    "chunked": ("/chunked", "GET"),
    "chunked-empty": ("/chunked-empty", "GET"),
    "close-delimited": ("/close", "GET"),
    "head": ("/cl", "HEAD"),
    "304": ("/304", "GET"),
}
# Refused targets, and the text the refusal must name.
TARGETS = {
    "metadata-ip": ("http://169.254.169.254/latest/meta-data/", "169.254.169.254"),
    "internal-name": ("http://metadata.google.internal/computeMetadata/v1/", "metadata.google.internal"),
}


# ------------------------------------------------------------------ the origin


class RedirectOrigin:
    """Answers `GET|HEAD /<shape>?to=<location>` with a 3xx in that shape."""

    def __init__(self, server_ctx: ssl.SSLContext):
        self.server_ctx = server_ctx
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="redirect-origin", daemon=True)
        self.release = threading.Event()  # lets /stall send its body
        self.bytes_sent: dict[str, int] = {}
        self.seen: list[tuple[str, str]] = []

    def start(self) -> RedirectOrigin:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)
        return self

    async def _start(self) -> None:
        self.servers = [
            await asyncio.start_server(self._handle, ORIGIN_IP, PORT),
            await asyncio.start_server(self._handle, ORIGIN_IP, TLS_PORT, ssl=self.server_ctx),
        ]

    def stop(self) -> None:
        self.release.set()
        stop_loop_thread(self.loop, self.thread, self.servers)

    @staticmethod
    def _split(target: str) -> tuple[str, str]:
        path, _, query = target.partition("?")
        return path, parse_qs(query).get("to", ["/"])[0]

    async def _wait_release(self) -> None:
        await self.loop.run_in_executor(None, self.release.wait, 30)

    # ---- HTTP/1.1
    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        ssl_object = writer.get_extra_info("ssl_object")
        try:
            if ssl_object is not None and ssl_object.selected_alpn_protocol() == "h2":
                await self._serve_h2(reader, writer)
                return
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                method, target, _ = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ")
                self.seen.append((method, target))
                if not await self._h1(writer, method, target):
                    return
        except (asyncio.IncompleteReadError, ConnectionError, OSError, ssl.SSLError, ValueError):
            return
        finally:
            writer.close()

    async def _h1(self, writer: asyncio.StreamWriter, method: str, target: str) -> bool:
        path, location = self._split(target)
        head = method == "HEAD"

        def start(status: str, *headers: str) -> bytes:
            lines = [f"HTTP/1.1 {status}", f"Location: {location}", "Content-Type: text/html", *headers]
            return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

        if path == "/ok":
            body = b"origin ok\n"
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + (b"" if head else body))
        elif path == "/empty":
            writer.write(start("302 Found", "Content-Length: 0"))
        elif path == "/cl":
            writer.write(start("302 Found", f"Content-Length: {len(MOVED)}") + (b"" if head else MOVED))
        elif path == "/chunked":
            writer.write(start("302 Found", "Transfer-Encoding: chunked"))
            await writer.drain()
            if not head:
                for piece in (MOVED[:20], MOVED[20:]):
                    await asyncio.sleep(0.05)
                    writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                    await writer.drain()
                writer.write(b"0\r\n\r\n")
        elif path == "/chunked-empty":
            writer.write(start("302 Found", "Transfer-Encoding: chunked") + (b"" if head else b"0\r\n\r\n"))
        elif path == "/close":
            writer.write(start("302 Found", "Connection: close") + (b"" if head else MOVED))
            await writer.drain()
            return False
        elif path == "/304":
            writer.write(start("304 Not Modified", 'ETag: "v1"'))
        elif path == "/stall":  # the headers now, the body only when the test says so
            writer.write(start("302 Found", f"Content-Length: {len(MOVED)}"))
            await writer.drain()
            await self._wait_release()
            writer.write(MOVED)
        elif path == "/huge":
            writer.write(start("302 Found", f"Content-Length: {HUGE}"))
            chunk = b"m" * 65536
            sent = 0
            while sent < HUGE:
                writer.write(chunk)
                await writer.drain()
                sent += len(chunk)
                self.bytes_sent[path] = sent
        else:
            writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()
        return True

    # ---- HTTP/2
    async def _serve_h2(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding="utf-8"))
        conn.initiate_connection()
        window = asyncio.Event()
        tasks: set[asyncio.Task] = set()

        async def flush() -> None:
            data = conn.data_to_send()
            if data:
                writer.write(data)
                await writer.drain()

        await flush()
        try:
            while True:
                data = await reader.read(65536)
                if not data:
                    return
                try:
                    events = conn.receive_data(data)
                except h2.exceptions.ProtocolError:
                    return
                for event in events:
                    if isinstance(event, h2.events.RequestReceived):
                        task = asyncio.create_task(self._h2(conn, flush, window, event.stream_id, dict(event.headers)))
                        tasks.add(task)
                        task.add_done_callback(tasks.discard)
                    elif isinstance(event, h2.events.DataReceived):
                        conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                    elif isinstance(event, h2.events.WindowUpdated):
                        window.set()
                    elif isinstance(event, h2.events.ConnectionTerminated):
                        return
                await flush()
        finally:
            for task in tasks:
                task.cancel()

    async def _h2(self, conn, flush, window: asyncio.Event, sid: int, headers: dict) -> None:
        method, target = headers[":method"], headers[":path"]
        self.seen.append((method, target))
        path, location = self._split(target)
        head = method == "HEAD"
        moved = [("location", location), ("content-type", "text/html")]
        try:
            if path == "/ok":
                body = b"origin ok\n"
                conn.send_headers(sid, [(":status", "200"), ("content-length", str(len(body)))], end_stream=head)
                if not head:
                    conn.send_data(sid, body, end_stream=True)
            elif path == "/empty":
                conn.send_headers(sid, [(":status", "302"), *moved, ("content-length", "0")], end_stream=True)
            elif path == "/cl":
                conn.send_headers(sid, [(":status", "302"), *moved, ("content-length", str(len(MOVED)))],
                                  end_stream=head)
                if not head:
                    conn.send_data(sid, MOVED, end_stream=True)
            elif path in ("/chunked", "/close"):  # no length: DATA frames until END_STREAM
                conn.send_headers(sid, [(":status", "302"), *moved], end_stream=head)
                await flush()
                if not head:
                    for piece, last in ((MOVED[:20], False), (MOVED[20:], True)):
                        await asyncio.sleep(0.05)
                        conn.send_data(sid, piece, end_stream=last)
                        await flush()
            elif path == "/chunked-empty":  # HEADERS without END_STREAM, then an empty DATA ending it
                conn.send_headers(sid, [(":status", "302"), *moved])
                await flush()
                await asyncio.sleep(0.05)
                conn.send_data(sid, b"", end_stream=True)
            elif path == "/304":
                conn.send_headers(sid, [(":status", "304"), *moved, ("etag", '"v1"')], end_stream=True)
            elif path == "/stall":
                conn.send_headers(sid, [(":status", "302"), *moved, ("content-length", str(len(MOVED)))])
                await flush()
                await self._wait_release()
                conn.send_data(sid, MOVED, end_stream=True)
            elif path == "/huge":
                size = 48 * 1024 * 1024
                conn.send_headers(sid, [(":status", "302"), *moved, ("content-length", str(size))])
                sent = 0
                while sent < size:
                    room = min(conn.local_flow_control_window(sid), conn.max_outbound_frame_size, size - sent)
                    if room <= 0:
                        window.clear()
                        await flush()
                        await window.wait()
                        continue
                    conn.send_data(sid, b"m" * room, end_stream=sent + room == size)
                    sent += room
                    self.bytes_sent["/huge-h2"] = sent
                    await flush()
            else:
                conn.send_headers(sid, [(":status", "404"), ("content-length", "0")], end_stream=True)
            await flush()
        except (h2.exceptions.ProtocolError, h2.exceptions.StreamClosedError, ConnectionError, OSError):
            return


@pytest.fixture(scope="module")
def origin(net, tls_ca, fake_dns):
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls_ca.ca.issue_cert(NAME).configure_cert(ctx)
    ctx.set_alpn_protocols(["h2", "http/1.1"])
    fake_dns.set(NAME, a=[ORIGIN_IP], ttl=300)
    server = RedirectOrigin(ctx).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def proxy(sluice_factory, origin, tls_ca):
    policy = default_policy(ports=[80, 443, PORT, TLS_PORT])
    policy["intercept"] = [NAME]
    return sluice_factory(policy, name="redirect-refusal",
                          extra_args=("--set", f"ssl_verify_upstream_trusted_ca={tls_ca.cafile}"))


@pytest.fixture
def released(origin):
    origin.release.clear()
    yield origin
    origin.release.set()


def sluice_ca(sluice_home: Path) -> ssl.SSLContext:
    """Trust Sluice's interception CA (clients inside intercepted tunnels)."""
    return ssl.create_default_context(cafile=str(sluice_home / ".sluice" / "ca" / "mitmproxy-ca-cert.pem"))


def url(path: str, location: str, *, tls: bool = False) -> str:
    scheme, port = ("https", TLS_PORT) if tls else ("http", PORT)
    return f"{scheme}://{NAME}:{port}{path}?to={quote(location, safe='')}"


def raw_request(method: str, path: str, location: str, *, close: bool) -> bytes:
    lines = [f"{method} {url(path, location)} HTTP/1.1", f"Host: {NAME}:{PORT}"]
    if close:
        lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def assert_whole_refusal(status: int, headers, body: bytes, method: str, names: str) -> None:
    """A 403 redirect_refusal whose body is all there and names the target."""
    assert status == 403, (status, headers, body)
    assert headers["sluice-reason"] == "redirect_refused"
    length = int(headers["content-length"])
    assert length > 0
    if method == "HEAD":
        assert body == b""
    else:
        assert len(body) == length, f"body {len(body)} bytes, Content-Length {length}"
        text = body.decode()
        assert text.startswith("Sluice refused this request: the response redirects to")
        assert names in text and text.endswith("\n")


def assert_closed(sock: socket.socket, reader: _Reader) -> None:
    assert not reader.buf, f"stray bytes after the refusal: {reader.buf[:200]!r}"
    assert sock.recv(65536) == b"", "the proxy did not close the connection"


# ------------------------------------------------------------------ plain HTTP/1.1


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("shape", SHAPES)
def test_keep_alive_client_gets_the_whole_refusal_then_a_usable_or_closed_connection(proxy, origin, shape, target):
    path, method = SHAPES[shape]
    location, names = TARGETS[target]
    with open_socket(proxy.address, timeout=15) as s:
        reader = _Reader(s)
        s.sendall(raw_request(method, path, location, close=False))
        r = read_response(reader, method=method)
        assert_whole_refusal(r.status, r.headers, r.body, method, names)
        if r.headers.get("connection", "").lower() == "close":
            assert_closed(s, reader)
        else:
            # No stray bytes and no half-finished exchange: the next request works.
            s.sendall(raw_request("GET", "/ok", "/", close=False))
            ok = read_response(reader)
            assert ok.status == 200 and ok.body == b"origin ok\n", ok


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("shape", SHAPES)
def test_connection_close_client_gets_the_whole_refusal_then_the_close(proxy, origin, shape, target):
    path, method = SHAPES[shape]
    location, names = TARGETS[target]
    with open_socket(proxy.address, timeout=15) as s:
        reader = _Reader(s)
        s.sendall(raw_request(method, path, location, close=True))
        r = read_response(reader, method=method)
        assert_whole_refusal(r.status, r.headers, r.body, method, names)
        assert_closed(s, reader)


@pytest.mark.parametrize("shape", SHAPES)
def test_head_announces_the_length_the_get_refusal_has(proxy, origin, shape):
    path, _ = SHAPES[shape]
    location, _ = TARGETS["metadata-ip"]
    with httpx.Client(proxy=proxy.proxy_url, trust_env=False, timeout=15) as c:
        get = c.get(url(path, location))
        head = c.head(url(path, location))
    assert get.status_code == head.status_code == 403
    assert head.headers["content-length"] == get.headers["content-length"] == str(len(get.content))


@pytest.mark.parametrize("shape", SHAPES)
def test_httpx_reads_the_whole_refusal_and_reuses_its_connection_pool(proxy, origin, shape):
    path, method = SHAPES[shape]
    location, names = TARGETS["metadata-ip"]
    with httpx.Client(proxy=proxy.proxy_url, trust_env=False, timeout=15) as c:
        r = c.request(method, url(path, location))
        assert_whole_refusal(r.status_code, r.headers, r.content, method, names)
        ok = c.get(url("/ok", "/"))
        assert ok.status_code == 200 and ok.content == b"origin ok\n"


@pytest.mark.parametrize("close", [False, True], ids=["keep-alive", "connection-close"])
@pytest.mark.parametrize("shape", SHAPES)
def test_curl_gets_the_whole_refusal(proxy, origin, shape, close):
    path, method = SHAPES[shape]
    location, names = TARGETS["internal-name"]
    args = ["-x", proxy.proxy_url]
    if method == "HEAD":
        args.append("-I")
    if close:
        args += ["-H", "Connection: close"]
    result = curl(*args, url(path, location), timeout=15)
    assert result.returncode == 0, result.stderr  # 18 would be "transfer closed with bytes remaining"
    body = b"" if method == "HEAD" else result.body
    assert_whole_refusal(result.status, result.headers, body, method, names)


def test_refusal_does_not_wait_for_a_stalled_origin_body(proxy, released):
    """The origin sends its 3xx headers and holds the body back until the
    client has read the whole refusal: the refusal cannot depend on it."""
    location, names = TARGETS["metadata-ip"]
    with open_socket(proxy.address, timeout=15) as s:
        reader = _Reader(s)
        s.sendall(raw_request("GET", "/stall", location, close=False))
        r = read_response(reader)
        assert_whole_refusal(r.status, r.headers, r.body, "GET", names)
        assert not released.release.is_set()


def test_huge_3xx_body_is_never_read_whole(proxy, origin):
    location, names = TARGETS["metadata-ip"]
    with open_socket(proxy.address, timeout=15) as s:
        reader = _Reader(s)
        s.sendall(raw_request("GET", "/huge", location, close=False))
        r = read_response(reader)
        assert_whole_refusal(r.status, r.headers, r.body, "GET", names)
    # The origin was not drained: the proxy stopped reading (or hung up) long before 1 GiB.
    assert origin.bytes_sent.get("/huge", 0) < HUGE // 4


@pytest.mark.parametrize("shape", SHAPES)
def test_allowed_redirect_passes_unchanged(proxy, origin, shape):
    path, method = SHAPES[shape]
    with httpx.Client(proxy=proxy.proxy_url, trust_env=False, timeout=15) as c:
        r = c.request(method, url(path, "/elsewhere"))
    assert r.status_code == (304 if shape == "304" else 302)
    assert r.headers["location"] == "/elsewhere" and "sluice-reason" not in r.headers
    expected = MOVED if path in ("/cl", "/chunked", "/close") and method == "GET" else b""
    assert r.content == expected


def test_the_audit_log_records_the_refusal_exactly_once(proxy, origin):
    location, names = TARGETS["metadata-ip"]
    mark = proxy.audit_mark()
    for path in ("/empty", "/chunked"):
        with open_socket(proxy.address, timeout=15) as s:
            s.sendall(raw_request("GET", path, location, close=True))
            r = read_response(_Reader(s))
            assert r.status == 403
    # A marker request on a fresh connection: its line comes after anything
    # the refused exchanges could still have written.
    with open_socket(proxy.address, timeout=15) as s:
        s.sendall(raw_request("GET", "/ok", "/marker", close=True))
        assert read_response(_Reader(s)).status == 200
    proxy.wait_audit(lambda e: e["status"] == 200 and e["host"] == NAME, since=mark, what="the marker request")
    refused = [e for e in proxy.audit()[mark:] if e.get("reason") == "redirect_refused"]
    assert len(refused) == 2, refused
    for entry in refused:
        assert entry["decision"] == "refuse" and entry["status"] == 403 and entry["event"] == "request"
        assert names in entry["detail"] and entry["host"] == NAME


# ------------------------------------------------------------------ intercepted TLS: HTTP/1.1 and h2


@pytest.mark.parametrize("http2", [False, True], ids=["http1.1", "h2"])
@pytest.mark.parametrize("shape", SHAPES)
def test_intercepted_client_gets_the_whole_refusal(proxy, origin, sluice_home, shape, http2):
    path, method = SHAPES[shape]
    location, names = TARGETS["internal-name"]
    with httpx.Client(proxy=proxy.proxy_url, verify=sluice_ca(sluice_home), http2=http2,
                      trust_env=False, timeout=15) as c:
        r = c.request(method, url(path, location, tls=True))
        assert r.http_version == ("HTTP/2" if http2 else "HTTP/1.1")
        assert_whole_refusal(r.status_code, r.headers, r.content, method, names)
        # The same connection (h2: the same multiplexed connection) still works.
        ok = c.get(url("/ok", "/", tls=True))
        assert ok.status_code == 200 and ok.content == b"origin ok\n"


@pytest.mark.parametrize("http2", [False, True], ids=["http1.1", "h2"])
def test_intercepted_allowed_redirect_passes_unchanged(proxy, origin, sluice_home, http2):
    with httpx.Client(proxy=proxy.proxy_url, verify=sluice_ca(sluice_home), http2=http2,
                      trust_env=False, timeout=15) as c:
        r = c.get(url("/cl", "/elsewhere", tls=True))
    assert r.status_code == 302 and r.headers["location"] == "/elsewhere" and r.content == MOVED


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_h2_huge_3xx_body_is_dropped_as_it_streams_not_held(proxy, origin, sluice_home):
    """Inside an intercepted h2 tunnel the origin's 48 MiB 3xx body is read
    and dropped chunk by chunk: the refusal arrives whole and the proxy's
    memory stays flat."""
    location, names = TARGETS["metadata-ip"]
    before = rss_kib(proxy.proc.pid)
    with httpx.Client(proxy=proxy.proxy_url, verify=sluice_ca(sluice_home), http2=True,
                      trust_env=False, timeout=30) as c:
        r = c.get(url("/huge", location, tls=True))
    assert r.http_version == "HTTP/2"
    assert_whole_refusal(r.status_code, r.headers, r.content, "GET", names)
    assert origin.bytes_sent["/huge-h2"] == 48 * 1024 * 1024  # read to its end, and dropped
    grown = rss_kib(proxy.proc.pid) - before
    assert grown < 24 * 1024, f"proxy RSS grew {grown} KiB while dropping a 48 MiB body"


@pytest.fixture(scope="module")
def short_proxy(sluice_factory, origin, tls_ca):
    policy = default_policy(ports=[80, 443, PORT, TLS_PORT])
    policy["intercept"] = [NAME]
    policy["limits"] = {"request_timeout": "2s"}
    return sluice_factory(policy, name="redirect-refusal-short",
                          extra_args=("--set", f"ssl_verify_upstream_trusted_ca={tls_ca.cafile}"))


@pytest.mark.parametrize("http2", [False, True], ids=["http1.1", "h2"])
def test_intercepted_refusal_never_waits_past_request_timeout_for_a_stalled_origin(short_proxy, released,
                                                                                   sluice_home, http2):
    """Inside TLS only mitmproxy's layers can write to the client, and they
    finish a streamed response only when the origin's body ends. An origin
    that holds its 3xx body back cannot hold the client: at the policy's
    request_timeout the client connection is closed (the client gets an
    error, not a wait until its own timeout), and the audit log records the
    redirect refusal once."""
    location, names = TARGETS["metadata-ip"]
    mark = short_proxy.audit_mark()
    with httpx.Client(proxy=short_proxy.proxy_url, verify=sluice_ca(sluice_home), http2=http2,
                      trust_env=False, timeout=httpx.Timeout(30, connect=10)) as c:
        with pytest.raises(httpx.RemoteProtocolError):
            with c.stream("GET", url("/stall", location, tls=True)) as r:
                assert r.status_code == 403 and r.headers["sluice-reason"] == "redirect_refused"
                r.read()
    assert not released.release.is_set()
    entry = short_proxy.wait_audit(lambda e: e["reason"] == "redirect_refused", since=mark, what="the refusal")
    assert names in entry["detail"] and entry["status"] == 403
