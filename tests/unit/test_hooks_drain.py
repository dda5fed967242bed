"""The graceful drain in process (addons/drain.py), through the addon chain
(tests/harness/inprocess.py): on the signal the listeners close (no new
connection is accepted) and readiness turns 503 before anything waits;
exchanges, tunnels and WebSocket pipes in flight get the drain timeout and
finish untouched; at the deadline (or a second signal) what is left is cut
with `shutdown`, each with its line, idle connections are closed, and the
master is told to exit. The drain's clock is the event loop's, moved on with
advance_loop, never slept for. No proxy is spawned."""

from __future__ import annotations

import asyncio

from mitmproxy.proxy.layers.http import (HttpConnectHook, HttpRequestHeadersHook, HttpResponseHeadersHook,
                                         HttpResponseHook)
from mitmproxy.proxy.layers.tcp import TcpStartHook
from mitmproxy.test import tflow

from harness.inprocess import (InProcess, advance_loop, answered, connect_flow, in_process, lines_of, request_flow,
                               respond)

POLICY = """version: 1
methods: [GET, CONNECT]
"""
DNS = {"public.example": ["8.8.8.8"]}
TIMEOUT = 10.0


class Listener:
    """One of mitmproxy's server instances, as the drain stops it."""

    def __init__(self, fails: bool = False) -> None:
        self.stopped, self.fails = False, fails
        self.mode = type("Mode", (), {"description": "HTTP(S) proxy"})()

    async def stop(self) -> None:
        self.stopped = True
        if self.fails:
            raise OSError("the socket would not close")


async def draining(p: InProcess, *listeners: Listener) -> None:
    """The first SIGTERM, with `listeners` up and the drain timeout TIMEOUT."""
    p.proxyserver.servers[:] = listeners
    p.drain.timeout = TIMEOUT
    p.drain.signal()
    await advance_loop(0)


async def stopped(p: InProcess, seconds: float = 0.5) -> bool:
    """Whether the drain finished (it told the master to exit) once what is
    due has run. The loop's clock is not moved here: `seconds` only bounds
    the callbacks that run, and is slack under the drain timeout."""
    try:
        await asyncio.wait_for(p.master.should_exit.wait(), seconds)
    except TimeoutError:
        pass
    return p.master.should_exit.is_set()


async def in_flight(p: InProcess, client):
    flow = request_flow(client)
    await p.hook(HttpRequestHeadersHook(flow))
    assert flow.response is None, flow.response
    return flow


async def tunnel(p: InProcess, client):
    flow = connect_flow(client)
    await p.hook(HttpConnectHook(flow))
    assert flow.response is None, flow.response
    return flow


@in_process(POLICY, DNS)
async def test_the_listeners_close_and_readiness_turns_503_before_the_wait(p, client):
    await in_flight(p, client)
    listeners = Listener(), Listener(fails=True), Listener()  # one that will not close stops nothing
    await draining(p, *listeners)
    assert all(listener.stopped for listener in listeners)  # no new connection is accepted
    assert p.drained == [True]  # Status: /readyz says 503 draining
    assert not await stopped(p) and not p.handler(client).socket.closed  # the exchange in flight still runs


@in_process(POLICY, DNS)
async def test_an_exchange_in_flight_finishes_and_then_the_drain_ends_with_nothing_cut(p, client):
    flow = await in_flight(p, client)
    await draining(p)
    await advance_loop(TIMEOUT - 2)
    assert not await stopped(p)
    respond(flow, Content_Length="0")
    await p.hook(HttpResponseHeadersHook(flow))
    await p.hook(HttpResponseHook(flow))
    await advance_loop(0.1)  # the drain's next look
    assert await stopped(p)
    [line] = lines_of(p.lines, "request")
    assert line["decision"] == "allow" and line["reason"] is None
    socket = p.handler(client).socket
    assert socket.closed and bytes(socket.sent) == b""  # closed once idle, never answered


@in_process(POLICY, DNS, client=False)
async def test_at_the_deadline_what_is_still_open_is_cut_shutdown_with_its_line(p):
    waiting, tunnelled = await p.connect(), await p.connect(port=40001)
    await in_flight(p, waiting)
    await tunnel(p, tunnelled)
    await draining(p)
    await advance_loop(TIMEOUT - 2)
    assert not await stopped(p) and not p.handler(waiting).socket.closed and not p.handler(tunnelled).socket.closed
    await advance_loop(3)
    assert await stopped(p)
    assert answered(p, waiting, 503, "shutdown")  # its response had not started
    assert p.handler(tunnelled).socket.closed
    [line] = lines_of(p.lines, "tunnel")
    assert line["reason"] == "shutdown" and f"drain timeout {TIMEOUT:g}s" in line["detail"]


@in_process(POLICY, DNS, client=False)
async def test_an_open_websocket_pipe_is_waited_for_and_cut_like_a_tunnel(p):
    client = await p.connect()
    upgrade = request_flow(client, Upgrade="websocket", Connection="Upgrade")
    await p.hook(HttpRequestHeadersHook(upgrade))
    respond(upgrade, 101, Upgrade="websocket", Connection="Upgrade")
    await p.hook(HttpResponseHeadersHook(upgrade))
    await p.hook(HttpResponseHook(upgrade))
    await p.hook(TcpStartHook(tflow.ttcpflow(client_conn=client, server_conn=upgrade.server_conn, messages=[])))
    await draining(p)
    await advance_loop(TIMEOUT - 2)
    assert not await stopped(p) and not p.handler(client).socket.closed
    await advance_loop(3)
    assert await stopped(p) and p.handler(client).socket.closed
    [line] = lines_of(p.lines, "tunnel")
    assert line["reason"] == "shutdown"


@in_process(POLICY, DNS)
async def test_a_second_signal_cuts_everything_at_once(p, client):
    await in_flight(p, client)
    await draining(p)
    assert not await stopped(p)
    p.drain.signal()
    await advance_loop(0)
    assert await stopped(p) and answered(p, client, 503, "shutdown")


@in_process(POLICY, DNS)
async def test_with_nothing_in_flight_idle_connections_are_closed_at_once_without_a_line(p, client):
    await draining(p)
    await advance_loop(0)
    assert await stopped(p)
    socket = p.handler(client).socket
    assert socket.closed and bytes(socket.sent) == b"" and p.lines == []

