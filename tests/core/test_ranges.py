"""The range table against the registry list in shared/reference/ranges.md."""

import ipaddress

import pytest
from hypothesis import given, settings, strategies as st

from sluice.policy.ranges import ALL_NON_PUBLIC, classify

# Every row of the registry table: each must be refused at its first and last address.
REGISTRY = [
    "0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16", "172.16.0.0/12",
    "192.0.0.0/24", "192.0.2.0/24", "192.88.99.0/24", "192.168.0.0/16", "198.18.0.0/15",
    "198.51.100.0/24", "203.0.113.0/24", "224.0.0.0/4", "240.0.0.0/4", "255.255.255.255/32",
    "::/128", "::1/128", "::ffff:0:0/96", "::/96", "::ffff:0:0:0/96", "64:ff9b::/96", "64:ff9b:1::/48",
    "100::/64", "100:0:0:1::/64", "2001::/23", "2001::/32", "2001:2::/48", "2001:10::/28",
    "2001:db8::/32", "2002::/16", "3fff::/20", "5f00::/16", "fc00::/7", "fe80::/10", "fec0::/10",
    "ff00::/8", "::/3", "4000::/2", "8000::/1",
]
# Carve-outs the registry marks global: Sluice refuses them with their block (documented).
CARVE_OUTS = ["192.0.0.9", "192.0.0.10", "2001:1::1", "2001:3::1", "2001:4:112::1", "2001:20::1", "2001:30::1"]
PUBLIC = ["8.8.8.8", "1.1.1.1", "93.184.215.14", "151.101.1.69", "2606:4700:4700::1111",
          "2a00:1450:4001:80b::200e", "2001:4860:4860::8888", "100.63.255.255", "100.128.0.0",
          "172.15.255.255", "172.32.0.0", "192.169.0.1", "198.17.255.255", "198.20.0.0", "223.255.255.255"]


@pytest.mark.parametrize("cidr", REGISTRY)
def test_every_registry_range_is_non_public_at_both_ends(cidr):
    net = ipaddress.ip_network(cidr)
    assert classify(str(net[0])) is not None
    assert classify(str(net[-1])) is not None


@pytest.mark.parametrize("address", CARVE_OUTS)
def test_carve_outs_are_refused_with_their_block(address):
    assert classify(address) is not None


@pytest.mark.parametrize("address", PUBLIC)
def test_public_addresses_pass(address):
    assert classify(address) is None


def test_metadata_addresses_are_named():
    assert "cloud metadata" in classify("169.254.169.254").name
    assert "metadata" in classify("fd00:ec2::254").name
    assert "Alibaba" in classify("100.100.100.200").name


@given(st.one_of(st.integers(0, 2**32 - 1).map(ipaddress.IPv4Address),
                 st.integers(0, 2**128 - 1).map(ipaddress.IPv6Address)))
@settings(max_examples=5000)
def test_whatever_cpython_calls_non_global_sluice_refuses(ip):
    # CPython's table is a floor, not the rule: Sluice refuses more (multicast, 6to4, NAT64...).
    if not ip.is_global:
        assert classify(str(ip)) is not None, ip


def test_table_rows_are_well_formed():
    for row in ALL_NON_PUBLIC:
        net = ipaddress.ip_network(row.cidr)
        assert (int(net[0]), int(net[-1])) == (row.first, row.last)
