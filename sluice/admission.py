"""The admission engine: what Sluice decides about each arrival, mitmproxy-free.

    admit(policy, identity, arrival, resolver) -> Admission

`arrival` is plain data about what reached the proxy (an HTTP request on the
front door, a CONNECT, a request inside an intercepted tunnel, a dial from
SOCKS5 or transparent mode); `identity` is the client profile it was matched
to (policy.clients.ClientMatch; the identity addon matches it, since that
takes password checks and throttling). The Admission says everything the
proxy then does: allowed or the refusal, the address to pin, whether the
tunnel is intercepted, the credential to set, the headers to strip, the
Host/authority rewrite, the rules it was decided with.

The gate (addons/gate.py) builds the Arrival from the flow, awaits admit()
and applies the Admission to the flow; `sluice policy explain` and `sluice
policy test` (sluice/policy_cli.py) call the same admit(), so they cannot
drift from the proxy. Re-deciding open tunnels after a reload
(`readmit_tunnel`, `still_allowed`) is here too, over plain data.

Nothing here imports mitmproxy (tests/unit/test_admission.py checks).
"""

from __future__ import annotations

import enum
import functools
import ipaddress
import re
from dataclasses import dataclass, replace
from collections.abc import Callable
from typing import NamedTuple, Protocol

from sluice.policy.approvals import Grant, Judgement, Requester, Verdict, granted_rules, judge
from sluice.policy.clients import ClientIdentity, ClientMatch, rematch
from sluice.policy.credentials import Credential, apply_to
from sluice.policy.decide import (
    Decision, Destination, check_address, check_answers, check_own_address, check_request, intercepts,
)
from sluice.policy.hosts import HostError, NameHost, parse_host
from sluice.policy.model import Policy, Rules
from sluice.policy.reasons import Reason, Refusal
from sluice.resolver import NameResolver, resolve_and_decide

# Hop-by-hop request headers never forwarded (RFC 9110 7.6.1), besides those
# the Connection header names. Upgrade stays so WebSockets keep working.
HOP_BY_HOP = ("Proxy-Connection", "Keep-Alive", "TE")
_KEPT_CONNECTION_TOKENS = frozenset({"close", "keep-alive", "upgrade"})
_DEFAULT_PORTS = {"http": 80, "https": 443}


class Kind(enum.Enum):
    REQUEST = "request"  # an HTTP request on the front door (absolute-form, or origin-form with Host)
    CONNECT = "connect"  # a CONNECT on the front door: a tunnel to host:port
    INSIDE = "inside"  # a request (or a CONNECT) inside an intercepted tunnel
    DIAL = "dial"  # a connection with no HTTP request: SOCKS5, transparent


@dataclass(frozen=True, slots=True)
class TunnelFacts:
    """The intercepted tunnel a request arrived inside: what its CONNECT named
    and the address it was validated and pinned with."""

    host: str
    port: int
    address: str | None
    refusal_note: str | None = None  # the tunnel's rules' refusal_note, for a CONNECT inside it


class Arrival(NamedTuple):
    """What arrived, as plain data (the gate reads it off the flow; the CLI off a URL).
    Immutable records (NamedTuple, like Admission): built on every request,
    and a tuple is made several times faster than a frozen dataclass."""

    kind: Kind
    host: str  # the destination as the client named it: never trusted
    port: int
    scheme: str | None = None  # None for a CONNECT or a dial
    method: str | None = None
    host_header: str | None = None  # None: the request has no Host header
    sni: str | None = None  # the TLS server name the client sent (inside an intercepted tunnel)
    authority: str = ""  # the request target's authority (absolute-form, HTTP/2 :authority)
    multiplexed: bool = False  # HTTP/2 or HTTP/3: the authority is a pseudo-header, never rewritten
    connection: str = ""  # the Connection header (its tokens name more hop-by-hop headers)
    has_credentials: bool = False  # user:password@ in the URL
    transport: str = "tcp"  # a dial's transport protocol
    # The request target as sent (origin-form path and query); None for a
    # CONNECT or a dial. Request rules (policy.request_rules) match it.
    target: str | None = None
    tunnel: TunnelFacts | None = None  # set for Kind.INSIDE


class OwnHost(Protocol):
    """Which destinations are the proxy's own host (`proxy_loop`)."""

    def refusal(self, rules: Rules, proxy_addresses: frozenset[str], addresses: tuple[str, ...] | list[str],
                port: int) -> Refusal | None: ...


class PolicyAddresses:
    """The own-host check from the policy alone (`proxy_addresses`): what
    the CLI knows without listeners. The proxy passes sluice/own_host.OWN_HOST,
    which adds the addresses it listens at."""

    def refusal(self, rules: Rules, proxy_addresses: frozenset[str], addresses: tuple[str, ...] | list[str],
                port: int) -> Refusal | None:
        return check_own_address(rules, addresses, port, proxy_addresses)


POLICY_ADDRESSES = PolicyAddresses()


class ApprovalView(NamedTuple):
    """The approvals in force for one arrival (policy.approvals): the grants
    and denials (a snapshot; the proxy's comes from its store), the client's
    user and the time. None to admit(): approvals are not consulted."""

    grants: tuple[Grant, ...]
    user: str | None
    now: float


class Admission(NamedTuple):
    """What the proxy does with one arrival (immutable)."""

    decision: Decision  # allowed, or the refusal (reason code, detail, note)
    profile: str | None  # the client profile it was decided for
    rules: Rules | None  # that profile's rules (None when the client itself was refused)
    method: str | None = None  # the method it was decided with (None: a tunnel whose requests are decided inside)
    intercept: bool = False  # a tunnel whose TLS the proxy terminates
    pin: str | None = None  # the one address to dial (or stay on, inside a tunnel)
    sni: str | None = None  # the server name to verify upstream against (an intercepted tunnel to a name)
    credential: Credential | None = None  # the credentials entry whose headers the proxy sets
    credential_refusal: Refusal | None = None  # set when the request must not carry its credentials
    strip_headers: tuple[str, ...] = ()  # request headers removed before forwarding
    host_header: str | None = None  # the Host header to send instead of the client's (None: keep it)
    origin_form: bool = False  # send the request target without its authority
    # The approvals' say (policy.approvals): granted (the decision is the
    # re-decision), denied, or asked (the refusal is approval_pending); None
    # when the decision was not an askable refusal.
    approval: Judgement | None = None

    @property
    def allowed(self) -> bool:
        return self.decision.allowed

    @property
    def refusal(self) -> Refusal | None:
        return self.decision.refusal


async def admit(policy: Policy, identity: ClientMatch, arrival: Arrival, resolver: NameResolver,
                own_host: OwnHost = POLICY_ADDRESSES, approvals: ApprovalView | None = None) -> Admission:
    """The decision for one arrival and everything that follows from it."""
    if arrival.kind is Kind.INSIDE:
        return await _admit_inside(identity, arrival, resolver, approvals)
    if arrival.kind is Kind.DIAL and arrival.transport != "tcp":
        refusal = Refusal(Reason.CLIENT_PROTOCOL_REFUSED, f"Sluice carries TCP only, not {arrival.transport}")
        return Admission(Decision(False, None, refusal, port=arrival.port), None, None)
    connect = arrival.kind is not Kind.REQUEST  # a CONNECT or a dial opens a tunnel
    rules = identity.rules
    intercept = connect and identity.refusal is None and intercepts(rules, arrival.host)
    # An intercepted tunnel's requests are checked one by one, so the CONNECT
    # itself is not a method the policy must list.
    method = None if intercept else arrival.method
    if identity.refusal is not None:
        decision = Decision(False, None, identity.refusal, port=arrival.port)
        return Admission(decision, identity.profile, None, method=method)
    dest = Destination(host=arrival.host, port=arrival.port, scheme=arrival.scheme if not connect else None,
                       method=method, has_credentials=arrival.has_credentials,
                       target=None if connect else arrival.target)
    decision = _not_own_host(rules, policy, await resolve_and_decide(rules, dest, resolver), own_host)
    judged = None
    if not decision.allowed and approvals is not None:
        decision, judged = await _with_approvals(rules, identity, dest, decision, approvals, resolver,
                                                 lambda d: _not_own_host(rules, policy, d, own_host))
    if not decision.allowed:
        return Admission(decision, identity.profile, rules, method=method, intercept=intercept, approval=judged)
    if connect:
        sni = decision.host.name if intercept and isinstance(decision.host, NameHost) else None
        return Admission(decision, identity.profile, rules, method=method, intercept=intercept,
                         pin=decision.address, sni=sni, approval=judged)
    credential, credential_refusal = _credential(rules, decision, arrival.host, arrival.scheme)
    host_header = None
    if arrival.host_header is not None and not names_authority(arrival.host_header, arrival.host, arrival.port):
        # Absolute-form with a Host header naming something else: RFC 9112
        # 3.2.2 has the proxy replace it, so the origin sees the host the
        # gate decided on (no fronting another virtual host on that IP).
        host_header = authority_of(arrival.scheme or "http", arrival.host, arrival.port)
    return Admission(decision, identity.profile, rules, method=method, pin=decision.address, credential=credential,
                     credential_refusal=credential_refusal, strip_headers=strip_headers(arrival.connection, rules),
                     host_header=host_header, approval=judged)


async def _with_approvals(rules: Rules, identity: ClientMatch, dest: Destination, decision: Decision,
                          approvals: ApprovalView, resolver: NameResolver,
                          finish: Callable[[Decision], Decision]) -> tuple[Decision, Judgement | None]:
    """A refused decision under the approvals in force: granted, decided again
    with the askable steps open (every other check applies: a granted host
    that resolves to a private address is still refused, as that); denied or
    asked, refused with the judgement's refusal. Not askable: unchanged."""
    host = str(decision.host) if decision.host is not None else dest.host.lower()
    requester = Requester(identity.profile, approvals.user, host, dest.method, dest.target)
    judged = judge(rules.approvals, decision.refusal, requester, approvals.grants, approvals.now)
    if judged is None:
        return decision, None
    if judged.verdict is Verdict.GRANTED:
        return finish(await resolve_and_decide(granted_rules(rules, dest.method), dest, resolver)), judged
    assert decision.refusal is not None
    return replace(decision, refusal=judged.refusal(decision.refusal)), judged


async def _admit_inside(identity: ClientMatch, arrival: Arrival, resolver: NameResolver,
                        approvals: ApprovalView | None = None) -> Admission:
    """A request inside an intercepted tunnel: it may only name the tunnel's
    host (no domain fronting), and is checked like any request, with the
    live policy's rules for the tunnel's client profile (`tunnel_client`)."""
    tunnel = arrival.tunnel
    assert tunnel is not None, "an arrival inside a tunnel names its tunnel"
    rules = identity.rules if identity.refusal is None else None
    if arrival.method == "CONNECT":
        # mitmproxy would treat the tunnel's origin as an upstream proxy and
        # repoint the tunnel's server: a tunnel names one host only.
        nested = Refusal(Reason.HOST_MISMATCH, f"a CONNECT inside the tunnel to {tunnel.host} is not allowed; "
                                               "open a new tunnel from the proxy").with_note(tunnel.refusal_note)
        return Admission(Decision(False, None, nested, port=tunnel.port), identity.profile, None)
    # Fronting first: it is refused whatever became of the client's profile.
    refusal = fronting(tunnel.host, arrival.host_header, arrival.sni, arrival.authority) or identity.refusal
    if refusal is not None or rules is None:
        assert refusal is not None, "rules are None only for a refused client"
        return Admission(Decision(False, None, refusal, port=tunnel.port), identity.profile, rules,
                         method=arrival.method)
    dest = Destination(tunnel.host, tunnel.port, arrival.scheme, arrival.method, target=arrival.target)
    decision = await resolve_and_decide(rules, dest, resolver)
    judged = None
    if not decision.allowed and approvals is not None:
        decision, judged = await _with_approvals(rules, identity, dest, decision, approvals, resolver, lambda d: d)
    if not decision.allowed:
        return Admission(decision, identity.profile, rules, method=arrival.method, approval=judged)
    credential, credential_refusal = _credential(rules, decision, tunnel.host, arrival.scheme)
    # Absolute-form naming the tunnel's own host: send origin-form, so the
    # origin can only ever see the tunnel's host.
    origin_form = bool(arrival.authority) and not arrival.multiplexed
    # No Host (HTTP/1.0, an empty one, absolute-form without one): name the
    # tunnel's host, or a shared origin's default virtual host answers.
    host_header = None if arrival.host_header else authority_of(arrival.scheme or "https", tunnel.host, tunnel.port)
    # Stay on the tunnel's pinned address (it was validated at CONNECT).
    return Admission(decision, identity.profile, rules, method=arrival.method, pin=tunnel.address,
                     credential=credential, credential_refusal=credential_refusal,
                     strip_headers=strip_headers(arrival.connection, rules), host_header=host_header,
                     origin_form=origin_form, approval=judged)


def _credential(
    rules: Rules, decision: Decision, host: str, scheme: str | None,
) -> tuple[Credential | None, Refusal | None]:
    """The entry whose headers the proxy sets on an allowed request it sees
    whole (policy.credentials.apply_to, with the host the gate decided on),
    or the `credential_plain_http` refusal."""
    entry, refusal = apply_to(rules, decision.host if decision.host is not None else host, scheme)
    return entry, (refusal.with_note(rules.refusal_note) if refusal is not None else None)


def tunnel_client(policy: Policy, profile: str | None) -> ClientMatch:
    """The client of an intercepted tunnel, for the requests inside it: the
    profile named when the tunnel opened, with the live policy's rules
    (identity is kept, rules are live); refused if the profile is gone."""
    rules = live_rules(policy, profile)
    if rules is None:
        return ClientMatch(policy.rules, profile, Refusal(
            Reason.CLIENT_UNKNOWN, f"the tunnel's client profile {profile!r} is no longer in the policy"))
    return ClientMatch(rules, profile)


def live_rules(policy: Policy, profile: str | None) -> Rules | None:
    """The current rules for a client profile named when its tunnel opened
    (None if the profile is gone, or for an anonymous client once
    `require_client` is on)."""
    if profile is None:
        return None if policy.require_client else policy.rules
    found = policy.profile(profile)
    return found.rules if found is not None else None


def _not_own_host(rules: Rules, policy: Policy, decision: Decision, own_host: OwnHost) -> Decision:
    """An allowed destination at one of the proxy's own host's addresses is
    refused `proxy_loop` instead, before any dial."""
    if not decision.allowed or decision.address is None:
        return decision
    refusal = own_host.refusal(rules, policy.proxy_addresses, decision.addresses or (decision.address,), decision.port)
    if refusal is None:
        return decision
    return Decision(False, decision.host, refusal.with_note(rules.refusal_note), addresses=decision.addresses,
                    port=decision.port)


def readmit_dial(rules: Rules, host: str, port: int) -> Refusal | None:
    """A dial to an address the gate already approved for this client
    connection with `rules` (host rules applied at request level): the
    address-level rules again."""
    return check_address(rules, host, port)


# ---- headers and authorities ---------------------------------------------------


def strip_headers(connection: str, rules: Rules) -> tuple[str, ...]:
    """The request headers removed before forwarding: those the Connection
    header names (but close, keep-alive, upgrade), the hop-by-hop ones, and
    the rules' `strip_request_headers`."""
    if not connection and not rules.strip_request_headers:
        return HOP_BY_HOP  # the common case, on every request
    named = [t.strip() for t in connection.split(",") if t.strip()]
    return (*(t for t in named if t.lower() not in _KEPT_CONNECTION_TOKENS), *HOP_BY_HOP,
            *sorted(rules.strip_request_headers))


# host, or [IPv6], then an optional :port (the request target's authority form, RFC 9112 3.2.3)
_AUTHORITY = re.compile(r"^(?P<host>[^:]+|\[.+\])(?::(?P<port>\d+))?$")
_DNS_LABEL = re.compile(r"^[a-z\d_-]{1,63}$", re.IGNORECASE)


@functools.lru_cache(maxsize=4096)
def parse_authority(text: str) -> tuple[str, int | None]:
    """A Host header or request authority as (host, port or None); brackets
    are removed from an IPv6 host (cached: agents send the same few Host
    headers again and again). ValueError if it is not well-formed: a
    host that is neither a DNS name (IDNA-encodable, letters, digits, `-`
    and `_` per label) nor an IP address, or a port outside 0-65535."""
    m = _AUTHORITY.match(text)
    if m is None:
        raise ValueError(f"{text!r} is not host[:port]")
    host = m["host"]
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not _well_formed_host(host):
        raise ValueError(f"{host!r} is not a host name or IP address")
    if m["port"] is None:
        return host, None
    port = int(m["port"])
    if port > 65535:
        raise ValueError(f"port {port} is out of range")
    return host, port


def _well_formed_host(host: str) -> bool:
    try:
        encoded = host.encode("idna")
        encoded.decode("idna")
    except (UnicodeError, ValueError):
        return False
    if len(encoded) > 255:
        return False
    name = encoded[:-1] if encoded.endswith(b".") else encoded
    if all(_DNS_LABEL.match(label) for label in name.decode("ascii").split(".")):
        return True
    try:
        ipaddress.ip_address(encoded.decode("idna"))
    except ValueError:
        return False
    return True


def same_host(a: str, b: str) -> bool:
    try:
        return parse_host(a) == parse_host(b)
    except HostError:
        return False


def fronting(tunnel_host: str, host_header: str | None, sni: str | None, authority: str = "") -> Refusal | None:
    """Domain fronting inside an intercepted tunnel: an SNI, a Host header,
    or a request target authority (absolute-form, or HTTP/2 `:authority`)
    that names another host than the CONNECT target."""
    if sni and not same_host(sni, tunnel_host):
        return Refusal(Reason.HOST_MISMATCH,
                       f"the TLS server name {shorten(sni)!r} is not the tunnel's host {tunnel_host}")
    for what, value in (("Host header", host_header), ("request target", authority)):
        if not value:
            continue
        try:
            named, _ = parse_authority(value)
        except ValueError:
            named = value
        if not same_host(named, tunnel_host):
            return Refusal(Reason.HOST_MISMATCH,
                           f"the {what} {shorten(value)!r} is not the tunnel's host {tunnel_host}")
    return None


def names_authority(host_header: str, host: str, port: int) -> bool:
    """Whether a Host header names this host (and port, if it names one)."""
    try:
        named, named_port = parse_authority(host_header)
    except ValueError:
        return False
    return same_host(named, host) and (named_port is None or named_port == port)


def authority_of(scheme: str, host: str, port: int) -> str:
    """host[:port] for a Host header: the port only when not the scheme's default."""
    shown = f"[{host}]" if ":" in host else host
    return shown if port == _DEFAULT_PORTS.get(scheme) else f"{shown}:{port}"


def shorten(text: str, limit: int = 80) -> str:
    """Client-supplied text cut to `limit` characters for a message."""
    return text if len(text) <= limit else text[:limit] + "…"


# ---- open tunnels after a reload ----------------------------------------------------


@dataclass(frozen=True, slots=True)
class OpenTunnel:
    """An open tunnel or pipe, as a reload re-decides it."""

    host: str  # as its client named it
    port: int
    method: str | None  # the method it was decided with (CONNECT; None for SOCKS5, transparent, pipes)
    addresses: tuple[str, ...]  # the addresses it was validated and pinned with
    profile: str | None
    identity: ClientIdentity | None = None  # who its client proved to be (None: not known)


@dataclass(frozen=True, slots=True)
class Readmission:
    """A reload's outcome on an open tunnel: the profile it belongs to now
    (`match`, when its client was matched again), or the refusal."""

    refusal: Refusal | None
    match: ClientMatch | None = None


def readmit_tunnel(policy: Policy, tunnel: OpenTunnel, own_host: OwnHost = POLICY_ADDRESSES) -> Readmission:
    """After a reload, for an open tunnel or pipe: its client matched again
    (`rematch`: the user it proved to be, or its source address) and the
    tunnel decided with that profile's rules. Allowed: the tunnel now belongs
    to `match`'s profile (its requests, credentials and limits follow it).
    Else the refusal (the caller closes it `tunnel_revoked`)."""
    if tunnel.identity is None:
        return Readmission(still_allowed(policy, tunnel))
    match = rematch(policy, tunnel.identity)
    if match.refusal is not None:
        detail = f"its client matches no client profile now: {match.refusal.detail}"
        return Readmission(replace(match.refusal, detail=detail))
    refusal = _allows(match.rules, tunnel)
    if refusal is None and tunnel.addresses:
        refusal = own_host.refusal(match.rules, policy.proxy_addresses, tunnel.addresses, tunnel.port)
    return Readmission(refusal, match if refusal is None else None)


def still_allowed(policy: Policy, tunnel: OpenTunnel) -> Refusal | None:
    """Would the policy now allow this open tunnel for the profile it belongs
    to? Pure: the addresses are the ones it was validated and pinned with, no
    new lookup."""
    rules = live_rules(policy, tunnel.profile)
    if rules is None:
        return Refusal(Reason.CLIENT_UNKNOWN, f"the client profile {tunnel.profile!r} is no longer in the policy")
    return _allows(rules, tunnel)


def _allows(rules: Rules, tunnel: OpenTunnel) -> Refusal | None:
    # The same question the tunnel was opened with (a CONNECT's method too).
    decision = check_request(rules, Destination(tunnel.host, tunnel.port, method=tunnel.method))
    if decision.needs_dns:
        decision = check_answers(rules, decision, tunnel.addresses)
    return None if decision.allowed else decision.refusal


def addresses_of(decision: Decision) -> tuple[str, ...]:
    """Every address a decision pinned with (its answers, else its one address)."""
    if decision.addresses:
        return decision.addresses
    return (decision.address,) if decision.address is not None else ()

