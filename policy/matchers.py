"""Host-pattern and address-set matchers that never scan their rule lists.

A name is matched by walking its own labels (O(labels) dict probes); an address
by probing one hash set per distinct prefix length present. So a policy with
10,000 host patterns and 1,000 CIDRs decides as fast as one with ten.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import netaddr

from sluice.policy.hosts import HostError, IPHost, NameHost, parse_host
from sluice.policy.ranges import address_value


class PatternError(ValueError):
    """A host pattern or CIDR that is malformed (an error, never a silent no-match)."""


@dataclass(frozen=True, slots=True)
class Rule:
    text: str  # as written in the policy
    origin: str = ""  # "file:line" of the entry

    def __str__(self) -> str:
        return f"{self.text} ({self.origin})" if self.origin else self.text


@dataclass(frozen=True, slots=True)
class AddressEntry:
    version: int
    prefixlen: int
    network: int  # the network's value shifted right by (bits - prefixlen)
    port: int | None
    rule: Rule


def parse_cidr(text: str) -> netaddr.IPNetwork:
    """A strict CIDR or single address (host bits must be zero)."""
    if not isinstance(text, str) or not text.strip():
        raise PatternError(f"{text!r} is not a CIDR")
    raw = text.strip()
    try:
        if raw.startswith("[") and "]" in raw:
            raw = raw[1:].replace("]", "", 1)
        net = netaddr.IPNetwork(raw)
        if "/" in raw:
            addr_part = raw.split("/", 1)[0]
            # netaddr is lenient about short IPv4 forms ("10/8"); insist on full ones.
            netaddr.IPAddress(addr_part, flags=netaddr.INET_PTON)
    except (netaddr.AddrFormatError, ValueError, TypeError):
        raise PatternError(f"{text!r} is not a valid IP address or CIDR") from None
    if net.ip != net.network:
        raise PatternError(f"{text!r} has host bits set; did you mean {net.cidr}?")
    return net


class AddressSet:
    """CIDRs (each optionally limited to one port) with fast membership."""

    __slots__ = ("_tables", "entries")

    def __init__(self, entries: tuple[AddressEntry, ...] = ()) -> None:
        self.entries = entries
        by_len: dict[tuple[int, int], dict[int, list[AddressEntry]]] = {}
        for e in entries:
            by_len.setdefault((e.version, e.prefixlen), {}).setdefault(e.network, []).append(e)
        # Per IP version: (shift, table) pairs, longest prefix first so the
        # most specific entry names the rule.
        self._tables: dict[int, list[tuple[int, dict[int, list[AddressEntry]]]]] = {4: [], 6: []}
        for (version, length), table in sorted(by_len.items(), key=lambda kv: -kv[0][1]):
            self._tables[version].append(((32 if version == 4 else 128) - length, table))

    @staticmethod
    def entry(cidr: str, port: int | None = None, origin: str = "", text: str | None = None) -> AddressEntry:
        net = parse_cidr(cidr)
        bits = 32 if net.version == 4 else 128
        return AddressEntry(
            net.version, net.prefixlen, net.first >> (bits - net.prefixlen), port,
            Rule(text if text is not None else cidr, origin),
        )

    def __bool__(self) -> bool:
        return bool(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def match(self, value: int, version: int, port: int | None = None) -> Rule | None:
        entry = self.match_entry(value, version, port)
        return entry.rule if entry else None

    def match_entry(self, value: int, version: int, port: int | None = None) -> AddressEntry | None:
        """The most specific entry holding this address (and port, if the entry names one)."""
        for shift, table in self._tables[version]:
            bucket = table.get(value >> shift)
            if bucket:
                for e in bucket:
                    if e.port is None or port is None or e.port == port:
                        return e
        return None

    def match_address(self, address: str, port: int | None = None) -> Rule | None:
        return self.match(*address_value(address), port)


@dataclass(slots=True)
class HostMatcher:
    """Host patterns: `example.com` exact, `*.example.com` subdomains only,
    `**.example.com` apex and subdomains, `*` every host, and IP literals or
    CIDRs matching by address."""

    exact: dict[str, Rule] = field(default_factory=dict)
    subdomains: dict[str, Rule] = field(default_factory=dict)
    apex_and_subdomains: dict[str, Rule] = field(default_factory=dict)
    everything: Rule | None = None
    addresses: AddressSet = field(default_factory=AddressSet)
    rules: list[Rule] = field(default_factory=list)
    # name -> (rule when the host is that name, rule when it is a subdomain of
    # it): one probe per label of the host, built from the three dicts above.
    _by_suffix: dict[str, tuple[Rule | None, Rule | None]] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.rules)

    def __len__(self) -> int:
        return len(self.rules)

    @classmethod
    def build(cls, patterns: list[tuple[str, str]]) -> HostMatcher:
        """From (pattern text, origin) pairs; raises PatternError on the first bad one."""
        m = cls()
        address_entries = []
        for text, origin in patterns:
            rule = Rule(text, origin)
            kind, key = parse_host_pattern(text)
            if kind == "everything":
                m.everything = m.everything or rule
            elif kind == "cidr":
                address_entries.append(AddressSet.entry(key, None, origin, text))
            else:
                getattr(m, kind).setdefault(key, rule)
            m.rules.append(rule)
        m.addresses = AddressSet(tuple(address_entries))
        for key in m.exact.keys() | m.subdomains.keys() | m.apex_and_subdomains.keys():
            both = m.apex_and_subdomains.get(key)
            m._by_suffix[key] = (m.exact.get(key) or both, m.subdomains.get(key) or both)
        return m

    def match_name(self, name: str) -> Rule | None:
        by_suffix = self._by_suffix
        if by_suffix:
            found = by_suffix.get(name)
            if found and found[0]:
                return found[0]
            dot = name.find(".")
            while dot >= 0:
                found = by_suffix.get(name[dot + 1 :])
                if found and found[1]:
                    return found[1]
                dot = name.find(".", dot + 1)
        return self.everything

    def match_host(self, host: IPHost | NameHost) -> Rule | None:
        if isinstance(host, NameHost):
            return self.match_name(host.name)
        return self.addresses.match_address(host.address) or self.everything

    def match_ip(self, address: str) -> Rule | None:
        """Whether a resolved address is listed (CIDR or IP entries only)."""
        return self.addresses.match_address(address) if self.addresses else None


def covers_pattern(matcher: HostMatcher, text: str) -> bool:
    """Whether `matcher` matches every host the pattern `text` names as
    written (`policy check`'s shadowing and interception checks, the
    credentials' interception check). Sound, never generous: False when
    unsure, and for a malformed pattern or a CIDR."""
    if matcher.everything:
        return True
    try:
        kind, key = parse_host_pattern(text)
    except PatternError:
        return False
    if kind == "everything":
        return False
    if kind == "exact":
        return matcher.match_name(key) is not None
    if kind == "cidr":
        try:
            host = parse_host(key)
        except HostError:
            return False  # a CIDR: no single host to probe
        return isinstance(host, IPHost) and matcher.match_host(host) is not None
    if kind == "apex_and_subdomains" and matcher.match_name(key) is None:
        return False
    # Every subdomain of `key`: only a wildcard at `key` or above matches them all.
    labels = key.split(".")
    for i in range(len(labels)):
        suffix = ".".join(labels[i:])
        if suffix in matcher.apex_and_subdomains or suffix in matcher.subdomains:
            return True
    return False


def parse_host_pattern(text: object) -> tuple[str, str]:
    """Classify one pattern: ("exact"|"subdomains"|"apex_and_subdomains", name),
    ("everything", "*") or ("cidr", text). Raises PatternError."""
    if not isinstance(text, str):
        raise PatternError(f"a host pattern must be a string, not {type(text).__name__}")
    raw = text.strip()
    if raw != text or not raw:
        raise PatternError(f"{text!r} has surrounding spaces or is empty")
    if raw == "*":
        return "everything", "*"
    if "://" in raw or "/" in raw and not _looks_like_cidr(raw):
        raise PatternError(f"{text!r} looks like a URL or path; write only the host, e.g. 'example.com'")
    if _looks_like_cidr(raw):
        parse_cidr(raw)
        return "cidr", raw
    if raw.startswith("**."):
        kind, rest = "apex_and_subdomains", raw[3:]
    elif raw.startswith("*."):
        kind, rest = "subdomains", raw[2:]
    else:
        kind, rest = "exact", raw
    if "*" in rest:
        raise PatternError(
            f"{text!r}: '*' may appear only as a whole leading label ('*.example.com', '**.example.com') or alone"
        )
    if ":" in rest and not rest.startswith("["):
        raise PatternError(f"{text!r} has a port; list ports under `ports`")
    try:
        host = parse_host(rest)
    except HostError as e:
        raise PatternError(f"{text!r} is not a valid host pattern: {e}") from None
    if isinstance(host, IPHost):
        if kind != "exact":
            raise PatternError(f"{text!r}: wildcards apply to names, not IP addresses")
        return "cidr", host.address
    return kind, host.name


def _looks_like_cidr(raw: str) -> bool:
    if "/" not in raw:
        return False
    addr, _, length = raw.partition("/")
    return length.isdigit() and (":" in addr or addr.replace(".", "").isdigit())
