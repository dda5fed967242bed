"""The proxy and `sluice policy explain/test` decide alike: one table of URLs
through the gate's hooks in process (mitmproxy's taddons/tflow; no proxy,
no sockets) and through policy_cli.judge, with the same policy and the same
DNS table; the decisions (allowed, reason, pinned address) must agree."""

from __future__ import annotations

import asyncio
import gc
from types import SimpleNamespace

import pytest
from mitmproxy.proxy import mode_specs
from mitmproxy.test import taddons, tflow, tutils

from sluice import connstate
from sluice.addons.audit import AuditLog
from sluice.addons.caps import Caps
from sluice.addons.conn_release import ConnRelease
from sluice.addons.credentials import CredentialInjector
from sluice.addons.gate import EgressGate, tunnel_of
from sluice.outcome import outcome_of
from sluice.policy.loader import load_policy_text
from sluice.policy_cli import judge, parse_url
from sluice.resolver import StaticResolver

POLICY = load_policy_text("""version: 1
ports: [80, 443, 8443]
methods: [GET, HEAD, CONNECT]
deny: [denied.example]
proxy_addresses: [1.2.3.4]
intercept: [seen.example, keyed.example]
private_networks: [10.9.0.0/16]
credentials:
  - hosts: [keyed.example]
    set_headers:
      X-Api-Key: {env: KEY}
clients:
  - name: builds
    sources: [192.0.2.0/24]
    methods: [GET, POST, CONNECT]
    deny: [public.example]
""", "parity.yaml", environ={"KEY": "s3cret"})

DNS = {
    "public.example": ["8.8.8.8"], "seen.example": ["8.8.4.4"], "keyed.example": ["9.9.9.9"],
    "denied.example": ["8.8.8.8"], "private.example": ["10.1.1.1"], "opened.example": ["10.9.0.5"],
    "loop.example": ["1.2.3.4"], "v6.example": ["2606:4700:4700::1111"],
}

URLS = [
    ("GET", "http://public.example/"),
    ("POST", "http://public.example/"),  # method_not_allowed for the top level, a deny for builds
    ("GET", "http://public.example:8080/"),
    ("GET", "http://denied.example/"),
    ("GET", "http://private.example/"),
    ("GET", "http://opened.example/"),
    ("GET", "http://loop.example/"),
    ("GET", "http://missing.example/"),
    ("GET", "http://169.254.169.254/latest/meta-data/"),
    ("GET", "http://metadata.google.internal/"),
    ("GET", "http://keyed.example/"),  # credential_plain_http
    ("GET", "https://public.example/"),
    ("GET", "https://v6.example:8443/"),
    ("GET", "https://denied.example/"),
    ("GET", "https://loop.example/"),
    ("GET", "https://seen.example/"),
    ("POST", "https://seen.example/"),
    ("GET", "https://keyed.example/"),
    ("GET", "https://private.example/"),
]

CLIENTS = [(None, "198.51.100.7"), ("builds", "192.0.2.9")]


class _Gate:
    def __init__(self) -> None:
        audit = AuditLog()
        audit.write = lambda **record: None
        current = SimpleNamespace(policy=POLICY, resolver=StaticResolver(DNS), generation=1)
        self.source = SimpleNamespace(current=current, on_reload=lambda f: None, poll_seconds=0)
        self.caps = Caps(self.source, audit)
        self.gate = EgressGate(self.source, audit, self.caps)
        self.credentials = CredentialInjector(self.source, audit)
        self.release = ConnRelease(audit)


def _client(source: str):
    client = tflow.tclient_conn()
    client.peername = (source, 40000)
    client.proxy_mode = mode_specs.ProxyMode.parse("regular")
    client.sni = None
    return client


async def _through_the_gate(proxy: _Gate, client, method: str, url: str):
    """(allowed, reason, address) as the gate decides the URL: a request on
    the front door, or a CONNECT and then (intercepted) the request inside."""
    dest = parse_url(url, method)
    if dest.scheme == "http":
        request = tutils.treq(method=method.encode(), host=dest.host, port=dest.port, scheme=b"http",
                              authority=f"{dest.host}:{dest.port}".encode(), path=b"/")
        flow = tflow.tflow(client_conn=client, req=request)
        await proxy.gate.requestheaders(flow)
        proxy.credentials.requestheaders(flow)
        return _outcome(flow)
    connect = tflow.tflow(client_conn=client, req=tutils.treq(method=b"CONNECT", host=dest.host, port=dest.port,
                                                              scheme=b"", authority=f"{dest.host}:{dest.port}".encode(),
                                                              path=b""))
    connect.server_conn.address = (dest.host, dest.port)
    await proxy.gate.http_connect(connect)
    tunnel = tunnel_of(client, connect.server_conn)
    if tunnel is None or not tunnel.intercept:
        return _outcome(connect)
    inner = tflow.tflow(client_conn=client, server_conn=connect.server_conn,
                        req=tutils.treq(method=method.encode(), host=dest.host, port=dest.port, scheme=b"https",
                                        authority=b"", path=b"/"))
    inner.request.host_header = dest.host
    await proxy.gate.requestheaders(inner)
    proxy.credentials.requestheaders(inner)
    allowed, reason, address = _outcome(inner)
    return allowed, reason, address


def _outcome(flow):
    outcome = outcome_of(flow)
    refusal = outcome.cap or outcome.decision.refusal
    if refusal is not None:
        return False, refusal.reason.value, None
    return True, None, flow.request.host  # the address the gate pinned


@pytest.mark.parametrize("profile,source", CLIENTS)
def test_the_cli_and_the_gate_decide_every_url_alike(profile, source):
    proxy = _Gate()

    async def run():
        rows = []
        with taddons.context(proxy.gate, proxy.credentials):
            for method, url in URLS:
                judgement = await judge(POLICY, profile, parse_url(url, method), StaticResolver(DNS))
                decision = judgement.decision
                cli = (decision.allowed, decision.refusal.reason.value if decision.refusal else None,
                       decision.address if decision.allowed else None)
                client = _client(source)
                rows.append((method, url, cli, await _through_the_gate(proxy, client, method, url)))
                proxy.release.client_disconnected(client)  # as the proxy does: its state goes with it
        return rows

    rows = asyncio.run(run())
    gc.collect()  # the flows' client connections, and with them their connection state (sluice/connstate.py)
    assert connstate.count() == 0
    assert [(m, u, gate) for m, u, _, gate in rows] == [(m, u, cli) for m, u, cli, _ in rows]
    # The table covers allowed and refused, tunnels and interception, for each client.
    assert {cli[0] for *_, cli, _ in rows} == {True, False}
    assert len({cli[1] for *_, cli, _ in rows}) >= 6
