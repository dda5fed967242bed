"""A passed-through tunnel's bytes, moved socket to socket below mitmproxy.

mitmproxy carries a raw tunnel (CONNECT not intercepted, SOCKS5,
transparent) through its whole per-connection machinery: every chunk is
read by the connection's handler task, taken through the server-event lock,
handed down the layer stack (mode layer, HTTP layer, HTTP/1 server, the
CONNECT stream, the TCP layer) as a generator event, turned back into a
SendData command, written, and followed by a drain of every writer of the
connection. For a tunnel whose every check is already made (decided, pinned
and connected by the one dialer, sluice/dialer.py), none of that decides
anything.

So once such a tunnel is connected, `splice` moves its bytes directly: each
of the two sockets' asyncio transports gets a protocol (`_Half`) whose
`data_received` meters the chunk with the very meters the dialer put on the
server connection's streams (the tunnel byte cap, the transfer quota: they
count `bytes_in`/`bytes_out` for the audit line and cut as bytes flow) and
writes it to the other transport. Flow control is the transports' own: when
one side's write buffer fills, the other side stops being read until it
drains.

Everything else stays mitmproxy's, unchanged: the connection handler, its
tasks and the layers still own both connections. The end of a direction
(EOF) and the loss of a socket are handed to the stream protocol mitmproxy
installed, so its handler sees them exactly as before (half-close, close,
`server_disconnected`, `client_disconnected`, and so the one release of the
connection's state, addons/conn_release.py). Anything that closes the
connection the mitmproxy way (a cap, a time limit, a revocation on reload,
the drain: addons/connections.py `close_client`) closes these sockets too.
Activity feeds the connection's idle watchdog, so the idle timeout sees the
tunnel's traffic as it did.

A direction is only spliced once mitmproxy has read everything it had
buffered from that socket (else bytes would overtake bytes still queued in
its reader); until then its chunks go to mitmproxy's stream protocol as
before, and `SplicedTunnel` engages it after relaying each one. A socket
that is not an asyncio selector transport (mitmproxy's own WireGuard or
local-mode streams) is never spliced: mitmproxy's relay carries it as
shipped.

The seam in mitmproxy (docs/mitmproxy-patches.md, "The tunnel splice"):
`ConnectionHandler.transports` (the streams of each connection),
`TimeoutWatchdog.register_activity`, and the TCP layer's `start`, whose end
is where a tunnel is known connected. addons/mitm_patches.py lists them in
RELIED_ON (`tunnel_splice`), with the asyncio stream internals read here.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from mitmproxy import connection
from mitmproxy.proxy import events, layer, layers

from sluice.addons import connections
from sluice.dialer import Meter, unwrap_stream

logger = logging.getLogger("sluice.splice")


class _Half(asyncio.Protocol):
    """One socket's incoming bytes, metered and written to the other socket.

    Installed on that socket's transport in place of mitmproxy's stream
    protocol (`original`), to which it hands everything that is not data
    (the end of the stream, the loss of the socket, write flow control), so
    mitmproxy's handler still sees those."""

    __slots__ = ("original", "reader", "transport", "peer", "meters", "from_client", "watchdog", "engaged",
                 "paused_peer", "other")

    def __init__(self, original: asyncio.BaseProtocol, reader: asyncio.StreamReader, transport: asyncio.Transport,
                 peer: asyncio.Transport, meters: list[Meter], from_client: bool, watchdog: Any) -> None:
        self.original = original
        self.reader = reader  # mitmproxy's reader for this socket
        self.transport = transport
        self.peer = peer  # where this socket's bytes go
        self.meters = meters
        self.from_client = from_client
        self.watchdog = watchdog
        self.engaged = False  # until then, chunks go to mitmproxy as shipped
        self.paused_peer = False  # this side's writes are backed up: the peer is not read
        self.other: _Half | None = None

    def engage(self) -> bool:
        """Splice this direction once mitmproxy's reader holds nothing
        unread (nothing can overtake it then). Whether it is spliced."""
        if not self.engaged and not self.reader._buffer:
            self.engaged = True
        return self.engaged

    def data_received(self, data: bytes) -> None:
        if not self.engaged:
            self.original.data_received(data)  # type: ignore[attr-defined]
            return
        self.watchdog.register_activity()  # the idle timeout sees the tunnel's traffic
        for meter in self.meters:
            allowed = meter(self.from_client, len(data))
            if allowed < len(data):
                data = data[:allowed]
                if not data:
                    return
        peer = self.peer
        if not peer.is_closing():
            peer.write(data)

    def eof_received(self) -> bool | None:
        return self.original.eof_received()  # type: ignore[attr-defined]

    def connection_lost(self, exc: Exception | None) -> None:
        if self.paused_peer:
            # This socket's write buffer is gone with it: the peer is read
            # again (its bytes are dropped, its EOF reaches mitmproxy).
            self.paused_peer = False
            _resume(self.peer)
        self.original.connection_lost(exc)

    def pause_writing(self) -> None:
        # This socket's write buffer is full of the peer's bytes: stop reading the peer.
        self.original.pause_writing()
        if self.other is not None and self.other.engaged and not self.paused_peer:
            self.paused_peer = True
            self.peer.pause_reading()

    def resume_writing(self) -> None:
        self.original.resume_writing()
        if self.paused_peer:
            self.paused_peer = False
            _resume(self.peer)


def _resume(transport: asyncio.Transport) -> None:
    if not transport.is_closing():
        transport.resume_reading()


class Splice:
    """The two halves of one spliced tunnel."""

    __slots__ = ("client_half", "server_half")

    def __init__(self, client_half: _Half, server_half: _Half) -> None:
        self.client_half, self.server_half = client_half, server_half

    def engage(self) -> None:
        self.client_half.engage()
        self.server_half.engage()


def splice(handler: Any, client: connection.Client, server: connection.Server) -> Splice | None:
    """Splice this tunnel's two sockets (see the module docstring); None when
    they cannot be (not both open asyncio sockets): mitmproxy relays it."""
    client_io = handler.transports.get(client)
    server_io = handler.transports.get(server)
    if client_io is None or server_io is None:
        return None
    client_reader, client_meters = unwrap_stream(client_io.reader)
    server_reader, server_meters = unwrap_stream(server_io.reader)
    _, writer_meters = unwrap_stream(server_io.writer)
    client_transport = _transport(client_io.writer)
    server_transport = _transport(server_io.writer)
    if (client_meters or client_transport is None or server_transport is None
            or not isinstance(client_reader, asyncio.StreamReader)
            or not isinstance(server_reader, asyncio.StreamReader)
            or server_meters != writer_meters[::-1]):
        return None
    watchdog = handler.timeout_watchdog
    # The dialer's meters on the server streams, in the order they apply:
    # for what the origin sends as its reader applies them, for what the
    # client sends as its writer does (sluice/dialer.py).
    client_half = _Half(client_transport.get_protocol(), client_reader, client_transport, server_transport,
                        writer_meters, True, watchdog)
    server_half = _Half(server_transport.get_protocol(), server_reader, server_transport, client_transport,
                        server_meters, False, watchdog)
    client_half.other, server_half.other = server_half, client_half
    client_transport.set_protocol(client_half)
    server_transport.set_protocol(server_half)
    spliced = Splice(client_half, server_half)
    spliced.engage()
    return spliced


def _transport(writer: Any) -> asyncio.Transport | None:
    """The plain socket transport under a stream writer (None: not one)."""
    raw, _ = unwrap_stream(writer)
    transport = getattr(raw, "transport", None) if isinstance(raw, asyncio.StreamWriter) else None
    if transport is None or transport.is_closing() or not hasattr(transport, "set_protocol"):
        return None
    if transport.get_extra_info("sslcontext") is not None:
        return None
    return transport


class SplicedTunnel(layers.TCPLayer):
    """mitmproxy's TCP layer for a passed-through tunnel (no TCP flow, no
    per-chunk hook), whose two sockets are spliced once it is connected.
    Ends, closes and half-closes are still this layer's (TCPLayer's)."""

    def __init__(self, context: Any) -> None:
        super().__init__(context, ignore=True)
        self.spliced: Splice | None = None

    def start(self, event: events.Event) -> layer.CommandGenerator[None]:
        yield from super().start(event)
        if self._handle_event != self.relay_messages:
            return  # the connection failed: TCPLayer closed the client
        handler = connections.handler_of(self.context.client)
        if handler is not None:
            try:
                self.spliced = splice(handler, self.context.client, self.context.server)
            except Exception:  # never worse than mitmproxy's own relay
                logger.exception("sluice: splicing a tunnel failed; mitmproxy relays it")
                self.spliced = None

    _handle_event = start

    def relay_messages(self, event: events.Event) -> layer.CommandGenerator[None]:
        yield from super().relay_messages(event)
        if self.spliced is not None and isinstance(event, events.DataReceived):
            self.spliced.engage()  # what mitmproxy had buffered is relayed: splice from here
