"""The tunnel splice (sluice/splice.py), in process over Unix socket pairs (no
network): once spliced, a tunnel's bytes go socket to socket without ever
reaching mitmproxy's readers, metered by the dialer's meters in their order
(the cap truncates, counts are kept); the end of each direction and the loss
of a socket still reach mitmproxy's stream protocol; flow control holds (a
side whose writes back up stops the other being read); a direction with
bytes mitmproxy has not read yet is spliced only once they are read; the
idle watchdog sees the traffic. (End to end, through the proxy:
tests/integration/test_tunnel_splice.py.)"""

from __future__ import annotations

import asyncio
import socket
from dataclasses import dataclass
from typing import Any

from mitmproxy import connection

from sluice.dialer import MeteredReader, MeteredWriter
from sluice.splice import splice


@dataclass
class IO:  # mitmproxy's ConnectionIO: the streams of one connection
    reader: Any
    writer: Any


class Watchdog:
    def __init__(self) -> None:
        self.activity = 0

    def register_activity(self) -> None:
        self.activity += 1


class Handler:  # what splice reads of mitmproxy's ConnectionHandler
    def __init__(self) -> None:
        self.transports: dict = {}
        self.timeout_watchdog = Watchdog()


class Counting:
    """A meter like the caps' tunnel meter: counts, and passes at most `cap` bytes per direction."""

    def __init__(self, cap: int | None = None) -> None:
        self.cap, self.seen = cap, {True: 0, False: 0}

    def __call__(self, from_client: bool, n: int) -> int:
        allowed = n if self.cap is None else max(0, min(n, self.cap - self.seen[from_client]))
        self.seen[from_client] += allowed
        return allowed


async def streams(sock: socket.socket):
    return await asyncio.open_connection(sock=sock)


async def tunnel(meters=(), *, server_first: bytes = b"", client_first: bytes = b""):
    """A client app, an origin app (plain sockets, nonblocking) and the
    proxy's two sides as mitmproxy holds them (asyncio streams, the server's
    metered like the dialer's), optionally with bytes already sent to the
    proxy before the splice."""
    client_app, proxy_client = socket.socketpair()
    proxy_server, origin_app = socket.socketpair()
    for s in (client_app, origin_app):
        s.setblocking(False)
    client_app.sendall(client_first)
    origin_app.sendall(server_first)
    c_reader, c_writer = await streams(proxy_client)
    s_reader, s_writer = await streams(proxy_server)
    meters = list(meters)
    if meters:
        s_reader, s_writer = MeteredReader(s_reader, meters), MeteredWriter(s_writer, meters[::-1])
    handler = Handler()
    client = connection.Client(peername=("127.0.0.1", 40000), sockname=("127.0.0.1", 8080), timestamp_start=0)
    server = connection.Server(address=("8.8.8.8", 443))
    handler.transports[client] = IO(c_reader, c_writer)
    handler.transports[server] = IO(s_reader, s_writer)
    await asyncio.sleep(0.01)  # what was sent first is in the readers
    return handler, client, server, client_app, origin_app


async def recv(sock: socket.socket, n: int, timeout: float = 2.0) -> bytes:
    loop = asyncio.get_running_loop()
    out = b""
    while len(out) < n:
        chunk = await asyncio.wait_for(loop.sock_recv(sock, n - len(out)), timeout)
        if not chunk:
            break
        out += chunk
    return out


def run(coro):
    return asyncio.run(coro)


def raw_reader(handler: Handler, conn) -> asyncio.StreamReader:
    reader = handler.transports[conn].reader
    return reader._reader if isinstance(reader, MeteredReader) else reader


def test_bytes_go_socket_to_socket_metered_and_mitmproxy_reads_none():
    async def main():
        meter = Counting()
        handler, client, server, client_app, origin_app = await tunnel([meter])
        spliced = splice(handler, client, server)
        assert spliced is not None and spliced.client_half.engaged and spliced.server_half.engaged
        loop = asyncio.get_running_loop()
        await loop.sock_sendall(client_app, b"hello origin")
        assert await recv(origin_app, 12) == b"hello origin"
        await loop.sock_sendall(origin_app, b"x" * 100_000)
        assert await recv(client_app, 100_000) == b"x" * 100_000
        assert meter.seen == {True: 12, False: 100_000}
        # Nothing went through mitmproxy's readers.
        assert not raw_reader(handler, client)._buffer and not raw_reader(handler, server)._buffer
        assert handler.timeout_watchdog.activity >= 2
    run(main())


def test_the_cap_truncates_in_each_direction():
    async def main():
        handler, client, server, client_app, origin_app = await tunnel([Counting(cap=5)])
        assert splice(handler, client, server) is not None
        loop = asyncio.get_running_loop()
        await loop.sock_sendall(client_app, b"0123456789")
        await loop.sock_sendall(origin_app, b"abcdefghij")
        assert await recv(origin_app, 5) == b"01234"
        assert await recv(client_app, 5) == b"abcde"
        await loop.sock_sendall(client_app, b"more")
        await asyncio.sleep(0.05)
        origin_app.setblocking(False)
        try:
            extra = origin_app.recv(100)
        except BlockingIOError:
            extra = b""
        assert extra == b""  # past the cap nothing more goes out
    run(main())


def test_meters_apply_in_the_dialers_order():
    async def main():
        calls = []

        def first(from_client, n):
            calls.append(("first", from_client))
            return n

        def second(from_client, n):
            calls.append(("second", from_client))
            return n

        handler, client, server, client_app, origin_app = await tunnel([first, second])
        assert splice(handler, client, server) is not None
        loop = asyncio.get_running_loop()
        await loop.sock_sendall(origin_app, b"down")
        await recv(client_app, 4)
        await loop.sock_sendall(client_app, b"up")
        await recv(origin_app, 2)
        # The origin's bytes as MeteredReader applies them, the client's as MeteredWriter does.
        assert calls == [("first", False), ("second", False), ("second", True), ("first", True)]
    run(main())


def test_eof_and_loss_reach_mitmproxys_readers():
    async def main():
        handler, client, server, client_app, origin_app = await tunnel()
        assert splice(handler, client, server) is not None
        client_app.shutdown(socket.SHUT_WR)
        assert await asyncio.wait_for(handler.transports[client].reader.read(10), 2) == b""  # mitmproxy sees the EOF
        origin_app.close()
        assert await asyncio.wait_for(handler.transports[server].reader.read(10), 2) == b""
        client_app.close()
    run(main())


def test_unread_bytes_are_not_overtaken():
    async def main():
        handler, client, server, client_app, origin_app = await tunnel(client_first=b"early")
        spliced = splice(handler, client, server)
        assert spliced is not None
        assert not spliced.client_half.engaged  # mitmproxy still holds "early"
        assert spliced.server_half.engaged
        loop = asyncio.get_running_loop()
        await loop.sock_sendall(client_app, b" later")
        await asyncio.sleep(0.05)
        reader = handler.transports[client].reader
        assert await reader.read(100) == b"early later"  # both still mitmproxy's, in order
        spliced.engage()  # what SplicedTunnel does after relaying a chunk
        assert spliced.client_half.engaged
        await loop.sock_sendall(client_app, b"direct")
        assert await recv(origin_app, 6) == b"direct"
    run(main())


def test_a_backed_up_side_stops_the_other_being_read():
    async def main():
        handler, client, server, client_app, origin_app = await tunnel()
        client_transport = handler.transports[client].writer.transport
        server_transport = handler.transports[server].writer.transport
        client_transport.set_write_buffer_limits(high=1024, low=256)
        assert splice(handler, client, server) is not None
        client_app.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        chunk = b"y" * 65536
        sent = 0
        # The client app reads nothing: the proxy's write buffer toward it fills.
        for _ in range(200):
            try:
                sent += origin_app.send(chunk)
            except BlockingIOError:
                await asyncio.sleep(0.01)
            if not server_transport.is_reading():
                break
            await asyncio.sleep(0)
        assert not server_transport.is_reading()  # the origin is no longer read
        got = b""
        while True:
            try:
                got += await recv(client_app, 65536, timeout=0.3)
            except TimeoutError:
                break
            if server_transport.is_reading():
                break
        assert server_transport.is_reading()  # the client read: the origin is read again
        assert sent > 0 and got
    run(main())


def test_a_stream_that_is_no_asyncio_socket_is_not_spliced():
    async def main():
        handler, client, server, client_app, origin_app = await tunnel()
        handler.transports[server] = IO(object(), object())  # e.g. mitmproxy_rs streams
        assert splice(handler, client, server) is None
        client_app.close()
        origin_app.close()
    run(main())
