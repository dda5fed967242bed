"""sluice.admission.admit(): every decision the gate makes, over plain data,
in process (no proxy, no sockets, no DNS: a fixed resolver table)."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from sluice.admission import (
    Arrival, Kind, OpenTunnel, TunnelFacts, admit, parse_authority, readmit_tunnel, strip_headers, tunnel_client,
)
from sluice.policy.clients import ClientMatch, identity_of, match_client
from sluice.policy.loader import load_policy_text
from sluice.resolver import StaticResolver

DNS = StaticResolver({
    "public.example": ["8.8.8.8"],
    "v6.example": ["2606:4700:4700::1111"],
    "inside.example": ["10.1.2.3"],
    "alias.example": ["8.8.4.4"],
    "api.example.com": ["8.8.8.8"],
    "other.example.com": ["8.8.4.4"],
    "proxyhost.example": ["1.2.3.4"],
})


def policy(text: str = "version: 1\n"):
    return load_policy_text(text, "p.yaml", environ={"KEY": "s3cret"})


def run(p, arrival: Arrival, identity: ClientMatch | None = None, resolver=DNS):
    return asyncio.run(admit(p, identity if identity is not None else match_client(p, None), arrival, resolver))


def request(host: str, port: int = 80, method: str = "GET", scheme: str = "http", **kw) -> Arrival:
    return Arrival(Kind.REQUEST, host, port, scheme=scheme, method=method, **kw)


def connect(host: str, port: int = 443) -> Arrival:
    return Arrival(Kind.CONNECT, host, port, method="CONNECT")


def inside(host: str = "public.example", port: int = 443, method: str = "GET", **kw) -> Arrival:
    return Arrival(Kind.INSIDE, host, port, scheme="https", method=method,
                   tunnel=TunnelFacts(host, port, "8.8.8.8"), **kw)


def test_the_module_imports_no_mitmproxy():
    code = ("import sys, sluice.admission, sluice.resolver; "
            "print(sorted(m for m in sys.modules if m == 'mitmproxy' or m.startswith('mitmproxy.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"


# ---- every reason the gate can produce ---------------------------------------

CLIENTS = """version: 1
require_client: true
clients:
  - name: ci
    sources: [10.0.0.0/8]
"""


@pytest.mark.parametrize("text,arrival,reason", [
    ("version: 1\n", request("public.example", scheme="ftp"), "scheme_not_allowed"),
    ("version: 1\n", request("public.example", has_credentials=True), "url_credentials"),
    ("version: 1\n", request("exa mple.com"), "malformed_host"),
    ("version: 1\n", request("public.example", port=8080), "port_not_allowed"),
    ("version: 1\nmethods: [GET]\n", request("public.example", method="DELETE"), "method_not_allowed"),
    ("version: 1\nmethods: [GET]\n", connect("public.example"), "method_not_allowed"),  # CONNECT is a method here
    ("version: 1\n", request("metadata.google.internal"), "internal_hostname"),
    ("version: 1\ndeny: [public.example]\n", connect("public.example"), "host_denied"),
    ("version: 1\nallow: [other.example.com]\n", request("public.example"), "host_not_allowed"),
    ("version: 1\n", request("169.254.169.254"), "address_not_public"),
    ("version: 1\n", connect("inside.example"), "dns_answer_not_public"),
    ("version: 1\n", request("missing.example"), "dns_failed"),
    ("version: 1\nproxy_addresses: [1.2.3.4]\n", connect("proxyhost.example"), "proxy_loop"),
    ("version: 1\nproxy_addresses: [1.2.3.4]\n", Arrival(Kind.DIAL, "1.2.3.4", 443), "proxy_loop"),
    ("version: 1\n", Arrival(Kind.DIAL, "public.example", 443, transport="udp"), "client_protocol_refused"),
    (CLIENTS, request("public.example"), "client_unknown"),
])
def test_every_refusal_reason(text, arrival, reason):
    admission = run(policy(text), arrival)
    assert not admission.allowed
    assert admission.refusal.reason.value == reason
    assert admission.pin is None and admission.credential is None and admission.strip_headers == ()


def test_a_refusal_carries_the_profiles_note():
    admission = run(policy("version: 1\nrefusal_note: Ask the platform team.\ndeny: [public.example]\n"),
                    request("public.example"))
    assert admission.refusal.note == "Ask the platform team." and admission.refusal.message.endswith("platform team.")


def test_a_refused_client_has_no_rules_and_a_refused_host_keeps_them():
    strict = policy(CLIENTS)
    refused = run(strict, request("public.example"))
    assert refused.rules is None and refused.profile is None
    ci = run(strict, request("169.254.169.254"), match_client(strict, "10.1.1.1"))
    assert ci.profile == "ci" and ci.rules is not None and ci.refusal.reason.value == "address_not_public"


def test_an_allowed_request_is_pinned_to_the_checked_address():
    admission = run(policy(), request("public.example"))
    assert admission.allowed and admission.pin == "8.8.8.8" and admission.method == "GET"
    assert not admission.intercept and admission.sni is None
    v6 = run(policy(), connect("v6.example"))
    assert v6.pin == "2606:4700:4700::1111" and v6.method == "CONNECT"


def test_report_mode_allows_what_it_would_refuse():
    admission = run(policy("version: 1\naction: report\ndeny: [public.example]\n"), request("public.example"))
    assert admission.allowed and admission.decision.would_refuse.reason.value == "host_denied"
    assert admission.pin == "8.8.8.8"


# ---- interception ------------------------------------------------------------------

INTERCEPT = "version: 1\nmethods: [GET]\nintercept: [public.example]\n"


def test_an_intercepted_connect_is_decided_without_a_method_and_verified_by_name():
    p = policy(INTERCEPT)
    admission = run(p, connect("public.example"))
    assert admission.allowed and admission.intercept and admission.method is None
    assert admission.sni == "public.example" and admission.pin == "8.8.8.8"
    raw = run(p, connect("alias.example"))  # not intercepted: CONNECT must be a listed method
    assert not raw.intercept and raw.refusal.reason.value == "method_not_allowed"


def test_a_dial_to_an_intercepted_ip_gets_no_server_name():
    admission = run(policy("version: 1\nintercept: ['*']\n"), Arrival(Kind.DIAL, "8.8.8.8", 443))
    assert admission.intercept and admission.sni is None and admission.pin == "8.8.8.8" and admission.method is None


def test_requests_inside_are_decided_with_their_method_and_stay_on_the_tunnels_address():
    p = policy(INTERCEPT)
    client = tunnel_client(p, None)
    assert run(p, inside(method="GET"), client).pin == "8.8.8.8"
    assert run(p, inside(method="POST"), client).refusal.reason.value == "method_not_allowed"


@pytest.mark.parametrize("host_header,sni,authority,refused", [
    ("public.example", "public.example", "", False),
    ("PUBLIC.example.:443", None, "public.example:443", False),
    ("public.example", None, "other.example.com", True),  # absolute-form naming another virtual host
    ("other.example.com", None, "", True),
    (None, "other.example.com", "", True),
    ("public.example:notaport", None, "", True),  # unreadable: judged whole, as a host, and refused
])
def test_fronting_inside_an_intercepted_tunnel(host_header, sni, authority, refused):
    p = policy(INTERCEPT)
    admission = run(p, inside(host_header=host_header, sni=sni, authority=authority), tunnel_client(p, None))
    assert admission.allowed is not refused
    if refused:
        assert admission.refusal.reason.value == "host_mismatch" and admission.pin is None


def test_fronting_wins_over_a_profile_that_is_gone():
    p = policy(INTERCEPT)
    gone = tunnel_client(p, "ci")
    assert run(p, inside(), gone).refusal.reason.value == "client_unknown"
    assert run(p, inside(host_header="other.example.com"), gone).refusal.reason.value == "host_mismatch"


def test_a_connect_inside_a_tunnel_is_refused_with_the_tunnels_note():
    p = policy(INTERCEPT)
    arrival = Arrival(Kind.INSIDE, "public.example", 443, method="CONNECT",
                      tunnel=TunnelFacts("public.example", 443, "8.8.8.8", "Ask the platform team."))
    admission = run(p, arrival, tunnel_client(p, None))
    assert admission.refusal.reason.value == "host_mismatch" and admission.refusal.note == "Ask the platform team."
    assert admission.rules is None


def test_inside_a_tunnel_absolute_form_becomes_origin_form_and_a_missing_host_is_named():
    p = policy(INTERCEPT)
    client = tunnel_client(p, None)
    absolute = run(p, inside(host_header="public.example", authority="public.example"), client)
    assert absolute.origin_form and absolute.host_header is None
    h2 = run(p, inside(host_header="public.example", authority="public.example", multiplexed=True), client)
    assert not h2.origin_form  # :authority is a pseudo-header, never rewritten
    bare = run(p, inside(), client)
    assert bare.host_header == "public.example"
    on_8443 = policy("version: 1\nports: [8443]\nintercept: [public.example]\n")
    other_port = run(on_8443, inside(port=8443), tunnel_client(on_8443, None))
    assert other_port.host_header == "public.example:8443"


# ---- the front door's Host header ---------------------------------------------------


@pytest.mark.parametrize("host_header,expected", [
    (None, None),  # origin-form already named it by Host; nothing to send instead
    ("public.example", None),
    ("Public.Example.:80", None),
    ("public.example:8080", "public.example"),  # another port
    ("other.example.com", "public.example"),  # another virtual host on that IP
    ("not a host", "public.example"),
])
def test_a_host_header_naming_something_else_is_replaced(host_header, expected):
    assert run(policy(), request("public.example", host_header=host_header)).host_header == expected


def test_replacement_host_headers_name_the_port_when_not_the_default():
    p = policy("version: 1\nports: [80, 8080]\n")
    assert run(p, request("public.example", 8080, host_header="x.example")).host_header == "public.example:8080"
    assert run(p, request("8.8.8.8", 8080, host_header="x.example")).host_header == "8.8.8.8:8080"


# ---- header strips ----------------------------------------------------------------------


def test_header_strips_are_the_connection_tokens_the_hop_by_hop_headers_and_the_rules():
    p = policy("version: 1\nstrip_request_headers: [Cookie, X-Trace]\n")
    admission = run(p, request("public.example", connection="keep-alive, X-Secret, Upgrade, close"))
    assert admission.strip_headers == ("X-Secret", "Proxy-Connection", "Keep-Alive", "TE", "cookie", "x-trace")
    assert strip_headers("", policy().rules) == ("Proxy-Connection", "Keep-Alive", "TE")
    assert run(p, connect("public.example")).strip_headers == ()  # a tunnel's headers are never seen


# ---- credentials --------------------------------------------------------------------------

CREDENTIALS = """version: 1
intercept: [api.example.com, other.example.com]
credentials:
  - hosts: [api.example.com]
    set_headers:
      X-Api-Key: {env: KEY}
  - hosts: [other.example.com]
    allow_plain_http: true
    set_headers:
      X-Api-Key: {env: KEY}
"""


def test_credentials_follow_the_host_decided_on():
    p = policy(CREDENTIALS)
    client = tunnel_client(p, None)
    inner = run(p, inside("api.example.com"), client)
    assert inner.credential is not None and inner.credential.header_names == ("X-Api-Key",)
    assert inner.credential_refusal is None
    assert run(p, inside("public.example"), client).credential is None  # another host: none


def test_credentials_are_never_sent_over_plain_http_unless_allowed():
    p = policy(CREDENTIALS)
    plain = run(p, request("api.example.com"))
    assert plain.allowed and plain.credential is None
    assert plain.credential_refusal.reason.value == "credential_plain_http"
    allowed = run(p, request("other.example.com"))
    assert allowed.credential is not None and allowed.credential_refusal is None


def test_a_tunnel_is_never_given_credentials():
    admission = run(policy(CREDENTIALS), connect("api.example.com"))
    assert admission.allowed and admission.credential is None and admission.credential_refusal is None


# ---- authorities ------------------------------------------------------------------


@pytest.mark.parametrize("text,expected", [
    ("a.example", ("a.example", None)),
    ("a.example:8080", ("a.example", 8080)),
    ("[2606:4700::1]:443", ("2606:4700::1", 443)),
    ("under_score.example", ("under_score.example", None)),
    ("a.example:70000", ValueError),
    ("a.example:", ValueError),
    ("bad-.example", ("bad-.example", None)),  # as lenient as the HTTP parser the gate relied on
    ("a b", ValueError),
    ("", ValueError),
])
def test_authorities_are_parsed_strictly(text, expected):
    if expected is ValueError:
        with pytest.raises(ValueError):
            parse_authority(text)
    else:
        assert parse_authority(text) == expected


# ---- open tunnels after a reload ---------------------------------------------------------


def test_a_reload_moves_a_tunnel_to_its_clients_new_profile_or_refuses_it():
    before = policy("version: 1\nclients:\n  - name: ci\n    sources: [10.0.0.0/8]\n")
    tunnel = OpenTunnel("public.example", 443, "CONNECT", ("8.8.8.8",), "ci", identity_of(before, "10.1.1.1", None))
    moved = readmit_tunnel(policy("version: 1\nclients:\n  - name: builds\n    sources: [10.1.0.0/16]\n"), tunnel)
    assert moved.refusal is None and moved.match.profile == "builds"
    denied = readmit_tunnel(policy("version: 1\ndeny: [public.example]\n"), tunnel)
    assert denied.match is None and denied.refusal.reason.value == "host_denied"
    loop = readmit_tunnel(policy("version: 1\nproxy_addresses: [8.8.8.8]\n"), tunnel)
    assert loop.refusal.reason.value == "proxy_loop"


TRICKY_AUTHORITIES = [
    "a.example", "A.EXAMPLE.:443", "a.example:0", "a.example:65535", "a.example:65536", "a..example", ".a.example",
    "a.example..", "[::1]", "[::1]:80", "::1", "[v1.fe]", "1.2.3.4:80", "0x7f.1", "bücher.example",
    "xn--bcher-kva.example",
    "a_b.example", "-a.example", "a-.example", "a" * 64 + ".example", ("a" * 63 + ".") * 4 + "example",
    "a.example:+80", "a.example: 80", "a example", "[]", "[::1", "a.example:80:80", "%41.example", "\u200b.example",
]


@pytest.mark.parametrize("text", TRICKY_AUTHORITIES)
def test_authorities_are_read_as_the_proxys_http_parser_reads_them(text):
    """The gate once used mitmproxy's parser for Host and :authority; the
    engine's own must accept and split exactly the same texts."""
    from mitmproxy.net.http import url as mitm_url

    try:
        theirs = mitm_url.parse_authority(text, check=True)
    except ValueError:
        theirs = ValueError
    try:
        ours = parse_authority(text)
    except ValueError:
        ours = ValueError
    assert ours == theirs
