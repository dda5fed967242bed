"""Helpers for the reliability suite: process gauges, bounded waits, a raw
keep-alive client, a misbehaving origin and a misbehaving DNS server.

Everything binds or dials only the namespace's test addresses
(`scripts/in-netns.sh`): the misbehaving origin stands on 93.184.215.14 on
high ports no other test uses, the misbehaving DNS server on 127.0.0.54:53.
"""

from __future__ import annotations

import asyncio
import os
import random
import socket
import struct
import threading
import time
from pathlib import Path

import dns.flags
import dns.message
import dns.rcode
import dns.rdatatype
import dns.rrset

from harness.clients import Response, _Reader, read_response
from harness.wait import wait_until  # noqa: F401 (the reliability tests take it from here)
from harness.loops import stop_loop_thread

# SLUICE_LONG=1 runs the long variants (bigger counts); the default is short
# enough for `make test` on two cores.
LONG = os.environ.get("SLUICE_LONG", "") not in ("", "0")


def scaled(short: int, long: int) -> int:
    return long if LONG else short


# ------------------------------------------------------------------ gauges


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for pid {pid}")


class RssPeak:
    """Samples a process's RSS every 20 ms in a thread (bounded by stop())."""

    def __init__(self, pid: int):
        self.pid = pid
        self.peak = rss_kib(pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            try:
                self.peak = max(self.peak, rss_kib(self.pid))
            except (OSError, AssertionError):
                return

    def __enter__(self) -> RssPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5)


def fd_targets(pid: int) -> list[str]:
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            out.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            pass
    return sorted(out)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time the process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")



def quiet_fds(pid: int, steady: float = 1.0, timeout: float = 10.0) -> int:
    """Wait (bounded) until the fd count has not changed for `steady` seconds; return it."""
    deadline = time.monotonic() + timeout
    last, since = fd_count(pid), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = fd_count(pid)
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= steady:
            break
    return last


def settle_fds(pid: int, limit: int, timeout: float = 15.0) -> int:
    """Wait (bounded) for the proxy's fd count to come down to `limit`; return the last count."""
    last = [fd_count(pid)]

    def ok() -> bool:
        last[0] = fd_count(pid)
        return last[0] <= limit

    wait_until(ok, timeout, 0.2)
    return last[0]


# ------------------------------------------------------------------ raw client


class KeepAlive:
    """One keep-alive client connection to the proxy, sending raw requests."""

    def __init__(self, address: tuple[str, int], timeout: float = 15.0):
        self.address = address
        self.timeout = timeout
        self.sock: socket.socket | None = None
        self.reader: _Reader | None = None
        self.opened = 0

    def _open(self) -> None:
        self.sock = socket.create_connection(self.address, timeout=self.timeout)
        self.reader = _Reader(self.sock)
        self.opened += 1

    def request(self, raw: bytes, method: str = "GET") -> Response:
        """Send one request and read one response. A response of None means
        the proxy closed the connection instead of answering."""
        if self.sock is None:
            self._open()
        assert self.sock is not None and self.reader is not None
        try:
            self.sock.sendall(raw)
        except OSError:
            self.close()
            return Response(None)
        response = read_response(self.reader, method=method)
        if response.status is None or response.headers.get("connection", "").lower() == "close":
            self.close()
        return response

    def close(self) -> None:
        if self.sock is not None:
            try:
                self.sock.close()
            except OSError:
                pass
        self.sock = None
        self.reader = None


def get(url: str, host: str | None = None, close: bool = False) -> bytes:
    """Raw absolute-form GET for `url`, with its Host header."""
    if host is None:
        host = url.split("://", 1)[1].split("/", 1)[0]
    extra = "Connection: close\r\n" if close else ""
    return f"GET {url} HTTP/1.1\r\nHost: {host}\r\n{extra}\r\n".encode()


def connect_tunnel(address: tuple[str, int], authority: str,
                   timeout: float = 15.0) -> tuple[Response, socket.socket | None, _Reader | None]:
    """CONNECT `authority`; on 200 return the open socket and its reader."""
    s = socket.create_connection(address, timeout=timeout)
    try:
        s.sendall(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
        reader = _Reader(s)
        response = read_response(reader, method="CONNECT", connect=True)
    except OSError:
        s.close()
        raise
    if response.status == 200:
        return response, s, reader
    s.close()
    return response, None, None


def socks5(address: tuple[str, int], host: str, port: int,
           timeout: float = 15.0) -> tuple[int | None, socket.socket | None]:
    """SOCKS5 CONNECT by domain name. Returns (REP or None, socket when REP == 0)."""
    s = socket.create_connection(address, timeout=timeout)
    try:
        s.sendall(b"\x05\x01\x00")
        reader = _Reader(s)
        if reader.exactly(2) != b"\x05\x00":
            s.close()
            return None, None
        name = host.encode()
        s.sendall(b"\x05\x01\x00\x03" + bytes([len(name)]) + name + struct.pack("!H", port))
        head = reader.exactly(4)
        if len(head) < 4:
            s.close()
            return None, None
        bound = {1: 4, 4: 16}.get(head[3])
        if bound is None and head[3] == 3:
            bound = reader.exactly(1)[0]
        reader.exactly((bound or 0) + 2)
        if head[1] != 0:
            s.close()
            return head[1], None
        assert not reader.buf
        return 0, s
    except OSError:
        s.close()
        return None, None


# ------------------------------------------------------------------ a misbehaving origin

FAULT_IP = "93.184.215.14"  # "public", on lo inside the namespace
FAULT_PORT = 9080  # plain HTTP; no other test listens here


class FaultOrigin:
    """HTTP/1.1 on FAULT_IP:FAULT_PORT with path-selected misbehaviour:

    /reset-head       read the request, then reset (RST) before any response byte
    /reset-body/N     headers with Content-Length N, half the body, then RST
    /close-body/N     headers with Content-Length N, half the body, then FIN
    /hang             read the request, never answer (until `release()`, the
                      proxy closing the connection, or 60 s)
    /bytes/N          N bytes of "x" (Content-Length), keep-alive
    anything else     `fault ok <path>`
    """

    def __init__(self, ip: str = FAULT_IP, port: int = FAULT_PORT):
        self.ip, self.port = ip, port
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fault-origin", daemon=True)
        self.server: asyncio.AbstractServer | None = None
        self._lock = threading.Lock()
        self.connections = 0
        self.open_connections = 0
        self.paths: list[str] = []
        self._release: asyncio.Event | None = None

    def start(self) -> FaultOrigin:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)
        return self

    async def _start(self) -> None:
        self._release = asyncio.Event()
        self.server = await asyncio.start_server(self._handle, self.ip, self.port, backlog=1024)

    def release(self) -> None:
        """Let every /hang request finish (closing its connection)."""
        self.loop.call_soon_threadsafe(self._release.set)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self._release.set)
        stop_loop_thread(self.loop, self.thread, [self.server])

    def reset_counts(self) -> None:
        with self._lock:
            self.connections = 0
            self.paths.clear()
        if self._release is not None:
            self.loop.call_soon_threadsafe(self._release.clear)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with self._lock:
            self.connections += 1
            self.open_connections += 1
        try:
            while True:
                try:
                    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
                except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError):
                    return
                request_line = head.split(b"\r\n", 1)[0].decode("latin-1")
                parts = request_line.split(" ")
                path = parts[1] if len(parts) == 3 else "/"
                with self._lock:
                    self.paths.append(path)
                if not await self._respond(path, reader, writer):
                    return
        except (ConnectionError, OSError):
            return
        finally:
            with self._lock:
                self.open_connections -= 1
            writer.close()

    @staticmethod
    def _rst(writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()

    async def _respond(self, path: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        if path == "/reset-head":
            self._rst(writer)
            return False
        if path.startswith("/reset-body/") or path.startswith("/close-body/"):
            n = int(path.split("/")[2])
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % n + b"r" * (n // 2))
            await writer.drain()
            await asyncio.sleep(0.05)
            if path.startswith("/reset-body/"):
                self._rst(writer)
            return False
        if path == "/hang":
            # Until released, or the proxy hangs up (EOF), or 60 s.
            waits = [asyncio.ensure_future(self._release.wait()), asyncio.ensure_future(reader.read(1))]
            _done, pending = await asyncio.wait(waits, timeout=60, return_when=asyncio.FIRST_COMPLETED)
            for w in pending:
                w.cancel()
            return False
        if path.startswith("/bytes/"):
            body = b"x" * int(path.split("/")[2])
        else:
            body = f"fault ok {path}\n".encode()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        await writer.drain()
        return True


# ------------------------------------------------------------------ a misbehaving DNS server

EVIL_DNS_IP = "127.0.0.54"
EVIL_DNS_PORT = 53


class EvilDNS:
    """A DNS server on 127.0.0.54:53 (UDP, and TCP that answers like UDP)
    whose behaviour is chosen by the query name's first label:

    ok-*        A 8.8.8.8 (TTL 0)
    silent-*    never answers
    slow<MS>-*  A 8.8.8.8 after MS milliseconds
    garbage-*   random bytes
    short-*     the first 7 bytes of a proper answer (a cut header)
    badid-*     a proper answer with another message id
    notqr-*     the query echoed back (QR bit clear)
    qmismatch-* an answer for another question (public.example.)
    loop-*      an answer whose owner name is a compression pointer to itself
    badrdlen-*  an A record with RDLENGTH 3
    trunc-*     TC set and nothing else (the resolver retries over TCP: TCP closes)
    rcode<N>-*  that rcode (e.g. rcode2 SERVFAIL, rcode5 REFUSED, rcode15 unknown)
    poison-*    A 8.8.8.8 for the name plus A 127.0.0.1 for other names, in the
                answer and additional sections
    cnamelocal-* a CNAME to localhost. with A 127.0.0.1
    a127-*      A 127.0.0.1
    aaaa-only-* a AAAA answer to an A query (wrong type)
    mixed-*     A 8.8.8.8 and A 10.0.0.1

    `mode` ("normal", "silent", "garbage") overrides everything, to stand
    for a server that went down or went mad.
    """

    def __init__(self, host: str = EVIL_DNS_IP, port: int = EVIL_DNS_PORT, seed: int = 1):
        self.host, self.port = host, port
        self.mode = "normal"
        self.rng = random.Random(seed)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.udp: socket.socket | None = None
        self.tcp: socket.socket | None = None
        self.queries = 0
        self._lock = threading.Lock()

    def start(self) -> EvilDNS:
        self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.udp.bind((self.host, self.port))
        self.udp.settimeout(0.2)
        self.tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.tcp.bind((self.host, self.port))
        self.tcp.listen(64)
        self.tcp.settimeout(0.2)
        for target in (self._serve_udp, self._serve_tcp):
            t = threading.Thread(target=target, name=f"evildns-{target.__name__}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=3)
        for s in (self.udp, self.tcp):
            if s is not None:
                s.close()

    # -- answering
    def _wire(self, data: bytes) -> tuple[bytes | None, float]:
        """(bytes to send or None for silence, delay in seconds)."""
        if self.mode == "silent":
            return None, 0.0
        if self.mode == "garbage":
            return self.rng.randbytes(self.rng.randrange(1, 300)), 0.0
        try:
            query = dns.message.from_wire(data)
        except Exception:
            return None, 0.0
        if not query.question:
            return None, 0.0
        q = query.question[0]
        qname = q.name.to_text()
        label = qname.split(".", 1)[0].lower()
        kind = label.split("-", 1)[0] if "-" in label else label
        response = dns.message.make_response(query)
        response.flags |= dns.flags.RA

        def a(*ips: str, owner=None) -> None:
            if q.rdtype == dns.rdatatype.A:
                response.answer.append(dns.rrset.from_text_list(owner or q.name, 0, "IN", "A", list(ips)))

        if kind == "silent":
            return None, 0.0
        if kind.startswith("slow"):
            a("8.8.8.8")
            return response.to_wire(), int(kind[4:] or "0") / 1000
        if kind == "garbage":
            return self.rng.randbytes(self.rng.randrange(1, 300)), 0.0
        if kind == "short":
            a("8.8.8.8")
            return response.to_wire()[:7], 0.0
        if kind == "badid":
            a("8.8.8.8")
            wire = bytearray(response.to_wire())
            wire[0] ^= 0x5A
            return bytes(wire), 0.0
        if kind == "notqr":
            return data, 0.0
        if kind == "qmismatch":
            other = dns.message.make_query("public.example.", q.rdtype)
            other.id = query.id
            r2 = dns.message.make_response(other)
            if q.rdtype == dns.rdatatype.A:
                r2.answer.append(dns.rrset.from_text_list("public.example.", 0, "IN", "A", ["127.0.0.1"]))
            return r2.to_wire(), 0.0
        if kind == "loop":
            header = struct.pack("!HHHHHH", query.id, 0x8180, 1, 1, 0, 0)
            question = q.name.to_wire() + struct.pack("!HH", q.rdtype, 1)
            # the answer's owner name: a compression pointer to its own offset
            offset = len(header) + len(question)
            answer = struct.pack("!H", 0xC000 | offset) + struct.pack("!HHIH", 1, 1, 0, 4) + bytes([8, 8, 8, 8])
            return header + question + answer, 0.0
        if kind == "badrdlen":
            header = struct.pack("!HHHHHH", query.id, 0x8180, 1, 1, 0, 0)
            question = q.name.to_wire() + struct.pack("!HH", q.rdtype, 1)
            answer = struct.pack("!H", 0xC00C) + struct.pack("!HHIH", q.rdtype, 1, 0, 3) + bytes([127, 0, 0])
            return header + question + answer, 0.0
        if kind == "trunc":
            response.flags |= dns.flags.TC
            return response.to_wire(), 0.0
        if kind.startswith("rcode"):
            wire = bytearray(response.to_wire())
            wire[3] = (wire[3] & 0xF0) | (int(kind[5:]) & 0x0F)
            return bytes(wire), 0.0
        if kind == "poison":
            a("8.8.8.8")
            if q.rdtype == dns.rdatatype.A:
                response.answer.append(dns.rrset.from_text_list("public.example.", 0, "IN", "A", ["127.0.0.1"]))
                response.additional.append(dns.rrset.from_text_list("ns.example.", 0, "IN", "A", ["127.0.0.1"]))
            return response.to_wire(), 0.0
        if kind == "cnamelocal":
            response.answer.append(dns.rrset.from_text(q.name, 0, "IN", "CNAME", "localhost."))
            if q.rdtype == dns.rdatatype.A:
                response.answer.append(dns.rrset.from_text_list("localhost.", 0, "IN", "A", ["127.0.0.1"]))
            return response.to_wire(), 0.0
        if kind == "a127":
            a("127.0.0.1")
            return response.to_wire(), 0.0
        if kind == "aaaa":  # aaaa-only-*: a AAAA record in answer to A
            if q.rdtype == dns.rdatatype.A:
                response.answer.append(dns.rrset.from_text_list(q.name, 0, "IN", "AAAA", ["::1"]))
            return response.to_wire(), 0.0
        if kind == "mixed":
            a("8.8.8.8", "10.0.0.1")
            return response.to_wire(), 0.0
        if kind == "ok":
            a("8.8.8.8")
            return response.to_wire(), 0.0
        response.set_rcode(dns.rcode.NXDOMAIN)
        return response.to_wire(), 0.0

    def _serve_udp(self) -> None:
        while not self._stop.is_set():
            try:
                data, peer = self.udp.recvfrom(65535)
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                self.queries += 1
            try:
                wire, delay = self._wire(data)
            except Exception:
                continue
            if wire is None:
                continue
            if delay > 0:
                t = threading.Timer(delay, self._send, (wire, peer))
                t.daemon = True
                t.start()
            else:
                self._send(wire, peer)

    def _send(self, wire: bytes, peer) -> None:
        if self._stop.is_set():
            return
        try:
            self.udp.sendto(wire, peer)
        except OSError:
            pass

    def _serve_tcp(self) -> None:
        # Truncated answers make resolvers retry over TCP: close at once.
        while not self._stop.is_set():
            try:
                conn, _ = self.tcp.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.close()
