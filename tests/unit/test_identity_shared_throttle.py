"""Login-failure throttles shared on the state store (issue 23): two
ClientIdentifiers, each with its own StoreCounters (two processes), on one
real redis-server on loopback. Wrong passwords counted by one throttle the
same address and username on the other; the script leaks on the store's
clock and its keys expire; a right password takes its charge back; a
store that is down throttles in process (`on_error: local`) or refuses the
check (`closed`), a remembered success passing either way; no check waits
past `state.timeout`."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import shutil
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace

import pytest

from harness.redis_server import RedisServer
from sluice.identity import ADDRESS_BURST, USERNAME_BURST, ClientIdentifier
from sluice.policy.reasons import Reason
from sluice.policy.state import StateSettings
from sluice.state_store import StoreCounters
from test_identity_throttle import POLICY, _sha
from test_state_closed import DownStore, SilentStore

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")


@pytest.fixture
def redis():
    with RedisServer() as server:
        yield server


def _identifier(store: StoreCounters | None, slept: list[float] | None = None) -> ClientIdentifier:
    async def sleep(seconds: float) -> None:
        if slept is not None:
            slept.append(seconds)

    ident = ClientIdentifier(verify=lambda verifier, password: verifier == _sha(password), sleep=sleep)
    ident.store = store
    return ident


def _store(url: str, process: str, on_error: str = "local", client=None, timeout: float = 2.0) -> StoreCounters:
    # A generous timeout against the real server: a step that timed out on a loaded machine would fall back.
    return StoreCounters(StateSettings(url, timeout=timeout, on_error=on_error), client=client, process=process)


@contextlib.asynccontextmanager
async def _two_processes(url: str) -> AsyncIterator[tuple[tuple[StoreCounters, StoreCounters],
                                                          tuple[ClientIdentifier, ClientIdentifier]]]:
    """Two processes on the one store: their StoreCounters (processes "a" and
    "b") and a ClientIdentifier on each; both stores closed at the end."""
    a, b = _store(url, "a"), _store(url, "b")
    try:
        yield (a, b), (_identifier(a), _identifier(b))
    finally:
        await a.close()
        await b.close()


async def _login(ident: ClientIdentifier, user: str, password: str, source: str = "192.0.2.1"):
    header = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
    match = await ident.match(POLICY, SimpleNamespace(peername=(source, 40000)), header)
    return match.refusal.reason if match.refusal else None


def test_wrong_passwords_on_one_process_throttle_the_address_on_the_other(redis):
    async def run():
        async with _two_processes(redis.url) as (_, (one, other)):
            # The address's burst, spread over both processes (and over two users, so only the address's bucket fills).
            results = [await _login(one if i % 2 else other, "alice" if i % 2 else "bob", f"guess-{i}")
                       for i in range(ADDRESS_BURST)]
            assert results == [Reason.CLIENT_UNKNOWN] * ADDRESS_BURST
            assert await _login(one, "alice", "guess-x") is Reason.AUTH_THROTTLED
            assert await _login(other, "bob", "guess-y") is Reason.AUTH_THROTTLED
            assert await _login(other, "alice", "guess-z",
                                source="192.0.2.2") is Reason.CLIENT_UNKNOWN  # another address
            assert len(one._by_address) == len(other._by_address) == 0  # nothing counted in process

    asyncio.run(run())


def test_wrong_passwords_for_one_username_are_throttled_across_processes_and_addresses(redis):
    async def run():
        async with _two_processes(redis.url) as (_, (one, other)):
            results = [await _login(one if i % 2 else other, "alice", f"guess-{i}", source=f"198.51.100.{i}")
                       for i in range(USERNAME_BURST)]
            assert results == [Reason.CLIENT_UNKNOWN] * USERNAME_BURST
            assert await _login(one, "alice", "guess-x", source="198.51.100.200") is Reason.AUTH_THROTTLED
            assert await _login(other, "bob", "guess-y", source="198.51.100.201") is Reason.CLIENT_UNKNOWN

    asyncio.run(run())


def test_a_right_password_takes_back_its_charge_in_the_store(redis):
    async def run():
        async with _two_processes(redis.url) as ((a, _), (one, other)):
            for i in range(ADDRESS_BURST - 1):
                assert await _login(one, "bob", f"guess-{i}") is Reason.CLIENT_UNKNOWN
            assert await _login(one, "alice", "alice-pw") is None  # right: its charge goes back
            await asyncio.gather(*a._tasks)  # the refund is sent in the background
            assert await _login(other, "bob", "guess-last") is Reason.CLIENT_UNKNOWN  # the burst's last, not throttled
            assert await _login(other, "bob", "guess-over") is Reason.AUTH_THROTTLED

    asyncio.run(run())


def test_the_script_leaks_on_the_stores_clock_and_its_keys_expire(redis):
    async def run():
        store = _store(redis.url, "a")
        buckets = [(("addr", "192.0.2.9"), 2, 0.3)]
        assert [await store.throttle_guess(buckets) for _ in range(2)] == [0.0, 0.0]
        wait = await store.throttle_guess(buckets)
        assert 0.2 < wait <= 0.3  # level 2 of a burst of 2: one must drain (0.3 s a guess)
        ttl = await store._client.pttl("sluice:login:" + '["addr","192.0.2.9"]')
        assert 0 < ttl <= 2 * 300 + 1000  # gone once drained (and a second's margin)
        await asyncio.sleep(wait + 0.05)
        assert await store.throttle_guess(buckets) == 0.0  # drained by one: one more guess
        assert await store.throttle_guess(buckets) > 0
        await asyncio.sleep(1.7)
        assert await store._client.exists("sluice:login:" + '["addr","192.0.2.9"]') == 0  # expired
        await store.close()

    asyncio.run(run())


def test_a_store_that_is_down_throttles_in_process_under_local():
    async def run():
        store = _store("redis://127.0.0.1:1/0", "a", on_error="local", client=DownStore(), timeout=0.05)
        ident = _identifier(store)
        results = [await _login(ident, "bob", f"guess-{i}") for i in range(ADDRESS_BURST + 1)]
        assert results == [Reason.CLIENT_UNKNOWN] * ADDRESS_BURST + [Reason.AUTH_THROTTLED]
        assert not store.up and len(ident._by_address) == 1  # counted here, in the bounded table
        await store.close()

    asyncio.run(run())


def test_a_store_that_is_down_refuses_password_checks_under_closed_but_not_remembered_ones():
    async def run():
        store = _store("redis://127.0.0.1:1/0", "a", on_error="closed", client=_Switch(), timeout=0.05)
        ident = _identifier(store)
        assert await _login(ident, "alice", "alice-pw") is None  # the store answers: checked and remembered
        store._client.down = True
        assert await _login(ident, "bob", "bob-pw") is Reason.STATE_STORE_UNAVAILABLE  # not remembered yet
        header = "Basic " + base64.b64encode(b"bob:wrong").decode()
        refused = await ident.match(POLICY, SimpleNamespace(peername=("192.0.2.1", 40000)), header)
        assert (refused.refusal.status, refused.refusal.retry_after) == (503, 5)
        assert "shared limit store is unreachable" in refused.refusal.message
        assert await _login(ident, "alice", "alice-pw") is None  # remembered: needs no throttle
        socks = await ident.socks5_login(POLICY, SimpleNamespace(peername=("192.0.2.1", 40001)), "bob", "bob-pw")
        assert socks.refusal.reason is Reason.STATE_STORE_UNAVAILABLE  # a SOCKS5 login is the same check
        assert len(ident._by_address) == 0
        await store.close()

    asyncio.run(run())


def test_a_check_never_waits_past_the_timeout_on_a_store_that_does_not_answer():
    async def run():
        answers = {}
        for on_error in ("local", "closed"):
            store = _store("redis://127.0.0.1:1/0", "a", on_error=on_error, client=SilentStore(), timeout=0.05)
            ident = _identifier(store)
            t0 = time.monotonic()
            answers[on_error] = await _login(ident, "bob", "wrong")
            assert time.monotonic() - t0 < 0.5  # the timeout (50 ms), a hash of 10,000 rounds and the loop's slack
            assert not store.up  # it was asked, and given up on
            await store.close()
        assert answers == {"local": Reason.CLIENT_UNKNOWN, "closed": Reason.STATE_STORE_UNAVAILABLE}

    asyncio.run(run())


class _Switch(DownStore):
    """Answers the throttle script as a store with room would ('0': charged) until `down` is set."""

    down = False

    def register_script(self, text: str):
        failing = super().register_script(text)

        async def run(keys=(), args=()):
            return await failing(keys, args) if self.down else "0"
        return run
