"""Host spellings: whatever a resolver would read as an IP address is read as
that IP by Sluice (or refused as malformed) — never as a name to look up."""

import ipaddress
import socket

import pytest
from hypothesis import example, given, settings, strategies as st

from sluice.policy.decide import Destination, check_request
from sluice.policy.hosts import HostError, IPHost, NameHost, canonical_ip, parse_host
from sluice.policy.model import Rules
from sluice.policy.ranges import ALL_NON_PUBLIC, classify

RULES = Rules()


def ipv4_part(value: int, style: str) -> str:
    if style == "hex":
        return hex(value)
    if style == "HEX":
        return "0X" + format(value, "X")
    if style == "oct":
        return "0" + format(value, "o")
    return str(value)


@st.composite
def ipv4_spellings(draw, value=None):
    """(text, integer) for an IPv4 address in any inet_aton spelling."""
    if value is None:
        value = draw(st.integers(0, 2**32 - 1))
    nparts = draw(st.integers(1, 4))
    octets = value.to_bytes(4, "big")
    head = list(octets[: nparts - 1])
    last = int.from_bytes(octets[nparts - 1 :], "big")
    styles = st.sampled_from(["dec", "hex", "HEX", "oct"])
    parts = [ipv4_part(v, draw(styles)) for v in head] + [ipv4_part(last, draw(styles))]
    text = ".".join(parts)
    if draw(st.booleans()):
        text += "."
    return text, value


def non_public_value(draw, version):
    rows = [r for r in ALL_NON_PUBLIC if r.version == version]
    row = draw(st.sampled_from(rows))
    return draw(st.integers(row.first, row.last))


@st.composite
def non_public_ipv4(draw):
    return non_public_value(draw, 4)


@st.composite
def non_public_ipv6(draw):
    return non_public_value(draw, 6)


def fullwidth(text: str) -> str:
    table = {str(d): chr(0xFF10 + d) for d in range(10)}
    table["."] = "\u3002"
    table["x"] = "\uff58"
    return "".join(table.get(c, c) for c in text)


@given(ipv4_spellings())
@settings(max_examples=2000)
def test_every_inet_aton_spelling_is_read_as_its_address(spelled):
    text, value = spelled
    expected = str(ipaddress.IPv4Address(value))
    host = parse_host(text)
    assert isinstance(host, IPHost) and host.address == expected
    if not text.endswith("."):
        # glibc agrees (it rejects the trailing dot form, which browsers accept)
        assert socket.inet_aton(text) == ipaddress.IPv4Address(value).packed


@given(st.text(alphabet="0123456789xXabcdefABCDEF.", min_size=1, max_size=24))
@settings(max_examples=3000)
@example("0x7f.1")
@example("0177.0.0.1")
@example("2130706433")
@example("127.1")
def test_what_glibc_reads_as_an_address_is_never_a_name(text):
    try:
        packed = socket.inet_aton(text)
    except OSError:
        return
    try:
        host = parse_host(text)
    except HostError:
        return  # refused as malformed: safe
    assert isinstance(host, IPHost), f"{text!r} is an IPv4 literal to glibc but a name to Sluice"
    assert host.address == socket.inet_ntoa(packed)


@given(st.data())
@settings(max_examples=1500)
def test_non_public_ipv4_in_any_spelling_is_refused(data):
    value = data.draw(non_public_ipv4())
    text, _ = data.draw(ipv4_spellings(value=value))
    variant = data.draw(st.sampled_from(["plain", "fullwidth", "mapped6", "bracketed-mapped"]))
    if variant == "fullwidth":
        text = fullwidth(text.lower())
    elif variant == "mapped6":
        text = "[::ffff:" + str(ipaddress.IPv4Address(value)) + "]"
    elif variant == "bracketed-mapped":
        text = "[::FFFF:" + format(value >> 16, "X") + ":" + format(value & 0xFFFF, "x") + "]"
    port = data.draw(st.sampled_from([80, 443]))
    decision = check_request(RULES, Destination(text, port, "http", "GET"))
    assert not decision.allowed and not decision.needs_dns, (text, decision)


@given(st.data())
@settings(max_examples=1500)
def test_non_public_ipv6_in_any_spelling_is_refused(data):
    value = data.draw(non_public_ipv6())
    address = ipaddress.IPv6Address(value)
    style = data.draw(st.sampled_from(["compressed", "exploded", "upper", "zone", "zone25"]))
    text = {
        "compressed": address.compressed,
        "exploded": address.exploded,
        "upper": address.compressed.upper(),
        "zone": address.compressed + "%eth0",
        "zone25": address.compressed + "%25eth0",
    }[style]
    decision = check_request(RULES, Destination("[" + text + "]", 443, "https", "GET"))
    assert not decision.allowed and not decision.needs_dns, (text, decision)


@given(st.text(max_size=40))
@settings(max_examples=3000)
def test_arbitrary_host_text_is_never_allowed_to_a_non_public_address(text):
    decision = check_request(RULES, Destination(text, 80, "http", "GET"))
    if decision.allowed and not decision.needs_dns:
        assert decision.address is not None and classify(decision.address) is None
    if decision.needs_dns:
        assert isinstance(decision.host, NameHost)
        # A name that goes to DNS never looks like a number at its end.
        assert not decision.host.name.split(".")[-1].isdigit()


@pytest.mark.parametrize(
    "text",
    [
        "localhost", "LOCALHOST", "localhost.", "ｌｏｃａｌｈｏｓｔ", "foo.localhost", "a.b.local",
        "metadata.google.internal", "metadata", "instance-data", "kubernetes.default",
        "kubernetes.default.svc", "kubernetes.default.svc.cluster.local", "db.prod.svc",
        "x.cluster.local", "router.home.arpa", "box.localdomain", "intranet",
        "1.0.0.127.in-addr.arpa", "printer.lan",
    ],
)
def test_internal_names_are_refused_before_any_lookup(text):
    decision = check_request(RULES, Destination(text, 80, "http", "GET"))
    assert not decision.allowed and not decision.needs_dns
    assert decision.refusal.reason == "internal_hostname"


@pytest.mark.parametrize(
    "text,expected",
    [
        ("2130706433", "127.0.0.1"), ("0x7f.1", "127.0.0.1"), ("0177.0.0.1", "127.0.0.1"),
        ("127.1", "127.0.0.1"), ("0", "0.0.0.0"), ("①②⑦.⓪.⓪.①", "127.0.0.1"),
        ("127。0。0。1", "127.0.0.1"), ("[::1]", "::1"), ("[FE80::1%25eth0]", "fe80::1"),
        ("[::ffff:169.254.169.254]", "::ffff:a9fe:a9fe"), ("0251.0376.0251.0376", "169.254.169.254"),
        ("0xa9fea9fe", "169.254.169.254"), ("8.8.8.8.", "8.8.8.8"),
    ],
)
def test_known_spellings(text, expected):
    host = parse_host(text)
    assert isinstance(host, IPHost)
    assert ipaddress.ip_address(host.address) == ipaddress.ip_address(expected)


@pytest.mark.parametrize(
    "text",
    ["", ".", "a..b", "foo.123", "1.2.3.999", "08.1.1.1", "0x1.0x1.0x1.0x100", "1.2.3.4.5",
     "[1.2.3.4]", "[::1", "ex ample.com", "a/b.com", "%31%32%37.0.0.1", "a" * 64 + ".com",
     "xn--zz.com", "-foo.com", "foo-.com"],
)
def test_malformed_hosts_are_refused(text):
    decision = check_request(RULES, Destination(text, 80, "http", "GET"))
    assert not decision.allowed
    assert decision.refusal.reason in ("malformed_host",)


@pytest.mark.parametrize("text,name", [("Example.COM.", "example.com"), ("bücher.de", "xn--bcher-kva.de"),
                                       ("ＥＸＡＭＰＬＥ．ｃｏｍ", "example.com"),
                                       ("_dmarc.example.com", "_dmarc.example.com")])
def test_names_are_normalised(text, name):
    assert parse_host(text) == NameHost(name)


# canonical_ip: the one spelling pins, own-address sets and DNS answers compare in.
@pytest.mark.parametrize(("text", "mapped_as_ipv4", "kept"), [
    ("8.8.8.8", "8.8.8.8", "8.8.8.8"),
    ("2001:DB8:0:0::1", "2001:db8::1", "2001:db8::1"),
    ("::ffff:8.8.8.8", "8.8.8.8", "::ffff:8.8.8.8"),
    ("::FFFF:0808:0808", "8.8.8.8", "::ffff:8.8.8.8"),
    ("fe80::1%eth0", "fe80::1", "fe80::1"),
])
def test_canonical_ip_spellings(text, mapped_as_ipv4, kept):
    assert canonical_ip(text) == mapped_as_ipv4
    assert canonical_ip(text, ipv4_mapped_as_ipv4=False) == kept


@pytest.mark.parametrize("text", ["example.com", "127.1", "0x7f.0.0.1", "010.0.0.1", "8.8.8.8/32", "[::1]", "",
                                  " 8.8.8.8"])
def test_canonical_ip_reads_addresses_not_host_text(text):
    with pytest.raises(ValueError):
        canonical_ip(text)


@given(st.ip_addresses())
def test_canonical_ip_is_the_spelling_parse_host_gives(ip):
    host = parse_host(f"[{ip}]" if ip.version == 6 else str(ip))
    assert isinstance(host, IPHost)
    mapped = ip.version == 6 and ip.ipv4_mapped is not None
    assert canonical_ip(str(ip), ipv4_mapped_as_ipv4=False) == host.address
    assert canonical_ip(str(ip)) == (str(ip.ipv4_mapped) if mapped else host.address)
