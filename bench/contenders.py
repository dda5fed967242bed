"""The things compared: the origin directly, plain mitmdump, Sluice with its
policies (default, 10k rules, every quota on: counted in process and in a
shared store), Sluice with two worker processes, tinyproxy, and proxy.py (a lean
pure-Python proxy: what a Python proxy without mitmproxy's machinery costs). `roles` says which
phases measure a contender (micro needs none). Each proxy is its
own process (or process tree, for --workers) on its own port."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

from bench import procs
from bench.baseline import Baseline
from bench.origin import HOST as ORIGIN_IP

LISTEN = "127.0.0.1"
NAME = "public.example"  # resolves to the origin (fake DNS for Sluice, a hosts file for the others)
VENV_BIN = Path(sys.executable).parent

# Plain mitmdump as the brief runs it: no addon, no onboarding app, quiet log,
# eager upstream connections (mitmproxy's default, spelled out), and no
# per-flow console lines (flow_detail=0: Sluice runs without the dumper too).
MITMDUMP_SETS = ["onboarding=false", "termlog_verbosity=warn", "connection_strategy=eager", "flow_detail=0"]


@dataclass
class Contender:
    key: str
    label: str
    port: int | None = None  # None: the origin itself
    roles: frozenset[str] = frozenset({"http", "tunnel", "idle", "connect"})
    proc: procs.Proc | None = None
    error: str | None = None  # why this contender is n/a
    url_host: str = NAME  # what goes into the request line / CONNECT
    notes: list[str] = field(default_factory=list)
    workers: int = 1  # > 1: `sluice proxy --workers N`, a supervisor and N worker processes
    pinned: bool = True  # pinned to the proxy core; False: allowed every CPU (shared with the load side)
    tree: Path | None = None  # another checkout whose Sluice code this contender runs (--baseline-tree)
    import_root: Path | None = None  # with `tree`: its code in the installed layout (bench/baseline.py)

    @property
    def proxy(self) -> tuple[str, int] | None:
        return (LISTEN, self.port) if self.port is not None else None

    @property
    def target(self) -> str:
        return f"http://{LISTEN}:{self.port}" if self.port is not None else f"http://{ORIGIN_IP}:80"

    def rss_kib(self) -> int | None:
        return self.proc.rss_kib() if self.proc is not None else None

    def cpu_seconds(self) -> float | None:
        """CPU time of the contender's process and its descendants (the
        workers, with --workers), like rss_kib()."""
        return self.proc.tree_cpu_seconds() if self.proc is not None else None

    def rss_kib_by_process(self) -> list[int | None]:
        """VmRSS of each process of the tree, by pid (the supervisor first, with --workers)."""
        if self.proc is None or not self.proc.alive():
            return []
        by_pid = procs.tree_rss_by_pid(self.proc.pid)
        return [by_pid[pid] for pid in procs.root_first(self.proc.pid, by_pid)]

    def cpu_by_pid(self) -> dict[int, float]:
        return procs.tree_cpu_by_pid(self.proc.pid) if self.proc is not None and self.proc.alive() else {}


def all_contenders() -> list[Contender]:
    return [
        # For CONNECT setups: straight to the echo origin, no CONNECT (the load side's ceiling).
        Contender("direct", "direct to nginx (no proxy)", None, frozenset({"http", "tunnel", "connect"})),
        Contender("mitmdump", "mitmdump (plain, no addon)", 18080),
        Contender("mitmdump-tcp", "mitmdump, tunnels as TCP flows (tcp_hosts=.*)", 18085, frozenset({"tunnel", "idle"})),
        Contender("sluice", "Sluice, default policy", 18081),
        # The scale-out path: not pinned, so on a 2-CPU machine its workers
        # share both CPUs with wrk, nginx and the benchmark itself.
        Contender("sluice-w2", "Sluice, default policy, --workers 2 (not pinned: both CPUs, shared with wrk and nginx)",
                  18086, frozenset({"http"}), workers=2, pinned=False),
        Contender("sluice-10k", "Sluice, 10k patterns + 1k CIDRs", 18082),
        Contender("sluice-limits", "Sluice, default policy + every quota limit on", 18088,
                  frozenset({"http", "connect", "store"})),
        # The same quotas counted in a redis-server on loopback (bench.store), beside sluice-limits.
        Contender("sluice-limits-store", "Sluice, every quota limit on, counted in redis-server (state.store)", 18089,
                  frozenset({"store"})),
        Contender("tinyproxy", "tinyproxy (reference)", 18083),
        Contender("proxypy", "proxy.py (pure Python, 1 worker, 1 acceptor)", 18084, frozenset({"http", "connect"})),
    ]


def baseline_contender(baseline: Baseline, phases: frozenset[str] = frozenset({"connect"})) -> Contender:
    """Sluice from another checkout or commit (bench/baseline.py), run with
    this venv and its own import root, in the same CONNECT and request-rate
    rounds as the current code (those of `phases` that run): a same-round A/B."""
    label = f"Sluice at {baseline.label} (baseline tree {baseline.tree}), default policy"
    return Contender("sluice-baseline", label, 18087, frozenset({"connect", "http"}) & phases, tree=baseline.tree,
                     import_root=baseline.import_root)


# ---- name resolution for the proxies that use the system resolver ----------

def hosts_wrapper(root: Path) -> list[str] | None:
    """argv prefix that runs a command with /etc/hosts replaced (in a private
    mount namespace) by one naming public.example -> 8.8.8.8, so mitmdump and
    tinyproxy can be sent the same requests as Sluice. None if that is not
    possible here (then they are sent the IP literal)."""
    hosts = root / "hosts"
    hosts.write_text(f"127.0.0.1 localhost\n::1 localhost\n{ORIGIN_IP} {NAME}\n")
    hosts.chmod(0o644)
    unshare = shutil.which("unshare")
    if unshare is None:
        return None
    prefix = [unshare, "-m", "--", "sh", "-c", 'mount --bind "$0" /etc/hosts && exec "$@"', str(hosts)]
    try:
        done = procs.run(prefix + ["getent", "hosts", NAME], timeout=10)
    except subprocess.TimeoutExpired:
        return None
    return prefix if done.returncode == 0 and ORIGIN_IP in done.stdout else None


# ---- starting ---------------------------------------------------------------

def start(c: Contender, root: Path, policies: dict[str, Path], wrapper: list[str] | None,
          cpus: set[int] | None = None, all_cpus: set[int] | None = None) -> None:
    """Start one contender's process, wait for its port and pin it to cpus
    (an unpinned contender's whole process tree gets all_cpus instead); on
    failure set c.error (the contender is then reported n/a) instead of raising."""
    if c.port is None:
        return
    try:
        if c.key.startswith("mitmdump"):
            _start_mitmdump(c, root, wrapper)
        elif c.key.startswith("sluice"):
            _start_sluice(c, root, policies["large" if c.key == "sluice-10k" else
                                            "limits" if c.key == "sluice-limits" else
                                            "limits-store" if c.key == "sluice-limits-store" else
                                            "baseline" if c.key == "sluice-baseline" else "default"])
        elif c.key == "tinyproxy":
            _start_tinyproxy(c, root, wrapper)
        elif c.key == "proxypy":
            _start_proxypy(c, root, wrapper)
        c.proc.wait_port(LISTEN, c.port, timeout=30)
        if c.workers > 1:
            # The port answers as soon as the first worker listens; wait for
            # the supervisor's line saying that all of them do.
            c.proc.wait_log(f"[{c.workers} workers]", timeout=60)
        if not c.pinned:
            # The benchmark runs on the load core and its children inherit
            # that: give the whole tree (supervisor and workers) every CPU.
            procs.pin_tree(c.proc.pid, all_cpus or os.sched_getaffinity(c.proc.pid))
        elif cpus:
            procs.pin(c.proc.pid, cpus)
    except (procs.StartError, OSError) as e:
        c.error = f"did not start: {e}"
        if c.proc is not None:
            c.proc.stop()


def _confdir(root: Path) -> str:
    d = root / "mitmproxy-conf"  # the CA mitmproxy creates at start stays in the run's temp dir
    d.mkdir(exist_ok=True)
    return str(d)


def _start_mitmdump(c: Contender, root: Path, wrapper: list[str] | None) -> None:
    exe = VENV_BIN / "mitmdump"
    if not exe.exists():
        raise procs.StartError(f"{exe} not found")
    argv = [str(exe), "--listen-host", LISTEN, "--listen-port", str(c.port)]
    for s in MITMDUMP_SETS + [f"confdir={_confdir(root)}"]:
        argv += ["--set", s]
    if c.key == "mitmdump-tcp":
        argv += ["--set", "tcp_hosts=.*"]
    else:
        # A CONNECT tunnel passed through untouched: how plain mitmproxy carries
        # traffic it is told not to intercept (mitmdump-tcp shows the TCP-flow way).
        argv += ["--set", "ignore_hosts=.*"]
    if wrapper is None:
        c.url_host = ORIGIN_IP
        c.notes.append("sent the IP literal (no private /etc/hosts possible here)")
    c.proc = procs.Proc(c.key, (wrapper or []) + argv, root / f"{c.key}.log").start()


def _start_sluice(c: Contender, root: Path, policy: Path) -> None:
    exe = VENV_BIN / "sluice"
    argv = [str(exe), "proxy", "--policy", str(policy), "--listen", f"{LISTEN}:{c.port}",
            "--audit-log", str(root / f"audit-{c.key}.jsonl"), "--set", f"confdir={_confdir(root)}"]
    if c.workers > 1:
        argv += ["--workers", str(c.workers)]
    if c.tree is None:
        # Each Sluice its own admin port (metrics on, as by default); a
        # baseline tree may predate --admin.
        argv += ["--admin", f"{LISTEN}:{c.port + 1000}"]
    env = None
    if c.import_root is not None:
        # Its sluice, addons and policy packages first, in the installed
        # layout (bench/baseline.py); -P: not the current directory's (this
        # checkout's), which `-m` would otherwise put first.
        env = dict(os.environ, PYTHONPATH=str(c.import_root))
        argv = [sys.executable, "-P", "-m", "sluice.cli"] + argv[1:]
    elif not exe.exists():
        argv = [sys.executable, "-m", "sluice.cli"] + argv[1:]
    c.proc = procs.Proc(c.key, argv, root / f"{c.key}.log", env=env).start()


def _start_tinyproxy(c: Contender, root: Path, wrapper: list[str] | None) -> None:
    exe = shutil.which("tinyproxy") or ("/usr/bin/tinyproxy" if os.path.exists("/usr/bin/tinyproxy") else None)
    if exe is None:
        raise procs.StartError("tinyproxy is not installed (`python -m bench deps` installs it, outside the namespace)")
    conf = root / "tinyproxy.conf"
    conf.write_text(textwrap.dedent(f"""\
        Port {c.port}
        Listen {LISTEN}
        Timeout 600
        MaxClients 2048
        LogFile "{root}/tinyproxy-own.log"
        LogLevel Error
        PidFile "{root}/tinyproxy.pid"
        Allow 127.0.0.1
        XTinyproxy No
        DisableViaHeader Yes
    """))
    if wrapper is None:
        c.url_host = ORIGIN_IP
        c.notes.append("sent the IP literal (no private /etc/hosts possible here)")
    c.proc = procs.Proc(c.key, (wrapper or []) + [exe, "-d", "-c", str(conf)], root / f"{c.key}.log").start()


def _start_proxypy(c: Contender, root: Path, wrapper: list[str] | None) -> None:
    """proxy.py as its README starts it for one core: one worker, one acceptor
    (its default log level: a line per request, as Sluice writes an audit line)."""
    exe = VENV_BIN / "proxy"
    if not exe.exists():
        raise procs.StartError(f"{exe} not found (`python -m bench deps` installs proxy.py into the venv)")
    if wrapper is None:
        c.url_host = ORIGIN_IP
        c.notes.append("sent the IP literal (no private /etc/hosts possible here)")
    argv = [str(exe), "--hostname", LISTEN, "--port", str(c.port), "--num-workers", "1", "--num-acceptors", "1"]
    c.proc = procs.Proc(c.key, (wrapper or []) + argv, root / f"{c.key}.log").start()
