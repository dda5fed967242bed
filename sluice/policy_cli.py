"""`sluice policy check|explain|test|hash-password`.

Exit codes, for every subcommand:

    0  OK / allowed / every case passed
    1  the policy (or the cases file) is invalid, or a test case failed
    2  usage error: a bad URL, --resolve, --client or --method (one line, never a traceback)
    3  `explain` only: the request would be refused

`explain` and `test` decide through the same `sluice.admission.admit()` the
proxy's gate uses, so what they print is what the proxy would do. They judge
a URL as the proxy meets it: an `http://` URL is one request, decided with its
method; an `https://` URL is a CONNECT tunnel, decided by host, port and
address (the method inside is never seen), unless the client's `intercept`
names the host: then the CONNECT and the request inside are both decided.

`check --strict` fails (exit 1) on warnings: rules the proxy cannot enforce
as written, such as `methods` or `strip_request_headers` for HTTPS hosts that
are not intercepted.
"""

from __future__ import annotations

import asyncio
import difflib
import getpass
import json
import re
import sys
from dataclasses import dataclass, replace
from typing import Any

import yaml

from sluice.admission import Admission, Arrival, Kind, TunnelFacts, admit, tunnel_client
from sluice.policy.clients import ClientMatch, match_client
from sluice.policy.credentials import Credential
from sluice.policy.decide import Decision, Destination
from sluice.policy.hosts import HostError, IPHost, canonical_ip, internal_name, parse_host
from sluice.policy.loader import (
    PolicyInvalid,
    Problem,
    _scan,
    compose_checked,
    hash_password,
    read_policy_bytes,
    read_policy_file,
)
from sluice.policy.matchers import HostMatcher, PatternError, covers_pattern, parse_host_pattern
from sluice.policy.model import STANDARD_METHODS, DnsSettings, Policy, Rules
from sluice.policy.reasons import Reason
from sluice.policy.request_rules import rule_warnings
from sluice.policy.urls import split_url
from sluice.resolver import DnsFailure, NameResolver, PinnedResolver, Resolution, StaticResolver

EXIT_OK = 0
EXIT_INVALID = 1  # invalid policy or cases file; failed test cases
EXIT_USAGE = 2
EXIT_REFUSED = 3


class UsageError(ValueError):
    """A one-line message for the user; exit 2."""


def dispatch(args) -> int:
    command = args.policy_command
    if command == "check":
        return check(args.file, strict=getattr(args, "strict", False))
    if command == "explain":
        return explain(args.policy, args.url, client=args.client, method=args.method, resolve=args.resolve)
    if command == "test":
        return run_test(args.file, args.cases, verbose=args.verbose)
    if command == "hash-password":
        return hash_password_command()
    if command == "suggest":
        from sluice.policy_suggest import suggest

        return suggest(args.policy, args.audit, profile=args.profile, since=args.since, apply=args.apply)
    if command == "init":
        return init(args.file, force=args.force)
    return EXIT_USAGE


def init(target: str, *, force: bool = False) -> int:
    from sluice.policy_location import write_starter

    problem = write_starter(target, force=force)
    if problem is not None:
        return _usage("init", problem)
    if target != "-":
        print(f"{target}: wrote the starter policy; edit it, then: sluice policy check {target}", file=sys.stderr)
    return EXIT_OK


def _usage(command: str, message: str) -> int:
    print(f"sluice policy {command}: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def _load(path: str) -> Policy | None:
    """The policy, or None after printing every problem as FILE:LINE:COL: message."""
    loaded = _load_with_bytes(path)
    return loaded[0] if loaded is not None else None


def _load_with_bytes(path: str) -> tuple[Policy, bytes] | None:
    """The policy and the bytes it was read from (one read), or None after
    printing every problem as FILE:LINE:COL: message."""
    try:
        return read_policy_file(path)
    except PolicyInvalid as e:
        problems = e.problems
    except Exception as e:  # a loader bug must still not print a traceback at the user
        problems = [Problem(path, 1, 1, f"cannot load the policy ({type(e).__name__}: {e}); please report this")]
    for problem in problems:
        print(problem, file=sys.stderr)
    print(f"{path}: {len(problems)} problem(s)", file=sys.stderr)
    return None


# ---- check -----------------------------------------------------------------


def summarise(policy: Policy) -> list[str]:
    lines = [f"{policy.source}: OK ({'report' if policy.rules.action == 'report' else 'enforce'} mode)"]
    lines += _rules_lines(policy.rules, "  ")
    dns = ", ".join(f"{h}:{p}" for h, p in policy.dns.nameservers) or "the system resolver (resolv.conf)"
    lines.append(f"  DNS: {dns}, timeout {policy.dns.timeout:g}s")
    for profile in policy.clients:
        who = []
        if profile.usernames:
            who.append("users " + ", ".join(sorted(profile.usernames)))
        if profile.sources:
            who.append("sources " + ", ".join(e.rule.text for e in profile.sources.entries))
        lines.append(f"  client {profile.name!r} ({'; '.join(who)}):")
        lines += _rules_lines(profile.rules, "    ")
    if policy.require_client:
        lines.append("  clients matching no profile are refused (407)")
    limits = policy.rules.limits
    lines.append(f"  request heads (every client): at most {_size(limits.max_header_bytes)} and "
                 f"{limits.max_header_count} fields, whole within {_seconds(limits.header_timeout)}")
    total = "" if limits.max_total_connections is None else f"; at most {limits.max_total_connections} connections in all"
    lines.append(f"  every client: HTTP/2 at most {limits.h2_max_concurrent_streams} streams per connection, "
                 f"{_size(limits.h2_stream_buffer_bytes)} held per stream; IPv6 clients counted per "
                 f"/{limits.ipv6_client_prefix}{total}")
    return lines


def no_https(policy: Policy) -> list[str]:
    """`check --strict` fails on these: the top level or a profile that can
    reach no https:// at all (e.g. `methods: [GET, HEAD]` without
    interception refuses every CONNECT)."""
    scopes = [("the top level", policy.rules)] + [(f"client {p.name!r}", p.rules) for p in policy.clients]
    return [f"{policy.source}: {who} can reach no https:// host: {line.removeprefix('unreachable: ')}"
            for who, rules in scopes for line in _unreachable(rules)
            if line.startswith(("unreachable: https://", "unreachable: every host"))
            and "hosts not under intercept" not in line]


def _rules_lines(rules: Rules, indent: str) -> list[str]:
    if rules.allow is None or rules.allow.everything:
        hosts = "any public host"
        internal = sorted(name for name in (rules.allow.exact if rules.allow else ()) if internal_name(name))
        if internal:
            hosts += f" and the internal name(s) {', '.join(internal)}"
    else:
        hosts = f"{len(rules.allow)} allowed host pattern(s)"
    hosts += f" on ports {', '.join(map(str, sorted(rules.ports)))}"
    if rules.deny:
        hosts += f", except {len(rules.deny)} denied pattern(s)"
    out = [f"{indent}reaches {hosts}"]
    if rules.action == "report":
        out.append(f"{indent}report mode: host and method refusals are logged, not enforced")
    out.append(f"{indent}methods: {', '.join(sorted(rules.methods))}")
    if rules.intercept:
        what = "every host" if rules.intercept.everything else ", ".join(r.text for r in rules.intercept.rules)
        out.append(f"{indent}intercepts TLS (methods and headers checked inside HTTPS) for: {what}")
    if rules.request_rules:
        out.append(f"{indent}request rules: {len(rules.request_rules)}, first match wins "
                   f"({rules.request_rules.rules[0].origin} to {rules.request_rules.rules[-1].origin})")
    if rules.private_networks:
        out.append(f"{indent}private networks opened: {', '.join(e.rule.text for e in rules.private_networks.entries)}")
    else:
        out.append(f"{indent}no private networks opened (public internet only)")
    if rules.strip_request_headers:
        out.append(f"{indent}strips request headers: {', '.join(sorted(rules.strip_request_headers, key=str.lower))}")
    for entry in rules.credentials:
        if entry.headers:  # names and sources only: a value is never shown
            sources = ", ".join(f"{h.name} ({h.source})" for h in entry.headers)
            clear = "; also over plain http" if entry.allow_plain_http else ""
            out.append(f"{indent}sets credentials {sources} on {', '.join(entry.hosts_text)} ({entry.origin}{clear})")
    if rules.upstream_proxy is not None:
        parent = rules.upstream_proxy
        auth = f", credentials from {parent.credential_source}" if parent.credential_source else ", no credentials"
        out.append(f"{indent}through the parent proxy {parent.url} (CONNECT to each pinned IP, never a name{auth}; "
                   f"{parent.origin})")
    out.append(f"{indent}{_limits_line(rules.limits)}")
    out.append(f"{indent}{_quotas_line(rules.limits)}")
    if rules.refusal_note:
        out.append(f"{indent}refusals end with the note: {rules.refusal_note!r}")
    out += [f"{indent}{line}" for line in _approvals_lines(rules)]
    out += [f"{indent}{line}" for line in _unreachable(rules)]
    return out


def _approvals_lines(rules: Rules) -> list[str]:
    settings = rules.approvals
    if settings is None:
        return []
    wait = f"held up to {_seconds(settings.wait)} for an answer" if settings.wait else "answered at once"
    out = [f"approvals: asks an operator about {', '.join(sorted(settings.ask))} ({settings.origin}); grants last "
           f"{_seconds(settings.grant_for)} unless the operator says; {wait}"]
    if settings.notify is not None:  # the secret's source only, never its value
        out.append(f"approvals notify the webhook {settings.notify.webhook} (signed with the secret from "
                   f"{settings.notify.secret_source})")
    return out


def _quotas_line(limits) -> str:
    """Every quota that is set (policy/model.py Limits; None is no limit)."""
    parts = []
    if limits.max_connections is not None:
        parts.append(f"{limits.max_connections} connections per source address")
    if limits.max_tunnels is not None:
        parts.append(f"{limits.max_tunnels} tunnels per client")
    if limits.requests_per_second is not None:
        parts.append(f"{limits.requests_per_second:g} requests/s per client (burst {limits.rate_burst})")
    if limits.bytes_per_hour is not None:
        parts.append(f"{_size(limits.bytes_per_hour)} per hour per client")
    if limits.max_requests_per_host_per_minute is not None:
        parts.append(f"{limits.max_requests_per_host_per_minute} requests per host per minute per client")
    parts.append(f"{limits.max_upstreams_per_connection} upstream sockets per client connection")
    return "quotas: " + "; ".join(parts)


def _size(n: int) -> str:
    for unit, name in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if n >= unit and n % unit == 0:
            return f"{n // unit}{name}"
    return f"{n}B"


def _seconds(s: float) -> str:
    for unit, name in ((3600, "h"), (60, "m")):
        if s >= unit and s % unit == 0:
            return f"{s / unit:g}{name}"
    return f"{s:g}s"


def _limits_line(limits) -> str:
    tunnel_bytes = f"{_size(limits.tunnel_max_bytes)} each way" if limits.tunnel_max_bytes is not None else "no byte cap"
    tunnel_time = _seconds(limits.tunnel_max_seconds) if limits.tunnel_max_seconds is not None else "no time cap"
    return (f"limits: connect {_seconds(limits.connect_timeout)}, request {_seconds(limits.request_timeout)}, "
            f"idle {_seconds(limits.idle_timeout)}; bodies: request {_size(limits.max_request_bytes)}, "
            f"response {_size(limits.max_response_bytes)}; tunnels: {tunnel_bytes}, {tunnel_time}")


def _unreachable(rules: Rules) -> list[str]:
    """A whole scheme (or everything) these rules can never reach, as summary lines."""
    out = []
    if rules.allow is not None and not rules.allow.everything and len(rules.allow) == 0:
        out.append("unreachable: every host (allow is empty)")
    for scheme, port in (("http", 80), ("https", 443)):
        if port not in rules.ports:
            out.append(f"unreachable: {scheme}:// on its default port {port} (not in ports)")
    if rules.action == "report":
        return out  # methods are logged, not enforced
    if not rules.methods - {"CONNECT"}:
        out.append("unreachable: every http:// request, and every request inside an intercepted tunnel "
                   "(methods lists only CONNECT)")
    if "CONNECT" not in rules.methods:
        if not rules.intercept:
            out.append("unreachable: https:// (clients reach HTTPS through CONNECT tunnels; CONNECT is not in "
                       "methods and no host is intercepted)")
        elif not rules.intercept.everything:
            out.append("unreachable: https:// to hosts not under intercept (CONNECT is not in methods)")
    return out


def check(path: str, *, strict: bool = False) -> int:
    loaded = _load_with_bytes(path)
    if loaded is None:
        return EXIT_INVALID
    policy, raw = loaded
    warnings = policy_warnings(policy, compose_checked(raw.decode("utf-8"), path))
    for warning in warnings:
        print(warning, file=sys.stderr)
    if warnings and strict:
        print(f"{path}: {len(warnings)} warning(s); --strict makes them errors", file=sys.stderr)
        return EXIT_INVALID
    blind = no_https(policy) if strict else []
    if blind:
        for line in blind:
            print(line, file=sys.stderr)
        print(f"{path}: --strict fails a policy under which a client can reach no https:// at all", file=sys.stderr)
        return EXIT_INVALID
    print("\n".join(summarise(policy)))
    if warnings:
        print(f"{path}: {len(warnings)} warning(s)", file=sys.stderr)
    return EXIT_OK


# ---- warnings: what the policy says but the proxy cannot enforce -----------

_SHOWN = 4  # allow entries named in a warning before "and N more"


def policy_warnings(policy: Policy, root: yaml.Node) -> list[Problem]:
    """Rules the proxy cannot enforce as written, as `FILE:LINE:COL: warning: ...`.

    `methods` and `strip_request_headers` act only on requests the proxy
    sees: plain http:// requests, and requests inside intercepted tunnels. An
    https:// request to a host the client's `intercept` does not name is a
    CONNECT tunnel, carried raw: its method and headers are never seen. So a
    profile that restricts methods or strips headers, lets CONNECT through
    (CONNECT in `methods`) and can reach hosts it does not intercept claims
    more than the proxy enforces."""
    top = _keys(root)
    scopes: list[tuple[str | None, Rules, dict[str, tuple[yaml.Node, yaml.Node]]]] = [(None, policy.rules, top)]
    profile_nodes: dict[str, dict[str, tuple[yaml.Node, yaml.Node]]] = {}
    clients = top.get("clients", (None, None))[1]
    if isinstance(clients, yaml.SequenceNode):
        for item in clients.value:
            keys = _keys(item)
            name = keys.get("name", (None, None))[1]
            if isinstance(name, yaml.ScalarNode):
                profile_nodes.setdefault(name.value, keys)
    for profile in policy.clients:
        own = profile_nodes.get(profile.name, {})
        if not own.keys() & {"action", "allow", "methods", "intercept", "strip_request_headers"}:
            continue  # the top level's rules, warned about there
        scopes.append((profile.name, profile.rules, own))

    out: list[Problem] = []
    out += _rule_warnings(policy)
    for name, rules, own in scopes:
        if "CONNECT" not in rules.methods:
            continue  # tunnels to hosts not intercepted are refused (or, in report mode, logged as such)
        unseen = _not_intercepted(rules)
        if unseen is None:
            continue
        who = f"client profile {name!r}: " if name is not None else ""
        refused = sorted(STANDARD_METHODS - rules.methods - {"CONNECT"})
        if refused:
            node = (own.get("methods") or top.get("methods") or (root, None))[0]
            out.append(_warning(policy.source, node, (
                f"{who}methods [{', '.join(sorted(rules.methods))}] cannot be enforced on https:// URLs to {unseen}: "
                "such a request is a CONNECT tunnel whose method the proxy never sees (a "
                f"{refused[0]} passes inside it). Intercept those hosts (`intercept:`; the client must then trust "
                "`sluice ca`), or leave CONNECT out of `methods` to refuse those tunnels")))
        if rules.strip_request_headers:
            node = (own.get("strip_request_headers") or top.get("strip_request_headers") or (root, None))[0]
            out.append(_warning(policy.source, node, (
                f"{who}strip_request_headers [{', '.join(sorted(rules.strip_request_headers))}] cannot be applied on "
                f"https:// URLs to {unseen}: such a request is a CONNECT tunnel whose headers the proxy never sees. "
                "Intercept those hosts (`intercept:`; the client must then trust `sluice ca`), or leave CONNECT out of "
                "`methods` to refuse those tunnels")))
    return out


def _rule_warnings(policy: Policy) -> list[Problem]:
    """Request rules that never decide (shadowed by an earlier one) and
    path patterns differing only by case, once per rule list (a profile
    that inherits the top level's list shares its warnings)."""
    out: list[Problem] = []
    seen: set[int] = set()
    for rules in [policy.rules] + [p.rules for p in policy.clients]:
        if id(rules.request_rules) in seen:
            continue
        seen.add(id(rules.request_rules))
        for rule, message in rule_warnings(rules.request_rules):
            out.append(Problem(policy.source, rule.line, rule.column, f"warning: {message}"))
    return out


def _keys(node: yaml.Node | None) -> dict[str, tuple[yaml.Node, yaml.Node]]:
    if not isinstance(node, yaml.MappingNode):
        return {}
    return {k.value: (k, v) for k, v in node.value if isinstance(k, yaml.ScalarNode)}


def _warning(file: str, node: yaml.Node, message: str) -> Problem:
    return Problem(file, node.start_mark.line + 1, node.start_mark.column + 1, f"warning: {message}")


def _not_intercepted(rules: Rules) -> str | None:
    """The hosts this rule set reaches over HTTPS without intercepting them
    (a phrase), or None when every one of them is intercepted."""
    intercept = rules.intercept
    if intercept.everything:
        return None
    if rules.allow is None or rules.allow.everything:
        return "any public host not under `intercept`" if intercept else "any public host (nothing is under `intercept`)"
    missing = [rule.text for rule in rules.allow.rules if not _intercepted_pattern(intercept, rule.text)]
    if not missing:
        return None
    shown = ", ".join(missing[:_SHOWN])
    more = f" and {len(missing) - _SHOWN} more allow entries" if len(missing) > _SHOWN else ""
    return f"{shown}{more} (not under `intercept`)"


def _intercepted_pattern(intercept: HostMatcher, text: str) -> bool:
    """Whether `intercept` covers every host the allow pattern can name. An
    address entry is reached by names that resolve into it, which only `*`
    intercepts (and `_not_intercepted` has answered for `*` already)."""
    try:
        kind, _ = parse_host_pattern(text)
    except PatternError:
        return False
    return kind != "cidr" and covers_pattern(intercept, text)


# ---- URLs, --resolve, --method ---------------------------------------------

_METHOD = re.compile(r"^[A-Za-z][A-Za-z-]{0,31}$")


def parse_method(method: str | None) -> str:
    if method is None:
        return "GET"
    if not _METHOD.match(method):
        raise UsageError(f"{method!r} is not an HTTP method")
    return method.upper()


def parse_url(url: str, method: str = "GET") -> Destination:
    """A URL as the proxy would see it, as a Destination for decide()
    (policy.urls.split_url: the host text reaches policy.hosts untouched).
    Raises UsageError for text that is not a URL at all."""
    try:
        target = split_url(url)
    except ValueError as e:
        raise UsageError(str(e)) from None
    return Destination(host=target.host, port=target.port, scheme=target.scheme, method=method,
                       has_credentials=target.has_credentials, target=_request_target(url))


def _request_target(url: str) -> str:
    """The origin-form target (path and query, no fragment) a client sends for this URL."""
    after = url.split("//", 1)[1] if "//" in url else ""
    end = next((i for i, c in enumerate(after) if c in "/?#\\"), len(after))
    rest = after[end:].split("#", 1)[0]
    if not rest or rest.startswith("?"):
        rest = "/" + rest
    return rest


def resolve_name(text: str) -> str:
    """A --resolve / `resolve:` host, normalised as the policy normalises hosts."""
    try:
        host = parse_host(text)
    except HostError as e:
        raise UsageError(str(e)) from None
    if isinstance(host, IPHost):
        raise UsageError(f"{text!r} is an IP address; only names are resolved")
    return host.name


def answer_ip(text: str) -> str:
    """One DNS answer: a plain IPv4 or IPv6 address, in canonical text (an
    IPv4-mapped answer stays as written, as a resolver returns it; a DNS
    answer has no zone id)."""
    raw = text.strip()
    if raw.startswith("[") and raw.endswith("]"):
        raw = raw[1:-1]
    if "%" not in raw:
        try:
            return canonical_ip(raw, ipv4_mapped_as_ipv4=False)
        except ValueError:
            pass
    raise UsageError(f"{text!r} is not an IP address (a DNS answer is a plain IPv4 or IPv6 address)")


def parse_resolve(items: list[str]) -> dict[str, list[str]]:
    """--resolve HOST=IP[,IP...], repeatable; several answers per name add up."""
    table: dict[str, list[str]] = {}
    for item in items:
        name, sep, ips = item.partition("=")
        if not sep or not name or not ips:
            raise UsageError(f"--resolve {item!r}: expected HOST=IP (repeat it, or HOST=IP1,IP2, for several answers)")
        try:
            key = resolve_name(name)
            answers = table.setdefault(key, [])
            for ip in ips.split(","):
                address = answer_ip(ip)
                if address not in answers:
                    answers.append(address)
        except UsageError as e:
            raise UsageError(f"--resolve {item!r}: {e}") from None
    return table


# ---- deciding --------------------------------------------------------------


class LiveResolver:
    """The policy's own DNS settings (PinnedResolver), failing closed on
    anything unexpected (no resolv.conf, a resolver error) as dns_failed."""

    def __init__(self, settings: DnsSettings) -> None:
        self.settings = settings
        self._resolver: PinnedResolver | None = None

    async def resolve(self, name: str) -> Resolution:
        try:
            if self._resolver is None:
                self._resolver = PinnedResolver(self.settings)
            return await self._resolver.resolve(name)
        except DnsFailure:
            raise
        except Exception as e:
            raise DnsFailure(f"the DNS lookup of {name} failed ({type(e).__name__}: {e})") from None


def find_profile(policy: Policy, name: str) -> Rules:
    """The rules of the client profile `name`, or a UsageError that names the
    profiles there are."""
    profile = policy.profile(name)
    if profile is not None:
        return profile.rules
    known = [p.name for p in policy.clients]
    if not known:
        raise UsageError(f"the policy has no client profiles, so there is no {name!r}")
    hint = difflib.get_close_matches(name, known, n=1)
    more = f"did you mean {hint[0]!r}? " if hint else ""
    raise UsageError(f"no client profile named {name!r}; {more}profiles: {', '.join(known)}")


TUNNEL = "tunnel: the method is not visible"
INTERCEPTED = "intercepted"


@dataclass(frozen=True, slots=True)
class Judgement:
    """What the proxy would decide for a URL, and how it meets it."""

    decision: Decision
    profile: str | None
    via: str  # "request" (plain HTTP), "tunnel" (a CONNECT carried raw) or "intercepted"
    note: str  # one or two sentences saying what the proxy sees and decides
    authority: str  # host:port as the proxy sees it
    method: str  # the method the URL was asked with
    credential: Credential | None = None  # the credentials entry whose headers the proxy would set


async def judge(policy: Policy, client: str | None, dest: Destination, resolver: NameResolver) -> Judgement:
    """The decision the gate would make for this client (a profile by name,
    or an unmatched client when None) and URL, made as the gate meets it,
    by the gate's own sluice.admission.admit():

    - an http:// URL is one request, decided with its method (an arrival of
      kind REQUEST);
    - an https:// URL (or `--method CONNECT`) is first a CONNECT, decided
      without a scheme. A host the client does not intercept: the CONNECT is
      the whole decision (method "CONNECT", which `methods` must list), and
      the tunnel is carried raw, its method and headers never seen. An
      intercepted host: the CONNECT is decided without a method, then the
      request inside with its method and scheme https (kind INSIDE).
    The proxy's own host is known here by the policy's `proxy_addresses`
    only (the proxy adds the addresses it listens at)."""
    if client is None:
        identity = match_client(policy, None)  # matched no profile: top level, or 407 under require_client
    else:
        identity = ClientMatch(find_profile(policy, client), client)
    profile = identity.profile
    method = dest.method or "GET"
    scheme = (dest.scheme or "").lower()
    shown_host = f"[{dest.host}]" if ":" in dest.host and not dest.host.startswith("[") else dest.host
    authority = f"{shown_host}:{dest.port}"

    if scheme != "https" and method != "CONNECT":
        request = Arrival(Kind.REQUEST, dest.host, dest.port, scheme=dest.scheme, method=method,
                          has_credentials=dest.has_credentials, target=dest.target)
        admission = await admit(policy, identity, request, resolver)
        decision = _with_credential_refusal(admission)
        note = f"request: the proxy sees this {method} request whole and decides it with its method"
        return Judgement(decision, profile, "request", note, authority, method, admission.credential)

    # A CONNECT names host:port only: no scheme, no path, no user:password@.
    tunnel = await admit(policy, identity, Arrival(Kind.CONNECT, dest.host, dest.port, method="CONNECT"), resolver)
    decision = tunnel.decision
    unseen = (" The URL's user:password@ is not seen either: a client sends it inside the tunnel."
              if dest.has_credentials else "")
    if not tunnel.intercept:
        inside = "the requests inside" if method == "CONNECT" else f"the {method} inside"
        note = (f"{TUNNEL}: the proxy sees only CONNECT {authority} (the host is not under `intercept`) and decides it "
                f"by host, port and address; {inside}, its path and headers are never seen. Add the host to "
                f"`intercept` to have them checked.{unseen}")
        return Judgement(decision, profile, "tunnel", note, authority, method)
    if not decision.allowed:
        note = f"{INTERCEPTED}: CONNECT {authority} is refused, so no request reaches the tunnel."
        return Judgement(decision, profile, "intercepted", note, authority, method)
    if method == "CONNECT":
        note = (f"{INTERCEPTED}: CONNECT {authority} is allowed without a method check; every request inside the "
                "tunnel is then decided on its own, with its method.")
        return Judgement(decision, profile, "intercepted", note, authority, method)
    inside_arrival = Arrival(Kind.INSIDE, dest.host, dest.port, scheme="https", method=method, target=dest.target,
                             tunnel=TunnelFacts(dest.host, dest.port, tunnel.pin, tunnel.rules.refusal_note
                                                if tunnel.rules is not None else None))
    inner = await admit(policy, tunnel_client(policy, profile), inside_arrival, resolver)
    inner_decision = inner.decision
    if inner_decision.allowed:
        # Requests inside stay on the address the tunnel was validated and pinned with.
        inner_decision = replace(inner_decision, address=decision.address, addresses=decision.addresses)
    note = (f"{INTERCEPTED}: CONNECT {authority} is allowed without a method check; Sluice terminates TLS (the client "
            f"must trust its CA, `sluice ca`) and decides the {method} request inside on its own.{unseen}")
    return Judgement(_with_credential_refusal(inner._replace(decision=inner_decision)), profile, "intercepted", note,
                     authority, method, inner.credential)


def _with_credential_refusal(admission: Admission) -> Decision:
    """The decision as the client meets it: a request refused
    `credential_plain_http` by the credential injector is refused."""
    refusal = admission.credential_refusal
    if refusal is None:
        return admission.decision
    return replace(admission.decision, allowed=False, refusal=refusal, would_refuse=None)


def decision_json(judgement: Judgement, dest: Destination) -> dict[str, Any]:
    decision, profile = judgement.decision, judgement.profile
    refusal = decision.refusal or decision.would_refuse
    if refusal is not None:
        rule = refusal.rule
    else:
        rule = decision.rule.origin if decision.rule else None
    host = decision.host
    if host is None:
        try:
            host = parse_host(dest.host)
        except HostError:
            host = None
    return {
        "decision": "allow" if decision.allowed else "refuse",
        "reason": refusal.reason.value if refusal else None,
        "would_refuse": bool(decision.allowed and decision.would_refuse is not None),
        "rule": rule,
        "profile": profile,
        "host": str(host) if host is not None else None,
        "port": dest.port,
        # The path the proxy forwards (normalised) when request rules judged it.
        "path": decision.path,
        "addresses": list(decision.addresses),
        "address": decision.address,
        "status": decision.refusal.status if decision.refusal else None,
        "detail": refusal.detail if refusal else None,
        "message": decision.refusal.message if decision.refusal else None,
        "via": judgement.via,
        "note": judgement.note,
        # Which entry's headers the proxy would set: names, never values.
        "credential": None if judgement.credential is None else {
            "entry": judgement.credential.origin, "headers": list(judgement.credential.header_names),
            "allow_plain_http": judgement.credential.allow_plain_http},
    }


# ---- explain ---------------------------------------------------------------


def explain(policy_path: str, url: str, *, client: str | None = None, method: str | None = None,
            resolve: list[str] | None = None) -> int:
    try:
        dest = parse_url(url, parse_method(method))
        table = parse_resolve(resolve or [])
    except UsageError as e:
        return _usage("explain", str(e))
    policy = _load(policy_path)
    if policy is None:
        return EXIT_INVALID
    if client is not None:
        try:
            find_profile(policy, client)
        except UsageError as e:
            return _usage("explain", str(e))
    resolver = StaticResolver(table) if resolve else LiveResolver(policy.dns)
    judgement = asyncio.run(judge(policy, client, dest, resolver))
    print(json.dumps(decision_json(judgement, dest), indent=2))
    return EXIT_OK if judgement.decision.allowed else EXIT_REFUSED


# ---- test ------------------------------------------------------------------

CASE_KEYS = ("name", "url", "client", "method", "resolve", "expect", "reason")
REASON_CODES = tuple(r.value for r in Reason)


@dataclass(frozen=True, slots=True)
class Case:
    line: int
    label: str
    dest: Destination
    client: str | None
    resolve: dict[str, list[str]]
    expect: str  # "allow" | "refuse"
    reason: str | None


class _CaseReader:
    def __init__(self, file: str, policy: Policy) -> None:
        self.file = file
        self.policy = policy
        self.problems: list[Problem] = []
        self._constructor = yaml.SafeLoader("")

    def problem(self, node: yaml.Node, message: str) -> None:
        self.problems.append(Problem(self.file, node.start_mark.line + 1, node.start_mark.column + 1, message))

    def scalar(self, node: yaml.Node) -> Any:
        if not isinstance(node, yaml.ScalarNode):
            return None
        try:
            return self._constructor.construct_object(node, deep=True)
        except (yaml.YAMLError, ValueError, TypeError, OverflowError):
            return None

    def string(self, node: yaml.Node, key: str) -> str | None:
        value = self.scalar(node)
        if not isinstance(value, str) or not value:
            self.problem(node, f"{key} must be a non-empty string")
            return None
        return value

    def cases(self, root: yaml.Node) -> list[Case]:
        if isinstance(root, yaml.ScalarNode) and root.tag == "tag:yaml.org,2002:null":
            self.problem(root, "the cases file has no cases")
            return []
        if not isinstance(root, yaml.SequenceNode):
            self.problem(root, "the cases file must be a list of cases (- url: ... expect: allow|refuse)")
            return []
        if not root.value:
            self.problem(root, "the cases file has no cases")
        out = []
        for item in root.value:
            case = self.case(item)
            if case is not None:
                out.append(case)
        return out

    def case(self, node: yaml.Node) -> Case | None:
        if not isinstance(node, yaml.MappingNode):
            self.problem(node, "each case must be a mapping: {url: ..., expect: allow|refuse}")
            return None
        before = len(self.problems)
        keys: dict[str, tuple[yaml.Node, yaml.Node]] = {}
        for key_node, value_node in node.value:
            key = self.scalar(key_node)
            if not isinstance(key, str):
                self.problem(key_node, "keys in a case must be strings")
            elif key in keys:
                self.problem(key_node, f"{key!r} appears twice in this case")
            elif key not in CASE_KEYS:
                hint = difflib.get_close_matches(key, CASE_KEYS, n=1)
                more = f"did you mean {hint[0]!r}?" if hint else f"known keys: {', '.join(CASE_KEYS)}"
                self.problem(key_node, f"unknown key {key!r} in a case; {more}")
            else:
                keys[key] = (key_node, value_node)
        for required in ("url", "expect"):
            if required not in keys:
                self.problem(node, f"this case has no `{required}`")

        method = "GET"
        if "method" in keys:
            text = self.string(keys["method"][1], "method")
            if text is not None:
                try:
                    method = parse_method(text)
                except UsageError as e:
                    self.problem(keys["method"][1], f"method: {e}")
        dest = None
        url = None
        if "url" in keys:
            url = self.string(keys["url"][1], "url")
            if url is not None:
                try:
                    dest = parse_url(url, method)
                except UsageError as e:
                    self.problem(keys["url"][1], f"url: {e}")
        client = None
        if "client" in keys:
            client = self.string(keys["client"][1], "client")
            if client is not None:
                try:
                    find_profile(self.policy, client)
                except UsageError as e:
                    self.problem(keys["client"][1], f"client: {e}")
        expect = None
        if "expect" in keys:
            expect = self.scalar(keys["expect"][1])
            if expect not in ("allow", "refuse"):
                self.problem(keys["expect"][1], f"expect must be 'allow' or 'refuse', not {expect!r}")
        reason = None
        if "reason" in keys:
            reason = self.scalar(keys["reason"][1])
            if reason not in REASON_CODES:
                hint = difflib.get_close_matches(str(reason), REASON_CODES, n=1)
                more = f"; did you mean {hint[0]!r}?" if hint else " (see policy/reasons.py for the codes)"
                self.problem(keys["reason"][1], f"{reason!r} is not a reason code{more}")
        table = self.resolve(keys["resolve"][1]) if "resolve" in keys else {}
        label = None
        if "name" in keys:
            label = self.string(keys["name"][1], "name")
        if len(self.problems) > before or dest is None:
            return None
        return Case(node.start_mark.line + 1, label or f"{method} {url}", dest, client, table, expect, reason)

    def resolve(self, node: yaml.Node) -> dict[str, list[str]]:
        if not isinstance(node, yaml.MappingNode):
            self.problem(node, "resolve must map each host name to an IP address or a list of them")
            return {}
        table: dict[str, list[str]] = {}
        for key_node, value_node in node.value:
            host = self.scalar(key_node)
            if not isinstance(host, str):
                self.problem(key_node, "resolve: each key must be a host name")
                continue
            try:
                name = resolve_name(host)
            except UsageError as e:
                self.problem(key_node, f"resolve: {e}")
                continue
            if name in table:
                self.problem(key_node, f"resolve: {name!r} appears twice (list several answers under one key)")
                continue
            items = value_node.value if isinstance(value_node, yaml.SequenceNode) else [value_node]
            if not items:
                self.problem(value_node, f"resolve: {host!r} has no addresses (leave it out to make the name unresolvable)")
            answers: list[str] = []
            for item in items:
                value = self.scalar(item)
                if not isinstance(value, str):
                    self.problem(item, f"resolve: {host!r} must map to an IP address string or a list of them")
                    continue
                try:
                    address = answer_ip(value)
                except UsageError as e:
                    self.problem(item, f"resolve: {e}")
                    continue
                if address not in answers:
                    answers.append(address)
            table[name] = answers
        return table


def load_cases(path: str, policy: Policy) -> list[Case]:
    """Parse and validate a cases file; raise PolicyInvalid with every problem."""
    raw = read_policy_bytes(path, "cases file")  # the policy's safe reader: regular files only, size-capped
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PolicyInvalid([Problem(path, 1, 1, f"the cases file is not UTF-8 text ({e.reason} at byte {e.start})")]) from None
    root = compose_checked(text, path, "cases file", null_is_empty=False)  # `~` is "no cases"
    problems = _scan(root, path, "cases file")
    if problems:
        raise PolicyInvalid(problems)
    reader = _CaseReader(path, policy)
    cases = reader.cases(root)
    if reader.problems:
        raise PolicyInvalid(sorted(reader.problems, key=lambda p: (p.line, p.col)))
    return cases


async def _run_cases(policy: Policy, cases: list[Case]) -> list[tuple[Case, Judgement]]:
    out = []
    for case in cases:
        # Only the case's own table: a name it does not list is unresolvable
        # (dns_failed), and no case ever sends a DNS query.
        out.append((case, await judge(policy, case.client, case.dest, StaticResolver(case.resolve))))
    return out


def _outcome(judgement: Judgement) -> str:
    decision = judgement.decision
    verdict = "allow" if decision.allowed else "refuse"
    verdict = f"{verdict} ({decision.reason.value})" if decision.reason else verdict
    via = {"tunnel": TUNNEL, "intercepted": INTERCEPTED}.get(judgement.via)
    return f"{verdict} [{via}]" if via else verdict


def _hint(case: Case, judgement: Judgement) -> str:
    """Why a failing case fails when the cause is how the proxy meets the URL."""
    method = case.dest.method or "GET"
    wants_method_refusal = case.expect == "refuse" and (
        case.reason == Reason.METHOD_NOT_ALLOWED.value or (case.reason is None and method not in ("GET", "CONNECT")))
    if judgement.via == "tunnel" and wants_method_refusal:
        return (f"; the host must be intercepted for its methods to be checked: the proxy sees only CONNECT "
                f"{judgement.authority}, never the {method} inside the tunnel (add the host to `intercept`; "
                "the client must then trust `sluice ca`)")
    if judgement.via == "intercepted" and method == "CONNECT" and case.reason == Reason.METHOD_NOT_ALLOWED.value:
        return "; the CONNECT to an intercepted host is not checked against `methods` (each request inside is)"
    return ""


def run_test(policy_path: str, cases_path: str, *, verbose: bool = False) -> int:
    policy = _load(policy_path)
    if policy is None:
        return EXIT_INVALID
    try:
        cases = load_cases(cases_path, policy)
    except PolicyInvalid as e:
        for problem in e.problems:
            print(problem, file=sys.stderr)
        print(f"{cases_path}: {len(e.problems)} problem(s)", file=sys.stderr)
        return EXIT_INVALID
    passed = failed = 0
    for case, judgement in asyncio.run(_run_cases(policy, cases)):
        decision = judgement.decision
        got = "allow" if decision.allowed else "refuse"
        ok = got == case.expect and (case.reason is None or (decision.reason is not None and decision.reason.value == case.reason))
        if ok:
            passed += 1
            if verbose:
                print(f"{cases_path}:{case.line}: ok: {case.label}: {_outcome(judgement)}")
            continue
        failed += 1
        wanted = f"{case.expect} ({case.reason})" if case.reason else case.expect
        refusal = decision.refusal or decision.would_refuse
        why = f": {refusal.detail}" if refusal else ""
        rule = refusal.rule if refusal else (decision.rule.origin if decision.rule else None)
        where = f" [rule {rule}]" if rule else ""
        print(f"{cases_path}:{case.line}: FAIL: {case.label}: expected {wanted}, got {_outcome(judgement)}{where}{why}"
              f"{_hint(case, judgement)}")
    print(f"{passed} passed, {failed} failed")
    return EXIT_OK if failed == 0 else EXIT_INVALID


# ---- hash-password ---------------------------------------------------------


def hash_password_command() -> int:
    stdin = sys.stdin
    try:
        interactive = stdin is not None and stdin.isatty()
    except ValueError:  # closed
        interactive = False
    try:
        if interactive:
            password = getpass.getpass("Password: ")
            if password != getpass.getpass("Repeat the password: "):
                return _usage("hash-password", "the passwords do not match")
        else:
            password = stdin.read() if stdin is not None else ""
            password = password.rstrip("\r\n")
    except (EOFError, OSError, ValueError) as e:
        return _usage("hash-password", f"could not read a password ({e or type(e).__name__})")
    if not password:
        return _usage("hash-password", "the password is empty")
    print(hash_password(password))
    return EXIT_OK
