"""Host text -> what it really names: an IP address or a normalised DNS name.

Host text is never trusted. It is folded the way resolvers and browsers fold it
(UTS-46 mapping: case, full-width and circled characters, ideographic dots;
a trailing dot), then read as an IP literal in every spelling glibc's
`inet_aton` accepts (decimal `2130706433`, hex `0x7f.1`, octal `0177.0.0.1`,
short `127.1`) or as bracketed IPv6 with an optional zone id. Whatever is
neither a valid IP literal nor a valid DNS name is malformed, and malformed is
refused: a parse failure never means "it's a name, allow it".
"""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass
from functools import lru_cache

import idna


class HostError(ValueError):
    """The host text is neither a valid IP literal nor a valid DNS name."""


@dataclass(frozen=True, slots=True)
class IPHost:
    address: str  # canonical text: dotted quad, or compressed lowercase IPv6
    version: int

    def __str__(self) -> str:
        return self.address


@dataclass(frozen=True, slots=True)
class NameHost:
    name: str  # lowercase ASCII (A-labels), no trailing dot

    def __str__(self) -> str:
        return self.name


Host = IPHost | NameHost

_NUMERIC_PART = re.compile(r"^(?:0x[0-9a-f]*|[0-9]+)$")
_ASCII_LABEL = re.compile(r"^[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?$")
_MAX_NAME = 253


@lru_cache(maxsize=8192)
def parse_host(raw: str) -> Host:
    """Read host text as an IP address or a DNS name; raise HostError otherwise.
    (Cached: it is pure, and agents ask for the same hosts again and again.)"""
    if not isinstance(raw, str) or not raw:
        raise HostError("the host is empty")
    text = raw
    if text.startswith("[") and text.endswith("]"):
        return _parse_ipv6(text[1:-1], raw)
    if "%" in text and ":" not in text:
        raise HostError(f"{raw!r} contains percent-encoding")
    try:
        # UTS-46 mapping folds case, full-width forms, circled digits and
        # ideographic full stops, as browsers and many resolvers do.
        text = idna.uts46_remap(text, std3_rules=False, transitional=False)
    except (idna.IDNAError, UnicodeError, ValueError) as e:
        raise HostError(f"{raw!r} is not a valid host name ({e})") from None
    if ":" in text:
        return _parse_ipv6(text, raw)
    if text.endswith("."):
        text = text[:-1]
    if not text:
        raise HostError(f"{raw!r} is not a valid host name")
    labels = text.split(".")
    if _NUMERIC_PART.match(labels[-1]):
        # A name whose last label is a number is an IPv4 literal or nothing
        # (WHATWG URL "ends in a number"); never a name to look up.
        return _parse_ipv4(labels, raw)
    return NameHost(_encode_name(labels, raw))


def _parse_ipv4(parts: list[str], raw: str) -> IPHost:
    """glibc inet_aton semantics: 1-4 parts, the last fills the remaining bytes."""
    if len(parts) > 4:
        raise HostError(f"{raw!r} is not a valid IPv4 address")
    values = []
    for part in parts:
        if not _NUMERIC_PART.match(part):
            raise HostError(f"{raw!r} is not a valid IPv4 address")
        try:
            if part.startswith("0x"):
                value = int(part[2:] or "0", 16)
            elif len(part) > 1 and part.startswith("0"):
                value = int(part, 8)
            else:
                value = int(part, 10)
        except ValueError:
            raise HostError(f"{raw!r} is not a valid IPv4 address") from None
        values.append(value)
    *head, last = values
    if any(v > 0xFF for v in head) or last >= 1 << (8 * (4 - len(head))):
        raise HostError(f"{raw!r} is not a valid IPv4 address (a part is out of range)")
    number = 0
    for v in head:
        number = (number << 8) | v
    number = (number << (8 * (4 - len(head)))) | last
    return IPHost(socket.inet_ntop(socket.AF_INET, number.to_bytes(4, "big")), 4)


def _parse_ipv6(text: str, raw: str) -> IPHost:
    # Zone ids (fe80::1%eth0, or %25eth0 as written in URLs) name an interface,
    # not an address: drop them before classifying.
    address = text.split("%", 1)[0]
    try:
        packed = socket.inet_pton(socket.AF_INET6, address)
    except (OSError, ValueError):
        raise HostError(f"{raw!r} is not a valid IPv6 address") from None
    return IPHost(socket.inet_ntop(socket.AF_INET6, packed), 6)


_IPV4_MAPPED_PREFIX = bytes(10) + b"\xff\xff"


@lru_cache(maxsize=4096)
def canonical_ip(text: str, *, ipv4_mapped_as_ipv4: bool = True) -> str:
    """A plain IP address (dotted quad or IPv6, an IPv6 zone id dropped) in
    the one spelling pins, own-address sets and DNS answers compare in: the
    text `parse_host` gives, with IPv4-mapped IPv6 as IPv4 unless
    `ipv4_mapped_as_ipv4` is False. ValueError if it is not one. Unlike
    `parse_host`, it takes none of inet_aton's other spellings: it reads
    addresses, not host text. (Cached: it runs on the tunnel-setup path.)"""
    address = text.split("%", 1)[0]
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            packed = socket.inet_pton(family, address)
        except (OSError, ValueError):
            continue
        if ipv4_mapped_as_ipv4 and packed[:12] == _IPV4_MAPPED_PREFIX:
            return socket.inet_ntop(socket.AF_INET, packed[12:])
        return socket.inet_ntop(family, packed)
    raise ValueError(f"{text!r} is not an IP address")


def _encode_name(labels: list[str], raw: str) -> str:
    encoded = []
    for label in labels:
        if label.isascii():
            if label.startswith("xn--"):
                try:
                    idna.ulabel(label)
                except (idna.IDNAError, UnicodeError):
                    raise HostError(f"{raw!r} has an invalid punycode label {label!r}") from None
        else:
            try:
                label = idna.alabel(label).decode("ascii")
            except (idna.IDNAError, UnicodeError):
                raise HostError(f"{raw!r} has an invalid label {label!r}") from None
        if not _ASCII_LABEL.match(label):
            raise HostError(f"{raw!r} has an invalid label {label!r}")
        encoded.append(label)
    name = ".".join(encoded)
    if len(name) > _MAX_NAME:
        raise HostError(f"{raw!r} is longer than {_MAX_NAME} characters")
    return name


# Names that are internal by definition: never looked up, always refused.
INTERNAL_NAMES: frozenset[str] = frozenset(
    {
        "localhost",
        "metadata",
        "metadata.google.internal",
        "instance-data",
        "instance-data.ec2.internal",
        "kubernetes",
        "kubernetes.default",
    }
)
# Suffixes (a name equal to the suffix or ending in ".suffix").
INTERNAL_SUFFIXES: tuple[str, ...] = (
    "localhost",
    "local",
    "internal",
    "home.arpa",
    "localdomain",
    "lan",
    "intranet",
    "corp",
    "private",
    "svc",
    "cluster.local",
    "test",
    "invalid",
    "onion",
    "alt",
    "arpa",
)


_INTERNAL_SUFFIX_SET = frozenset(INTERNAL_SUFFIXES)


@lru_cache(maxsize=8192)
def internal_name(name: str) -> str | None:
    """Why this normalised name is internal (a short phrase), or None.
    Walks the name's own suffixes: a few set probes, whatever the list size."""
    if name in INTERNAL_NAMES:
        return "a reserved internal name"
    if "." not in name:
        return "a single-label name (resolved through local search domains)"
    if name.startswith("kubernetes.default."):
        return "a Kubernetes service name"
    suffix = name
    while True:
        if suffix in _INTERNAL_SUFFIX_SET:
            return f"an internal name (*.{suffix})"
        dot = suffix.find(".")
        if dot < 0:
            return None
        suffix = suffix[dot + 1 :]
