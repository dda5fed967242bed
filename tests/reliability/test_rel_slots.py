"""Sockets and slots (issue 18, items 2 and 3): one client cannot take the
proxy's file descriptors or its connection slots.

1. Upstreams per client connection: one keep-alive client connection asking
   many distinct public addresses (here: many ports of 8.8.8.8) held one
   upstream socket per address until it closed. With
   `limits.max_upstreams_per_connection` the least recently used idle one is
   closed first, so the proxy's fds and the origin's open connections stay
   within 1 + the limit, and the most recent ones are still reused.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from harness import default_policy
from harness.sluice import free_port
from relkit import KeepAlive, fd_count, get, quiet_fds, wait_until

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
        async def close() -> None:
            for s in self.servers:
                s.close()

        asyncio.run_coroutine_threadsafe(close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)

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
