"""The upgrade guard's hooks in process (addons/upgrades.py), through the
addon chain (tests/harness/inprocess.py): only WebSocket upgrades pass,
an origin may not switch protocols unasked, and an accepted WebSocket is
carried as a pipe with its own caps, transfer charge, time cap, audit line,
reload revocation and tunnel slot. No proxy is spawned."""

from __future__ import annotations

from mitmproxy.proxy.layers.http import (HttpConnectHook, HttpErrorHook, HttpRequestHeadersHook,
                                         HttpResponseHeadersHook, HttpResponseHook)
from mitmproxy.proxy.layers.tcp import TcpEndHook, TcpMessageHook, TcpStartHook
from mitmproxy import tcp
from mitmproxy.test import tflow

from harness.inprocess import (InProcess, advance_loop, answered, connect_flow, in_process, lines_of, policy,
                               request_flow, respond)
from sluice.outcome import outcome_of

POLICY = """version: 1
methods: [GET, CONNECT]
limits:
  tunnel_max_bytes: 1000
  tunnel_max_seconds: 60
"""
DNS = {"public.example": ["8.8.8.8"]}
WEBSOCKET = {"Upgrade": "websocket", "Connection": "Upgrade"}


def upgrade(client, **headers: str):
    return request_flow(client, **{name.replace("-", "_"): value for name, value in (headers or WEBSOCKET).items()})


async def switched(p: InProcess, flow, **headers: str):
    """The origin's 101 for `flow` (default: a WebSocket answer), through the response-head hooks."""
    respond(flow, 101, **(headers or {"Upgrade": "websocket", "Connection": "Upgrade"}))
    await p.hook(HttpResponseHeadersHook(flow))


async def pipe(p: InProcess, client):
    """A WebSocket upgrade accepted and started as its TCP pipe (Sluice runs mitmproxy with websocket=false)."""
    flow = upgrade(client)
    await p.hook(HttpRequestHeadersHook(flow))
    assert flow.response is None, flow.response
    await switched(p, flow)
    await p.hook(HttpResponseHook(flow))
    tcp_flow = tflow.ttcpflow(client_conn=client, server_conn=flow.server_conn, messages=[])
    await p.hook(TcpStartHook(tcp_flow))
    return tcp_flow


async def message(p: InProcess, flow: tcp.TCPFlow, content: bytes, from_client: bool = True) -> bytes:
    """One chunk through the pipe: what of it passes."""
    chunk = tcp.TCPMessage(from_client, content)
    flow.messages.append(chunk)
    await p.hook(TcpMessageHook(flow))
    return chunk.content


# ---- the request and the 101 -----------------------------------------------------------------


@in_process(POLICY, DNS)
async def test_an_upgrade_to_anything_but_websocket_is_refused_before_it_goes_upstream(p, client):
    for asked in ("h2c", "websocket, h2c", "TLS/1.2"):
        flow = upgrade(client, Upgrade=asked, Connection="Upgrade")
        await p.hook(HttpRequestHeadersHook(flow))
        assert flow.response.status_code == 403, asked
        assert flow.response.headers["Sluice-Reason"] == "upgrade_refused"
        assert "only WebSocket upgrades may pass" in flow.response.get_text()
        assert outcome_of(flow).cap.reason.value == "upgrade_refused"
    for fine in ("websocket", "WebSocket"):
        flow = upgrade(client, Upgrade=fine, Connection="Upgrade")
        await p.hook(HttpRequestHeadersHook(flow))
        assert flow.response is None, fine


@in_process(POLICY, DNS)
async def test_a_101_that_is_not_a_websocket_answer_to_a_websocket_request_is_cut(p, client):
    flow = upgrade(client)
    await p.hook(HttpRequestHeadersHook(flow))
    await switched(p, flow, Upgrade="h2c", Connection="Upgrade")
    assert answered(p, client, 403, "upgrade_refused") and p.handler(client).socket.closed
    await p.hook(HttpErrorHook(flow))
    [line] = lines_of(p.lines, "request")
    assert line["reason"] == "upgrade_refused" and "switched protocols" in line["detail"]


@in_process(POLICY, DNS)
async def test_a_101_nobody_asked_for_is_cut(p, client):
    flow = request_flow(client)
    await p.hook(HttpRequestHeadersHook(flow))
    await switched(p, flow)
    assert answered(p, client, 403, "upgrade_refused")
    tcp_flow = tflow.ttcpflow(client_conn=client, server_conn=flow.server_conn, messages=[])
    await p.hook(TcpStartHook(tcp_flow))
    assert outcome_of(tcp_flow) is None  # no pipe was accepted: it carries nothing
    assert await message(p, tcp_flow, b"hello") == b""


# ---- the pipe ----------------------------------------------------------------------------------


@in_process(POLICY, DNS)
async def test_a_pipe_passes_up_to_tunnel_max_bytes_each_way_keeps_nothing_and_has_its_line(p, client):
    flow = await pipe(p, client)
    assert await message(p, flow, b"a" * 600) == b"a" * 600
    assert await message(p, flow, b"b" * 1000, from_client=False) == b"b" * 1000  # each direction its own cap
    assert flow.messages == []  # chunks are never kept
    assert await message(p, flow, b"c" * 600) == b"c" * 400  # the 1000th byte towards the origin is the last
    assert p.handler(client).socket.closed
    assert await message(p, flow, b"d") == b""  # cut: nothing more
    [line] = lines_of(p.lines, "tunnel")
    assert (line["reason"], line["bytes_out"], line["bytes_in"]) == ("tunnel_too_large", 1000, 1000)
    assert line["host"] == "public.example" and line["decision"] == "refuse"


@in_process(POLICY, DNS)
async def test_a_pipe_that_ends_gets_one_allowed_line_with_its_bytes(p, client):
    flow = await pipe(p, client)
    await message(p, flow, b"ping")
    await message(p, flow, b"pong!", from_client=False)
    await p.hook(TcpEndHook(flow))
    [line] = lines_of(p.lines, "tunnel")
    assert (line["decision"], line["reason"], line["bytes_out"], line["bytes_in"]) == ("allow", None, 4, 5)
    assert not p.handler(client).socket.closed


@in_process(POLICY.replace("limits:\n", "limits:\n  bytes_per_hour: 700\n"), DNS)
async def test_a_pipe_is_charged_to_bytes_per_hour_and_cut_where_it_runs_out(p, client):
    flow = await pipe(p, client)
    assert await message(p, flow, b"a" * 500) == b"a" * 500
    assert await message(p, flow, b"b" * 500, from_client=False) == b"b" * 200  # both ways share the hour
    assert p.handler(client).socket.closed
    [line] = lines_of(p.lines, "tunnel")
    assert line["reason"] == "quota_exceeded" and (line["bytes_out"], line["bytes_in"]) == (500, 200)


@in_process(POLICY, DNS)
async def test_a_pipe_is_cut_at_tunnel_max_seconds(p, client):
    await pipe(p, client)
    await advance_loop(59)
    assert not p.handler(client).socket.closed
    await advance_loop(2)
    assert p.handler(client).socket.closed
    [line] = lines_of(p.lines, "tunnel")
    assert line["reason"] == "tunnel_timeout"


@in_process(POLICY, DNS)
async def test_a_reload_that_refuses_the_pipes_host_cuts_it_tunnel_revoked(p, client):
    await pipe(p, client)
    p.source.reload(policy(POLICY + "deny: [public.example]\n"))
    assert p.handler(client).socket.closed
    [line] = lines_of(p.lines, "tunnel")
    assert line["reason"] == "tunnel_revoked" and "host_denied" in line["detail"]


# ---- its tunnel slot ---------------------------------------------------------------------------


@in_process(POLICY.replace("limits:\n", "limits:\n  max_tunnels: 1\n"), DNS, client=False)
async def test_an_open_pipe_holds_a_tunnel_slot_until_its_connection_ends(p):
    client = await p.connect()
    await pipe(p, client)
    other = await p.connect(port=40001)
    refused = connect_flow(other)
    await p.hook(HttpConnectHook(refused))
    assert refused.response.headers["Sluice-Reason"] == "too_many_tunnels"
    await p.hook(HttpErrorHook(refused))
    await p.disconnect(client)
    again = connect_flow(other)
    await p.hook(HttpConnectHook(again))
    assert again.response is None
    await p.disconnect(other)
    assert p.held() == []


@in_process(POLICY.replace("limits:\n", "limits:\n  max_tunnels: 1\n"), DNS)
async def test_an_upgrade_the_origin_declines_gives_its_tunnel_slot_back(p, client):
    declined = upgrade(client)
    await p.hook(HttpRequestHeadersHook(declined))
    respond(declined, 200, Content_Length="0")
    await p.hook(HttpResponseHeadersHook(declined))
    await p.hook(HttpResponseHook(declined))
    flow = upgrade(client)
    await p.hook(HttpRequestHeadersHook(flow))
    assert flow.response is None  # the slot the declined upgrade took is free again
