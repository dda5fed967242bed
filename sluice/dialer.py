"""The one place an upstream connection is opened (like Smokescreen's single `dialContext`).

mitmproxy opens every upstream TCP connection in
`ConnectionHandler.open_connection`, which ends in `asyncio.open_connection`;
addons/mitm_patches.py (`dial_check`) routes that call, for a connection
handler's dials only, to `Dialer.dial`. It runs, in this order:

1. **Pin.** Only an (IP, port) the gate approved for this client connection
   is dialled, never a name, so neither mitmproxy nor the OS resolves one
   (`pin_mismatch`).
2. **Loop.** Not one of the proxy's own host's addresses (addons/own_host.py),
   which the gate refused when it decided; this catches an address that
   became the host's since (`proxy_loop`).
3. **Room.** The client connection's upstream table (addons/upstreams.py)
   makes room under `limits.max_upstreams_per_connection`, or says why not.
4. **Connect** within the approving rules' `limits.connect_timeout`, counted
   from the start of the handler's dial (its hooks and mitmproxy's wait for a
   per-address slot included), so a blackholed origin is `connect_timeout`.
5. **Peer.** The connected socket's peer must be the pinned address, else the
   socket is aborted before a byte passes and the client connection closed
   (`pin_mismatch`): an invariant checked at the socket itself.
6. **Meters.** A passed-through tunnel's bytes are metered at its server
   socket (the tunnel byte cap, the transfer quota): the streams returned are
   wrapped once, with every meter that applies.

A refusal raises an OSError subclass whose text is `reason: sentence`;
mitmproxy reports it as a failed connect (`server_connect_error`, then the
flow's `error`), and addons/caps.py turns the timeout and the busy cases into
the client's answer.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from sluice.addons import open_files
from sluice.addons.audit import peer
from sluice.addons.own_host import OWN_HOST
from sluice.policy.decide import canonical_ip
from sluice.policy.model import Rules
from sluice.policy.reasons import Reason

OUT_OF_FILES_DIAL = "the proxy is out of file descriptors and could not open a connection to the origin"
UPSTREAMS_BUSY = "every upstream connection this client connection may hold is busy"

# meter(from_client, n) -> how many of those n bytes may pass.
Meter = Callable[[bool, int], int]
# The meter a server connection's streams get, if any (asked at its dial).
MeterSource = Callable[[Any, Any], "Meter | None"]
Connect = Callable[..., Awaitable[tuple[Any, Any]]]


class DialRefused(OSError):
    """Sluice refused this dial; the text is `reason: sentence`."""


class ConnectTimedOut(DialRefused):
    """The origin did not accept within the connect timeout."""


class OutOfFilesDial(OSError):
    """A dial the process had no file descriptor for (EMFILE and the like):
    reported once (addons/open_files.py) and refused by the caps."""


class Audit(Protocol):
    def write(self, **record: Any) -> None: ...


@functools.lru_cache(maxsize=4096)
def pinned_ip(text: str) -> str | None:
    """An IP literal in the form the gate pins (policy.decide.canonical_ip),
    None for a name. Cached: it runs several times per connection on the
    tunnel-setup hot path."""
    try:
        return canonical_ip(text)
    except ValueError:
        return None


class Dialer:
    def __init__(
        self,
        pins: Callable[[Any, str, int], Rules | None],
        audit: Audit,
        proxy_addresses: Callable[[], frozenset[str]] = frozenset,
        close_client: Callable[[Any], object] = lambda client: None,
    ) -> None:
        # pins(client, ip, port): the rules that approved that address for
        # that client connection (None: never approved). The gate's table.
        self.pins = pins
        self.audit = audit
        self.proxy_addresses = proxy_addresses
        self.close_client = close_client
        # room(client, server) -> None, or why no upstream can be opened now.
        self.room: Callable[[Any, Any], str | None] | None = None
        # Inner first: for reads the first meter sees the bytes first, for
        # writes the last one does (each wraps the one before it).
        self.meter_sources: list[MeterSource] = []

    # ---- the checks, each also usable on its own -----------------------------

    def approved(self, client: Any, host: str, port: int) -> Rules | None:
        """The pin and the loop check: the approving rules, or None (refused
        and audited: `pin_mismatch` or `proxy_loop`)."""
        ip = pinned_ip(str(host))
        rules = self.pins(client, ip, port) if ip is not None else None
        if rules is None:
            self._refused(client, host, port, Reason.PIN_MISMATCH,
                          f"a dial to {_short(str(host))}:{port} was not approved for this client connection; "
                          "refused before connecting")
            return None
        loop = OWN_HOST.refusal(rules, self.proxy_addresses(), (ip,), port)
        if loop is not None:
            self._refused(client, host, port, Reason.PROXY_LOOP, f"{loop.detail}; refused before connecting")
            return None
        return rules

    def peer_pinned(self, client: Any, address: tuple[str, int], peername: tuple | None) -> bool:
        """After the connect: the socket's peer is the pinned address (else
        audited `pin_mismatch`)."""
        peer_ip = pinned_ip(str(peername[0])) if peername else None
        if peer_ip is not None and peer_ip == pinned_ip(str(address[0])) and peername[1] == address[1]:
            return True
        self._refused(client, address[0], address[1], Reason.PIN_MISMATCH,
                      f"the upstream connection's peer {peername} was never approved for this client connection")
        return False

    def meter_for(self, client: Any, server: Any) -> list[Meter]:
        return [m for source in self.meter_sources if (m := source(client, server)) is not None]

    # ---- the dial ------------------------------------------------------------

    async def dial(self, client: Any, server: Any, host: str, port: int, connect: Connect,
                   *args: Any, started: float | None = None, **kwargs: Any) -> tuple[Any, Any]:
        rules = self.approved(client, host, port)
        if rules is None:
            raise DialRefused(f"{Reason.PIN_MISMATCH.value}: Sluice refused to dial {host}:{port}, "
                              "which was not approved for this client connection")
        if self.room is not None and server is not None:
            why = self.room(client, server)
            if why:
                raise DialRefused(why)
        loop = asyncio.get_running_loop()
        seconds = rules.limits.connect_timeout
        left = seconds - (loop.time() - started) if started is not None else seconds
        try:
            if left <= 0:
                raise TimeoutError
            reader, writer = await asyncio.wait_for(connect(host, port, *args, **kwargs), left)
        except TimeoutError:
            raise ConnectTimedOut(f"{Reason.CONNECT_TIMEOUT.value}: {host} did not accept a connection "
                                  f"within {seconds:g}s") from None
        except OSError as e:
            if not open_files.is_out_of_files(e):
                raise
            open_files.report("dialling an origin", e)
            raise OutOfFilesDial(e.errno, OUT_OF_FILES_DIAL) from None
        peername = writer.get_extra_info("peername")
        if not self.peer_pinned(client, (host, port), peername):
            transport = getattr(writer, "transport", None)
            if transport is not None:
                transport.abort()  # not one byte to that peer
            else:
                writer.close()
            loop.call_soon(self.close_client, client)
            raise DialRefused(f"{Reason.PIN_MISMATCH.value}: the upstream connection's peer {peername} "
                              "was never approved for this client connection")
        meters = self.meter_for(client, server) if server is not None else []
        if meters:
            return MeteredReader(reader, meters), MeteredWriter(writer, meters[::-1])
        return reader, writer

    def _refused(self, client: Any, host: str, port: int, reason: Reason, detail: str) -> None:
        self.audit.write(event="connect", client=peer(client), host=str(host), port=port, decision="refuse",
                         reason=reason.value, detail=detail)


class MeteredReader:
    """A server connection's reader: each meter, in order, says how much of
    what the server sent may pass."""

    __slots__ = ("_reader", "_meters")

    def __init__(self, reader: Any, meters: list[Meter]) -> None:
        self._reader, self._meters = reader, meters

    async def read(self, n: int = -1) -> bytes:
        data = await self._reader.read(n)
        for meter in self._meters:
            if not data:
                break
            allowed = meter(False, len(data))
            if allowed < len(data):
                data = data[:allowed]
        return data

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reader, name)


class MeteredWriter:
    """A server connection's writer: each meter, in order, says how much of
    what the client sent may pass."""

    __slots__ = ("_writer", "_meters")

    def __init__(self, writer: Any, meters: list[Meter]) -> None:
        self._writer, self._meters = writer, meters

    def write(self, data: bytes) -> None:
        for meter in self._meters:
            if not data:
                break
            allowed = meter(True, len(data))
            if allowed < len(data):
                data = data[:allowed]
        if data:
            self._writer.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._writer, name)


def _short(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[:limit] + "…"


def unwrap_stream(stream: Any) -> tuple[Any, list[Meter]]:
    """The stream under a metered one and its meters, in the order they
    apply (a plain stream: itself, no meters). For sluice/splice.py, which
    meters a spliced tunnel's bytes with the same meters."""
    if isinstance(stream, MeteredReader):
        return stream._reader, stream._meters
    if isinstance(stream, MeteredWriter):
        return stream._writer, stream._meters
    return stream, []
