"""Per-client quotas, the pure part: the counters the quota addon
(addons/quotas.py) counts through, and the checks that turn a policy's
quota `limits` and those counters into refusals. No sockets and no clock of
its own: every call is given `now` (seconds on a monotonic clock).

Who is counted:

- `max_connections`: client connections from one source address (identity
  is not known when a connection is accepted).
- `max_total_connections`: every client connection of the process.
- everything else (`max_tunnels`, `requests_per_second`/`burst`,
  `bytes_per_hour`, `max_requests_per_host_per_minute`) per *client*: the
  proxy user once a request names one (Proxy-Authorization, a SOCKS5 login),
  else the source address (`client_key`).

A source address is counted as its `source_group`: an IPv4 address itself,
an IPv6 address by its network of `limits.ipv6_client_prefix` bits (default
/64, which one host usually holds whole: per-address counting would let it
rotate addresses past every limit). Login throttling counts the same way.

The counters sit behind the `Counters` protocol, so a store shared by
processes or replicas replaces `MemoryCounters` without touching the
addon or the gate. The refusals are pure functions of the limits and what
the counters answered; only the counting awaits. `MemoryCounters` keeps memory bounded: a key is dropped
once it carries no information (a bucket that has refilled, a window that
ended, a count back at zero), swept at most every SWEEP_SECONDS; past
MAX_KEYS buckets or windows the oldest are forgotten (forgetting only ever
lets a client through, never refuses one).
"""

from __future__ import annotations

import ipaddress
import math
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Protocol

from sluice.policy.model import Limits
from sluice.policy.reasons import Reason, Refusal
from sluice.policy.units import size_text

# A counter's key: a kind tag, then who (profile, user or source) and what.
QuotaKey = tuple[str | None, ...]

HOUR = 3600.0
MINUTE = 60.0
SWEEP_SECONDS = 10.0
MAX_KEYS = 100_000
TOTAL_KEY = ("total",)


class CountersUnavailable(Exception):
    """A shared store could not answer a step that needs a shared limit, and
    its policy refuses such steps while the store is down (`state.on_error:
    closed`; with `local` the store answers from this process instead). The
    text says why, for operators; the checks below turn it into the agent's
    refusal (`store_down_refusal`)."""


# Counted by each process whatever the store: its own file descriptors.
PROCESS_KINDS = frozenset({"total", "open"})


class Counters(Protocol):
    """What quotas count with: the one interface of every counter store.

    A step that decides something (`take`, `acquire`, `count`, `window`)
    is awaited, one atomic step each, so a store shared by processes
    (sluice/state_store.py) can make it one round trip. `spend` and
    `release` never wait: bytes are charged as they pass, in callbacks
    that cannot await (a store charges them against its own view and
    settles with the shared window in batches), and a release needs no
    answer (a store sends it in the background). `spent` is that view,
    for the message of a transfer cut.

    `now` is this process's monotonic clock; a shared store may measure
    its buckets and windows on its own clock instead.

    A shared store that is down may raise `CountersUnavailable` from a step
    that decides against a limit (`take`, `window`, `count`, an `acquire`
    with a limit), never from the others."""

    async def take(self, key: Hashable, rate: float, burst: float, now: float) -> float:
        """Token bucket `key` (holds up to `burst`, refills `rate` a second,
        starts full): take one token and return 0.0, or take nothing and
        return the seconds until one is there."""

    def spend(self, key: Hashable, amount: int, limit: int | None, period: float, now: float) -> int:
        """Fixed window of `period` seconds from its first use: add up to
        `amount` without passing `limit` (None: no limit); return how much
        was added."""

    def spent(self, key: Hashable, period: float, now: float) -> tuple[int, float]:
        """`window` as this process last knew it, without waiting."""

    async def window(self, key: Hashable, period: float, now: float) -> tuple[int, float]:
        """(used in the current window, seconds until it resets)."""

    async def acquire(self, key: Hashable, limit: int | None) -> bool:
        """Count one more concurrent holder of `key` if fewer than `limit`
        (None: no limit) hold it; False, counting nothing, otherwise."""

    def release(self, key: Hashable) -> None:
        """One holder of `key` fewer."""

    async def count(self, key: Hashable) -> int:
        """How many hold `key`."""


class MemoryCounters:
    """Counters in this process's memory (see the module docstring)."""

    __slots__ = ("_buckets", "_windows", "_counts", "_swept", "max_keys")

    def __init__(self, max_keys: int = MAX_KEYS) -> None:
        self._buckets: dict[Hashable, list[float]] = {}  # key -> [tokens, last, rate, burst]
        self._windows: dict[Hashable, list[float]] = {}  # key -> [used, start, period]
        self._counts: dict[Hashable, int] = {}
        self._swept = -math.inf
        self.max_keys = max_keys

    def __len__(self) -> int:
        return len(self._buckets) + len(self._windows) + len(self._counts)

    async def take(self, key: Hashable, rate: float, burst: float, now: float) -> float:
        self._maybe_sweep(now)
        state = self._buckets.get(key)
        if state is None:
            self._make_room(self._buckets, now)
            state = self._buckets[key] = [float(burst), now, rate, burst]
        else:
            tokens = state[0] + max(0.0, now - state[1]) * rate
            state[0] = tokens if tokens < burst else float(burst)
            state[1], state[2], state[3] = now, rate, burst
        if state[0] >= 1.0:
            state[0] -= 1.0
            return 0.0
        return (1.0 - state[0]) / rate

    def spend(self, key: Hashable, amount: int, limit: int | None, period: float, now: float) -> int:
        self._maybe_sweep(now)
        state = self._windows.get(key)
        if state is None or now >= state[1] + state[2]:
            if state is None:
                self._make_room(self._windows, now)
            state = self._windows[key] = [0, now, period]
        granted = amount if limit is None else max(0, min(amount, limit - int(state[0])))
        state[0] += granted
        return granted

    async def window(self, key: Hashable, period: float, now: float) -> tuple[int, float]:
        return self.spent(key, period, now)

    def spent(self, key: Hashable, period: float, now: float) -> tuple[int, float]:
        state = self._windows.get(key)
        if state is None or now >= state[1] + state[2]:
            return 0, period
        return int(state[0]), state[1] + state[2] - now

    async def acquire(self, key: Hashable, limit: int | None) -> bool:
        held = self._counts.get(key, 0)
        if limit is not None and held >= limit:
            return False
        self._counts[key] = held + 1
        return True

    def release(self, key: Hashable) -> None:
        held = self._counts.get(key, 0) - 1
        if held > 0:
            self._counts[key] = held
        else:
            self._counts.pop(key, None)

    async def count(self, key: Hashable) -> int:
        return self._counts.get(key, 0)

    # ---- bounded memory ----------------------------------------------------

    def _maybe_sweep(self, now: float) -> None:
        if now - self._swept >= SWEEP_SECONDS:
            self.sweep(now)

    def sweep(self, now: float) -> None:
        """Drop every bucket that has refilled and every window that ended."""
        self._swept = now
        full = [k for k, (tokens, last, rate, burst) in self._buckets.items() if tokens + (now - last) * rate >= burst]
        for k in full:
            del self._buckets[k]
        ended = [k for k, (_, start, period) in self._windows.items() if now >= start + period]
        for k in ended:
            del self._windows[k]

    def _make_room(self, table: dict[Hashable, list[float]], now: float) -> None:
        if len(table) < self.max_keys:
            return
        self.sweep(now)
        while len(table) >= self.max_keys:
            del table[next(iter(table))]  # the oldest key: forgetting it only lets its client through


# ---- who is counted --------------------------------------------------------


def source_group(source: str | None, ipv6_prefix: int = 64) -> str | None:
    """What a source address is counted as: an IPv4 address itself, an IPv6
    address its network of `ipv6_prefix` bits (`2001:db8:1:2::/64`)."""
    if source is None or ":" not in source:
        return source
    try:
        return str(ipaddress.IPv6Network(f"{source.split('%', 1)[0]}/{ipv6_prefix}", strict=False))
    except ValueError:
        return source


def client_key(profile: str | None, user: str | None, source: str | None) -> QuotaKey:
    """The client a request is counted against: its proxy user once known
    (with the profile it matched), else its source (`source_group`)."""
    if user:
        return ("user", profile, user)
    return ("addr", source)


def connection_key(source: str | None) -> QuotaKey:
    """`source`: the connection's `source_group`."""
    return ("conn", source)


def tunnel_key(client: QuotaKey) -> QuotaKey:
    return ("tunnels",) + client


def bytes_key(client: QuotaKey) -> QuotaKey:
    return ("bytes",) + client


# ---- the checks --------------------------------------------------------------


def _seconds(wait: float) -> int:
    """A wait as the whole seconds of Retry-After: rounded up, so waiting
    that long is always enough."""
    return max(1, math.ceil(wait))


def _when(seconds: int) -> str:
    if seconds < 120:
        return f"{seconds} second{'s' if seconds != 1 else ''}"
    return f"{math.ceil(seconds / 60)} minutes"


def transfer_refusal(limits: Limits, resets_in: float, *, cut: bool = False) -> Refusal:
    """`bytes_per_hour` used up: a new request's refusal, or (`cut`) why an
    open tunnel was closed."""
    assert limits.bytes_per_hour is not None  # only a quota that is set can be used up
    retry = _seconds(resets_in)
    what = ("this agent used up its hourly transfer quota" if cut else "this agent has used its hourly transfer quota")
    return Refusal(Reason.QUOTA_EXCEEDED,
                   f"{what} of {size_text(limits.bytes_per_hour)}; it resets in {_when(retry)}", retry_after=retry)


def upload_refusal(limits: Limits, size: int, used: int, resets_in: float) -> Refusal:
    """A request body read whole that does not fit in what is left of
    `bytes_per_hour`: refused before it is sent, and not charged (no byte of
    it passed)."""
    assert limits.bytes_per_hour is not None  # only a quota that is set can be too small
    retry = _seconds(resets_in)
    left = max(0, limits.bytes_per_hour - used)
    return Refusal(Reason.QUOTA_EXCEEDED,
                   f"this request's {size}-byte body does not fit in what is left of this agent's hourly transfer "
                   f"quota of {size_text(limits.bytes_per_hour)} ({left} bytes left); it resets in {_when(retry)}",
                   retry_after=retry)


def rate_refusal(limits: Limits, wait: float) -> Refusal:
    """Over `requests_per_second`/`burst`: `wait` seconds until a token."""
    return Refusal(Reason.RATE_LIMITED,
                   f"this agent is over its rate limit of {limits.requests_per_second:g} requests a second (bursts "
                   f"of {limits.rate_burst}); slow down",
                   retry_after=_seconds(wait))


def host_rate_refusal(limits: Limits, host: str, wait: float) -> Refusal:
    """Over `max_requests_per_host_per_minute` to `host`."""
    return Refusal(Reason.HOST_RATE_LIMITED,
                   f"this agent is over its limit of {limits.max_requests_per_host_per_minute} requests a minute to "
                   f"{host}; other hosts are not affected", retry_after=_seconds(wait))


# Retry-After of a refusal for a shared store that is down: the store is
# probed again every second, and a store restart takes seconds; retrying
# sooner would only add load to a proxy that refuses anyway.
STORE_DOWN_RETRY_AFTER = 5


def store_down_refusal(limit: str) -> Refusal:
    """`state.on_error: closed` while the shared store is down: `limit` (the
    policy key that needs the store) cannot be checked. The store's address
    is infrastructure: the agent is not told it (the operator's stderr and
    audit lines name it)."""
    return Refusal(Reason.STATE_STORE_UNAVAILABLE,
                   f"the proxy's shared limit store is unreachable, so this agent's {limit} cannot be checked and "
                   "the policy refuses what needs it until the store is back (state.on_error: closed)",
                   retry_after=STORE_DOWN_RETRY_AFTER)


def tunnels_refusal(limits: Limits) -> Refusal:
    return Refusal(Reason.TOO_MANY_TUNNELS,
                   f"this agent already has {limits.max_tunnels} tunnels open, this policy's max_tunnels",
                   advice="Close a tunnel (or let a download finish) before opening another, then retry.")


def total_refusal(limit: int | None) -> str:
    return (f"the proxy already has {limit} client connections open, its max_total_connections; "
            "this connection was closed when it was accepted")


def source_share_refusal(total: int, share: int, source: str | None) -> str:
    return (f"{source or 'this address'} already holds {share} of the proxy's {total} client connections "
            f"(max_total_connections less {total - share} kept for other sources); "
            "this connection was closed when it was accepted")


async def check_request(counters: Counters, limits: Limits, client: QuotaKey, host: str,
                        now: float) -> Refusal | None:
    """A new request (an HTTP request, a CONNECT, a SOCKS5 or transparent
    connection): the transfer quota, the request rate and the per-host rate,
    in that order. A request that passes has taken its tokens. A limit that
    cannot be checked (`CountersUnavailable`) is refused with
    `store_down_refusal`; a request with none of these limits set never asks
    the counters."""
    if limits.bytes_per_hour is not None:
        try:
            used, resets_in = await counters.window(bytes_key(client), HOUR, now)
        except CountersUnavailable:
            return store_down_refusal("bytes_per_hour")
        if used >= limits.bytes_per_hour:
            return transfer_refusal(limits, resets_in)
    rate = limits.requests_per_second
    if rate is not None:
        try:
            wait = await counters.take(("rate",) + client, rate, limits.rate_burst, now)
        except CountersUnavailable:
            return store_down_refusal("requests_per_second")
        if wait > 0:
            return rate_refusal(limits, wait)
    per_host = limits.max_requests_per_host_per_minute
    if per_host is not None:
        try:
            wait = await counters.take(("host", host.lower()) + client, per_host / MINUTE, per_host, now)
        except CountersUnavailable:
            return store_down_refusal("max_requests_per_host_per_minute")
        if wait > 0:
            return host_rate_refusal(limits, host, wait)
    return None


async def admit_connection(counters: Counters, limits: Limits, source: str | None) -> Refusal | None:
    """Count a client connection against its source address's
    `max_connections` (from accept, or from its first request if it was
    over the limit at accept, until it closes)."""
    try:
        if await counters.acquire(connection_key(source), limits.max_connections):
            return None
    except CountersUnavailable:
        return store_down_refusal("max_connections")
    return _too_many_connections(limits, source)


async def admit_tunnel(counters: Counters, limits: Limits, client: QuotaKey) -> Refusal | None:
    """Count an open tunnel against the client's `max_tunnels`."""
    try:
        if await counters.acquire(tunnel_key(client), limits.max_tunnels):
            return None
    except CountersUnavailable:
        return store_down_refusal("max_tunnels")
    return tunnels_refusal(limits)


async def admit_total(counters: Counters, limit: int | None) -> str | None:
    """Count a newly accepted client connection against
    `max_total_connections`; None if it may stay, else why not."""
    if await counters.acquire(TOTAL_KEY, limit):
        return None
    return total_refusal(limit)


@dataclass(slots=True)
class TransferMeter:
    """Counts an open tunnel's bytes (both directions) against its client's
    `bytes_per_hour`: `__call__(n, now)` says how many of `n` bytes may pass;
    fewer than `n` means the quota ran out and the tunnel must be closed."""

    counters: Counters
    client: QuotaKey
    limit: int

    def __call__(self, n: int, now: float) -> int:
        return self.counters.spend(bytes_key(self.client), n, self.limit, HOUR, now)


# ---- slots: connections counted from accept (issue 18) ------------------------

# fds the proxy keeps for itself (listeners, audit log, DNS, admin, metrics)
# when it derives max_total_connections from its open-files limit.
FD_RESERVE = 64
# One source may hold every slot but a reserve: max(16, 5%) of
# max_total_connections (at most half of it), so other sources still connect.
SOURCE_RESERVE_MIN = 16
SOURCE_RESERVE_FRACTION = 0.05


def default_total_connections(fd_limit: int) -> int:
    """`max_total_connections` when the policy sets none: what the open-files
    limit holds at two fds a connection (the client's and one upstream's)."""
    return max(1, (fd_limit - FD_RESERVE) // 2)


def source_reserve(total: int) -> int:
    return min(max(SOURCE_RESERVE_MIN, math.ceil(total * SOURCE_RESERVE_FRACTION)), total // 2)


def source_slots_key(source: str | None) -> QuotaKey:
    """Every open connection of a source (its `source_group`), admitted or not."""
    return ("open", source)


async def admit_source_share(counters: Counters, total: int, source: str | None) -> str | None:
    """Count a newly accepted connection against its source's share of
    `max_total_connections` (all of it but `source_reserve`); None if it may
    stay, else why not."""
    share = total - source_reserve(total)
    if await counters.acquire(source_slots_key(source), share):
        return None
    return source_share_refusal(total, share, source)


async def over_connections(counters: Counters, limits: Limits, source: str | None) -> Refusal | None:
    """A connection already counted (at accept) against its source's
    `max_connections` meets the limit of the profile its first request
    identified (a user profile may set its own): refused if its source has
    more open than that."""
    if limits.max_connections is None:
        return None
    try:
        if await counters.count(connection_key(source)) <= limits.max_connections:
            return None
    except CountersUnavailable:
        return store_down_refusal("max_connections")
    return _too_many_connections(limits, source)


def _too_many_connections(limits: Limits, source: str | None) -> Refusal:
    return Refusal(Reason.TOO_MANY_CONNECTIONS,
                   f"{source or 'this address'} already has {limits.max_connections} connections open through the "
                   "proxy, this policy's max_connections for it",
                   advice="Reuse an open connection (keep-alive) or close one, then retry.")
