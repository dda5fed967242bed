"""Raw clients: exact bytes on the wire, for spellings real clients normalise.

- `http_request(proxy, raw)` sends raw request bytes to the proxy and parses
  one HTTP/1.1 response.
- `absolute_form(proxy, url)` / `origin_form(proxy, host_header, path)`.
- `connect(proxy, authority)` sends CONNECT; on 200 it hands back the socket
  (a tunnel) to keep using.
- `socks5_connect(socks, host, port)` does a SOCKS5 CONNECT with the host sent
  as a domain name (ATYP 3) exactly as given, or as ATYP 1/4 for IP literals
  when asked, and returns the reply code and the socket.
- `curl(...)` runs curl with a clean environment (no proxy variables, no
  ~/.curlrc) and returns status, headers and body.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import ssl
import struct
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Response:
    status: int | None  # None: the connection closed without a response
    reason: str = ""
    headers: dict[str, str] = field(default_factory=dict)  # lower-case names
    body: bytes = b""
    raw_head: bytes = b""

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")

    @property
    def sluice_reason(self) -> str | None:
        return self.headers.get("sluice-reason")

    def __repr__(self) -> str:
        return f"Response({self.status} {self.reason!r}, headers={self.headers}, body={self.body[:200]!r})"


def _addr(hostport: tuple[str, int] | str) -> tuple[str, int]:
    if isinstance(hostport, tuple):
        return hostport
    host, _, port = hostport.rpartition(":")
    return host.strip("[]"), int(port)


class _Reader:
    def __init__(self, sock):
        self.sock = sock
        self.buf = b""

    def _fill(self) -> bool:
        chunk = self.sock.recv(65536)
        if not chunk:
            return False
        self.buf += chunk
        return True

    def until(self, marker: bytes) -> bytes | None:
        while marker not in self.buf:
            if not self._fill():
                return None
        i = self.buf.index(marker) + len(marker)
        out, self.buf = self.buf[:i], self.buf[i:]
        return out

    def exactly(self, n: int) -> bytes:
        while len(self.buf) < n:
            if not self._fill():
                break
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def rest(self) -> bytes:
        while self._fill():
            pass
        out, self.buf = self.buf, b""
        return out


def read_response(reader: _Reader, method: str = "GET", connect: bool = False) -> Response:
    try:
        head = reader.until(b"\r\n\r\n")
    except (ConnectionError, TimeoutError, OSError):
        head = None
    if head is None:
        return Response(None, raw_head=reader.buf)
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    status = int(parts[1])
    reason = parts[2] if len(parts) > 2 else ""
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if line:
            k, _, v = line.partition(":")
            headers[k.strip().lower()] = v.strip()
    if method == "HEAD" or status in (204, 304) or (connect and 200 <= status < 300):
        body = b""
    elif "content-length" in headers:
        body = reader.exactly(int(headers["content-length"]))
    elif headers.get("transfer-encoding", "").lower() == "chunked":
        body = b""
        while True:
            size_line = reader.until(b"\r\n")
            if size_line is None:
                break
            size = int(size_line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                reader.until(b"\r\n")
                break
            body += reader.exactly(size)
            reader.exactly(2)
    else:
        body = reader.rest()
    return Response(status, reason, headers, body, head)


def open_socket(addr: tuple[str, int] | str, timeout: float = 10, source: str | None = None) -> socket.socket:
    """A connection to addr, from the local address `source` when given (quota tests tell clients apart by it)."""
    return socket.create_connection(_addr(addr), timeout=timeout,
                                    source_address=(source, 0) if source is not None else None)


def http_request(proxy: tuple[str, int] | str, raw: bytes, timeout: float = 15) -> Response:
    """Send raw request bytes on a new connection; parse one response."""
    with open_socket(proxy, timeout) as s:
        s.sendall(raw)
        method = raw.split(b" ", 1)[0].decode()
        return read_response(_Reader(s), method=method, connect=(method == "CONNECT"))


def absolute_form(proxy, url: str, host_header: str | None = None, method: str = "GET", close: bool = True) -> Response:
    if host_header is None:
        authority = url.split("://", 1)[1].split("/", 1)[0]
        host_header = authority.rsplit("@", 1)[-1]
    raw = f"{method} {url} HTTP/1.1\r\nHost: {host_header}\r\n"
    if close:
        raw += "Connection: close\r\n"
    return http_request(proxy, (raw + "\r\n").encode())


def origin_form(proxy, host_header: str, path: str = "/", method: str = "GET") -> Response:
    raw = f"{method} {path} HTTP/1.1\r\nHost: {host_header}\r\nConnection: close\r\n\r\n"
    return http_request(proxy, raw.encode())


class Tunnel:
    """A CONNECT (or SOCKS) tunnel: send raw HTTP through it, maybe over TLS."""

    def __init__(self, sock: socket.socket, reader: _Reader):
        self.sock = sock
        self.reader = reader

    def start_tls(self, server_hostname: str, cafile: str) -> ssl.SSLSocket:
        ctx = ssl.create_default_context(cafile=cafile)
        assert not self.reader.buf, "unexpected bytes before TLS"
        tls = ctx.wrap_socket(self.sock, server_hostname=server_hostname)
        self.sock = tls
        self.reader = _Reader(tls)
        return tls

    def request(self, host: str, path: str = "/", close: bool = False) -> Response:
        raw = f"GET {path} HTTP/1.1\r\nHost: {host}\r\n"
        if close:
            raw += "Connection: close\r\n"
        self.sock.sendall((raw + "\r\n").encode())
        return read_response(self.reader)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def connect(proxy, authority: str, timeout: float = 15, source: str | None = None) -> tuple[Response, Tunnel | None]:
    """CONNECT authority (from the local address `source` when given); returns
    (response, tunnel or None). Caller closes the tunnel."""
    s = open_socket(proxy, timeout, source)
    s.sendall(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
    reader = _Reader(s)
    response = read_response(reader, method="CONNECT", connect=True)
    if response.status == 200:
        return response, Tunnel(s, reader)
    s.close()
    return response, None


@dataclass
class SocksResult:
    reply: int | None  # SOCKS5 REP field; None if the proxy closed first
    tunnel: Tunnel | None

    @property
    def ok(self) -> bool:
        return self.reply == 0


def socks5_connect(socks, host: str, port: int, atyp: str = "domain", timeout: float = 15,
                   source: str | None = None) -> SocksResult:
    """SOCKS5 CONNECT (from the local address `source` when given). atyp:
    "domain" (send `host` text as is), or "ip" (ATYP 1/4)."""
    s = open_socket(socks, timeout, source)
    reader = _Reader(s)
    try:
        s.sendall(b"\x05\x01\x00")
        greet = reader.exactly(2)
        if greet != b"\x05\x00":
            s.close()
            return SocksResult(None, None)
        if atyp == "domain":
            name = host.encode("utf-8")
            addr = b"\x03" + bytes([len(name)]) + name
        else:
            ip = ipaddress.ip_address(host.strip("[]"))
            addr = (b"\x01" if ip.version == 4 else b"\x04") + ip.packed
        s.sendall(b"\x05\x01\x00" + addr + struct.pack("!H", port))
        head = reader.exactly(4)
        if len(head) < 2:
            s.close()
            return SocksResult(None, None)
        reply = head[1]
        if len(head) == 4:
            bound_len = {1: 4, 4: 16}.get(head[3])
            if bound_len is None and head[3] == 3:
                bound_len = reader.exactly(1)[0]
            reader.exactly((bound_len or 0) + 2)
        if reply != 0:
            s.close()
            return SocksResult(reply, None)
        return SocksResult(0, Tunnel(s, reader))
    except (ConnectionError, TimeoutError, OSError):
        s.close()
        return SocksResult(None, None)


# ---------------------------------------------------------------- curl

CLEAN_ENV_DROP = {"http_proxy", "https_proxy", "all_proxy", "no_proxy", "ftp_proxy", "socks_proxy"}


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.lower() not in CLEAN_ENV_DROP and k != "CURL_HOME"}


@dataclass
class CurlResult:
    returncode: int
    status: int  # %{http_code}: final response (0 if none)
    connect_status: int  # %{http_connect}: the proxy's CONNECT answer (0 if none)
    headers: dict[str, str]  # of the last response head
    body: bytes
    stderr: str

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")

    @property
    def sluice_reason(self) -> str | None:
        return self.headers.get("sluice-reason")


def curl(*args: str, timeout: float = 20) -> CurlResult:
    """Run `curl -q -sS <args>`; args carry the proxy option and the URL."""
    with tempfile.TemporaryDirectory() as d:
        headers_file = Path(d) / "h"
        body_file = Path(d) / "b"
        cmd = [
            "curl",
            "-q",
            "-sS",
            "--max-time",
            str(int(timeout)),
            "-D",
            str(headers_file),
            "-o",
            str(body_file),
            "-w",
            "%{http_code} %{http_connect}",
            *args,
        ]
        p = subprocess.run(cmd, capture_output=True, text=True, env=clean_env(), timeout=timeout + 10)
        codes = (p.stdout.strip() or "0 0").split()
        raw_headers = headers_file.read_bytes().decode("latin-1") if headers_file.exists() else ""
        body = body_file.read_bytes() if body_file.exists() else b""
    # -D holds every response head (CONNECT answer, then the real one); keep the last.
    heads = [h for h in raw_headers.split("\r\n\r\n") if h.strip()]
    headers: dict[str, str] = {}
    if heads:
        for line in heads[-1].split("\r\n")[1:]:
            k, _, v = line.partition(":")
            headers[k.strip().lower()] = v.strip()
    return CurlResult(p.returncode, int(codes[0]), int(codes[1]) if len(codes) > 1 else 0, headers, body, p.stderr)
