"""`state.on_error: closed` (issue 23) with a store that is down, no
redis-server needed: a stand-in client whose every step fails (or never
answers) as an unreachable store's would. What needs a shared limit is
refused with `state_store_unavailable` (503, Retry-After) on every path (an
HTTP request, a CONNECT, a SOCKS5 dial, a buffered upload); what needs none
passes; `on_error: local` still counts in process; no decision waits past
`state.timeout`."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import pytest
from mitmproxy import connection
from mitmproxy.proxy.layers.http import HttpConnectHook, HttpRequestHook
from mitmproxy.proxy.server_hooks import ServerConnectHook, ServerConnectionHookData

from harness.inprocess import InProcess, connect_flow, lines_of, request_flow
from sluice.addons.gate import SOCKS5_NOT_ALLOWED
from sluice.policy import quotas
from sluice.policy.loader import PolicyInvalid, load_policy_text
from sluice.policy.model import Limits
from sluice.policy.quotas import CountersUnavailable
from sluice.policy.reasons import Reason
from sluice.policy.state import StateSettings
from sluice import state_store
from sluice.state_store import StoreCounters
from test_hooks_quotas import ask

ALICE = quotas.client_key("agents", "alice", "10.0.0.5")
LIMITED, FREE = "192.0.2.10", "192.0.2.20"  # a profile with limits, and the top level (none)
POLICY = f"""version: 1
methods: [GET, POST, CONNECT]
clients:
  - name: limited
    sources: [{LIMITED}/32]
    limits: {{requests_per_second: 100, burst: 100, max_tunnels: 4, bytes_per_hour: 10000, max_connections: 8}}
"""


class DownStore:
    """A store client whose every step fails at once, as one whose address refuses connections."""

    def register_script(self, text: str):
        async def run(keys=(), args=()):
            raise ConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")
        return run

    async def aclose(self) -> None:
        pass


class SilentStore(DownStore):
    """A store client whose steps never answer (a store that hangs, or packets dropped)."""

    def register_script(self, text: str):
        async def run(keys=(), args=()):
            await asyncio.Event().wait()
        return run


def _store(on_error: str, client=None, statuses=None, timeout: float = 0.05) -> StoreCounters:
    note = (lambda up, line: statuses.append((up, line))) if statuses is not None else None
    return StoreCounters(StateSettings("redis://127.0.0.1:6379/0", timeout=timeout, on_error=on_error), note,
                         client=client or DownStore(), process="p")


# ---- the counters and the checks ------------------------------------------------


def test_closed_refuses_each_limit_that_needs_the_store_with_the_reason_and_retry_after():
    statuses: list = []

    async def run():
        store = _store("closed", statuses=statuses)
        limits = Limits(requests_per_second=1.0, burst=5, bytes_per_hour=1000, max_tunnels=2,
                        max_requests_per_host_per_minute=10, max_connections=3)
        refusal = await quotas.check_request(store, limits, ALICE, "x.example", 0.0)
        assert (refusal.reason, refusal.status, refusal.retry_after) == (Reason.STATE_STORE_UNAVAILABLE, 503, 5)
        assert "shared limit store is unreachable" in refusal.message and "Retry after 5 s." in refusal.message
        assert "127.0.0.1" not in refusal.message  # the store's address is the operator's, not the agent's
        for only, key in ((Limits(requests_per_second=1.0), "requests_per_second"),
                          (Limits(max_requests_per_host_per_minute=10), "max_requests_per_host_per_minute")):
            refusal = await quotas.check_request(store, only, ALICE, "x.example", 0.0)
            assert refusal.reason is Reason.STATE_STORE_UNAVAILABLE and key in refusal.detail
        assert (await quotas.admit_tunnel(store, limits, ALICE)).reason is Reason.STATE_STORE_UNAVAILABLE
        assert (await quotas.admit_connection(store, limits, "10.0.0.5")).reason is Reason.STATE_STORE_UNAVAILABLE
        assert (await quotas.over_connections(store, limits, "10.0.0.5")).reason is Reason.STATE_STORE_UNAVAILABLE
        with pytest.raises(CountersUnavailable, match="unavailable"):
            await store.take(("rate",) + ALICE, 1.0, 1, 0.0)
        # Reported once, saying what it does meanwhile.
        assert [up for up, _ in statuses] == [False]
        assert "refusing what needs a shared limit until it is back (on_error: closed)" in statuses[0][1]
        await store.close()

    asyncio.run(run())


def test_closed_passes_what_needs_no_limit_and_counts_the_processs_own_slots():
    async def run():
        store = _store("closed")
        refused = await quotas.admit_tunnel(store, Limits(max_tunnels=4), ALICE)
        assert refused.reason is Reason.STATE_STORE_UNAVAILABLE  # the same client, with a limit
        assert await quotas.check_request(store, Limits(), ALICE, "x.example", 0.0) is None
        assert await quotas.admit_tunnel(store, Limits(), ALICE) is None  # no max_tunnels: counted here
        assert await quotas.admit_connection(store, Limits(), "10.0.0.5") is None
        assert await quotas.over_connections(store, Limits(), "10.0.0.5") is None
        assert await quotas.admit_total(store, 1) is None  # the process's own fds: never the store's
        assert await quotas.admit_total(store, 1) is not None
        assert store.spend(quotas.bytes_key(ALICE), 100, 1000, quotas.HOUR, 0.0) == 100  # bytes passing go on
        store.release(quotas.tunnel_key(ALICE))
        assert await store.local.count(quotas.tunnel_key(ALICE)) == 0  # given back where it was taken
        await store.close()

    asyncio.run(run())


def test_the_same_down_store_refuses_under_closed_and_counts_in_process_under_local():
    statuses: list = []

    async def run():
        limits = Limits(requests_per_second=0.01, burst=2, max_tunnels=1)
        closed, local = _store("closed"), _store("local", statuses=statuses)
        results = [await quotas.check_request(closed, limits, ALICE, "x.example", 0.0) for _ in range(3)]
        assert [r.reason for r in results] == [Reason.STATE_STORE_UNAVAILABLE] * 3
        results = [await quotas.check_request(local, limits, ALICE, "x.example", 0.0) for _ in range(3)]
        assert [r.reason if r else None for r in results] == [None, None, Reason.RATE_LIMITED]  # a bucket here
        assert await quotas.admit_tunnel(local, limits, ALICE) is None
        assert (await quotas.admit_tunnel(local, limits, ALICE)).reason is Reason.TOO_MANY_TUNNELS
        assert "counting in this process until it is back" in statuses[0][1]
        await closed.close(), await local.close()

    asyncio.run(run())


def test_a_store_that_never_answers_is_not_waited_on_past_the_timeout():
    async def run():
        limits = Limits(requests_per_second=1.0, burst=5, bytes_per_hour=1000, max_tunnels=2)
        answers = {}
        for on_error in ("closed", "local"):
            store = _store(on_error, client=SilentStore(), timeout=0.05)
            t0 = time.monotonic()
            refusal = await quotas.check_request(store, limits, ALICE, "x.example", 0.0)
            first = time.monotonic() - t0
            t0 = time.monotonic()
            tunnel_refusal = await quotas.admit_tunnel(store, limits, ALICE)
            second = time.monotonic() - t0
            answers[on_error] = (refusal.reason if refusal else None, tunnel_refusal.reason if tunnel_refusal else None)
            assert first < 0.5  # one timeout (50 ms) and the loop's slack, not the store's silence
            assert second < 0.05  # known down: no attempt at all
            await store.close()
        assert answers == {"closed": (Reason.STATE_STORE_UNAVAILABLE,) * 2, "local": (None, None)}

    asyncio.run(run())


# ---- through the quota addon's hooks ---------------------------------------------


def _closed_proxy(on_error: str = "closed") -> InProcess:
    p = InProcess(POLICY, {"public.example": ["8.8.8.8"]})
    p.quotas.counters = _store(on_error)
    return p


def test_closed_refuses_a_limited_clients_request_and_connect_and_passes_an_unlimited_one():
    async def run():
        async with _closed_proxy() as p:
            limited = await p.connect(source=LIMITED)
            flow = request_flow(limited)
            assert await ask(p, flow) == (503, "state_store_unavailable", "5")
            assert "shared limit store is unreachable" in flow.response.get_text()
            connect = connect_flow(await p.connect(source=LIMITED, port=40001))
            await p.hook(HttpConnectHook(connect))
            assert connect.response.status_code == 503
            assert connect.response.reason == "Sluice state_store_unavailable"  # the phrase a CONNECT client sees
            assert connect.response.headers["Retry-After"] == "5"
            free = await p.connect(source=FREE)
            assert await ask(p, request_flow(free)) == (None, None, None)
            open_tunnel = connect_flow(free)
            await p.hook(HttpConnectHook(open_tunnel))
            assert open_tunnel.response is None  # no max_tunnels for it: the tunnel opens
    asyncio.run(run())


def test_closed_gives_a_socks5_client_the_refusal_reply_and_a_connect_line():
    async def run():
        async with _closed_proxy() as p:
            client = await p.connect(source=LIMITED, mode="socks5")
            server = connection.Server(address=("8.8.8.8", 443))
            await p.hook(ServerConnectHook(ServerConnectionHookData(server=server, client=client)))
            assert server.error.startswith("state_store_unavailable: ")
            assert bytes(p.handler(client).socket.sent) == SOCKS5_NOT_ALLOWED
            [line] = lines_of(p.lines, "connect")
            assert (line["decision"], line["reason"]) == ("refuse", "state_store_unavailable")
    asyncio.run(run())


def test_closed_refuses_a_buffered_upload_when_the_store_went_down_after_its_head():
    async def run():
        async with InProcess(POLICY, {"public.example": ["8.8.8.8"]}) as p:
            store = p.quotas.counters = _store("closed", client=_Flaky())
            client = await p.connect(source=LIMITED)
            upload = request_flow(client, method=b"POST", content=b"u" * 100)
            assert (await ask(p, upload))[0] is None  # admitted while the store answered
            store._client.down = True
            await p.hook(HttpRequestHook(upload))
            assert upload.response.status_code == 503
            assert upload.response.headers["Sluice-Reason"] == "state_store_unavailable"
    asyncio.run(run())


def test_local_passes_through_the_hooks_what_closed_refuses():
    async def run():
        answers = {}
        for on_error in ("closed", "local"):
            async with _closed_proxy(on_error) as p:
                limited = await p.connect(source=LIMITED)
                connect = connect_flow(limited)
                await p.hook(HttpConnectHook(connect))
                answers[on_error] = ((await ask(p, request_flow(limited)))[:2],
                                     connect.response.status_code if connect.response else None)
        assert answers == {"closed": ((503, "state_store_unavailable"), 503), "local": ((None, None), None)}
    asyncio.run(run())


class _Flaky(DownStore):
    """Answers like an empty store until `down` is set, then fails like DownStore."""

    down = False

    def register_script(self, text: str):
        failing = super().register_script(text)

        async def run(keys=(), args=()):
            if self.down:
                return await failing(keys, args)
            if text == state_store.TAKE:
                return "0"  # a token taken
            if text == state_store.SPEND:
                return [int(args[0]), int(args[0]), 3_600_000]  # {granted, used, ms left}
            if text == state_store.HOLD:
                return [1, 0]  # {acquired, held before}
            return 0  # RELEASE: holders left
        return run


# ---- the policy key ----------------------------------------------------------------


def test_on_error_closed_loads_and_a_bad_value_names_both_choices():
    state = load_policy_text("version: 1\nstate: {store: {url: 'redis://v'}, on_error: closed}\n").state
    assert state.on_error == "closed"
    with pytest.raises(PolicyInvalid) as e:
        load_policy_text("version: 1\nstate: {store: {url: 'redis://v'}, on_error: open}\n")
    assert "state.on_error must be local" in str(e.value) and "or closed (refuse what needs a shared limit" in str(
        e.value)


def test_a_reload_that_changes_only_on_error_keeps_the_store_and_its_counts():
    async def run():
        async with InProcess(POLICY) as p:
            settings = StateSettings("redis://127.0.0.1:1/0", timeout=0.05)  # nothing listens on port 1
            p.quotas.use_state(settings)
            store = p.quotas.counters
            p.quotas.use_state(replace(settings, on_error="closed"))
            assert p.quotas.counters is store and store.settings.on_error == "closed"
            assert store.settings is p.quotas.state
            p.quotas.use_state(replace(settings, url="redis://127.0.0.2:1/0"))  # another store: reconnected
            assert p.quotas.counters is not store and p.quotas.counters.settings.on_error == "local"
            p.quotas.use_state(None)
    asyncio.run(run())
