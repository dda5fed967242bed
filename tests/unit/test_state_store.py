"""sluice/state_store.py against a real redis-server on loopback: the Lua
scripts are atomic across processes (two clients never both take the last
token or slot), buckets run on the store's clock, a dead process's holdings
expire with its heartbeat, bytes settle in batches within the documented
slack, and a store that fails is never waited on past the timeout: the
fallback answers, the status says so once, and the store is found again."""

from __future__ import annotations

import asyncio
import shutil
import time

import pytest

from harness.redis_server import RedisServer
from sluice import state_store
from sluice.policy import quotas
from sluice.policy.model import Limits
from sluice.policy.state import StateSettings
from sluice.state_store import BYTE_BATCH, StoreCounters

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")

ALICE = quotas.client_key("agents", "alice", "10.0.0.5")


@pytest.fixture
def redis():
    with RedisServer() as server:
        yield server


def _pair(redis, statuses=None, timeout=0.2):
    settings = StateSettings(redis.url, timeout=timeout)
    note = (lambda up, line: statuses.append((up, line))) if statuses is not None else None
    return StoreCounters(settings, note, process="a"), StoreCounters(settings, note, process="b")


def test_two_processes_share_one_bucket_and_never_both_take_the_last_token(redis):
    async def run():
        # A generous timeout: this checks the script's atomicity, and a take that timed out on a loaded machine
        # would fall back to the local counters (on_error: local) and pass a token of its own.
        a, b = _pair(redis, timeout=5.0)
        await a.start(), await b.start()
        # 40 concurrent takes over both processes from a bucket of 10 (refilling 0.01/s): exactly 10 pass
        waits = await asyncio.gather(*[(a if i % 2 else b).take(("rate",) + ALICE, 0.01, 10, 0.0) for i in range(40)])
        assert sum(1 for w in waits if w == 0.0) == 10
        assert all(w > 90 for w in waits if w)  # the honest wait for one token at 0.01/s
        await a.close(), await b.close()

    asyncio.run(run())


def test_the_shared_check_request_holds_a_rate_across_processes(redis):
    async def run():
        a, b = _pair(redis)
        limits = Limits(requests_per_second=1.0, burst=4)
        results = [await quotas.check_request(c, limits, ALICE, "x.example", 0.0) for c in (a, b, a, b, a, b)]
        assert [r is None for r in results] == [True] * 4 + [False] * 2
        assert results[-1].reason.value == "rate_limited"
        await a.close(), await b.close()

    asyncio.run(run())


def test_concurrent_slots_are_counted_over_processes_and_released(redis):
    async def run():
        a, b = _pair(redis)
        await a.start(), await b.start()
        key = quotas.tunnel_key(ALICE)
        got = await asyncio.gather(*[(a if i % 2 else b).acquire(key, 3) for i in range(12)])
        assert sum(got) == 3
        assert await a.count(key) == await b.count(key) == 3
        holder = a if a._held else b
        holder.release(key)
        await asyncio.sleep(0)  # the release is sent in the background
        await asyncio.gather(*holder._tasks)
        assert await b.count(key) == 2 and await (a if holder is b else b).acquire(key, 3)
        await a.close(), await b.close()

    asyncio.run(run())


def test_a_dead_processes_holdings_expire_with_its_heartbeat(redis, monkeypatch):
    monkeypatch.setattr(state_store, "HEARTBEAT_TTL", 0.3)
    monkeypatch.setattr(state_store, "HEARTBEAT_EVERY", 0.05)

    async def run():
        a, b = _pair(redis)
        await a.start(), await b.start()
        key = quotas.tunnel_key(ALICE)
        assert await a.acquire(key, 1)
        assert not await b.acquire(key, 1)  # a holds the one slot
        a._closed = True  # a dies: no more heartbeats, nothing released
        a._loop_task.cancel()
        deadline = time.monotonic() + 3
        while not await b.acquire(key, 1):
            assert time.monotonic() < deadline, "the dead process's slot never expired"
            await asyncio.sleep(0.05)
        assert await b.count(key) == 1
        await b.close()

    asyncio.run(run())


def test_per_process_counts_stay_in_the_process(redis):
    async def run():
        a, b = _pair(redis)
        assert await a.acquire(quotas.TOTAL_KEY, 1)
        assert await b.acquire(quotas.TOTAL_KEY, 1)  # max_total_connections counts each process's own fds
        assert await a.count(quotas.TOTAL_KEY) == 1
        await a.close(), await b.close()

    asyncio.run(run())


def test_bytes_settle_in_batches_within_the_slack(redis):
    async def run():
        a, b = _pair(redis)
        key, limit = quotas.bytes_key(ALICE), 2 * BYTE_BATCH
        chunk = 16 * 1024
        passed = 0
        for _ in range(200):  # each process charges as bytes pass; batches settle with the store
            for c in (a, b):
                passed += c.spend(key, chunk, limit, quotas.HOUR, time.monotonic())
                await asyncio.sleep(0.001)  # chunks arrive over a network, not all in one loop turn
        await asyncio.gather(*a._tasks, *b._tasks)
        assert limit <= passed <= limit + 2 * BYTE_BATCH  # the documented slack: a batch per process
        used, resets_in = await b.window(key, quotas.HOUR, time.monotonic())
        assert used >= limit and 3500 < resets_in <= 3600
        await a.close(), await b.close()

    asyncio.run(run())


def test_a_failed_store_is_never_waited_on_and_falls_back_then_comes_back(redis):
    statuses: list = []

    async def run():
        a, _ = _pair(redis, statuses=statuses, timeout=0.1)
        await a.start()
        key = ("rate",) + ALICE
        assert await a.take(key, 0.01, 1, 0.0) == 0.0
        assert await a.take(key, 0.01, 1, 0.0) > 0  # shared bucket used up
        redis.stop()
        t0 = time.monotonic()
        assert await a.take(key, 0.01, 1, 0.0) == 0.0  # local fallback: a bucket of its own
        assert time.monotonic() - t0 < 1.0
        assert not a.up and [up for up, _ in statuses] == [False]
        assert "counting in this process" in statuses[0][1]
        t0 = time.monotonic()
        await a.take(key, 0.01, 1, 0.0)
        assert time.monotonic() - t0 < 0.05  # down: no attempt, no wait
        await asyncio.to_thread(redis.start)
        deadline = time.monotonic() + 5
        while not a.up:
            assert time.monotonic() < deadline, "the store was never found again"
            await asyncio.sleep(0.05)
        assert [up for up, _ in statuses] == [False, True] and "shared again" in statuses[1][1]
        assert await a.take(key, 0.01, 1, 0.0) == 0.0  # a new (empty) store: shared again
        await a.close()

    asyncio.run(run())


# ---- the policy's `state` key ---------------------------------------------------


def test_state_loads_with_a_password_from_a_file_or_the_environment(tmp_path):
    from sluice.policy.loader import load_policy_file, load_policy_text

    (tmp_path / "pw").write_text("s3cret\n")
    (tmp_path / "p.yaml").write_text("version: 1\nstate: {store: {url: 'rediss://valkey:6379/0', password: {file: pw}},"
                                     " timeout: 80ms}\n")
    state = load_policy_file(tmp_path / "p.yaml").state
    assert (state.url, state.password.reveal(), state.timeout, state.on_error) == (
        "rediss://valkey:6379/0", "s3cret", 0.08, "local")
    state = load_policy_text("version: 1\nstate: {store: {url: 'redis://v', password: {env: VK}}}\n",
                             environ={"VK": "pw"}).state
    assert state.password.reveal() == "pw" and state.where == "redis://v:6379"
    assert load_policy_text("version: 1\n").state is None


@pytest.mark.parametrize("text, message", [
    ("{store: {url: 'http://v'}}", "must start redis:// or rediss://"),
    ("{store: {url: 'redis://user:hunter2@v'}}", "must not carry credentials"),
    ("{store: {url: 'redis://v', password: hunter2}}", "must not be written in the policy"),
    ("{store: {url: 'redis://v', password: {env: NOPE}}}", "the environment variable 'NOPE' is not set"),
    ("{store: {url: 'redis://v'}, timeout: 10s}", "state.timeout must be at most 5s"),
    ("{store: {url: 'redis://v'}, on_error: maybe}", "state.on_error must be local"),
    ("{}", "state needs a store"),
    ("{store: {url: 'redis://v/x'}}", "may name only a database number"),
])
def test_bad_state_is_a_clear_problem_that_never_echoes_a_secret(text, message):
    from sluice.policy.loader import PolicyInvalid, load_policy_text

    with pytest.raises(PolicyInvalid) as e:
        load_policy_text(f"version: 1\nstate: {text}\n", environ={})
    assert message in str(e.value) and "hunter2" not in str(e.value)
