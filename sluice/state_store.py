"""Quota counters shared by every process through Valkey/Redis (issue 23):
`StoreCounters` implements policy.quotas.Counters over the policy's
`state.store` (policy/state.py).

- Every deciding step is one Lua script, run atomically by the server, so
  two processes can never both take the last token or the last slot.
  Token buckets measure time on the store's clock (`TIME`): the processes'
  clocks may disagree.
- Concurrent holdings (connections, tunnels) are one hash per process
  (`sluice:held:<process>`) beside a heartbeat key (`sluice:alive:<process>`,
  TTL HEARTBEAT_TTL, refreshed every HEARTBEAT_EVERY). A count sums the
  hashes of live processes; a hash whose heartbeat expired (a process
  killed with tunnels open) is deleted by the next count, so a crashed
  process's holdings are free within HEARTBEAT_TTL.
- Login-failure throttles (sluice/identity.py) are leaky buckets in the
  store (`sluice:login:<key>`): one script leaks them on the store's
  clock, refuses a guess past the burst or charges it, and sets each key
  to expire once it would have drained.
- Bytes are charged as they pass (that cannot wait), against this
  process's view of the client's hourly window, and settled with the store
  in batches of BYTE_BATCH per client (or every FLUSH_EVERY). The slack is
  BYTE_BATCH x processes (each process may pass up to one batch another
  process has already used), plus what passes during one settle's round
  trip to the store.
- No decision waits on the store longer than `state.timeout`. On a failure
  the store is marked down (one stderr line, an audit line,
  `sluice_state_store_up 0`) and, until a background ping finds it again,
  every step goes straight to the fallback: counters in this process
  (`on_error: local`), or (`closed`) `CountersUnavailable` from every step
  that needs a shared limit (`take`, `window`, `count`, an `acquire` with a
  limit), which the checks in policy.quotas turn into a
  `state_store_unavailable` refusal. What needs no limit, the process's own
  counts and bytes already passing are counted in this process either way.
  Back up, it says so, re-registers what this process holds and shares
  again.

The store is infrastructure, like the DNS server: dialled directly by this
process, not through the egress gate. Every store step runs in a task with
an empty context, so a step made while mitmproxy dials for a client (the
quota addon's `server_connect`) is never routed to Sluice's dialer
(addons/mitm_patches.py `dial_check`). Keep the store off the agents'
network.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import logging
import os
import socket
import sys
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any

from sluice.policy.quotas import PROCESS_KINDS, CountersUnavailable, MemoryCounters
from sluice.policy.state import StateSettings

logger = logging.getLogger(__name__)

PREFIX = "sluice:"
HEARTBEAT_TTL = 15.0
HEARTBEAT_EVERY = 5.0
RECONNECT_EVERY = 1.0
BYTE_BATCH = 256 * 1024
FLUSH_EVERY = 1.0

# KEYS[1] the bucket; ARGV rate, burst. Returns the wait (text: Lua numbers
# come back as integers otherwise).
TAKE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local rate, burst = tonumber(ARGV[1]), tonumber(ARGV[2])
local s = redis.call('HMGET', KEYS[1], 'tokens', 'last')
local tokens, last = tonumber(s[1]), tonumber(s[2])
if tokens == nil then
  tokens = burst
else
  tokens = math.min(burst, tokens + math.max(0, now - last) * rate)
end
local wait = 0
if tokens >= 1 then tokens = tokens - 1 else wait = (1 - tokens) / rate end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'last', tostring(now))
redis.call('PEXPIRE', KEYS[1], math.ceil(burst / rate * 1000) + 1000)
return tostring(wait)
"""

# KEYS[1] the window; ARGV amount, limit (-1: none), period in ms.
# Returns {granted, used, milliseconds left}.
SPEND = """
local used = tonumber(redis.call('GET', KEYS[1]) or '0')
local amount, limit = tonumber(ARGV[1]), tonumber(ARGV[2])
local granted = amount
if limit >= 0 then granted = math.max(0, math.min(amount, limit - used)) end
if granted > 0 then used = redis.call('INCRBY', KEYS[1], granted) end
if granted > 0 and redis.call('PTTL', KEYS[1]) < 0 then redis.call('PEXPIRE', KEYS[1], ARGV[3]) end
return {granted, used, redis.call('PTTL', KEYS[1])}
"""

# KEYS[1] the set of processes; ARGV prefix, this process, field, limit
# (-1: none), add (1: acquire, 0: count). Sums the field over live
# processes, forgetting dead ones; returns {acquired (0/1), total before}.
HOLD = """
local prefix, me, field = ARGV[1], ARGV[2], ARGV[3]
local limit, add = tonumber(ARGV[4]), tonumber(ARGV[5])
local total = 0
for _, p in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  if redis.call('EXISTS', prefix .. 'alive:' .. p) == 1 then
    total = total + tonumber(redis.call('HGET', prefix .. 'held:' .. p, field) or '0')
  else
    redis.call('DEL', prefix .. 'held:' .. p)
    redis.call('SREM', KEYS[1], p)
  end
end
if add == 0 or (limit >= 0 and total >= limit) then return {0, total} end
redis.call('HINCRBY', prefix .. 'held:' .. me, field, 1)
return {1, total}
"""

# Login-failure throttles (sluice/identity.py), leaky buckets of wrong
# passwords: KEYS the buckets (an address's, a username's); ARGV amount
# (1: a guess, -1: a refund), then burst and refill seconds for each key.
# Each level drains by one every refill seconds of the store's clock. A
# guess is refused, charging nothing, while any bucket's level is past
# burst - 1 (returns the seconds until it is not); else every bucket is
# charged (returns '0'). A bucket expires once it would have drained to 0.
THROTTLE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local amount = tonumber(ARGV[1])
local levels, wait = {}, 0
for i, key in ipairs(KEYS) do
  local burst, refill = tonumber(ARGV[2 * i]), tonumber(ARGV[2 * i + 1])
  local s = redis.call('HMGET', key, 'level', 'when')
  local level = 0
  if s[1] then level = math.max(0, tonumber(s[1]) - math.max(0, now - tonumber(s[2])) / refill) end
  levels[i] = level
  local excess = level - (burst - 1)
  if amount > 0 and excess > 0 then wait = math.max(wait, excess * refill) end
end
if wait > 0 then return tostring(wait) end
for i, key in ipairs(KEYS) do
  local refill = tonumber(ARGV[2 * i + 1])
  local level = math.max(0, levels[i] + amount)
  if level > 0 then
    redis.call('HSET', key, 'level', tostring(level), 'when', tostring(now))
    redis.call('PEXPIRE', key, math.ceil(level * refill * 1000) + 1000)
  else
    redis.call('DEL', key)
  end
end
return '0'
"""

# KEYS[1] this process's hash; ARGV field. One holder fewer.
RELEASE = """
local left = redis.call('HINCRBY', KEYS[1], ARGV[1], -1)
if left <= 0 then redis.call('HDEL', KEYS[1], ARGV[1]) end
return left
"""


def key_text(key: Hashable) -> str:
    """A quota key (a tuple of text or None) as the store's key text."""
    return json.dumps(list(key) if isinstance(key, tuple) else key, separators=(",", ":"))


class StoreCounters:
    """policy.quotas.Counters on a shared store (see the module docstring).
    `status(up, line)` hears every change of the store's state (the quota
    addon writes the stderr and audit lines and the metric)."""

    def __init__(self, settings: StateSettings, status: Callable[[bool, str], None] | None = None,
                 client: Any = None, process: str | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.local = MemoryCounters()  # the fallback, and the held counts taken while down
        self.process = process or f"{socket.gethostname()}:{os.getpid()}:{os.urandom(3).hex()}"
        self.up = True
        self._status = status or (lambda up, line: None)
        self._clock = clock
        self._client = client if client is not None else _connect(settings)
        self._scripts = {name: self._client.register_script(text)
                         for name, text in (("take", TAKE), ("spend", SPEND), ("hold", HOLD), ("release", RELEASE),
                                            ("throttle", THROTTLE))}
        self._held: dict[str, int] = {}  # field -> holders this process has counted in the store
        self._bytes: dict[Hashable, list[float]] = {}  # key -> [known used, unsettled, resets at, period]
        self._tasks: set[asyncio.Task[Any]] = set()
        self._loop_task: asyncio.Task[None] | None = None
        self._closed = False

    # ---- lifecycle -------------------------------------------------------------

    async def start(self) -> None:
        """Register this process and keep its heartbeat (and batches) going."""
        if self._loop_task is None:
            self._loop_task = asyncio.get_running_loop().create_task(self._keepalive(), context=contextvars.Context())
        try:
            await self._guard(self._register())
        except CountersUnavailable:
            pass  # reported; the keepalive reconnects

    async def close(self) -> None:
        self._closed = True
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(BaseException):
                await self._loop_task
        with contextlib.suppress(Exception):
            async with asyncio.timeout(self.settings.timeout * 4):
                await self._settle_all()
                await self._client.delete(self._held_key, self._alive_key)
                await self._client.srem(PREFIX + "procs", self.process)
        with contextlib.suppress(Exception):
            await self._client.aclose()

    @property
    def _held_key(self) -> str:
        return f"{PREFIX}held:{self.process}"

    @property
    def _alive_key(self) -> str:
        return f"{PREFIX}alive:{self.process}"

    async def _register(self) -> None:
        """The heartbeat, and this process's holdings written whole (after a
        reconnect the store may have forgotten them, or be a new one)."""
        pipe = self._client.pipeline(transaction=True)
        pipe.set(self._alive_key, "1", px=int(HEARTBEAT_TTL * 1000))
        pipe.sadd(PREFIX + "procs", self.process)
        pipe.delete(self._held_key)
        held = {f: n for f, n in self._held.items() if n > 0}
        if held:
            pipe.hset(self._held_key, mapping=held)
        await pipe.execute()

    async def _keepalive(self) -> None:
        beat = flush = 0.0
        while not self._closed:
            await asyncio.sleep(min(RECONNECT_EVERY, FLUSH_EVERY, HEARTBEAT_EVERY))
            now = self._clock()
            if not self.up:
                try:
                    async with asyncio.timeout(max(self.settings.timeout, 0.5)):
                        await self._client.ping()
                        await self._register()
                except Exception:
                    continue
                self.up = True
                beat = now
                self._status(True, f"sluice: state store {self.settings.where} is reachable again; quotas are "
                                   "shared again")
                continue
            try:
                if now - beat >= HEARTBEAT_EVERY:
                    await self._guard(self._client.set(self._alive_key, "1", px=int(HEARTBEAT_TTL * 1000)))
                    beat = now
                if now - flush >= FLUSH_EVERY:
                    flush = now
                    await self._guard(self._settle_all())
            except CountersUnavailable:
                pass

    async def _guard(self, step: Any) -> Any:
        """Await a store step for at most the timeout; a failure marks the store down."""
        if not self.up:
            _drop(step)
            raise CountersUnavailable(self._down_why)
        try:
            async with asyncio.timeout(self.settings.timeout):
                return await asyncio.get_running_loop().create_task(step, context=contextvars.Context())
        except Exception as e:
            self._down(e)
            raise CountersUnavailable(self._down_why) from None

    def _down(self, error: BaseException) -> None:
        if not self.up:
            return
        self.up = False
        what = "did not answer within the timeout" if isinstance(error, TimeoutError) else _short(error)
        fallback = ("refusing what needs a shared limit until it is back (on_error: closed)" if self._closed_mode
                    else "counting in this process until it is back")
        self._down_why = f"the state store {self.settings.where} is unavailable ({what})"
        self._status(False, f"sluice: state store {self.settings.where} {what}; {fallback}")

    _down_why = "the state store is unavailable"

    @property
    def _closed_mode(self) -> bool:
        return self.settings.on_error == "closed"

    def _fallback(self) -> MemoryCounters:
        """Where a step that needs a shared limit goes while the store is
        down: this process's counters, or (on_error: closed) nowhere."""
        if self._closed_mode:
            raise CountersUnavailable(self._down_why)
        return self.local

    def _spawn(self, step: Any) -> None:
        try:
            task = asyncio.get_running_loop().create_task(step, context=contextvars.Context())
        except RuntimeError:  # no loop (a release at shutdown): nothing to send it with
            _drop(step)
            return
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- Counters ----------------------------------------------------------------

    async def take(self, key: Hashable, rate: float, burst: float, now: float) -> float:
        if self.up:
            try:
                return float(await self._guard(self._scripts["take"](keys=[PREFIX + "b:" + key_text(key)],
                                                                      args=[repr(rate), repr(float(burst))])))
            except CountersUnavailable:
                pass
        return await self._fallback().take(key, rate, burst, now)

    async def acquire(self, key: Hashable, limit: int | None) -> bool:
        if _per_process(key):
            return await self.local.acquire(key, limit)
        field = key_text(key)
        if self.up:
            try:
                got, _ = await self._guard(self._scripts["hold"](
                    keys=[PREFIX + "procs"], args=[PREFIX, self.process, field, -1 if limit is None else limit, 1]))
            except CountersUnavailable:
                pass
            else:
                if got:
                    self._held[field] = self._held.get(field, 0) + 1
                return bool(got)
        if limit is None:  # nothing to refuse: counted here (released here too) whatever on_error says
            return await self.local.acquire(key, limit)
        return await self._fallback().acquire(key, limit)

    def release(self, key: Hashable) -> None:
        field = key_text(key)
        held = 0 if _per_process(key) else self._held.get(field, 0)
        if held <= 0:  # taken from the fallback while the store was down
            self.local.release(key)
            return
        if held == 1:
            del self._held[field]
        else:
            self._held[field] = held - 1
        if self.up and not self._closed:
            self._spawn(self._release(field))
        # down: re-registering on reconnect writes the holdings whole

    async def _release(self, field: str) -> None:
        with contextlib.suppress(CountersUnavailable):
            await self._guard(self._scripts["release"](keys=[self._held_key], args=[field]))

    async def count(self, key: Hashable) -> int:
        if _per_process(key):
            return await self.local.count(key)
        if self.up:
            try:
                _, total = await self._guard(self._scripts["hold"](
                    keys=[PREFIX + "procs"], args=[PREFIX, self.process, key_text(key), -1, 0]))
                return int(total) + await self.local.count(key)
            except CountersUnavailable:
                pass
        return await self._fallback().count(key)

    # ---- login-failure throttles (sluice/identity.py) -------------------------------

    @property
    def refuses_while_down(self) -> bool:
        """on_error: closed (what needs the store is refused while it is down)."""
        return self._closed_mode

    async def throttle_guess(self, buckets: Sequence[tuple[Hashable, int, float]]) -> float:
        """One wrong-password guess against `buckets` ((key, burst, refill
        seconds) each), in one script: 0.0 and every bucket charged, or the
        seconds until a guess is allowed and nothing charged.
        `CountersUnavailable` while the store is down, whatever on_error
        says: the caller throttles in process or refuses."""
        return float(await self._guard(self._scripts["throttle"](
            keys=[_throttle_key(key) for key, _, _ in buckets],
            args=[1, *(v for _, burst, refill in buckets for v in (burst, repr(float(refill))))])))

    def throttle_refund(self, buckets: Sequence[tuple[Hashable, int, float]]) -> None:
        """Take back one guess (the password was right), in the background:
        nothing waits for it, and while the store is down it is dropped (the
        levels drain by themselves)."""
        if self.up and not self._closed:
            self._spawn(self._throttle_refund(buckets))

    async def _throttle_refund(self, buckets: Sequence[tuple[Hashable, int, float]]) -> None:
        with contextlib.suppress(CountersUnavailable):
            await self._guard(self._scripts["throttle"](
                keys=[_throttle_key(key) for key, _, _ in buckets],
                args=[-1, *(v for _, burst, refill in buckets for v in (burst, repr(float(refill))))]))

    # ---- bytes: charged now, settled in batches ------------------------------------

    def spend(self, key: Hashable, amount: int, limit: int | None, period: float, now: float) -> int:
        if not self.up:
            return self.local.spend(key, amount, limit, period, now)  # a transfer under way goes on, counted here
        view = self._view(key, period, now)
        used = int(view[0] + view[1])
        granted = amount if limit is None else max(0, min(amount, limit - used))
        view[1] += granted
        if view[1] >= BYTE_BATCH:
            self._spawn(self._settle_soon(key))
        return granted

    def spent(self, key: Hashable, period: float, now: float) -> tuple[int, float]:
        if not self.up:
            return self.local.spent(key, period, now)
        view = self._bytes.get(key)
        if view is None or now >= view[2]:
            return 0, period
        return int(view[0] + view[1]), view[2] - now

    async def window(self, key: Hashable, period: float, now: float) -> tuple[int, float]:
        if self.up:
            try:
                await self._guard(self._settle(key, period, now))
                return self.spent(key, period, now)
            except CountersUnavailable:
                pass
        return await self._fallback().window(key, period, now)

    def _view(self, key: Hashable, period: float, now: float) -> list[float]:
        view = self._bytes.get(key)
        if view is None or now >= view[2]:
            view = self._bytes[key] = [0.0, view[1] if view is not None else 0.0, now + period, period]
        return view

    async def _settle(self, key: Hashable, period: float | None = None, now: float | None = None) -> None:
        """Charge this process's unsettled bytes of `key` to the store and
        learn the window's total from it."""
        view = self._bytes.get(key)
        if view is None:
            if period is None or now is None:
                return
            view = self._view(key, period, now)
        sending = int(view[1])
        view[1] -= sending  # before the await: a concurrent settle must not send the same bytes
        try:
            _, used, ttl_ms = await self._scripts["spend"](keys=[PREFIX + "w:" + key_text(key)],
                                                           args=[sending, -1, int(view[3] * 1000)])
        except BaseException:
            view[1] += sending  # not charged: the next settle sends them
            raise
        view[0] = float(used)
        left = ttl_ms / 1000 if ttl_ms > 0 else view[3]
        view[2] = self._clock() + left

    async def _settle_soon(self, key: Hashable) -> None:
        with contextlib.suppress(CountersUnavailable):
            await self._guard(self._settle(key))

    async def _settle_all(self) -> None:
        now = self._clock()
        for key, view in list(self._bytes.items()):
            if now >= view[2] and view[1] == 0:
                del self._bytes[key]
            elif view[1] > 0:
                await self._settle(key)


def _throttle_key(key: Hashable) -> str:
    return PREFIX + "login:" + key_text(key)


def _per_process(key: Hashable) -> bool:
    """max_total_connections and each source's share of it count this
    process's own file descriptors: never shared."""
    return isinstance(key, tuple) and bool(key) and key[0] in PROCESS_KINDS


def _connect(settings: StateSettings) -> Any:
    import redis.asyncio as aioredis

    password = settings.password.reveal() if settings.password is not None and settings.password.known else None
    return aioredis.Redis.from_url(settings.url, password=password, socket_timeout=settings.timeout * 4,
                                   socket_connect_timeout=max(settings.timeout * 4, 0.5), retry_on_timeout=False,
                                   health_check_interval=0, decode_responses=True)


def _drop(step: Any) -> None:
    close = getattr(step, "close", None)
    if callable(close):
        close()


def _short(error: BaseException) -> str:
    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    return text[:160]


def stderr_status(up: bool, line: str) -> None:
    print(line, file=sys.stderr, flush=True)
