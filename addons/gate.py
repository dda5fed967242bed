"""The egress gate: every way a request reaches the proxy passes the same check.

- HTTP requests (absolute-form, or origin-form with the Host header):
  `requestheaders` decides, then pins by setting `request.data.host` to the
  validated IP. The Host header is left as the client sent it, and mitmproxy
  dials and reuses connections keyed by that IP, so keep-alive keeps working.
- CONNECT: `http_connect` decides and pins the tunnel's server address the
  same way (SNI and Host inside stay the client's).
- SOCKS5 and transparent connections, and every connection whatsoever:
  `server_connect` is the last gate. It re-checks the address about to be
  dialled; a name (SOCKS5 with a hostname) is resolved here and pinned.
  Nothing is ever dialled by name, so mitmproxy and the OS never resolve.
- Tunnels are carried as raw TCP flows (validated, pinned, byte-counted, never
  decrypted) unless the policy's `intercept` names their host; then
  mitmproxy terminates TLS and every request inside is gated too, with the
  tunnel's host as the only host it may name (else `host_mismatch`).
"""

from __future__ import annotations

from mitmproxy import connection, http
from mitmproxy.net.http import url as mitm_url
from mitmproxy.proxy import layer, layers, mode_specs
from mitmproxy.proxy.layers import modes
from mitmproxy.proxy.server_hooks import ServerConnectionHookData

from addons import connections
from addons.audit import AuditLog
from addons.failsafe import fail_closed
from addons.caps import Caps
from addons.identity import PROXY_AUTHORIZATION, ClientIdentifier
from addons.policy_source import LivePolicy, PolicySource
from addons.refusals import refusal_response
from addons.resolver import decide
from addons.verdict import META, Verdict, verdict_of
from policy.decide import Decision, Destination, check_address
from policy.hosts import HostError, NameHost, parse_host
from policy.model import Rules
from policy.reasons import Reason, Refusal

# SOCKS5 reply: version 5, REP 2 "connection not allowed by ruleset", IPv4 0.0.0.0:0.
SOCKS5_NOT_ALLOWED = b"\x05\x02\x00\x01\x00\x00\x00\x00\x00\x00"

# Hop-by-hop request headers never forwarded (RFC 9110 7.6.1), besides those
# the Connection header names. Upgrade stays so WebSockets keep working.
HOP_BY_HOP = ("Proxy-Connection", "Keep-Alive", "TE")


class EgressGate:
    def __init__(self, source: PolicySource, audit: AuditLog, caps: Caps) -> None:
        self.source = source
        self.audit = audit
        self.caps = caps
        self.identity = ClientIdentifier()
        # client id -> {(ip, port): the rules that approved it}: what the
        # request-level gate approved and pinned, so server_connect knows the
        # host rules were already applied.
        self._approved: dict[str, dict[tuple[str, int], Rules]] = {}
        # tunnel server connection id -> the tunnel's verdict (its real host),
        # and client id -> those server ids, for clean-up.
        self._tunnels: dict[str, Verdict] = {}
        self._client_tunnels: dict[str, list[str]] = {}

    def live(self) -> LivePolicy:
        live = self.source.current
        assert live is not None, "the policy is loaded before the proxy starts"
        return live

    # ---- HTTP and CONNECT ----------------------------------------------

    @fail_closed()
    async def requestheaders(self, flow: http.HTTPFlow) -> None:
        if flow.response is not None or flow.request.method == "CONNECT":
            return
        tunnel = self._tunnels.get(flow.server_conn.id)
        if tunnel is not None:
            await self._gate_inside_tunnel(flow, tunnel)
        else:
            await self._gate_http(flow)
        verdict = verdict_of(flow)
        if verdict is not None and flow.error is not None:
            # mitmproxy already found the request invalid (e.g. an ftp:// URL)
            # and answers 400 itself after this hook: record what was sent.
            flow.response = None
            verdict.wire_status = 400
        elif verdict is not None and verdict.decision.allowed:
            _strip_headers(flow.request, verdict.rules.strip_request_headers if verdict.rules else frozenset())

    @fail_closed()
    async def http_connect(self, flow: http.HTTPFlow) -> None:
        if flow.response is None:
            await self._gate_http(flow, connect=True)

    async def _gate_http(self, flow: http.HTTPFlow, connect: bool = False) -> None:
        request = flow.request
        live = self.live()  # one policy snapshot for the whole decision
        authorization = request.headers.pop(PROXY_AUTHORIZATION, None)  # never forwarded
        client = await self.identity.match(live.policy, flow.client_conn, authorization)
        intercept = connect and client.refusal is None and _intercepts(client.rules, request.host)
        dest = Destination(
            host=request.host, port=request.port,
            scheme=None if connect else request.scheme,
            # An intercepted tunnel's requests are checked one by one, so the
            # CONNECT itself is not a method the policy must list.
            method=None if intercept else request.method,
        )
        if client.refusal is not None:
            decision = Decision(False, None, client.refusal, port=request.port)
        else:
            decision = await decide(client.rules, dest, live.resolver)
        verdict = Verdict(request.host, request.port, decision, client.profile,
                          client.rules if client.refusal is None else None, intercept=intercept)
        flow.metadata[META] = verdict
        if not decision.allowed:
            flow.response = refusal_response(decision.refusal)
            return
        self.caps.watch_client(flow.client_conn, client.rules)
        # Pin: mitmproxy dials (and keys connection reuse on) request.host.
        request.data.host = decision.address
        self._approved.setdefault(flow.client_conn.id, {})[(decision.address, request.port)] = client.rules
        if connect:
            if intercept and isinstance(decision.host, NameHost):
                flow.server_conn.sni = decision.host.name  # verify upstream against the name
            self._remember_tunnel(flow.client_conn, flow.server_conn, verdict)

    async def _gate_inside_tunnel(self, flow: http.HTTPFlow, tunnel: Verdict) -> None:
        """A request inside an intercepted tunnel: it may only talk to the
        tunnel's host (no domain fronting), and is checked like any request."""
        request = flow.request
        rules = tunnel.rules
        refusal = _fronting(tunnel, request.host_header, flow.client_conn.sni)
        if refusal is not None or rules is None:
            decision = Decision(False, None, refusal or Refusal(Reason.CLIENT_UNKNOWN, "unknown client"), port=tunnel.port)
        else:
            dest = Destination(tunnel.host, tunnel.port, request.scheme, request.method)
            decision = await decide(rules, dest, self.live().resolver)
        flow.metadata[META] = Verdict(tunnel.host, tunnel.port, decision, tunnel.profile, rules)
        if not decision.allowed:
            flow.response = refusal_response(decision.refusal)
            return
        # Stay on the tunnel's pinned address (it was validated at CONNECT).
        request.data.host = tunnel.decision.address

    # ---- the last gate: every dial ---------------------------------------

    @fail_closed()
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
                self.caps.watch_connect(data.client, server, approved_rules.limits)
                return
            self._refuse_dial(data, host, port, Decision(False, None, refusal, port=port), None)
            return
        live = self.live()
        client = await self.identity.match(live.policy, data.client, None)
        if client.refusal is not None:
            self._refuse_dial(data, host, port, Decision(False, None, client.refusal, port=port), None)
            return
        # SOCKS5, transparent, or anything else that reached a dial.
        decision = await decide(client.rules, Destination(host=host, port=port), live.resolver)
        if not decision.allowed:
            self._refuse_dial(data, host, port, decision, client.profile)
            return
        intercept = _intercepts(client.rules, host)
        verdict = Verdict(host, port, decision, client.profile, client.rules, intercept=intercept)
        self._remember_tunnel(data.client, server, verdict)
        self._approved.setdefault(data.client.id, {})[(decision.address, port)] = client.rules
        server.address = (decision.address, port)  # pin
        if intercept and isinstance(decision.host, NameHost):
            server.sni = decision.host.name
        self.caps.watch_client(data.client, client.rules)
        self.caps.watch_connect(data.client, server, client.rules.limits)

    def _refuse_dial(self, data: ServerConnectionHookData, host: str, port: int, decision: Decision, profile: str | None) -> None:
        data.server.error = f"{decision.refusal.reason.value}: {decision.refusal.message}"
        self.audit.refused_connection(data.client, host, port, decision, profile)
        if isinstance(data.client.proxy_mode, mode_specs.Socks5Mode) and not self._approved.get(data.client.id):
            # mitmproxy would answer "host unreachable" (REP 4); a policy
            # refusal is "connection not allowed by ruleset" (REP 2), which
            # tells a SOCKS client not to retry. Nothing else reaches it after.
            connections.write_to_client(data.client, SOCKS5_NOT_ALLOWED)
            connections.shut_client_writer(data.client)

    def _remember_tunnel(self, client: connection.Client, server: connection.Server, verdict: Verdict) -> None:
        self._tunnels[server.id] = verdict
        self._client_tunnels.setdefault(client.id, []).append(server.id)
        if not verdict.intercept:
            self.caps.watch_tunnel(client, verdict)

    def client_disconnected(self, client: connection.Client) -> None:
        self._approved.pop(client.id, None)
        for server_id in self._client_tunnels.pop(client.id, ()):
            tunnel = self._tunnels.pop(server_id, None)
            if tunnel is not None and not tunnel.intercept:
                self.audit.tunnel_line(tunnel, client)  # if its TCP flow did not already

    # ---- what runs inside a tunnel ---------------------------------------

    def next_layer(self, nextlayer: layer.NextLayer) -> None:
        """Carry tunnel contents (after CONNECT, SOCKS5, transparent) as raw TCP,
        unless the tunnel's host is intercepted."""
        context = nextlayer.context
        if context.client.transport_protocol != "tcp" or isinstance(nextlayer.layer, layers.TCPLayer):
            return
        # An addon that decided before us (mitmproxy's own NextLayer) has
        # already pushed its layers onto the stack; look at the stack below them.
        stack = context.layers
        cut = stack.index(nextlayer.layer) if nextlayer.layer is not None and nextlayer.layer in stack else len(stack)
        below = stack[:cut]
        if not below:
            return
        if len(below) == 1 and isinstance(below[0], (modes.HttpProxy, modes.HttpUpstreamProxy, modes.ReverseProxy)):
            return  # the proxy's own HTTP front door
        if any(isinstance(l, (layers.ServerTLSLayer, layers.ClientTLSLayer)) for l in below):
            return  # already inside an intercepted TLS session
        tunnel = self._tunnels.get(context.server.id)
        if tunnel is not None and tunnel.intercept:
            return  # mitmproxy's own choice: TLS interception, then HTTP
        del stack[cut:]
        # ignore=True: no TCP flow and no per-chunk hooks (mitmproxy's tunnel
        # speed); Caps meters the bytes at the server socket instead.
        nextlayer.layer = layers.TCPLayer(context, ignore=True)

    @fail_closed()
    def server_connected(self, data: ServerConnectionHookData) -> None:
        tunnel = self._tunnels.get(data.server.id)
        if tunnel is not None and not tunnel.intercept:
            self.caps.meter_tunnel(data.client, data.server, tunnel)


def _intercepts(rules: Rules, host_text: str) -> bool:
    if not rules.intercept:
        return False
    try:
        return rules.intercept.match_host(parse_host(host_text)) is not None
    except HostError:
        return False


def _same_host(a: str, b: str) -> bool:
    try:
        return parse_host(a) == parse_host(b)
    except HostError:
        return False


def _fronting(tunnel: Verdict, host_header: str | None, sni: str | None) -> Refusal | None:
    """Domain fronting inside an intercepted tunnel: a Host header or SNI that
    names another host than the CONNECT target."""
    if sni and not _same_host(sni, tunnel.host):
        return Refusal(Reason.HOST_MISMATCH, f"the TLS server name {sni!r} is not the tunnel's host {tunnel.host}")
    if host_header:
        try:
            named, _ = mitm_url.parse_authority(host_header, check=True)
        except ValueError:
            named = host_header
        if not _same_host(named, tunnel.host):
            return Refusal(Reason.HOST_MISMATCH, f"the Host header {host_header!r} is not the tunnel's host {tunnel.host}")
    return None


def _strip_headers(request: http.Request, extra: frozenset[str]) -> None:
    connection_tokens = [t.strip() for t in request.headers.get("Connection", "").split(",") if t.strip()]
    for token in connection_tokens:
        if token.lower() not in ("close", "keep-alive", "upgrade"):
            request.headers.pop(token, None)
    for name in HOP_BY_HOP:
        request.headers.pop(name, None)
    for name in extra:
        request.headers.pop(name, None)
