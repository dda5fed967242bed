"""The whole benchmark, side by side in one run, inside the namespace.

Order: decision microbenchmark (nothing else running), then the origin, the
fake DNS server, the store phase's redis-server and every proxy start (each proxy pinned to one core, the
load generator, origin and this process to the other; the exception is
Sluice --workers 2, allowed every CPU, the scale-out path); memory per idle
tunnel on the fresh proxies; request rate and latency at each connection
count, contenders interleaved and repeated in alternating order; CONNECT
setups; the shared store's decision cost and Sluice with quotas counted
locally against in the store (bench.store); tunnel downloads; stop all.
"""

from __future__ import annotations

import os
import platform
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench import baseline, connects, load, micro, origin, policies, procs
from bench import contenders as C
from bench import store as shared_store
from bench.fakedns import FakeDNS


@dataclass(frozen=True)
class Settings:
    quick: bool = False
    only: tuple[str, ...] | None = None  # a subset of PHASES (`--only connect`); None: all
    baseline_tree: str | None = None  # another checkout's Sluice, in the CONNECT rounds (same-round A/B)

    @property
    def duration(self) -> float:  # seconds measured per wrk run
        return 3 if self.quick else 4

    @property
    def warmup(self) -> float:  # one wrk run per contender and connection count before its rounds
        return 1

    @property
    def rounds(self) -> int:
        """Measured wrk runs of mitmdump and the two Sluices per connection
        count, interleaved in alternating order: the machine's speed drifts,
        so each Sluice run is compared with the mitmdump run next to it."""
        return 1 if self.quick else 6

    @property
    def side_rounds(self) -> int:  # the same for the references (direct, tinyproxy)
        return 1 if self.quick else 2

    @property
    def connections(self) -> tuple[int, ...]:
        return (16, 128)

    @property
    def tunnel_bytes(self) -> int:
        return (64 if self.quick else 256) * 2**20

    @property
    def tunnel_rounds(self) -> int:
        return 1 if self.quick else 3

    @property
    def idle_connections(self) -> int:
        return 100 if self.quick else 500

    # CONNECT setups per second (bench.connects): rounds and side_rounds as above.
    @property
    def connect_duration(self) -> float:  # seconds measured per run
        return 3 if self.quick else 4

    @property
    def connect_clients(self) -> int:
        return 16

    @property
    def run_phases(self) -> tuple[str, ...]:
        return self.only or PHASES


# What `--only` may name; a full run does them all, in this order.
REPO = Path(__file__).resolve().parents[1]  # the checkout this bench runs from (--baseline-tree COMMIT is its)
PHASES = ("micro", "idle", "http", "connect", "store", "tunnel", "extraction")


class NotInNamespace(Exception):
    pass


def check_namespace() -> None:
    """Refuse to send a single packet unless we are inside scripts/in-netns.sh's
    namespace: only `lo`, holding the test addresses."""
    if os.environ.get("SLUICE_NETNS") != "1":
        raise NotInNamespace("not inside the benchmark namespace; run `make bench` "
                             "(or scripts/in-netns.sh .venv/bin/python -m bench)")
    names = sorted(n for _, n in socket.if_nameindex())
    if names != ["lo"]:
        raise NotInNamespace(f"this network namespace has interfaces {names}, not only lo; refusing to run")
    for ip in (origin.HOST, "127.0.0.53"):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                s.bind((ip, 0))
            except OSError:
                raise NotInNamespace(f"{ip} is not a local address here; refusing to run") from None


def machine() -> dict:
    cpu = "unknown"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_kib = 0
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemTotal:"):
                mem_kib = int(line.split()[1])
    except OSError:
        pass

    def version(argv: list[str]) -> str:
        try:
            done = procs.run(argv, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return "not installed"
        text = (done.stdout + done.stderr).strip().splitlines()
        return text[0] if text else "?"

    try:
        from mitmproxy.version import VERSION as mitm
    except ImportError:
        mitm = "?"
    return {
        "nproc": os.cpu_count(), "cpu": cpu, "memory_gib": round(mem_kib / 2**20, 1),
        "kernel": platform.release(), "python": platform.python_version(), "mitmproxy": mitm,
        "nginx": version(["nginx", "-v"]), "wrk": version(["wrk", "-v"]).split(" [")[0],
        "tinyproxy": version(["tinyproxy", "-v"]),
        "proxypy": _package_version("proxy.py"),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def _package_version(name: str) -> str:
    import importlib.metadata

    try:
        return f"{name} {importlib.metadata.version(name)}"
    except importlib.metadata.PackageNotFoundError:
        return f"{name} not installed"


def _raise_nofile() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 65536
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


def _on_signal(signum, _frame):
    raise KeyboardInterrupt(f"signal {signum}")


def run(settings: Settings, log=print) -> dict:
    check_namespace()
    _raise_nofile()
    signal.signal(signal.SIGTERM, _on_signal)
    started = time.monotonic()
    whole = procs.ForeignLoad()
    layout = procs.cpu_layout()
    all_cpus = os.sched_getaffinity(0)
    if layout:
        os.sched_setaffinity(0, layout[0])  # inherited by nginx, wrk, curl
    results: dict = {"settings": {k: getattr(settings, k) for k in
                                  ("quick", "duration", "warmup", "rounds", "side_rounds", "connections", "tunnel_bytes",
                                   "tunnel_rounds", "idle_connections", "connect_duration", "connect_clients", "only",
                                   "baseline_tree",
                                   "run_phases")}
                     | {"cpus": {"load": sorted(layout[0]), "proxy": sorted(layout[1]),
                                 "unpinned": {"cpus": sorted(all_cpus), "contenders": [SCALE]}} if layout else None},
                     "machine": machine(), "micro": None, "http": {}, "tunnel": {}, "idle": {}, "connect": {},
                     "contenders": {}, "origin": None, "notes": []}
    phases = settings.run_phases
    _tcp_tw_reuse(results)
    with tempfile.TemporaryDirectory(prefix="sluice-bench-") as tmp:
        root = Path(tmp)
        root.chmod(0o755)
        policy_files = policies.write_all(root)

        if "micro" in phases:
            log("bench: decision microbenchmark")
            try:
                results["micro"] = micro.run(policy_files, quick=settings.quick)
            except Exception as e:  # e.g. the policy format moved on: report it, run the rest
                results["micro"] = {"error": f"{type(e).__name__}: {e}"}

        if "extraction" in phases:
            log("bench: main-content F1 and the structure check (bench.extraction)")
            try:
                results["extraction"] = extraction_phase()
            except Exception as e:  # report it, run the rest
                results["extraction"] = {"error": f"{type(e).__name__}: {e}"}

        dns = FakeDNS()
        # Only the contenders some chosen phase measures are started.
        everyone = [c for c in C.all_contenders() if c.roles & set(phases)]
        redis = None
        if "store" in phases:
            redis = _start_store(root, policy_files, results, log)
            if redis is None:
                everyone = [c for c in everyone if c.key != STORE_KEY]
        if settings.baseline_tree and {"connect", "http"} & set(phases):
            base = baseline.prepare(settings.baseline_tree, REPO, root)
            baseline.verify(base, log)  # says which file each side imports; refuses a mix of the two trees
            policy_files["baseline"] = policies.write_baseline(root, base.tree)
            everyone.insert([c.key for c in everyone].index("sluice") + 1,
                            C.baseline_contender(base, frozenset(phases)))
        try:
            try:
                dns.start()
            except OSError as e:  # Sluice then fails its test request and is reported n/a
                results["notes"].append(f"the fake DNS server did not start on 127.0.0.53:53: {e}")
            log("bench: starting the origin and the proxies")
            try:
                _, results["origin"] = origin.start(root, settings.tunnel_bytes)
            except (procs.StartError, OSError) as e:
                results["origin"] = f"none: {e}"
                for c in everyone:
                    c.error = "the origin did not start"
            if "connect" in phases or redis is not None:  # the store phase's CONNECT setups too
                results["connect_origin"] = _start_echo(root)
            origin_up = not results["origin"].startswith("none")
            wrapper = C.hosts_wrapper(root) if origin_up else None
            if wrapper is None and origin_up:
                results["notes"].append("mitmdump and tinyproxy were sent the IP literal 8.8.8.8 "
                                        "(no private /etc/hosts could be mounted)")
            for c in everyone:
                if c.error is None:
                    C.start(c, root, policy_files, wrapper, layout[1] if layout else None, all_cpus)
                if c.error is None:
                    _check_works(c)
                log(f"bench:   {c.key}: {'ready' if c.error is None else 'n/a: ' + c.error}")
            results["contenders"] = {c.key: {"label": c.label, "error": c.error, "notes": c.notes,
                                             "rss_start_kib": c.rss_kib()} for c in everyone}

            if "idle" in phases:
                idle_phase(everyone, settings, results, log)  # first: fresh processes, no freed memory to reuse
            if "http" in phases:
                http_phase(everyone, settings, root, results, log, all_cpus)
            if "connect" in phases:
                connect_phase(everyone, settings, results, log)
            if redis is not None:
                store_phase(everyone, settings, root, redis, layout, all_cpus, results, log)
            if "tunnel" in phases:
                tunnel_phase(everyone, settings, results, log)
            other, stolen = whole.cores()
            results["foreign_cores"], results["steal_cores"] = round(other, 2), round(stolen, 2)
            for c in everyone:
                results["contenders"][c.key]["rss_end_kib"] = c.rss_kib()
                if c.workers > 1:
                    results["contenders"][c.key]["rss_end_kib_by_process"] = c.rss_kib_by_process()
                if c.error is not None:
                    results["contenders"][c.key]["error"] = c.error
        finally:
            procs.stop_all()
            dns.stop()
        results["dns_queries"] = dns.queries
    results["seconds"] = round(time.monotonic() - started, 1)
    return results


def _start_store(root: Path, policy_files: dict[str, Path], results: dict, log) -> procs.Proc | None:
    """The store phase's redis-server (on the load side's core, like nginx), and
    the policy that counts in it; None (the phase skipped, one line) without it."""
    why = shared_store.missing()
    redis = None
    if why is None:
        try:
            redis = shared_store.start(root)
        except (procs.StartError, OSError) as e:
            why = f"redis-server did not start: {e}"
    if redis is None:
        results["store"] = {"skipped": why}
        log(f"bench: shared-store phase skipped: {why}")
        return None
    results["machine"]["redis"] = shared_store.version()
    policy_files["limits-store"] = policies.write_store(root, shared_store.url(), f"{shared_store.TIMEOUT:g}s")
    return redis


def _check_works(c: C.Contender) -> None:
    """One request through the contender; a refusal or failure makes it n/a."""
    try:
        status, detail = load.probe(c.proxy or (origin.HOST, origin.PORT), c.url_host, C.NAME, origin.SMALL)
    except Exception as e:  # OSError, http.client.HTTPException: n/a, not a crash
        c.error = f"a test request failed: {e}"
        return
    if status != 200:
        c.error = f"a test request got HTTP {status}: {detail}"


def _tcp_tw_reuse(results: dict) -> None:
    """Let this namespace's outgoing connections reuse TIME_WAIT ports (the
    setting is per network namespace; the host's is untouched). The CONNECT
    scenario opens thousands of proxy-to-origin connections to one address,
    and the proxy closes them first: without this they could run out of
    ephemeral ports within the 60 s a closed connection waits."""
    path = Path("/proc/sys/net/ipv4/tcp_tw_reuse")
    try:
        if path.read_text().strip() != "1":
            path.write_text("1\n")
    except OSError as e:
        results["notes"].append(f"could not set net.ipv4.tcp_tw_reuse=1 in the namespace ({e}); "
                                "CONNECT runs may meet ephemeral port exhaustion")


def _start_echo(root: Path) -> str:
    """The CONNECT scenario's origin: an echo server on 8.8.8.8:443."""
    proc = procs.Proc("echo", [sys.executable, "-m", "bench.connects", "origin", connects.HOST, str(connects.PORT)],
                      root / "echo.log")
    try:
        proc.start().wait_port(connects.HOST, connects.PORT, timeout=15)
    except (procs.StartError, OSError) as e:
        return f"none: {e}"
    return f"asyncio echo server on {connects.HOST}:{connects.PORT}"


def _usable(c: C.Contender, role: str) -> bool:
    return role in c.roles and c.error is None and (c.proc is None or c.proc.alive())


# ---- phases -----------------------------------------------------------------


def extraction_phase() -> dict:
    """Sluice's main-content F1 and structure shares on the held-out half (no network)."""
    from bench import extraction

    held = extraction.load(extraction.HELD_OUT)
    quiet = lambda _m: None  # noqa: E731
    f1 = extraction.quality(held, {"sluice (markdown, links)"}, log=quiet)["sluice (markdown, links)"]
    return {"f1": f1, "structure": extraction.structure(held, log=quiet)}

def _slope(points: list[tuple[int, int]]) -> float | None:
    """Least-squares slope of RSS (KiB) over open tunnels."""
    if len(points) < 2:
        return None
    mx = statistics.mean(x for x, _ in points)
    my = statistics.mean(y for _, y in points)
    sxx = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else None


def idle_phase(everyone: list[C.Contender], s: Settings, results: dict, log) -> None:
    """RSS growth per idle CONNECT tunnel. A first batch of n tunnels is
    opened and held unmeasured: a fresh process reuses memory it already
    freed (the 10k-policy Sluice has megabytes of it from parsing its YAML),
    which would hide the first few hundred tunnels. Then n more are opened in
    steps, and the least-squares slope of RSS over them is the cost."""
    n = s.idle_connections
    steps = 5
    log(f"bench: memory per idle tunnel ({n} CONNECT tunnels held, then {n} more measured)")
    for c in everyone:
        if "idle" not in c.roles:
            continue
        if not _usable(c, "idle"):
            results["idle"][c.key] = {"error": c.error or "not running"}
            continue
        connect_to = f"{c.url_host}:80"
        deadline = time.monotonic() + 90
        held: list = []
        points: list[tuple[int, int]] = []
        r: dict = {"fill": n, "requested": n}
        try:
            held, err = load.open_idle_tunnels(c.proxy, connect_to, n, deadline)
            base = len(held)
            if not err:
                time.sleep(0.3)
                rss = c.rss_kib()
                if rss is not None:
                    points.append((0, rss))
                for _ in range(steps):
                    socks, err = load.open_idle_tunnels(c.proxy, connect_to, n // steps, deadline)
                    held += socks
                    time.sleep(0.3)
                    rss = c.rss_kib()
                    if rss is not None:
                        points.append((len(held) - base, rss))
                    if err:
                        break
        finally:
            load.close_all(held)
        r.update(opened=len(held) - base, points=points)
        slope = _slope(points)
        if not c.proc.alive():
            r["error"] = "the proxy exited"
        elif err and len(held) < n:
            r["error"] = err
        elif slope is None:
            r["error"] = err or "too few measurements"
        else:
            r["kib_per_conn"] = slope
            if err:
                r["warning"] = err
        results["idle"][c.key] = r
        log(f"bench:   {c.key}: " + (f"{r['kib_per_conn']:.1f} KiB per tunnel" if "kib_per_conn" in r else r["error"]))
        time.sleep(1.0)  # let the proxy close its upstream sides


# Measured every round; the rest are references. proxy.py too: the targets
# are ratios against it, paired by round.
KEY = ("mitmdump", "sluice", "sluice-10k", "sluice-limits", "proxypy")
# Also measured every round, but left out of KEY's quiet-round test: its
# workers share both CPUs with the load side, and its ratios get their own.
SCALE = "sluice-w2"
# --baseline-tree: another tree's Sluice, every round too, for a same-round A/B.
BASELINE_KEY = "sluice-baseline"
EVERY_ROUND = KEY + (SCALE, BASELINE_KEY)


QUIET = 0.25  # cores of other processes' load under which a run counts as quiet
MIN_QUIET_ROUNDS = 3


def _paired(runs: dict[str, list[dict]], key: str, base: str, field: str,
            rounds: set[int] | None = None) -> float | None:
    """Median over rounds (those in `rounds`, if given) of key's value /
    base's value in the same round."""
    by_round = {r["round"]: r for r in runs.get(base, []) if "error" not in r and r.get(field)}
    ratios = [r[field] / by_round[r["round"]][field] for r in runs.get(key, [])
              if "error" not in r and r.get(field) is not None and r["round"] in by_round
              and (rounds is None or r["round"] in rounds)]
    return statistics.median(ratios) if ratios else None


def _quiet_rounds(runs: dict[str, list[dict]], keys: tuple[str, ...]) -> set[int]:
    """Rounds in which no run of `keys` saw other processes' load."""
    rounds: dict[int, bool] = {}
    for key in keys:
        for r in runs.get(key, []):
            quiet = "error" not in r and (r.get("foreign_cores") or 0) < QUIET
            rounds[r["round"]] = rounds.get(r["round"], True) and quiet
    return {rnd for rnd, quiet in rounds.items() if quiet}


def http_phase(everyone: list[C.Contender], s: Settings, root: Path, results: dict, log,
               all_cpus: set[int] | None = None) -> None:
    scripts = {host: load.wrk_script(root, C.NAME, host, origin.SMALL) for host in {c.url_host for c in everyone}}
    runners = [c for c in everyone if "http" in c.roles]
    for conns in s.connections:
        per: dict[str, list[dict]] = {c.key: [] for c in runners}
        warm_failed: dict[str, str] = {}
        log(f"bench: {conns} connections: warm-up")
        for c in runners:
            if _usable(c, "http"):
                warm = load.wrk(c.target, scripts[c.url_host], connections=conns, duration=s.warmup,
                                threads=2 if c.proxy is None else 1, cpus=all_cpus if c.proxy is None else None)
                if "error" in warm and not warm.get("requests"):
                    warm_failed[c.key] = warm["error"]
        for rnd in range(s.rounds):
            order = [c for c in runners if (c.key in EVERY_ROUND or rnd < s.side_rounds)
                     and _usable(c, "http") and c.key not in warm_failed]
            if rnd % 2:
                order.reverse()
            log(f"bench: {conns} connections, round {rnd + 1}/{s.rounds}: " + " ".join(c.key for c in order))
            for c in order:
                if not _usable(c, "http") or c.key in warm_failed:
                    continue
                cpu0 = c.cpu_seconds()
                split0 = c.cpu_by_pid() if c.workers > 1 else {}
                accepted0 = origin.accepted_connections()
                foreign = procs.ForeignLoad()
                r = load.wrk(c.target, scripts[c.url_host], connections=conns, duration=s.duration,
                             threads=2 if c.proxy is None else 1, cpus=all_cpus if c.proxy is None else None)
                cpu1 = c.cpu_seconds()
                if c.workers > 1:
                    # CPU seconds per process of the tree over the run (supervisor
                    # first): shows how evenly SO_REUSEPORT spread the connections.
                    split1 = c.cpu_by_pid()
                    r["cpu_s_by_process"] = [round(split1[pid] - split0.get(pid, 0.0), 2)
                                             for pid in procs.root_first(c.proc.pid, split1)]
                other, stolen = foreign.cores()
                r["foreign_cores"], r["steal_cores"] = round(other, 2), round(stolen, 2)
                accepted1 = origin.accepted_connections()
                if accepted0 is not None and accepted1 is not None:
                    r["upstream_conns"] = accepted1 - accepted0 - 1  # less the status query's own
                if cpu0 is not None and cpu1 is not None and r.get("requests"):
                    r["cpu_us_per_req"] = (cpu1 - cpu0) / r["requests"] * 1e6
                r["rss_kib"] = c.rss_kib()
                r["round"] = rnd
                per[c.key].append(r)
        # Ratios use the quiet rounds when there are enough of them: another
        # process's burst of CPU lands on one contender's run, not its pair's.
        quiet = _quiet_rounds(per, KEY)
        use = quiet if len(quiet) >= MIN_QUIET_ROUNDS else None
        quiet_scale = _quiet_rounds(per, KEY + (SCALE,))
        use_scale = quiet_scale if len(quiet_scale) >= MIN_QUIET_ROUNDS else None
        summary = {"_rounds": {"all": s.rounds, "quiet": sorted(quiet), "ratios_from": "quiet" if use else "all",
                               "quiet_with_workers": sorted(quiet_scale),
                               "workers_ratios_from": "quiet" if use_scale else "all"}}
        for c in runners:
            runs = per[c.key]
            good = [r for r in runs if "error" not in r]
            if not good:
                summary[c.key] = {"error": c.error or warm_failed.get(c.key) or (runs[0]["error"] if runs else "not run")}
                continue
            cpus = [r["cpu_us_per_req"] for r in good if "cpu_us_per_req" in r]
            row = {
                "rps": statistics.median(r["rps"] for r in good),
                "p50_ms": statistics.median(r["p50_us"] for r in good) / 1000,
                "p99_ms": statistics.median(r["p99_us"] for r in good) / 1000,
                "cpu_us_per_req": statistics.median(cpus) if cpus else None,
                "rounds": len(good),
                "rps_runs": [round(r["rps"], 1) for r in good],
                "p50_ms_runs": [round(r["p50_us"] / 1000, 2) for r in good],
                "foreign_cores_runs": [r.get("foreign_cores") for r in good],
                "upstream_conns_runs": [r.get("upstream_conns") for r in good],
                "errors": sum(r["errors"] for r in good),
                "read_errors": sum(r["read"] for r in good),
                "requests": sum(r["requests"] for r in good),
                "rss_kib": good[-1].get("rss_kib"),
                "failed_runs": [r["error"] for r in runs if "error" in r],
            }
            if c.workers > 1:
                row["cpu_s_by_process_runs"] = [r.get("cpu_s_by_process") for r in good]
            # Ratios are medians of same-round ratios (adjacent runs), which
            # cancel most of the machine's drift.
            if c.key != "mitmdump":
                # The references ran too few rounds to filter; --workers 2 is
                # filtered by the rounds in which its own run was quiet too.
                pick = use_scale if c.key == SCALE else use if c.key in KEY else None
                row["rps_ratio"] = _paired(per, c.key, "mitmdump", "rps", pick)
                row["p50_ratio"] = _paired(per, c.key, "mitmdump", "p50_us", pick)
                row["cpu_ratio"] = _paired(per, c.key, "mitmdump", "cpu_us_per_req", pick)
            if c.key.startswith("sluice") and c.key != SCALE:
                row["rps_vs_proxypy"] = _paired(per, c.key, "proxypy", "rps", use)
                row["cpu_vs_proxypy"] = _paired(per, c.key, "proxypy", "cpu_us_per_req", use)
            if c.key in ("sluice-10k", BASELINE_KEY):
                row["rps_vs_default"] = _paired(per, c.key, "sluice", "rps", use)
                row["p50_vs_default"] = _paired(per, c.key, "sluice", "p50_us", use)
                row["cpu_vs_default"] = _paired(per, c.key, "sluice", "cpu_us_per_req", use)
            if c.key == SCALE:  # the scaling: workers vs the single-process Sluice, same policy, same rounds
                row["rps_vs_single"] = _paired(per, c.key, "sluice", "rps", use_scale)
                row["p50_vs_single"] = _paired(per, c.key, "sluice", "p50_us", use_scale)
                row["cpu_vs_single"] = _paired(per, c.key, "sluice", "cpu_us_per_req", use_scale)
            summary[c.key] = row
        results["http"][str(conns)] = summary


# Every round (proxy.py too: a target is a ratio against it); tinyproxy and direct are references.
CONNECT_KEYS = ("mitmdump", "sluice", "sluice-baseline", "sluice-10k", "sluice-limits", "proxypy")


def connect_phase(everyone: list[C.Contender], s: Settings, results: dict, log) -> None:
    """CONNECT setups per second: `connect_clients` concurrent loops of a new
    connection, CONNECT, a ClientHello's worth of bytes echoed, close
    (bench.connects). Rounds interleaved in alternating order like the
    request-rate phase; ratios are medians of same-round ratios."""
    runners = [c for c in everyone if "connect" in c.roles]
    results["connect"] = {}
    if str(results.get("connect_origin", "none")).startswith("none"):
        for c in runners:
            results["connect"][c.key] = {"error": f"no echo origin ({results.get('connect_origin')})"}
        return
    log(f"bench: CONNECT setups ({s.connect_clients} clients, {s.connect_duration:g} s runs): warm-up")

    def measure(c: C.Contender, seconds: float) -> dict:
        if c.proxy is None:
            return load.connect_setups((connects.HOST, connects.PORT), None, clients=s.connect_clients,
                                       seconds=seconds)
        return load.connect_setups(c.proxy, f"{c.url_host}:{connects.PORT}", clients=s.connect_clients,
                                   seconds=seconds)

    warm_failed: dict[str, str] = {}
    for c in runners:
        if _usable(c, "connect"):
            warm = measure(c, s.warmup)
            if "error" in warm and not warm.get("setups"):
                warm_failed[c.key] = warm["error"]
    per: dict[str, list[dict]] = {c.key: [] for c in runners}
    for rnd in range(s.rounds):
        order = [c for c in runners if (c.key in CONNECT_KEYS or rnd < s.side_rounds)
                 and _usable(c, "connect") and c.key not in warm_failed]
        if rnd % 2:
            order.reverse()
        log(f"bench: CONNECT setups, round {rnd + 1}/{s.rounds}: " + " ".join(c.key for c in order))
        for c in order:
            cpu0 = c.cpu_seconds()
            foreign = procs.ForeignLoad()
            r = measure(c, s.connect_duration)
            cpu1 = c.cpu_seconds()
            other, stolen = foreign.cores()
            r["foreign_cores"], r["steal_cores"] = round(other, 2), round(stolen, 2)
            if cpu0 is not None and cpu1 is not None and r.get("setups"):
                # Includes the setups still in flight at the end: a slight overestimate, alike for all.
                r["cpu_us_per_setup"] = (cpu1 - cpu0) / r["setups"] * 1e6
            r["round"] = rnd
            per[c.key].append(r)
    quiet = _quiet_rounds(per, CONNECT_KEYS)
    use = quiet if len(quiet) >= MIN_QUIET_ROUNDS else None
    summary: dict = {"_rounds": {"all": s.rounds, "quiet": sorted(quiet), "ratios_from": "quiet" if use else "all"}}
    for c in runners:
        runs = per[c.key]
        good = [r for r in runs if "error" not in r]
        if not good:
            summary[c.key] = {"error": c.error or warm_failed.get(c.key) or (runs[0]["error"] if runs else "not run")}
            continue
        cpus = [r["cpu_us_per_setup"] for r in good if "cpu_us_per_setup" in r]
        row = {
            "rate": statistics.median(r["rate"] for r in good),
            "p50_ms": statistics.median(r["p50_ms"] for r in good),
            "p99_ms": statistics.median(r["p99_ms"] for r in good),
            "to_200_p50_ms": statistics.median(r["to_200_p50_ms"] for r in good),
            "cpu_us_per_setup": statistics.median(cpus) if cpus else None,
            "rounds": len(good),
            "rate_runs": [round(r["rate"], 1) for r in good],
            "p50_ms_runs": [round(r["p50_ms"], 2) for r in good],
            "cpu_us_per_setup_runs": [round(x) for x in cpus],
            "foreign_cores_runs": [r.get("foreign_cores") for r in good],
            "setups": sum(r["setups"] for r in good),
            "errors": sum(r["errors"] for r in good),
            "error_samples": sorted({e for r in runs for e in r.get("error_samples", [])})[:5],
            "failed_runs": [r["error"] for r in runs if "error" in r],
        }
        if c.key != "mitmdump" and c.proxy is not None:
            pick = use if c.key in CONNECT_KEYS else None  # the references ran too few rounds to filter
            row["rate_ratio"] = _paired(per, c.key, "mitmdump", "rate", pick)
            row["p50_ratio"] = _paired(per, c.key, "mitmdump", "p50_ms", pick)
            row["cpu_ratio"] = _paired(per, c.key, "mitmdump", "cpu_us_per_setup", pick)
        if c.key.startswith("sluice"):
            row["rate_vs_proxypy"] = _paired(per, c.key, "proxypy", "rate", use)
            row["cpu_vs_proxypy"] = _paired(per, c.key, "proxypy", "cpu_us_per_setup", use)
        if c.key in ("sluice-10k", "sluice-baseline"):
            row["rate_vs_default"] = _paired(per, c.key, "sluice", "rate", use)
            row["cpu_vs_default"] = _paired(per, c.key, "sluice", "cpu_us_per_setup", use)
        summary[c.key] = row
        log(f"bench:   {c.key}: {row['rate']:.0f} setups/s (runs {row['rate_runs']}), p50 {row['p50_ms']:.1f} ms"
            + (f", {row['rate_ratio']:.2f}x mitmdump" if row.get("rate_ratio") else ""))
    results["connect"] = summary


LOCAL_KEY, STORE_KEY = "sluice-limits", "sluice-limits-store"


def _ratio_spread(local: list[dict], store: list[dict], field: str) -> dict | None:
    """Median and min–max of store / local over the rounds both ran."""
    by_round = {r["round"]: r for r in local if r.get(field)}
    ratios = [r[field] / by_round[r["round"]][field] for r in store if r.get(field) and r["round"] in by_round]
    if not ratios:
        return None
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "runs": len(ratios)}


def store_phase(everyone: list[C.Contender], s: Settings, root: Path, redis: procs.Proc,
                layout: tuple[set[int], set[int]] | None, all_cpus: set[int], results: dict, log) -> None:
    """The cost of shared limits (bench.store): the quota decision, local
    against redis-server on loopback; then Sluice with every quota on, local
    counters (sluice-limits) against the store (sluice-limits-store), keep-alive
    requests and CONNECT setups, in interleaved rounds."""
    out: dict = {"server": results["machine"].get("redis"), "url": shared_store.url(),
                 "timeout_s": shared_store.TIMEOUT}
    results["store"] = out
    log("bench: shared-store decision cost (local counters vs redis-server on loopback)")
    if layout:
        procs.pin(redis.pid, all_cpus)  # the proxies are idle now: the store may run beside this process
    try:
        out["decisions"] = shared_store.decisions(shared_store.url(), quick=s.quick)
    except Exception as e:  # reported, not fatal
        out["decisions"] = {"error": f"{type(e).__name__}: {e}"}
    finally:
        if layout:
            procs.pin(redis.pid, layout[0])
    out["decisions"]["server"] = out["server"]
    if str(results.get("connect_origin", "none")).startswith("none"):
        out["error"] = f"no echo origin for the CONNECT setups ({results.get('connect_origin')})"
        return
    pair = {c.key: c for c in everyone if c.key in (LOCAL_KEY, STORE_KEY)}
    missing = [k for k in (LOCAL_KEY, STORE_KEY) if k not in pair or not _usable(pair[k], "store")]
    if missing:
        out["error"] = "; ".join(f"{k}: {pair[k].error if k in pair else 'not started'}" for k in missing)
        return
    conns = s.connections[0]
    script = load.wrk_script(root, C.NAME, pair[LOCAL_KEY].url_host, origin.SMALL)
    rounds = 2 if s.quick else s.rounds
    runs: dict[str, dict[str, list[dict]]] = {"http": {LOCAL_KEY: [], STORE_KEY: []},
                                               "connect": {LOCAL_KEY: [], STORE_KEY: []}}
    for c in pair.values():  # warm-up: connections to the store, scripts loaded, origin keep-alive
        load.wrk(c.target, script, connections=conns, duration=s.warmup)
    for rnd in range(rounds):
        order = [pair[LOCAL_KEY], pair[STORE_KEY]]
        if rnd % 2:
            order.reverse()
        log(f"bench: shared store, round {rnd + 1}/{rounds}: " + " ".join(c.key for c in order))
        for c in order:
            for kind in ("http", "connect"):
                cpu0, store0, foreign = c.cpu_seconds(), redis.cpu_seconds(), procs.ForeignLoad()
                if kind == "http":
                    r = load.wrk(c.target, script, connections=conns, duration=s.duration)
                    done = r.get("requests")
                else:
                    r = load.connect_setups(c.proxy, f"{c.url_host}:{connects.PORT}", clients=s.connect_clients,
                                            seconds=s.connect_duration)
                    done = r.get("setups")
                cpu1, store1 = c.cpu_seconds(), redis.cpu_seconds()
                r["foreign_cores"] = round(foreign.cores()[0], 2)
                if done and cpu0 is not None and cpu1 is not None:
                    r["cpu_us"] = (cpu1 - cpu0) / done * 1e6
                if done and store0 is not None and store1 is not None:
                    r["store_cpu_us"] = (store1 - store0) / done * 1e6
                r["round"] = rnd
                runs[kind][c.key].append(r)
    for kind, rate, unit in (("http", "rps", "req/s"), ("connect", "rate", "setups/s")):
        summary: dict = {"connections" if kind == "http" else "clients": conns if kind == "http" else s.connect_clients}
        for key in (LOCAL_KEY, STORE_KEY):
            good = [r for r in runs[kind][key] if "error" not in r]
            if not good:
                summary[key] = {"error": next((r["error"] for r in runs[kind][key]), "not run")}
                continue
            cpus = [r["cpu_us"] for r in good if "cpu_us" in r]
            summary[key] = {
                rate: statistics.median(r[rate] for r in good), f"{rate}_runs": [round(r[rate], 1) for r in good],
                "cpu_us": statistics.median(cpus) if cpus else None,
                "store_cpu_us": statistics.median([r["store_cpu_us"] for r in good if "store_cpu_us" in r] or [0]),
                "foreign_cores_runs": [r.get("foreign_cores") for r in good],
                "failed_runs": [r["error"] for r in runs[kind][key] if "error" in r],
            }
        local = [r for r in runs[kind][LOCAL_KEY] if "error" not in r]
        shared = [r for r in runs[kind][STORE_KEY] if "error" not in r]
        summary["ratio"] = _ratio_spread(local, shared, rate)
        summary["cpu_ratio"] = _ratio_spread(local, shared, "cpu_us")
        if kind == "http":
            summary["p50_ratio"] = _ratio_spread(local, shared, "p50_us")
        out[kind] = summary
        ratio = summary["ratio"]
        log(f"bench:   {kind}: store/local {unit} " + (f"{ratio['median']:.2f}x ({ratio['min']:.2f}-{ratio['max']:.2f})"
                                                      if ratio else "n/a"))
    # A store that stalled past the timeout turns the process to local counting: say so.
    try:
        text = pair[STORE_KEY].proc.log.read_text(errors="replace")
    except OSError:
        text = ""
    out["fallbacks"] = text.count("counting in this process until it is back")


def tunnel_phase(everyone: list[C.Contender], s: Settings, results: dict, log) -> None:
    log(f"bench: CONNECT tunnel download ({s.tunnel_bytes // 2**20} MiB, {s.tunnel_rounds} rounds)")
    runners = [c for c in everyone if "tunnel" in c.roles]
    per: dict[str, list[dict]] = {c.key: [] for c in runners}
    for rnd in range(s.tunnel_rounds):
        order = runners if rnd % 2 == 0 else list(reversed(runners))
        for c in order:
            if not _usable(c, "tunnel"):
                continue
            connect_host = origin.HOST if c.proxy is None else c.url_host
            r = load.curl_download(c.proxy, connect_host, C.NAME, origin.LARGE, s.tunnel_bytes)
            r["round"] = rnd
            per[c.key].append(r)
    for c in runners:
        runs = per[c.key]
        good = [r for r in runs if "error" not in r]
        if not good:
            results["tunnel"][c.key] = {"error": c.error or (runs[0]["error"] if runs else "not run")}
            continue
        results["tunnel"][c.key] = {
            "mbps": statistics.median(r["mbps"] for r in good),
            "mbps_runs": [round(r["mbps"], 1) for r in good],
            "ratio": _paired(per, c.key, "mitmdump", "mbps") if c.key != "mitmdump" else 1.0,
            "rss_kib": c.rss_kib(),
            "failed_runs": [r["error"] for r in runs if "error" in r],
        }
        log(f"bench:   {c.key}: {results['tunnel'][c.key]['mbps']:.0f} MB/s")
