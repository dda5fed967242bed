"""Size and time caps: connect, whole-request and idle timeouts, request and
response body caps counted on the wire as bodies stream, tunnel byte and time
caps. Nothing is ever buffered to be counted, so memory stays flat.

A cap that trips before the response started answers the client with a clear
status and `Sluice-Reason`; after bytes went out, the connection is closed.
Either way the outcome records the cap, the audit line names it, and the
client connection (with its server connections) is closed and freed.
"""

from __future__ import annotations

import asyncio

from mitmproxy import connection, http
from mitmproxy.connection import ConnectionState
from mitmproxy.proxy.server_hooks import ServerConnectionHookData

from sluice import connstate
from sluice.addons import connections, mitm_patches
from sluice.addons.audit import AuditLog
from sluice.failsafe import fail_closed
from sluice.addons.policy_source import PolicySource
from sluice.refusals import answer_now, noted, refusal_bytes, refusal_response
from sluice.outcome import Outcome, outcome_of
from sluice.dialer import OUT_OF_FILES_DIAL, UPSTREAMS_BUSY, Meter
from sluice.policy.model import Limits, Rules
from sluice.policy.reasons import Reason, Refusal
from sluice.policy.units import size_text

NO_BODY_STATUSES = frozenset({204, 304})
CONNECT_TIMEOUT_PREFIX = f"{Reason.CONNECT_TIMEOUT.value}: "  # how the dialer's timeout reads in server.error
UPSTREAM_PROXY_PREFIX = f"{Reason.UPSTREAM_PROXY_FAILED.value}: "  # and its parent proxy's failures


class Caps:
    def __init__(self, source: PolicySource, audit: AuditLog) -> None:
        self.source = source
        self.audit = audit
        self._request_deadlines: dict[str, asyncio.TimerHandle] = {}  # flow id
        # Per client connection, in its ConnState (sluice/connstate.py): its
        # tunnels' time caps, and the connect-time refusal (timeout, no fd,
        # upstreams busy) its failing exchange is answered with.

    def load(self, loader) -> None:
        mitm_patches.set_stream_cap_listener(self)

    def done(self) -> None:
        mitm_patches.set_stream_cap_listener(None)

    # ---- called by the gate ----------------------------------------------

    def watch_client(self, client: connection.Client, rules: Rules) -> None:
        top = self.source.current.policy.rules.limits if self.source.current else Limits()
        if rules.limits.idle_timeout != top.idle_timeout:
            connections.set_idle_timeout(client, rules.limits.idle_timeout)

    def h2_stream_reset(self, flow: http.HTTPFlow, buffered: int, cap: int) -> None:
        """mitm_patches reset an HTTP/2 stream whose client did not read it
        (the backstop of h2_stream_buffer_cap): its audit line says so."""
        outcome = outcome_of(flow)
        if outcome is not None:
            outcome.cut(Refusal(
                Reason.RESPONSE_TOO_LARGE,
                f"the client left this HTTP/2 stream unread while the proxy held {buffered} bytes of it, over twice "
                f"this proxy's {size_text(cap)} limits.h2_stream_buffer_bytes, so the stream was reset",
                advice="Read each HTTP/2 stream as its data arrives (open its flow-control window); the request may be retried."))

    # ---- a dial that failed: the client's answer --------------------------

    def server_connect_error(self, data: ServerConnectionHookData) -> None:
        error = data.server.error or ""
        if error.startswith(CONNECT_TIMEOUT_PREFIX):
            # The dialer (sluice/dialer.py) gave up within limits.connect_timeout.
            connstate.state_of(data.client).connect_refusal = Refusal(
                Reason.CONNECT_TIMEOUT, error[len(CONNECT_TIMEOUT_PREFIX):])
        elif error.startswith(UPSTREAM_PROXY_PREFIX):
            # The dialer's parent proxy (upstream_proxy) was down, slow or refused the CONNECT.
            connstate.state_of(data.client).connect_refusal = Refusal(
                Reason.UPSTREAM_PROXY_FAILED, error[len(UPSTREAM_PROXY_PREFIX):])
        elif OUT_OF_FILES_DIAL in error:
            # No fd for the dial (sluice/open_files.py reported it): answered
            # like a connect timeout, as a refusal the client can act on.
            connstate.state_of(data.client).connect_refusal = Refusal(
                Reason.TOO_MANY_CONNECTIONS, f"{OUT_OF_FILES_DIAL}; it is overloaded",
                advice="Retry in a few seconds, with fewer connections open.")
        elif UPSTREAMS_BUSY in error:
            # addons/upstreams.py: every upstream this client connection may hold is in use.
            connstate.state_of(data.client).connect_refusal = Refusal(
                Reason.TOO_MANY_CONNECTIONS, data.server.error.split("] ", 1)[-1],
                advice="Finish an exchange (or use another client connection), then retry.")

    def client_connected(self, client: connection.Client) -> None:
        if self.source.current is not None:
            connections.set_idle_timeout(client, self.source.current.policy.rules.limits.idle_timeout)

    # client_disconnected: addons/conn_release.py cancels the tunnels' time
    # caps and drops the connect refusal with the rest of the ConnState.

    # ---- HTTP exchanges ----------------------------------------------------

    @fail_closed()
    def requestheaders(self, flow: http.HTTPFlow) -> None:
        outcome = outcome_of(flow)
        if outcome is None or not outcome.decision.allowed or flow.response is not None:
            return
        limits = outcome.limits
        length = flow.request.headers.get("content-length")
        if length is not None and length.strip().isdigit() and int(length) > limits.max_request_bytes:
            outcome.cut(Refusal(Reason.REQUEST_TOO_LARGE, f"the request body is {int(length)} bytes, over this policy's {size_text(limits.max_request_bytes)} cap"))
            answer_now(flow, outcome.cap)
            return
        if length is None:
            # Chunked HTTP/1, and HTTP/2 bodies (which need no length at all):
            # counted as they stream. (An HTTP/1 request with neither has no body.)
            flow.request.stream = _BodyCounter(self, flow, limits.max_request_bytes, request=True)
        loop = asyncio.get_running_loop()
        self._request_deadlines[flow.id] = loop.call_later(
            limits.request_timeout, self._request_expired, flow, limits.request_timeout
        )

    @fail_closed(response_phase=True)
    def responseheaders(self, flow: http.HTTPFlow) -> None:
        outcome = outcome_of(flow)
        if outcome is None or not outcome.decision.allowed or outcome.cap is not None:
            return
        limits = outcome.limits
        response = flow.response
        has_body = flow.request.method != "HEAD" and response.status_code >= 200 and response.status_code not in NO_BODY_STATUSES
        length = response.headers.get("content-length")
        if has_body and length is not None and length.strip().isdigit() and int(length) > limits.max_response_bytes:
            outcome.cut(Refusal(Reason.RESPONSE_TOO_LARGE, f"the response body is {int(length)} bytes, over this policy's {size_text(limits.max_response_bytes)} cap"))
            answer_now(flow, outcome.cap)
            return
        if response.stream is False or response.stream is None:
            # Stream every body: counted chunk by chunk, never buffered whole.
            response.stream = _BodyCounter(self, flow, limits.max_response_bytes, request=False)
        outcome.response_started = True

    def response(self, flow: http.HTTPFlow) -> None:
        self._finish(flow)

    def error(self, flow: http.HTTPFlow) -> None:
        timeout = _take_connect_refusal(flow.client_conn)
        outcome = outcome_of(flow)
        if timeout is not None and outcome is not None and not outcome.response_started and outcome.cut(timeout):
            answer_now(flow, timeout)
        elif (outcome is not None and outcome.decision.allowed and outcome.cap is None
              and not outcome.response_started and flow.client_conn.state & ConnectionState.CAN_WRITE):
            # The origin failed before answering (reset, refused, bad
            # response): mitmproxy answers the client 502 itself.
            outcome.sent(502)
        self._finish(flow)

    def http_connect_error(self, flow: http.HTTPFlow) -> None:
        timeout = _take_connect_refusal(flow.client_conn)
        outcome = outcome_of(flow)
        if timeout is not None and outcome is not None:
            outcome.cut(timeout)
            flow.response = refusal_response(noted(flow, outcome.cap))

    def _finish(self, flow: http.HTTPFlow) -> None:
        handle = self._request_deadlines.pop(flow.id, None)
        if handle:
            handle.cancel()

    def _request_expired(self, flow: http.HTTPFlow, seconds: float) -> None:
        self._request_deadlines.pop(flow.id, None)
        self.cut(flow, Refusal(Reason.REQUEST_TIMEOUT, f"the exchange took longer than this policy's {seconds:g}s request timeout"))

    def cut(self, flow: http.HTTPFlow, refusal: Refusal) -> None:
        """End an exchange now, from outside any hook (timer, body chunk)."""
        outcome = outcome_of(flow)
        if outcome is None or not outcome.cut(refusal):
            return
        self._close_cut(flow)

    def cut_soon(self, flow: http.HTTPFlow, refusal: Refusal) -> None:
        """From inside mitmproxy's event processing (a body chunk): the
        exchange is marked cut now, so its audit line names the cut even if
        mitmproxy ends the exchange first; its sockets close just after."""
        outcome = outcome_of(flow)
        if outcome is None or not outcome.cut(refusal):
            return
        asyncio.get_running_loop().call_soon(self._close_cut, flow)

    def _close_cut(self, flow: http.HTTPFlow) -> None:
        outcome = outcome_of(flow)
        refusal = noted(flow, outcome.cap)
        if not outcome.response_started and not (flow.request.is_http2 or flow.request.is_http3):
            connections.write_to_client(flow.client_conn, refusal_bytes(refusal))
        connections.close_client(flow.client_conn)
        self._finish(flow)
        self.audit.http_flow(flow)

    # ---- tunnels -----------------------------------------------------------

    def watch_tunnel(self, client: connection.Client, outcome: Outcome) -> None:
        """Start a passed-through tunnel's time cap as soon as it is open (a
        tunnel that never carries a byte is still capped)."""
        seconds = outcome.limits.tunnel_max_seconds
        if seconds is None:
            return
        handle = asyncio.get_running_loop().call_later(
            seconds, self.cut_tunnel, client, outcome,
            Refusal(Reason.TUNNEL_TIMEOUT, f"the tunnel stayed open longer than this policy's {seconds:g}s tunnel cap"),
        )
        connstate.state_of(client).tunnel_deadlines.append(handle)

    def tunnel_meter(self, client: connection.Client, outcome: Outcome) -> Meter:
        """The dialer's meter for a passed-through tunnel: count its bytes in
        each direction and cut it at `tunnel_max_bytes` (the byte that would
        pass the cap never goes out)."""
        cap = outcome.limits.tunnel_max_bytes
        loop = asyncio.get_running_loop()

        def meter(from_client: bool, n: int) -> int:
            if outcome.cap is not None:
                return 0
            before = outcome.bytes_from_client if from_client else outcome.bytes_from_server
            allowed = n if cap is None else max(0, min(n, cap - before))
            if from_client:
                outcome.bytes_from_client += allowed
            else:
                outcome.bytes_from_server += allowed
            if allowed < n:
                loop.call_soon(self.cut_tunnel, client, outcome, Refusal(
                    Reason.TUNNEL_TOO_LARGE, f"the tunnel carried more than this policy's {size_text(cap)} cap in one direction"))
            return allowed

        return meter

    def cut_tunnel(self, client: connection.Client, outcome: Outcome, refusal: Refusal) -> None:
        if outcome.logged or not outcome.cut(refusal):
            return
        connections.close_client(client)
        self.audit.tunnel_line(outcome, client)


def _take_connect_refusal(client: connection.Client) -> Refusal | None:
    state = connstate.peek(client)
    if state is None:
        return None
    refusal, state.connect_refusal = state.connect_refusal, None
    return refusal


class _BodyCounter:
    """A mitmproxy stream callable: counts a body's bytes on the wire, passes
    them through, and cuts the exchange once the cap is passed or its
    client's transfer quota (`outcome.transfer`) runs out (the client then
    sees a body that ends without its terminator: plainly incomplete)."""

    __slots__ = ("caps", "flow", "cap", "request", "seen", "tripped")

    def __init__(self, caps: Caps, flow: http.HTTPFlow, cap: int, *, request: bool) -> None:
        self.caps, self.flow, self.cap, self.request, self.seen = caps, flow, cap, request, 0
        self.tripped = False

    def __call__(self, chunk: bytes) -> bytes | list[bytes]:
        if self.tripped:
            # Whatever comes after the cap (more data, or the end of the body,
            # which mitmproxy would frame as a clean finish) never reaches the
            # other side: its writer is shut now, synchronously.
            if self.request:
                connections.shut_server_writer(self.flow.client_conn, self.flow.server_conn)
            else:
                connections.shut_client_writer(self.flow.client_conn)
            return []  # b"" would go out as a zero-length chunk: an end of body
        if not chunk:
            return chunk
        outcome: Outcome | None = outcome_of(self.flow)
        if outcome is None or outcome.cap is not None:
            return []
        self.seen += len(chunk)
        if self.request:
            outcome.bytes_from_client = self.seen
        else:
            outcome.bytes_from_server = self.seen
        allowed = len(chunk) - max(0, self.seen - self.cap)
        refusal = None
        if allowed < len(chunk):
            reason = Reason.REQUEST_TOO_LARGE if self.request else Reason.RESPONSE_TOO_LARGE
            what = "request" if self.request else "response"
            refusal = Refusal(reason, f"the {what} body passed this policy's {size_text(self.cap)} cap")
        charge = outcome.transfer
        if charge is not None and allowed > 0:
            # The client's transfer quota, charged as the bytes pass: when it
            # runs out, this exchange (and every other one in flight) stops here.
            granted = charge(allowed)
            if granted < allowed:
                allowed, refusal = granted, charge.refusal()
        if refusal is None:
            return chunk
        self.tripped = True
        if self.request:
            outcome.bytes_from_client -= len(chunk) - allowed  # what passed
        else:
            outcome.bytes_from_server -= len(chunk) - allowed
        self.caps.cut_soon(self.flow, refusal)
        head = chunk[:allowed]
        return head if head else []
