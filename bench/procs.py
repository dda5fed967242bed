"""Child processes the benchmark starts, and nothing else.

Every process is started in its own session (so its process group id is its
pid) and registered here; `stop_all()` ends each registered group by its id,
TERM first and KILL after a bounded wait. The runner calls it in a `finally`.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

_STARTED: list[Proc] = []


class StartError(Exception):
    """A process did not come up; str() says why (with the tail of its log)."""


@dataclass
class Proc:
    name: str
    argv: list[str]
    log: Path
    env: dict[str, str] | None = None
    popen: subprocess.Popen | None = field(default=None, repr=False)

    def start(self) -> Proc:
        out = open(self.log, "ab")
        try:
            self.popen = subprocess.Popen(
                self.argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                env=self.env, start_new_session=True,
            )
        finally:
            out.close()
        _STARTED.append(self)
        return self

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def log_tail(self, lines: int = 8) -> str:
        try:
            text = self.log.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return " | ".join(text[-lines:])

    def wait_port(self, host: str, port: int, timeout: float = 20.0) -> None:
        """Until something accepts on host:port, this process died, or timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise StartError(f"{self.name} exited with {self.popen.returncode}: {self.log_tail()}")
            try:
                with socket.create_connection((host, port), timeout=0.5):
                    return
            except OSError:
                time.sleep(0.05)
        raise StartError(f"{self.name} did not listen on {host}:{port} within {timeout:g}s: {self.log_tail()}")

    def stop(self, grace: float = 5.0) -> None:
        if self.popen is None or self.popen.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.popen.pid, sig)  # our own session: pgid == pid
            except ProcessLookupError:
                return
            try:
                self.popen.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue

    def rss_kib(self) -> int | None:
        """VmRSS of the process and its descendants (nginx workers, forks)."""
        if not self.alive():
            return None
        return tree_rss_kib(self.pid)

    def cpu_seconds(self) -> float | None:
        """User + system CPU time of the process (all its threads) so far."""
        if not self.alive():
            return None
        try:
            with open(f"/proc/{self.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            return None
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def tree_cpu_seconds(self) -> float | None:
        """User + system CPU time so far of the process and its live
        descendants (e.g. the workers of `sluice proxy --workers N`)."""
        if not self.alive():
            return None
        return sum(tree_cpu_by_pid(self.pid).values())

    def wait_log(self, text: str, timeout: float = 30.0) -> None:
        """Until `text` appears in this process's log, it died, or timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise StartError(f"{self.name} exited with {self.popen.returncode}: {self.log_tail()}")
            try:
                if text in self.log.read_text(errors="replace"):
                    return
            except OSError:
                pass
            time.sleep(0.05)
        raise StartError(f"{self.name} did not log {text!r} within {timeout:g}s: {self.log_tail()}")


def pin(pid: int, cpus: set[int]) -> None:
    """Move every thread of a process (threads it starts later inherit) to cpus."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        tids = [pid]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except OSError:
            pass


def pin_tree(root: int, cpus: set[int]) -> None:
    """pin() for a process and every live descendant (processes they start
    later inherit it)."""
    for pid in _tree(root):
        pin(pid, cpus)


def cpu_layout() -> tuple[set[int], set[int]] | None:
    """(load side, proxy side): the proxy under test gets a core to itself and
    the load generator, origin and benchmark share the other, which steadies
    the numbers on a 2-core machine. None with fewer than 2 CPUs."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None
    return ({cpus[0]}, {cpus[-1]}) if len(cpus) >= 2 else None


def _tree(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        if pid not in out:
            out.append(pid)
            todo.extend(children.get(pid, []))
    return out


def _cpu_of(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def tree_cpu_by_pid(root: int) -> dict[int, float]:
    """{pid: user + system CPU seconds so far} for root and its live descendants."""
    return {pid: _cpu_of(pid) for pid in _tree(root)}


def own_cpu_seconds() -> float:
    """CPU used so far by this process, its reaped children (wrk, curl) and
    every live process it started with their descendants (proxies, nginx)."""
    t = os.times()
    total = t.user + t.system + t.children_user + t.children_system
    for p in _STARTED:
        if p.alive():
            total += sum(_cpu_of(pid) for pid in _tree(p.pid))
    return total


def machine_busy_seconds() -> tuple[float, float]:
    """(busy, stolen): CPU time the whole machine has spent busy (all
    processes, all CPUs), and time the hypervisor gave to someone else."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq = fields[:7]
    steal = fields[7] if len(fields) > 7 else 0
    tick = os.sysconf("SC_CLK_TCK")
    return (user + nice + system + irq + softirq) / tick, steal / tick


class ForeignLoad:
    """How much CPU other processes (not this benchmark's) used over a span."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.busy0, self.steal0 = machine_busy_seconds()
        self.own0 = own_cpu_seconds()

    def cores(self) -> tuple[float, float]:
        """(other processes' CPU, stolen CPU) in cores, averaged over the span."""
        wall = time.monotonic() - self.t0
        busy, steal = machine_busy_seconds()
        foreign = (busy - self.busy0) - (own_cpu_seconds() - self.own0)
        if wall <= 0:
            return 0.0, 0.0
        return max(0.0, foreign / wall), max(0.0, (steal - self.steal0) / wall)


def stop_all() -> None:
    while _STARTED:
        _STARTED.pop().stop()


def _status_field(pid: int, key: str) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def tree_rss_kib(root: int) -> int | None:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    total, seen, todo = 0, set(), [root]
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        rss = _status_field(pid, "VmRSS")
        if rss is None and pid == root:
            return None
        total += rss or 0
        todo.extend(children.get(pid, []))
    return total


def root_first(root: int, pids) -> list[int]:
    """pids in a stable order: root first, then by pid."""
    return sorted(pids, key=lambda pid: (pid != root, pid))


def tree_rss_by_pid(root: int) -> dict[int, int | None]:
    """{pid: VmRSS KiB} for root and its live descendants."""
    return {pid: _status_field(pid, "VmRSS") for pid in _tree(root)}


def run(argv: list[str], timeout: float, **kw) -> subprocess.CompletedProcess:
    """subprocess.run in its own session, killed as a group on timeout."""
    with subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          start_new_session=True, text=True, **kw) as p:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            out, err = p.communicate(timeout=5)
            raise subprocess.TimeoutExpired(argv, timeout, out, err) from None
        except BaseException:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            raise
        return subprocess.CompletedProcess(argv, p.returncode, out, err)
