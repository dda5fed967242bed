"""A two-virtual-host origin on one address, and clients for attacks inside
intercepted tunnels (tests/integration/test_interception_holds.py,
tests/reliability/test_rel_intercept.py).

    origin = VhostOrigin("1.1.1.1", tls_port=8443, plain_port=8081, server_ctx=ctx).start()
    origin.seen()              # every request: Seen(vhost, method, target, headers, sni, port)
    origin.seen("b.example")   # those routed to b.example
    origin.reset()

It serves every virtual host name on one address, as a shared HTTP server
does, and routes a request the way RFC 9112 origins do: by the request
target's authority when the target is absolute-form, else by the Host header,
else (no Host at all, e.g. HTTP/1.0) to its `default_vhost`, as nginx's
`default_server` does. `/bytes/N` answers N bytes instead of JSON. A
WebSocket upgrade request gets `101 Switching Protocols`, then every byte is
echoed back raw (`websocket_bytes` counts them).
Like nginx it skips empty lines before a request line. Every request is
recorded before it is answered; the answer is JSON naming the virtual host
(`{"vhost": ..., "method": ..., "target": ..., "headers": {...}}`) with an
`X-Vhost` header. Bytes that are not an HTTP request head are recorded as
vhost None, method "<garbage>", and answered 400.

Clients:

    sock = open_tunnel(proxy, "connect-tls", sluice_ca)   # or connect-plain, socks-tls, socks-plain
    outcome = exchange(sock, [b"DE", b"LETE /admin HTTP/1.1\r\n..."], pause=0.15)
    outcome.kind        # "response" | "closed" | "timeout" | "tls_error"
    outcome.response    # harness.clients.Response when kind == "response"
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import socket
import ssl
import threading
import time
from dataclasses import dataclass, field

from .clients import Response, _Reader, connect, read_response, socks5_connect
from .loops import stop_loop_thread

# The two virtual hosts (and a third name) served on one address.
A, B, C = "a.example", "b.example", "c.example"
ORIGIN_IP = "1.1.1.1"
TLS_PORT, PLAIN_PORT = 8443, 8081
# How a client reaches the intercepted host: CONNECT or SOCKS5, then TLS or plain HTTP.
MODES = ("connect-tls", "connect-plain", "socks-tls", "socks-plain")


@dataclass
class Seen:
    vhost: str | None
    method: str
    target: str
    headers: dict[str, str]  # lower-case names
    sni: str | None
    port: int
    body_len: int = 0


def _vhost_of(authority: str | None) -> str | None:
    if not authority:
        return None
    host = authority.strip().lower()
    if host.startswith("["):
        return host.split("]", 1)[0] + "]"
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


@dataclass
class VhostOrigin:
    ip: str
    tls_port: int
    plain_port: int
    server_ctx: ssl.SSLContext
    default_vhost: str | None = None
    _seen: list[Seen] = field(default_factory=list)
    connections: int = 0
    tls_server_names: list[str | None] = field(default_factory=list)  # the SNI of every TLS connection
    websocket_bytes: int = 0  # bytes echoed after a 101

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="vhost-origin", daemon=True)
        self.servers: list[asyncio.AbstractServer] = []
        self.server_ctx.sni_callback = self._on_sni

    # ------------------------------------------------------------ records
    def seen(self, vhost: str | None = "*") -> list[Seen]:
        with self._lock:
            return [s for s in self._seen if vhost == "*" or s.vhost == vhost]

    def reset(self) -> None:
        with self._lock:
            self._seen.clear()
            self.connections = 0
            self.tls_server_names.clear()
            self.websocket_bytes = 0

    def _record(self, seen: Seen) -> None:
        with self._lock:
            self._seen.append(seen)

    # ------------------------------------------------------------ lifecycle
    def start(self) -> VhostOrigin:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)
        return self

    async def _start(self) -> None:
        self.servers = [
            await asyncio.start_server(lambda r, w: self._handle(r, w, self.tls_port), self.ip, self.tls_port,
                                       ssl=self.server_ctx),
            await asyncio.start_server(lambda r, w: self._handle(r, w, self.plain_port), self.ip, self.plain_port),
        ]

    def stop(self) -> None:
        stop_loop_thread(self.loop, self.thread, self.servers)

    @staticmethod
    def _on_sni(sslobj, server_name, _context):
        sslobj.sluice_sni = server_name  # read back per connection
        return None

    # ------------------------------------------------------------ serving
    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, port: int) -> None:
        with self._lock:
            self.connections += 1
        sslobj = writer.get_extra_info("ssl_object")
        sni = getattr(sslobj, "sluice_sni", None) if sslobj is not None else None
        if sslobj is not None:
            with self._lock:
                self.tls_server_names.append(sni)
        try:
            while True:
                line = await reader.readline()
                while line in (b"\r\n", b"\n"):  # nginx skips empty lines before a request
                    line = await reader.readline()
                if not line:
                    return
                lines = [line.decode("latin-1").rstrip("\r\n")]
                while len(lines) <= 200:
                    field_line = await reader.readline()
                    if field_line in (b"\r\n", b"\n", b""):
                        break
                    lines.append(field_line.decode("latin-1").rstrip("\r\n"))
                parts = lines[0].split(" ")
                if len(parts) != 3 or not parts[2].startswith("HTTP/"):
                    self._record(Seen(None, "<garbage>", lines[0][:200], {}, sni, port))
                    writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                    await writer.drain()
                    return
                method, target, _ = parts
                headers: dict[str, str] = {}
                for h in lines[1:]:
                    if h:
                        k, _, v = h.partition(":")
                        headers[k.strip().lower()] = v.strip()
                if "://" in target:  # absolute-form: the target's authority routes (RFC 9112 3.2.2)
                    vhost = _vhost_of(target.split("://", 1)[1].split("/", 1)[0])
                else:
                    vhost = _vhost_of(headers.get("host"))
                if vhost is None:
                    vhost = self.default_vhost
                body_len = await self._drain_body(reader, headers)
                self._record(Seen(vhost, method, target, headers, sni, port, body_len))
                body = json.dumps({"vhost": vhost, "method": method, "target": target, "headers": headers,
                                   "sni": sni, "port": port}).encode()
                close = headers.get("connection", "").lower() == "close"
                if headers.get("upgrade", "").lower() == "websocket" and "sec-websocket-key" in headers:
                    accept = base64.b64encode(hashlib.sha1(
                        (headers["sec-websocket-key"] + "258EAFA5-E914-47DA-95CA-C5AB0DC85B11").encode()).digest())
                    writer.write(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                                 b"Sec-WebSocket-Accept: " + accept + b"\r\n\r\n")
                    await writer.drain()
                    while chunk := await reader.read(65536):
                        with self._lock:
                            self.websocket_bytes += len(chunk)
                        writer.write(chunk)
                        await writer.drain()
                    return
                if target.startswith("/bytes/") and target[7:].isdigit():
                    n = int(target[7:])
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % n)
                    for _ in range(n // 65536):
                        writer.write(b"x" * 65536)
                        await writer.drain()
                    writer.write(b"x" * (n % 65536))
                    await writer.drain()
                    continue
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Vhost: %s\r\nContent-Length: %d\r\n%s\r\n"
                    % ((vhost or "-").encode("latin-1", "replace"), len(body), b"Connection: close\r\n" if close
                       else b"")
                    + (b"" if method == "HEAD" else body)
                )
                await writer.drain()
                if close:
                    return
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, OSError, ssl.SSLError,
                ValueError):
            return
        finally:
            writer.close()

    @staticmethod
    async def _drain_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> int:
        if "chunked" in headers.get("transfer-encoding", "").lower():
            total = 0
            while True:
                size = int((await reader.readuntil(b"\r\n")).split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    await reader.readuntil(b"\r\n")
                    return total
                total += len(await reader.readexactly(size))
                await reader.readexactly(2)
        if "content-length" in headers:
            return len(await reader.readexactly(int(headers["content-length"])))
        return 0


# ---------------------------------------------------------------- clients


def start_vhost_origin(tls_ca, fake_dns) -> VhostOrigin:
    """The two-vhost origin of the interception tests, started: a, b and c
    resolve to ORIGIN_IP; b is the default virtual host, as an nginx
    default_server would be."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    # Explicit names: OpenSSL never matches the session certificate's
    # "*.example" (a wildcard over a single-label suffix) when mitmproxy
    # verifies the upstream.
    tls_ca.ca.issue_cert(A, B, C).configure_cert(ctx)
    for name in (A, B, C):
        fake_dns.set(name, a=[ORIGIN_IP], ttl=300)
    return VhostOrigin(ORIGIN_IP, TLS_PORT, PLAIN_PORT, ctx, default_vhost=B).start()

def mode_port(mode: str) -> int:
    return TLS_PORT if mode.endswith("-tls") else PLAIN_PORT


def mode_scheme(mode: str) -> str:
    return "https" if mode.endswith("-tls") else "http"


def open_tunnel(proxy, mode: str, sluice_ca: str, host: str = A, sni: str | None = None,
                timeout: float = 5.0) -> socket.socket:
    """A tunnel to host through the proxy (CONNECT or SOCKS5 with the name),
    TLS inside it for the -tls modes (trusting the Sluice CA). Asserts it opened."""
    how, _, layer = mode.partition("-")
    port = TLS_PORT if layer == "tls" else PLAIN_PORT
    if how == "connect":
        response, tunnel = connect(proxy.address, f"{host}:{port}", timeout=timeout)
        assert response.status == 200 and tunnel is not None, f"CONNECT {host}:{port} -> {response}"
        assert not tunnel.reader.buf, "bytes after the CONNECT answer"
        sock = tunnel.sock
    else:
        result = socks5_connect(proxy.socks_address, host, port, timeout=timeout)
        assert result.ok and result.tunnel is not None, f"SOCKS5 {host}:{port} -> reply {result.reply}"
        assert not result.tunnel.reader.buf, "bytes after the SOCKS5 reply"
        sock = result.tunnel.sock
    if layer == "tls":
        ctx = ssl.create_default_context(cafile=sluice_ca)
        sock = ctx.wrap_socket(sock, server_hostname=sni or host)
    sock.settimeout(timeout)
    return sock


@dataclass
class Outcome:
    kind: str  # "response" | "closed" | "timeout" | "tls_error"
    response: Response | None = None
    error: str = ""

    @property
    def status(self) -> int | None:
        return self.response.status if self.response is not None else None

    @property
    def from_origin(self) -> bool:
        """The answer came from the origin (it names a virtual host)."""
        return self.response is not None and "x-vhost" in self.response.headers

    def __repr__(self) -> str:
        return f"Outcome({self.kind}, {self.response!r}{', ' + self.error if self.error else ''})"


def exchange(sock: socket.socket, chunks: list[bytes], pause: float = 0.15, method: str = "GET",
             close: bool = True) -> Outcome:
    """Send chunks with a pause between them, then read one response (bounded
    by the socket's timeout). Closes the socket unless close=False."""
    reader = _Reader(sock)
    try:
        for i, chunk in enumerate(chunks):
            if i:
                time.sleep(pause)
            sock.sendall(chunk)
        while b"\r\n\r\n" not in reader.buf:
            if not reader._fill():
                return Outcome("closed", error=repr(reader.buf[:200]))
        return Outcome("response", read_response(reader, method=method))
    except TimeoutError:
        return Outcome("timeout", error=repr(reader.buf[:200]))
    except (ssl.SSLEOFError, ssl.SSLZeroReturnError) as e:  # the proxy closed the TLS connection
        return Outcome("closed", error=repr(e))
    except ssl.SSLError as e:  # bytes that are not TLS records (e.g. plaintext) on a TLS connection
        return Outcome("tls_error", error=repr(e))
    except (ConnectionError, OSError) as e:
        return Outcome("closed", error=repr(e))
    finally:
        if close:
            try:
                sock.close()
            except OSError:
                pass
