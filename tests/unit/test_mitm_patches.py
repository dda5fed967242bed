"""addons/mitm_patches.py: the patched mitmproxy code is the code we read, and
the patches do what they say, driven through a real Http1Server layer (no
network: events in, commands out)."""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import importlib.metadata
import inspect
import time

import pytest
from mitmproxy import connection, options
from mitmproxy.proxy import commands, events
from mitmproxy.proxy.context import Context
from mitmproxy.proxy.layers.http._base import ReceiveHttp
from mitmproxy.proxy.layers.http._events import (RequestHeaders, RequestProtocolError, ResponseEndOfMessage,
                                                 ResponseHeaders)
from mitmproxy.proxy.layers.http._http1 import Http1Server
from mitmproxy import http

from sluice.addons import mitm_patches
from sluice.policy.model import Limits

# sha256 (first 16 hex digits) of inspect.getsource() of every mitmproxy
# function a patch wraps or relies on, as shipped in MITMPROXY_VERSION.
RECORDED = {
    "mitmproxy.hooks:Hook.args": "5bab95f7aa358e18",
    "mitmproxy.http:MessageData.__post_init__": "f65088e210cd9cc1",
    "mitmproxy.utils.typecheck:check_option_type": "b60e47c7091fa795",
    "mitmproxy.addonmanager:AddonManager.handle_lifecycle": "38c97e792d1db5b7",
    "mitmproxy.proxy.layers.http:HttpLayer._handle_event": "6ba31883cc7a06b3",
    "mitmproxy.proxy.layers.http._http1:Http1Server.__init__": "508efbb58d5dead1",
    "mitmproxy.proxy.layers.http._http1:Http1Server.read_headers": "3fe0945216bcf7bc",
    "mitmproxy.proxy.layers.http._http1:Http1Connection.start": "888ce41383823cf2",
    "mitmproxy.proxy.layers.http._http1:Http1Connection.mark_done": "dc5ed395ce4f0763",
    "mitmproxy.proxy.layers.http._http1:Http1Server.mark_done": "94fd7ea388c88671",
    "h11._receivebuffer:ReceiveBuffer.maybe_extract_lines": "435e54e6db463e31",
    "mitmproxy.proxy.layers.http._http1:Http1Connection._handle_event": "2ac8db3e43ae743f",
    "mitmproxy.proxy.layers.http:HttpLayer.event_to_child": "1095f6e1581d1780",
    "mitmproxy.proxy.layers.http._http1:Http1Connection.wait": "c99d0494a840a2b6",
    "mitmproxy.proxy.layers.http:HttpStream.state_wait_for_request_headers": "3706d5d5ce01dcd4",
    "mitmproxy.proxy.server:ConnectionHandler.wakeup": "6e42e075ee5fa3df",
    "mitmproxy.proxy.server:ConnectionHandler.open_connection": "5e0b3cbaf7a4030a",
    "mitmproxy.proxy.layers.http:HttpStream.state_consume_request_body": "45459c1bbd8bdb1a",
    "h11._receivebuffer:ReceiveBuffer.maybe_extract_at_most": "a283b372f1fb7393",
    "mitmproxy.proxy.layers.http._http1:Http1Client.read_headers": "415454c5fa8b5981",
    "mitmproxy.proxy.layers.http._http1:Http1Connection.read_body": "aece271029af36e4",
    "h11._readers:ChunkedReader.__call__": "2618d847a89a1505",
    "mitmproxy.addonmanager:AddonManager.trigger_event": "b763c59bc4992e33",
    "mitmproxy.addonmanager:AddonManager.invoke_addon": "13180532440359de",
    "mitmproxy.addonmanager:AddonManager._iter_hooks": "350b419ab7284091",
    "mitmproxy.addonmanager:safecall": "f2052c18340e99b0",
    "mitmproxy.addonmanager:traverse": "bad3d9f88bdf9269",
    "mitmproxy.proxy.server:ConnectionHandler.handle_connection": "95c3f93e9824e527",
    "mitmproxy.proxy.server:ConnectionHandler.server_event": "a2b42657ebe8bf6d",
    "mitmproxy.proxy.layers.modes:Socks5Proxy.socks_err": "25dc8e9d3b91ec95",
    "mitmproxy.proxy.layers.modes:Socks5Proxy.state_greet": "16c9cc458dcd00ae",
    "mitmproxy.proxy.layers.modes:Socks5Proxy.state_auth": "4e45f4a6f1acf885",
    "mitmproxy.proxy.layers.modes:Socks5Proxy.state_connect": "1f22acee40d5061e",
    "mitmproxy.proxy.layers.http._http1:make_error_response": "03ce75ab62e8e78b",
    "mitmproxy.proxy.layers.http:HttpStream._handle_event": "e3cbfef7310ae81f",
    "mitmproxy.proxy.layers.http._http1:Http1Server.send": "cc218a1337c0f5cf",
    "mitmproxy.proxy.layers.modes:Socks5Proxy._handle_event": "89b26466b40d47ee",
    "mitmproxy.proxy.layers.http._http2:Http2Server._handle_event": "7282fa18e70a3eaa",
    "mitmproxy.proxy.layers.http._http2:Http2Server.__init__": "fbaceff7e0dfcd9e",
    "mitmproxy.proxy.layers.http._http2:Http2Connection._handle_event": "7fc814a8a507f234",
    "mitmproxy.proxy.layers.http._http2:Http2Connection.close_connection": "44b76ed198e7916a",
    "mitmproxy.proxy.layers.http._http_h2:BufferedH2Connection.send_data": "eeb7918d96b19708",
    "mitmproxy.proxy.layers.http._http_h2:BufferedH2Connection.stream_window_updated": "3be939b870a5f8e4",
    "mitmproxy.proxy.server:ConnectionHandler.drain_writers": "6b57434604561e3e",
    "mitmproxy.proxy.layers.http:HttpLayer.make_stream": "654959c6e74548e1",
    "mitmproxy.proxy.layers.http._http2:Http2Client.__init__": "e4b5d0162e44ceaa",
    "mitmproxy.proxy.layers.http._http2:Http2Client._handle_event": "02de05a5b89f087b",
    "mitmproxy.proxy.layers.http._http2:Http2Connection.handle_h2_event": "f6b6a52b12548102",
    "mitmproxy.proxy.layers.http._http_h2:BufferedH2Connection.__init__": "73fce8e17f54112a",
    "mitmproxy.proxy.layers.http:HttpLayer.get_connection": "1aa1c63e3175766c",
    "mitmproxy.proxy.layers.http:HttpClient._handle_event": "bc1cae775a49a4fe",
    "mitmproxy.addons.proxyserver:Proxyserver.register_connection": "d79bb91554a8bda2",
    "mitmproxy.proxy.layers.http:HttpLayer.__init__": "1ece202e595d103e",
    "mitmproxy.proxy.layer:NextLayer._ask": "4d8ace76d8488336",
    "mitmproxy.proxy.layers.http:HttpStream.handle_connect_finish": "eb3a0054cb5b716e",
    "mitmproxy.proxy.layers.http._http1:Http1Client.send": "35d961e20d481204",
    "mitmproxy.proxy.server:ConnectionHandler.__init__": "ffb8e6c9e6c6d020",
    "mitmproxy.proxy.server:ConnectionHandler.close_connection": "c0d10cc05dd65b80",
    "mitmproxy.proxy.server:TimeoutWatchdog.watch": "eee8e7085dba9250",
    "mitmproxy.proxy.layers.http:validate_request": "e7cec257ce91b7c5",
    "mitmproxy.proxy.layers.http:HttpStream.handle_connect_regular": "ae920a52067801dc",
    "mitmproxy.net.http.http1.read:_read_request_line": "f212df4b4badf61b",
    "mitmproxy.addons.proxyserver:Proxyserver.server_connect": "1fc787ebda12ea02",
    "mitmproxy.proxy.layers.tcp:TCPLayer.start": "b1418418362ceaa7",
    "mitmproxy.proxy.layers.tcp:TCPLayer.relay_messages": "3b3d49a9f63b7d40",
    "mitmproxy.proxy.server:TimeoutWatchdog.register_activity": "41e033f7debf79d3",
    "mitmproxy.addons.next_layer:NextLayer.next_layer": "d277fef31bbe9519",
    "mitmproxy.addons.next_layer:NextLayer._next_layer": "ed22cb84e2f72df2",
    "mitmproxy.addons.next_layer:NextLayer._ignore_connection": "3deb115e04c33c51",
    "mitmproxy.proxy.layer:NextLayer.__init__": "b270467e818faea9",
    "mitmproxy.addons.proxyserver:Proxyserver.configure": "03e1da6deac19a25",
    "mitmproxy.addonmanager:AddonManager.register": "01ddcca314eebbd3",
    "mitmproxy.addons.script:Script.loadscript": "f2972abb206ff2fe",
}


def _resolve(path: str):
    module, _, qualname = path.partition(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return inspect.unwrap(obj)  # the mitmproxy function under any Sluice wrapper


def _depended_on() -> dict[str, str]:
    out = {}
    for name, (_, paths) in mitm_patches.PATCHES.items():
        out.update({p: f"patch {name!r}" for p in paths})
    for name, paths in mitm_patches.RELIED_ON.items():
        out.update({p: f"{name!r}" for p in paths})
    return out


def test_pinned_mitmproxy_version():
    installed = importlib.metadata.version("mitmproxy")
    assert installed == mitm_patches.MITMPROXY_VERSION, (
        f"mitmproxy {installed} is installed but addons/mitm_patches.py was written against "
        f"{mitm_patches.MITMPROXY_VERSION}: re-read every function listed in its PATCHES and RELIED_ON "
        "in the new version, adapt the patches, then update MITMPROXY_VERSION, pyproject's pin and RECORDED here."
    )


@pytest.mark.parametrize("path", sorted(_depended_on()))
def test_patched_source_unchanged(path):
    mitm_patches.install()
    source = inspect.getsource(_resolve(path))
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    assert path in RECORDED, f"{path} is new in addons/mitm_patches.py: record its hash here ({digest})"
    assert digest == RECORDED[path], (
        f"{path} changed (sha256 {digest}, recorded {RECORDED[path]} for mitmproxy "
        f"{mitm_patches.MITMPROXY_VERSION}); {_depended_on()[path]} in addons/mitm_patches.py depends on it. "
        "Re-read the new source, check the patch still does what its docstring says, then record the new hash."
    )


def test_every_recorded_function_is_still_depended_on():
    assert set(RECORDED) == set(_depended_on())


def test_install_is_idempotent():
    from mitmproxy.proxy.layers import http as http_layers
    from mitmproxy.proxy.layers.http import _http1

    mitm_patches.install()
    first = http_layers.Http1Server, _http1.make_error_response
    mitm_patches.install()
    for patch, _ in mitm_patches.PATCHES.values():
        patch()  # even called directly, a patch never wraps itself twice
    assert (http_layers.Http1Server, _http1.make_error_response) == first
    assert http_layers.Http1Server is mitm_patches.SluiceHttp1Server  # what HttpLayer makes for HTTP/1 clients
    assert Http1Server.__dict__["read_headers"] is inspect.unwrap(Http1Server.read_headers)  # mitmproxy's, unwrapped


# ---- the behaviour, through a real Http1Server ---------------------------------


class FakeGuard:
    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.refused: list[str] = []

    def head_limits(self) -> Limits:
        return self.limits

    def refuse_head(self, client, problem, limits) -> bytes:
        self.refused.append(problem)
        return b"" if problem == mitm_patches.PIPELINED_TOO_MUCH else f"HTTP/1.1 4xx {problem}\r\n\r\n".encode()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def guard(monkeypatch):
    mitm_patches.install()
    g = FakeGuard(Limits(max_header_bytes=1024, max_header_count=10, header_timeout=10.0))
    monkeypatch.setattr(mitm_patches.hooks, "head_guard", g)
    clock = Clock()
    monkeypatch.setattr(mitm_patches, "_clock", clock)
    g.clock = clock
    return g


def make_server() -> tuple[Http1Server, connection.Client]:
    client = connection.Client(peername=("192.0.2.1", 40000), sockname=("127.0.0.1", 8080), timestamp_start=time.time())
    server = mitm_patches.SluiceHttp1Server(Context(client, options.Options()))
    assert list(server.handle_event(events.Start())) == []
    return server, client


def feed(server, client, data: bytes) -> list[commands.Command]:
    return list(server.handle_event(events.DataReceived(client, data)))


def sent(cmds) -> bytes:
    return b"".join(c.data for c in cmds if isinstance(c, commands.SendData))


def closed(cmds) -> bool:
    return any(isinstance(c, commands.CloseConnection) for c in cmds)


def heads(cmds) -> list:
    return [c.event for c in cmds if isinstance(c, ReceiveHttp) and isinstance(c.event, RequestHeaders)]


def test_endless_head_is_cut_at_the_cap(guard):
    server, client = make_server()
    cmds = feed(server, client, b"GET http://example.com/ HTTP/1.1\r\nX: ")
    for _ in range(100):
        if closed(cmds):
            break
        cmds = feed(server, client, b"a" * 100)
    assert guard.refused == ["size"]
    assert sent(cmds).startswith(b"HTTP/1.1 4xx size") and closed(cmds) and not heads(cmds)
    assert len(server.buf) == 0  # what was buffered is freed
    # Whatever else arrives before the socket closes is dropped, not buffered.
    assert feed(server, client, b"a" * 50_000 + b"\r\n\r\n") == []
    assert len(server.buf) == 0


def test_head_sent_whole_over_the_cap_is_refused(guard):
    server, client = make_server()
    cmds = feed(server, client, b"GET http://example.com/ HTTP/1.1\r\nX: " + b"a" * 2000 + b"\r\n\r\n")
    assert guard.refused == ["size"] and closed(cmds) and not heads(cmds)


def test_endless_empty_lines_are_cut(guard):
    # mitmproxy skips one leading empty line per read: they must not pile up.
    server, client = make_server()
    cmds = feed(server, client, b"\r\n" * 2000)
    assert guard.refused == ["size"] and closed(cmds)


def test_head_under_the_caps_passes_with_its_body(guard):
    server, client = make_server()
    body = b"b" * 5000  # over max_header_bytes, but it is the body, not the head
    cmds = feed(server, client,
                b"POST http://example.com/ HTTP/1.1\r\nHost: example.com\r\nContent-Length: 5000\r\n\r\n" + body)
    assert guard.refused == [] and not closed(cmds)
    assert len(heads(cmds)) == 1
    assert not any(isinstance(c, mitm_patches.HeadDeadline) for c in cmds)


def test_too_many_fields_never_reach_the_stream(guard):
    server, client = make_server()
    fields = b"".join(b"X-%d: v\r\n" % i for i in range(11))
    cmds = feed(server, client, b"GET http://example.com/ HTTP/1.1\r\n" + fields + b"\r\n")
    assert guard.refused == ["count"] and closed(cmds) and not heads(cmds)
    assert sent(cmds).startswith(b"HTTP/1.1 4xx count")


def test_exactly_the_cap_of_fields_passes(guard):
    server, client = make_server()
    fields = b"".join(b"X-%d: v\r\n" % i for i in range(10))
    cmds = feed(server, client, b"GET http://example.com/ HTTP/1.1\r\n" + fields + b"\r\n")
    assert guard.refused == [] and len(heads(cmds)) == 1


def test_slow_head_gets_408_at_its_deadline_however_it_dribbles(guard):
    server, client = make_server()
    cmds = feed(server, client, b"GET http://example.com/ HTTP/1.1\r\n")
    wakeups = [c for c in cmds if isinstance(c, mitm_patches.HeadDeadline)]
    assert len(wakeups) == 1 and wakeups[0].delay == 10.0
    guard.clock.now += 6
    assert feed(server, client, b"X: a\r\n") == []  # dribbling does not move the deadline, nor ask again
    guard.clock.now += 4
    cmds = list(server.handle_event(events.Wakeup(wakeups[0])))
    assert guard.refused == ["timeout"]
    assert sent(cmds).startswith(b"HTTP/1.1 4xx timeout") and closed(cmds)


def test_deadline_of_a_completed_head_is_dropped(guard):
    server, client = make_server()
    cmds = feed(server, client, b"GET http://example.com/ HTTP/1.1\r\n")
    wakeup = next(c for c in cmds if isinstance(c, mitm_patches.HeadDeadline))
    cmds = feed(server, client, b"Host: example.com\r\n\r\n")
    assert len(heads(cmds)) == 1
    guard.clock.now += 10
    assert list(server.handle_event(events.Wakeup(wakeup))) == []
    assert guard.refused == []


def test_next_head_on_a_keep_alive_connection_gets_its_own_deadline(guard):
    server, client = make_server()
    first = feed(server, client, b"GET http://example.com/ HTTP/1.1\r\n")
    wakeup = next(c for c in first if isinstance(c, mitm_patches.HeadDeadline))
    cmds = feed(server, client, b"Host: example.com\r\n\r\n")
    stream = heads(cmds)[0].stream_id
    response = http.Response.make(200, b"", {"Content-Length": "0"})
    list(server.handle_event(ResponseHeaders(stream, response)))
    list(server.handle_event(ResponseEndOfMessage(stream)))
    guard.clock.now += 8  # idle between requests: not the head timer's business
    assert feed(server, client, b"GET http://example.com/2 HTTP/1.1\r\n") == []  # one wakeup is still pending
    guard.clock.now += 2  # the first wakeup fires: the second head has 8 s left
    cmds = list(server.handle_event(events.Wakeup(wakeup)))
    again = [c for c in cmds if isinstance(c, mitm_patches.HeadDeadline)]
    assert guard.refused == [] and len(again) == 1 and again[0].delay == pytest.approx(8.0)
    guard.clock.now += 8
    cmds = list(server.handle_event(events.Wakeup(again[0])))
    assert guard.refused == ["timeout"] and closed(cmds)


def test_no_guard_means_mitmproxy_as_shipped(monkeypatch):
    mitm_patches.install()
    monkeypatch.setattr(mitm_patches.hooks, "head_guard", None)
    server, client = make_server()
    cmds = feed(server, client, b"GET http://example.com/ HTTP/1.1\r\nX: " + b"a" * 100_000)
    assert cmds == [] and len(server.buf) > 100_000


def test_pipelined_flood_while_a_response_is_pending_closes(guard):
    server, client = make_server()
    cmds = feed(server, client, b"GET http://example.com/ HTTP/1.1\r\nHost: example.com\r\n\r\n")
    stream = heads(cmds)[0].stream_id
    assert feed(server, client, b"GET http://example.com/2 HTTP/1.1\r\n") == []  # a little pipelining is fine
    cmds = feed(server, client, b"X: " + b"a" * 2000)
    assert guard.refused == ["pipelined"] and closed(cmds) and sent(cmds) == b""
    errors = [c.event for c in cmds if isinstance(c, ReceiveHttp) and isinstance(c.event, RequestProtocolError)]
    assert [e.stream_id for e in errors] == [stream]


# ---- dial_check: only what the gate approved is dialled ------------------------


def _client() -> connection.Client:
    return connection.Client(peername=("127.0.0.1", 40000), sockname=("127.0.0.1", 8080), timestamp_start=0)


async def _dial_as(client, host, port):
    """Dial the way a mitmproxy handler's task does, with its dial set."""
    token = mitm_patches._dialling.set((client, None, asyncio.get_running_loop().time()))
    try:
        reader, writer = await asyncio.open_connection(host, port)
        writer.close()
    finally:
        mitm_patches._dialling.reset(token)


class _Audit:
    def write(self, **record):
        pass


def test_dial_check_refuses_before_connecting_and_admits_what_it_approves():
    from sluice.dialer import Dialer
    from sluice.policy.model import Rules

    mitm_patches.install()
    accepted = []

    async def scenario():
        server = await asyncio.start_server(lambda r, w: (accepted.append(1), w.close()), "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        me, other = _client(), _client()
        asked = []

        def check(client, host, port_):
            asked.append((client, host, port_))
            return Rules() if client is me and host == "127.0.0.1" else None

        mitm_patches.set_dialer(Dialer(check, _Audit()))
        try:
            with pytest.raises(mitm_patches.DialRefused):
                await _dial_as(other, "127.0.0.1", port)
            with pytest.raises(mitm_patches.DialRefused):
                await _dial_as(me, "localhost", port)  # a name: never resolved, never dialled
            await asyncio.sleep(0.05)
            assert accepted == []
            await _dial_as(me, "127.0.0.1", port)
            await asyncio.sleep(0.05)
            assert accepted == [1]
            # Outside a handler's dial (no client set), asyncio is untouched.
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            # A name is refused before the table is even asked.
            assert [a[1] for a in asked] == ["127.0.0.1", "127.0.0.1"]
            mitm_patches.set_dialer(None)
            with pytest.raises(mitm_patches.DialRefused):  # no dialer: fail closed
                await _dial_as(me, "127.0.0.1", port)
        finally:
            mitm_patches.set_dialer(None)
            server.close()

    asyncio.run(scenario())

    # (That mitmproxy's handler sets its client around the real dial is shown
    # end to end in tests/integration/test_front_door.py, dial check tests.)


def test_a_request_after_leading_empty_lines_is_read_in_the_same_read(guard):
    # RFC 9112 2.2; mitmproxy alone would wait for more bytes that never come.
    server, client = make_server()
    cmds = feed(server, client, b"\r\n\r\n\nGET http://example.com/ HTTP/1.1\r\nHost: example.com\r\n\r\n")
    assert guard.refused == [] and len(heads(cmds)) == 1


# ---- fast_dispatch: the same hooks, in the same order, with the same errors ------


def _manager():
    """A bare AddonManager of a real Master (inside a running loop)."""
    from mitmproxy.master import Master

    return Master(options.Options(), with_termlog=False).addons


def test_fast_dispatch_calls_what_mitmproxy_would_in_the_same_order(caplog):
    from mitmproxy import exceptions, hooks

    calls = []

    class Child:
        def running(self):
            calls.append("child")

    class Parent:
        addons = [Child()]

        def running(self):
            calls.append("parent")

    class Broken:
        def running(self):
            calls.append("broken")
            raise RuntimeError("a bug in a hook")

    class Async:
        async def running(self):
            calls.append("async")

    class Halt:
        def running(self):
            calls.append("halt")
            raise exceptions.AddonHalt()

    class After:
        def running(self):
            calls.append("after")

    async def scenario():
        manager = _manager()
        manager.add(Parent(), Broken(), Async(), Halt(), After())
        await manager.trigger_event(hooks.RunningHook())
        as_mitmproxy = list(calls)
        calls.clear()
        mitm_patches.fast_dispatch(manager)
        await manager.trigger_event(hooks.RunningHook())
        return as_mitmproxy, list(calls)

    as_mitmproxy, fast = asyncio.run(scenario())
    assert as_mitmproxy == ["parent", "child", "broken", "async", "halt"]
    assert fast == as_mitmproxy
    assert "a bug in a hook" in caplog.text


def test_fast_dispatch_sees_addons_added_later():
    from mitmproxy import hooks

    seen = []

    class Late:
        def running(self):
            seen.append("late")

    async def scenario():
        manager = _manager()
        mitm_patches.fast_dispatch(manager)
        await manager.trigger_event(hooks.RunningHook())
        late = Late()
        manager.add(late)
        await manager.trigger_event(hooks.RunningHook())
        manager.remove(late)
        await manager.trigger_event(hooks.RunningHook())

    asyncio.run(scenario())
    assert seen == ["late"]


def test_fast_dispatch_sends_update_only_to_an_addon_that_has_it():
    from mitmproxy.proxy.layers.http import HttpRequestHook
    from mitmproxy.test import tflow

    seen = []

    class Request:
        def request(self, flow):
            seen.append(("request", flow.id))

    class Update:
        def update(self, flows):
            seen.append(("update", [f.id for f in flows]))

    async def scenario():
        manager = _manager()
        mitm_patches.fast_dispatch(manager)
        manager.add(Request())
        flow = tflow.tflow()
        await manager.handle_lifecycle(HttpRequestHook(flow))
        alone = list(seen)
        seen.clear()
        manager.add(Update())
        await manager.handle_lifecycle(HttpRequestHook(flow))
        return flow.id, alone, list(seen)

    flow_id, alone, with_update = asyncio.run(scenario())
    assert alone == [("request", flow_id)]
    assert with_update == [("request", flow_id), ("update", [flow_id])]


# ---- lean_hot_path: the same answers as mitmproxy's own checks ---------------------


def test_hook_args_are_the_dataclass_fields_in_order():
    import dataclasses

    from mitmproxy import hooks
    from mitmproxy.proxy.layers.http import HttpRequestHook, HttpResponseHook
    from mitmproxy.proxy.server_hooks import ServerConnectHook, ServerConnectionHookData
    from mitmproxy.test import tflow

    @dataclasses.dataclass
    class LeanArgsPairHook(hooks.Hook):
        first: int
        second: str
        name = "sluice_test_lean_args_pair"

    mitm_patches.install()
    assert getattr(hooks.Hook.args, "__sluice_lean__", False)
    assert LeanArgsPairHook(1, "two").args() == [1, "two"]
    flow = tflow.tflow()
    data = ServerConnectionHookData(flow.server_conn, flow.client_conn)
    for hook in (HttpRequestHook(flow), HttpResponseHook(flow), ServerConnectHook(data), hooks.RunningHook(),
                 hooks.UpdateHook([flow])):
        assert hook.args() == [getattr(hook, f.name) for f in dataclasses.fields(hook)]
        assert hook.args() == inspect.unwrap(hooks.Hook.args)(hook)


@pytest.mark.parametrize("field, value", [
    ("host", b"example.com"), ("port", "80"), ("port", 80.0), ("method", "GET"), ("headers", {}),
    ("content", "text"), ("trailers", []), ("timestamp_start", "now"), ("timestamp_start", None),
    ("timestamp_end", "later"), ("http_version", None),
])
def test_a_request_field_of_the_wrong_type_raises_as_mitmproxy_does(field, value):
    from mitmproxy.test import tutils
    from mitmproxy.utils import typecheck

    mitm_patches.install()
    fields = vars(tutils.treq().data).copy()
    fields[field] = value
    annotation = {f.name: f.type for f in __import__("dataclasses").fields(http.RequestData)}[field]
    with pytest.raises(TypeError) as shipped:
        typecheck.check_option_type(field, value, annotation)
    with pytest.raises(TypeError) as patched:
        http.RequestData(**fields)
    assert str(patched.value) == str(shipped.value)


@pytest.mark.parametrize("field, value", [
    ("port", True), ("timestamp_start", 1), ("timestamp_end", None), ("timestamp_end", 2), ("content", None),
    ("trailers", None), ("trailers", http.Headers(a="b")), ("host", "example.com"),
])
def test_a_request_field_mitmproxy_admits_is_admitted(field, value):
    from mitmproxy.test import tutils

    mitm_patches.install()
    fields = vars(tutils.treq().data).copy()
    fields[field] = value
    assert getattr(http.RequestData(**fields), field) is value


def test_a_response_of_the_wrong_type_still_raises():
    from mitmproxy.test import tutils

    mitm_patches.install()
    fields = vars(tutils.tresp().data).copy()
    fields["status_code"] = "200"
    with pytest.raises(TypeError, match="status_code"):
        http.ResponseData(**fields)
    fields["status_code"] = 200
    fields["reason"] = "OK"
    with pytest.raises(TypeError, match="reason"):
        http.ResponseData(**fields)


@pytest.mark.parametrize("annotation, admitted", [
    (int, (int,)), (float, (float, int)), (bytes | None, (bytes, type(None))), (float | None, (float, int, type(None))),
    (tuple[int, int], None), (list[str] | None, None),
])
def test_admitted_classes_are_only_taken_for_plain_annotations(annotation, admitted):
    assert mitm_patches._admitted_classes(annotation) == admitted


# ---- h2_stream_buffer_cap's backstop, through a real Http2Server ------------------


def test_h2_stream_left_unread_past_twice_the_cap_is_reset(monkeypatch):
    """With no origin to hold back (none here), a stream whose client opens no
    window is reset at twice the cap plus two reads, not buffered further."""
    import h2.config
    import h2.connection
    import h2.events
    import h2.settings
    from mitmproxy.proxy.layers.http._events import ResponseData
    from mitmproxy.proxy.layers.http._http2 import Http2Server

    mitm_patches.install()
    cap = 64 * 1024
    monkeypatch.setattr(mitm_patches.hooks, "head_guard",
                        FakeGuard(Limits(h2_stream_buffer_bytes=cap, h2_max_concurrent_streams=7)))
    client = connection.Client(peername=("192.0.2.1", 40000), sockname=("127.0.0.1", 8080), timestamp_start=time.time())
    opts = options.Options()
    opts.add_option("validate_inbound_headers", bool, True, "")  # the proxyserver addon's option
    layer = Http2Server(Context(client, opts))
    agent = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
    agent.local_settings = h2.settings.Settings(client=True,
                                                initial_values={h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0})
    agent.initiate_connection()
    agent.send_headers(1, [(":method", "GET"), (":scheme", "https"), (":authority", "a.example"), (":path", "/")],
                       end_stream=True)

    to_agent = sent(layer.handle_event(events.Start()))
    cmds = list(layer.handle_event(events.DataReceived(client, agent.data_to_send())))
    assert heads(cmds) and agent.receive_data(to_agent + sent(cmds)) is not None
    assert agent.remote_settings.max_concurrent_streams == 7  # the policy's, not h2's 100
    cmds = list(layer.handle_event(ResponseHeaders(1, http.Response.make(200), end_stream=False)))
    chunk = b"x" * 16 * 1024
    errors = []
    for _ in range(100):
        cmds = list(layer.handle_event(ResponseData(1, chunk)))
        errors = [c.event for c in cmds if isinstance(c, ReceiveHttp) and isinstance(c.event, RequestProtocolError)]
        if errors:
            break
        assert mitm_patches._stream_buffered(layer.h2_conn, 1) <= 2 * (cap + mitm_patches.STREAM_READ)
    assert errors and errors[0].stream_id == 1 and errors[0].message == mitm_patches.STREAM_RESET
    assert mitm_patches._stream_buffered(layer.h2_conn, 1) == 0  # the buffer is freed
    resets = [e for e in agent.receive_data(sent(cmds)) if isinstance(e, h2.events.StreamReset)]
    assert [e.stream_id for e in resets] == [1]
    # What the origin still sends for it is dropped, never buffered.
    list(layer.handle_event(ResponseData(1, chunk)))
    assert mitm_patches._stream_buffered(layer.h2_conn, 1) == 0


def test_caps_audits_an_h2_stream_reset_as_response_too_large():
    from mitmproxy.test import tflow

    from sluice.addons.caps import Caps
    from sluice.outcome import META, Outcome
    from sluice.policy.decide import Decision
    from sluice.policy.reasons import Reason

    flow = tflow.tflow()
    outcome = Outcome("a.example", 443, Decision(True, address="192.0.2.7"), None, None)
    flow.metadata[META] = outcome
    Caps(source=None, audit=None).h2_stream_reset(flow, 300_000, 64 * 1024)
    assert outcome.cap.reason is Reason.RESPONSE_TOO_LARGE
    assert "300000 bytes" in outcome.cap.detail and "64 KiB limits.h2_stream_buffer_bytes" in outcome.cap.detail
    assert outcome.cap.message.endswith("the request may be retried.")
