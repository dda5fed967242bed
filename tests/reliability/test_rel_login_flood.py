"""Login flood: wrong proxy passwords from many addresses must not slow down
anyone else.

One client with correct credentials measures its median latency for plain
HTTP requests through the proxy, first alone, then while flooding threads
send fresh wrong passwords as fast as the proxy answers them. Two kinds:
LONE_FLOODERS each guess the measuring agent's own username from one
address of their own (the issue's case: any client knows a username), and
SPREAD_FLOODERS guess every user of the policy, each attempt from the next
of 240 loopback source addresses, so no per-address throttle stops them and
the password hashing runs flat out for the whole flood.

Checks: the measuring client got 200 on every request (a cached success
passes even while its username is throttled), the flood really hashed and
was then throttled (407 client_unknown and 407 auth_throttled with
Retry-After), no flood request reached the origin, and the median latency
with the flood stays within a generous bound of the one without (printed;
see FLOOD_MEDIAN_BOUND_MS for why that bound).
"""

from __future__ import annotations

import base64
import socket
import statistics
import threading
import time
from collections import Counter

import pytest

from harness import default_policy
from harness.clients import _Reader, read_response
from sluice.policy.loader import hash_password
from relkit import KeepAlive, scaled

pytestmark = pytest.mark.netns

AGENT, AGENT_PASSWORD = "agent", "agent-correct-horse"
# Every user is hashed with the default parameters of `sluice policy
# hash-password` (PBKDF2-SHA256, 200,000 iterations), as operators' are.
FLOOD_USERS = [AGENT] + [f"user{i:02d}" for i in range(15)]
LONE_FLOODERS = 4  # sources 127.0.0.2-5, username AGENT
SPREAD_FLOODERS = 6  # enough to keep the hash pool busy; with the lone ones more than its queue holds
FLOOD_SOURCES = [f"127.0.0.{i}" for i in range(10, 250)]
PHASE_SECONDS = scaled(6.0, 20.0)  # each measuring phase (bounded in time and count)
MAX_SAMPLES = 5_000

# The bound. Measured on 2 shared cores (see the test's printed figures):
# the median moves by about a millisecond with the flood. With the hash on the event loop
# (before this check moved to a worker thread) every wrong password held the
# loop for one PBKDF2 run (40-120 ms here) and ten flooders kept it held,
# so the median went to hundreds of milliseconds. 30 ms over the baseline is
# far below one hash on any machine yet leaves room for a loaded CI box
# where the hashing thread and the event loop share one core (a scheduler
# slice or two per request).
FLOOD_MEDIAN_BOUND_MS = 30.0


def _basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


@pytest.fixture(scope="module")
def flood_proxy(sluice_factory):
    users = {user: {"password_hash": hash_password(AGENT_PASSWORD if user == AGENT else f"{user}-secret")}
             for user in FLOOD_USERS}
    policy = default_policy(require_client=True, clients=[{"name": "agents", "users": users}])
    return sluice_factory(policy, name="login-flood")


def _measure(proxy, seconds: float, tag: str) -> tuple[list[float], Counter]:
    """Sequential keep-alive GETs with the right password for `seconds`:
    (latencies in ms, status/reason counts)."""
    conn = KeepAlive(proxy.address, timeout=15)
    auth = _basic(AGENT, AGENT_PASSWORD)
    latencies: list[float] = []
    outcomes: Counter = Counter()
    deadline = time.monotonic() + seconds
    try:
        for i in range(MAX_SAMPLES):
            if time.monotonic() >= deadline:
                break
            raw = (f"GET http://8.8.8.8/{tag}/{i} HTTP/1.1\r\nHost: 8.8.8.8\r\n"
                   f"Proxy-Authorization: {auth}\r\n\r\n").encode()
            started = time.perf_counter()
            r = conn.request(raw)
            latencies.append((time.perf_counter() - started) * 1000)
            outcomes[(r.status, r.sluice_reason)] += 1
    finally:
        conn.close()
    return latencies, outcomes


def _flood(proxy, stop: threading.Event, worker: int, outcomes: Counter, retry_afters: list,
           lock: threading.Lock) -> None:
    attempt = worker
    while not stop.is_set():
        if worker < LONE_FLOODERS:
            user, source = AGENT, f"127.0.0.{2 + worker}"
        else:
            user = FLOOD_USERS[attempt % len(FLOOD_USERS)]
            source = FLOOD_SOURCES[attempt % len(FLOOD_SOURCES)]
        raw = (f"GET http://8.8.8.8/flood/{attempt} HTTP/1.1\r\nHost: 8.8.8.8\r\n"
               f"Proxy-Authorization: {_basic(user, f'wrong-{attempt}')}\r\nConnection: close\r\n\r\n").encode()
        try:
            with socket.create_connection(proxy.address, timeout=15, source_address=(source, 0)) as s:
                s.sendall(raw)
                r = read_response(_Reader(s))
            key = (r.status, r.sluice_reason)
            if r.sluice_reason == "auth_throttled" and b"busy" in r.body:
                key = (r.status, "auth_throttled (busy)")  # the hash queue was full
            retry_after = r.headers.get("retry-after")
        except OSError as e:
            key, retry_after = ("error", type(e).__name__), None
        with lock:
            outcomes[key] += 1
            if retry_after is not None:
                retry_afters.append(retry_after)
        attempt += LONE_FLOODERS + SPREAD_FLOODERS


@pytest.mark.timeout(120 + 4 * PHASE_SECONDS)
def test_login_flood_does_not_slow_other_clients(flood_proxy, net):
    proxy = flood_proxy
    origin = net.origin("8.8.8.8", 80)
    warm, _ = _measure(proxy, 1.0, "warm")  # the first request hashes the right password once
    assert warm, "the measuring client made no request"

    quiet, quiet_outcomes = _measure(proxy, PHASE_SECONDS, "quiet")

    stop = threading.Event()
    lock = threading.Lock()
    flood_outcomes: Counter = Counter()
    retry_afters: list[str] = []
    flooders = [threading.Thread(target=_flood, args=(proxy, stop, w, flood_outcomes, retry_afters, lock), daemon=True)
                for w in range(LONE_FLOODERS + SPREAD_FLOODERS)]
    for t in flooders:
        t.start()
    try:
        time.sleep(0.5)  # the flood is under way: hashes queued, throttles filling
        flooded, flooded_outcomes = _measure(proxy, PHASE_SECONDS, "flooded")
    finally:
        stop.set()
        for t in flooders:
            t.join(20)
    assert not any(t.is_alive() for t in flooders), "flood threads still running"

    quiet_ms, flooded_ms = statistics.median(quiet), statistics.median(flooded)
    print(f"\nlogin flood: median {quiet_ms:.2f} ms alone ({len(quiet)} requests), "
          f"{flooded_ms:.2f} ms during the flood ({len(flooded)} requests); "
          f"p90 {statistics.quantiles(quiet, n=10)[-1]:.2f} -> {statistics.quantiles(flooded, n=10)[-1]:.2f} ms; "
          f"flood answers: {dict(flood_outcomes)}")

    # The right password always passes, even while its username is throttled.
    assert set(quiet_outcomes) == {(200, None)}, quiet_outcomes
    assert set(flooded_outcomes) == {(200, None)}, flooded_outcomes
    # The flood was real: wrong passwords were hashed and refused, then throttled.
    assert flood_outcomes[(407, "client_unknown")] >= 20, flood_outcomes
    assert flood_outcomes[(407, "auth_throttled")] >= 1, flood_outcomes
    assert set(flood_outcomes) <= {(407, "client_unknown"), (407, "auth_throttled"),
                                   (407, "auth_throttled (busy)")}, flood_outcomes
    assert retry_afters and all(v.isdigit() and int(v) >= 1 for v in retry_afters), retry_afters[:10]
    assert not any(req.path.startswith("/flood/") for req in origin.requests), "a wrong password reached the origin"

    assert flooded_ms - quiet_ms <= FLOOD_MEDIAN_BOUND_MS, (
        f"the login flood moved another client's median latency from {quiet_ms:.1f} ms to {flooded_ms:.1f} ms")
