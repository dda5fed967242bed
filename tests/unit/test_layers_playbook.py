"""The layers Sluice patches (addons/mitm_patches.py), driven as mitmproxy
runs them: a real `HttpLayer` in regular mode, scripted events in, expected
commands out (tests/harness/playbook.py), with Sluice's own head guard
(addons/head_limits.py) and refusal listener (addons/connection_audit.py).
No proxy, no sockets. Whatever Http1Server the HttpLayer makes (mitmproxy's,
wrapped, or a subclass) is the one under test.

Each test fails with the patch it names left out (checked by hand: install()
without that entry of PATCHES)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
from mitmproxy import connection, http, options
from mitmproxy.addons.proxyserver import Proxyserver
from mitmproxy.connection import ConnectionState
from mitmproxy.proxy import commands, events
from mitmproxy.proxy.context import Context
from mitmproxy.proxy.layers.http import (HttpLayer, HTTPMode, HttpRequestHeadersHook, HttpRequestHook,
                                         HttpResponseHeadersHook, HttpResponseHook, HttpErrorHook)
from mitmproxy.test import taddons

from harness.playbook import Matching, Placeholder, Playbook, reply
from sluice import connstate
from sluice.addons import mitm_patches
from sluice.addons.audit import AuditLog
from sluice.addons.caps import Caps
from sluice.addons.connection_audit import ConnectionAudit
from sluice.addons.gate import EgressGate
from sluice.addons.head_limits import HeadLimits
from sluice.policy.loader import load_policy_text
from sluice.resolver import StaticResolver

POLICY = load_policy_text("""version: 1
methods: [GET, POST]
limits: {max_header_bytes: 1024, max_header_count: 10, header_timeout: 10}
""", "layers.yaml")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Proxy:
    """The head guard, the refusal listener and the gate, set as they load."""

    def __init__(self, monkeypatch) -> None:
        mitm_patches.install()
        self.lines: list[dict] = []
        self.audit = AuditLog()
        self.audit.write = lambda **record: self.lines.append(record)
        resolver = StaticResolver({"public.example": ["8.8.8.8"], "private.example": ["10.1.1.1"]})
        self.source = SimpleNamespace(current=SimpleNamespace(policy=POLICY, resolver=resolver, generation=1),
                                      on_reload=lambda f: None)
        self.head_limits = HeadLimits(self.source, self.audit)
        self.connection_audit = ConnectionAudit(self.audit)
        self.gate = EgressGate(self.source, self.audit, Caps(self.source, self.audit))
        monkeypatch.setattr(mitm_patches.hooks, "head_guard", self.head_limits)
        monkeypatch.setattr(mitm_patches.hooks, "refusal_listener", self.connection_audit)
        self.clock = Clock()
        monkeypatch.setattr(mitm_patches, "_clock", self.clock)
        opts = options.Options()
        Proxyserver().load(opts)  # the options mitmproxy's HTTP layers read
        self.client = connection.Client(peername=("192.0.2.1", 40000), sockname=("127.0.0.1", 8080),
                                        timestamp_start=time.time(), state=ConnectionState.OPEN)
        self.context = Context(self.client, opts)

    def playbook(self) -> Playbook:
        return Playbook(HttpLayer(self.context, HTTPMode.regular))

    def reasons(self) -> list[str]:
        return [line["reason"] for line in self.lines]


@pytest.fixture
def proxy(monkeypatch):
    p = Proxy(monkeypatch)
    yield p
    connstate.pop(p.client)


def in_loop(coroutine_function, *addons):
    """Run the test body in an event loop with a mitmproxy master (the head
    guard schedules its close of the client on the running loop)."""
    async def body():
        with taddons.context(*addons):
            await coroutine_function()
    asyncio.run(body())


def answer(status: int, reason: str) -> Matching:
    """Sluice's raw HTTP/1 refusal: the status, its Sluice-Reason, and Connection: close."""
    def sent(command) -> bool:
        data = getattr(command, "data", b"")
        return (isinstance(command, commands.SendData) and data.startswith(f"HTTP/1.1 {status} ".encode())
                and f"\r\nSluice-Reason: {reason}\r\n".encode() in data and b"\r\nConnection: close\r\n" in data
                and b"mitmproxy" not in data)
    return Matching(sent, f"SendData(client, HTTP/1.1 {status} ... Sluice-Reason: {reason})")


GET = b"GET http://public.example/ HTTP/1.1\r\nHost: public.example\r\n\r\n"


# ---- http1_leading_blank_lines (RFC 9112 2.2) ------------------------------------


def test_a_request_after_leading_empty_lines_is_read_in_the_same_read(proxy):
    flow = Placeholder(http.HTTPFlow)
    assert (proxy.playbook()
            >> events.DataReceived(proxy.client, b"\r\n\r\n\n" + GET)
            << HttpRequestHeadersHook(flow))
    assert flow().request.pretty_url == "http://public.example/" and proxy.lines == []


def test_empty_lines_alone_are_capped_like_a_head(proxy):
    async def run():
        assert (proxy.playbook()
                >> events.DataReceived(proxy.client, b"\r\n" * 1000)  # 2000 bytes, no request line
                << answer(431, "request_headers_too_large")
                << commands.CloseConnection(proxy.client))
    in_loop(run)
    assert proxy.reasons() == ["request_headers_too_large"]


# ---- http1_head_caps -----------------------------------------------------------------


def test_a_head_over_max_header_bytes_is_answered_431_and_never_becomes_a_flow(proxy):
    async def run():
        playbook = (proxy.playbook()
                    >> events.DataReceived(proxy.client, b"GET http://public.example/ HTTP/1.1\r\nX: ")
                    << mitm_patches.HeadDeadline  # incomplete: its header_timeout starts
                    >> events.DataReceived(proxy.client, b"a" * 600)  # 640 bytes: under the cap, waits
                    >> events.DataReceived(proxy.client, b"a" * 600)  # over it, no end of head in sight
                    << answer(431, "request_headers_too_large")
                    << commands.CloseConnection(proxy.client))
        assert playbook
        # What the client still sends before its socket closes is dropped, not parsed or buffered.
        assert playbook >> events.DataReceived(proxy.client, b"a" * 50_000 + b"\r\n\r\n")
    in_loop(run)
    assert proxy.reasons() == ["request_headers_too_large"]
    assert "1 KiB cap (limits.max_header_bytes)" in proxy.lines[0]["detail"]


def test_a_whole_head_with_more_than_max_header_count_fields_is_431(proxy):
    fields = b"".join(b"X-%d: v\r\n" % i for i in range(10))  # and Host: 11 fields
    async def run():
        assert (proxy.playbook()
                >> events.DataReceived(proxy.client, b"GET http://public.example/ HTTP/1.1\r\nHost: a\r\n" + fields
                                       + b"\r\n")
                << answer(431, "request_headers_too_large")
                << commands.CloseConnection(proxy.client))
    in_loop(run)
    assert "more than this proxy's 10 header fields" in proxy.lines[0]["detail"]


def test_a_head_of_exactly_max_header_count_fields_passes(proxy):
    fields = b"".join(b"X-%d: v\r\n" % i for i in range(9))
    assert (proxy.playbook()
            >> events.DataReceived(proxy.client, b"GET http://public.example/ HTTP/1.1\r\nHost: a\r\n" + fields
                                   + b"\r\n")
            << HttpRequestHeadersHook(Placeholder(http.HTTPFlow)))


# ---- http1_head_deadline --------------------------------------------------------------


def test_a_head_still_incomplete_at_header_timeout_is_408_however_it_dribbles(proxy):
    wakeup = Placeholder(mitm_patches.HeadDeadline)

    async def run():
        playbook = (proxy.playbook()
                    >> events.DataReceived(proxy.client, b"GET http://public.example/ HTTP/1.1\r\n")
                    << wakeup)
        assert playbook and wakeup().delay == 10
        proxy.clock.now += 9
        assert playbook >> events.DataReceived(proxy.client, b"X-Slow: 1\r\n")  # no new deadline, no answer
        proxy.clock.now += 1
        assert (playbook
                >> events.Wakeup(wakeup)
                << answer(408, "header_timeout")
                << commands.CloseConnection(proxy.client))
    in_loop(run)
    assert proxy.reasons() == ["header_timeout"]


def test_a_head_completed_in_time_is_never_refused_at_its_deadline(proxy):
    wakeup = Placeholder(mitm_patches.HeadDeadline)
    flow = Placeholder(http.HTTPFlow)
    playbook = (proxy.playbook()
                >> events.DataReceived(proxy.client, b"GET http://public.example/ HTTP/1.1\r\n")
                << wakeup
                >> events.DataReceived(proxy.client, b"Host: public.example\r\n\r\n")
                << HttpRequestHeadersHook(flow))
    assert playbook
    proxy.clock.now += 60
    assert playbook >> events.Wakeup(wakeup)  # nothing: that head was whole in time
    assert proxy.lines == []


# ---- http1_pipeline_cap -------------------------------------------------------------------


def test_a_client_pipelining_past_the_cap_while_a_response_is_pending_is_closed(proxy):
    flow = Placeholder(http.HTTPFlow)
    server = Placeholder(connection.Server)

    async def run():
        playbook = (proxy.playbook()
                    >> events.DataReceived(proxy.client, GET)
                    << HttpRequestHeadersHook(flow)
                    >> reply()
                    << HttpRequestHook(flow)
                    >> reply()
                    << commands.OpenConnection(server)
                    >> reply(None)
                    << commands.SendData(server, b"GET / HTTP/1.1\r\nHost: public.example\r\n\r\n")
                    >> events.DataReceived(proxy.client, GET))  # a little pipelining waits its turn
        assert playbook
        assert (playbook
                >> events.DataReceived(proxy.client, b"X: " + b"a" * 1100)
                << commands.CloseConnection(proxy.client)  # mid-response: nothing can be answered
                << commands.CloseConnection(server)
                << HttpErrorHook(flow)
                >> reply())
    in_loop(run)
    assert proxy.reasons() == ["request_headers_too_large"] and proxy.lines[0]["status"] is None
    assert "of further requests while a response was pending" in proxy.lines[0]["detail"]


# ---- http1_error_pages and http1_bad_head --------------------------------------------------


def test_a_head_mitmproxy_cannot_parse_gets_sluices_400_and_an_audit_line(proxy):
    async def run():
        assert (proxy.playbook()
                >> events.DataReceived(proxy.client, b"NOT HTTP AT ALL\r\n\r\n")
                << answer(400, "bad_request")
                << commands.CloseConnection(proxy.client))
    in_loop(run)
    assert proxy.reasons() == ["bad_request"] and proxy.lines[0]["status"] == 400
    assert "not valid HTTP/1.1" in proxy.lines[0]["detail"]


def test_an_ftp_url_is_refused_for_its_scheme(proxy):
    async def run():
        assert (proxy.playbook()
                >> events.DataReceived(proxy.client, b"GET ftp://public.example/file HTTP/1.1\r\n\r\n")
                << answer(403, "scheme_not_allowed")
                << commands.CloseConnection(proxy.client))
    in_loop(run)
    assert proxy.reasons() == ["scheme_not_allowed"]


# ---- refused_body_discard, with the gate's own hook --------------------------------------------


def test_a_refused_uploads_body_is_dropped_as_it_arrives_and_the_refusal_follows_it(proxy):
    flow = Placeholder(http.HTTPFlow)
    head = b"POST http://private.example/ HTTP/1.1\r\nHost: private.example\r\nContent-Length: 300000\r\n\r\n"

    async def run():
        playbook = (proxy.playbook()
                    >> events.DataReceived(proxy.client, head + b"x" * 1000)
                    << HttpRequestHeadersHook(flow)
                    >> reply(side_effect=proxy.gate.requestheaders)  # refuses: 10.1.1.1 is private
                    >> events.DataReceived(proxy.client, b"x" * 200_000))
        assert await playbook.play()
        assert flow().response.status_code == 403 and not flow().request.data.content  # nothing kept
        assert await (playbook
                      >> events.DataReceived(proxy.client, b"x" * 99_000)
                      << HttpRequestHook(flow)
                      >> reply()
                      << HttpResponseHeadersHook(flow)
                      >> reply()
                      << HttpResponseHook(flow)
                      >> reply()
                      << Matching(lambda c: isinstance(c, commands.SendData) and c.data.startswith(b"HTTP/1.1 403 ")
                                  and b"Sluice-Reason: dns_answer_not_public" in c.data, "the 403's head")
                      << Matching(lambda c: isinstance(c, commands.SendData) and c.data.startswith(b"Sluice refused"),
                                  "its body")
                      ).play()
        assert not flow().request.data.content
    in_loop(run, proxy.gate)
