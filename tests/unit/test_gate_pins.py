"""The gate's per-connection pins and the pure checks behind interception and
reloads, without a network: the dialer's pin check and connected-peer check
refuse what the gate never approved; tunnels are re-decided with live rules."""

from __future__ import annotations

import asyncio

import pytest
from mitmproxy import connection

from sluice import admission, dialer
from sluice.addons import gate
from sluice.addons.gate import EgressGate, open_tunnel
from sluice.dialer import pinned_ip as _canonical_ip
from sluice.outcome import Outcome
from sluice.admission import live_rules as _live_rules
from sluice.policy.decide import Decision
from sluice.policy.loader import load_policy_text
from sluice.policy.model import Rules


class RecordingAudit:
    def __init__(self):
        self.lines = []

    def write(self, **record):
        self.lines.append(record)


class NoCaps:
    def __getattr__(self, name):
        return lambda *a, **k: None


def make_gate():
    audit = RecordingAudit()
    return EgressGate(source=None, audit=audit, caps=NoCaps()), audit


def client() -> connection.Client:
    return connection.Client(peername=("127.0.0.1", 40000), sockname=("127.0.0.1", 8080), timestamp_start=0)


def test_only_an_approved_ip_and_port_may_be_dialled():
    g, audit = make_gate()
    c, other = client(), client()
    g._approve(c, "8.8.8.8", 443, Rules())
    assert g.dialer.approved(c, "8.8.8.8", 443) is not None
    assert not g.dialer.approved(c, "8.8.8.8", 80)  # another port
    assert not g.dialer.approved(other, "8.8.8.8", 443)  # another client connection
    assert not g.dialer.approved(c, "169.254.169.254", 443)
    assert not g.dialer.approved(c, "public.example", 443)  # a name is never dialled
    assert [line["reason"] for line in audit.lines] == ["pin_mismatch"] * 4


def test_approvals_compare_addresses_canonically():
    g, _ = make_gate()
    c = client()
    g._approve(c, "2606:4700:4700:0:0:0:0:1111", 443, Rules())
    assert g.dialer.approved(c, "2606:4700:4700::1111", 443)
    assert _canonical_ip("::ffff:8.8.8.8") == "8.8.8.8"
    assert _canonical_ip("fe80::1%eth0") == "fe80::1"
    assert _canonical_ip("example.com") is None


class FakeTransport:
    def __init__(self, closed):
        self.closed = closed

    def abort(self):
        self.closed.append(("server", self))


class FakeWriter:
    """What asyncio.open_connection returns, connected to `peername`."""

    def __init__(self, peername, closed):
        self.peername, self.transport = peername, FakeTransport(closed)

    def get_extra_info(self, name):
        return self.peername if name == "peername" else None

    def close(self):
        pytest.fail("a refused peer's socket is aborted, not closed gracefully")


def _dial_connected_to(g, c, address, peername):
    """The gate's dialer dialling `address`, the socket landing on `peername`."""
    server = connection.Server(address=address)

    async def connect(host, port, **kwargs):
        return object(), FakeWriter(peername, closed)

    async def scenario():
        try:
            return await g.dialer.dial(c, server, *address, connect)
        finally:
            await asyncio.sleep(0)  # the client's close is scheduled, not done inside the dial

    closed = []
    return closed, scenario


def test_a_connected_peer_that_was_never_approved_is_closed_at_once():
    g, audit = make_gate()
    c = client()
    g.dialer.close_client = lambda client_: closed.append(("client", client_))
    g._approve(c, "8.8.8.8", 80, Rules())
    closed, scenario = _dial_connected_to(g, c, ("8.8.8.8", 80), ("10.0.0.1", 80))  # connected somewhere else
    with pytest.raises(dialer.DialRefused) as refused:
        asyncio.run(scenario())
    assert [kind for kind, _ in closed] == ["server", "client"]
    assert str(refused.value).startswith("pin_mismatch")  # mitmproxy's server.error for the failed dial
    assert audit.lines[-1]["reason"] == "pin_mismatch"


def test_an_approved_peer_passes_the_connected_check():
    g, audit = make_gate()
    c = client()
    g.dialer.close_client = lambda client_: pytest.fail("closed an approved peer")
    g._approve(c, "8.8.8.8", 80, Rules())
    closed, scenario = _dial_connected_to(g, c, ("8.8.8.8", 80), ("::ffff:8.8.8.8", 80, 0, 0))
    reader, writer = asyncio.run(scenario())
    assert writer.peername[0] == "::ffff:8.8.8.8" and closed == [] and audit.lines == []


def _tunnel(host: str, port: int, address: str, profile=None) -> Outcome:
    return Outcome(host, port, Decision(True, address=address, addresses=(address,)), profile, None)


def policy(text: str):
    return load_policy_text(text, "p.yaml")


def still_allowed(policy, tunnel: Outcome):
    """The reload check on an open tunnel, over the facts the gate keeps of it."""
    return admission.still_allowed(policy, open_tunnel(tunnel))


def _fronting(tunnel: Outcome, host_header, sni, authority):
    return admission.fronting(tunnel.host, host_header, sni, authority)


def test_a_reload_refuses_a_tunnel_by_host_port_and_pinned_address_without_dns():
    old = _tunnel("public.example", 443, "8.8.8.8")
    assert still_allowed(policy("version: 1\n"), old) is None
    assert still_allowed(policy("version: 1\ndeny: [public.example]\n"), old).reason == "host_denied"
    assert still_allowed(policy("version: 1\nports: [80]\n"), old).reason == "port_not_allowed"
    assert still_allowed(policy("version: 1\nallow: [other.example]\n"), old).reason == "host_not_allowed"
    # A tunnel to a private address opened by private_networks, closed when that goes.
    private = _tunnel("10.0.0.1", 443, "10.0.0.1")
    assert still_allowed(policy("version: 1\nprivate_networks: [10.0.0.0/8]\n"), private) is None
    assert still_allowed(policy("version: 1\n"), private).reason == "address_not_public"


def test_live_rules_follow_the_profile_and_refuse_when_it_is_gone():
    p = policy("version: 1\nclients:\n  - name: ci\n    sources: [10.0.0.0/8]\n    methods: [GET]\n")
    assert _live_rules(p, "ci").methods == frozenset({"GET"})
    assert _live_rules(p, "gone") is None
    assert _live_rules(p, None) is p.rules
    strict = policy("version: 1\nrequire_client: true\nclients:\n  - name: ci\n    sources: [10.0.0.0/8]\n")
    assert _live_rules(strict, None) is None  # anonymous tunnels are refused once require_client is on
    assert still_allowed(strict, _tunnel("public.example", 443, "8.8.8.8")).reason == "client_unknown"


@pytest.mark.parametrize("host_header,sni,authority,refused", [
    ("a.example", "a.example", "", False),
    ("a.example:443", None, "a.example:443", False),
    (None, None, "A.EXAMPLE.", False),
    ("a.example", "a.example", "b.example", True),  # absolute-form naming another vhost
    (None, None, "b.example:443", True),  # no Host, absolute-form elsewhere
    ("b.example", None, "", True),
    (None, "b.example", "", True),
])
def test_every_place_a_request_names_a_host_must_name_the_tunnels(host_header, sni, authority, refused):
    tunnel = _tunnel("a.example", 443, "8.8.8.8")
    refusal = _fronting(tunnel, host_header, sni, authority)
    assert (refusal is not None) == refused
    if refused:
        assert refusal.reason == "host_mismatch"


def test_the_dial_guard_is_installed_when_the_gate_loads(monkeypatch):
    installed = []
    monkeypatch.setattr(gate.mitm_patches, "set_dialer", lambda dialer_: installed.append(dialer_))

    class Source:
        def on_reload(self, callback):
            installed.append(callback)

    g = EgressGate(source=Source(), audit=RecordingAudit(), caps=NoCaps())
    installed.clear()  # the gate's own approvals follow reloads from construction; this is about load
    g.load(None)
    assert installed == [g.dialer, g.revoke_refused_tunnels]



@pytest.mark.parametrize("host_header,host,port,same", [
    ("a.example", "a.example", 80, True),
    ("A.Example.:80", "a.example", 80, True),
    ("a.example:8080", "a.example", 80, False),
    ("b.example", "a.example", 80, False),
    ("[2606:4700:4700::1111]:8080", "2606:4700:4700::1111", 8080, True),
    ("not a host", "a.example", 80, False),
])
def test_a_host_header_names_the_requests_authority_or_is_replaced(host_header, host, port, same):
    assert admission.names_authority(host_header, host, port) is same


def test_replacement_host_headers_are_well_formed():
    assert admission.authority_of("http", "a.example", 80) == "a.example"
    assert admission.authority_of("http", "a.example", 8080) == "a.example:8080"
    assert admission.authority_of("https", "2606:4700:4700::1111", 443) == "[2606:4700:4700::1111]"
    assert admission.authority_of("https", "2606:4700:4700::1111", 8443) == "[2606:4700:4700::1111]:8443"


def test_a_connect_tunnel_is_re_decided_with_its_method():
    tunnel = _tunnel("public.example", 443, "8.8.8.8")
    tunnel.method = "CONNECT"
    assert still_allowed(policy("version: 1\nmethods: [GET, CONNECT]\n"), tunnel) is None
    assert still_allowed(policy("version: 1\nmethods: [GET]\n"), tunnel).reason == "method_not_allowed"
    socks = _tunnel("public.example", 443, "8.8.8.8")  # SOCKS5: no method was ever decided
    assert still_allowed(policy("version: 1\nmethods: [GET]\n"), socks) is None


def test_only_this_hosts_own_addresses_count_as_the_proxy():
    from sluice import own_host

    assert own_host._is_local_address("127.0.0.1")
    assert not own_host._is_local_address("192.0.2.1")  # TEST-NET-1: never a local address here
    interfaces = own_host.interface_addresses()
    assert interfaces is not None and "127.0.0.1" in interfaces and "192.0.2.1" not in interfaces
    # Bound to one address: that address; to a wildcard: every interface address.
    assert own_host.OwnHost(lambda: [("127.0.0.1", 8080)]).addresses(frozenset()) == {"127.0.0.1"}
    assert own_host.OwnHost(lambda: [("0.0.0.0", 8080)]).addresses(frozenset()) >= interfaces
    # The operator's NAT'd addresses, always.
    assert own_host.OwnHost(lambda: []).addresses(frozenset({"203.0.113.7"})) == {"203.0.113.7"}


def test_the_proxys_own_host_is_proxy_loop_on_any_port_unless_private_networks_names_the_port():
    from sluice.policy.decide import check_own_address

    own = frozenset({"203.0.113.7", "2001:db8::7"})
    rules = policy("version: 1\nports: [80, 443]\n").rules
    assert check_own_address(rules, ("203.0.113.7",), 9090, own).reason == "proxy_loop"
    # one answer is enough
    assert check_own_address(rules, ("93.184.215.14", "203.0.113.7"), 443, own).reason == "proxy_loop"
    assert check_own_address(rules, ("::ffff:203.0.113.7",), 80, own).reason == "proxy_loop"  # one spelling
    assert check_own_address(rules, ("2001:DB8:0::7",), 80, own).reason == "proxy_loop"
    assert check_own_address(rules, ("93.184.215.14",), 80, own) is None
    opened = policy("version: 1\nports: [80, 443]\nprivate_networks: ['203.0.113.7/32:8080', '203.0.113.0/24']\n").rules
    assert check_own_address(opened, ("203.0.113.7",), 8080, own) is None  # named with this very port
    assert check_own_address(opened, ("203.0.113.7",), 80, own).reason == "proxy_loop"  # a portless entry is not enough


def test_proxy_addresses_are_ip_addresses():
    from sluice.policy.loader import PolicyInvalid, load_policy_text

    assert load_policy_text("version: 1\nproxy_addresses: ['203.0.113.7', "
                            "'::ffff:198.51.100.1']\n").proxy_addresses == {
        "203.0.113.7", "198.51.100.1"}
    for bad in ("'203.0.113.0/24'", "'host.example'", "5", "'203.0.113.7:80'"):
        with pytest.raises(PolicyInvalid, match="proxy_addresses"):
            load_policy_text(f"version: 1\nproxy_addresses: [{bad}]\n")
