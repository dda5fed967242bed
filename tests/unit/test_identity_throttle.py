"""sluice.identity: password checks off the event loop, only successes cached,
wrong passwords throttled per address and per username (injected clock,
verifier and sleep: nothing here waits or measures time)."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import threading
from types import SimpleNamespace

import pytest

from sluice import identity
from sluice.identity import (
    ADDRESS_BURST,
    ADDRESS_REFILL_SECONDS,
    MAX_PENDING_CHECKS,
    THROTTLED_DELAY_SECONDS,
    USERNAME_BURST,
    USERNAME_REFILL_SECONDS,
    ClientIdentifier,
    FailureThrottle,
)
from sluice.refusals import refusal_headers
from sluice.policy.clients import PasswordCheck, identify, throttled
from sluice.policy.loader import hash_password, load_policy_text
from sluice.policy.reasons import Reason


def _sha(password: str) -> str:
    # A real verifier (pbkdf2, few iterations, fixed salt: the same for each call).
    return hash_password(password, iterations=10_000, salt=b"0123456789abcdef")


USERS = {"alice": "alice-pw", "bob": "bob-pw"}
POLICY = load_policy_text(
    "version: 1\nrequire_client: true\nclients:\n  - name: agents\n    users:\n"
    + "".join(f'      {u}: {{password_hash: "{_sha(pw)}"}}\n' for u, pw in USERS.items()),
    "p.yaml",
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Harness:
    """A ClientIdentifier with a fake clock, a counting verifier and a sleep
    that only records how long it was asked to wait."""

    def __init__(self, verify=None) -> None:
        self.clock = Clock()
        self.hashed: list[tuple[str, str]] = []
        self.threads: set[str] = set()
        self.slept: list[float] = []

        def counting_verify(verifier: str, password: str) -> bool:
            self.hashed.append((verifier, password))
            self.threads.add(threading.current_thread().name)
            return verifier == _sha(password)

        async def sleep(seconds: float) -> None:
            self.slept.append(seconds)

        self.ident = ClientIdentifier(verify=verify or counting_verify, clock=self.clock, sleep=sleep)

    def match(self, user: str, password: str, source: str = "192.0.2.1"):
        return asyncio.run(self.amatch(user, password, source))

    async def amatch(self, user: str, password: str, source: str = "192.0.2.1"):
        header = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
        return await self.ident.match(POLICY, SimpleNamespace(peername=(source, 40000)), header)


def _reason(m):
    return m.refusal.reason if m.refusal else None


# ---- FailureThrottle -------------------------------------------------------


def test_throttle_allows_the_burst_then_refuses_until_it_drains():
    clock = Clock()
    t = FailureThrottle(burst=3, refill_seconds=10.0, clock=clock)
    for _ in range(3):
        assert t.retry_after("k") == 0
        t.charge("k")
    assert t.retry_after("k") == pytest.approx(10.0)  # level 3: one must drain first
    clock.now += 4
    assert t.retry_after("k") == pytest.approx(6.0)
    clock.now += 6
    assert t.retry_after("k") == 0  # one more attempt allowed...
    t.charge("k")
    assert t.retry_after("k") == pytest.approx(10.0)  # ...and only one
    assert t.retry_after("other") == 0  # keys are independent


def test_throttle_refund_takes_back_a_charge_and_drained_keys_are_forgotten():
    clock = Clock()
    t = FailureThrottle(burst=2, refill_seconds=5.0, clock=clock)
    t.charge("k")
    t.charge("k")
    assert t.retry_after("k") > 0
    t.refund("k")
    assert t.retry_after("k") == 0
    t.refund("never-charged")  # a no-op, never a negative level
    assert len(t) == 1
    clock.now += 5.0
    assert t.retry_after("k") == 0 and len(t) == 0  # fully drained: the entry is gone


def test_throttle_memory_is_bounded_whatever_the_number_of_keys():
    clock = Clock()
    t = FailureThrottle(burst=1, refill_seconds=60.0, capacity=100, clock=clock)
    for i in range(10_000):
        t.charge(f"198.51.100.{i}")
    assert len(t) == 100
    assert t.retry_after("198.51.100.9999") > 0  # the most recent are kept
    assert t.retry_after("198.51.100.0") == 0  # the oldest were dropped


# ---- ClientIdentifier ------------------------------------------------------


def test_a_right_password_is_hashed_once_then_remembered_off_the_event_loop():
    h = Harness()
    for _ in range(5):
        m = h.match("alice", "alice-pw")
        assert m.refusal is None and m.profile == "agents"
    assert len(h.hashed) == 1
    assert h.threads and all(name.startswith("sluice-password") for name in h.threads)


def test_wrong_passwords_are_not_remembered():
    h = Harness()
    for _ in range(3):
        assert _reason(h.match("alice", "nope")) == Reason.CLIENT_UNKNOWN
    assert len(h.hashed) == 3  # each checked again: failures are never cached


def test_the_cache_never_holds_the_password():
    h = Harness()
    h.match("alice", "alice-pw")
    (key,) = h.ident._successes
    assert b"alice-pw" not in key and hashlib.sha256(b"alice-pw").digest()[:16] != key


def test_wrong_passwords_from_one_address_are_throttled_with_retry_after():
    h = Harness()
    for _ in range(ADDRESS_BURST):
        assert _reason(h.match("alice", "guess")) == Reason.CLIENT_UNKNOWN
    hashed = len(h.hashed)
    m = h.match("bob", "another-guess")  # any username: it is the address that is throttled
    assert _reason(m) == Reason.AUTH_THROTTLED and m.refusal.status == 407
    assert m.refusal.retry_after is not None and m.refusal.retry_after >= 1
    assert refusal_headers(m.refusal)["Retry-After"] == str(m.refusal.retry_after)
    assert "Retry-After" in m.refusal.detail and "wait" in m.refusal.detail
    assert len(h.hashed) == hashed  # refused without hashing
    assert h.slept == [THROTTLED_DELAY_SECONDS]  # the refusal was held back (tarpit)
    # Another address is not affected.
    assert h.match("bob", "bob-pw", source="192.0.2.99").refusal is None


def test_a_throttled_address_recovers_as_its_bucket_drains():
    h = Harness()
    for _ in range(ADDRESS_BURST):
        h.match("alice", "guess")
    m = h.match("alice", "guess")
    assert _reason(m) == Reason.AUTH_THROTTLED
    h.clock.now += m.refusal.retry_after + THROTTLED_DELAY_SECONDS
    assert _reason(h.match("alice", "guess")) == Reason.CLIENT_UNKNOWN  # checked again
    assert _reason(h.match("alice", "guess")) == Reason.AUTH_THROTTLED  # one attempt per refill
    h.clock.now += ADDRESS_REFILL_SECONDS
    assert h.match("alice", "alice-pw").refusal is None


def test_a_remembered_success_passes_even_from_a_throttled_address():
    h = Harness()
    assert h.match("alice", "alice-pw").refusal is None  # the agent logged in earlier
    for _ in range(ADDRESS_BURST):
        h.match("alice", "guess")  # then someone on the same address guesses
    assert h.match("alice", "alice-pw").refusal is None  # the agent carries on
    # A right password not yet remembered waits out the throttle like a guess.
    assert _reason(h.match("bob", "bob-pw")) == Reason.AUTH_THROTTLED


def test_wrong_passwords_for_one_username_are_throttled_across_addresses():
    h = Harness()
    assert h.match("alice", "alice-pw", source="203.0.113.1").refusal is None
    for i in range(USERNAME_BURST):
        assert _reason(h.match("alice", f"guess-{i}", source=f"198.51.100.{i}")) == Reason.CLIENT_UNKNOWN
    m = h.match("alice", "guess-x", source="198.51.100.200")  # a fresh address
    assert _reason(m) == Reason.AUTH_THROTTLED
    assert m.refusal.retry_after == pytest.approx(USERNAME_REFILL_SECONDS - THROTTLED_DELAY_SECONDS, abs=1)
    assert h.match("bob", "bob-pw", source="198.51.100.201").refusal is None  # other users are not
    assert h.match("alice", "alice-pw", source="203.0.113.1").refusal is None  # nor alice's remembered login


def test_a_right_password_takes_back_its_charge():
    h = Harness()
    for i in range(ADDRESS_BURST + 3):  # distinct right passwords never throttle an address
        user = "alice" if i % 2 else "bob"
        h.ident._successes.clear()  # force a hash each time
        assert h.match(user, USERS[user]).refusal is None


def test_unknown_usernames_count_against_the_address_without_hashing():
    h = Harness()
    for i in range(ADDRESS_BURST):
        assert _reason(h.match(f"nobody{i}", "x")) == Reason.CLIENT_UNKNOWN
    assert h.hashed == []
    assert _reason(h.match("alice", "alice-pw")) == Reason.AUTH_THROTTLED
    assert len(h.ident._by_username) == 0  # unknown names are never tracked: no memory to fill


def test_unreadable_credentials_count_as_a_guess():
    h = Harness()
    client = SimpleNamespace(peername=("192.0.2.1", 1))
    for _ in range(ADDRESS_BURST):
        m = asyncio.run(h.ident.match(POLICY, client, "Basic !!!not-base64"))
        assert _reason(m) == Reason.CLIENT_UNKNOWN
    assert _reason(asyncio.run(h.ident.match(POLICY, client, "Basic !!!"))) == Reason.AUTH_THROTTLED


def test_too_many_pending_checks_are_refused_at_once_and_identical_ones_share_a_hash():
    release = threading.Event()
    started: list[str] = []

    def slow_verify(verifier: str, password: str) -> bool:
        started.append(password)
        release.wait(10)
        return verifier == _sha(password)

    h = Harness(verify=slow_verify)

    async def scenario():
        # Distinct addresses and users, so only the queue bound applies.
        first = [asyncio.create_task(h.amatch("alice" if i % 2 else "bob", f"guess-{i}", source=f"198.51.100.{i}"))
                 for i in range(MAX_PENDING_CHECKS - 1)]
        right = [asyncio.create_task(h.amatch("alice", "alice-pw", source="203.0.113.1")) for _ in range(3)]
        try:
            await asyncio.sleep(0)
            assert len(h.ident._pending) == MAX_PENDING_CHECKS  # the three identical checks are one
            busy = await h.amatch("bob", "bob-pw", source="203.0.113.2")
            assert _reason(busy) == Reason.AUTH_THROTTLED and busy.refusal.retry_after == 1
            assert "busy" in busy.refusal.detail
        finally:
            release.set()  # never leave the pool blocked, even when an assertion failed
        return await asyncio.gather(*first, *right)

    results = asyncio.run(scenario())
    assert [_reason(m) for m in results[: MAX_PENDING_CHECKS - 1]] == [Reason.CLIENT_UNKNOWN] * (MAX_PENDING_CHECKS - 1)
    assert all(m.refusal is None and m.profile == "agents" for m in results[MAX_PENDING_CHECKS - 1:])
    assert started.count("alice-pw") == 1
    assert h.ident._pending == {}


def test_success_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(identity, "SUCCESS_CACHE_ENTRIES", 3)
    h = Harness()

    def verify(verifier: str, password: str) -> bool:
        return True  # every password right: many distinct successes

    h.ident._verify_password = verify
    for i in range(20):
        h.clock.now += ADDRESS_REFILL_SECONDS  # stay clear of any throttle
        assert h.match("alice", f"pw-{i}", source=f"198.51.100.{i}").refusal is None
    assert len(h.ident._successes) == 3


def test_a_real_pbkdf2_verifier_is_checked_in_the_pool():
    verifier = hash_password("s3cret", iterations=10_000)
    policy = load_policy_text(
        f'version: 1\nclients:\n  - name: a\n    users:\n      bot: {{password_hash: "{verifier}"}}\n', "p.yaml")
    ident = ClientIdentifier()
    client = SimpleNamespace(peername=("::ffff:192.0.2.5", 1))

    def header(pw: str) -> str:
        return "Basic " + base64.b64encode(f"bot:{pw}".encode()).decode()

    assert asyncio.run(ident.match(policy, client, header("s3cret"))).profile == "a"
    assert _reason(asyncio.run(ident.match(policy, client, header("wrong")))) == Reason.CLIENT_UNKNOWN
    # The address was read without its IPv4-mapped prefix.
    assert "192.0.2.5" in ident._by_address._levels


# ---- policy.clients: which verifier applies, apart from verifying -----------


def test_identify_names_the_verifier_without_hashing():
    step = identify(POLICY, "192.0.2.1", "alice", "anything")
    assert isinstance(step, PasswordCheck) and step.verifier == _sha("alice-pw") and step.profile.name == "agents"
    unknown = identify(POLICY, "192.0.2.1", "mallory", "x")
    assert isinstance(unknown, PasswordCheck) and unknown.verifier is None
    assert _reason(identify(POLICY, "192.0.2.1")) == Reason.CLIENT_UNKNOWN  # require_client, no credentials


def test_throttled_refusal_is_a_407_with_retry_after():
    m = throttled(POLICY, 7)
    assert m.refusal.status == 407 and m.refusal.reason == Reason.AUTH_THROTTLED and m.refusal.retry_after == 7
    assert "wait 7 s" in m.refusal.detail
    assert "Proxy-Authenticate" in refusal_headers(m.refusal)


def test_ipv6_clients_are_throttled_by_their_64():
    from sluice.identity import _throttle_key

    assert _throttle_key("2001:db8:1:2::5") == _throttle_key("2001:db8:1:2:ffff::9") == "2001:db8:1:2::/64"
    assert _throttle_key("2001:db8:1:3::5") != _throttle_key("2001:db8:1:2::5")
    assert _throttle_key("fe80::1%eth0") == "fe80::/64"
    assert _throttle_key("10.0.0.5") == "10.0.0.5" and _throttle_key(None) is None


def test_guesses_rotating_through_one_ipv6_64_share_one_throttle():
    h = Harness()
    for i in range(ADDRESS_BURST):
        assert _reason(h.match("alice", "guess", source=f"2001:db8:1:2::{i + 1:x}")) == Reason.CLIENT_UNKNOWN
    m = h.match("bob", "another-guess", source="2001:db8:1:2::ffff")  # a fresh address, the same /64
    assert _reason(m) == Reason.AUTH_THROTTLED
    assert h.match("bob", "bob-pw", source="2001:db8:1:3::1").refusal is None  # another /64 is not affected
