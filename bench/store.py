"""The cost of shared limits (issue 23; phase `store`): a quota decision
counted in this process (policy.quotas.MemoryCounters) next to the same
decision counted in a real redis-server on loopback (sluice.state_store.
StoreCounters), and Sluice end to end with every quota on, local counters
against the store, in the same rounds.

The benchmark starts its own redis-server (Debian's package; `.ci/run` and
`python -m bench deps` install it) on 127.0.0.1 inside the namespace, saving
nothing, and stops it with everything else. Without redis-server the phase
is skipped with one line.

Decision cost (`decisions`): `policy.quotas.check_request` for an admitted
request, awaited on an asyncio loop as the quota addon awaits it, with limits
that never refuse: the request-rate bucket alone (one store step), and every
request quota (the transfer window, the rate bucket and the per-host bucket:
three steps, each one round trip to the store), one client after another and
16 clients at once (µs per decision is then wall time over decisions: the
round trips overlap). Local and store rounds alternate, so the machine's
drift falls on both. While this runs the proxies are idle, and redis-server
may use every CPU (pinned beside this process, the two would take turns on
one core); for the end-to-end rounds it goes back to the load side's core,
off the core of the Sluice being measured. A row of plain PINGs (redis-py,
one after another) gives the loopback round trip the store steps are made of.
"""

from __future__ import annotations

import asyncio
import gc
import shutil
import statistics
import time
from dataclasses import replace
from pathlib import Path

from bench import procs

HOST = "127.0.0.1"
PORT = 16379  # inside the benchmark's namespace, where nothing else listens
BINARY = "redis-server"
# The bench's store gets a generous timeout: on this loaded machine a 50 ms
# stall would turn a process to its local counters, and the figures would no
# longer be the store's. Any such fallback is reported.
TIMEOUT = 1.0
CLIENTS = 16  # the concurrent case

# (label, quota limits on, store steps per decision); limits never refuse.
CASES = [
    ("rate bucket only (1 step)", {"requests_per_second": 1_000_000_000, "burst": 1_000_000_000}, 1),
    ("every request quota: transfer window, rate and per-host buckets (3 steps)",
     {"requests_per_second": 1_000_000_000, "burst": 1_000_000_000, "bytes_per_hour": 2**50,
      "max_requests_per_host_per_minute": 1_000_000_000}, 3),
]


def url(port: int = PORT) -> str:
    return f"redis://{HOST}:{port}/0"


def missing() -> str | None:
    """Why the phase cannot run here, or None."""
    if shutil.which(BINARY) is None:
        return "redis-server is not installed (apt-get install redis-server; `python -m bench deps` does it)"
    return None


def start(root: Path) -> procs.Proc:
    """redis-server on HOST:PORT, saving nothing; registered with procs, so
    stop_all() ends it. Raises procs.StartError."""
    exe = shutil.which(BINARY)
    if exe is None:
        raise procs.StartError(missing() or "redis-server not found")
    argv = [exe, "--bind", HOST, "--port", str(PORT), "--save", "", "--appendonly", "no", "--dir", str(root),
            "--protected-mode", "no", "--daemonize", "no", "--loglevel", "warning"]
    proc = procs.Proc("redis", argv, root / "redis.log").start()
    proc.wait_port(HOST, PORT, timeout=15)
    return proc


def version() -> str:
    exe = shutil.which(BINARY)
    if exe is None:
        return "redis-server not installed"
    try:
        out = procs.run([exe, "--version"], timeout=10).stdout.split()
    except OSError:
        return "redis-server ?"
    v = next((w.split("=", 1)[1] for w in out if w.startswith("v=")), "?")
    return f"redis-server {v}"


# ---- decision cost ---------------------------------------------------------------------


async def _round(counters, limits, clients: int, per_client: int, host: str) -> float:
    """µs per decision: `clients` loops of `per_client` admitted decisions at once."""
    from sluice.policy import quotas

    async def one_client(i: int) -> None:
        client = quotas.client_key("bench", f"agent-{i}", None)
        for _ in range(per_client):
            if await quotas.check_request(counters, limits, client, host, time.monotonic()) is not None:
                raise RuntimeError("the quota check refused (the bench's limits never should)")

    t0 = time.perf_counter_ns()
    await asyncio.gather(*(one_client(i) for i in range(clients)))
    return (time.perf_counter_ns() - t0) / (clients * per_client) / 1000.0


async def _pings(store_url: str, *, rounds: int, n: int) -> dict:
    """µs per PING, one after another: the loopback round trip itself."""
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(store_url)
    try:
        await client.ping()
        per_round = []
        for _ in range(rounds):
            t0 = time.perf_counter_ns()
            for _ in range(n):
                await client.ping()
            per_round.append((time.perf_counter_ns() - t0) / n / 1000.0)
    finally:
        await client.aclose()
    return _summary(per_round)


def _summary(per_round: list[float]) -> dict:
    return {"median_us": statistics.median(per_round), "min_us": min(per_round), "max_us": max(per_round),
            "runs_us": [round(x, 1) for x in per_round]}


async def _decisions(store_url: str, *, rounds: int, decisions: int) -> dict:
    from sluice.policy.model import Limits
    from sluice.policy.quotas import HOUR, MemoryCounters, bytes_key, client_key
    from sluice.policy.state import StateSettings
    from sluice.state_store import StoreCounters

    events: list[str] = []
    store = StoreCounters(StateSettings(store_url, timeout=TIMEOUT),
                          status=lambda up, line: events.append(("up: " if up else "down: ") + line))
    await store.start()
    local = MemoryCounters()
    out: dict = {"cases": {}, "rounds": rounds, "decisions_per_round": decisions, "timeout_s": TIMEOUT}
    try:
        if not store.up:
            raise RuntimeError(f"the store did not answer: {events[-1] if events else '?'}")
        now = time.monotonic()
        for counters in (local, store):  # clients that have used some bytes: their window exists
            for i in range(CLIENTS):
                counters.spend(bytes_key(client_key("bench", f"agent-{i}", None)), 1000, None, HOUR, now)
        out["ping"] = await _pings(store_url, rounds=rounds, n=decisions)
        for label, on, steps in CASES:
            limits = replace(Limits(), **on)
            rows = {}
            for concurrency in (1, CLIENTS):
                per = max(1, decisions // concurrency)
                runs: dict[str, list[float]] = {"local": [], "store": []}
                for name, counters in (("local", local), ("store", store)):  # warm: connections, scripts loaded
                    await _round(counters, limits, concurrency, max(1, per // 10), "public.example")
                for rnd in range(rounds):
                    order = [("local", local), ("store", store)]
                    for name, counters in (order if rnd % 2 == 0 else order[::-1]):
                        runs[name].append(await _round(counters, limits, concurrency, per, "public.example"))
                ratios = [s / m for s, m in zip(runs["store"], runs["local"]) if m]
                rows[str(concurrency)] = {"local": _summary(runs["local"]), "store": _summary(runs["store"]),
                                          "ratio": statistics.median(ratios), "ratio_min": min(ratios),
                                          "ratio_max": max(ratios)}
            out["cases"][label] = {"steps": steps, "by_clients": rows}
        if not store.up or any(e.startswith("down") for e in events):
            out["error"] = f"the store was marked down during the run ({events[-1]}): the figures mix in local counting"
        import redis.asyncio as aioredis

        check = aioredis.Redis.from_url(store_url)
        try:
            keys = await check.dbsize()
        finally:
            await check.aclose()
        if not keys:
            out["error"] = "the store holds no key after the run: the decisions did not reach it"
        out["store_keys"] = keys
    finally:
        await store.close()
    return out


def decisions(store_url: str, *, quick: bool = False) -> dict:
    """Decision cost, local vs store (see the module docstring)."""
    rounds, n = (3, 400) if quick else (7, 2000)
    gc_was = gc.isenabled()
    gc.disable()
    try:
        return asyncio.run(_decisions(store_url, rounds=rounds, decisions=n))
    finally:
        if gc_was:
            gc.enable()


# ---- the report's lines ------------------------------------------------------------------


def _times(x: float) -> str:
    return f"{x:,.0f}×" if x >= 10 else f"{x:.2f}×"


def _us(t: dict) -> str:
    return f"{t['median_us']:,.1f} µs ({t['min_us']:,.1f}–{t['max_us']:,.1f})"


def decision_table(d: dict) -> list[str]:
    if "skipped" in d:
        return [f"Shared-store decision cost: skipped ({d['skipped']})"]
    if "cases" not in d:
        return [f"Shared-store decision cost: n/a ({d.get('error', 'not run')})"]
    lines = [f"Quota check of an admitted request (`policy.quotas.check_request`, awaited), counted in this process "
             f"against counted in {d.get('server', 'redis-server')} on loopback (`StoreCounters`, one Lua script per "
             f"step): median µs per decision over {d['rounds']} alternating rounds of {d['decisions_per_round']:,} "
             f"decisions (min–max of the rounds), and the median of same-round ratios (min–max):", "",
             "| Quota check | clients at once | local | shared store | store / local |",
             "|---|---:|---:|---:|---:|"]
    for label, case in d["cases"].items():
        for clients, r in case["by_clients"].items():
            lines.append(f"| {label} | {clients} | {_us(r['local'])} | {_us(r['store'])} | "
                         f"{_times(r['ratio'])} ({_times(r['ratio_min'])}–{_times(r['ratio_max'])}) |")
    if d.get("ping"):
        lines += ["", f"The loopback round trip itself (redis-py PING, one after another): {_us(d['ping'])}."]
    if d.get("error"):
        lines += ["", f"Warning: {d['error']}"]
    return lines
