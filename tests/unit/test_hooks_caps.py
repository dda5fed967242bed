"""The size and time caps' hooks in process (addons/caps.py), through the
addon chain (tests/harness/inprocess.py): each cap trips with its reason
code, the client's answer and the audit line, and frees the connection.
Timers run on the event loop's clock, moved on with advance_loop, never
slept for. No proxy is spawned."""

from __future__ import annotations

from mitmproxy.proxy.layers.http import (HttpConnectHook, HttpErrorHook, HttpRequestHeadersHook,
                                         HttpResponseHeadersHook, HttpResponseHook)
from mitmproxy.proxy.server_hooks import ServerConnectErrorHook, ServerConnectionHookData
from mitmproxy.test import tflow

from harness.inprocess import advance_loop, answered, connect_flow, in_process, lines_of, request_flow, respond
from sluice.addons.gate import tunnel_of
from sluice.outcome import outcome_of

POLICY = """version: 1
methods: [GET, POST, CONNECT]
limits:
  max_request_bytes: 1000
  max_response_bytes: 1000
  request_timeout: 30
  tunnel_max_seconds: 60
  tunnel_max_bytes: 1000
  header_timeout: 10
"""
DNS = {"public.example": ["8.8.8.8"]}


@in_process(POLICY, DNS)
async def test_a_request_body_declared_over_the_cap_is_refused_before_it_is_read(p, client):
    flow = request_flow(client, method=b"POST", Content_Length="5000")
    await p.hook(HttpRequestHeadersHook(flow))
    assert outcome_of(flow).cap.reason.value == "request_too_large"
    assert answered(p, client, 413, "request_too_large")
    assert flow.error is not None  # killed: mitmproxy reads no body, dials nothing
    await p.hook(HttpErrorHook(flow))
    [line] = lines_of(p.lines, "request")
    assert line["reason"] == "request_too_large" and line["status"] == 413
    assert "5000 bytes, over this policy's 1000 bytes cap" in line["detail"]


@in_process(POLICY, DNS)
async def test_a_response_declared_over_the_cap_is_refused_at_its_headers(p, client):
    flow = request_flow(client)
    await p.hook(HttpRequestHeadersHook(flow))
    respond(flow, Content_Length="2000")
    await p.hook(HttpResponseHeadersHook(flow))
    assert answered(p, client, 502, "response_too_large")
    assert outcome_of(flow).cap.reason.value == "response_too_large"


@in_process(POLICY, DNS)
async def test_a_streamed_response_is_cut_at_the_byte_the_cap_allows(p, client):
    flow = request_flow(client)
    await p.hook(HttpRequestHeadersHook(flow))
    respond(flow, Transfer_Encoding="chunked")
    await p.hook(HttpResponseHeadersHook(flow))
    stream = flow.response.stream
    assert callable(stream)  # counted chunk by chunk, never buffered whole
    assert stream(b"a" * 600) == b"a" * 600
    assert stream(b"b" * 600) == b"b" * 400  # the 1000th byte is the last to pass
    assert outcome_of(flow).cap.reason.value == "response_too_large"
    await advance_loop(0)  # the cut closes the connection just after the chunk
    socket = p.handler(client).socket
    assert socket.closed and bytes(socket.sent) == b""  # the response had started: closed, not answered
    assert stream(b"c" * 10) == [] and stream(b"") == []  # nothing after, not even the final chunk
    [line] = lines_of(p.lines, "request")
    assert line["reason"] == "response_too_large" and line["bytes_in"] == 1000


@in_process(POLICY, DNS)
async def test_a_response_under_the_cap_passes_whole(p, client):
    flow = request_flow(client)
    await p.hook(HttpRequestHeadersHook(flow))
    respond(flow, Transfer_Encoding="chunked")
    await p.hook(HttpResponseHeadersHook(flow))
    assert flow.response.stream(b"a" * 1000) == b"a" * 1000
    assert flow.response.stream(b"") == b""
    await p.hook(HttpResponseHook(flow))
    [line] = lines_of(p.lines, "request")
    assert line["decision"] == "allow" and line["reason"] is None and line["bytes_in"] == 1000
    assert not p.handler(client).socket.closed


@in_process(POLICY, DNS)
async def test_an_exchange_over_its_request_timeout_is_answered_504(p, client):
    flow = request_flow(client)
    await p.hook(HttpRequestHeadersHook(flow))
    await advance_loop(29)
    assert outcome_of(flow).cap is None
    await advance_loop(2)
    assert answered(p, client, 504, "request_timeout")
    [line] = lines_of(p.lines, "request")
    assert line["reason"] == "request_timeout" and "30s request timeout" in line["detail"]


@in_process(POLICY, DNS)
async def test_a_finished_exchange_is_never_cut_by_its_timer(p, client):
    flow = request_flow(client)
    await p.hook(HttpRequestHeadersHook(flow))
    respond(flow, Content_Length="0")
    await p.hook(HttpResponseHeadersHook(flow))
    await p.hook(HttpResponseHook(flow))
    await advance_loop(31)
    assert outcome_of(flow).cap is None and not p.handler(client).socket.closed




@in_process(POLICY, DNS)
async def test_a_tunnel_is_cut_at_tunnel_max_seconds_even_if_it_never_carried_a_byte(p, client):
    flow = connect_flow(client)
    await p.hook(HttpConnectHook(flow))
    await advance_loop(59)
    assert not p.handler(client).socket.closed
    await advance_loop(2)
    assert p.handler(client).socket.closed
    [line] = lines_of(p.lines, "tunnel")
    assert line["reason"] == "tunnel_timeout" and line["decision"] == "refuse"
    assert "60s tunnel cap" in line["detail"]


@in_process(POLICY, DNS)
async def test_a_tunnels_meter_passes_bytes_up_to_tunnel_max_bytes_in_each_direction(p, client):
    flow = connect_flow(client)
    await p.hook(HttpConnectHook(flow))
    [meter] = p.gate.dialer.meter_for(client, flow.server_conn)  # the caps' meter on its server socket
    assert meter(True, 1000) == 1000  # the client's direction: at the cap, not over
    assert meter(False, 600) == 600
    assert meter(False, 600) == 400
    await advance_loop(0)
    tunnel = tunnel_of(client, flow.server_conn)
    assert tunnel.cap.reason.value == "tunnel_too_large" and p.handler(client).socket.closed
    assert meter(True, 1) == 0  # cut: nothing more either way
    [line] = lines_of(p.lines, "tunnel")
    assert (line["reason"], line["bytes_out"], line["bytes_in"]) == ("tunnel_too_large", 1000, 1000)


@in_process(POLICY, DNS)
async def test_a_dial_that_timed_out_answers_its_exchange_504_connect_timeout(p, client):
    flow = request_flow(client)
    await p.hook(HttpRequestHeadersHook(flow))
    flow.server_conn.address = ("8.8.8.8", 80)
    flow.server_conn.error = "connect_timeout: 8.8.8.8 did not accept a connection within 10s"
    await p.hook(ServerConnectErrorHook(ServerConnectionHookData(server=flow.server_conn, client=client)))
    flow.error = tflow.terr("Connection killed")
    await p.hook(HttpErrorHook(flow))
    assert answered(p, client, 504, "connect_timeout")
    [line] = lines_of(p.lines, "request")
    assert line["reason"] == "connect_timeout" and "within 10s" in line["detail"]


@in_process(POLICY, DNS, client=False)
async def test_a_connection_that_sends_no_head_within_header_timeout_of_accept_is_answered_408(p):
    idle = await p.connect(head=False)
    busy = await p.connect(port=40001)  # its head arrived: that deadline is met
    await advance_loop(11)
    assert answered(p, idle, 408, "header_timeout") and p.handler(idle).socket.closed
    assert not p.handler(busy).socket.closed
    [line] = lines_of(p.lines, "connection")
    assert line["reason"] == "header_timeout" and line["status"] == 408
    assert "within this proxy's 10s of connecting" in line["detail"]
