"""Every change Sluice makes to mitmproxy's own code, in one place.

Sluice pins mitmproxy exactly (pyproject.toml: mitmproxy==12.3.1). Where
mitmproxy offers no hook for something Sluice must enforce, a small patch
here wraps (never copies) the mitmproxy function. Rules for this module:

- one small function `_patch_<name>()` per patch (or, for the HTTP/1 server
  side, one subclass installed where mitmproxy makes it), listed in PATCHES
  with the mitmproxy functions it wraps or relies on;
- `install()` applies every patch, once (it is idempotent; `sluice proxy` and
  addons/sluice_addon.py both call it);
- addons reach the patches through one object, `hooks` (set with the
  set_* functions), never module globals;
- tests/unit/test_mitm_patches.py records a hash of the source of every
  function in PATCHES and RELIED_ON for MITMPROXY_VERSION and fails loudly,
  naming what to re-check, when an upgrade changes one of them.

docs/mitmproxy-patches.md lists each patch with the mitmproxy defect or gap
it answers and the upstream change that would let Sluice drop it.

Patches:

- `http1_server`: HttpLayer makes `SluiceHttp1Server`, a subclass of
  mitmproxy's `Http1Server`, for every HTTP/1 client connection; it holds
  its own per-connection state, and its three overrides list its checks in
  the order they apply:
  - the head caps (`http1_head_caps`): mitmproxy buffers an incomplete
    HTTP/1 request head without bound and without a time limit (its own
    "FIXME: protect against header size DoS"), and no addon hook runs
    before a head is complete. It answers 431 and closes when the buffered
    head passes `limits.max_header_bytes` with no blank line in sight, or a
    complete head has more than `limits.max_header_count` fields (the head
    is then never handed on: no flow, no hook, no upstream); and it arms the
    `limits.header_timeout` deadline when a head is still incomplete after
    a read. It tells the guard of each complete head (`head_complete`),
    which ends the deadline a connection has from accept.
  - the head deadline (`http1_head_deadline`): it takes the deadline's
    wakeup (the inherited states would raise on it) and answers 408 and
    closes if that head is still incomplete. At most one wakeup is pending
    per connection. It also drops what a refused client still sends before
    the socket closes (the inherited `done` state would buffer it).
  - the pipelining cap (`http1_pipeline_cap`): while a response is
    pending, mitmproxy buffers whatever the client sends next, without
    bound; past `limits.max_header_bytes` the connection is closed (no
    answer can be sent in the middle of another response).
  - leading empty lines (`http1_leading_blank_lines`), the unparseable
    head's 400 (`http1_bad_head`) and mitmproxy's error pages
    (`http1_error_pages`): see their sections below.

- `refused_body_discard`, `http1_framing_caps`: see their sections below (a
  refused request's body is never buffered; an origin's response head and
  chunk-size/trailer lines are capped like request heads).
- `cancelled_handler_close`: a connection handler cancelled while waiting for
  the server-event lock closes its socket too (see its section).
- `dial_check` wraps `ConnectionHandler.open_connection` and, for the task
  it runs in, routes `asyncio.open_connection` to Sluice's one dialer
  (sluice/dialer.py): only an (IP, port) the gate approved for that client
  connection is dialled, never a name (see its section).

- `http1_error_pages` marks mitmproxy's own HTML error pages
  (`make_error_response`); `SluiceHttp1Server` replaces them, where it hands
  its commands on, with Sluice's answer (see its section).
- `socks5_login` wraps the SOCKS5 greeting (`Socks5Proxy.state`): a client
  offering username/password is asked for it, so it can be identified (see
  its section).
- `h2_stream_buffer_cap` bounds what an HTTP/2 client that does not read
  makes the proxy hold, about `limits.h2_stream_buffer_bytes` a stream: an
  HTTP/2 origin is held back by flow control on that stream alone, an
  HTTP/1 origin's connection is not read; past twice that the stream is
  reset. The client is offered `limits.h2_max_concurrent_streams` (see its
  section).

- `lean_hot_path`: hook arguments and message type checks worked out once
  per class: per-request costs, same behaviour (see its section).

These limits are global (the policy's top level): the client's identity is
in the very head being read. The head patches act only once a guard is set
(`set_head_guard`, by addons/head_limits.py); until then mitmproxy behaves as
shipped. They run wherever mitmproxy reads an HTTP/1 request head: the front
door and inside intercepted tunnels (the answers go through mitmproxy's layer
stack, so they are encrypted there).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import re
import time
from typing import Protocol

from h11._receivebuffer import ReceiveBuffer
from mitmproxy import connection
from mitmproxy.connection import ConnectionState
from mitmproxy.proxy import commands, events, server
from mitmproxy.proxy.layers.http._base import ReceiveHttp
from mitmproxy.proxy.layers.http._events import ErrorCode, RequestHeaders, RequestProtocolError
from mitmproxy.proxy.layers.http._http1 import Http1Connection, Http1Server

from sluice.dialer import DialRefused, Dialer
from sluice.policy.model import Limits

MITMPROXY_VERSION = "12.3.1"


class Hooks:
    """What connects Sluice's addons to these patches: one object, set by
    the addons when they load (through the set_* functions below). Unset,
    a patch behaves as shipped; the dial fails closed."""

    __slots__ = ("dialer", "head_guard", "refusal_listener", "stream_cap_listener", "socks5_login")

    def __init__(self) -> None:
        self.dialer: Dialer | None = None  # sluice/dialer.py, by addons/gate.py
        self.head_guard: HeadGuard | None = None  # addons/head_limits.py: the head, pipelining and framing caps
        self.refusal_listener: RefusalListener | None = None  # addons/connection_audit.py: refusals with no hook
        self.stream_cap_listener: StreamCapListener | None = None  # addons/caps.py: an HTTP/2 stream reset
        self.socks5_login = False  # addons/gate.py: ask SOCKS5 clients that offer it for username/password


hooks = Hooks()


def set_dialer(dialer: Dialer | None) -> None:
    hooks.dialer = dialer

# What the head caps found; the guard turns it into a refusal.
HEAD_TOO_LARGE = "size"
TOO_MANY_FIELDS = "count"
HEAD_TIMEOUT = "timeout"
PIPELINED_TOO_MUCH = "pipelined"


class HeadGuard(Protocol):
    def head_limits(self) -> Limits | None:
        """The limits to apply now (None: none)."""

    def refuse_head(self, client: connection.Client, problem: str, limits: Limits) -> bytes:
        """Record the refusal; return the raw HTTP/1 response to send (b"": none)."""

    def head_complete(self, client: connection.Client) -> None:
        """A whole request head arrived on this client connection."""


_clock = time.monotonic  # tests may replace it
_BLANK_LINE = re.compile(b"\n\r?\n")  # how h11's ReceiveBuffer finds a head's end


def set_head_guard(guard: HeadGuard | None) -> None:
    hooks.head_guard = guard


def head_guard() -> HeadGuard | None:
    return hooks.head_guard


class HeadDeadline(commands.RequestWakeup):
    """The header_timeout wakeup a Http1Server asks for (told apart from others)."""


# ---- http1_server: http1_head_caps, http1_head_deadline, http1_pipeline_cap, http1_bad_head,
# http1_leading_blank_lines, http1_error_pages (the Http1Server subclass) ---------------


def _head_ends_within(buf: ReceiveBuffer, limit: int) -> bool:
    """Whether the buffered head ends (blank line) within its first `limit` bytes.
    Called only when the buffer is over `limit`, and the buffer never grows
    past limit plus one read while a head is read, so the copy is bounded."""
    data = bytes(buf)
    start = len(data) - len(data.lstrip(b"\r\n"))  # leading empty lines are skipped one per read
    return _BLANK_LINE.search(data, start, limit) is not None


class SluiceHttp1Server(Http1Server):
    """mitmproxy's HTTP/1 server side (the client's end of every HTTP/1
    connection: the front door and inside intercepted tunnels) with Sluice's
    request-head checks, holding its own state. mitmproxy's methods run
    unchanged inside the overrides, which say in one place in which order
    the checks apply:

    - `read_headers`: leading empty lines dropped (http1_leading_blank_lines),
      then mitmproxy's own 400 for an unparseable head told to the refusal
      listener (http1_bad_head), then the head size, field count and
      deadline (http1_head_caps), then mitmproxy's parser;
    - `_handle_event`: mitmproxy's error pages replaced by Sluice's answer
      (http1_error_pages), the head deadline's wakeup and a refused client's
      late bytes (http1_head_deadline), then mitmproxy's handling;
    - `wait`: the pipelining cap (http1_pipeline_cap), then mitmproxy's.

    Installed by `_install_http1_server` where HttpLayer makes the client's
    HTTP/1 connection layer; with no head guard set it behaves as shipped."""

    def __init__(self, context) -> None:
        super().__init__(context)
        self.head_deadline: float | None = None  # when the head being read must be complete
        self.wakeup_pending = False  # at most one HeadDeadline wakeup is asked for at a time
        self.refused = False  # refused and closing: what the client still sends is dropped
        self.blank_bytes = 0  # leading empty lines dropped before the head being read

    # ---- read_headers ---------------------------------------------------------

    def read_headers(self, event):
        if isinstance(event, events.DataReceived):
            self._drop_leading_blank_lines()
        listener = hooks.refusal_listener
        if listener is None:
            return (yield from self._read_capped_head(event))
        # mitmproxy's own 400 for a head it cannot parse, with no request (so
        # no flow and no hook): a 400 sent, no RequestHeaders, and the error
        # logged as "<peer>: <error>".
        answered_400 = parsed = False
        logged = ""
        for command in self._read_capped_head(event):  # Http1Server yields no blocking commands
            if (isinstance(command, commands.SendData) and command.connection is self.conn
                    and command.data.startswith(b"HTTP/1.1 400 ")):
                answered_400 = True
            elif isinstance(command, ReceiveHttp) and isinstance(command.event, RequestHeaders):
                parsed = True
            elif isinstance(command, commands.Log):
                logged = command.message
            yield command
        if answered_400 and not parsed:
            listener.client_refused(self.conn, HTTP_BAD_HEAD, logged.partition(": ")[2] or logged,
                                    in_tunnel=_in_intercepted_tunnel(self))

    def _drop_leading_blank_lines(self) -> None:
        """RFC 9112 2.2: empty lines before a request line are ignored, all of
        them at once (h11 drops one per read), up to max_header_bytes of them
        per head; past that they stay and the head size cap refuses."""
        data = self.buf._data
        skip = 0
        while True:
            if data[skip:skip + 2] == b"\r\n":
                skip += 2
            elif data[skip:skip + 1] == b"\n":
                skip += 1
            else:
                break
        limits = hooks.head_guard.head_limits() if hooks.head_guard is not None else None
        seen = self.blank_bytes + skip
        if skip and (limits is None or seen <= limits.max_header_bytes):
            self.buf.maybe_extract_at_most(skip)
        self.blank_bytes = seen if not self.buf else 0

    def _read_capped_head(self, event):
        guard = hooks.head_guard
        limits = guard.head_limits() if guard is not None else None
        if guard is None or limits is None or not isinstance(event, events.DataReceived):
            return (yield from super().read_headers(event))
        if len(self.buf) > limits.max_header_bytes and not _head_ends_within(self.buf, limits.max_header_bytes):
            return (yield from self._refuse_head(guard, HEAD_TOO_LARGE, limits))
        parsing = super().read_headers(event)
        for command in parsing:  # Http1Server yields no blocking commands: nothing is sent back
            if isinstance(command, ReceiveHttp) and isinstance(command.event, RequestHeaders):
                if len(command.event.request.headers.fields) > limits.max_header_count:
                    parsing.close()
                    return (yield from self._refuse_head(guard, TOO_MANY_FIELDS, limits))
                complete = getattr(guard, "head_complete", None)
                if complete is not None:
                    complete(self.conn)  # the deadline from accept is met
            yield command
        yield from self._arm_deadline(limits.header_timeout)
        if self.head_deadline is not None:
            # A head has started: its own deadline (from its first byte) takes
            # over from the one since accept, so one late head is one refusal.
            complete = getattr(guard, "head_complete", None)
            if complete is not None:
                complete(self.conn)

    def _arm_deadline(self, timeout: float):
        """After a read: a head still incomplete gets a deadline, counted from
        the read that started it; a completed head drops it."""
        if self.state != self.read_headers or not self.buf:
            self.head_deadline = None
            return
        if self.head_deadline is None:
            self.head_deadline = _clock() + timeout
            if not self.wakeup_pending:
                self.wakeup_pending = True
                yield HeadDeadline(timeout)

    def _refuse_head(self, guard: HeadGuard, problem: str, limits: Limits):
        self.state = self.done
        self.buf = ReceiveBuffer()
        self.refused = True
        self.head_deadline = None
        raw = guard.refuse_head(self.conn, problem, limits)
        if raw:
            yield commands.SendData(self.conn, raw)
        yield commands.CloseConnection(self.conn)

    # ---- _handle_event --------------------------------------------------------

    def _handle_event(self, event):
        steps = self._handle_deadline(event)
        reply = None
        while True:  # like `yield from`, replacing mitmproxy's error pages as they go by
            try:
                command = steps.send(reply)
            except StopIteration as done:
                return done.value
            listener = hooks.refusal_listener
            if (isinstance(command, commands.SendData) and isinstance(command.data, ErrorPage)
                    and listener is not None and hasattr(listener, "error_page")):
                page = command.data
                raw = listener.error_page(self.conn, page.status, page.message, in_tunnel=_in_intercepted_tunnel(self))
                if raw:
                    command = commands.SendData(command.connection, raw)
            reply = yield command

    def _handle_deadline(self, event):
        if isinstance(event, events.DataReceived) and self.refused:
            return  # refused and closing: the inherited `done` state would buffer it
        if not (isinstance(event, events.Wakeup) and isinstance(event.command, HeadDeadline)):
            return (yield from super()._handle_event(event))
        self.wakeup_pending = False
        guard = hooks.head_guard
        limits = guard.head_limits() if guard is not None else None
        if guard is None or self.head_deadline is None or limits is None or self.state != self.read_headers:
            return  # that head completed (or the connection moved on)
        remaining = self.head_deadline - _clock()
        if remaining > 0.001:  # a later head: its deadline is still ahead
            self.wakeup_pending = True
            yield HeadDeadline(remaining)
            return
        yield from self._refuse_head(guard, HEAD_TIMEOUT, limits)

    # ---- wait -----------------------------------------------------------------

    def wait(self, event):
        guard = hooks.head_guard
        limits = guard.head_limits() if guard is not None else None
        if (guard is None or limits is None or not isinstance(event, events.DataReceived)
                or len(self.buf) <= limits.max_header_bytes):
            return (yield from super().wait(event))
        stream_id = self.stream_id
        yield from self._refuse_head(guard, PIPELINED_TOO_MUCH, limits)
        yield ReceiveHttp(RequestProtocolError(
            stream_id, f"the client sent more than {limits.max_header_bytes} bytes ahead while a response was pending",
            code=ErrorCode.CLIENT_DISCONNECTED,
        ))


def _install_http1_server() -> None:
    """HttpLayer makes the client's HTTP/1 layer by looking `Http1Server` up in
    its module when it starts: that name is where the subclass goes in."""
    from mitmproxy.proxy.layers import http as http_layers

    http_layers.Http1Server = SluiceHttp1Server


# name -> (the patch, the mitmproxy functions whose source it depends on)
PATCHES = {
    # One entry for the subclass: its checks are told apart in its docstring.
    "http1_server": (_install_http1_server, (
        "mitmproxy.proxy.layers.http:HttpLayer._handle_event",
        "mitmproxy.proxy.layers.http._http1:Http1Server.__init__",
        "mitmproxy.proxy.layers.http._http1:Http1Server.read_headers",
        "mitmproxy.proxy.layers.http._http1:Http1Server.send",
        "mitmproxy.proxy.layers.http._http1:Http1Server.mark_done",
        "mitmproxy.proxy.layers.http._http1:Http1Connection.start",
        "mitmproxy.proxy.layers.http._http1:Http1Connection.mark_done",
        "mitmproxy.proxy.layers.http._http1:Http1Connection._handle_event",
        "mitmproxy.proxy.layers.http._http1:Http1Connection.wait",
        "mitmproxy.proxy.layers.http._http1:make_error_response",
        "mitmproxy.proxy.layers.http:HttpLayer.event_to_child",
        "mitmproxy.proxy.server:ConnectionHandler.wakeup",
        "h11._receivebuffer:ReceiveBuffer.maybe_extract_lines",
        "h11._receivebuffer:ReceiveBuffer.maybe_extract_at_most",
    )),
}

# Not patched, but Sluice's behaviour depends on them (who relies, and on what).
RELIED_ON = {
    # The gate refuses in `requestheaders` by setting flow.response;
    # addons/head_limits.py then drops `Expect: 100-continue`, because this
    # function sends `100 Continue` after that hook when the header is there.
    "expect_on_refusal": (
        "mitmproxy.proxy.layers.http:HttpStream.state_wait_for_request_headers",
    ),
    # A CloseConnection for the client cancels its reader task, but if the
    # client keeps sending, the cancellation can land outside the try that
    # closes the socket (on the server_event lock), leaving it open until
    # garbage collection; addons/head_limits.py closes the socket itself.
    "head_refusal_close": (
        "mitmproxy.proxy.server:ConnectionHandler.handle_connection",
        "mitmproxy.proxy.server:ConnectionHandler.server_event",
    ),
}

# addons/connections.py reaches into a client connection's handler: the
# handler found by client id, its transports (reader, writer, task), its close
# and its idle watchdog; the server streams it holds are the dialer's
# (sluice/dialer.py), stored by open_connection (dial_check above).
RELIED_ON["connection_handler"] = (
    "mitmproxy.addons.proxyserver:Proxyserver.register_connection",
    "mitmproxy.proxy.server:ConnectionHandler.__init__",
    "mitmproxy.proxy.server:ConnectionHandler.close_connection",
    "mitmproxy.proxy.server:TimeoutWatchdog.watch",
    # idle_http1_servers walks the layer tree: HttpLayer's connections and
    # streams, a NextLayer's chosen layer, a CONNECT stream's child layer,
    # and an Http1Client between exchanges (no stream id, reading headers).
    "mitmproxy.proxy.layers.http:HttpLayer.__init__",
    "mitmproxy.proxy.layer:NextLayer._ask",
    "mitmproxy.proxy.layers.http:HttpStream.handle_connect_finish",
    "mitmproxy.proxy.layers.http._http1:Http1Client.send",
)
# addons/connection_audit.py reads mitmproxy's own refusal texts to tell its
# refusals apart (the invalid-request 400s, the failed CONNECT's 502, a head
# it cannot parse, the SOCKS5 errors) and its proxyserver's refusal of a dial
# back to one of its listeners (told by the listener addresses, which
# sluice/own_host.py reads).
RELIED_ON["mitmproxy_messages"] = (
    "mitmproxy.proxy.layers.http:validate_request",
    "mitmproxy.proxy.layers.http:HttpStream.handle_connect_regular",
    "mitmproxy.net.http.http1.read:_read_request_line",
    "mitmproxy.proxy.layers.modes:Socks5Proxy.state_greet",
    "mitmproxy.proxy.layers.modes:Socks5Proxy.state_auth",
    "mitmproxy.proxy.layers.modes:Socks5Proxy.state_connect",
    "mitmproxy.addons.proxyserver:Proxyserver.server_connect",
)

# addons/layer_choice.py: LayerChoice is mitmproxy's NextLayer addon,
# subclassed. It relies on next_layer keeping another addon's choice and
# catching NeedsMoreData around _next_layer; on _next_layer's choices where
# it defers (a front door's, and for bytes not ignored that start like TLS,
# the TLS layers); on _ignore_connection asking first; on the NextLayer layer
# taking itself off the stack (so context.layers is what lies below); on the
# proxyserver looking the addon up as "nextlayer". TakeOverNextLayer (the
# `mitmdump -s` path) relies on a script's addons being registered after
# mitmdump's own, with names unique, and removed before a reload.
RELIED_ON["layer_choice"] = (
    "mitmproxy.addons.next_layer:NextLayer.next_layer",
    "mitmproxy.addons.next_layer:NextLayer._next_layer",
    "mitmproxy.addons.next_layer:NextLayer._ignore_connection",
    "mitmproxy.proxy.layer:NextLayer.__init__",
    "mitmproxy.addons.proxyserver:Proxyserver.configure",
    "mitmproxy.addonmanager:AddonManager.register",
    "mitmproxy.addons.script:Script.loadscript",
)

_installed: set[str] = set()


def install() -> None:
    """Apply every patch in PATCHES, each at most once per process."""
    for name, (patch, _) in PATCHES.items():
        if name not in _installed:
            patch()
            _installed.add(name)


# ---- refusals_without_hook: socks5_refusals, http1_bad_head, http_no_destination ----
#
# mitmproxy refuses some clients itself and runs no addon hook for it: a
# SOCKS5 handshake it does not accept (SOCKS4, BIND, UDP ASSOCIATE, an
# unknown address type, garbage; `Socks5Proxy.socks_err`), an HTTP/1 request
# head it cannot parse (400 from `Http1Server.read_headers`, no flow), and an
# origin-form request with no Host header (400 from
# `HttpStream.state_wait_for_request_headers`, a flow but no hook). These
# wrappers (for the head: SluiceHttp1Server.read_headers) tell a listener
# (addons/connection_audit.py, via `set_refusal_listener`) so every refusal
# has its audit line; what mitmproxy sends the client is unchanged. Without
# a listener they only pass through.

SOCKS5_REFUSED = "socks5"  # message: mitmproxy's; data: the handshake bytes it refused
HTTP_BAD_HEAD = "http_head"  # message: mitmproxy's parse error; data: b""
HTTP_NO_DESTINATION = "http_destination"  # message: mitmproxy's; request: the request


class RefusalListener(Protocol):
    def client_refused(self, client: connection.Client, kind: str, message: str, *,
                       data: bytes = b"", request=None, in_tunnel: bool = False) -> None:
        """mitmproxy refused this client itself (synchronous, from inside its layers)."""


def set_refusal_listener(listener: RefusalListener | None) -> None:
    hooks.refusal_listener = listener


def _wrap_once(owner: type, name: str, marker: str, make) -> None:
    """Wrap owner.name (whatever is there: mitmproxy's function or another
    Sluice patch of it) unless this patch already did."""
    current = owner.__dict__[name]
    seen = current
    while seen is not None:
        if getattr(seen, marker, False):
            return
        seen = getattr(seen, "__wrapped__", None)
    wrapper = make(current)
    wrapper.__wrapped__ = current
    wrapper.__sluice_patch__ = True
    setattr(wrapper, marker, True)
    setattr(owner, name, wrapper)


def _patch_socks5_refusals() -> None:
    from mitmproxy.proxy.layers.modes import Socks5Proxy

    def make(original):
        def socks_err(self, message, reply_code=None):
            listener = hooks.refusal_listener
            # Every call refuses the handshake itself, before a destination is
            # named (a refused or failed dial never comes here).
            if listener is not None and self.context.server.address is None:
                listener.client_refused(self.context.client, SOCKS5_REFUSED, message, data=bytes(self.buf[:32]))
            return (yield from original(self, message, reply_code))
        return socks_err

    _wrap_once(Socks5Proxy, "socks_err", "__sluice_socks5_refusals__", make)


def _patch_http_no_destination() -> None:
    from mitmproxy.proxy.layers.http import HttpStream, ResponseProtocolError, SendHttp

    def make(original):
        def state_wait_for_request_headers(self, event):
            steps = original(self, event)
            reply = None
            while True:  # like `yield from`, watching what goes by (replies to blocking commands included)
                try:
                    command = steps.send(reply)
                except StopIteration as done:
                    return done.value
                if (hooks.refusal_listener is not None and isinstance(command, SendHttp)
                        and isinstance(command.event, ResponseProtocolError)
                        and command.event.code is ErrorCode.DESTINATION_UNKNOWN):
                    hooks.refusal_listener.client_refused(self.context.client, HTTP_NO_DESTINATION, command.event.message,
                                                     request=self.flow.request)
                reply = yield command
        return state_wait_for_request_headers

    _wrap_once(HttpStream, "state_wait_for_request_headers", "__sluice_http_no_destination__", make)


PATCHES.update({
    "socks5_refusals": (_patch_socks5_refusals, (
        "mitmproxy.proxy.layers.modes:Socks5Proxy.socks_err",
        "mitmproxy.proxy.layers.modes:Socks5Proxy.state_greet",
        "mitmproxy.proxy.layers.modes:Socks5Proxy.state_auth",
        "mitmproxy.proxy.layers.modes:Socks5Proxy.state_connect",
    )),
    "http_no_destination": (_patch_http_no_destination, (
        "mitmproxy.proxy.layers.http:HttpStream.state_wait_for_request_headers",
        "mitmproxy.proxy.layers.http:HttpStream._handle_event",
    )),
})


# ---- dial_check ------------------------------------------------------------
#
# mitmproxy's `ConnectionHandler.open_connection` runs the `server_connect`
# hook, then waits for a per-address connection slot, then reads the server
# address *again* and calls `asyncio.open_connection` with it; `server_connected`
# fires only after the TCP handshake, when an internal service has already
# accepted. So the connect itself is routed to Sluice's one dialer
# (sluice/dialer.py, `set_dialer`, by addons/gate.py): while a handler opens a
# connection, its `asyncio.open_connection` becomes `Dialer.dial`, which
# checks the pin and the loop, connects within the connect timeout, checks
# the peer and returns metered streams. A refused dial raises OSError before
# any packet is sent; mitmproxy reports it as a failed connect. Fails closed:
# with no dialer set, every dial that a handler makes is refused.

# The dial of the task it runs in (set by the handler's open_connection):
# its client connection, its server connection, and when it started (the
# connect timeout counts from there).
_dialling: contextvars.ContextVar[tuple | None] = contextvars.ContextVar("sluice_dialling", default=None)


def _patch_dial_check() -> None:
    def make_open_connection(original):
        @functools.wraps(original)
        async def open_connection(self, command):
            token = _dialling.set((self.client, command.connection, asyncio.get_running_loop().time()))
            try:
                return await original(self, command)
            finally:
                _dialling.reset(token)
        return open_connection

    _wrap_once(server.ConnectionHandler, "open_connection", "__sluice_dial_check__", make_open_connection)
    if getattr(asyncio.open_connection, "__sluice_dial_check__", False):
        return
    original_connect = asyncio.open_connection

    @functools.wraps(original_connect)
    async def guarded_open_connection(host=None, port=None, *args, **kwargs):
        dialling = _dialling.get()
        if dialling is None:
            return await original_connect(host, port, *args, **kwargs)  # not a handler's dial
        client, dialled, started = dialling
        dialer = hooks.dialer
        if dialer is None:
            raise DialRefused(f"pin_mismatch: Sluice refused to dial {host}:{port}: no dialer is installed")
        return await dialer.dial(client, dialled, host, port, original_connect, *args, started=started, **kwargs)

    guarded_open_connection.__sluice_dial_check__ = True
    asyncio.open_connection = guarded_open_connection


PATCHES["dial_check"] = (_patch_dial_check, (
    "mitmproxy.proxy.server:ConnectionHandler.open_connection",
))


# ---- http1_error_pages -------------------------------------------------------
#
# mitmproxy answers some requests itself, before or instead of any addon
# hook that could: a head it cannot parse, a request it finds invalid (an
# ftp:// URL, smuggling-prone framing), no Host, a failed dial. Its answer is
# an HTML page with `Server: mitmproxy` (`make_error_response`, called from
# `Http1Server.read_headers` and `Http1Server.send`). The patch marks those
# pages (a bytes subclass carrying status and message) and, where
# SluiceHttp1Server hands its commands on, asks the listener
# (addons/connection_audit.py, `error_page`) for Sluice's answer instead: the
# same status where the audit line records it, `Sluice-Reason`, the sentence,
# plain text. Without a listener (or when it returns nothing) mitmproxy's
# page goes out as shipped.

class ErrorPage(bytes):
    """The bytes of one of mitmproxy's own HTTP/1 error responses."""

    status: int
    message: str


class ErrorPageListener(Protocol):
    def error_page(self, client: connection.Client, status: int, message: str, *, in_tunnel: bool) -> bytes | None:
        """The raw HTTP/1 response to send instead of mitmproxy's page (None: keep it)."""


def _in_intercepted_tunnel(layer_) -> bool:
    from mitmproxy.proxy.layers.http import HttpLayer, HTTPMode

    return any(isinstance(l, HttpLayer) and l.mode is HTTPMode.transparent for l in layer_.context.layers)


def _patch_http1_error_pages() -> None:
    """Marks mitmproxy's pages; SluiceHttp1Server._handle_event replaces them."""
    from mitmproxy.proxy.layers.http import _http1

    if getattr(_http1.make_error_response, "__sluice_http1_error_pages__", False):
        return
    shipped = _http1.make_error_response

    @functools.wraps(shipped)
    def make_error_response(status_code: int, message: str = "") -> bytes:
        page = ErrorPage(shipped(status_code, message))
        page.status, page.message = status_code, message
        return page

    make_error_response.__sluice_http1_error_pages__ = True
    _http1.make_error_response = make_error_response  # both callers look it up in the module


PATCHES["http1_error_pages"] = (_patch_http1_error_pages, (
    "mitmproxy.proxy.layers.http._http1:make_error_response",
    "mitmproxy.proxy.layers.http._http1:Http1Server.send",
    "mitmproxy.proxy.layers.http._http1:Http1Server.read_headers",
))


# ---- socks5_login ------------------------------------------------------------
#
# mitmproxy's SOCKS5 layer asks for username/password (RFC 1929) only when
# its `proxyauth` option is set, for every client (`Socks5Proxy.state_greet`),
# and Sluice has no such option. Once enabled (`set_socks5_login`, by
# addons/gate.py), a client whose greeting offers username/password is asked
# for it, so its credentials identify a client profile as Proxy-Authorization
# does; mitmproxy then runs its own `state_auth`, which asks the
# `socks5_auth` hook. A client that offers only "no authentication" is
# greeted as shipped (and known by its source address).

def set_socks5_login(enabled: bool) -> None:
    hooks.socks5_login = enabled


def _patch_socks5_login() -> None:
    from mitmproxy.proxy.layers import modes

    def make(original):
        def state_greet(self):
            buf = self.buf
            if (hooks.socks5_login and len(buf) >= 2 and buf[0] == modes.SOCKS5_VERSION and len(buf) >= 2 + buf[1]
                    and modes.SOCKS5_METHOD_USER_PASSWORD_AUTHENTICATION in buf[2:2 + buf[1]]):
                yield commands.SendData(self.context.client, bytes(
                    [modes.SOCKS5_VERSION, modes.SOCKS5_METHOD_USER_PASSWORD_AUTHENTICATION]))
                self.buf = buf[2 + buf[1]:]
                self.state = self.state_auth
                return (yield from self.state())
            return (yield from original(self))
        return state_greet

    # The class attribute `state` (the greeting, Socks5Proxy.state_greet) is
    # what a new layer starts in; state_greet itself is never looked up by name.
    _wrap_once(modes.Socks5Proxy, "state", "__sluice_socks5_login__", make)


PATCHES["socks5_login"] = (_patch_socks5_login, (
    "mitmproxy.proxy.layers.modes:Socks5Proxy.state_greet",
    "mitmproxy.proxy.layers.modes:Socks5Proxy.state_auth",
    "mitmproxy.proxy.layers.modes:Socks5Proxy._handle_event",
))


# ---- refused_body_discard ----------------------------------------------------
#
# A response set in `requestheaders` (every refusal the gate or a cap makes
# before the body) is sent by mitmproxy only after the request body has
# arrived, and `HttpStream.state_consume_request_body` buffers that body whole
# in memory first: a refused 1 GiB upload would be held in RAM only to be
# thrown away. Once the answer is decided, the body is dropped as it arrives.

def _patch_refused_body_discard() -> None:
    from mitmproxy.proxy.layers.http import HttpStream
    from mitmproxy.proxy.layers.http._events import RequestData

    def make(original):
        def state_consume_request_body(self, event):
            if isinstance(event, RequestData) and self.flow is not None and self.flow.response is not None:
                return (yield from ())  # decided already: never buffered, never forwarded
            return (yield from original(self, event))
        return state_consume_request_body

    _wrap_once(HttpStream, "state_consume_request_body", "__sluice_refused_body_discard__", make)


PATCHES["refused_body_discard"] = (_patch_refused_body_discard, (
    "mitmproxy.proxy.layers.http:HttpStream.state_consume_request_body",
    "mitmproxy.proxy.layers.http:HttpStream.state_wait_for_request_headers",
))


# ---- http1_framing_caps -------------------------------------------------------
#
# Two more places where mitmproxy's HTTP/1 reader buffers without bound while
# it waits for a line ending (its own "FIXME: protect against header size DoS"):
# an origin's response head (`Http1Client.read_headers`: a hostile public
# origin streaming an endless header), and the chunk-size and trailer lines of
# a chunked body, either direction (`Http1Connection.read_body`; data itself is
# passed on as it arrives and never waits in the buffer). Past the head size
# cap (`limits.max_header_bytes`) the connection is closed with a protocol
# error: an origin's becomes a 502 for the client, a client's ends its request.

FRAMING_TOO_LARGE = "HTTP/1 framing (a response head, or a chunk-size or trailer line) is over Sluice's max_header_bytes"


def _framing_limit() -> int | None:
    limits = hooks.head_guard.head_limits() if hooks.head_guard is not None else None
    return limits.max_header_bytes if limits is not None else None


def _framing_error(self):
    yield commands.CloseConnection(self.conn)
    if self.stream_id is not None:
        yield ReceiveHttp(self.ReceiveProtocolError(self.stream_id, FRAMING_TOO_LARGE, code=self.ReceiveProtocolError.code))


def _patch_http1_framing_caps() -> None:
    from mitmproxy.proxy.layers.http._http1 import Http1Client

    def make_response_head(original):
        def read_headers(self, event):
            limit = _framing_limit()
            if (limit is not None and isinstance(event, events.DataReceived) and self.request
                    and len(self.buf) > limit and not _head_ends_within(self.buf, limit)):
                self.buf.maybe_extract_at_most(len(self.buf))  # never kept
                return (yield from _framing_error(self))
            return (yield from original(self, event))
        return read_headers

    def make_read_body(original):
        def read_body(self, event):
            yield from original(self, event)
            limit = _framing_limit()
            if (limit is not None and isinstance(event, events.DataReceived)
                    and self.state == self.read_body and len(self.buf) > limit):
                self.buf.maybe_extract_at_most(len(self.buf))
                self.state = self.done
                if isinstance(self, Http1Server):
                    # mitmproxy's close of a client that keeps sending can miss
                    # its socket (see head_limits): close it from outside too.
                    from sluice.addons import connections
                    asyncio.get_running_loop().call_soon(connections.close_client, self.context.client)
                yield from _framing_error(self)
        return read_body

    _wrap_once(Http1Client, "read_headers", "__sluice_http1_response_head_cap__", make_response_head)
    _wrap_once(Http1Connection, "read_body", "__sluice_http1_body_framing_cap__", make_read_body)


PATCHES["http1_framing_caps"] = (_patch_http1_framing_caps, (
    "mitmproxy.proxy.layers.http._http1:Http1Client.read_headers",
    "mitmproxy.proxy.layers.http._http1:Http1Connection.read_body",
    "h11._readers:ChunkedReader.__call__",
))


# ---- fast_dispatch (sluice proxy only) ----------------------------------------
#
# mitmproxy offers every event to every addon: per event it walks the whole
# addon tree, looks each hook up by name and enters a context manager per
# addon, whether or not the addon has that hook. On the tunnel-setup hot path
# that is a quarter of the proxy's CPU (bench/results/profile-connect.md).
# `sluice proxy` builds its addon list once, so it can resolve each event's
# hooks once: `fast_dispatch(master.addons)` gives that AddonManager a
# `trigger_event` that calls the same hooks in the same order with the same
# error handling (errors logged as "Addon error", AddonHalt stops the event,
# OptionsError propagates), from a list rebuilt whenever an addon is added or
# removed; and a `handle_lifecycle` that sends the `update` event mitmproxy
# follows every flow hook with only when some addon has an `update` hook
# (otherwise it calls nothing: 4 dispatches of nothing per request). Not used
# under `mitmdump -s`, whose scripts change their child addons on reload
# without telling the manager.

def fast_dispatch(manager) -> None:
    import inspect as _inspect
    import sys as _sys
    import types as _types

    from mitmproxy import addonmanager, exceptions
    from mitmproxy import flow as _flow
    from mitmproxy import hooks as _hooks

    hooks_by_event: dict[str, list] = {}

    def hooks_for(name: str) -> list:
        found = hooks_by_event.get(name)
        if found is None:
            found = []
            for addon in addonmanager.traverse(manager.chain):
                func = getattr(addon, name, None)
                if func and callable(func) and not isinstance(func, _types.ModuleType):
                    found.append(func)
            hooks_by_event[name] = found
        return found

    def report() -> None:
        etype, value, tb = _sys.exc_info()
        addonmanager.logger.error(f"Addon error: {value}", exc_info=(etype, value, tb))

    async def trigger_event(event) -> None:
        args = event.args()
        for func in hooks_for(event.name):
            try:
                result = func(*args)
                if result is not None and _inspect.isawaitable(result):
                    await result
            except exceptions.AddonHalt:
                return
            except exceptions.OptionsError:
                raise
            except Exception:
                report()

    def invalidating(method):
        @functools.wraps(method)
        def wrapper(*a, **kw):
            hooks_by_event.clear()
            try:
                return method(*a, **kw)
            finally:
                hooks_by_event.clear()
        return wrapper

    async def handle_lifecycle(event) -> None:
        # mitmproxy follows every flow hook with an `update` event for the
        # flow; with no addon that has an `update` hook that is a no-op.
        message = event.args()[0]
        await trigger_event(event)
        if hooks_for("update") and isinstance(message, _flow.Flow):
            await trigger_event(_hooks.UpdateHook([message]))

    manager.trigger_event = trigger_event
    manager.handle_lifecycle = handle_lifecycle
    for name in ("add", "remove", "clear", "register"):
        setattr(manager, name, invalidating(getattr(manager, name)))


# ---- lean_hot_path: the same checks, done once ----------------------------------
#
# Two mitmproxy helpers that every request pays for redo work whose result
# cannot change (bench/results/profile-http.md: ~9% of a keep-alive
# request's CPU):
# - `Hook.args()` calls `dataclasses.fields()` on every hook of every event
#   (8 per plain-HTTP request): a hook class's fields are fixed when the class
#   is made, so their names are read once per class.
# - `MessageData.__post_init__` (every Request and Response made, twice per
#   request) type-checks each field with `check_option_type`, which inspects
#   each annotation with `typing` on every call. Each field's annotation is
#   read once per class into the classes it admits (a plain class, or a union
#   of plain classes; `float` also admits int, as check_option_type does);
#   a value that is an instance of one passes, anything else, and any field
#   whose annotation is not that simple, goes to check_option_type itself, so
#   what passes and what raises (and its message) are exactly as shipped.

# Both replace mitmproxy's function rather than call it; `_wrap_once` still
# keeps it as `__wrapped__` (the source-hash test reads it there).

def _patch_hook_args() -> None:
    import dataclasses

    from mitmproxy import hooks as mitm_hooks

    names_by_class: dict[type, tuple[str, ...]] = {}

    def args(self) -> list:
        names = names_by_class.get(type(self))
        if names is None:
            names = names_by_class[type(self)] = tuple(f.name for f in dataclasses.fields(self))
        return [getattr(self, name) for name in names]

    _wrap_once(mitm_hooks.Hook, "args", "__sluice_lean__", lambda shipped: args)


def _admitted_classes(annotation) -> tuple[type, ...] | None:
    """The classes check_option_type admits for `annotation` by isinstance
    alone, or None if it does more than that for it."""
    import types as _types
    import typing

    if isinstance(annotation, type) and typing.get_origin(annotation) is None:
        members: tuple = (annotation,)
    elif typing.get_origin(annotation) in (typing.Union, _types.UnionType):
        members = typing.get_args(annotation)
        if not all(isinstance(m, type) and typing.get_origin(m) is None for m in members):
            return None
    else:
        return None
    admitted: list[type] = []
    for member in members:
        admitted.append(member)
        if member is float:
            admitted.append(int)
    return tuple(admitted)


def _patch_message_checks() -> None:
    import dataclasses

    from mitmproxy import http as mitm_http
    from mitmproxy.utils import typecheck

    checks_by_class: dict[type, tuple[tuple[str, object, tuple[type, ...] | None], ...]] = {}

    def checks_for(cls: type) -> tuple:
        checks = checks_by_class.get(cls)
        if checks is None:
            checks = checks_by_class[cls] = tuple(
                (f.name, f.type, _admitted_classes(f.type)) for f in dataclasses.fields(cls))
        return checks

    if "__post_init__" not in mitm_http.MessageData.__dict__:
        return  # not defined under python -O: nothing is checked

    def __post_init__(self) -> None:
        for name, annotation, admitted in checks_for(type(self)):
            value = getattr(self, name)
            if admitted is None or not isinstance(value, admitted):
                typecheck.check_option_type(name, value, annotation)

    # The dataclasses' generated __init__ calls self.__post_init__, found on
    # the class at call time: RequestData and ResponseData inherit this one.
    _wrap_once(mitm_http.MessageData, "__post_init__", "__sluice_lean__", lambda shipped: __post_init__)


PATCHES["lean_hot_path"] = (lambda: (_patch_hook_args(), _patch_message_checks()), (
    "mitmproxy.hooks:Hook.args",
    "mitmproxy.http:MessageData.__post_init__",
    "mitmproxy.utils.typecheck:check_option_type",
))


# sluice/splice.py moves a passed-through tunnel's bytes below mitmproxy: it
# takes each connection's streams from `ConnectionHandler.transports` once
# the TCP layer has started relaying (its `start`, whose end means both sides
# are connected), swaps the asyncio transports' protocols, hands EOF and
# connection loss to the stream protocol mitmproxy installed (so its
# `handle_connection` sees them as before) and feeds the idle watchdog.
RELIED_ON["tunnel_splice"] = (
    "mitmproxy.proxy.layers.tcp:TCPLayer.start",
    "mitmproxy.proxy.layers.tcp:TCPLayer.relay_messages",
    "mitmproxy.proxy.server:ConnectionHandler.handle_connection",
    "mitmproxy.proxy.server:ConnectionHandler.open_connection",
    "mitmproxy.proxy.server:TimeoutWatchdog.register_activity",
)
# (It also reads asyncio's StreamReader buffer, `_buffer`: stdlib, not pinned
# here; tests/unit/test_splice.py fails if that changes.)


RELIED_ON["fast_dispatch"] = (
    "mitmproxy.addonmanager:AddonManager.trigger_event",
    "mitmproxy.addonmanager:AddonManager.handle_lifecycle",
    "mitmproxy.addonmanager:AddonManager.invoke_addon",
    "mitmproxy.addonmanager:AddonManager._iter_hooks",
    "mitmproxy.addonmanager:safecall",
    "mitmproxy.addonmanager:traverse",
)


# ---- cancelled_handler_close ---------------------------------------------------
#
# `ConnectionHandler.handle_connection` closes a connection's socket only on
# its normal way out. Cancelled while it awaits the server-event lock (to
# report data or the peer's EOF) — which is how mitmproxy closes a connection
# whose peer is still sending or has just half-closed — the CancelledError
# leaves it before `writer.close()`: no FIN is sent, idle_timeout no longer
# applies and the fd stays open after the client is gone (found by
# tests/reliability/test_rel_front_door.py). The wrapper closes the socket on
# that way out too.

def _patch_cancelled_handler_close() -> None:
    def make(original):
        @functools.wraps(original)
        async def handle_connection(self, connection):
            try:
                return await original(self, connection)
            except asyncio.CancelledError:
                # The transport entry stays (a later SendData finds a closing
                # writer and skips it); the handler's end discards it.
                io = self.transports.get(connection)
                if io is not None and io.writer is not None:
                    try:
                        io.writer.close()
                    except OSError:
                        pass
                connection.state = ConnectionState.CLOSED
                raise
        return handle_connection

    _wrap_once(server.ConnectionHandler, "handle_connection", "__sluice_cancelled_handler_close__", make)


PATCHES["cancelled_handler_close"] = (_patch_cancelled_handler_close, (
    "mitmproxy.proxy.server:ConnectionHandler.handle_connection",
    "mitmproxy.proxy.server:ConnectionHandler.server_event",
))


# ---- h2_stream_buffer_cap -----------------------------------------------------
#
# Toward an HTTP/2 client, mitmproxy keeps what the client's flow-control
# window does not let it send yet in per-stream buffers
# (`BufferedH2Connection.stream_buffers`), without bound, while it goes on
# reading every origin as fast as the origin sends: it opens a 2 GiB window
# toward HTTP/2 origins and acknowledges every byte at once. A client that
# announces a zero window and opens many streams for large bodies makes the
# proxy hold them all (2 connections x 50 streams of 9 MiB took it to
# 1.16 GiB). Its only backpressure, `ConnectionHandler.drain_writers`, waits
# on the socket buffers of every connection of the handler, so it never sees
# these, and pausing it would stall the whole client connection.
#
# So each stream's buffer toward the client is watched after every event the
# client-side layer (`Http2Server`) handles, against the top level's
# `limits.h2_stream_buffer_bytes` (the cap):
#
# - the stream's response comes from an HTTP/2 origin: that origin connection
#   gives the stream a window of half the cap (`Http2Client.__init__`), and
#   while the stream's buffer is over half the cap what the origin sends on
#   it is not acknowledged (its `acknowledge_received_data` is held back), so
#   the origin stops at the window's end; once the client has taken the
#   buffer down to a quarter of the cap the held acknowledgement goes out.
#   Only that stream waits: the connection's other streams, and the client's
#   own reads (its WINDOW_UPDATE frames are what drain the buffer), go on.
# - from an HTTP/1 origin (one stream per origin connection): that origin
#   connection's reader waits in `drain_writers` (which every reader awaits
#   after each read) while the buffer is over the cap, until the client has
#   taken it down to half.
#
# Either way a stream holds at most about the cap plus one read (64 KiB),
# and one client connection at most h2_max_concurrent_streams times that.
# Should a stream's buffer still pass twice the cap plus two reads (an origin
# that could not be held back), the stream is reset instead (RST_STREAM
# toward the client, the exchange aborted upstream) and the listener
# (addons/caps.py, `set_stream_cap_listener`) records `response_too_large`.
# `Http2Server.__init__` announces `limits.h2_max_concurrent_streams`
# (mitmproxy keeps h2's 100) as SETTINGS_MAX_CONCURRENT_STREAMS; h2 refuses a
# client that opens more.

class _ReadHold:
    """An origin connection that is not read while any of its streams is over the cap."""

    __slots__ = ("streams", "released")

    def __init__(self) -> None:
        self.streams: set[tuple[int, int]] = set()  # (id of the Http2Server layer, stream id)
        self.released = asyncio.Event()


_read_holds: dict[connection.Connection, _ReadHold] = {}


STREAM_READ = 64 * 1024  # what mitmproxy reads from a socket at once
STREAM_RESET = "the HTTP/2 stream was reset: the client did not read it"


class StreamCapListener(Protocol):
    def h2_stream_reset(self, flow, buffered: int, cap: int) -> None:
        """A stream of `flow` was reset holding `buffered` bytes (synchronous)."""


def set_stream_cap_listener(listener: StreamCapListener | None) -> None:
    hooks.stream_cap_listener = listener


def _h2_limits() -> Limits | None:
    return hooks.head_guard.head_limits() if hooks.head_guard is not None else None


def _origin_window(cap: int) -> int:
    """The stream window an HTTP/2 origin gets (SETTINGS_INITIAL_WINDOW_SIZE)."""
    return min(max(cap // 2, 16 * 1024), 2**31 - 1)


def _stream_buffered(h2_conn, stream_id: int) -> int:
    chunks = h2_conn.stream_buffers.get(stream_id)  # a defaultdict: .get never adds
    return sum(len(chunk.data) for chunk in chunks) if chunks else 0


def _http_layer(layer_):
    from mitmproxy.proxy.layers.http import HttpLayer

    for below in reversed(layer_.context.layers):
        if isinstance(below, HttpLayer):
            return below
    return None


def _h2_origin(http_layer, server: connection.Connection):
    """The Http2Client speaking to `server` (None: the origin is not HTTP/2)."""
    from mitmproxy.proxy.layers.http._http2 import Http2Client

    found = http_layer.connections.get(server)
    for _ in range(8):  # down the server's stack: TLS, HttpClient, then the protocol layer
        if found is None or isinstance(found, Http2Client):
            return found if found is not None and hasattr(found, "_sluice_withheld") else None
        found = getattr(found, "child_layer", None)
    return None


def _check_stream(layer_, stream_id: int, cap: int) -> list:
    """Hold or release one stream's origin; returns the commands to send."""
    buffered = _stream_buffered(layer_.h2_conn, stream_id)
    if buffered > 2 * (cap + STREAM_READ):
        return _reset(layer_, stream_id, buffered, cap)
    held = layer_._sluice_held.get(stream_id)
    if held is not None:
        return _release(layer_, stream_id) if buffered <= held[0] else []
    if buffered <= cap // 2:
        return []
    http_layer = _http_layer(layer_)
    stream = http_layer.streams.get(stream_id) if http_layer is not None else None
    server = stream.context.server if stream is not None else None
    if server is None or server is layer_.conn:
        return []
    origin = _h2_origin(http_layer, server)
    if origin is not None:
        ours = origin.our_stream_id.get(stream_id)
        if ours is not None:
            origin._sluice_withheld.setdefault(ours, 0)
            layer_._sluice_held[stream_id] = (cap // 4, origin, ours)
    elif buffered > cap:
        _read_holds.setdefault(server, _ReadHold()).streams.add((id(layer_), stream_id))
        layer_._sluice_held[stream_id] = (cap // 2, server, None)
    return []


def _reset(layer_, stream_id: int, buffered: int, cap: int) -> list:
    """The backstop: reset the stream toward the client and abort its exchange."""
    import h2.errors

    http_layer = _http_layer(layer_)
    stream = http_layer.streams.get(stream_id) if http_layer is not None else None
    if stream is not None and stream.flow is not None and hooks.stream_cap_listener is not None:
        hooks.stream_cap_listener.h2_stream_reset(stream.flow, buffered, cap)
    if stream_id in layer_._sluice_held:
        out = _release(layer_, stream_id)
    else:
        out = []
    layer_.h2_conn.reset_stream(stream_id, h2.errors.ErrorCodes.CANCEL)  # drops its buffer
    data = layer_.h2_conn.data_to_send()
    if data:
        out.append(commands.SendData(layer_.conn, data))
    if layer_.streams.pop(stream_id, None) is not None:
        # As if the client had reset it: the HttpStream aborts the exchange upstream.
        out.append(ReceiveHttp(RequestProtocolError(stream_id, STREAM_RESET, code=ErrorCode.CANCEL)))
    return out


def _release(layer_, stream_id: int, send: bool = True) -> list:
    _, held, ours = layer_._sluice_held.pop(stream_id)
    if ours is not None:  # an HTTP/2 origin: hand back the window it was not given
        size = held._sluice_withheld.pop(ours, 0)
        if not (size and send and held.conn.connected):
            return []
        held.h2_conn.acknowledge_received_data(size, ours)  # no longer withheld: goes through
        data = held.h2_conn.data_to_send()
        return [commands.SendData(held.conn, data)] if data else []
    hold = _read_holds.get(held)
    if hold is not None:
        hold.streams.discard((id(layer_), stream_id))
        if not hold.streams:
            del _read_holds[held]
            hold.released.set()
    return []


def _patch_h2_stream_buffer_cap() -> None:
    from mitmproxy.proxy.layers.http._events import ResponseData
    from mitmproxy.proxy.layers.http._http2 import Http2Client, Http2Server

    def make_handle_event(original):
        def _handle_event(self, event):
            yield from original(self, event)
            held = self.__dict__.setdefault("_sluice_held", {})
            if "_handle_event" in self.__dict__:  # closed: mitmproxy switched this layer to `done`
                for stream_id in list(held):
                    _release(self, stream_id, send=False)
                return
            limits = _h2_limits()
            if limits is None:
                return
            cap = limits.h2_stream_buffer_bytes
            if isinstance(event, ResponseData):
                for command in _check_stream(self, event.stream_id, cap):
                    yield command
            for stream_id in [s for s in held if not isinstance(event, ResponseData) or s != event.stream_id]:
                # The client's WINDOW_UPDATE (or RST_STREAM, or the end of
                # the connection) may have drained any held stream.
                for command in _check_stream(self, stream_id, cap):
                    yield command
        return _handle_event

    def make_server_init(original):
        @functools.wraps(original)
        def __init__(self, context):
            original(self, context)
            limits = _h2_limits()
            if limits is not None:
                self.h2_conn.local_settings.max_concurrent_streams = limits.h2_max_concurrent_streams
                self.h2_conn.local_settings.acknowledge()  # effective now, and sent in the first SETTINGS
        return __init__

    def make_client_init(original):
        @functools.wraps(original)
        def __init__(self, context):
            original(self, context)
            limits = _h2_limits()
            if limits is None:
                return
            self.h2_conn.local_settings.initial_window_size = _origin_window(limits.h2_stream_buffer_bytes)
            self.h2_conn.local_settings.acknowledge()  # sent in the first SETTINGS
            withheld: dict[int, int] = {}  # our stream id -> bytes received and not yet acknowledged
            self._sluice_withheld = withheld
            shipped = self.h2_conn.acknowledge_received_data

            def acknowledge_received_data(acknowledged_size: int, stream_id: int) -> None:
                if stream_id in withheld:
                    withheld[stream_id] += acknowledged_size
                else:
                    shipped(acknowledged_size, stream_id)

            self.h2_conn.acknowledge_received_data = acknowledge_received_data
        return __init__

    def make_drain(original):
        @functools.wraps(original)
        async def drain_writers(self):
            await original(self)
            if not _read_holds:
                return
            task = asyncio.current_task()
            for conn, io in list(self.transports.items()):
                if io.handler is task:
                    break
            else:
                return
            try:
                while (hold := _read_holds.get(conn)) is not None:
                    await hold.released.wait()
            except asyncio.CancelledError:
                _read_holds.pop(conn, None)  # the connection is being closed
                raise
        return drain_writers

    _wrap_once(Http2Server, "_handle_event", "__sluice_h2_stream_buffer_cap__", make_handle_event)
    _wrap_once(Http2Server, "__init__", "__sluice_h2_max_concurrent_streams__", make_server_init)
    _wrap_once(Http2Client, "__init__", "__sluice_h2_stream_buffer_cap__", make_client_init)
    _wrap_once(server.ConnectionHandler, "drain_writers", "__sluice_h2_stream_buffer_cap__", make_drain)


PATCHES["h2_stream_buffer_cap"] = (_patch_h2_stream_buffer_cap, (
    "mitmproxy.proxy.layers.http._http2:Http2Server._handle_event",
    "mitmproxy.proxy.layers.http._http2:Http2Server.__init__",
    "mitmproxy.proxy.layers.http._http2:Http2Client.__init__",
    "mitmproxy.proxy.layers.http._http2:Http2Client._handle_event",
    "mitmproxy.proxy.layers.http._http2:Http2Connection._handle_event",
    "mitmproxy.proxy.layers.http._http2:Http2Connection.handle_h2_event",
    "mitmproxy.proxy.layers.http._http2:Http2Connection.close_connection",
    "mitmproxy.proxy.layers.http._http_h2:BufferedH2Connection.__init__",
    "mitmproxy.proxy.layers.http._http_h2:BufferedH2Connection.send_data",
    "mitmproxy.proxy.layers.http._http_h2:BufferedH2Connection.stream_window_updated",
    "mitmproxy.proxy.server:ConnectionHandler.drain_writers",
    "mitmproxy.proxy.server:ConnectionHandler.handle_connection",
    "mitmproxy.proxy.layers.http:HttpLayer.make_stream",
    "mitmproxy.proxy.layers.http:HttpLayer.get_connection",
    "mitmproxy.proxy.layers.http:HttpClient._handle_event",
))
