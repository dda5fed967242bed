"""The one table of non-public address ranges, and the classifier over it.

Rows follow the IANA special-purpose registries (IPv4 and IPv6), keeping every
range whose "globally reachable" is false, plus multicast, 240/4, broadcast and
every IPv6 range that embeds an IPv4 address. See docs in README ("What is
enforced") and ../shared/reference/ranges.md.

Choice on carve-outs: the registries mark a few slivers inside these blocks as
globally reachable (192.0.0.9/32 PCP anycast, 192.0.0.10/32 TURN anycast,
2001:1::1/128 and friends, 2001:3::/32 AMT, 2001:4:112::/48 AS112,
2001:20::/28 ORCHIDv2, 2001:30::/28 drone remote ID). No agent needs them and
each sits inside a block that is otherwise infrastructure, so Sluice refuses
them with their enclosing block. An operator can still open one through
`private_networks`.

We compare plain integers (netaddr parses the table once) so classifying an
address costs a few dozen integer comparisons and no allocation per row.
"""

from __future__ import annotations

from dataclasses import dataclass
import socket
from functools import lru_cache

import netaddr


@dataclass(frozen=True, slots=True)
class NonPublicRange:
    cidr: str
    name: str
    rfc: str
    first: int
    last: int
    version: int


# (cidr, human name used in refusal messages, RFC). Most specific first within
# a family, so the first match names the range best.
_IPV4_ROWS: tuple[tuple[str, str, str], ...] = (
    ("169.254.169.254/32", "link-local (cloud metadata)", "3927"),
    ("169.254.170.2/32", "link-local (ECS task metadata)", "3927"),
    ("169.254.170.23/32", "link-local (EKS pod identity)", "3927"),
    ("100.100.100.200/32", "shared address space (Alibaba cloud metadata)", "6598"),
    ("192.0.0.192/32", "IETF protocol assignments (Oracle cloud metadata)", "6890"),
    ("255.255.255.255/32", "limited broadcast", "919"),
    ("0.0.0.0/8", "'this network'", "791"),
    ("10.0.0.0/8", "private-use", "1918"),
    ("100.64.0.0/10", "shared address space (CGNAT)", "6598"),
    ("127.0.0.0/8", "loopback", "1122"),
    ("169.254.0.0/16", "link-local", "3927"),
    ("172.16.0.0/12", "private-use", "1918"),
    ("192.0.0.0/24", "IETF protocol assignments", "6890"),
    ("192.0.2.0/24", "documentation (TEST-NET-1)", "5737"),
    ("192.88.99.0/24", "deprecated 6to4 relay anycast", "7526"),
    ("192.168.0.0/16", "private-use", "1918"),
    ("198.18.0.0/15", "benchmarking", "2544"),
    ("198.51.100.0/24", "documentation (TEST-NET-2)", "5737"),
    ("203.0.113.0/24", "documentation (TEST-NET-3)", "5737"),
    ("224.0.0.0/4", "multicast", "5771"),
    ("240.0.0.0/4", "reserved", "1112"),
)

_IPV6_ROWS: tuple[tuple[str, str, str], ...] = (
    ("::/128", "unspecified", "4291"),
    ("::1/128", "loopback", "4291"),
    ("fd00:ec2::254/128", "unique local (AWS cloud metadata)", "4193"),
    ("::ffff:0:0/96", "IPv4-mapped (embeds an IPv4 address)", "4291"),
    ("::ffff:0:0:0/96", "SIIT translated (embeds an IPv4 address)", "6052"),
    ("::/96", "IPv4-compatible (embeds an IPv4 address)", "4291"),
    ("64:ff9b::/96", "NAT64 (embeds an IPv4 address)", "6052"),
    ("64:ff9b:1::/48", "local-use IPv4/IPv6 translation (embeds an IPv4 address)", "8215"),
    ("100::/64", "discard-only", "6666"),
    ("100:0:0:1::/64", "dummy prefix", "9780"),
    ("2001::/32", "Teredo (embeds an IPv4 address)", "4380"),
    ("2001::/23", "IETF protocol assignments", "2928"),
    ("2001:db8::/32", "documentation", "3849"),
    ("2002::/16", "6to4 (embeds an IPv4 address)", "3056"),
    ("3fff::/20", "documentation", "9637"),
    ("5f00::/16", "SRv6 SIDs", "9602"),
    ("fc00::/7", "unique local", "4193"),
    ("fe80::/10", "link-local", "4291"),
    ("fec0::/10", "site-local (deprecated)", "3879"),
    ("ff00::/8", "multicast", "4291"),
    # Everything outside 2000::/3 is not global unicast. Expressed as the
    # complement blocks so the table stays a flat list of prefixes.
    ("::/3", "not global unicast (outside 2000::/3)", "4291"),
    ("4000::/2", "not global unicast (outside 2000::/3)", "4291"),
    ("8000::/1", "not global unicast (outside 2000::/3)", "4291"),
)


def _compile(rows: tuple[tuple[str, str, str], ...], version: int) -> tuple[NonPublicRange, ...]:
    compiled = []
    for cidr, name, rfc in rows:
        net = netaddr.IPNetwork(cidr)
        assert net.version == version, cidr
        compiled.append(NonPublicRange(str(net.cidr), name, rfc, net.first, net.last, version))
    return tuple(compiled)


IPV4_NON_PUBLIC: tuple[NonPublicRange, ...] = _compile(_IPV4_ROWS, 4)
IPV6_NON_PUBLIC: tuple[NonPublicRange, ...] = _compile(_IPV6_ROWS, 6)
ALL_NON_PUBLIC: tuple[NonPublicRange, ...] = IPV4_NON_PUBLIC + IPV6_NON_PUBLIC


def non_public_range(value: int, version: int) -> NonPublicRange | None:
    """The non-public range holding this address, or None if it is public."""
    table = IPV4_NON_PUBLIC if version == 4 else IPV6_NON_PUBLIC
    for row in table:
        if row.first <= value <= row.last:
            return row
    return None


@lru_cache(maxsize=65536)
def address_value(address: str) -> tuple[int, int]:
    """(integer value, IP version) of an IP address string; cached, since the
    same few addresses are looked at again and again."""
    if ":" in address:
        return int.from_bytes(socket.inet_pton(socket.AF_INET6, address.split("%", 1)[0]), "big"), 6
    return int.from_bytes(socket.inet_pton(socket.AF_INET, address), "big"), 4


@lru_cache(maxsize=65536)
def classify(address: str) -> NonPublicRange | None:
    """Classify a canonical IP address string (as produced by policy.hosts)."""
    return non_public_range(*address_value(address))
