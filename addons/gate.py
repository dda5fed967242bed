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
  mitmproxy terminates TLS and every request inside is an HTTP request
  checked against the live policy, with the tunnel's host as the only host it
  may name in Host, `:authority`, SNI or the request target (else
  `host_mismatch`). Bytes inside an intercepted tunnel that are not HTTP are
  never passed raw.
- The front door speaks plain HTTP/1 (and SOCKS5 on its own port): a client
  that talks TLS (and so HTTP/2) to the proxy itself is refused
  (`client_protocol_refused`), so one client connection never multiplexes
  streams onto one shared upstream object and TLS to the proxy never implies
  interception.
- Every dial goes through one dialer (sluice/dialer.py, reached from
  mitmproxy's connect by addons/mitm_patches.py `dial_check`): only an IP
  address this gate approved for the client connection may be dialled, never
  a name; after the connect, the peer must be that address (else
  `pin_mismatch`, closed before a byte passes).
- A reload matches every open tunnel's client again (user, source) and
  re-decides the tunnel with the profile it matches now; it closes those
  the new policy refuses or whose client matches no profile any more
  (`tunnel_revoked`).
- A destination at one of the proxy's own host's addresses, on any port, is
  `proxy_loop` (addons/own_host.py says which addresses), decided with the
  rest so the client gets the 403 and the audit line says refuse; the dial
  check refuses it again if the address became the host's since.
"""

from __future__ import annotations

import dataclasses
import logging

from mitmproxy import connection, http
from mitmproxy.net import tls as mitm_tls
from mitmproxy.net.http import url as mitm_url
from mitmproxy.proxy import commands, events, layer, layers, mode_specs
from mitmproxy.proxy.layers import modes
from mitmproxy.proxy.layers.http import HTTPMode
from mitmproxy.proxy.server_hooks import ServerConnectionHookData

from sluice import connstate
from sluice.addons import connections, mitm_patches
from sluice.addons.audit import AuditLog, peer, quote_client
from sluice.addons.failsafe import fail_closed
from sluice.addons.caps import Caps
from sluice.addons.identity import PROXY_AUTHORIZATION, ClientIdentifier, parse_basic
from sluice.addons.own_host import OWN_HOST
from sluice.addons.policy_source import LivePolicy, PolicySource
from sluice.addons.refusals import refusal_response
from sluice.addons.resolver import decide
from sluice.addons.verdict import META, Verdict, verdict_of
from sluice.dialer import Dialer, pinned_ip
from sluice.policy.clients import rematch
from sluice.policy.decide import Decision, Destination, check_address, check_answers, check_request, intercepts
from sluice.policy.hosts import HostError, NameHost, parse_host
from sluice.policy.model import Policy, Rules
from sluice.policy.reasons import Reason, Refusal
from sluice.policy.request_rules import split_target

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
        # What the gate approved and pinned for each client connection, and
        # its tunnels, are in its ConnState (sluice/connstate.py): `approved`
        # tells server_connect the host rules were applied, and the dialer
        # (sluice/dialer.py) admits nothing else.
        # The one dialer: it admits only what the approvals hold; a tunnel's
        # server socket is metered by its caps (addons/quotas.py adds its own).
        self.dialer = Dialer(self._approved_rules, audit, self._proxy_addresses, connections.close_client)
        self.dialer.meter_sources.append(self._tunnel_meter)

    def load(self, loader) -> None:
        mitm_patches.install()
        mitm_patches.set_dialer(self.dialer)
        mitm_patches.set_socks5_login(True)  # SOCKS5 clients may identify with username/password
        self.source.on_reload(self.revoke_refused_tunnels)

    def live(self) -> LivePolicy:
        live = self.source.current
        assert live is not None, "the policy is loaded before the proxy starts"
        return live

    # ---- HTTP and CONNECT ----------------------------------------------

    @fail_closed()
    async def requestheaders(self, flow: http.HTTPFlow) -> None:
        if flow.response is not None or flow.request.method == "CONNECT":
            return
        tunnel = tunnel_of(flow.client_conn, flow.server_conn)
        if tunnel is not None:
            # Proxy credentials are for the proxy, in every mode: never forwarded.
            flow.request.headers.pop(PROXY_AUTHORIZATION, None)
            await self._gate_inside_tunnel(flow, tunnel)
        else:
            await self._gate_http(flow)
        verdict = verdict_of(flow)
        if verdict is not None and flow.error is not None:
            # mitmproxy already found the request invalid (e.g. an ftp:// URL)
            # and answers 400 itself after this hook: record what was sent.
            flow.response = None
            verdict.sent(400)
        elif verdict is not None and verdict.decision.allowed:
            _strip_headers(flow.request, verdict.rules.strip_request_headers if verdict.rules else frozenset())

    @fail_closed()
    async def http_connect(self, flow: http.HTTPFlow) -> None:
        if flow.response is not None:
            return
        tunnel = tunnel_of(flow.client_conn, flow.server_conn)
        if tunnel is not None:
            # mitmproxy would treat the tunnel's origin as an upstream proxy
            # and repoint the tunnel's server: a tunnel names one host only.
            refusal = Refusal(Reason.HOST_MISMATCH, f"a CONNECT inside the tunnel to {tunnel.host} is not allowed; open a new tunnel from the proxy")
            flow.metadata[META] = Verdict(tunnel.host, tunnel.port, Decision(False, None, refusal, port=tunnel.port), tunnel.profile, None)
            _inside(flow, tunnel)
            flow.response = refusal_response(refusal.with_note(tunnel.rules.refusal_note) if tunnel.rules else refusal)
            return
        await self._gate_http(flow, connect=True)

    async def _gate_http(self, flow: http.HTTPFlow, connect: bool = False) -> None:
        request = flow.request
        live = self.live()  # one policy snapshot for the whole decision
        authorization = request.headers.pop(PROXY_AUTHORIZATION, None)  # never forwarded
        client = await self.identity.match(live.policy, flow.client_conn, authorization)
        intercept = connect and client.refusal is None and intercepts(client.rules, request.host)
        dest = Destination(
            host=request.host, port=request.port,
            scheme=None if connect else request.scheme,
            # An intercepted tunnel's requests are checked one by one, so the
            # CONNECT itself is not a method the policy must list.
            method=None if intercept else request.method,
            target=None if connect else request.path,
        )
        if client.refusal is not None:
            decision = Decision(False, None, client.refusal, port=request.port)
        else:
            decision = _not_own_host(client.rules, live.policy, await decide(client.rules, dest, live.resolver))
        verdict = Verdict(request.host, request.port, decision, client.profile,
                          client.rules if client.refusal is None else None, intercept=intercept, method=dest.method)
        flow.metadata[META] = verdict
        verdict.user = _user(live.policy, authorization)
        verdict.identity = self.identity.identity(live.policy, flow.client_conn, authorization, client)
        if connect:
            verdict.connect_id = flow.id  # its tunnel's line, and the requests inside, carry it
        if not decision.allowed:
            flow.response = refusal_response(decision.refusal)
            return
        self.caps.watch_client(flow.client_conn, client.rules)
        if not connect and request.host_header is not None and not _names_authority(request.host_header, request.host, request.port):
            # Absolute-form with a Host header naming something else: RFC 9112
            # 3.2.2 has the proxy replace it, so the origin sees the host the
            # gate decided on (no fronting another virtual host on that IP).
            request.host_header = _authority(request.scheme, request.host, request.port)
        _forward_path(request, decision)
        # Pin: mitmproxy dials (and keys connection reuse on) request.host.
        request.data.host = decision.address
        self._approve(flow.client_conn, decision.address, request.port, client.rules)
        if connect:
            if intercept and isinstance(decision.host, NameHost):
                flow.server_conn.sni = decision.host.name  # verify upstream against the name
            self._remember_tunnel(flow.client_conn, flow.server_conn, verdict)

    async def _gate_inside_tunnel(self, flow: http.HTTPFlow, tunnel: Verdict) -> None:
        """A request inside an intercepted tunnel: it may only name the
        tunnel's host (no domain fronting), and is checked like any request,
        with the live policy's rules for the tunnel's client profile."""
        request = flow.request
        tunnel.requests += 1
        live = self.live()
        rules = _live_rules(live.policy, tunnel.profile)
        refusal = _fronting(tunnel, request.host_header, flow.client_conn.sni, request.authority)
        if refusal is None and rules is None:
            refusal = Refusal(Reason.CLIENT_UNKNOWN, f"the tunnel's client profile {tunnel.profile!r} is no longer in the policy")
        if refusal is not None:
            decision = Decision(False, None, refusal, port=tunnel.port)
        else:
            dest = Destination(tunnel.host, tunnel.port, request.scheme, request.method, target=request.path)
            decision = await decide(rules, dest, live.resolver)
        flow.metadata[META] = Verdict(tunnel.host, tunnel.port, decision, tunnel.profile, rules, method=request.method)
        _inside(flow, tunnel)
        if not decision.allowed:
            flow.response = refusal_response(decision.refusal)
            return
        _forward_path(request, decision)
        # Stay on the tunnel's pinned address (it was validated at CONNECT).
        request.data.host = tunnel.decision.address
        if request.authority and not (request.is_http2 or request.is_http3):
            # Absolute-form naming the tunnel's own host: send origin-form, so
            # the origin can only ever see the tunnel's host.
            request.authority = ""
        if not request.host_header:
            # No Host (HTTP/1.0, an empty one, absolute-form without one): name
            # the tunnel's host, or a shared origin's default virtual host answers.
            request.host_header = _authority(request.scheme, tunnel.host, tunnel.port)

    # ---- SOCKS5 username/password ------------------------------------------

    async def socks5_auth(self, data: modes.Socks5AuthData) -> None:
        """A SOCKS5 client's username/password (RFC 1929, asked for when its
        greeting offers it: mitm_patches `socks5_login`), checked exactly like
        Proxy-Authorization. The profile it matches is the connection's
        identity (addons/identity.py keeps it by client connection id for
        `server_connect`). A refused login gets mitmproxy's RFC 1929 failure
        reply and the connection closes; its audit line is written here."""
        client = data.client_conn
        try:
            match = await self.identity.socks5_login(self.live().policy, client, data.username, data.password)
            refusal = match.refusal if match is not None else None
        except Exception:
            logging.getLogger("sluice").exception("sluice: EgressGate.socks5_auth failed; refusing")
            refusal = Refusal(Reason.INTERNAL_ERROR, "Sluice failed while checking this SOCKS5 login, so it refuses it")
        if refusal is None:
            data.valid = True
            return
        self.audit.write(event="connection", client=peer(client), user=quote_client(data.username, 64),
                         decision="refuse", reason=refusal.reason.value, detail=f"SOCKS5 login: {refusal.detail}")

    # ---- the last gate: every dial ---------------------------------------

    @fail_closed()
    async def server_connect(self, data: ServerConnectionHookData) -> None:
        server = data.server
        if server.address is None or server.error:
            return
        host, port = server.address
        if server.transport_protocol != "tcp":
            self._refuse_dial(data, host, port, Decision(False, None, Refusal(
                Reason.CLIENT_PROTOCOL_REFUSED, f"Sluice carries TCP only, not {server.transport_protocol}"), port=port), None)
            return
        approved_rules = self._approved_rules(data.client, host, port)
        if approved_rules is not None:
            # Decided with the host rules at request level; re-check the address.
            refusal = check_address(approved_rules, host, port)
            if refusal is None:
                return
            self._refuse_dial(data, host, port, Decision(False, None, refusal, port=port), None)
            return
        live = self.live()
        # A SOCKS5 client that logged in is matched to its login's profile
        # (identity keeps it by client connection id); else by its address.
        client = await self.identity.match(live.policy, data.client, None)
        if client.refusal is not None:
            self._refuse_dial(data, host, port, Decision(False, None, client.refusal, port=port), None)
            return
        # SOCKS5, transparent, or anything else that reached a dial.
        decision = _not_own_host(client.rules, live.policy, await decide(client.rules, Destination(host=host, port=port), live.resolver))
        if not decision.allowed:
            self._refuse_dial(data, host, port, decision, client.profile)
            return
        intercept = intercepts(client.rules, host)
        verdict = Verdict(host, port, decision, client.profile, client.rules, intercept=intercept)
        verdict.user = self.identity.socks5_user(data.client)
        verdict.identity = self.identity.identity(live.policy, data.client, None, client)
        self._remember_tunnel(data.client, server, verdict)
        self._approve(data.client, decision.address, port, client.rules)
        server.address = (decision.address, port)  # pin
        if intercept and isinstance(decision.host, NameHost):
            server.sni = decision.host.name
        self.caps.watch_client(data.client, client.rules)

    def _refuse_dial(self, data: ServerConnectionHookData, host: str, port: int, decision: Decision, profile: str | None) -> None:
        data.server.error = f"{decision.refusal.reason.value}: {decision.refusal.message}"
        self.audit.refused_connection(data.client, host, port, decision, profile)
        if isinstance(data.client.proxy_mode, mode_specs.Socks5Mode) and not _has_approvals(data.client):
            # mitmproxy would answer "host unreachable" (REP 4); a policy
            # refusal is "connection not allowed by ruleset" (REP 2), which
            # tells a SOCKS client not to retry. Nothing else reaches it after.
            connections.write_to_client(data.client, SOCKS5_NOT_ALLOWED)
            connections.shut_client_writer(data.client)

    def _approve(self, client: connection.Client, address: str, port: int, rules: Rules) -> None:
        """Record an address the gate validated and pinned for this client
        connection: the only kind of address its dials may reach.

        Bounded like the connection's upstreams (addons/upstreams.py): the
        most recent limits.max_upstreams_per_connection + 1 approvals (every
        request approves its address again right before it dials or reuses
        a connection), plus those of the connection's open tunnels, which
        mitmproxy may dial again for the requests inside."""
        approved = connstate.state_of(client).approved
        key = (pinned_ip(address) or address, port)
        approved.pop(key, None)
        approved[key] = rules  # most recent last
        keep = rules.limits.max_upstreams_per_connection + 1
        if len(approved) > keep:
            pinned = self._tunnel_addresses(client)
            droppable = [k for k in approved if k not in pinned]
            for old in droppable[: len(droppable) - keep]:
                del approved[old]

    def _tunnel_addresses(self, client: connection.Client) -> set[tuple[str, int]]:
        out = set()
        state = connstate.peek(client)
        for tunnel in state.tunnels.values() if state is not None else ():
            if tunnel.decision.address:
                out.add((pinned_ip(tunnel.decision.address) or tunnel.decision.address, tunnel.port))
        return out

    def rules_for_dial(self, client: connection.Client, server: connection.Server) -> Rules | None:
        """The rules that approved the address this server connection dials."""
        if server.address is None:
            return None
        return self._approved_rules(client, *server.address)

    def tunnel_server_ids(self, client: connection.Client) -> set[str]:
        state = connstate.peek(client)
        return set(state.tunnels) if state is not None else set()

    def _approved_rules(self, client: connection.Client, host: str, port: int) -> Rules | None:
        ip = pinned_ip(host)
        state = connstate.peek(client)
        return state.approved.get((ip, port)) if ip is not None and state is not None else None

    def _remember_tunnel(self, client: connection.Client, server: connection.Server, verdict: Verdict) -> None:
        verdict.client = client
        connstate.state_of(client).tunnels[server.id] = verdict
        self.caps.watch_tunnel(client, verdict)

    # client_disconnected: addons/conn_release.py releases the approvals and
    # the tunnels (writing each tunnel's line) with the rest of the ConnState.

    # ---- what runs inside a tunnel ---------------------------------------

    def next_layer(self, nextlayer: layer.NextLayer) -> None:
        """What runs on a client connection and inside each tunnel:
        - the front door (nothing below but the HTTP proxy mode) is plain
          HTTP/1; TLS to the proxy itself is refused;
        - a tunnel the policy does not intercept is raw TCP, never decrypted;
        - an intercepted tunnel is TLS (mitmproxy's choice) and then HTTP,
          never raw, whatever its first bytes look like."""
        context = nextlayer.context
        if context.client.transport_protocol != "tcp":
            return
        # An addon that decided before us (mitmproxy's own NextLayer) has
        # already pushed its layers onto the stack; look at the stack below them.
        stack = context.layers
        cut = stack.index(nextlayer.layer) if nextlayer.layer is not None and nextlayer.layer in stack else len(stack)
        below = stack[:cut]
        if not below:
            return
        if len(below) == 1 and isinstance(below[0], (modes.HttpProxy, modes.HttpUpstreamProxy, modes.ReverseProxy)):
            first = nextlayer.data_client()
            if first[:1] == b"\x16" or mitm_tls.starts_like_tls_record(first):
                del stack[cut:]
                nextlayer.layer = _RefuseClient(context)
                self.audit.write(
                    event="connection", client=peer(context.client), decision="refuse",
                    reason=Reason.CLIENT_PROTOCOL_REFUSED.value,
                    detail="the client spoke TLS to the proxy itself; Sluice's proxy port is plain HTTP "
                           "(set HTTP_PROXY/HTTPS_PROXY to http://host:port; HTTPS still goes through CONNECT)",
                )
            return  # the proxy's own HTTP front door: plain HTTP/1
        tunnel = tunnel_of(context.client, context.server)
        if tunnel is not None and tunnel.intercept:
            chosen = nextlayer.layer
            if chosen is None or isinstance(chosen, (layers.ServerTLSLayer, layers.ClientTLSLayer, layers.HttpLayer)):
                return  # TLS interception, then HTTP (or undecided yet)
            # mitmproxy would carry these bytes raw (rawtcp, tcp_hosts, a DNS
            # port, ...): inside an intercepted tunnel only HTTP may pass, so
            # the HTTP parser judges them and refuses what is not HTTP.
            del stack[cut:]
            nextlayer.layer = layers.HttpLayer(context, HTTPMode.transparent)
            return
        if isinstance(nextlayer.layer, layers.TCPLayer) and nextlayer.layer.flow is None:
            return  # already our raw, unhooked tunnel
        del stack[cut:]
        # ignore=True: no TCP flow and no per-chunk hooks (mitmproxy's tunnel
        # speed); Caps meters the bytes at the server socket instead.
        nextlayer.layer = layers.TCPLayer(context, ignore=True)

    def _tunnel_meter(self, client: connection.Client, server: connection.Server):
        """The dialer's meter for a passed-through tunnel's server socket: its caps."""
        tunnel = tunnel_of(client, server)
        return self.caps.tunnel_meter(client, tunnel) if tunnel is not None else None

    def _proxy_addresses(self) -> frozenset[str]:
        live = self.source.current if self.source is not None else None
        return live.policy.proxy_addresses if live is not None else frozenset()

    # ---- reloads reach open tunnels ------------------------------------

    def revoke_refused_tunnels(self, live: LivePolicy) -> None:
        """After a reload: match every open tunnel's client again (its user,
        its source) and re-decide the tunnel with the profile it matches now
        (pinned addresses kept); close those the policy now refuses, or whose
        client matches no profile any more. The requests inside an
        intercepted tunnel then follow that profile (credentials included)."""
        for _, state in connstate.states():
            for tunnel in list(state.tunnels.values()):
                if tunnel.logged or tunnel.cap is not None or tunnel.client is None:
                    continue
                refusal = redecide(live.policy, tunnel)
                if refusal is not None:
                    self.caps.cut_tunnel(tunnel.client, tunnel, Refusal(
                        Reason.TUNNEL_REVOKED, f"the reloaded policy refuses this tunnel ({refusal.reason.value}: {refusal.detail})"))


def tunnel_of(client: connection.Client, server: connection.Server | None) -> Verdict | None:
    """The verdict of the tunnel (CONNECT, SOCKS5, transparent) this server
    connection of this client connection carries, if any."""
    state = connstate.peek(client)
    return state.tunnels.get(server.id) if state is not None and server is not None else None



def _has_approvals(client: connection.Client) -> bool:
    state = connstate.peek(client)
    return bool(state is not None and state.approved)


def _user(policy: Policy, authorization: str | None) -> str | None:
    """The proxy username a request authenticated (or was refused) as, for
    the audit log: only when the policy checks credentials (it has users)."""
    if not authorization or not any(profile.credentials for profile in policy.clients):
        return None
    credentials = parse_basic(authorization)
    return quote_client(credentials[0], 64) if credentials else None


def _inside(flow: http.HTTPFlow, tunnel: Verdict) -> None:
    """A request inside a tunnel is its tunnel's client: same user, same CONNECT."""
    verdict = verdict_of(flow)
    verdict.user, verdict.connect_id, verdict.identity = tunnel.user, tunnel.connect_id, tunnel.identity


def _same_host(a: str, b: str) -> bool:
    try:
        return parse_host(a) == parse_host(b)
    except HostError:
        return False


def _fronting(tunnel: Verdict, host_header: str | None, sni: str | None, authority: str = "") -> Refusal | None:
    """Domain fronting inside an intercepted tunnel: an SNI, a Host header,
    or a request target authority (absolute-form, or HTTP/2 `:authority`)
    that names another host than the CONNECT target."""
    if sni and not _same_host(sni, tunnel.host):
        return Refusal(Reason.HOST_MISMATCH, f"the TLS server name {_short(sni)!r} is not the tunnel's host {tunnel.host}")
    for what, value in (("Host header", host_header), ("request target", authority)):
        if not value:
            continue
        try:
            named, _ = mitm_url.parse_authority(value, check=True)
        except ValueError:
            named = value
        if not _same_host(named, tunnel.host):
            return Refusal(Reason.HOST_MISMATCH, f"the {what} {_short(value)!r} is not the tunnel's host {tunnel.host}")
    return None


def _names_authority(host_header: str, host: str, port: int) -> bool:
    try:
        named, named_port = mitm_url.parse_authority(host_header, check=True)
    except ValueError:
        return False
    return _same_host(named, host) and (named_port is None or named_port == port)


def _authority(scheme: str, host: str, port: int) -> str:
    shown = f"[{host}]" if ":" in host else host
    return shown if port == {"http": 80, "https": 443}.get(scheme) else f"{shown}:{port}"


def _short(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[:limit] + "…"


def _live_rules(policy: Policy, profile: str | None) -> Rules | None:
    """The current rules for a client profile named when its tunnel opened
    (None if the profile is gone): identity is kept, rules are live."""
    if profile is None:
        return None if policy.require_client else policy.rules
    for candidate in policy.clients:
        if candidate.name == profile:
            return candidate.rules
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


def _not_own_host(rules: Rules, policy: Policy, decision: Decision) -> Decision:
    """An allowed destination at one of the proxy's own host's addresses
    (addons/own_host.py) is refused `proxy_loop` instead, before any dial."""
    if not decision.allowed or decision.address is None:
        return decision
    refusal = OWN_HOST.refusal(rules, policy.proxy_addresses, decision.addresses or (decision.address,), decision.port)
    if refusal is None:
        return decision
    return Decision(False, decision.host, refusal.with_note(rules.refusal_note), addresses=decision.addresses,
                    port=decision.port)


def redecide(policy: Policy, tunnel: Verdict) -> Refusal | None:
    """After a reload, for an open tunnel or pipe: its client matched again
    (`rematch`: the user it proved to be, or its source address) and the
    tunnel decided with that profile's rules. Allowed: the tunnel now belongs
    to that profile (its requests, credentials and limits follow it). Else
    the refusal (the caller closes it `tunnel_revoked`)."""
    if tunnel.identity is None:
        return still_allowed(policy, tunnel)
    match = rematch(policy, tunnel.identity)
    if match.refusal is not None:
        return dataclasses.replace(match.refusal, detail=f"its client matches no client profile now: {match.refusal.detail}")
    refusal = _allows(match.rules, tunnel)
    if refusal is None and tunnel.decision.address is not None:
        refusal = OWN_HOST.refusal(match.rules, policy.proxy_addresses, tunnel.decision.addresses or (tunnel.decision.address,),
                                   tunnel.port)
    if refusal is None:
        tunnel.profile, tunnel.rules = match.profile, match.rules
    return refusal


def still_allowed(policy: Policy, tunnel: Verdict) -> Refusal | None:
    """Would the policy now allow this open tunnel for the profile it belongs
    to? Pure: the addresses are the ones it was validated and pinned with, no
    new lookup."""
    rules = _live_rules(policy, tunnel.profile)
    if rules is None:
        return Refusal(Reason.CLIENT_UNKNOWN, f"the client profile {tunnel.profile!r} is no longer in the policy")
    return _allows(rules, tunnel)


def _allows(rules: Rules, tunnel: Verdict) -> Refusal | None:
    # The same question the tunnel was opened with (a CONNECT's method too).
    decision = check_request(rules, Destination(tunnel.host, tunnel.port, method=tunnel.method))
    if decision.needs_dns:
        decision = check_answers(rules, decision, tunnel.decision.addresses or (tunnel.decision.address,))
    if decision.allowed:
        return None
    return decision.refusal


class _RefuseClient(layer.Layer):
    """Closes the client connection at once: the front door refused what the
    client speaks (there is no HTTP to answer in)."""

    def _handle_event(self, event: events.Event) -> layer.CommandGenerator[None]:
        if isinstance(event, events.Start):
            yield commands.CloseConnection(self.context.client)


def _forward_path(request: http.Request, decision: Decision) -> None:
    """Forward exactly the normalised path the request rules matched (the
    query as sent), so the origin never sees a spelling no rule judged
    (HTTP/2's `:path` too: mitmproxy sends request.path as it)."""
    if decision.path is None:
        return
    _, query = split_target(request.path)
    target = decision.path if query is None else f"{decision.path}?{query}"
    if target != request.path:
        request.path = target
