"""The egress gate: every way a request reaches the proxy passes the same check.

- HTTP requests (absolute-form, or origin-form with the Host header):
  `requestheaders` decides, then pins by setting `request.data.host` to the
  validated IP. The Host header is left as the client sent it, and mitmproxy
  dials and reuses connections keyed by that IP, so keep-alive keeps working.
- CONNECT: `http_connect` decides and pins the tunnel's server address the
  same way (so SNI and Host inside stay the client's).
- SOCKS5 and transparent connections, and every connection whatsoever:
  `server_connect` is the last gate. It re-checks the address that is about
  to be dialled; a name (SOCKS5 with a hostname) is resolved here and pinned.
  Nothing is ever dialled by name, so mitmproxy and the OS never resolve.
- Tunnels that are not intercepted are carried as raw TCP flows (never TLS
  interception by default), which keeps per-tunnel byte counts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from mitmproxy import connection, http, tcp
from mitmproxy.proxy import layer, layers
from mitmproxy.proxy.layers import modes
from mitmproxy.proxy.server_hooks import ServerConnectionHookData

from addons.audit import AuditLog
from addons.identity import PROXY_AUTHORIZATION, ClientIdentifier
from addons.policy_source import LivePolicy, PolicySource
from addons.resolver import decide
from policy.decide import Decision, Destination, check_address
from policy.hosts import IPHost
from policy.model import Rules
from policy.reasons import REASONS, Reason, Refusal

REASON_HEADER = "Sluice-Reason"
META = "sluice"  # flow.metadata key


@dataclass(slots=True)
class Verdict:
    """What the gate decided for one flow, kept in flow.metadata for the audit."""

    host: str
    port: int
    decision: Decision
    profile: str | None
    started: float


def refusal_response(refusal: Refusal) -> http.Response:
    body = refusal.message + "\n"
    return http.Response.make(
        refusal.status,
        body.encode(),
        {
            "Content-Type": "text/plain; charset=utf-8",
            REASON_HEADER: refusal.reason.value,
            # RFC 9209, so generic HTTP tooling can see who refused and why.
            "Proxy-Status": f'sluice; error="{_proxy_status_error(refusal.reason)}"; details="{refusal.reason.value}"',
            "Cache-Control": "no-store",
        },
    )


def _proxy_status_error(reason: Reason) -> str:
    if reason is Reason.DNS_FAILED:
        return "dns_error"
    if reason in (Reason.CONNECT_TIMEOUT,):
        return "connection_timeout"
    return "destination_ip_prohibited" if REASONS[reason].status == 403 else "proxy_internal_response"


class EgressGate:
    def __init__(self, source: PolicySource, audit: AuditLog) -> None:
        self.source = source
        self.audit = audit
        # client id -> {(ip, port): the rules that approved it} for what the
        # request-level gate approved and pinned, so server_connect knows the
        # host rules were already applied.
        self._approved: dict[str, dict[tuple[str, int], Rules]] = {}
        # server connection id -> the host the client asked for, for tunnel audits.
        self._tunnel_hosts: dict[str, Verdict] = {}
        self.identity = ClientIdentifier()

    # ---- deciding ------------------------------------------------------

    def live(self) -> LivePolicy:
        live = self.source.current
        assert live is not None, "the policy is loaded before the proxy starts"
        return live

    async def _gate_http(self, flow: http.HTTPFlow, method: str) -> None:
        request = flow.request
        live = self.live()  # one policy snapshot for the whole decision
        authorization = request.headers.pop(PROXY_AUTHORIZATION, None)  # never forwarded
        client = self.identity.match(live.policy, flow.client_conn, authorization)
        dest = Destination(
            host=request.host, port=request.port,
            scheme=None if method == "CONNECT" else request.scheme, method=method,
        )
        if client.refusal is not None:
            decision = Decision(False, None, client.refusal, port=request.port)
        else:
            decision = await decide(client.rules, dest, live.resolver)
        verdict = Verdict(request.host, request.port, decision, client.profile, time.time())
        flow.metadata[META] = verdict
        if not decision.allowed:
            flow.response = refusal_response(decision.refusal)
            if decision.refusal.reason is Reason.CLIENT_UNKNOWN:
                flow.response.headers["Proxy-Authenticate"] = 'Basic realm="sluice"'
            return
        # Pin: mitmproxy dials (and keys connection reuse on) request.host.
        request.data.host = decision.address
        if method == "CONNECT":
            self._tunnel_hosts[flow.server_conn.id] = verdict
        self._approved.setdefault(flow.client_conn.id, {})[(decision.address, request.port)] = client.rules

    # ---- hooks ---------------------------------------------------------

    async def requestheaders(self, flow: http.HTTPFlow) -> None:
        if flow.response is not None or flow.request.method == "CONNECT":
            return
        await self._gate_http(flow, flow.request.method)

    async def http_connect(self, flow: http.HTTPFlow) -> None:
        if flow.response is not None:
            return
        await self._gate_http(flow, "CONNECT")

    async def server_connect(self, data: ServerConnectionHookData) -> None:
        server = data.server
        if server.address is None or server.error:
            return
        host, port = server.address
        approved_rules = self._approved.get(data.client.id, {}).get((host, port))
        if approved_rules is not None:
            # Decided with the host rules at request level; re-check the address.
            refusal = check_address(approved_rules, host, port)
            if refusal is None:
                return
            decision = Decision(False, IPHost(host, 6 if ":" in host else 4), refusal, port=port)
            self._audit_refusal(data.client, host, port, decision, None)
            server.error = f"{refusal.reason.value}: {refusal.message}"
            return
        live = self.live()
        client = self.identity.match(live.policy, data.client, None)
        rules, profile = client.rules, client.profile
        if client.refusal is not None:
            decision = Decision(False, None, client.refusal, port=port)
        else:
            # SOCKS5, transparent, or anything else that reached a dial.
            decision = await decide(rules, Destination(host=host, port=port), live.resolver)
            if decision.allowed:
                self._tunnel_hosts[server.id] = Verdict(host, port, decision, profile, time.time())
                server.address = (decision.address, port)  # pin
                return
        server.error = f"{decision.refusal.reason.value}: {decision.refusal.message}"
        self._audit_refusal(data.client, host, port, decision, profile)

    def server_disconnected(self, data: ServerConnectionHookData) -> None:
        self._tunnel_hosts.pop(data.server.id, None)

    def client_disconnected(self, client: connection.Client) -> None:
        self._approved.pop(client.id, None)

    def next_layer(self, nextlayer: layer.NextLayer) -> None:
        """Carry tunnel contents (after CONNECT, SOCKS5, transparent) as raw TCP:
        validated and pinned, never TLS-intercepted unless the policy says so."""
        context = nextlayer.context
        if context.client.transport_protocol != "tcp" or isinstance(nextlayer.layer, layers.TCPLayer):
            return
        # An addon that decided before us (mitmproxy's own NextLayer) has
        # already pushed its layers onto the stack; look at the stack below them.
        stack = context.layers
        cut = len(stack)
        if nextlayer.layer is not None and nextlayer.layer in stack:
            cut = stack.index(nextlayer.layer)
        below = stack[:cut]
        if not below:
            return
        if len(below) == 1 and isinstance(below[0], (modes.HttpProxy, modes.HttpUpstreamProxy, modes.ReverseProxy)):
            return  # the proxy's own HTTP front door
        if any(isinstance(l, (layers.ServerTLSLayer, layers.ClientTLSLayer)) for l in below):
            return  # already inside an intercepted TLS session
        del stack[cut:]
        nextlayer.layer = layers.TCPLayer(context, ignore=False)

    # ---- audit ---------------------------------------------------------

    def response(self, flow: http.HTTPFlow) -> None:
        self._audit_http(flow, "request")

    def error(self, flow: http.HTTPFlow) -> None:
        self._audit_http(flow, "request")

    def http_connect_error(self, flow: http.HTTPFlow) -> None:
        self._audit_http(flow, "connect")

    def tcp_start(self, flow: tcp.TCPFlow) -> None:
        flow.metadata["sluice_bytes"] = [0, 0]  # [from client, from server]

    def tcp_message(self, flow: tcp.TCPFlow) -> None:
        counts = flow.metadata.setdefault("sluice_bytes", [0, 0])
        message = flow.messages[-1]
        counts[0 if message.from_client else 1] += len(message.content)
        flow.messages.clear()  # keep memory flat however long the tunnel runs

    def tcp_end(self, flow: tcp.TCPFlow) -> None:
        self._audit_tunnel(flow)

    def tcp_error(self, flow: tcp.TCPFlow) -> None:
        self._audit_tunnel(flow)

    def _audit_http(self, flow: http.HTTPFlow, event: str) -> None:
        verdict: Verdict | None = flow.metadata.get(META)
        if verdict is None or flow.metadata.get("sluice_logged"):
            return
        flow.metadata["sluice_logged"] = True
        d = verdict.decision
        response = flow.response
        refusal = d.refusal
        self.audit.write(
            event="connect" if flow.request.method == "CONNECT" else event,
            id=flow.id, client=_peer(flow.client_conn), profile=verdict.profile,
            method=flow.request.method, scheme=None if flow.request.method == "CONNECT" else flow.request.scheme,
            host=str(d.host) if d.host else verdict.host, port=verdict.port, address=d.address,
            decision="allow" if d.allowed else "refuse",
            reason=refusal.reason.value if refusal else (d.would_refuse.reason.value if d.would_refuse else None),
            would_refuse=True if d.would_refuse else None,
            rule=(refusal.rule if refusal else (d.would_refuse.rule if d.would_refuse else (d.rule.origin if d.rule else None))),
            status=response.status_code if response else None,
            bytes_out=len(flow.request.raw_content or b""),
            bytes_in=len(response.raw_content or b"") if response else 0,
            duration=round(time.time() - verdict.started, 4),
            detail=refusal.detail if refusal else (flow.error.msg if flow.error else None),
        )

    def _audit_tunnel(self, flow: tcp.TCPFlow) -> None:
        if flow.metadata.get("sluice_logged"):
            return
        flow.metadata["sluice_logged"] = True
        verdict = self._tunnel_hosts.get(flow.server_conn.id)
        counts = flow.metadata.get("sluice_bytes", [0, 0])
        address = flow.server_conn.peername[0] if flow.server_conn.peername else (flow.server_conn.address or (None,))[0]
        self.audit.write(
            event="tunnel", id=flow.id, client=_peer(flow.client_conn),
            profile=verdict.profile if verdict else None,
            host=str(verdict.decision.host) if verdict else address,
            port=flow.server_conn.address[1] if flow.server_conn.address else None,
            address=address, decision="allow",
            bytes_out=counts[0], bytes_in=counts[1],
            duration=round(time.time() - flow.timestamp_created, 4) if hasattr(flow, "timestamp_created") else None,
            detail=flow.error.msg if flow.error else None,
        )

    def _audit_refusal(self, client: connection.Client, host: str, port: int, decision: Decision, profile: str | None) -> None:
        refusal = decision.refusal
        self.audit.write(
            event="connect", client=_peer(client), profile=profile,
            host=str(decision.host) if decision.host else host, port=port,
            decision="refuse", reason=refusal.reason.value, rule=refusal.rule, detail=refusal.detail,
        )


def _peer(conn: connection.Client) -> str | None:
    if not conn.peername:
        return None
    host, port = conn.peername[:2]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
