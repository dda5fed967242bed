"""The gate's hooks in process (addons/gate.py), through mitmproxy's own
dispatch over the addon chain (tests/harness/inprocess.py): what is pinned,
what is refused with which reason and answer, tunnels and their reload, the
SOCKS5 dial, and the front door's layer choice (tests/harness/playbook.py).
No proxy is spawned."""

from __future__ import annotations

import time

from mitmproxy import connection, http, options
from mitmproxy.addons.proxyserver import Proxyserver
from mitmproxy.connection import ConnectionState
from mitmproxy.proxy import commands, events, layer, layers
from mitmproxy.proxy.context import Context
from mitmproxy.proxy.layers import modes
from mitmproxy.proxy.layers.http import HttpConnectHook, HTTPMode, HttpRequestHeadersHook, HttpResponseHook
from mitmproxy.proxy.server_hooks import ServerConnectHook, ServerConnectionHookData
from mitmproxy.test import taddons, tflow, tutils

from harness.inprocess import InProcess, connect_flow, in_process, lines_of, policy, request_flow
from harness.playbook import Placeholder, Playbook, reply
from sluice import connstate
from sluice.addons.gate import SOCKS5_NOT_ALLOWED, tunnel_of
from sluice.outcome import outcome_of

POLICY = """version: 1
ports: [80, 443]
methods: [GET, POST, CONNECT]
intercept: [seen.example]
"""
DNS = {"public.example": ["8.8.8.8"], "seen.example": ["8.8.4.4"], "inside.example": ["10.1.2.3"],
       "other.example": ["1.1.1.1"]}


@in_process(POLICY, DNS)
async def test_an_allowed_request_is_pinned_to_the_address_it_was_decided_with(p, client):
    flow = request_flow(client, "public.example", path=b"/path?q=1")
    await p.hook(HttpRequestHeadersHook(flow))
    assert flow.response is None
    assert flow.request.host == "8.8.8.8" and flow.request.host_header == "public.example"
    assert flow.request.path == "/path?q=1"
    assert p.gate.dialer.approved(client, "8.8.8.8", 80) is not None  # the one address its dial may reach
    outcome = outcome_of(flow)
    assert outcome.decision.allowed and outcome.decision.address == "8.8.8.8"


@in_process(POLICY, DNS)
async def test_a_refusal_answers_with_its_reason_code_and_a_sentence_and_dials_nothing(p, client):
    flow = request_flow(client, "inside.example")
    await p.hook(HttpRequestHeadersHook(flow))
    response = flow.response
    assert response.status_code == 403
    assert response.headers["Sluice-Reason"] == "dns_answer_not_public"
    assert 'details="dns_answer_not_public"' in response.headers["Proxy-Status"]
    text = response.get_text()
    assert text.startswith("Sluice refused this request: inside.example resolves to 10.1.2.3")
    assert "do not retry" in text
    assert connstate.peek(client).approved == {}  # nothing approved: no dial can follow
    await p.hook(HttpResponseHook(flow))
    [line] = lines_of(p.lines, "request")
    assert (line["decision"], line["reason"], line["status"], line["host"]) == (
        "refuse", "dns_answer_not_public", 403, "inside.example")


@in_process(POLICY, DNS)
async def test_proxy_credentials_are_never_forwarded(p, client):
    flow = request_flow(client, "public.example", Proxy_Authorization="Basic dXNlcjpwYXNz")
    await p.hook(HttpRequestHeadersHook(flow))
    assert flow.response is None and "Proxy-Authorization" not in flow.request.headers


@in_process(POLICY, DNS)
async def test_a_connect_is_pinned_its_tunnel_remembered_and_a_refused_one_opens_none(p, client):
    flow = connect_flow(client, "public.example")
    await p.hook(HttpConnectHook(flow))
    assert flow.response is None and flow.request.host == "8.8.8.8"
    tunnel = tunnel_of(client, flow.server_conn)
    assert tunnel is not None and tunnel.host == "public.example" and not tunnel.intercept
    refused = connect_flow(client, "public.example", 22)
    await p.hook(HttpConnectHook(refused))
    assert refused.response.status_code == 403
    assert refused.response.headers["Sluice-Reason"] == "port_not_allowed"
    assert tunnel_of(client, refused.server_conn) is None
    assert p.gate.dialer.approved(client, "8.8.8.8", 22) is None


@in_process(POLICY, DNS)
async def test_inside_an_intercepted_tunnel_a_request_may_name_only_the_tunnels_host(p, client):
    tunnel = connect_flow(client, "seen.example")
    tunnel.server_conn.sni = None
    await p.hook(HttpConnectHook(tunnel))
    assert tunnel_of(client, tunnel.server_conn).intercept
    assert tunnel.server_conn.sni == "seen.example"  # the origin is verified against the name, not the IP
    client.sni = "seen.example"
    for host_header, allowed in (("seen.example", True), ("other.example", False)):
        inner = tflow.tflow(client_conn=client, server_conn=tunnel.server_conn,
                            req=tutils.treq(method=b"GET", host="seen.example", port=443, scheme=b"https",
                                            authority=b"", path=b"/"))
        inner.request.host_header = host_header
        await p.hook(HttpRequestHeadersHook(inner))
        if allowed:
            assert inner.response is None and inner.request.host == "8.8.4.4"
        else:
            assert inner.response.status_code == 403
            assert inner.response.headers["Sluice-Reason"] == "host_mismatch"


@in_process(POLICY, DNS, mode="socks5")
async def test_a_socks5_dial_by_name_is_resolved_and_pinned_and_a_refused_one_gets_rep_2(p, client):
    server = connection.Server(address=("public.example", 443))
    await p.hook(ServerConnectHook(ServerConnectionHookData(server=server, client=client)))
    assert server.error is None and server.address == ("8.8.8.8", 443)
    assert tunnel_of(client, server) is not None
    other = await p.connect(mode="socks5", port=40001)
    refused = connection.Server(address=("inside.example", 443))
    await p.hook(ServerConnectHook(ServerConnectionHookData(server=refused, client=other)))
    assert refused.error.startswith("dns_answer_not_public: ")
    assert refused.address == ("inside.example", 443)  # never pinned, never dialled
    socket = p.handler(other).socket
    assert bytes(socket.sent) == SOCKS5_NOT_ALLOWED and socket.closed  # "not allowed by ruleset"
    [line] = [line for line in p.lines if line["reason"] == "dns_answer_not_public"]
    assert line["host"] == "inside.example" and line["decision"] == "refuse"


@in_process(POLICY, DNS)
async def test_a_reload_that_refuses_an_open_tunnel_cuts_it_tunnel_revoked(p, client):
    flow = connect_flow(client, "public.example")
    await p.hook(HttpConnectHook(flow))
    kept = await p.connect(port=40001)
    other = connect_flow(kept, "other.example")
    await p.hook(HttpConnectHook(other))
    p.source.reload(policy(POLICY + "deny: [public.example]\n"))
    assert p.handler(client).socket.closed and not p.handler(kept).socket.closed
    [line] = lines_of(p.lines, "tunnel")
    assert line["reason"] == "tunnel_revoked" and line["host"] == "public.example"
    assert "host_denied" in line["detail"]
    assert tunnel_of(kept, other.server_conn).cap is None


def test_tls_spoken_to_the_proxy_itself_is_refused_at_the_front_door():
    """The front door's layer choice, driven through mitmproxy's own HttpProxy
    and NextLayer layers: a TLS ClientHello to the proxy port closes the
    connection, with one audit line, before any TLS layer runs."""
    p = InProcess(POLICY, DNS)
    opts = options.Options()
    Proxyserver().load(opts)
    client = connection.Client(peername=("192.0.2.1", 40000), sockname=("127.0.0.1", 8080),
                               timestamp_start=time.time(), state=ConnectionState.OPEN)
    context = Context(client, opts)
    next_layer = Placeholder(layer.NextLayer)
    hello = b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03" + b"\x00" * 40

    def choose(nl: layer.NextLayer) -> None:
        p.layer_choice.next_layer(nl)
        assert type(nl.layer).__name__ == "_RefuseClient"

    assert (Playbook(modes.HttpProxy(context))
            >> events.DataReceived(client, hello)
            << layer.NextLayerHook(next_layer)
            >> reply(side_effect=choose)
            << commands.CloseConnection(client))
    [line] = p.lines
    assert line["reason"] == "client_protocol_refused" and "plain HTTP" in line["detail"]


def test_plain_http_at_the_front_door_is_left_to_mitmproxys_http_layer():
    p = InProcess(POLICY, DNS)
    opts = options.Options()
    Proxyserver().load(opts)
    client = connection.Client(peername=("192.0.2.1", 40000), sockname=("127.0.0.1", 8080),
                               timestamp_start=time.time(), state=ConnectionState.OPEN)
    chosen = []

    def choose(nl: layer.NextLayer) -> None:
        p.layer_choice.next_layer(nl)
        chosen.append(nl.layer)

    with taddons.context():  # mitmproxy's choice reads its options (ignore_hosts, ...) from ctx
        assert (Playbook(modes.HttpProxy(Context(client, opts)))
                >> events.DataReceived(client, b"GET http://public.example/ HTTP/1.1\r\n\r\n")
                << layer.NextLayerHook(Placeholder(layer.NextLayer))
                >> reply(side_effect=choose)
                << HttpRequestHeadersHook(Placeholder(http.HTTPFlow)))
    # mitmproxy's own choice for its HTTP proxy mode: its HTTP layer, regular mode
    [http_layer] = chosen
    assert isinstance(http_layer, layers.HttpLayer) and http_layer.mode is HTTPMode.regular and p.lines == []
