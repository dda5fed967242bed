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

Each case writes exactly one line: it either turns the flow's verdict into
the refusal (the audit log's own line then says it) or writes the line
itself where no other line will be written. This addon runs before the gate,
the caps and the audit log (addons/sluice_addon.py).
"""

from __future__ import annotations

import dataclasses
import re

from mitmproxy import connection, ctx, http
from mitmproxy.proxy import mode_specs
from mitmproxy.proxy.server_hooks import ServerConnectionHookData

from addons import connections, mitm_patches
from addons.audit import AuditLog, peer, quote_client
from addons.refusals import refusal_response
from addons.verdict import verdict_of
from policy.decide import Decision
from policy.reasons import Reason, Refusal

# flow.metadata key: mitmproxy found the request invalid (its message) and answers 400 itself.
INVALID = "sluice_invalid_request"

# SOCKS5 reply: version 5, REP 2 "connection not allowed by ruleset", IPv4 0.0.0.0:0.
SOCKS5_NOT_ALLOWED = b"\x05\x02\x00\x01\x00\x00\x00\x00\x00\x00"

SOCKS5_COMMANDS = {1: "CONNECT", 2: "BIND", 3: "UDP ASSOCIATE"}


class ConnectionAudit:
    def __init__(self, audit: AuditLog) -> None:
        self.audit = audit
        # client id -> the proxy-loop refusal of its last dial, until the
        # flow that dialled takes it (or the connection ends without one).
        self._loops: dict[str, tuple[Refusal, str, int]] = {}

    def load(self, loader) -> None:
        mitm_patches.install()  # idempotent; the refusal patches report here
        mitm_patches.set_refusal_listener(self)

    def done(self) -> None:
        if mitm_patches._refusal_listener is self:
            mitm_patches.set_refusal_listener(None)

    # ---- mitmproxy's own 400s on flows ------------------------------------

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        # Before any Sluice addon: an error already set here is mitmproxy's
        # validation of the request (HttpStream.check_invalid), answered 400.
        if flow.error is not None and flow.response is None:
            flow.metadata[INVALID] = flow.error.msg

    def error(self, flow: http.HTTPFlow) -> None:
        self._settle(flow)

    def http_connect_error(self, flow: http.HTTPFlow) -> None:
        self._settle(flow)

    def _settle(self, flow: http.HTTPFlow) -> None:
        invalid = flow.metadata.pop(INVALID, None)
        if invalid is not None:
            self._invalid_request(flow, invalid)
        loop = self._loops.pop(flow.client_conn.id, None)
        if loop is not None:
            self._loop_flow(flow, *loop)

    def _invalid_request(self, flow: http.HTTPFlow, message: str) -> None:
        verdict = verdict_of(flow)
        if message.startswith("Invalid request scheme") and verdict is not None and not verdict.decision.allowed:
            verdict.wire_status = 400  # mitmproxy's check is the gate's scheme rule: keep its reason
            return
        refusal = Refusal(Reason.BAD_REQUEST, f"mitmproxy refused the request as malformed HTTP: {_validation_error(message)}")
        if verdict is None:  # a CONNECT (the gate decides those later) or a request it never saw
            request = flow.request
            self.audit.write(
                event="connect" if request.method == "CONNECT" else "request", id=flow.id,
                client=peer(flow.client_conn), method=quote_client(request.method, 20),
                host=quote_client(request.host, 100) if request.host else None, port=request.port or None,
                decision="refuse", reason=refusal.reason.value, status=400, detail=refusal.detail,
            )
            return
        # Whatever the gate decided, the client got mitmproxy's 400.
        verdict.decision = dataclasses.replace(verdict.decision, allowed=False, refusal=refusal, would_refuse=None)
        verdict.wire_status = 400

    # ---- connections back to the proxy itself -----------------------------

    def server_connect(self, data: ServerConnectionHookData) -> None:
        server = data.server
        if not server.error or server.address is None or not _own_listener(server):
            return
        host, port = server.address[:2]
        refusal = Refusal(Reason.PROXY_LOOP, f"{quote_client(str(host), 100)}:{port} is this proxy's own listening address, not a destination")
        server.error = f"{refusal.reason.value}: {refusal.message}"  # what the client's 502 says
        self._loops[data.client.id] = (refusal, str(host), port)
        if isinstance(data.client.proxy_mode, mode_specs.Socks5Mode):
            # As the gate answers its SOCKS5 refusals: REP 2, not "host unreachable".
            connections.write_to_client(data.client, SOCKS5_NOT_ALLOWED)
            connections.shut_client_writer(data.client)

    def _loop_flow(self, flow: http.HTTPFlow, refusal: Refusal, host: str, port: int) -> None:
        verdict = verdict_of(flow)
        if flow.request.method == "CONNECT" and flow.response is not None:
            flow.response = refusal_response(refusal)  # sent after this hook, instead of mitmproxy's 502
            status = None
        else:
            status = 502  # mitmproxy's answer to the failed dial, carrying the reason
        if verdict is None:
            self.audit.write(event="connect" if flow.request.method == "CONNECT" else "request", id=flow.id,
                             client=peer(flow.client_conn), method=flow.request.method, host=host, port=port,
                             decision="refuse", reason=refusal.reason.value, status=status or refusal.status,
                             detail=refusal.detail)
            return
        # The gate allowed it, the dial was refused: the audit log's line for
        # this flow (and the tunnel's, for a CONNECT: the same verdict) says so.
        verdict.decision = dataclasses.replace(verdict.decision, allowed=False, refusal=refusal, would_refuse=None)
        verdict.wire_status = status

    def client_disconnected(self, client: connection.Client) -> None:
        loop = self._loops.pop(client.id, None)
        if loop is not None:  # no flow took it (SOCKS5, transparent)
            refusal, host, port = loop
            self.audit.refused_connection(client, host, port, Decision(False, None, refusal, port=port), None)

    # ---- refusals with no hook at all (mitm_patches listener) --------------

    def client_refused(self, client: connection.Client, kind: str, message: str, *,
                       data: bytes = b"", request=None, in_tunnel: bool = False) -> None:
        if kind == mitm_patches.SOCKS5_REFUSED:
            reason, detail = _socks_refusal(message, data)
            self.audit.write(event="connection", client=peer(client), decision="refuse",
                             reason=reason.value, detail=detail)
        elif kind == mitm_patches.HTTP_BAD_HEAD:
            reason = Reason.NOT_HTTP if in_tunnel else Reason.BAD_REQUEST
            what = "inside an intercepted tunnel, bytes that are not an HTTP request" if in_tunnel else "a request head mitmproxy cannot parse"
            self.audit.write(event="request", client=peer(client), decision="refuse", reason=reason.value,
                             status=400, detail=f"{what}: {quote_client(message)}")
        elif kind == mitm_patches.HTTP_NO_DESTINATION and request is not None and request.data.method == b"PRI" \
                and request.data.http_version == b"HTTP/2.0":
            # The HTTP/2 connection preface (h2c with prior knowledge), read as a request.
            self.audit.write(event="connection", client=peer(client), decision="refuse",
                             reason=Reason.CLIENT_PROTOCOL_REFUSED.value, status=400,
                             detail="the client spoke HTTP/2 (prior knowledge) to the proxy itself; the proxy port is HTTP/1.1")
        elif kind == mitm_patches.HTTP_NO_DESTINATION:
            self.audit.write(event="request", client=peer(client),
                             method=quote_client(request.method, 20) if request is not None else None,
                             decision="refuse", reason=Reason.BAD_REQUEST.value, status=400,
                             detail="the request names no destination (an origin-form request without a Host header)")


def _own_listener(server: connection.Server) -> bool:
    """mitmproxy's proxyserver test for a dial back to one of its listeners."""
    proxyserver = ctx.master.addons.get("proxyserver")
    if proxyserver is None or server.address is None:
        return False
    host, port = server.address[:2]
    for instance in proxyserver.servers:
        for listen_host, listen_port, *_ in instance.listen_addrs:
            if (port == listen_port and host in ("localhost", "127.0.0.1", "::1", listen_host)
                    and instance.mode.transport_protocol == server.transport_protocol):
                return True
    return False


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
