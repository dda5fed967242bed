"""sluice.policy.matchers: host patterns (exact, *., **., *, IP, CIDR), their
normalisation, and address sets."""

from __future__ import annotations

import time

import netaddr
import pytest

from sluice.policy.hosts import IPHost, NameHost, parse_host
from sluice.policy.matchers import (
    AddressSet,
    HostMatcher,
    PatternError,
    covers_pattern,
    parse_cidr,
    parse_host_pattern,
)


def matcher(*patterns: str) -> HostMatcher:
    return HostMatcher.build([(p, f"p.yaml:{i + 1}") for i, p in enumerate(patterns)])


def matched(m: HostMatcher, host: str) -> str | None:
    rule = m.match_host(parse_host(host))
    return rule.text if rule else None


# ---- parse_host_pattern ------------------------------------------------------


@pytest.mark.parametrize(
    ("pattern", "expected"),
    [
        ("example.com", ("exact", "example.com")),
        ("EXAMPLE.com.", ("exact", "example.com")),
        ("Sub.Example.COM", ("exact", "sub.example.com")),
        ("*.example.com", ("subdomains", "example.com")),
        ("*.EXAMPLE.COM.", ("subdomains", "example.com")),
        ("**.example.com", ("apex_and_subdomains", "example.com")),
        ("*", ("everything", "*")),
        ("bücher.example", ("exact", "xn--bcher-kva.example")),
        ("**.BÜCHER.example", ("apex_and_subdomains", "xn--bcher-kva.example")),
        ("xn--bcher-kva.example", ("exact", "xn--bcher-kva.example")),
        ("ｅｘａｍｐｌｅ．ｃｏｍ", ("exact", "example.com")),  # full-width letters, ideographic dot
        ("searxng", ("exact", "searxng")),
        ("_dmarc.example.com", ("exact", "_dmarc.example.com")),
        ("10.0.0.1", ("cidr", "10.0.0.1")),
        ("0x7f.1", ("cidr", "127.0.0.1")),
        ("2130706433", ("cidr", "127.0.0.1")),
        ("[::1]", ("cidr", "::1")),
        ("[2001:DB8::1]", ("cidr", "2001:db8::1")),
        ("10.0.0.0/8", ("cidr", "10.0.0.0/8")),
        ("2001:db8::/32", ("cidr", "2001:db8::/32")),
    ],
)
def test_patterns_are_normalised_like_hosts(pattern, expected):
    assert parse_host_pattern(pattern) == expected


@pytest.mark.parametrize(
    "pattern",
    ["", " x.com", "x.com ", "http://x.com", "x.com/", "x.com:80", "a*.x.com", "*.*.x.com", "x.*.com",
     "*.10.0.0.1", "**.[::1]", "exa mple.com", "a..b", "-a.com", "10.0.0.1/8", "10/8", "999.1.1.1", 42, None],
)
def test_bad_patterns_raise(pattern):
    with pytest.raises(PatternError):
        parse_host_pattern(pattern)


# ---- HostMatcher -------------------------------------------------------------


def test_exact_matches_only_that_name():
    m = matcher("example.com")
    assert matched(m, "example.com") == "example.com"
    assert matched(m, "EXAMPLE.COM.") == "example.com"
    assert matched(m, "www.example.com") is None
    assert matched(m, "notexample.com") is None
    assert matched(m, "example.com.evil.net") is None


def test_single_star_matches_subdomains_only():
    m = matcher("*.example.com")
    assert matched(m, "a.example.com") == "*.example.com"
    assert matched(m, "a.b.c.example.com") == "*.example.com"
    assert matched(m, "example.com") is None
    assert matched(m, "badexample.com") is None


def test_double_star_matches_apex_and_subdomains():
    m = matcher("**.example.com")
    assert matched(m, "example.com") == "**.example.com"
    assert matched(m, "deep.sub.example.com") == "**.example.com"
    assert matched(m, "example.com.evil") is None
    assert matched(m, "xexample.com") is None


def test_star_matches_every_host_names_and_addresses():
    m = matcher("*")
    for host in ("example.com", "a.b.c", "8.8.8.8", "[2606:4700::1111]"):
        assert matched(m, host) == "*"


def test_the_most_specific_name_rule_names_the_match():
    m = matcher("**.example.com", "*.api.example.com", "v1.api.example.com", "*")
    assert matched(m, "v1.api.example.com") == "v1.api.example.com"
    assert matched(m, "v2.api.example.com") == "*.api.example.com"
    assert matched(m, "www.example.com") == "**.example.com"
    assert matched(m, "other.org") == "*"


def test_ip_and_cidr_entries_match_addresses_in_any_spelling():
    m = matcher("10.0.0.0/8", "192.168.1.10", "[fd00::1]", "2001:db8::/32")
    assert matched(m, "10.200.3.4") == "10.0.0.0/8"
    assert matched(m, "012.0.0.1") == "10.0.0.0/8"  # octal 012 is 10
    assert matched(m, "0xc0a8010a") == "192.168.1.10"
    assert matched(m, "192.168.1.11") is None
    assert matched(m, "[FD00:0::1]") == "[fd00::1]"
    assert matched(m, "[2001:db8:ffff::9]") == "2001:db8::/32"
    assert matched(m, "11.0.0.1") is None
    # names never match address entries by name; resolved answers do
    assert matched(m, "ten.example") is None
    assert m.match_ip("10.9.9.9").text == "10.0.0.0/8"
    assert m.match_ip("8.8.8.8") is None
    assert matcher("example.com").match_ip("10.0.0.1") is None


def test_idn_patterns_match_unicode_and_punycode_hosts():
    m = matcher("**.bücher.example")
    assert matched(m, "bücher.example") == "**.bücher.example"
    assert matched(m, "www.xn--bcher-kva.example") == "**.bücher.example"
    assert matched(m, "BÜCHER.example") == "**.bücher.example"
    assert matched(m, "bucher.example") is None


def test_rules_keep_their_text_and_origin():
    m = matcher("a.example", "*.b.example")
    rule = m.match_name("x.b.example")
    assert (rule.text, rule.origin) == ("*.b.example", "p.yaml:2")
    assert str(rule) == "*.b.example (p.yaml:2)"
    assert len(m) == 2 and bool(m) and not HostMatcher()


def test_match_host_takes_parsed_hosts():
    m = matcher("example.com", "10.0.0.0/8")
    assert m.match_host(NameHost("example.com")).text == "example.com"
    assert m.match_host(IPHost("10.1.1.1", 4)).text == "10.0.0.0/8"


def test_many_patterns_match_without_scanning():
    m = matcher(*[f"host{i}.example{i % 97}.com" for i in range(10_000)],
                *[f"10.{i // 256}.{i % 256}.0/24" for i in range(1_000)])
    start = time.perf_counter()
    for _ in range(2_000):
        assert m.match_name("www.unrelated.example.org") is None
        assert m.match_ip("10.3.200.7") is not None
    assert time.perf_counter() - start < 1.0


# ---- AddressSet and parse_cidr -------------------------------------------------


def test_parse_cidr_is_strict():
    assert str(parse_cidr("10.0.0.0/8").cidr) == "10.0.0.0/8"
    assert str(parse_cidr("10.0.0.5").cidr) == "10.0.0.5/32"
    assert str(parse_cidr("[fd00::]/64").cidr) == "fd00::/64"
    for bad in ("10.0.0.1/8", "10/8", "10.0.0.0/33", "", "  ", "example.com", None):
        with pytest.raises(PatternError):
            parse_cidr(bad)


def test_address_set_most_specific_entry_and_ports():
    entries = AddressSet((
        AddressSet.entry("10.0.0.0/8", None, "p:1"),
        AddressSet.entry("10.0.0.5/32", 8080, "p:2"),
        AddressSet.entry("fd00::/64", 9000, "p:3"),
    ))

    def at(address, port):
        ip = netaddr.IPAddress(address)
        entry = entries.match_entry(int(ip), ip.version, port)
        return entry.rule.origin if entry else None

    assert at("10.0.0.5", 8080) == "p:2"
    assert at("10.0.0.5", 443) == "p:1"  # the port-limited /32 does not hold port 443
    assert at("10.1.2.3", 8080) == "p:1"
    assert at("11.0.0.1", 80) is None
    assert at("fd00::7", 9000) == "p:3"
    assert at("fd00::7", 9001) is None
    assert at("fd00:0:0:1::7", 9000) is None
    assert entries.match_address("10.0.0.5", None).origin == "p:2"
    assert len(entries) == 3 and bool(entries) and not AddressSet()


# One helper answers "does this matcher cover every host that pattern names"
# for policy check's deny shadowing, its interception summary, request-rule
# shadowing and the credentials' interception check.
@pytest.mark.parametrize("patterns,text,covered", [
    (["*"], "**.a.com", True),
    (["*"], "10.0.0.0/8", True),
    (["**.a.com"], "x.y.a.com", True),
    (["**.a.com"], "**.a.com", True),
    (["**.a.com"], "a.com", True),
    (["*.a.com"], "**.a.com", False),
    (["*.a.com"], "*.a.com", True),
    (["*.a.com"], "*.b.a.com", True),
    (["*.a.com"], "a.com", False),
    (["a.com"], "*.a.com", False),
    (["a.com", "*.a.com"], "**.a.com", True),
    (["**.com"], "*.a.com", True),
    (["*.com"], "**.a.com", True),
    (["a.com"], "b.com", False),
    (["1.2.3.4"], "1.2.3.4", True),
    (["1.2.3.4"], "1.2.3.5", False),
    (["10.0.0.0/8"], "10.1.2.3", True),
    (["10.0.0.0/8"], "10.0.0.0/8", False),  # a CIDR names no single host to probe: never claimed
    (["a.com"], "*", False),
    (["a.com"], "not a pattern", False),
])
def test_covers_pattern(patterns, text, covered):
    assert covers_pattern(matcher(*patterns), text) is covered
