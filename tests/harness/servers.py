"""Origin servers and canary listeners on the namespace's test addresses.

All listeners run on one asyncio loop in a background thread. Each is bound to
its exact address (never a wildcard) and records what it saw:

- an origin answers HTTP/1.1 with keep-alive: `origin ok <Host header> <path>`
  (`/bytes/N` answers N bytes of "x"); a TLS origin (certificate from a
  trustme CA) also records the SNI each connection sent.
- a canary stands on an address that the proxy must never reach. It records
  every connection it accepts and, if spoken to, answers HTTP
  `canary <ip> <port>` so a leak is obvious from the client side too.

`connections` counts TCP connections accepted; `requests` lists
`SeenRequest`s. `reset()` clears both.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import threading
from dataclasses import dataclass, field
from .loops import stop_loop_thread

ORIGIN_ADDRESSES = [
    ("8.8.8.8", 80),
    ("8.8.8.8", 8080),
    ("1.1.1.1", 80),
    ("2606:4700:4700::1111", 80),
]
TLS_ORIGIN_ADDRESSES = [("8.8.8.8", 443), ("2606:4700:4700::1111", 443)]
CANARY_IPS = ["127.0.0.1", "10.0.0.1", "169.254.169.254", "100.100.100.200", "fd00:ec2::254", "::1"]
CANARY_PORTS = [80, 443, 8080]

TLS_NAMES = ["public.example", "example.com", "*.example", "v6.example", "*.example.com"]


@dataclass
class SeenRequest:
    method: str
    path: str
    host: str | None
    headers: dict[str, str]
    sni: str | None
    peer: tuple
    conn: int  # connection number on this listener


@dataclass
class Listener:
    ip: str
    port: int
    kind: str  # "origin" | "canary"
    tls: bool = False
    connections: int = 0
    requests: list[SeenRequest] = field(default_factory=list)
    peers: list[tuple] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def name(self) -> str:
        ip = f"[{self.ip}]" if ":" in self.ip else self.ip
        return f"{self.kind} {ip}:{self.port}{' (tls)' if self.tls else ''}"

    def reset(self) -> None:
        with self._lock:
            self.connections = 0
            self.requests.clear()
            self.peers.clear()

    def snapshot(self) -> tuple[int, list[SeenRequest]]:
        with self._lock:
            return self.connections, list(self.requests)

    def hosts_seen(self) -> list[str | None]:
        with self._lock:
            return [r.host for r in self.requests]


class NetServers:
    """Every origin and canary, on one event loop thread."""

    def __init__(self, server_ssl_context: ssl.SSLContext | None = None):
        self._ssl_context = server_ssl_context
        self.origins: dict[tuple[str, int], Listener] = {}
        self.canaries: dict[tuple[str, int], Listener] = {}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="netservers", daemon=True)
        self._servers: list[asyncio.AbstractServer] = []
        self._sni: dict[int, str | None] = {}

    # ------------------------------------------------------------ public API
    def origin(self, ip: str, port: int) -> Listener:
        return self.origins[(ip, port)]

    def canary(self, ip: str, port: int) -> Listener:
        return self.canaries[(ip, port)]

    def all_listeners(self) -> list[Listener]:
        return [*self.origins.values(), *self.canaries.values()]

    def reset(self) -> None:
        for listener in self.all_listeners():
            listener.reset()

    def canary_hits(self) -> dict[str, int]:
        """Canaries that accepted at least one connection: name -> count."""
        return {c.name: c.connections for c in self.canaries.values() if c.connections}

    def start(self) -> NetServers:
        self._thread.start()
        fut = asyncio.run_coroutine_threadsafe(self._start_all(), self._loop)
        fut.result(timeout=20)
        return self

    def stop(self) -> None:
        stop_loop_thread(self._loop, self._thread, self._servers)

    # ------------------------------------------------------------ internals
    async def _start_all(self) -> None:
        for ip, port in ORIGIN_ADDRESSES:
            await self._listen(Listener(ip, port, "origin"), self.origins)
        if self._ssl_context is not None:
            self._ssl_context.sni_callback = self._on_sni
            for ip, port in TLS_ORIGIN_ADDRESSES:
                await self._listen(Listener(ip, port, "origin", tls=True), self.origins)
        for ip in CANARY_IPS:
            for port in CANARY_PORTS:
                await self._listen(Listener(ip, port, "canary"), self.canaries)

    def _on_sni(self, sslobj, server_name, _context):
        self._sni[id(sslobj)] = server_name
        return None

    async def _listen(self, listener: Listener, registry: dict) -> None:
        family = socket.AF_INET6 if ":" in listener.ip else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        try:
            sock.bind((listener.ip, listener.port))
        except OSError as e:
            sock.close()
            raise RuntimeError(f"cannot bind {listener.name}: {e}") from e
        sock.listen(128)
        sock.setblocking(False)

        async def handler(reader, writer):
            await self._handle(listener, reader, writer)

        server = await asyncio.start_server(
            handler,
            sock=sock,
            ssl=self._ssl_context if listener.tls else None,
            ssl_handshake_timeout=10 if listener.tls else None,
            limit=1 << 16,
        )
        self._servers.append(server)
        registry[(listener.ip, listener.port)] = listener

    async def _handle(self, listener: Listener, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        peer = writer.get_extra_info("peername")
        sni = None
        if listener.tls:
            sslobj = writer.get_extra_info("ssl_object")
            sni = self._sni.pop(id(sslobj), None) if sslobj is not None else None
        with listener._lock:
            listener.connections += 1
            conn_no = listener.connections
            listener.peers.append(peer)
        try:
            while True:
                try:
                    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=30)
                except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError):
                    return
                lines = head.decode("latin-1").split("\r\n")
                parts = lines[0].split(" ")
                if len(parts) != 3:
                    await self._send(writer, 400, b"bad request line\n", close=True)
                    return
                method, target, version = parts
                headers: dict[str, str] = {}
                for line in lines[1:]:
                    if not line:
                        continue
                    k, _, v = line.partition(":")
                    headers[k.strip().lower()] = v.strip()
                await self._read_body(reader, headers)
                host = headers.get("host")
                with listener._lock:
                    listener.requests.append(SeenRequest(method, target, host, headers, sni, peer, conn_no))
                conn_hdr = headers.get("connection", "").lower()
                close = conn_hdr == "close" or (version == "HTTP/1.0" and conn_hdr != "keep-alive")
                if listener.kind == "canary":
                    body = f"canary {listener.ip} {listener.port}\n".encode()
                elif target.startswith("/bytes/"):
                    body = b"x" * int(target.split("/")[2])
                else:
                    body = f"origin ok {host} {target}\n".encode()
                await self._send(writer, 200, body, close=close, head=(method == "HEAD"))
                if close:
                    return
        except (ConnectionError, OSError, ssl.SSLError, ValueError, EOFError, asyncio.LimitOverrunError):
            # EOFError covers asyncio.IncompleteReadError (a client that hangs up mid-body).
            return
        finally:
            try:
                writer.close()
            except Exception:
                pass

    @staticmethod
    async def _read_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> bytes:
        if "content-length" in headers:
            return await reader.readexactly(int(headers["content-length"]))
        if headers.get("transfer-encoding", "").lower() == "chunked":
            body = b""
            while True:
                size_line = await reader.readuntil(b"\r\n")
                size = int(size_line.split(b";")[0].strip(), 16)
                if size == 0:
                    # trailers until empty line
                    while (await reader.readuntil(b"\r\n")) != b"\r\n":
                        pass
                    return body
                body += await reader.readexactly(size)
                await reader.readexactly(2)
        return b""

    @staticmethod
    async def _send(writer, status: int, body: bytes, close: bool, head: bool = False) -> None:
        reason = {200: "OK", 400: "Bad Request"}.get(status, "OK")
        header = (
            f"HTTP/1.1 {status} {reason}\r\n"
            f"Content-Type: text/plain\r\n"
            f"Content-Length: {len(body)}\r\n"
            f"Connection: {'close' if close else 'keep-alive'}\r\n\r\n"
        ).encode()
        writer.write(header + (b"" if head else body))
        await writer.drain()
