"""SOCKS5 refusals say "connection not allowed by ruleset" (REP 2), so SOCKS
clients report a policy refusal rather than an unreachable host."""

from __future__ import annotations

import pytest

from harness import default_policy, socks5_connect

pytestmark = pytest.mark.netns


@pytest.fixture(scope="module")
def socks_proxy(sluice_factory):
    return sluice_factory(default_policy(), socks=True, name="socksrep")


@pytest.mark.parametrize("host,atyp", [("169.254.169.254", "ip"), ("localhost", "domain"), ("10.0.0.1", "domain")])
def test_refused_socks_destinations_get_rep_2(socks_proxy, host, atyp):
    result = socks5_connect(socks_proxy.socks_address, host, 80, atyp=atyp)
    assert result.reply == 2


def test_allowed_socks_destination_succeeds(socks_proxy):
    result = socks5_connect(socks_proxy.socks_address, "public.example", 80)
    assert result.reply == 0
    result.tunnel.close()
