"""One connection state (sluice/connstate.py), released in one place
(addons/conn_release.py): in-process hook tests with mitmproxy's own test
helpers, no proxy spawned."""

from __future__ import annotations

import asyncio
import gc
from types import SimpleNamespace

from mitmproxy.proxy import mode_specs
from mitmproxy.proxy.server_hooks import ServerConnectionHookData
from mitmproxy.test import taddons, tflow, tutils

from sluice import connstate
from sluice.addons.audit import AuditLog
from sluice.addons.caps import Caps
from sluice.addons.conn_release import ConnRelease
from sluice.addons.connection_audit import ConnectionAudit
from sluice.addons.drain import Drain
from sluice.addons.gate import EgressGate, tunnel_of
from sluice.addons.head_limits import HeadLimits
from sluice.addons.quotas import Quotas
from sluice.addons.upgrades import UpgradeGuard
from sluice.addons.upstreams import Upstreams
from sluice.outcome import Outcome
from sluice.policy import quotas
from sluice.policy.decide import Decision
from sluice.policy.loader import load_policy_text
from sluice.policy.quotas import MemoryCounters
from sluice.dialer import UPSTREAMS_BUSY
from sluice.policy.reasons import Reason, Refusal

POLICY = load_policy_text("version: 1\nlimits: {tunnel_max_seconds: 60, max_tunnels: 4, max_connections: 8}\n")


class _Proxy:
    """The addons that keep per-connection state, wired as make_addons wires them."""

    def __init__(self) -> None:
        self.lines: list[dict] = []
        self.audit = AuditLog()
        self.audit.write = lambda **record: self.lines.append(record)  # no stdout in these tests
        self.source = SimpleNamespace(current=SimpleNamespace(policy=POLICY, resolver=None), on_reload=lambda f: None)
        self.caps = Caps(self.source, self.audit)
        self.gate = EgressGate(self.source, self.audit, self.caps)
        self.counters = MemoryCounters()
        self.quotas = Quotas(self.source, self.audit, self.caps, self.gate, self.counters, clock=lambda: 1000.0)
        self.upstreams = Upstreams(self.gate, self.audit)
        self.head_limits = HeadLimits(self.source, self.audit)
        self.upgrades = UpgradeGuard(self.caps, self.source)
        self.connection_audit = ConnectionAudit(self.audit)
        self.drain = Drain(self.caps)
        self.release = ConnRelease(self.audit)

    async def connect(self, n: int = 0):
        client = tflow.tclient_conn()
        client.peername = (f"192.0.2.{n % 250 + 1}", 40000 + n)
        client.proxy_mode = mode_specs.ProxyMode.parse("regular")
        await self.quotas.client_connected(client)
        self.head_limits.client_connected(client)
        return client

    def held(self) -> list:
        """Every counter still held (connection, share, total and tunnel slots)."""
        return [k for k, v in self.counters._counts.items() if v]


def _connect_flow(client, host: str = "8.8.8.8"):
    flow = tflow.tflow(client_conn=client, req=tutils.treq(method=b"CONNECT", host=host, port=443, path=b"",
                                                           scheme=b"", authority=f"{host}:443".encode()))
    flow.server_conn.address = (host, 443)
    return flow


def test_every_piece_of_a_connections_state_is_released_once_on_disconnect():
    proxy = _Proxy()

    async def run():
        with taddons.context(proxy.gate, proxy.quotas):
            client = await proxy.connect()
            flow = _connect_flow(client)
            await proxy.gate.http_connect(flow)  # approves, pins, remembers the tunnel, starts its time cap
            await proxy.quotas.http_connect(flow)  # takes a connection and a tunnel slot
            assert flow.response is None and tunnel_of(client, flow.server_conn) is not None
            assert proxy.upstreams.before_dial(client, flow.server_conn) is None
            request = tflow.tflow(client_conn=client)
            proxy.drain.requestheaders(request)
            proxy.connection_audit._answer(client, Refusal(Reason.BAD_REQUEST, "pending error page"))
            connstate.state_of(client).loop = (Refusal(Reason.PROXY_LOOP, "its own listener"), "127.0.0.1", 8080)
            state = connstate.peek(client)
            timers = [state.head_deadline, *state.tunnel_deadlines]
            assert state.approved and state.tunnels and state.upstreams and state.in_flight and state.error_page
            assert len(timers) == 2 and proxy.held()

            proxy.release.client_disconnected(client)
            proxy.release.client_disconnected(client)  # idempotent: nothing twice

            assert connstate.peek(client) is None
            assert state.released and not (state.approved or state.tunnels or state.upstreams or state.in_flight)
            assert all(t.cancelled() for t in timers)
            assert proxy.held() == []
            assert [(line["event"], line["reason"]) for line in proxy.lines] == [
                ("connect", "proxy_loop"), ("tunnel", None)]  # the loop no flow took, then the tunnel's line

    asyncio.run(run())


def test_many_connections_opened_and_closed_leave_no_state():
    proxy = _Proxy()

    async def run():
        with taddons.context(proxy.gate, proxy.quotas):
            for i in range(300):
                client = await proxy.connect(i)
                if i % 3 == 0:
                    flow = _connect_flow(client)
                    await proxy.gate.http_connect(flow)
                    await proxy.quotas.http_connect(flow)
                else:
                    flow = tflow.tflow(client_conn=client)
                    proxy.drain.requestheaders(flow)
                    proxy.upstreams.before_dial(client, flow.server_conn)
                    proxy.drain.response(flow)
                proxy.release.client_disconnected(client)
            assert connstate.count() == 0
            assert proxy.held() == []
            assert proxy.drain.in_flight() == 0
            assert sum(1 for line in proxy.lines if line["event"] == "tunnel") == 100

    asyncio.run(run())
    gc.collect()
    assert connstate.count() == 0


def test_a_failed_connects_tunnel_slot_is_given_back_at_once():
    proxy = _Proxy()

    async def run():
        with taddons.context(proxy.gate, proxy.quotas):
            client = await proxy.connect()
            flows = [_connect_flow(client) for _ in range(4)]
            for flow in flows:
                await proxy.gate.http_connect(flow)
                await proxy.quotas.http_connect(flow)
            tunnel = quotas.tunnel_key(quotas.client_key(None, None, "192.0.2.1"))
            assert proxy.counters._counts[tunnel] == 4
            over = _connect_flow(client)
            await proxy.gate.http_connect(over)
            await proxy.quotas.http_connect(over)
            assert over.response.status_code == 429  # max_tunnels: 4
            proxy.quotas.http_connect_error(flows[0])
            assert proxy.counters._counts[tunnel] == 3
            proxy.release.client_disconnected(client)
            assert proxy.held() == []

    asyncio.run(run())


def test_state_is_per_client_connection():
    proxy = _Proxy()

    async def run():
        a, b = await proxy.connect(1), await proxy.connect(2)
        connstate.state_of(a).socks_login = ("agents", "bot")
        assert connstate.peek(b).socks_login is None
        tunnel = Outcome("8.8.8.8", 443, Decision(True, address="8.8.8.8", port=443), None, POLICY.rules)
        server = tflow.tserver_conn()
        connstate.state_of(a).tunnels[server.id] = tunnel
        assert tunnel_of(a, server) is tunnel and tunnel_of(b, server) is None
        assert connstate.open_tunnels() == [tunnel]
        for client in (a, b):
            proxy.release.client_disconnected(client)
        assert connstate.count() == 0 and connstate.open_tunnels() == []

    asyncio.run(run())


def test_an_upgraded_pipe_is_held_by_its_connection_until_release():
    proxy = _Proxy()

    async def run():
        with taddons.context(proxy.upgrades, proxy.caps):
            client = await proxy.connect()
            flow = tflow.tflow(client_conn=client, resp=True)
            flow.request.headers["upgrade"] = "websocket"
            flow.response.status_code = 101
            flow.response.headers["upgrade"] = "websocket"
            flow.metadata["sluice"] = Outcome("8.8.8.8", 80, Decision(True, address="8.8.8.8", port=80), None,
                                              POLICY.rules)
            proxy.upgrades.responseheaders(flow)
            assert list(connstate.peek(client).accepted_upgrades) == [flow.server_conn.id]
            pipe_flow = tflow.ttcpflow(client_conn=client, server_conn=flow.server_conn)
            proxy.upgrades.tcp_start(pipe_flow)
            state = connstate.peek(client)
            assert not state.accepted_upgrades and len(state.pipes) == 1 and proxy.upgrades.open_pipes() == state.pipes
            deadline = state.tunnel_deadlines[-1]  # the pipe's tunnel_max_seconds
            proxy.release.client_disconnected(client)
            assert proxy.upgrades.open_pipes() == [] and deadline.cancelled() and connstate.count() == 0

    asyncio.run(run())


def test_a_connect_refusal_answers_the_next_failing_exchange_only():
    proxy = _Proxy()

    async def run():
        with taddons.context(proxy.caps):
            client = await proxy.connect()
            server = tflow.tserver_conn()
            server.error = f"[{server.address[0]}] {UPSTREAMS_BUSY}: it holds 2 upstream connections"
            proxy.caps.server_connect_error(ServerConnectionHookData(server=server, client=client))
            assert connstate.peek(client).connect_refusal.reason is Reason.TOO_MANY_CONNECTIONS
            first, second = (tflow.tflow(client_conn=client, err=True) for _ in range(2))
            for flow in (first, second):
                flow.metadata["sluice"] = Outcome("8.8.8.8", 80, Decision(True, address="8.8.8.8", port=80), None,
                                                  POLICY.rules)
                proxy.caps.error(flow)
            assert first.metadata["sluice"].cap.reason is Reason.TOO_MANY_CONNECTIONS
            assert second.metadata["sluice"].cap is None and connstate.peek(client).connect_refusal is None
            proxy.release.client_disconnected(client)

    asyncio.run(run())


def test_the_last_lookup_shortcut_never_outlives_the_state():
    a, b = tflow.tclient_conn(), tflow.tclient_conn()
    first = connstate.state_of(a)
    assert connstate.peek(a) is first and connstate.state_of(a) is first
    other = connstate.state_of(b)
    assert other is not first
    assert connstate.peek(a) is first and connstate.peek(b) is other  # alternating lookups
    assert connstate.pop(a) is first
    assert connstate.peek(a) is None  # forgotten with the state, though it was the last looked up
    assert connstate.peek(b) is other
    assert connstate.pop(b) is other and connstate.peek(b) is None
    again = connstate.state_of(a)
    assert again is not first and connstate.peek(a) is again
    connstate.pop(a)
    del a, b, first, other, again
    gc.collect()
    assert connstate.peek(tflow.tclient_conn()) is None  # a new client never gets a dead one's state
