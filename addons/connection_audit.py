"""Audit lines for the refusals mitmproxy makes itself, so every decision has one.

The gate, the caps and the audit log see what passes through Sluice's own
hooks. Some refusals happen in mitmproxy before (or instead of) them:

- **Its own 400s.** A request that fails mitmproxy's validation (both
  Content-Length and Transfer-Encoding, differing Content-Lengths, a bad
  header name, ...) still runs `requestheaders` and `error`, and the gate may
  have allowed it: its line must say `bad_request` (400), not "allow" (nor
  the 502 an origin failure would be). An unparseable request head (no
  flow at all) or an origin-form request without a Host header (a flow, no
  hook) reach this addon through `mitm_patches` (`http1_bad_head`,
  `http_no_destination`); inside an intercepted tunnel an unparseable head
  is `not_http`, and the HTTP/2 preface (h2c prior knowledge) at the front
  door is `client_protocol_refused`.
- **SOCKS handshakes it does not accept** (SOCKS4, BIND, UDP ASSOCIATE, an
  unknown address type, garbage): `client_protocol_refused`, through
  `mitm_patches` (`socks5_refusals`).
- **Connections back to the proxy's own listening addresses.** mitmproxy's
  proxyserver addon refuses these in `server_connect` before the gate's
  turn (which then stands aside): `proxy_loop`. The line is the refused
  flow's (a request gets mitmproxy's 502 naming the reason; a CONNECT gets
  Sluice's 403), or, with no flow (SOCKS5, which gets REP 2), written when
  the client connection ends.

Each case writes exactly one line: it either turns the flow's outcome into
the refusal (the audit log's own line then says it) or writes the line
itself where no other line will be written. This addon runs before the gate,
the caps and the audit log (addons/sluice_addon.py).

What the client gets is Sluice's refusal too, never mitmproxy's HTML page
with `Server: mitmproxy`: `mitm_patches` (`http1_error_pages`) asks
`error_page` for the bytes to send instead, and it answers with the very
refusal the audit line records (status, `Sluice-Reason`, sentence), or, for
a failure that is no refusal (the origin could not be reached), plain text
without a reason code. (A failed SOCKS5 login is audited by the gate's
`socks5_auth` hook, which knows why it failed.)
"""

from __future__ import annotations

import re

from mitmproxy import connection, ctx, http
from mitmproxy.proxy import mode_specs
from mitmproxy.proxy.server_hooks import ServerConnectionHookData

from sluice import connstate
from sluice.addons import connections, mitm_patches
from sluice.addons.audit import AuditLog, peer, quote_client
from sluice.own_host import mitmproxy_listeners
from sluice.refusals import REASON_HEADER, error_bytes, error_response, refusal_body, refusal_bytes, refusal_response
from sluice.outcome import Outcome, outcome_of
from sluice.policy.decide import ALLOWED_SCHEMES, scheme_refusal
from sluice.policy.reasons import Reason, Refusal

# flow.metadata key: mitmproxy found the request invalid (its message) and answers 400 itself.
INVALID = "sluice_invalid_request"

# SOCKS5 reply: version 5, REP 2 "connection not allowed by ruleset", IPv4 0.0.0.0:0.
SOCKS5_NOT_ALLOWED = b"\x05\x02\x00\x01\x00\x00\x00\x00\x00\x00"

SOCKS5_COMMANDS = {1: "CONNECT", 2: "BIND", 3: "UDP ASSOCIATE"}


class ConnectionAudit:
    def __init__(self, audit: AuditLog) -> None:
        self.audit = audit
        # Per client connection, in its ConnState (sluice/connstate.py):
        # `loop`, the proxy-loop refusal of its last dial, until the flow that
        # dialled takes it (or the connection ends without one: its line is
        # written on release, addons/conn_release.py); `error_page`, the
        # refusal its pending mitmproxy error page becomes (the one its audit
        # line records), until `error_page` takes it; `answered`, a bad-head
        # refusal mitmproxy already answered before any flow, for the flow
        # that may still follow it (a head that parsed but whose body framing
        # did not).

    def load(self, loader) -> None:
        mitm_patches.install()  # idempotent; the refusal patches report here
        mitm_patches.set_refusal_listener(self)

    def done(self) -> None:
        if mitm_patches.hooks.refusal_listener is self:
            mitm_patches.set_refusal_listener(None)

    # ---- mitmproxy's own 400s on flows ------------------------------------

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        # Before any Sluice addon: an error already set here is mitmproxy's
        # validation of the request (HttpStream.check_invalid), answered 400.
        if flow.error is not None and flow.response is None:
            flow.metadata[INVALID] = flow.error.msg

    def error(self, flow: http.HTTPFlow) -> None:
        self._settle(flow)

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        self._note_refusal(flow)

    def _note_refusal(self, flow: http.HTTPFlow) -> None:
        """Before any other addon's hook: a refusal another addon set in an
        earlier hook (the gate inside a tunnel, the upgrade guard, the
        fail-safe) ends with the operator's sentence for its client, like
        every other."""
        outcome = outcome_of(flow)
        response = flow.response
        refusal = outcome.answer if outcome is not None else None
        if (refusal is None or refusal.note is not None or response is None or response.stream
                or response.headers.get(REASON_HEADER) != refusal.reason.value):
            return
        note = outcome.rules.refusal_note if outcome.rules is not None else _top_note()
        if note and response.raw_content == refusal_body(refusal):  # exactly Sluice's un-noted body
            response.content = refusal_body(refusal.with_note(note))

    def http_connect_error(self, flow: http.HTTPFlow) -> None:
        self._settle(flow)
        self._note_refusal(flow)
        response = flow.response
        if response is not None and response.status_code == 502 and REASON_HEADER not in response.headers:
            # mitmproxy's own "Cannot connect to ...: <error> If you plan to
            # redirect requests away ...": the origin failed, no rule refused.
            text = response.get_text(strict=False) or ""
            flow.response = error_response(502, text.split(" If you plan to redirect", 1)[0])

    def _settle(self, flow: http.HTTPFlow) -> None:
        invalid = flow.metadata.pop(INVALID, None)
        if invalid is not None:
            self._invalid_request(flow, invalid)
        state = connstate.peek(flow.client_conn)
        answered = state.answered if state is not None else None
        loop = state.loop if state is not None else None
        if state is not None:
            state.answered = state.loop = None
        outcome = outcome_of(flow)
        if answered is not None and invalid is None and outcome is not None:
            # The head parsed, its framing did not: mitmproxy answered 400
            # (error_page) before the flow began; its line says so.
            outcome.answered(answered, answered.status)
        if loop is not None:
            self._loop_flow(flow, *loop)

    def _invalid_request(self, flow: http.HTTPFlow, message: str) -> None:
        outcome = outcome_of(flow)
        if message.startswith("Invalid request scheme") and outcome is not None and not outcome.decision.allowed:
            # mitmproxy's check is the gate's scheme rule: keep its reason,
            # and answer with its refusal instead of mitmproxy's 400.
            self._answer(flow.client_conn, outcome.decision.refusal, outcome)
            outcome.sent(outcome.decision.refusal.status)
            return
        refusal = Refusal(Reason.BAD_REQUEST, f"the request is malformed HTTP: {_validation_error(message)}")
        self._answer(flow.client_conn, refusal, outcome)
        if outcome is None:  # a CONNECT (the gate decides those later) or a request it never saw
            request = flow.request
            self.audit.write(
                event="connect" if request.method == "CONNECT" else "request", id=flow.id,
                client=peer(flow.client_conn), method=quote_client(request.method, 20),
                host=quote_client(request.host, 100) if request.host else None, port=request.port or None,
                decision="refuse", reason=refusal.reason.value, status=400, detail=refusal.detail,
            )
            return
        outcome.answered(refusal, 400)  # whatever the gate decided, the client gets this 400

    # ---- Sluice's answer in place of mitmproxy's error pages --------------

    def _answer(self, client: connection.Client, refusal: Refusal, outcome: Outcome | None = None) -> None:
        """The client's next mitmproxy error page is this refusal (with the
        operator's note for its rules, or the top level's)."""
        rules = outcome.rules if outcome is not None and outcome.rules is not None else None
        note = rules.refusal_note if rules is not None else _top_note()
        connstate.state_of(client).error_page = refusal.with_note(note)

    def error_page(self, client: connection.Client, status: int, message: str, *, in_tunnel: bool) -> bytes | None:
        """mitm_patches `http1_error_pages`: the bytes sent instead of
        mitmproxy's page. The refusal recorded for this client (its audit
        line says the same); else, for a 400 (a head mitmproxy cannot
        parse, audited by `client_refused`), that refusal; else (the origin
        failed: no rule refused anything) plain text with mitmproxy's status."""
        state = connstate.state_of(client)
        refusal, state.error_page = state.error_page, None
        if refusal is None and status == 400:
            refusal = state.answered = _bad_head(message, in_tunnel).with_note(_top_note())
        if refusal is not None:
            return refusal_bytes(refusal)
        return error_bytes(status, _gate_message(message))

    # ---- connections back to the proxy itself -----------------------------

    def server_connect(self, data: ServerConnectionHookData) -> None:
        server = data.server
        if not server.error or server.address is None or not _own_listener(server):
            return
        host, port = server.address[:2]
        refusal = Refusal(Reason.PROXY_LOOP, f"{quote_client(str(host), 100)}:{port} is this proxy's own listening address, not a destination")
        server.error = f"{refusal.reason.value}: {refusal.message}"  # why mitmproxy's dial failed
        connstate.state_of(data.client).loop = (refusal, str(host), port)
        if isinstance(data.client.proxy_mode, mode_specs.Socks5Mode):
            # As the gate answers its SOCKS5 refusals: REP 2, not "host unreachable".
            connections.write_to_client(data.client, SOCKS5_NOT_ALLOWED)
            connections.shut_client_writer(data.client)

    def _loop_flow(self, flow: http.HTTPFlow, refusal: Refusal, host: str, port: int) -> None:
        outcome = outcome_of(flow)
        if flow.request.method == "CONNECT" and flow.response is not None:
            flow.response = refusal_response(refusal.with_note(
                outcome.rules.refusal_note if outcome is not None and outcome.rules is not None else _top_note()))
            status = None  # sent after this hook, instead of mitmproxy's 502
        else:
            # mitmproxy answers the failed dial after this hook: error_page
            # sends this refusal instead of its 502.
            self._answer(flow.client_conn, refusal, outcome)
            status = refusal.status
        if outcome is None:
            self.audit.write(event="connect" if flow.request.method == "CONNECT" else "request", id=flow.id,
                             client=peer(flow.client_conn), method=flow.request.method, host=host, port=port,
                             decision="refuse", reason=refusal.reason.value, status=status or refusal.status,
                             detail=refusal.detail)
            return
        # The gate allowed it, the dial was refused: the audit log's line for
        # this flow (and the tunnel's, for a CONNECT: the same outcome) says so.
        outcome.answered(refusal, status)

    # client_disconnected: a loop no flow took (SOCKS5, transparent) gets its
    # line when addons/conn_release.py releases the ConnState.

    # ---- refusals with no hook at all (mitm_patches listener) --------------

    def client_refused(self, client: connection.Client, kind: str, message: str, *,
                       data: bytes = b"", request=None, in_tunnel: bool = False) -> None:
        if kind == mitm_patches.SOCKS5_REFUSED:
            if message == "authentication failed":
                return  # the gate's socks5_auth hook refused the login and wrote its line
            reason, detail = _socks_refusal(message, data)
            self.audit.write(event="connection", client=peer(client), decision="refuse",
                             reason=reason.value, detail=detail)
        elif kind == mitm_patches.HTTP_BAD_HEAD:
            state = connstate.peek(client)
            if state is not None:
                state.answered = None  # no flow follows: this is its line
            refusal = _bad_head(message, in_tunnel)
            self.audit.write(event="request", client=peer(client), decision="refuse", reason=refusal.reason.value,
                             status=refusal.status, detail=refusal.detail)
        elif kind == mitm_patches.HTTP_NO_DESTINATION and request is not None and request.data.method == b"PRI" \
                and request.data.http_version == b"HTTP/2.0":
            # The HTTP/2 connection preface (h2c with prior knowledge), read as a request.
            refusal = Refusal(Reason.CLIENT_PROTOCOL_REFUSED,
                              "the client spoke HTTP/2 (prior knowledge) to the proxy itself; the proxy port is HTTP/1.1")
            self._answer(client, refusal)
            self.audit.write(event="connection", client=peer(client), decision="refuse",
                             reason=refusal.reason.value, status=400, detail=refusal.detail)
        elif kind == mitm_patches.HTTP_NO_DESTINATION:
            refusal = Refusal(Reason.BAD_REQUEST, "the request names no destination (an origin-form request without a Host header)")
            self._answer(client, refusal)
            self.audit.write(event="request", client=peer(client),
                             method=quote_client(request.method, 20) if request is not None else None,
                             decision="refuse", reason=refusal.reason.value, status=400, detail=refusal.detail)


# mitmproxy's parse error for a request line naming a scheme it has no default
# port for (`GET ftp://host/ HTTP/1.1`): the scheme, not the syntax, is the problem.
_OTHER_SCHEME_LINE = re.compile(r"""^Bad HTTP request line: b['"][!-~]+ ([A-Za-z][A-Za-z0-9+.\-]{0,30})://""")


def _bad_head(message: str, in_tunnel: bool) -> Refusal:
    """A request head mitmproxy cannot parse (it answers 400 with no flow).
    The sentence is about the request; it never names mitmproxy."""
    if in_tunnel:
        return Refusal(Reason.NOT_HTTP, f"inside an intercepted tunnel, bytes that are not an HTTP request: {quote_client(message)}")
    scheme = _OTHER_SCHEME_LINE.match(message)
    if scheme and scheme.group(1).lower() not in ALLOWED_SCHEMES:
        return scheme_refusal(scheme.group(1))
    return Refusal(Reason.BAD_REQUEST, f"the request head is not valid HTTP/1.1: {quote_client(message)}")


def _top_note() -> str | None:
    """The top-level `refusal_note`, for refusals made before any client is
    known (mitmproxy's own 400s)."""
    source = ctx.master.addons.get("policysource") if getattr(ctx, "master", None) is not None else None
    live = getattr(source, "current", None)
    return live.policy.rules.refusal_note if live is not None else None


_REASON_PREFIX = re.compile(r"^([a-z_]+): (.*)$", re.S)


def _gate_message(message: str) -> str:
    """mitmproxy's text for a failed dial; a refusal Sluice made at dial time
    (`reason: sentence`) is shown as its sentence."""
    m = _REASON_PREFIX.match(message)
    return m.group(2) if m and m.group(1) in Reason._value2member_map_ else message


def _own_listener(server: connection.Server) -> bool:
    """mitmproxy's proxyserver test for a dial back to one of its listeners
    (`Proxyserver.server_connect`), on the listener addresses own_host reads."""
    if server.address is None:
        return False
    host, port = server.address[:2]
    return any(port == listen_port and host in ("localhost", "127.0.0.1", "::1", listen_host)
               for listen_host, listen_port in mitmproxy_listeners(server.transport_protocol))


_VALIDATION = re.compile(r"^Received (?P<what>.*) from client, refusing to prevent request smuggling attacks", re.S)


def _validation_error(message: str) -> str:
    m = _VALIDATION.match(message)
    return quote_client(m.group("what") if m else message)


def _socks_refusal(message: str, data: bytes) -> tuple[Reason, str]:
    if message == "authentication failed":
        return Reason.CLIENT_UNKNOWN, "SOCKS5 username/password authentication failed"
    if data[:1] == b"\x04":
        return Reason.CLIENT_PROTOCOL_REFUSED, "the client spoke SOCKS4; this port speaks SOCKS5 (CONNECT only)"
    if data[:1] != b"\x05":
        return Reason.CLIENT_PROTOCOL_REFUSED, f"not a SOCKS5 handshake: {quote_client(data[:16])}"
    if message.startswith("Unsupported SOCKS5 request") and len(data) >= 2:
        command = SOCKS5_COMMANDS.get(data[1], f"command {data[1]}")
        return Reason.CLIENT_PROTOCOL_REFUSED, f"SOCKS5 {command} is not supported; only CONNECT is"
    if message.startswith("Unknown address type") and len(data) >= 4:
        return Reason.CLIENT_PROTOCOL_REFUSED, f"SOCKS5 address type {data[3]} is unknown"
    if message.startswith("Client does not support"):
        return Reason.CLIENT_PROTOCOL_REFUSED, "the client offers no SOCKS5 authentication method this proxy accepts"
    return Reason.CLIENT_PROTOCOL_REFUSED, f"SOCKS5 handshake refused: {quote_client(message)}"
