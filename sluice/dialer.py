"""The one place an upstream connection is opened (like Smokescreen's single `dialContext`).

mitmproxy opens every upstream TCP connection in
`ConnectionHandler.open_connection`, which ends in `asyncio.open_connection`;
addons/mitm_patches.py (`dial_check`) routes that call, for a connection
handler's dials only, to `Dialer.dial`. It runs, in this order:

1. **Pin.** Only an (IP, port) the gate approved for this client connection
   is dialled, never a name, so neither mitmproxy nor the OS resolves one
   (`pin_mismatch`).
2. **Loop.** Not one of the proxy's own host's addresses (sluice/own_host.py),
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

With a parent proxy (the approving rules' `upstream_proxy`), step 4 connects
to the parent instead, the peer check (5) checks the parent's address (it may
be private: it is accepted only for dials routed through it), and then
`connect_through_parent` sends `CONNECT <pinned IP>:<port>` (never a name)
and reads the parent's reply, bounded. Whatever goes over the tunnel after
that (TLS, an origin-form HTTP request with its Host, SOCKS5 and transparent
tunnels' bytes) is mitmproxy's as on a direct connection. Any failure of the
parent, down, refusing, slow, is `upstream_proxy_failed` with its status line.

A refusal raises an OSError subclass whose text is `reason: sentence`;
mitmproxy reports it as a failed connect (`server_connect_error`, then the
flow's `error`), and addons/caps.py turns the timeout and the busy cases into
the client's answer.
"""

from __future__ import annotations

import asyncio
import functools
import re
import socket
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from sluice import open_files
from sluice.addons.audit import peer
from sluice.own_host import OWN_HOST, parent_loop_detail
from sluice.policy.hosts import canonical_ip
from sluice.policy.model import Rules, UpstreamProxy
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


class UpstreamProxyFailed(DialRefused):
    """The parent proxy was down, slow, or did not answer the CONNECT with 2xx."""

    def __init__(self, detail: str) -> None:
        super().__init__(f"{Reason.UPSTREAM_PROXY_FAILED.value}: {detail}")


class ParentReplyRefused(Exception):
    """connect_through_parent: the parent's reply was not a 2xx (or not HTTP);
    the text describes it, sanitised and bounded."""


class OutOfFilesDial(OSError):
    """A dial the process had no file descriptor for (EMFILE and the like):
    reported once (sluice/open_files.py) and refused by the caps."""


class Audit(Protocol):
    def write(self, **record: Any) -> None: ...


@functools.lru_cache(maxsize=4096)
def pinned_ip(text: str) -> str | None:
    """An IP literal in the form the gate pins (policy.hosts.canonical_ip),
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
        deadline = (started if started is not None else loop.time()) + seconds
        if rules.upstream_proxy is not None:
            reader, writer = await self.dial_through_parent(client, rules.upstream_proxy, host, port, connect, args,
                                                            kwargs, deadline, seconds)
        else:
            try:
                left = deadline - loop.time()
                if left <= 0:
                    raise TimeoutError
                reader, writer = await asyncio.wait_for(connect(host, port, *args, **kwargs), left)
            except TimeoutError:
                raise ConnectTimedOut(f"{Reason.CONNECT_TIMEOUT.value}: {host} did not accept a connection "
                                      f"within {seconds:g}s") from None
            except OSError as e:
                raise _out_of_files_or(e) from None
            self._check_peer(client, writer, (host, port))
        meters = self.meter_for(client, server) if server is not None else []
        if meters:
            return MeteredReader(reader, meters), MeteredWriter(writer, meters[::-1])
        return reader, writer

    def _check_peer(self, client: Any, writer: Any, address: tuple[str, int]) -> None:
        """The connected socket's peer is `address`, else it is aborted (not
        one byte to that peer), the client connection closed, and the dial
        refused `pin_mismatch`."""
        peername = writer.get_extra_info("peername")
        if self.peer_pinned(client, address, peername):
            return
        _abort(writer)
        asyncio.get_running_loop().call_soon(self.close_client, client)
        raise DialRefused(f"{Reason.PIN_MISMATCH.value}: the upstream connection's peer {peername} "
                          "was never approved for this client connection")

    async def dial_through_parent(self, client: Any, parent: UpstreamProxy, ip: str, port: int, connect: Connect,
                                  args: tuple[Any, ...], kwargs: dict[str, Any], deadline: float,
                                  seconds: float) -> tuple[Any, Any]:
        """Connect to the parent proxy (its name, if it has one, resolved by
        the system resolver: the parent is the operator's, like the DNS
        servers), check the socket's peer is the parent's address, and open
        `CONNECT ip:port` through it, all before `deadline`."""
        loop = asyncio.get_running_loop()
        where = f"the parent proxy {parent.url}"

        def left() -> float:
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise TimeoutError
            return remaining

        try:
            if pinned_ip(parent.host) is not None:
                addresses = [parent.host]
            else:
                try:
                    infos = await asyncio.wait_for(
                        loop.getaddrinfo(parent.host, parent.port, type=socket.SOCK_STREAM), left())
                except socket.gaierror as e:
                    raise UpstreamProxyFailed(f"{where}: its name does not resolve ({e.strerror or e})") from None
                addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
            for address in addresses:
                # A name of this host on a listening port: the load-time check sees only literals.
                loop_detail = parent_loop_detail(address, parent.port, self.proxy_addresses())
                if loop_detail is not None:
                    raise UpstreamProxyFailed(f"{where} {loop_detail}")
            failure: OSError | None = None
            for address in addresses:
                try:
                    reader, writer = await asyncio.wait_for(connect(address, parent.port, *args, **kwargs), left())
                    break
                except TimeoutError:
                    raise
                except OSError as e:
                    if open_files.is_out_of_files(e):
                        raise _out_of_files_or(e) from None
                    failure = e
            else:
                why = (failure.strerror or str(failure)) if failure is not None else "no address"
                raise UpstreamProxyFailed(f"{where} is down or unreachable ({why})")
        except TimeoutError:
            raise UpstreamProxyFailed(f"{where} did not accept a connection within {seconds:g}s") from None
        self._check_peer(client, writer, (address, parent.port))
        authorization = parent.authorization.reveal() if parent.authorization is not None else None
        target = _authority(ip, port)
        try:
            await asyncio.wait_for(connect_through_parent(reader, writer, ip, port, authorization), left())
        except BaseException as e:
            _abort(writer)
            if isinstance(e, TimeoutError):
                raise UpstreamProxyFailed(f"{where} did not answer CONNECT {target} within {seconds:g}s") from None
            if isinstance(e, ParentReplyRefused):
                raise UpstreamProxyFailed(f"{where} {e} to CONNECT {target}") from None
            if isinstance(e, (OSError, EOFError)):
                raise UpstreamProxyFailed(f"{where} closed the connection before answering CONNECT {target}") from None
            raise
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


# The parent's reply to CONNECT: a status line and header fields, read line
# by line (never past the blank line: what follows is the tunnel's) and
# bounded in bytes and lines, so a hostile parent's endless header costs at
# most this (plus the stream reader's own line limit) before it is refused.
MAX_PARENT_REPLY_BYTES = 16 * 1024
MAX_PARENT_REPLY_LINES = 100
MAX_STATUS_CHARS = 120
_STATUS_LINE = re.compile(rb"HTTP/1\.[01] ([0-9]{3})(?: [^\r\n]*)?\r?\n")


async def connect_through_parent(reader: Any, writer: Any, ip: str, port: int, authorization: str | None) -> None:
    """Send `CONNECT ip:port` (with Proxy-Authorization when given) and read
    the parent's reply head. Returns on a 2xx; raises ParentReplyRefused
    (saying what the parent answered) otherwise, EOFError or OSError if the
    connection ends first."""
    target = _authority(ip, port)
    head = f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n"
    if authorization is not None:
        head += f"Proxy-Authorization: {authorization}\r\n"
    writer.write((head + "\r\n").encode("latin-1"))
    await writer.drain()
    status: bytes | None = None
    seen = lines = 0
    while True:
        try:
            line = await reader.readuntil(b"\n")
        except asyncio.LimitOverrunError:
            raise ParentReplyRefused(f"answered a line longer than {MAX_PARENT_REPLY_BYTES} bytes") from None
        except asyncio.IncompleteReadError as e:
            if status is None and e.partial:
                raise ParentReplyRefused(f"answered {_status_text(e.partial)!r} and closed the connection") from None
            raise EOFError from None
        seen += len(line)
        lines += 1
        if seen > MAX_PARENT_REPLY_BYTES or lines > MAX_PARENT_REPLY_LINES:
            what = f"status {_status_text(status)!r} with a" if status is not None else "a"
            raise ParentReplyRefused(f"answered {what} reply head over {MAX_PARENT_REPLY_BYTES} bytes or "
                                     f"{MAX_PARENT_REPLY_LINES} lines")
        if status is None:
            status = line
            if not _STATUS_LINE.fullmatch(line):
                raise ParentReplyRefused(f"answered something that is not an HTTP/1 status line: "
                                         f"{_status_text(line)!r}")
            continue
        if line in (b"\r\n", b"\n"):
            break
    code = int(status[9:12])
    if not 200 <= code < 300:
        hint = " (wrong or missing upstream_proxy.credentials)" if code == 407 else ""
        raise ParentReplyRefused(f"answered {_status_text(status)!r}{hint}")


def _status_text(line: bytes) -> str:
    """A line from the parent as it may be quoted in a message: printable
    ASCII only, at most MAX_STATUS_CHARS."""
    text = "".join(c if " " <= c <= "~" else "?" for c in line.decode("latin-1").rstrip("\r\n"))
    return text if len(text) <= MAX_STATUS_CHARS else text[:MAX_STATUS_CHARS] + "…"


def _authority(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def _abort(writer: Any) -> None:
    transport = getattr(writer, "transport", None)
    if transport is not None:
        transport.abort()
    else:
        writer.close()


def _out_of_files_or(e: OSError) -> OSError:
    """The error a failed connect raises: OutOfFilesDial (reported once) when
    the process is out of file descriptors, else the error itself."""
    if not open_files.is_out_of_files(e):
        return e
    open_files.report("dialling an origin", e)
    return OutOfFilesDial(e.errno, OUT_OF_FILES_DIAL)


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
