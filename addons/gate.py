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
  never passed raw (which layers carry a tunnel: addons/layer_choice.py).
- The front door speaks plain HTTP/1 (and SOCKS5 on its own port): a client
  that talks TLS (and so HTTP/2) to the proxy itself is refused
  (`client_protocol_refused`), so one client connection never multiplexes
  streams onto one shared upstream object and TLS to the proxy never implies
  interception (refused by addons/layer_choice.py, before any TLS layer).
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
  `proxy_loop` (sluice/own_host.py says which addresses), decided with the
  rest so the client gets the 403 and the audit line says refuse; the dial
  check refuses it again if the address became the host's since.
"""

from __future__ import annotations

import logging

from mitmproxy import connection, http
from mitmproxy.proxy import mode_specs
from mitmproxy.proxy.layers import modes
from mitmproxy.proxy.server_hooks import ServerConnectionHookData

from sluice import connstate
from sluice.addons import connections, mitm_patches
from sluice.addons.approvals import WEBHOOK_HEADER, Approvals, is_webhook
from sluice.addons.audit import AuditLog, peer, quote_client
from sluice.failsafe import fail_closed
from sluice.addons.caps import Caps
from sluice.identity import PROXY_AUTHORIZATION, ClientIdentifier, parse_basic
from sluice.own_host import OWN_HOST
from sluice.addons.policy_source import LivePolicy, PolicySource
from sluice.refusals import refusal_response
from sluice.outcome import ADMISSION_META, META, Outcome, outcome_of
from sluice.admission import (
    POLICY_ADDRESSES, Admission, Arrival, Kind, OpenTunnel, OwnHost, TunnelFacts, addresses_of, admit, readmit_dial,
    readmit_tunnel, tunnel_client,
)
from sluice.dialer import Dialer, pinned_ip
from sluice.policy.approvals import Verdict
from sluice.policy.clients import ClientIdentity, ClientMatch
from sluice.resolver import NameResolver
from sluice.policy.decide import Decision
from sluice.policy.model import Policy, Rules
from sluice.policy.reasons import Reason, Refusal
from sluice.policy.request_rules import split_target

# SOCKS5 reply: version 5, REP 2 "connection not allowed by ruleset", IPv4 0.0.0.0:0.
SOCKS5_NOT_ALLOWED = b"\x05\x02\x00\x01\x00\x00\x00\x00\x00\x00"


class EgressGate:
    def __init__(self, source: PolicySource, audit: AuditLog, caps: Caps, approvals: Approvals | None = None) -> None:
        self.source = source
        self.audit = audit
        self.caps = caps
        # Grants in force, asks, waits (addons/approvals.py; make_addons shares one).
        self.approvals = approvals if approvals is not None else Approvals(audit, source)
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
        outcome = outcome_of(flow)
        if outcome is not None and flow.error is not None:
            # mitmproxy already found the request invalid (e.g. an ftp:// URL)
            # and answers 400 itself after this hook: record what was sent.
            flow.response = None
            outcome.sent(400)
        elif outcome is not None and outcome.decision.allowed:
            admission: Admission | None = flow.metadata.get(ADMISSION_META)
            if admission is not None:
                for name in admission.strip_headers:
                    flow.request.headers.pop(name, None)

    @fail_closed()
    async def http_connect(self, flow: http.HTTPFlow) -> None:
        if flow.response is not None:
            return
        tunnel = tunnel_of(flow.client_conn, flow.server_conn)
        if tunnel is not None:
            admission = await admit(self.live().policy, tunnel_client(self.live().policy, tunnel.profile),
                                    _inside_arrival(flow, tunnel), self.live().resolver)
            flow.metadata[META] = Outcome(tunnel.host, tunnel.port, admission.decision, tunnel.profile, None)
            _inside(flow, tunnel)
            flow.response = refusal_response(admission.decision.refusal)
            return
        await self._gate_http(flow, connect=True)

    async def _gate_http(self, flow: http.HTTPFlow, connect: bool = False) -> None:
        request = flow.request
        live = self.live()  # one policy snapshot for the whole decision
        authorization = request.headers.pop(PROXY_AUTHORIZATION, None)  # never forwarded
        marker = request.headers.pop(WEBHOOK_HEADER, None)  # a proxy header too
        asks = marker is None or not is_webhook(live.policy, marker)
        client = await self.identity.match(live.policy, flow.client_conn, authorization)
        arrival = Arrival(
            Kind.CONNECT if connect else Kind.REQUEST, request.host, request.port,
            scheme=request.scheme, method=request.method, host_header=request.host_header,
            connection=request.headers.get("Connection", ""), target=None if connect else request.path,
        )
        user = _user(live.policy, authorization)
        admission = await self._admit(live.policy, client, arrival, live.resolver, OWN_HOST, user,
                                      peer(flow.client_conn), asks=asks)
        decision = admission.decision
        outcome = Outcome(request.host, request.port, decision, client.profile, admission.rules,
                          intercept=admission.intercept, method=admission.method)
        flow.metadata[META] = outcome
        flow.metadata[ADMISSION_META] = admission
        outcome.user = user
        outcome.identity = self.identity.identity(live.policy, flow.client_conn, authorization, client)
        if connect:
            outcome.connect_id = flow.id  # its tunnel's line, and the requests inside, carry it
        if not decision.allowed:
            flow.response = refusal_response(decision.refusal)
            return
        self.caps.watch_client(flow.client_conn, client.rules)
        if admission.host_header is not None:
            request.host_header = admission.host_header
        _forward_path(request, decision)
        # Pin: mitmproxy dials (and keys connection reuse on) request.host.
        request.data.host = admission.pin
        self._approve(flow.client_conn, admission.pin, request.port, client.rules)
        if connect:
            if admission.sni is not None:
                flow.server_conn.sni = admission.sni  # verify upstream against the name
            self._remember_tunnel(flow.client_conn, flow.server_conn, outcome)

    async def _gate_inside_tunnel(self, flow: http.HTTPFlow, tunnel: Outcome) -> None:
        """A request inside an intercepted tunnel, decided by admit() with the
        live policy's rules for the tunnel's client profile."""
        request = flow.request
        tunnel.requests += 1
        live = self.live()
        admission = await self._admit(live.policy, tunnel_client(live.policy, tunnel.profile),
                                      _inside_arrival(flow, tunnel), live.resolver, None, tunnel.user,
                                      peer(flow.client_conn))
        flow.metadata[META] = Outcome(tunnel.host, tunnel.port, admission.decision, tunnel.profile, admission.rules,
                                      method=request.method)
        flow.metadata[ADMISSION_META] = admission
        _inside(flow, tunnel)
        if not admission.allowed:
            flow.response = refusal_response(admission.decision.refusal)
            return
        _forward_path(request, admission.decision)
        request.data.host = admission.pin
        if admission.origin_form:
            request.authority = ""
        if admission.host_header is not None:
            request.host_header = admission.host_header

    async def _admit(self, policy: Policy, client: ClientMatch, arrival: Arrival, resolver: NameResolver,
                     own_host: OwnHost | None, user: str | None, who: str | None, asks: bool = True) -> Admission:
        """admit() with the approvals in force; an ask is recorded, and with
        `wait` the request is held for the answer and decided again. Not
        `asks` (the approvals' own webhook): admit() alone."""
        own = own_host if own_host is not None else POLICY_ADDRESSES
        if not asks:
            return await admit(policy, client, arrival, resolver, own)
        admission = await admit(policy, client, arrival, resolver, own, self.approvals.view(user))
        judged = admission.approval
        if judged is None:
            return admission
        settings = admission.rules.approvals if admission.rules is not None else None
        await self.approvals.judged(admission, settings, who)
        if judged.verdict is Verdict.ASK and settings is not None and settings.wait > 0:
            if await self.approvals.wait_for_answer(judged, settings.wait):
                admission = await admit(policy, client, arrival, resolver, own, self.approvals.view(user))
                await self.approvals.judged(admission, settings, who)
        return admission

    # ---- SOCKS5 username/password ------------------------------------------

    async def socks5_auth(self, data: modes.Socks5AuthData) -> None:
        """A SOCKS5 client's username/password (RFC 1929, asked for when its
        greeting offers it: mitm_patches `socks5_login`), checked exactly like
        Proxy-Authorization. The profile it matches is the connection's
        identity (sluice/identity.py keeps it by client connection id for
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
        approved_rules = self._approved_rules(data.client, host, port) if server.transport_protocol == "tcp" else None
        if approved_rules is not None:
            # Decided with the host rules at request level; re-check the address.
            refusal = readmit_dial(approved_rules, host, port)
            if refusal is None:
                return
            self._refuse_dial(data, host, port, Decision(False, None, refusal, port=port), None)
            return
        live = self.live()
        # A SOCKS5 client that logged in is matched to its login's profile
        # (identity keeps it by client connection id); else by its address.
        client = await self.identity.match(live.policy, data.client, None)
        # SOCKS5, transparent, or anything else that reached a dial.
        admission = await self._admit(live.policy, client,
                                      Arrival(Kind.DIAL, host, port, transport=server.transport_protocol),
                                      live.resolver, OWN_HOST, self.identity.socks5_user(data.client),
                                      peer(data.client))
        decision = admission.decision
        if not decision.allowed:
            # A refused client (or transport) is audited without a profile.
            self._refuse_dial(data, host, port, decision, client.profile if admission.rules is not None else None)
            return
        outcome = Outcome(host, port, decision, client.profile, client.rules, intercept=admission.intercept)
        outcome.user = self.identity.socks5_user(data.client)
        outcome.identity = self.identity.identity(live.policy, data.client, None, client)
        self._remember_tunnel(data.client, server, outcome)
        self._approve(data.client, admission.pin, port, client.rules)
        server.address = (admission.pin, port)  # pin
        if admission.sni is not None:
            server.sni = admission.sni
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

    def _remember_tunnel(self, client: connection.Client, server: connection.Server, outcome: Outcome) -> None:
        outcome.client = client
        connstate.state_of(client).tunnels[server.id] = outcome
        self.caps.watch_tunnel(client, outcome)

    # client_disconnected: addons/conn_release.py releases the approvals and
    # the tunnels (writing each tunnel's line) with the rest of the ConnState.

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


def tunnel_of(client: connection.Client, server: connection.Server | None) -> Outcome | None:
    """The outcome of the tunnel (CONNECT, SOCKS5, transparent) this server
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


def _inside(flow: http.HTTPFlow, tunnel: Outcome) -> None:
    """A request inside a tunnel is its tunnel's client: same user, same CONNECT."""
    outcome = outcome_of(flow)
    outcome.user, outcome.connect_id, outcome.identity = tunnel.user, tunnel.connect_id, tunnel.identity


def _inside_arrival(flow: http.HTTPFlow, tunnel: Outcome) -> Arrival:
    """A request (or a CONNECT) inside an intercepted tunnel, as plain data."""
    request = flow.request
    return Arrival(
        Kind.INSIDE, tunnel.host, tunnel.port, scheme=request.scheme, method=request.method,
        host_header=request.host_header, sni=flow.client_conn.sni, authority=request.authority,
        multiplexed=request.is_http2 or request.is_http3, connection=request.headers.get("Connection", ""),
        target=request.path,
        tunnel=TunnelFacts(tunnel.host, tunnel.port, tunnel.decision.address,
                           tunnel.rules.refusal_note if tunnel.rules is not None else None),
    )


def redecide(policy: Policy, tunnel: Outcome) -> Refusal | None:
    """After a reload, for an open tunnel or pipe: admission.readmit_tunnel
    over its plain facts. Allowed: the tunnel now belongs to the profile its
    client matches now (its requests, credentials and limits follow it).
    Else the refusal (the caller closes it `tunnel_revoked`)."""
    outcome = readmit_tunnel(policy, open_tunnel(tunnel), OWN_HOST)
    if outcome.match is not None:
        tunnel.profile, tunnel.rules = outcome.match.profile, outcome.match.rules
    return outcome.refusal


def open_tunnel(tunnel: Outcome) -> OpenTunnel:
    """An open tunnel's facts, as a reload re-decides them."""
    identity = tunnel.identity if isinstance(tunnel.identity, ClientIdentity) else None
    return OpenTunnel(tunnel.host, tunnel.port, tunnel.method, addresses_of(tunnel.decision), tunnel.profile, identity)


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
