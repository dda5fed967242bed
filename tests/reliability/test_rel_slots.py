"""Sockets and slots (issue 18, items 2 and 3): one client cannot take the
proxy's file descriptors or its connection slots.

1. Upstreams per client connection: one keep-alive client connection asking
   many distinct public addresses (here: many ports of 8.8.8.8) held one
   upstream socket per address until it closed. With
   `limits.max_upstreams_per_connection` the least recently used idle one is
   closed first, so the proxy's fds and the origin's open connections stay
   within 1 + the limit, and the most recent ones are still reused.
2. Idle connections from one source: connections that never send a byte
   (or SOCKS5 greetings with no CONNECT) were not counted against
   `max_connections` and held a `max_total_connections` slot for the whole
   idle timeout, so one source filled the proxy and every other source was
   refused at accept. Now they count from accept, a connection's first head
   or SOCKS5 handshake must complete within `header_timeout` of its accept,
   and one source may hold all slots but a reserve.
3. Out of file descriptors: with its open-files limit lowered under a
   connection flood, the proxy pauses accepting and refuses dials it cannot
   make, with one line on stderr each (rate-limited), never a traceback, and
   serves again once the flood is gone.
"""

from __future__ import annotations

import asyncio
import os
import resource
import socket
import threading
import time

import pytest

from harness import default_policy
from harness.sluice import free_port
from harness.clients import _Reader, read_response
from relkit import KeepAlive, fd_count, get, quiet_fds, settle_fds, wait_until
from harness.loops import stop_loop_thread

pytestmark = pytest.mark.netns

MANY_IP = "8.8.8.8"


class ManyPortsOrigin:
    """Keep-alive HTTP/1.1 on MANY_IP on `count` free ports; counts open connections."""

    def __init__(self, count: int):
        self.ports = sorted({free_port(MANY_IP) for _ in range(count * 2)})[:count]
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="many-ports-origin", daemon=True)
        self.servers: list[asyncio.AbstractServer] = []
        self.lock = threading.Lock()
        self.accepted = 0
        self.open = 0

    def start(self) -> ManyPortsOrigin:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)
        return self

    async def _start(self) -> None:
        for port in self.ports:
            self.servers.append(await asyncio.start_server(self._handle, MANY_IP, port))

    def stop(self) -> None:
        stop_loop_thread(self.loop, self.thread, self.servers)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with self.lock:
            self.accepted += 1
            self.open += 1
        try:
            while True:
                await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 60)
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nok\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError, OSError):
            pass
        finally:
            with self.lock:
                self.open -= 1
            writer.close()


@pytest.fixture(scope="module")
def many_ports(net):
    origin = ManyPortsOrigin(40).start()
    yield origin
    origin.stop()


UPSTREAMS = 4


def test_one_client_connection_holds_at_most_max_upstreams_sockets(sluice_factory, many_ports):
    origin = many_ports
    proxy = sluice_factory(default_policy(ports=origin.ports, limits={"max_upstreams_per_connection": UPSTREAMS,
                                                                      "max_connections": 1}),
                           name="upstreams")
    pid = proxy.proc.pid
    before = quiet_fds(pid)
    conn = KeepAlive(proxy.address)
    peak_fds = peak_open = 0
    try:
        for port in origin.ports:
            r = conn.request(get(f"http://{MANY_IP}:{port}/"))
            assert r.status == 200, (port, r.status, r.sluice_reason, r.body[:200])
            peak_fds = max(peak_fds, fd_count(pid) - before)
            with origin.lock:
                peak_open = max(peak_open, origin.open)
        assert conn.opened == 1, "the client connection was closed along the way"
        # The proxy keeps at most UPSTREAMS upstream sockets for it (the
        # origin sees them), plus the client socket itself.
        assert wait_until(lambda: origin.open <= UPSTREAMS, 10), origin.open
        assert peak_open <= UPSTREAMS + 1, peak_open  # a closed one may still be on its way out
        assert quiet_fds(pid) - before <= 1 + UPSTREAMS
        assert peak_fds <= 1 + UPSTREAMS + 1, peak_fds
        # The most recently used ones are still open and reused: no new dial.
        accepted = origin.accepted
        for port in origin.ports[-UPSTREAMS:]:
            assert conn.request(get(f"http://{MANY_IP}:{port}/again")).status == 200
        assert origin.accepted == accepted, (origin.accepted, accepted)
        # And one evicted long ago is dialled again, fine.
        assert conn.request(get(f"http://{MANY_IP}:{origin.ports[0]}/back")).status == 200
        assert conn.opened == 1
    finally:
        conn.close()
    assert wait_until(lambda: origin.open == 0, 10), origin.open
    lines = [e for e in proxy.audit() if e.get("decision") == "refuse"]
    assert not lines, lines


# ------------------------------------------------------------------ idle slots

ABUSER, VICTIM = "127.0.0.70", "127.0.0.71"
TOTAL = 40  # reserve: min(max(16, 5%), half) = 16, so one source holds at most 24
SHARE = TOTAL - 16
HEADER_TIMEOUT = 2.0


def _open(address, source: str) -> socket.socket:
    return socket.create_connection(address, timeout=10, source_address=(source, 0))


def _closed_by_proxy(sock: socket.socket, within: float) -> tuple[bool, bytes]:
    """Whether the proxy closed `sock` within `within` seconds (what it sent first)."""
    sock.settimeout(within)
    data = b""
    try:
        while True:
            chunk = sock.recv(4096)
            if not chunk:
                return True, data
            data += chunk
    except TimeoutError:
        return False, data
    except ConnectionResetError:
        return True, data


@pytest.fixture(scope="module")
def slots_proxy(sluice_factory):
    policy = default_policy(limits={"max_total_connections": TOTAL, "max_connections": 8,
                                    "header_timeout": f"{HEADER_TIMEOUT:g}s"})
    return sluice_factory(policy, socks=True, name="slots")


def test_idle_connections_from_one_source_leave_slots_for_the_others(slots_proxy, net):
    proxy = slots_proxy
    net.origin("8.8.8.8", 80)
    mark = proxy.audit_mark()
    idle: list[socket.socket] = []
    try:
        for _ in range(TOTAL + 10):
            idle.append(_open(proxy.address, ABUSER))
        time.sleep(0.5)  # every one accepted (or closed at accept)
        # Another source is still served, at once.
        victim = KeepAlive(proxy.address)
        victim.sock = _open(proxy.address, VICTIM)
        victim.reader = _Reader(victim.sock)
        r = victim.request(get("http://8.8.8.8/victim"))
        assert r.status == 200, (r.status, r.sluice_reason, r.body[:300])
        victim.close()
        # The abuser holds its share and no more: the rest were closed at accept.
        refused = [e for e in proxy.audit()[mark:] if e["reason"] == "too_many_connections"
                   and e["client"].startswith(ABUSER + ":")]
        assert len(refused) == TOTAL + 10 - SHARE, len(refused)
        assert all(e["event"] == "connection" and "kept for other sources" in e["detail"] for e in refused), refused[:2]
        # And none is held past header_timeout: each gets 408 and is closed.
        answers = []
        for sock in idle[: SHARE]:
            closed, data = _closed_by_proxy(sock, HEADER_TIMEOUT + 10)
            assert closed, "an idle connection was still open well past header_timeout"
            answers.append(data)
        assert all(a.startswith(b"HTTP/1.1 408 ") or a == b"" for a in answers)
        assert any(b"header_timeout" in a for a in answers)
    finally:
        for sock in idle:
            sock.close()
    lines = proxy.wait_audit(lambda e: e["reason"] == "header_timeout" and e["event"] == "connection", since=mark)
    assert "of connecting" in lines["detail"]


def test_idle_connections_count_against_max_connections_from_accept(slots_proxy, net):
    """max_connections is 8: eight connections that never sent a byte leave
    no room for a ninth's request (it used to count only connections that
    had sent one)."""
    proxy = slots_proxy
    origin = net.origin("8.8.8.8", 80)
    source = "127.0.0.72"
    idle = [_open(proxy.address, source) for _ in range(8)]
    try:
        time.sleep(0.3)
        ninth = KeepAlive(proxy.address)
        ninth.sock = _open(proxy.address, source)
        ninth.reader = _Reader(ninth.sock)
        r = ninth.request(get("http://8.8.8.8/ninth"))
        assert (r.status, r.sluice_reason) == (429, "too_many_connections"), (r.status, r.sluice_reason)
        assert "already has 8 connections open" in r.body.decode()
        ninth.close()
    finally:
        for sock in idle:
            sock.close()
    assert not [r for r in origin.requests if r.path == "/ninth"]
    # Once they are gone, the source is served again (bounded wait for the closes).
    def served() -> bool:
        c = KeepAlive(proxy.address)
        c.sock = _open(proxy.address, source)
        c.reader = _Reader(c.sock)
        try:
            return c.request(get("http://8.8.8.8/after-idle", close=True)).status == 200
        finally:
            c.close()
    assert wait_until(served, 10, 0.3)


def test_socks5_greeting_without_connect_is_closed_after_header_timeout(slots_proxy):
    proxy = slots_proxy
    mark = proxy.audit_mark()
    sock = socket.create_connection(proxy.socks_address, timeout=10)
    try:
        sock.sendall(b"\x05\x01\x00")
        assert _Reader(sock).exactly(2) == b"\x05\x00"
        started = time.monotonic()
        closed, data = _closed_by_proxy(sock, HEADER_TIMEOUT + 10)
        assert closed and data == b"", (closed, data)
        assert time.monotonic() - started >= HEADER_TIMEOUT - 0.5
    finally:
        sock.close()
    line = proxy.wait_audit(lambda e: e["reason"] == "header_timeout", since=mark)
    assert line["event"] == "connection" and "SOCKS5 handshake" in line["detail"], line
    # A SOCKS5 client that completes its handshake at once is served.
    from relkit import socks5
    rep, tunnel = socks5(proxy.socks_address, "8.8.8.8", 80)
    assert rep == 0, rep
    tunnel.sendall(b"GET /socks-ok HTTP/1.1\r\nHost: 8.8.8.8\r\nConnection: close\r\n\r\n")
    assert read_response(_Reader(tunnel)).status == 200
    tunnel.close()


# ------------------------------------------------------------------ out of fds


def test_out_of_file_descriptors_is_one_line_not_a_traceback(sluice_factory, net):
    """max_total_connections set far over what the lowered limit holds, so
    the flood really takes every fd (unset, the limit derived from the fd
    limit would close the flood at accept)."""
    proxy = sluice_factory(default_policy(limits={"max_total_connections": 1000}), name="emfile")
    pid = proxy.proc.pid
    base = quiet_fds(pid)
    # A keep-alive client accepted before the flood, to ask for a dial after it.
    early = KeepAlive(proxy.address)
    assert early.request(get("http://8.8.8.8/before")).status == 200
    early.request(get("http://1.1.1.1/before"))  # its upstreams now take fds too
    # The limit is on fd numbers: room for about 12 more above the highest.
    limit = max(int(fd) for fd in os.listdir(f"/proc/{pid}/fd")) + 1 + 12
    soft, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (limit, hard))  # the soft one: it can be raised back
    mark = proxy.stderr_mark()
    flood: list[socket.socket] = []
    try:
        for _ in range(60):
            try:
                flood.append(socket.create_connection(proxy.address, timeout=5))
            except OSError:
                break
        assert wait_until(lambda: "out of file descriptors" in proxy.stderr_since(mark), 10), proxy.stderr_since(mark)
        time.sleep(2.5)  # several accept pauses
        # A dial the proxy has no fd for is a refusal, not a crash.
        r = early.request(get("http://[2606:4700:4700::1111]/during"))
        assert (r.status, r.sluice_reason) == (429, "too_many_connections"), (r.status, r.sluice_reason, r.body[:300])
        assert b"out of file descriptors" in r.body
    finally:
        for s in flood:
            s.close()
        early.close()
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, hard))
    settle_fds(pid, base + 10, 20)
    text = proxy.stderr_since(mark)
    assert "Traceback" not in text, text[-4000:]
    emfile_lines = [line for line in text.splitlines() if "open files" in line or "file descriptors" in line]
    assert 1 <= len(emfile_lines) <= 4, text[-4000:]
    # It serves again.
    assert KeepAlive(proxy.address).request(get("http://8.8.8.8/after", close=True)).status == 200

