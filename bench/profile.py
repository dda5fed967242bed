"""`python -m bench profile [--only connect]`: where the time goes, Sluice
beside plain mitmdump.

Inside the namespace. For each of mitmdump and Sluice (default policy), and
each of three loads (16 keep-alive connections of 1 KiB requests; one 64 MiB
CONNECT tunnel download; CONNECT setups from 16 clients, bench.connects), a
fresh proxy runs under a profiler switched on only for the load
(bench._profiled), pinned to one CPU like in the bench, twice: once under a
CPU-time sampler (shares of the CPU the process really used: not skewed by
other processes on a shared machine, nor by profiler overhead), once under
cProfile (exact call counts, e.g. events per setup; wall-clock times that
include preemption and its own per-call overhead). Each prints the time
grouped by where it is spent (mitmproxy's layers, hook dispatch, Sluice's
gate, DNS cache, asyncio, ...), the top functions, and Sluice's own
functions (addons/, policy/) including what they call. Results go to
bench/results/profile[-SCENARIOS].md, with the raw profiles beside them.
"""

from __future__ import annotations

import io
import json
import linecache
import os
import pstats
import re
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from bench import connects
from bench import contenders as C
from bench import load, origin, policies, procs, run
from bench.fakedns import FakeDNS

TUNNEL_BYTES = 64 * 2**20
RESULTS = Path(__file__).resolve().parent / "results"
OWN = (str(policies.REPO / "addons") + os.sep, str(policies.REPO / "policy") + os.sep,
       str(policies.REPO / "sluice") + os.sep)


def _argv(key: str, port: int, root: Path, policy: Path, out: Path, wrapper: list[str] | None,
          sample: bool = False) -> list[str]:
    prof = [sys.executable, "-m", "bench._profiled"] + (["--sample"] if sample else []) + [str(out)]
    confdir = root / "mitmproxy-conf"
    confdir.mkdir(exist_ok=True)
    if key == "mitmdump":
        args = ["--listen-host", C.LISTEN, "--listen-port", str(port)]
        for s in C.MITMDUMP_SETS + [f"confdir={confdir}", "ignore_hosts=.*"]:
            args += ["--set", s]
        return (wrapper or []) + prof + ["script", str(C.VENV_BIN / "mitmdump")] + args
    return prof + ["module", "sluice.cli", "proxy", "--policy", str(policy), "--listen", f"{C.LISTEN}:{port}",
                   "--audit-log", str(root / "audit-profile.jsonl"), "--set", f"confdir={confdir}"]


def _profile_one(key: str, scenario: str, root: Path, policy: Path, wrapper: list[str] | None, seconds: float,
                 sample: bool = False, cpus: set[int] | None = None) -> str:
    port = 18090
    out = root / f"{key}-{scenario}.{'samples.json' if sample else 'prof'}"
    proc = procs.Proc(f"{key}-profiled", _argv(key, port, root, policy, out, wrapper, sample),
                      root / f"{key}-{scenario}.log").start()
    url_host = C.NAME if (key != "mitmdump" or wrapper) else origin.HOST
    try:
        proc.wait_port(C.LISTEN, port, timeout=30)
        if cpus:
            procs.pin(proc.pid, cpus)
        script = load.wrk_script(root, C.NAME, url_host, origin.SMALL)
        target = f"http://{C.LISTEN}:{port}"
        if scenario == "connect":  # warm-up, not profiled
            load.connect_setups((C.LISTEN, port), f"{url_host}:{connects.PORT}", clients=16, seconds=1)
        else:
            load.wrk(target, script, connections=16, duration=1)
        os.kill(proc.pid, signal.SIGRTMIN + 2)  # bench._profiled.START
        time.sleep(0.2)
        cpu0, split0 = proc.cpu_seconds(), _user_system(proc.pid)
        if scenario == "http":
            r = load.wrk(target, script, connections=16, duration=seconds)
            done = f"{r.get('requests', 0)} requests, {r.get('rps', 0):.0f} req/s under the profiler"
        elif scenario == "connect":
            r = load.connect_setups((C.LISTEN, port), f"{url_host}:{connects.PORT}", clients=16, seconds=seconds)
            done = f"{r.get('setups', 0)} CONNECT setups, {r.get('rate', 0):.0f}/s under the profiler"
        else:
            r = load.curl_download((C.LISTEN, port), url_host, C.NAME, origin.LARGE, TUNNEL_BYTES)
            done = f"{TUNNEL_BYTES // 2**20} MiB at {r.get('mbps', 0):.0f} MB/s under the profiler"
        cpu1, split1 = proc.cpu_seconds(), _user_system(proc.pid)
        if "error" in r:
            done += f" (error: {r['error']})"
        os.kill(proc.pid, signal.SIGRTMIN + 3)  # bench._profiled.STOP
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not out.exists():
            time.sleep(0.1)
        time.sleep(0.5)  # let the dump finish
    finally:
        proc.stop()
    if not out.exists():
        return f"### {key}, {scenario}: no profile written ({proc.log_tail()})\n"
    RESULTS.mkdir(exist_ok=True)
    shutil.copy(out, RESULTS / out.name)  # for pstats / snakeviz afterwards
    if sample:
        return _sampled(out, key, scenario, done, (cpu1 or 0) - (cpu0 or 0), split1[1] - split0[1])
    buf = io.StringIO()
    stats = pstats.Stats(str(out), stream=buf)
    total = stats.total_tt or 1e-9
    lines = [f"### {key}, {scenario}, cProfile (wall-clock times, every call): {done}; process CPU "
             f"{((cpu1 or 0) - (cpu0 or 0)):.1f} s; profiled {total:.1f} s", ""]
    def find(suffix: str, name: str):
        for (file, line, fname), v in stats.stats.items():
            if fname == name and file.endswith(suffix):
                return v
        return None

    trig, iters = find("mitmproxy/addonmanager.py", "trigger_event"), find("mitmproxy/addonmanager.py", "_iter_hooks")
    units = _units(done)
    if trig and iters:
        # trigger_event is a coroutine: cProfile counts a call per resumption,
        # so the event count is the primitive-call count (cc).
        events = trig[0]
        lines.insert(1, f"Hook dispatch (`AddonManager.trigger_event`, every event offered to every addon): "
                        f"{trig[3] / total:.0%} of the time including the hooks it runs; {events} events"
                        + (f" ({events / units:.1f} per {UNIT[scenario]})" if units else "")
                        + f", ≈{iters[0] / max(events, 1):.0f} addons visited per event.")
        lines.insert(1, "")
    if units:
        lines.insert(1, f"CPU per {UNIT[scenario]} (process, without the profiler's share being separable): "
                        f"{((cpu1 or 0) - (cpu0 or 0)) / units * 1e6:,.0f} µs; profiled time per {UNIT[scenario]}: "
                        f"{total / units * 1e6:,.0f} µs.")
        lines.insert(1, "")
    lines += ["Own time by where it is spent (time in other stdlib functions and builtins, such as contextlib or "
              "dataclasses, is charged to the callers that spent it):", "", "| share | own s | where |", "|---:|---:|---|"]
    for where, tt in categories(stats):
        lines.append(f"| {tt / total:.1%} | {tt:.2f} | {where} |")
    lines += ["", "Top functions by own time:", "", "| own % | own s | calls | function |", "|---:|---:|---:|---|"]
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])
    for (file, line, name), (cc, nc, tt, ct, _callers) in rows[:20]:
        lines.append(f"| {tt / total:.1%} | {tt:.2f} | {nc} | `{_short(file)}:{line}({name})` |")
    own = [(k, v) for k, v in stats.stats.items() if k[0].startswith(OWN)]
    if own:
        own_tt = sum(v[2] for _, v in own)
        lines += ["", f"Sluice's own code (addons/, policy/): {own_tt / total:.1%} of the time as own time. "
                      "By cumulative time (including what it calls):", "",
                  "| cum % | cum s | calls | function |", "|---:|---:|---:|---|"]
        for (file, line, name), (cc, nc, tt, ct, _callers) in sorted(own, key=lambda kv: -kv[1][3])[:15]:
            lines.append(f"| {ct / total:.1%} | {ct:.2f} | {nc} | `{_short(file)}:{line}({name})` |")
    return "\n".join(lines) + "\n"


UNIT = {"http": "request", "tunnel": "MiB", "connect": "setup"}

# Own time grouped by file (first match wins); "~" entries are C functions.
_SITE = "site-packages" + os.sep


def _ours(file: str, *names: str) -> bool:
    """file is one of addons/<names> or sluice/<names> (the core outside the addons)."""
    return file.startswith((OWN[0], OWN[2])) and os.path.basename(file) in names


CATEGORIES = [
    ("Sluice: gate and policy (addons/gate.py, identity, outcome, refusals; policy/)",
     lambda f, n: f.startswith(OWN[1]) or _ours(f, "gate.py", "identity.py", "outcome.py", "refusals.py", "failsafe.py")),
    ("Sluice: DNS cache and resolver (sluice/resolver.py, dnspython)",
     lambda f, n: _ours(f, "resolver.py") or (_SITE + "dns" + os.sep) in f),
    ("Sluice: caps, audit log, policy source, connections (rest of addons/ and sluice/)",
     lambda f, n: f.startswith((OWN[0], OWN[2]))),
    ("mitmproxy: hook dispatch (addonmanager.py, hooks.py)",
     lambda f, n: f.endswith(("mitmproxy" + os.sep + "addonmanager.py", "mitmproxy" + os.sep + "hooks.py"))),
    ("mitmproxy: connection handler (proxy/server.py) and its commands/events",
     lambda f, n: f.endswith(tuple("mitmproxy" + os.sep + "proxy" + os.sep + x
                                   for x in ("server.py", "commands.py", "events.py", "server_hooks.py")))),
    ("mitmproxy: protocol layers (proxy/layer.py, proxy/layers/, tunnel, modes)",
     lambda f, n: ("mitmproxy" + os.sep + "proxy" + os.sep) in f),
    ("mitmproxy: built-in addons (next_layer, proxyserver, ...)",
     lambda f, n: ("mitmproxy" + os.sep + "addons" + os.sep) in f),
    ("mitmproxy: the rest (connection and flow objects, HTTP parsing, TLS parsing, utils)",
     lambda f, n: ("mitmproxy" + os.sep) in f or (_SITE + "mitmproxy_rs") in f),
    ("socket and epoll system calls (C)",
     lambda f, n: f == "~" and any(x in n for x in ("socket", "epoll", "select", "_overlapped"))),
    ("asyncio and selectors (event loop, streams, tasks, futures)",
     lambda f, n: any(x in f for x in ("asyncio" + os.sep, "selectors.py", os.sep + "socket.py"))
     or f == "~" and any(x in n for x in ("_asyncio", "Future", "Task", "_contextvars", "Context"))),
    ("logging", lambda f, n: ("logging" + os.sep) in f),
    ("other (stdlib, builtins)", lambda f, n: True),
]


OTHER = CATEGORIES[-1][0]


def _category(func: tuple) -> str:
    file, _line, name = func
    return next(label for label, test in CATEGORIES if test(file, name))


def categories(stats: pstats.Stats) -> list[tuple[str, float]]:
    """Own time per category. The own time of a function in OTHER (stdlib,
    builtins) goes to its callers, in proportion to the time it spent for
    each (pstats records that per caller), up the stack until a caller with
    a category of its own; what is left (no callers) stays OTHER."""
    totals = {label: 0.0 for label, _ in CATEGORIES}
    cats = {func: _category(func) for func in stats.stats}
    memo: dict[tuple, dict[str, float]] = {}

    def shares(func: tuple, visiting: set) -> dict[str, float]:
        """How func's own time splits over categories (fractions summing to 1)."""
        cat = cats.get(func, OTHER)
        if cat != OTHER:
            return {cat: 1.0}
        if func in memo:
            return memo[func]
        # callers: {caller: (cc, nc, tt, ct)}; tt is func's own time when called from there.
        # Recursion (a caller already on this path) is left out.
        callers = {c: v[2] for c, v in (stats.stats[func][4] if func in stats.stats else {}).items()
                   if v[2] > 0 and c not in visiting}
        spent = sum(callers.values())
        if spent <= 0:
            return {OTHER: 1.0}
        out: dict[str, float] = {}
        visiting.add(func)
        for caller, tt in callers.items():
            for k, f in shares(caller, visiting).items():
                out[k] = out.get(k, 0.0) + f * tt / spent
        visiting.discard(func)
        memo[func] = out
        return out

    for func, (_cc, _nc, tt, _ct, _callers) in stats.stats.items():
        for k, f in shares(func, set()).items():
            totals[k] += tt * f
    return sorted(((k, v) for k, v in totals.items() if v > 0), key=lambda kv: -kv[1])


SOCKET_CALL = re.compile(r"\.(send|sendall|recv|recv_into|connect|connect_ex|accept|close|shutdown|poll|select|"
                         r"setsockopt|getsockopt|getpeername|getsockname|socketpair)\(")
SYSCALLS = "socket and epoll system calls (the line making the call)"


def _user_system(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of one process so far."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        tick = os.sysconf("SC_CLK_TCK")
        return int(fields[11]) / tick, int(fields[12]) / tick
    except (OSError, ValueError, IndexError):
        return 0.0, 0.0


def _sampled(out: Path, key: str, scenario: str, done: str, cpu: float, system: float) -> str:
    """The CPU-time sampler's view. The kernel fires CPU timers on its tick
    (CONFIG_HZ, often 250/s), not every SAMPLE_INTERVAL, so a sample stands
    for an unknown slice of CPU: the shares count, and µs are shares of the
    CPU the process was measured to use."""
    data = json.loads(out.read_text(encoding="utf-8"))
    interval, samples = data["interval"], data["samples"]
    n = sum(c for c, _ in samples) or 1
    units = _units(done)
    per = f"{UNIT[scenario]}"
    cats = {label: 0 for label, _ in CATEGORIES}
    cats[SYSCALLS] = 0
    own_fn: dict[tuple, int] = {}
    own_incl: dict[tuple, int] = {}
    hooks = hooks_own = sluice_any = 0
    for count, frames in samples:
        file, first, name, line = frames[-1]
        if SOCKET_CALL.search(linecache.getline(file, line or 0) if line else ""):
            cats[SYSCALLS] += count
        else:
            for f in reversed(frames):
                label = _category((f[0], f[1], f[2]))
                if label != OTHER:
                    break
            cats[label] += count
        top = (file, first, name)
        own_fn[top] = own_fn.get(top, 0) + count
        seen = {(f[0], f[1], f[2]) for f in frames}
        for fn in seen:
            if fn[0].startswith(OWN):
                own_incl[fn] = own_incl.get(fn, 0) + count
        mine = any(fn[0].startswith(OWN) for fn in seen)
        sluice_any += count if mine else 0
        if any(fn[0].endswith("addonmanager.py") and fn[2] == "trigger_event" for fn in seen):
            hooks += count
            hooks_own += count if mine else 0
    del interval  # see the docstring: shares, not sample counts times the interval
    lines = [f"### {key}, {scenario}, CPU-time sampler: {done}; process CPU {cpu:.1f} s "
             f"({system / cpu if cpu else 0:.0%} of it in the kernel); {n} samples", ""]
    if units:
        lines += [f"CPU per {per}: {cpu / units * 1e6:,.0f} µs (process, under the sampler), of which "
                  f"{system / units * 1e6:,.0f} µs system time.", ""]
    lines += [f"Hook dispatch (inside `AddonManager.trigger_event`): {hooks / n:.0%} of the CPU, of which "
              f"{hooks_own / n:.0%} in Sluice's hooks and {(hooks - hooks_own) / n:.0%} dispatching. Sluice's own "
              f"code (addons/, policy/) and everything it calls: {sluice_any / n:.0%}.", "",
              "CPU by where it is spent (the innermost frame with a category; stdlib and builtins charged to their "
              "caller; socket calls on their own line):", "", "| share | µs per " + per + " | where |",
              "|---:|---:|---|"]
    for label, count in sorted(cats.items(), key=lambda kv: -kv[1]):
        if count:
            us = f"{count / n * cpu / units * 1e6:,.0f}" if units else "–"
            lines.append(f"| {count / n:.1%} | {us} | {label} |")
    lines += ["", "Top functions by own CPU:", "", "| own % | function |", "|---:|---|"]
    for (file, first, name), count in sorted(own_fn.items(), key=lambda kv: -kv[1])[:15]:
        lines.append(f"| {count / n:.1%} | `{_short(file)}:{first}({name})` |")
    if own_incl:
        lines += ["", "Sluice's functions, CPU including what they call:", "", "| cum % | function |", "|---:|---|"]
        for (file, first, name), count in sorted(own_incl.items(), key=lambda kv: -kv[1])[:12]:
            lines.append(f"| {count / n:.1%} | `{_short(file)}:{first}({name})` |")
    return "\n".join(lines) + "\n"


def _units(done: str) -> float:
    """Requests served (http), MiB moved (tunnel) or setups (connect), parsed back from the summary."""
    try:
        return float(done.split()[0])
    except (ValueError, IndexError):
        return 0.0


def _short(file: str) -> str:
    for marker in ("site-packages" + os.sep, "lib" + os.sep + "python3.12" + os.sep, str(policies.REPO) + os.sep):
        if marker in file:
            return file.split(marker, 1)[1]
    return file


def main(seconds: float = 10.0, only: tuple[str, ...] | None = None) -> int:
    try:
        run.check_namespace()
    except run.NotInNamespace as e:
        print(f"bench: {e}", file=sys.stderr)
        return 2
    scenarios = [x for x in ("http", "tunnel", "connect") if not only or x in only]
    if not scenarios:
        print("bench: profile scenarios are http, tunnel and connect", file=sys.stderr)
        return 2
    run._raise_nofile()
    signal.signal(signal.SIGTERM, run._on_signal)
    notes: dict = {"notes": []}
    run._tcp_tw_reuse(notes)
    parts = [f"_{n}_\n" for n in notes["notes"]]
    with tempfile.TemporaryDirectory(prefix="sluice-bench-profile-") as tmp:
        root = Path(tmp)
        root.chmod(0o755)
        files = policies.write_all(root)
        dns = FakeDNS()
        try:
            dns.start()
            origin.start(root, TUNNEL_BYTES)
            if "connect" in scenarios:
                echo = run._start_echo(root)
                if echo.startswith("none"):
                    raise RuntimeError(f"the echo origin did not start: {echo}")
            wrapper = C.hosts_wrapper(root)
            layout = procs.cpu_layout()
            if layout:  # like the bench: the proxy on one core, the load and origins on the other
                os.sched_setaffinity(0, layout[0])
            for scenario in scenarios:
                for key in ("mitmdump", "sluice"):
                    for sample in (True, False):
                        print(f"bench: profiling {key}, {scenario}, {'CPU sampler' if sample else 'cProfile'}",
                              file=sys.stderr, flush=True)
                        parts.append(_profile_one(key, scenario, root, files["default"], wrapper, seconds,
                                                  sample, layout[1] if layout else None))
        finally:
            procs.stop_all()
            dns.stop()
    text = "\n".join(parts)
    print(text)
    out = Path(__file__).resolve().parent / "results"
    out.mkdir(exist_ok=True)
    name = "profile.md" if not only else f"profile-{'-'.join(scenarios)}.md"
    (out / name).write_text(text, encoding="utf-8")
    print(f"bench: wrote {out / name}", file=sys.stderr)
    return 0
