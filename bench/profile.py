"""`python -m bench profile`: where the time goes, Sluice beside plain mitmdump.

Inside the namespace. For each of mitmdump and Sluice (default policy), and
each of two loads (16 keep-alive connections of 1 KiB requests; one 64 MiB
CONNECT tunnel download), a fresh proxy runs under cProfile switched on only
for the load (bench._profiled). Prints the top functions by own time, and
Sluice's own functions (addons/, policy/) by cumulative time. cProfile slows
call-heavy code, so read the shares, not the absolute times.
"""

from __future__ import annotations

import io
import os
import pstats
import signal
import sys
import tempfile
import time
from pathlib import Path

from bench import contenders as C
from bench import load, origin, policies, procs, run
from bench.fakedns import FakeDNS

TUNNEL_BYTES = 64 * 2**20
OWN = (str(policies.REPO / "addons") + os.sep, str(policies.REPO / "policy") + os.sep)


def _argv(key: str, port: int, root: Path, policy: Path, out: Path, wrapper: list[str] | None) -> list[str]:
    prof = [sys.executable, "-m", "bench._profiled", str(out)]
    confdir = root / "mitmproxy-conf"
    confdir.mkdir(exist_ok=True)
    if key == "mitmdump":
        args = ["--listen-host", C.LISTEN, "--listen-port", str(port)]
        for s in C.MITMDUMP_SETS + [f"confdir={confdir}", "ignore_hosts=.*"]:
            args += ["--set", s]
        return (wrapper or []) + prof + ["script", str(C.VENV_BIN / "mitmdump")] + args
    return prof + ["module", "sluice.cli", "proxy", "--policy", str(policy), "--listen", f"{C.LISTEN}:{port}",
                   "--audit-log", str(root / "audit-profile.jsonl"), "--set", f"confdir={confdir}"]


def _profile_one(key: str, scenario: str, root: Path, policy: Path, wrapper: list[str] | None, seconds: float) -> str:
    port = 18090
    out = root / f"{key}-{scenario}.prof"
    proc = procs.Proc(f"{key}-profiled", _argv(key, port, root, policy, out, wrapper), root / f"{key}-{scenario}.log").start()
    url_host = C.NAME if (key != "mitmdump" or wrapper) else origin.HOST
    try:
        proc.wait_port(C.LISTEN, port, timeout=30)
        script = load.wrk_script(root, C.NAME, url_host, origin.SMALL)
        target = f"http://{C.LISTEN}:{port}"
        load.wrk(target, script, connections=16, duration=1)  # warm-up, not profiled
        os.kill(proc.pid, signal.SIGRTMIN + 2)  # bench._profiled.START
        time.sleep(0.2)
        cpu0 = proc.cpu_seconds()
        if scenario == "http":
            r = load.wrk(target, script, connections=16, duration=seconds)
            done = f"{r.get('requests', 0)} requests, {r.get('rps', 0):.0f} req/s under the profiler"
        else:
            r = load.curl_download((C.LISTEN, port), url_host, C.NAME, origin.LARGE, TUNNEL_BYTES)
            done = f"{TUNNEL_BYTES // 2**20} MiB at {r.get('mbps', 0):.0f} MB/s under the profiler"
        cpu1 = proc.cpu_seconds()
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
    buf = io.StringIO()
    stats = pstats.Stats(str(out), stream=buf)
    total = stats.total_tt or 1e-9
    lines = [f"### {key}, {scenario}: {done}; process CPU {((cpu1 or 0) - (cpu0 or 0)):.1f} s; profiled {total:.1f} s",
             "", "Top functions by own time:", "", "| own % | own s | calls | function |", "|---:|---:|---:|---|"]
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
                        + (f" ({events / units:.1f} per {('request' if scenario == 'http' else 'MiB')})" if units else "")
                        + f", ≈{iters[0] / max(events, 1):.0f} addons visited per event.")
        lines.insert(1, "")
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


def _units(done: str) -> float:
    """Requests served (http) or MiB moved (tunnel), parsed back from the summary."""
    try:
        return float(done.split()[0])
    except (ValueError, IndexError):
        return 0.0


def _short(file: str) -> str:
    for marker in ("site-packages" + os.sep, "lib" + os.sep + "python3.12" + os.sep, str(policies.REPO) + os.sep):
        if marker in file:
            return file.split(marker, 1)[1]
    return file


def main(seconds: float = 10.0) -> int:
    try:
        run.check_namespace()
    except run.NotInNamespace as e:
        print(f"bench: {e}", file=sys.stderr)
        return 2
    run._raise_nofile()
    signal.signal(signal.SIGTERM, run._on_signal)
    parts = []
    with tempfile.TemporaryDirectory(prefix="sluice-bench-profile-") as tmp:
        root = Path(tmp)
        root.chmod(0o755)
        files = policies.write_all(root)
        dns = FakeDNS()
        try:
            dns.start()
            origin.start(root, TUNNEL_BYTES)
            wrapper = C.hosts_wrapper(root)
            for scenario in ("http", "tunnel"):
                for key in ("mitmdump", "sluice"):
                    print(f"bench: profiling {key}, {scenario}", file=sys.stderr, flush=True)
                    parts.append(_profile_one(key, scenario, root, files["default"], wrapper, seconds))
        finally:
            procs.stop_all()
            dns.stop()
    text = "\n".join(parts)
    print(text)
    out = Path(__file__).resolve().parent / "results"
    out.mkdir(exist_ok=True)
    (out / "profile.md").write_text(text, encoding="utf-8")
    print(f"bench: wrote {out / 'profile.md'}", file=sys.stderr)
    return 0
