"""The quotas' hooks in process (addons/quotas.py), through the addon chain
(tests/harness/inprocess.py): each limit refuses with its reason code, its
429 and an honest Retry-After, and gives back what it counted. Time is the
quotas' injected clock, moved on by the test: nothing sleeps, and every test
builds its own counters, so none depends on another having run."""

from __future__ import annotations

import asyncio

from mitmproxy import connection
from mitmproxy.proxy.layers.http import (HttpConnectHook, HttpErrorHook, HttpRequestHeadersHook, HttpRequestHook,
                                         HttpResponseHeadersHook, HttpResponseHook)
from mitmproxy.proxy.server_hooks import ServerConnectHook, ServerConnectionHookData

from harness.inprocess import InProcess, connect_flow, in_process, lines_of, request_flow, respond
from sluice.addons.gate import SOCKS5_NOT_ALLOWED
from sluice.outcome import outcome_of

DNS = {"public.example": ["8.8.8.8"], "other.example": ["1.1.1.1"]}


def limits(text: str, extra: str = "") -> str:
    """A policy with these `limits` (and `extra` lines after them)."""
    return f"version: 1\nmethods: [GET, POST, CONNECT]\nlimits: {{{text}}}\n{extra}"


async def ask(p: InProcess, flow) -> tuple[int | None, str | None, str | None]:
    """The request's own answer, if Sluice made one: (status, Sluice-Reason, Retry-After)."""
    await p.hook(HttpRequestHeadersHook(flow))
    response = flow.response
    if response is None:
        return None, None, None
    return response.status_code, response.headers.get("Sluice-Reason"), response.headers.get("Retry-After")


@in_process(limits("requests_per_second: 1, burst: 2"), DNS)
async def test_over_the_request_rate_is_429_until_the_bucket_refills(p, client):
    assert [await ask(p, request_flow(client)) for _ in range(2)] == [(None, None, None)] * 2
    over = request_flow(client)
    assert await ask(p, over) == (429, "rate_limited", "1")
    assert "rate limit of 1 requests a second (bursts of 2)" in over.response.get_text()
    await p.hook(HttpResponseHook(over))
    [line] = [line for line in lines_of(p.lines, "request") if line["decision"] == "refuse"]
    assert (line["reason"], line["status"]) == ("rate_limited", 429)
    other = await p.connect(source="192.0.2.20")  # another client has its own bucket
    assert await ask(p, request_flow(other)) == (None, None, None)
    p.clock.now += 1
    assert await ask(p, request_flow(client)) == (None, None, None)  # one token back a second
    assert (await ask(p, request_flow(client)))[1] == "rate_limited"


@in_process(limits("max_requests_per_host_per_minute: 2"), DNS)
async def test_the_per_host_rate_counts_each_host_apart(p, client):
    assert [(await ask(p, request_flow(client)))[0] for _ in range(2)] == [None, None]
    assert await ask(p, request_flow(client)) == (429, "host_rate_limited", "30")
    assert (await ask(p, request_flow(client, "other.example")))[0] is None
    p.clock.now += 30
    assert (await ask(p, request_flow(client)))[0] is None


@in_process(limits("bytes_per_hour: 1000"), DNS)
async def test_bytes_per_hour_is_charged_as_bodies_stream_and_cuts_where_it_runs_out(p, client):
    first = request_flow(client)
    assert (await ask(p, first))[0] is None
    respond(first, 200, Transfer_Encoding="chunked")
    await p.hook(HttpResponseHeadersHook(first))
    assert first.response.stream(b"a" * 600) == b"a" * 600
    assert first.response.stream(b"b" * 600) == b"b" * 400  # the quota's last byte
    assert outcome_of(first).cap.reason.value == "quota_exceeded"
    await asyncio.sleep(0)  # the cut closes the connection just after the chunk
    assert p.handler(client).socket.closed
    later = await p.connect(port=40001)
    status, reason, retry = await ask(p, request_flow(later))
    assert (status, reason) == (429, "quota_exceeded") and 3500 <= int(retry) <= 3600
    p.clock.now += 3600
    assert (await ask(p, request_flow(later)))[0] is None  # the hour is over: a new allowance


@in_process(limits("bytes_per_hour: 1000"), DNS)
async def test_a_buffered_upload_that_does_not_fit_is_refused_before_it_goes_upstream(p, client):
    upload = request_flow(client, method=b"POST", content=b"u" * 1200)
    assert (await ask(p, upload))[0] is None  # its head: nothing charged yet
    await p.hook(HttpRequestHook(upload))  # mitmproxy read the body whole: charged now, and refused
    assert upload.response.status_code == 429
    assert upload.response.headers["Sluice-Reason"] == "quota_exceeded"
    assert "1200-byte body does not fit" in upload.response.get_text()
    assert "(1000 bytes left)" in upload.response.get_text()  # the refused body was not charged
    fits = request_flow(client, method=b"POST", content=b"u" * 900)
    assert (await ask(p, fits))[0] is None
    await p.hook(HttpRequestHook(fits))
    assert fits.response is None  # sent, and charged
    over = request_flow(client, method=b"POST", content=b"u" * 200)
    await ask(p, over)
    await p.hook(HttpRequestHook(over))
    assert "(100 bytes left)" in over.response.get_text()


@in_process(limits("max_tunnels: 1"), DNS)
async def test_max_tunnels_refuses_the_extra_connect_and_a_closed_tunnel_gives_its_slot_back(p, first_client):
    first = connect_flow(first_client)
    await p.hook(HttpConnectHook(first))
    assert first.response is None
    second_client = await p.connect(port=40001)
    extra = connect_flow(second_client)
    await p.hook(HttpConnectHook(extra))
    assert extra.response.status_code == 429
    assert extra.response.headers["Sluice-Reason"] == "too_many_tunnels"
    await p.hook(HttpErrorHook(extra))
    await p.disconnect(first_client)
    again = connect_flow(second_client)
    await p.hook(HttpConnectHook(again))
    assert again.response is None
    await p.disconnect(second_client)
    assert p.held() == []  # every connection and tunnel slot given back


@in_process(limits("max_tunnels: 1"), DNS)
async def test_a_websocket_upgrade_takes_a_tunnel_slot_before_it_goes_upstream(p, client):
    open_tunnel = connect_flow(client)
    await p.hook(HttpConnectHook(open_tunnel))
    upgrade = request_flow(client, Upgrade="websocket", Connection="Upgrade")
    assert await ask(p, upgrade) == (429, "too_many_tunnels", None)  # no 101 is ever asked for


@in_process(limits("max_connections: 1"), DNS)
async def test_max_connections_refuses_the_extra_connections_first_request_with_connection_close(p, kept):
    assert (await ask(p, request_flow(kept)))[0] is None
    extra = await p.connect(port=40001)
    flow = request_flow(extra)
    assert await ask(p, flow) == (429, "too_many_connections", None)
    assert flow.response.headers["Connection"] == "close"
    assert "already has 1 connections open" in flow.response.get_text()
    assert (await ask(p, request_flow(kept)))[0] is None  # the first is untouched
    await p.disconnect(kept)
    await p.disconnect(extra)
    fresh = await p.connect(port=40002)
    assert (await ask(p, request_flow(fresh)))[0] is None


@in_process(limits("max_total_connections: 2"), DNS, client=False)
async def test_max_total_connections_closes_the_extra_connection_at_accept(p):
    held = [await p.connect(source=source) for source in ("192.0.2.30", "192.0.2.31")]
    extra = await p.connect(source="192.0.2.32")
    assert extra.error.startswith("too_many_connections: ")  # mitmproxy closes it before reading
    assert all(client.error is None for client in held)
    [line] = lines_of(p.lines, "connection")
    assert line["reason"] == "too_many_connections" and "max_total_connections" in line["detail"]


@in_process(limits("requests_per_second: 0.5, burst: 1"), DNS, client=False)
async def test_a_socks5_tunnel_over_the_rate_gets_the_refusal_reply_and_its_line(p):
    results = []
    for port in (40000, 40001):
        client = await p.connect(mode="socks5", port=port)
        server = connection.Server(address=("8.8.8.8", 443))
        await p.hook(ServerConnectHook(ServerConnectionHookData(server=server, client=client)))
        results.append((server.error, bytes(p.handler(client).socket.sent)))
    assert results[0] == (None, b"")
    error, reply = results[1]
    assert error.startswith("rate_limited: ") and reply == SOCKS5_NOT_ALLOWED
    [line] = lines_of(p.lines, "connect")
    assert (line["reason"], line["decision"], line["host"]) == ("rate_limited", "refuse", "8.8.8.8")


@in_process(limits("requests_per_second: 1, burst: 1", "action: report\n"), DNS)
async def test_in_report_mode_a_limit_records_would_refuse_and_refuses_nothing(p, client):
    flows = [request_flow(client) for _ in range(2)]
    for flow in flows:
        assert (await ask(p, flow))[0] is None
    decision = outcome_of(flows[1]).decision
    assert decision.allowed and decision.would_refuse.reason.value == "rate_limited"
    assert outcome_of(flows[0]).decision.would_refuse is None
