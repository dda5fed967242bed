"""Decisions as pure functions over plain data: no sockets, no DNS, no files.

A request is decided in two steps because DNS sits between them:

    check_request(rules, Destination)  -> Decision (final, or needs_dns)
    check_answers(rules, pending, addresses) -> Decision (final)

The edges (the mitmproxy addon, `sluice policy explain`) do the lookup in
between with whatever resolver they have.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import netaddr

from sluice.policy.hosts import Host, HostError, IPHost, NameHost, canonical_ip, internal_name, parse_host
from sluice.policy.matchers import AddressEntry, Rule
from sluice.policy.model import Rules
from sluice.policy.ranges import classify
from sluice.policy.reasons import Reason, Refusal
from sluice.policy.request_rules import RequestRule, RuleMatch

ALLOWED_SCHEMES = frozenset({"http", "https"})
# rule_denied for a path's spelling: the agent can fix the request itself.
HOSTILE_PATH_ADVICE = ("Write each path segment plainly (a real '/' between segments, no encoded slash, backslash or "
                       "dot-dot, no ';' parameters) and send it again; sent unchanged, it gets the same answer.")


@dataclass(frozen=True, slots=True)
class Destination:
    """What the proxy knows of a request before any lookup."""

    host: str  # as the client wrote it: never trusted
    port: int
    scheme: str | None = None  # None where unknown (SOCKS5 or transparent TCP)
    method: str | None = None  # None for a raw tunnel
    has_credentials: bool = False  # user:pass@ in the URL
    # The request target as sent (origin-form path and query, e.g. HTTP/2's
    # `:path`); None for a CONNECT or a raw tunnel. Request rules match it.
    target: str | None = None


@dataclass(frozen=True, slots=True)
class Decision:
    allowed: bool
    host: Host | None = None
    refusal: Refusal | None = None  # set when refused
    would_refuse: Refusal | None = None  # report mode: what enforce would have refused
    address: str | None = None  # the one address to connect to
    addresses: tuple[str, ...] = ()  # every address the name resolved to
    rule: Rule | None = None  # the rule that let it through, if one did
    needs_dns: bool = False
    port: int = 0
    # Request rules (policy.request_rules): the rule that decided, and the
    # normalised path it matched, which is the path the proxy forwards.
    request_rule: RequestRule | None = None
    path: str | None = None

    @property
    def reason(self) -> Reason | None:
        r = self.refusal or self.would_refuse
        return r.reason if r else None


def _refuse(reason: Reason, detail: str, host: Host | None = None, rule: Rule | None = None,
            **kw: Any) -> Decision:
    return Decision(False, host, Refusal(reason, detail, rule.origin if rule else None), **kw)


def scheme_refusal(scheme: str) -> Refusal:
    """The refusal of a URL scheme Sluice does not carry (ftp:, gopher:, ...),
    whether the gate or the request-line parser met it first."""
    return Refusal(Reason.SCHEME_NOT_ALLOWED,
                   f"Sluice carries http and https (https through CONNECT); {scheme.lower()} is not proxied")


def check_request(rules: Rules, dest: Destination) -> Decision:
    """Everything decidable before DNS. Returns a final Decision, or one with
    needs_dns=True for a name that must be resolved and passed to check_answers."""
    if dest.scheme is not None and dest.scheme.lower() not in ALLOWED_SCHEMES:
        return Decision(False, None, scheme_refusal(dest.scheme))
    if dest.has_credentials:
        return _refuse(Reason.URL_CREDENTIALS,
                       "URLs with user:password@ credentials are not allowed; send credentials in headers instead")
    try:
        host = parse_host(dest.host)
    except HostError as e:
        return _refuse(Reason.MALFORMED_HOST, f"{e}")
    if not (0 < dest.port < 65536):
        return _refuse(Reason.PORT_NOT_ALLOWED, f"port {dest.port} is not a valid port", host)
    if dest.port not in rules.ports and not _private_port_exists(rules, dest.port):
        return _refuse(Reason.PORT_NOT_ALLOWED, f"port {dest.port} is not allowed (allowed ports: {_ports(rules)})",
                       host)

    soft: Refusal | None = None  # a host/method/rule refusal, which report mode lets through
    allow_rule: Rule | None = None
    if isinstance(host, NameHost):
        why = internal_name(host.name)
        explicitly_allowed = rules.allow is not None and rules.allow.exact.get(host.name)
        if why and not explicitly_allowed:
            return _refuse(Reason.INTERNAL_HOSTNAME, f"{host.name} is {why}", host)

    judged = _judge_rules(rules, host, dest)
    # The rule that decides: the first matching one, unless the path is refused first (`hostile`).
    request_rule = judged.rule if judged is not None and judged.hostile is None else None
    path = judged.path if judged is not None and judged.hostile is None else None
    if judged is not None and judged.hostile is not None:
        assert judged.rule is not None  # a hostile path is refused only where a rule names the host
        soft = Refusal(Reason.RULE_DENIED, _hostile_detail(host, judged.hostile, judged.rule), judged.rule.origin,
                       advice=HOSTILE_PATH_ADVICE)
    elif request_rule is not None and request_rule.action == "deny":
        soft = Refusal(Reason.RULE_DENIED, _denied_detail(host, dest, path, request_rule), request_rule.origin)
    elif request_rule is not None:
        # An allow rule replaces the host-level allow/deny/methods step only.
        allow_rule = Rule(request_rule.text, request_rule.origin)
    else:
        if dest.method is not None and dest.method.upper() not in rules.methods:
            soft = Refusal(Reason.METHOD_NOT_ALLOWED,
                           f"the method {dest.method} is not allowed (allowed: {', '.join(sorted(rules.methods))})")
        deny_rule = rules.deny.match_host(host)
        if deny_rule:
            soft = soft or Refusal(Reason.HOST_DENIED, f"{host} is denied by the rule {deny_rule.text!r}",
                                   deny_rule.origin)
        elif rules.allow is not None:
            allow_rule = rules.allow.match_host(host)
            if not allow_rule and not (isinstance(host, NameHost) and rules.allow.addresses):
                soft = soft or Refusal(Reason.HOST_NOT_ALLOWED, f"{host} is not on this policy's allow list")

    if isinstance(host, IPHost):
        return _check_addresses(rules, host, dest.port, (host.address,), soft, allow_rule, literal=True,
                                request_rule=request_rule, path=path)
    if soft is not None and rules.action != "report":
        return Decision(False, host, soft, port=dest.port, request_rule=request_rule)  # no lookup needed to refuse
    return Decision(True, host, None, soft, rule=allow_rule, needs_dns=True, port=dest.port,
                    request_rule=request_rule, path=path)


def _judge_rules(rules: Rules, host: Host, dest: Destination) -> RuleMatch | None:
    """The request rules' verdict, or None when they have none here. A
    tunnel that will be intercepted is not judged: each request inside is."""
    if not rules.request_rules:
        return None
    if dest.target is None:
        if dest.method not in (None, "CONNECT") or intercepts(rules, dest.host):
            return None
        return rules.request_rules.judge(host, None, None)
    return rules.request_rules.judge(host, dest.method, dest.target)


def _hostile_detail(host: Host, hostile: str, first: RequestRule) -> str:
    return (f"the path contains {hostile}, which origins decode in different ways, and request rules govern "
            f"{host} (the first naming it is at {first.origin}), so its paths may not contain %2F, %5C, %2E%2E, "
            "a backslash or ';'")


def _denied_detail(host: Host, dest: Destination, path: str | None, rule: RequestRule) -> str:
    what = f"{(dest.method or 'GET').upper()} {path}" if path is not None else "a tunnel"
    return f"{what} on {host} is denied by the rule at {rule.origin} ({rule.text})"


def check_answers(
    rules: Rules, pending: Decision, addresses: tuple[str, ...] | list[str], cnames: tuple[str, ...] | list[str] = ()
) -> Decision:
    """Finish a needs_dns decision with every address the name resolved to
    (all A and AAAA answers, after CNAMEs) and the names the CNAME chain passed
    through. One non-public answer, or one internal name in the chain, refuses."""
    assert pending.needs_dns and isinstance(pending.host, NameHost)
    for alias in cnames:
        why = internal_name(alias)
        if why:
            return _refuse(Reason.DNS_ANSWER_NOT_PUBLIC,
                           f"{pending.host} is an alias (CNAME) of {alias}, which is {why}",
                           pending.host, port=pending.port)
    if not addresses:
        return _refuse(Reason.DNS_FAILED, f"{pending.host} has no address records", pending.host, port=pending.port)
    soft = pending.would_refuse
    allow_rule = pending.rule
    if rules.allow is not None and allow_rule is None and soft is None and pending.request_rule is None:
        # A name not on the allow list by name may still be allowed by address
        # when the allow list holds CIDRs: every answer must be inside them.
        matched = [rules.allow.match_ip(a) for a in addresses]
        if all(matched):
            allow_rule = matched[0]
        else:
            soft = Refusal(Reason.HOST_NOT_ALLOWED, f"{pending.host} is not on this policy's allow list")
    return _check_addresses(rules, pending.host, pending.port, tuple(addresses), soft, allow_rule, literal=False,
                            request_rule=pending.request_rule, path=pending.path)


def _check_addresses(
    rules: Rules, host: Host, port: int, addresses: tuple[str, ...],
    soft: Refusal | None, allow_rule: Rule | None, *, literal: bool,
    request_rule: RequestRule | None = None, path: str | None = None,
) -> Decision:
    reason = Reason.ADDRESS_NOT_PUBLIC if literal else Reason.DNS_ANSWER_NOT_PUBLIC
    rule = allow_rule
    for address in addresses:
        opened = _opened(rules, address, port)
        non_public = classify(address)
        if non_public is not None and opened is None:
            what = address if literal else f"{host} resolves to {address}, which"
            return _refuse(reason, f"{what} is {non_public.name} ({non_public.cidr}); only public internet addresses "
                                   "are reachable",
                           host, addresses=addresses, port=port)
        if opened is not None and (opened.port is not None or port in rules.ports):
            rule = rule or opened.rule
        elif port not in rules.ports:
            return _refuse(Reason.PORT_NOT_ALLOWED, f"port {port} is not allowed (allowed ports: {_ports(rules)})",
                           host, addresses=addresses, port=port)
        # A request rule that decided replaces the host-level deny (by address too).
        deny_rule = rules.deny.match_ip(address) if not literal and request_rule is None else None
        if deny_rule and soft is None:
            soft = Refusal(Reason.HOST_DENIED, f"{host} resolves to {address}, which is denied by the rule "
                                               f"{deny_rule.text!r}", deny_rule.origin)
    if soft is not None and rules.action != "report":
        return Decision(False, host, soft, None, addresses=addresses, port=port, request_rule=request_rule)
    return Decision(True, host, None, soft, address=_pick(addresses), addresses=addresses, rule=rule, port=port,
                    request_rule=request_rule, path=path)


def _opened(rules: Rules, address: str, port: int) -> AddressEntry | None:
    """The private_networks entry that opens this address on this port, if any.
    An entry without a port opens the address on the policy's `ports` only;
    one with a port opens that port (checked by the caller)."""
    if not rules.private_networks:
        return None
    ip = netaddr.IPAddress(address)
    value, version = int(ip), ip.version
    entry = rules.private_networks.match_entry(value, version, port)
    if entry is None or entry.port is not None or port in rules.ports:
        return entry
    # The most specific entry has no port and this port is not in `ports`: a
    # less specific entry may still name this very port (rare; a short scan).
    bits = 32 if version == 4 else 128
    for e in rules.private_networks.entries:
        if e.version == version and e.port == port and value >> (bits - e.prefixlen) == e.network:
            return e
    return entry


def _pick(addresses: tuple[str, ...]) -> str:
    # Deterministic, so every request to a name maps to one upstream address
    # and mitmproxy can reuse the connection. IPv4 first, as most stacks do.
    for a in addresses:
        if ":" not in a:
            return a
    return addresses[0]


def _private_port_exists(rules: Rules, port: int) -> bool:
    return any(e.port == port for e in rules.private_networks.entries)


def _ports(rules: Rules) -> str:
    return ", ".join(str(p) for p in sorted(rules.ports))


def check_address(rules: Rules, address: str, port: int) -> Refusal | None:
    """The address-level rules alone (public-only, private_networks, ports) for
    an address about to be dialled whose host rules were already applied."""
    try:
        host = parse_host(address)
    except HostError as e:
        return Refusal(Reason.MALFORMED_HOST, str(e))
    if not isinstance(host, IPHost):
        return Refusal(Reason.MALFORMED_HOST, f"{address} is not an IP address")
    decision = _check_addresses(rules, host, port, (host.address,), None, None, literal=True)
    return decision.refusal


def check_own_address(rules: Rules, addresses: tuple[str, ...] | list[str], port: int,
                      own: frozenset[str] | set[str]) -> Refusal | None:
    """`proxy_loop` if any address a destination would be dialled at is one of
    this host's own (`own`: canonical IPs: the addresses the proxy can be
    reached at, and the policy's `proxy_addresses`), on any port: the proxy,
    its admin endpoint and every other service of the host are not
    destinations. Only a `private_networks` entry naming that address with
    this very port opens it."""
    if not own:
        return None
    for address in addresses:
        try:
            ip = canonical_ip(address)
        except ValueError:
            continue
        if ip not in own:
            continue
        opened = _opened(rules, ip, port)
        if opened is not None and opened.port == port:
            continue
        return Refusal(Reason.PROXY_LOOP, f"{ip}:{port} is an address of the proxy's own host, not a destination "
                                          "(the proxy, its admin endpoint and the host's other services are never "
                                          "reachable through it)")
    return None


def intercepts(rules: Rules, host_text: str) -> bool:
    """Whether a tunnel to `host_text` is intercepted (TLS terminated, every
    request inside decided on its own) under these rules: the gate's test and
    `sluice policy explain/test`'s."""
    if not rules.intercept:
        return False
    try:
        return rules.intercept.match_host(parse_host(host_text)) is not None
    except HostError:
        return False
