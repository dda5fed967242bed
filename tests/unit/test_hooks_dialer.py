"""The one dialer (sluice/dialer.py) as the proxy reaches it: the gate's
hooks approve and pin, then mitmproxy's own `ConnectionHandler.open_connection`
(as addons/mitm_patches.py `dial_check` patches it) runs the server_connect
hooks and dials, and the dial goes through Sluice's dialer to the event
loop's FakeNetwork (tests/harness/inprocess.py): nothing leaves the process.
Each step refuses before the next runs: the pin, the loop check, the
upstream room, the connect timeout, the peer check; then the tunnel and
quota slots and meters a tunnel gets, and the route through a parent proxy.
(The dialer alone, with its own fakes: tests/unit/test_dialer.py.)"""

from __future__ import annotations

import asyncio

from mitmproxy import connection
from mitmproxy.proxy.layers.http import HttpConnectHook, HttpErrorHook, HttpRequestHeadersHook
from mitmproxy.test import tflow

from harness.inprocess import (BLACKHOLE, Accept, InProcess, advance_loop, answered, connect_flow, in_process,
                               lines_of, policy, request_flow)
from sluice.dialer import UPSTREAMS_BUSY, MeteredReader, MeteredWriter

POLICY = """version: 1
methods: [GET, POST, CONNECT]
limits:
  connect_timeout: 5
"""
DNS = {"public.example": ["8.8.8.8"], "other.example": ["1.1.1.1"]}
PARENT = ("10.0.0.9", 3128)
PARENT_POLICY = POLICY + f"upstream_proxy: {{url: 'http://{PARENT[0]}:{PARENT[1]}'}}\n"


async def allowed(p: InProcess, client: connection.Client, host: str = "public.example"):
    """An allowed plain-HTTP request the gate pinned, with the server
    connection mitmproxy addresses from the (rewritten) request."""
    flow = request_flow(client, host)
    await p.hook(HttpRequestHeadersHook(flow))
    assert flow.response is None, flow.response
    flow.server_conn = connection.Server(address=(flow.request.host, flow.request.port))
    return flow


async def tunnel(p: InProcess, client: connection.Client):
    """An allowed CONNECT: its server connection addressed as mitmproxy
    addresses it after the hook, from the (pinned) request."""
    flow = connect_flow(client)
    await p.hook(HttpConnectHook(flow))
    assert flow.response is None, flow.response
    flow.server_conn.address = (flow.request.host, flow.request.port)
    return flow


async def failed(p: InProcess, flow) -> None:
    """mitmproxy ends an exchange whose dial failed with its error hook."""
    flow.error = tflow.terr(f"Connection killed: {flow.server_conn.error}")
    await p.hook(HttpErrorHook(flow))


async def settled(task: asyncio.Task, seconds: float = 0.5) -> bool:
    """Whether `task` is done once what is due has run (the loop's clock is
    not moved here: `seconds` only bounds the hooks and callbacks that run)."""
    await asyncio.wait({task}, timeout=seconds)
    return task.done()


def refused_dials(p: InProcess) -> list[dict]:
    return [line for line in lines_of(p.lines, "connect") if line["decision"] == "refuse"]


# ---- the pin ---------------------------------------------------------------------------


@in_process(POLICY, DNS)
async def test_the_pinned_address_is_what_is_dialled(p, client):
    flow = await allowed(p, client)
    assert await p.dial(client, flow.server_conn) is None
    assert p.network.dialled == [("8.8.8.8", 80)]
    assert flow.server_conn.peername == ("8.8.8.8", 80) and refused_dials(p) == []


@in_process(POLICY, DNS)
async def test_an_address_changed_after_the_hooks_is_never_dialled_pin_mismatch(p, client):
    """mitmproxy reads the server's address again after server_connect: what
    it dials is checked at the dial itself, a name or another IP alike."""
    for changed in (("1.1.1.1", 80), ("public.example", 80), ("8.8.8.8", 8080)):
        flow = await allowed(p, client)

        async def rewrite(server, changed=changed):
            server.address = changed
        p.handler(client).between = rewrite
        error = await p.dial(client, flow.server_conn)
        assert error.startswith(f"pin_mismatch: Sluice refused to dial {changed[0]}:{changed[1]}"), error
    assert p.network.dialled == []  # not one connect, not one lookup
    assert [line["reason"] for line in refused_dials(p)] == ["pin_mismatch"] * 3
    assert "was not approved for this client connection" in refused_dials(p)[0]["detail"]


@in_process(POLICY, DNS)
async def test_an_address_that_became_the_proxys_own_since_the_decision_is_a_loop(p, client):
    flow = await allowed(p, client)
    p.source.reload(policy(POLICY + "proxy_addresses: [8.8.8.8]\n"))
    error = await p.dial(client, flow.server_conn)
    assert error.startswith("pin_mismatch: ") and p.network.dialled == []
    [line] = refused_dials(p)
    assert line["reason"] == "proxy_loop" and "refused before connecting" in line["detail"]


# ---- the connect and the peer ----------------------------------------------------------------


@in_process(POLICY, DNS)
async def test_a_blackholed_origin_is_given_up_at_connect_timeout_and_answered_504(p, client):
    flow = await allowed(p, client)
    p.network.answers[("8.8.8.8", 80)] = BLACKHOLE
    task = asyncio.ensure_future(p.dial(client, flow.server_conn))
    await p.network.reached()
    await advance_loop(3.5)  # (the loop's clock also runs on in real time: 1.5 s of slack)
    assert not await settled(task)
    await advance_loop(2)
    assert await settled(task) and await task == "connect_timeout: 8.8.8.8 did not accept a connection within 5s"
    await failed(p, flow)
    assert answered(p, client, 504, "connect_timeout")
    [line] = lines_of(p.lines, "request")
    assert line["reason"] == "connect_timeout" and "within 5s" in line["detail"]


@in_process(POLICY, DNS)
async def test_the_connect_timeout_counts_from_the_start_of_the_dial_hooks_included(p, client):
    flow = await allowed(p, client)
    p.network.answers[("8.8.8.8", 80)] = BLACKHOLE

    async def slow_hooks(server):
        await advance_loop(3)  # the server_connect hooks and the slot wait took 3 of the 5 s
    p.handler(client).between = slow_hooks
    task = asyncio.ensure_future(p.dial(client, flow.server_conn))
    await p.network.reached()
    await advance_loop(0.5)  # (the loop's clock also runs on in real time: 1.5 s of slack)
    assert not await settled(task)
    await advance_loop(2)  # 2.5 s after the connect began, 5.5 s after the dial did
    assert await settled(task) and (await task).startswith("connect_timeout: ")


@in_process(POLICY, DNS)
async def test_a_socket_whose_peer_is_not_the_pin_is_aborted_before_a_byte_and_the_client_closed(p, client):
    flow = await allowed(p, client)
    p.network.answers[("8.8.8.8", 80)] = Accept(peer=("10.0.0.7", 80))
    error = await p.dial(client, flow.server_conn)
    assert error.startswith("pin_mismatch: the upstream connection's peer ('10.0.0.7', 80)"), error
    [transport] = p.network.transports
    assert transport.aborted and bytes(transport.sent) == b""
    await advance_loop(0)
    assert p.handler(client).socket.closed
    [line] = refused_dials(p)
    assert line["reason"] == "pin_mismatch" and "peer ('10.0.0.7', 80)" in line["detail"]


# ---- room, slots and meters ------------------------------------------------------------------


@in_process(POLICY.replace("limits:\n", "limits:\n  max_upstreams_per_connection: 1\n"), DNS)
async def test_no_room_for_another_upstream_is_refused_before_connecting_and_answered_429(p, client):
    first = await allowed(p, client)
    assert await p.dial(client, first.server_conn) is None  # an exchange in flight on it: not idle
    second = await allowed(p, client, "other.example")
    error = await p.dial(client, second.server_conn)
    assert UPSTREAMS_BUSY in error and p.network.dialled == [("8.8.8.8", 80)]
    await failed(p, second)
    assert answered(p, client, 429, "too_many_connections")


@in_process(POLICY.replace("limits:\n", "limits:\n  max_upstreams_per_connection: 1\n"), DNS)
async def test_a_closed_upstream_gives_its_room_back(p, client):
    first = await allowed(p, client)
    assert await p.dial(client, first.server_conn) is None
    p.handler(client).close_connection(first.server_conn)
    await advance_loop(0)  # its handler runs server_disconnected
    second = await allowed(p, client, "other.example")
    assert await p.dial(client, second.server_conn) is None
    assert p.network.dialled == [("8.8.8.8", 80), ("1.1.1.1", 80)]


@in_process(POLICY + "  max_tunnels: 1\n", DNS, client=False)
async def test_a_socks5_dial_over_max_tunnels_never_reaches_the_network(p):
    first = await p.connect(mode="socks5")
    assert await p.dial(first, connection.Server(address=("public.example", 443))) is None
    second = await p.connect(mode="socks5", port=40001)
    error = await p.dial(second, connection.Server(address=("other.example", 443)))
    assert error.startswith("Connection killed: too_many_tunnels: "), error
    assert p.network.dialled == [("8.8.8.8", 443)]
    [line] = refused_dials(p)
    assert line["reason"] == "too_many_tunnels" and line["host"] == "other.example"


@in_process(POLICY + "  tunnel_max_bytes: 1000\n  bytes_per_hour: 1500\n", DNS)
async def test_a_tunnels_streams_are_metered_by_its_byte_cap_and_its_transfer_quota(p, client):
    flow = await tunnel(p, client)
    assert await p.dial(client, flow.server_conn) is None
    io = p.handler(client).transports[flow.server_conn]
    assert isinstance(io.reader, MeteredReader) and isinstance(io.writer, MeteredWriter)
    [upstream] = p.network.transports
    io.writer.write(b"a" * 600)
    io.writer.write(b"b" * 600)  # the tunnel cap: 1000 bytes towards the origin
    assert bytes(upstream.sent) == b"a" * 600 + b"b" * 400
    await advance_loop(0)
    assert p.handler(client).socket.closed
    [line] = lines_of(p.lines, "tunnel")
    assert line["reason"] == "tunnel_too_large" and line["bytes_out"] == 1000


@in_process(POLICY + "  bytes_per_hour: 500\n", DNS)
async def test_a_tunnels_transfer_quota_cuts_it_where_the_hour_runs_out(p, client):
    flow = await tunnel(p, client)
    assert await p.dial(client, flow.server_conn) is None
    io = p.handler(client).transports[flow.server_conn]
    [upstream] = p.network.transports
    io.writer.write(b"a" * 800)
    assert bytes(upstream.sent) == b"a" * 500
    await advance_loop(0)
    [line] = lines_of(p.lines, "tunnel")
    assert line["reason"] == "quota_exceeded" and p.handler(client).socket.closed


# ---- a parent proxy --------------------------------------------------------------------------


@in_process(PARENT_POLICY, DNS)
async def test_with_a_parent_the_dial_connects_to_it_and_asks_for_the_pinned_ip_never_the_name(p, client):
    p.network.answers[PARENT] = Accept(reply=b"HTTP/1.1 200 Connection established\r\n\r\n")
    flow = await allowed(p, client)
    assert await p.dial(client, flow.server_conn) is None
    assert p.network.dialled == [PARENT]
    [parent] = p.network.transports
    assert bytes(parent.sent) == b"CONNECT 8.8.8.8:80 HTTP/1.1\r\nHost: 8.8.8.8:80\r\n\r\n"


@in_process(PARENT_POLICY, DNS)
async def test_a_parent_that_refuses_the_connect_is_upstream_proxy_failed_answered_502(p, client):
    p.network.answers[PARENT] = Accept(reply=b"HTTP/1.1 407 Proxy Authentication Required\r\n\r\n")
    flow = await allowed(p, client)
    error = await p.dial(client, flow.server_conn)
    assert error == ("upstream_proxy_failed: the parent proxy http://10.0.0.9:3128 answered 'HTTP/1.1 407 Proxy "
                     "Authentication Required' (wrong or missing upstream_proxy.credentials) to CONNECT 8.8.8.8:80")
    [parent] = p.network.transports
    assert parent.aborted
    await failed(p, flow)
    assert answered(p, client, 502, "upstream_proxy_failed")


@in_process(PARENT_POLICY, DNS)
async def test_a_parent_socket_whose_peer_is_not_the_parent_is_aborted_before_the_connect(p, client):
    p.network.answers[PARENT] = Accept(peer=("10.0.0.8", 3128))
    flow = await allowed(p, client)
    error = await p.dial(client, flow.server_conn)
    assert error.startswith("pin_mismatch: the upstream connection's peer ('10.0.0.8', 3128)"), error
    [parent] = p.network.transports
    assert parent.aborted and bytes(parent.sent) == b""  # no CONNECT, no credentials
