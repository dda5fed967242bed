"""An `upstream_proxy` that is Sluice itself (its own listener) would loop:
each request would come back in and be sent to the parent again. Only the
running proxy knows its listeners, so it refuses such a policy at start and
at reload (sluice/own_host.py parent_loop_problems; end to end:
tests/integration/test_upstream_proxy_loop.py), and a parent named by a
name is checked when it is dialled."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from sluice.dialer import UpstreamProxyFailed
from sluice.own_host import listener_at, parent_loop_problems
from sluice.policy.loader import load_policy_text

from test_upstream_proxy_dialer import PARENT, client, make


def policy(upstream: str, extra: str = ""):
    return load_policy_text(f"version: 1\nupstream_proxy: {{url: \"{upstream}\"}}\n{extra}", "p.yaml",
                            lambda path: "", {})


@pytest.mark.parametrize("url, listeners", [
    ("http://127.0.0.1:8080", [("127.0.0.1", 8080)]),  # the listen address itself
    ("http://127.0.0.2:8080", [("0.0.0.0", 8080)]),  # any loopback address reaches a wildcard listener
    ("http://[::1]:8080", [("::", 8080)]),
    ("http://localhost:8080", [("127.0.0.1", 8080)]),  # localhost is loopback without DNS (RFC 6761)
    ("http://proxy.localhost:1080", [("127.0.0.1", 8080), ("127.0.0.1", 1080)]),  # the SOCKS5 listener too
])
def test_a_parent_at_one_of_the_proxys_own_listeners_is_refused_naming_it(url, listeners):
    problems = parent_loop_problems(policy(url), listeners)
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"p.yaml:2: upstream_proxy.url {url} is this proxy itself (its listener ")
    assert problems[0].endswith("every request would loop through Sluice; give the parent proxy's own address")


def test_a_parent_at_one_of_the_policys_proxy_addresses_is_this_host():
    loaded = policy("http://203.0.113.7:8080", "proxy_addresses: [203.0.113.7]\n")
    assert parent_loop_problems(loaded, [("0.0.0.0", 8080)]) != []
    assert parent_loop_problems(policy("http://203.0.113.7:8080"), [("0.0.0.0", 8080)]) == []


@pytest.mark.parametrize("url, listeners", [
    ("http://127.0.0.1:3128", [("127.0.0.1", 8080)]),  # another port of this host: a local parent is fine
    ("http://127.0.0.2:8080", [("127.0.0.1", 8080)]),  # a listener bound to one address is not reached at another
    ("http://10.0.0.2:3128", [("0.0.0.0", 8080)]),
    ("http://corp-proxy:8080", [("0.0.0.0", 8080)]),  # a name: checked when dialled (below)
])
def test_a_parent_elsewhere_is_not_a_loop(url, listeners):
    assert parent_loop_problems(policy(url), listeners) == []


def test_a_profiles_own_parent_is_checked_with_its_line():
    loaded = policy("http://10.0.0.2:3128", "clients:\n  - name: looped\n    sources: [10.1.0.0/16]\n"
                                            "    upstream_proxy: {url: \"http://127.0.0.1:8080\"}\n")
    assert parent_loop_problems(loaded, [("127.0.0.1", 8080)]) == [
        "p.yaml:6: upstream_proxy.url http://127.0.0.1:8080 is this proxy itself (its listener 127.0.0.1:8080): "
        "every request would loop through Sluice; give the parent proxy's own address"]


def test_listener_at_names_the_listener_reached():
    assert listener_at("127.0.0.1", 8080, [("0.0.0.0", 1080), ("0.0.0.0", 8080)]) == ("0.0.0.0", 8080)
    assert listener_at("127.0.0.1", 9090, [("0.0.0.0", 8080)]) is None


def test_a_parent_whose_name_resolves_to_this_proxy_is_refused_at_the_dial(monkeypatch):
    d, _ = make(parent=dataclasses.replace(PARENT, host="corp-proxy", url="http://corp-proxy:3128"))
    monkeypatch.setattr("sluice.own_host.proxy_listeners", lambda: [("0.0.0.0", 3128)])
    dialled = []

    async def getaddrinfo(self, host, port, **kw):
        return [(2, 1, 6, "", ("127.0.0.1", 3128))]
    monkeypatch.setattr(asyncio.BaseEventLoop, "getaddrinfo", getaddrinfo)

    async def connect(host, port, **kw):
        dialled.append(host)
        raise AssertionError("nothing may be dialled")
    with pytest.raises(UpstreamProxyFailed) as e:
        asyncio.run(d.dial(client(), None, "8.8.8.8", 443, connect))
    assert str(e.value) == (
        "upstream_proxy_failed: the parent proxy http://corp-proxy:3128 resolves to 127.0.0.1:3128, this proxy's own "
        "listener 0.0.0.0:3128, so the request would loop through Sluice; the operator must point upstream_proxy at "
        "the real parent")
    assert dialled == []
