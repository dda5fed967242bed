"""Who is asking: Proxy-Authorization Basic credentials, SOCKS5
username/password (RFC 1929) or the source address, matched to a client
profile by policy.clients (`identify`, then `checked`).

A SOCKS5 client authenticates once, in its handshake (`socks5_login`, from
the gate's `socks5_auth` hook), before it names a destination; the profile
its credentials matched is kept in the connection's ConnState
(sluice/connstate.py) until the connection ends, and every `match` for that connection (the
gate's `server_connect`) uses it, with the live policy's rules for it.

Password verifiers (PBKDF2, 40-120 ms a check) must never stall the proxy:

- The hash runs in a small thread pool (hashlib releases the GIL), never on
  the event loop. At most MAX_PENDING_CHECKS distinct checks are queued or
  running; past that a check is refused at once (407 `auth_throttled`).
  Identical concurrent checks share one hash.
- Only successes are remembered (bounded LRU, keyed by a keyed BLAKE2 of
  verifier and password, never the password): a client hashes once, then
  passes in microseconds.
- Wrong passwords are counted per source address and per username, as leaky
  buckets in bounded tables. Past the burst, a check that is not a
  remembered success is refused with 407 `auth_throttled` and Retry-After,
  after a THROTTLED_DELAY_SECONDS pause, so a flooder's own connection
  cannot send more than about one guess a second.
- A remembered success passes even from a throttled address or for a
  throttled username: an attacker who knows an agent's username (or shares
  its address) cannot lock the agent out once it has logged in. Only a
  password that is right and not yet remembered (the first use after a
  start, a reload that changed the hash, or past the cache's size) waits out
  the throttle like a guess would.

With the policy's `state.store` (sluice/state_store.py) the throttles'
levels live in the store instead, shared by every process on it (one Lua
script checks and charges both buckets, on the store's clock), so a login
throttle on one process holds on the others. No check waits on the store
longer than `state.timeout`. While the store is down a check throttles in
this process (`state.on_error: local`) or (`closed`) is refused with
`state_store_unavailable`; a remembered success passes either way (it
needs no throttle).

Every parameter is a constant below, documented in docs/policy.md.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import math
import os
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from mitmproxy import connection
from mitmproxy.proxy import mode_specs

from sluice import connstate
from sluice.addons.audit import quote_client

from sluice.policy.clients import (
    VIA_HTTP,
    VIA_SOCKS5,
    VIA_SOURCE,
    ClientIdentity,
    ClientMatch,
    PasswordCheck,
    checked,
    identify,
    identity_of,
    profile_match,
    throttle_store_down,
    throttled,
    verify_password,
)
from sluice.policy.model import Policy
from sluice.policy.quotas import CountersUnavailable, source_group

if TYPE_CHECKING:
    from sluice.state_store import StoreCounters

PROXY_AUTHORIZATION = "Proxy-Authorization"

# ---- the throttling parameters (one place; docs/policy.md explains them) ----
# Hash threads: one on a 2-core machine, so hashing can never take the core
# the event loop runs on; two where there are cores to spare.
HASH_WORKERS = max(1, min(2, (os.cpu_count() or 1) // 2))
# Distinct checks queued or running: about a second of work for one worker.
MAX_PENDING_CHECKS = 8
SUCCESS_CACHE_ENTRIES = 4096
# Per source address: 5 wrong passwords at once, then one more every 12 s.
ADDRESS_BURST = 5
ADDRESS_REFILL_SECONDS = 12.0
# Per username (whatever the address): 10 at once, then one every 6 s.
USERNAME_BURST = 10
USERNAME_REFILL_SECONDS = 6.0
# Addresses (and usernames) tracked at once; the least recently seen go first.
TRACKED_KEYS = 10_000
# A throttled or "busy" refusal is answered after this pause (no CPU spent).
THROTTLED_DELAY_SECONDS = 1.0
BUSY_RETRY_AFTER = 1  # seconds


def parse_basic(header: str | None) -> tuple[str, str] | None:
    """(username, password) from a `Basic` Proxy-Authorization value, else None."""
    if not header:
        return None
    scheme, _, value = header.strip().partition(" ")
    if scheme.lower() != "basic" or not value:
        return None
    try:
        decoded = base64.b64decode(value.strip(), validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        return None
    user, sep, password = decoded.partition(":")
    return (user, password) if sep else None


def _throttle_key(source: str | None, ipv6_prefix: int = 64) -> str | None:
    """What wrong passwords are counted against: the address, or for IPv6 its
    network (`limits.ipv6_client_prefix`, /64 by default), which one host
    usually holds whole (per-address counting would let it rotate addresses).
    The quotas count sources the same way."""
    return source_group(source, ipv6_prefix)


def _socks_login(client: connection.Client) -> tuple[str | None, str] | None:
    state = connstate.peek(client)
    return state.socks_login if state is not None else None


def _source(client: connection.Client) -> str | None:
    source = client.peername[0] if client.peername else None
    if source and source.startswith("::ffff:"):
        source = source[7:]  # dual-stack sockets report IPv4 clients as mapped
    return source


def _via(client: connection.Client) -> str:
    """How this client could name itself, for a require_client refusal."""
    mode = getattr(client, "proxy_mode", None)
    if mode is None or isinstance(mode, (mode_specs.RegularMode, mode_specs.UpstreamMode)):
        return VIA_HTTP
    if isinstance(mode, mode_specs.Socks5Mode):
        return VIA_SOCKS5
    return VIA_SOURCE


class FailureThrottle:
    """Wrong passwords per key as a leaky bucket: each failure adds one, the
    level drains by one every `refill_seconds`; a key whose level has reached
    `burst` is throttled until it drains below. At most `capacity` keys are
    kept (least recently charged dropped first), so a flood of distinct keys
    costs bounded memory; a dropped key merely starts again at its burst."""

    def __init__(self, burst: int, refill_seconds: float, capacity: int = TRACKED_KEYS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.burst = burst
        self.refill_seconds = refill_seconds
        self.capacity = capacity
        self._clock = clock
        self._levels: OrderedDict[Hashable, tuple[float, float]] = OrderedDict()  # key -> (level, when)

    def __len__(self) -> int:
        return len(self._levels)

    def _level(self, key: Hashable, now: float) -> float:
        entry = self._levels.get(key)
        if entry is None:
            return 0.0
        level = entry[0] - (now - entry[1]) / self.refill_seconds
        if level <= 0:
            del self._levels[key]
            return 0.0
        return level

    def retry_after(self, key: Hashable) -> float:
        """Seconds until `key` may try again; 0 when it may now."""
        level = self._level(key, self._clock())
        excess = level - (self.burst - 1)
        return excess * self.refill_seconds if excess > 0 else 0.0

    def charge(self, key: Hashable) -> None:
        now = self._clock()
        self._levels[key] = (self._level(key, now) + 1, now)
        self._levels.move_to_end(key)
        while len(self._levels) > self.capacity:
            self._levels.popitem(last=False)

    def refund(self, key: Hashable) -> None:
        """Take back one charge (the password turned out right)."""
        now = self._clock()
        level = self._level(key, now)
        if level > 0:
            self._levels[key] = (max(0.0, level - 1), now)


class _Guess:
    """One password check's charge: the throttle keys it counts against, and
    the store it was charged to (None: this process's throttles)."""

    __slots__ = ("source", "username", "shared")

    def __init__(self, source: str | None, username: str | None) -> None:
        self.source, self.username = source, username
        self.shared: StoreCounters | None = None

    @property
    def buckets(self) -> list[tuple[Hashable, int, float]]:
        """(store key, burst, refill seconds) of each throttle it counts against."""
        buckets: list[tuple[Hashable, int, float]] = []
        if self.source:
            buckets.append((("addr", self.source), ADDRESS_BURST, ADDRESS_REFILL_SECONDS))
        if self.username is not None:
            buckets.append((("user", self.username), USERNAME_BURST, USERNAME_REFILL_SECONDS))
        return buckets


class ClientIdentifier:
    """`verify`, `clock` and `sleep` are injectable for tests."""

    def __init__(
        self,
        verify: Callable[[str, str], bool] = verify_password,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self._verify_password = verify
        self._sleep = sleep
        # In this process: without a store, and while one is down (on_error: local).
        self._by_address = FailureThrottle(ADDRESS_BURST, ADDRESS_REFILL_SECONDS, TRACKED_KEYS, clock)
        self._by_username = FailureThrottle(USERNAME_BURST, USERNAME_REFILL_SECONDS, TRACKED_KEYS, clock)
        # The policy's shared store, when it names one (the quota addon sets it
        # as it connects: addons/quotas.py `use_state`).
        self.store: StoreCounters | None = None
        self._successes: OrderedDict[bytes, None] = OrderedDict()
        self._pending: dict[bytes, asyncio.Future[bool]] = {}
        self._pool: ThreadPoolExecutor | None = None  # made on first use: no threads without users
        # Keys the success cache: its keys reveal nothing about passwords,
        # even to someone who reads the process's memory without this secret.
        self._cache_secret = os.urandom(32)
        # A client connection's SOCKS5 login (the profile it matched, the
        # username) is its ConnState's `socks_login` (sluice/connstate.py).

    async def match(self, policy: Policy, client: connection.Client, authorization: str | None) -> ClientMatch:
        login = _socks_login(client) if authorization is None else None
        if login is not None:
            # Identified by its SOCKS5 login: that profile, with today's rules.
            return profile_match(policy, login[0])
        source = _source(client)
        credentials = parse_basic(authorization)
        if authorization and credentials is None:
            credentials = ("", "")  # present but unreadable: treat as wrong credentials
        username, password = credentials if credentials else (None, None)
        step = identify(policy, source, username, password, _via(client))
        if isinstance(step, PasswordCheck):
            assert password is not None  # identify asks for a check only with a password
            return await self._check(policy, source, step, password)
        return step

    async def socks5_login(self, policy: Policy, client: connection.Client, username: str,
                           password: str) -> ClientMatch | None:
        """A SOCKS5 username/password, checked exactly like Proxy-Authorization
        (same verifiers, cache and throttles). None when credentials do not
        count (the policy defines no users: the client is then known by its
        source address); else the match, whose profile is kept for this
        connection when the password is right."""
        if not any(profile.credentials for profile in policy.clients):
            return None
        source = _source(client)
        step = identify(policy, source, username, password, VIA_SOCKS5)
        result = await self._check(policy, source, step, password) if isinstance(step, PasswordCheck) else step
        if result.refusal is None:
            connstate.state_of(client).socks_login = (result.profile, username)
        return result

    def identity(self, policy: Policy, client: connection.Client, authorization: str | None,
                 match: ClientMatch) -> ClientIdentity | None:
        """Who this client proved to be in `match` (None if it was refused),
        kept with its tunnels so a reload can match it again (`rematch`)."""
        if match.refusal is not None:
            return None
        login = _socks_login(client) if authorization is None else None
        if login is not None:
            username = login[1]
        else:
            credentials = parse_basic(authorization)
            username = credentials[0] if credentials else None
        return identity_of(policy, _source(client), username, _via(client))

    def socks5_user(self, client: connection.Client) -> str | None:
        """The username this connection's SOCKS5 login matched, for the audit log."""
        login = _socks_login(client)
        return quote_client(login[1], 64) if login is not None else None


    async def _check(self, policy: Policy, source: str | None, check: PasswordCheck, password: str) -> ClientMatch:
        source = _throttle_key(source, policy.rules.limits.ipv6_client_prefix)
        key = self._cache_key(check.verifier, password) if check.verifier is not None else None
        if key is not None:
            if key in self._successes:
                self._successes.move_to_end(key)
                return checked(policy, check, True)  # even when throttled: see the module docstring
            shared = self._pending.get(key)
            if shared is not None:  # the same check is already running: share its answer
                return checked(policy, check, await asyncio.shield(shared))
        # No such user (no verifier): a guess from this address, but no username's.
        guess = _Guess(source, check.username if check.verifier is not None else None)
        try:
            wait = await self._charge(guess)
        except CountersUnavailable:  # the shared store is down and the policy says on_error: closed
            return throttle_store_down(policy)
        if wait > 0:
            await self._sleep(THROTTLED_DELAY_SECONDS)
            return throttled(policy, max(1, math.ceil(wait - THROTTLED_DELAY_SECONDS)))
        if key is None:  # no such user: wrong without hashing
            return checked(policy, check, False)
        if len(self._pending) >= MAX_PENDING_CHECKS:
            self._refund(guess)  # never checked: not a guess
            await self._sleep(THROTTLED_DELAY_SECONDS)
            return throttled(policy, BUSY_RETRY_AFTER, busy=True)
        # Charged before hashing, so concurrent guesses see each other;
        # refunded if the password is right.
        future = asyncio.get_running_loop().run_in_executor(self._executor(), self._verify_password, check.verifier,
                                                            password)
        self._pending[key] = future
        future.add_done_callback(lambda done: self._finished(key, guess, done))
        # shield: a client that goes away must not cancel a check others share
        return checked(policy, check, await asyncio.shield(future))

    async def _charge(self, guess: _Guess) -> float:
        """Charge one guess to its address's and username's throttles: 0.0,
        or (throttled, nothing charged) the seconds until one is allowed.
        In the shared store when there is one and it answers, else here;
        `CountersUnavailable` when it is down and on_error is closed."""
        store = self.store
        if store is not None and guess.buckets:
            try:
                wait = await store.throttle_guess(guess.buckets)
            except CountersUnavailable:
                if store.refuses_while_down:
                    raise
            else:
                guess.shared = store
                return wait
        wait = max(self._by_address.retry_after(guess.source) if guess.source else 0.0,
                   self._by_username.retry_after(guess.username) if guess.username is not None else 0.0)
        if wait > 0:
            return wait
        if guess.source:
            self._by_address.charge(guess.source)
        if guess.username is not None:
            self._by_username.charge(guess.username)
        return 0.0

    def _refund(self, guess: _Guess) -> None:
        """Take back a guess's charge, where it was made."""
        if guess.shared is not None:
            guess.shared.throttle_refund(guess.buckets)
            return
        if guess.source:
            self._by_address.refund(guess.source)
        if guess.username is not None:
            self._by_username.refund(guess.username)

    def _finished(self, key: bytes, guess: _Guess, done: asyncio.Future[bool]) -> None:
        self._pending.pop(key, None)
        if done.cancelled() or done.exception() is not None or not done.result():
            return
        self._successes[key] = None
        self._successes.move_to_end(key)
        while len(self._successes) > SUCCESS_CACHE_ENTRIES:
            self._successes.popitem(last=False)
        self._refund(guess)

    def _cache_key(self, verifier: str, password: str) -> bytes:
        h = hashlib.blake2b(key=self._cache_secret, digest_size=16)
        h.update(verifier.encode())
        h.update(b"\0")  # verifiers are ASCII without NUL, so the split is unambiguous
        h.update(password.encode())
        return h.digest()

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=HASH_WORKERS, thread_name_prefix="sluice-password")
        return self._pool
