"""Run `sluice proxy` as a subprocess for a test module.

    proc = SluiceProcess(workdir, policy=default_policy(), socks=True).start()
    proc.proxy_url        # "http://127.0.0.1:PORT"
    proc.socks_url        # "socks5h://127.0.0.1:PORT2" (if socks=True)
    mark = proc.audit_mark()
    ...
    proc.wait_audit(lambda e: e["host"] == "x", since=mark)
    proc.stop()           # SIGTERM, then SIGKILL after 10 s

The proxy listens on 127.0.0.1 on a free port; `start()` waits (bounded) for
the one `sluice: ready` line on stderr and fails with the stderr if it does
not come or the process exits.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import yaml

from .clients import clean_env

READY_PREFIX = "sluice: ready"
DNS_SERVER = "127.0.0.53:53"

# Every live SluiceProcess, so a failing test's report can show their stderr.
LIVE: list[SluiceProcess] = []


def default_policy(**overrides) -> dict:
    policy = {
        "version": 1,
        "ports": [80, 443],
        "dns": {"nameservers": [DNS_SERVER], "timeout": "2s"},
        "private_networks": [],
    }
    policy.update(overrides)
    return policy


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def sluice_executable() -> str:
    """The `sluice` console script of this venv (or $SLUICE_BIN, to test another build)."""
    override = os.environ.get("SLUICE_BIN")
    if override:
        return override
    candidate = Path(sys.executable).parent / "sluice"
    if candidate.exists():
        return str(candidate)
    repo_venv = Path(__file__).resolve().parents[2] / ".venv" / "bin" / "sluice"
    if repo_venv.exists():
        return str(repo_venv)
    found = shutil.which("sluice")
    if found:
        return found
    raise RuntimeError(
        "the `sluice` console script is not installed: run `.venv/bin/pip install -e '.[test]'`"
    )


class SluiceProcess:
    def __init__(
        self,
        workdir: Path,
        policy: dict | str | None = None,
        *,
        socks: bool = False,
        name: str = "sluice",
        extra_args: tuple[str, ...] = (),
        home: Path | None = None,
        ready_timeout: float = 20.0,
    ):
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.name = name
        self.policy = default_policy() if policy is None else policy
        self.policy_file = self.workdir / f"{name}-policy.yaml"
        self.audit_file = self.workdir / f"{name}-audit.jsonl"
        self.stdout_file = self.workdir / f"{name}-stdout.log"
        self.socks = socks
        self.extra_args = tuple(extra_args)
        self.home = home
        self.ready_timeout = ready_timeout
        self.host = "127.0.0.1"
        self.port = 0
        self.socks_port = 0
        self.admin_port = 0
        self.ready_line: str | None = None
        self.proc: subprocess.Popen | None = None
        self._stderr_lines: list[str] = []
        self._stderr_lock = threading.Lock()
        self._ready = threading.Event()
        self._reader: threading.Thread | None = None
        self._stdout_fh = None

    # ------------------------------------------------------------ addresses
    @property
    def address(self) -> tuple[str, int]:
        return (self.host, self.port)

    @property
    def proxy_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def socks_address(self) -> tuple[str, int]:
        assert self.socks, "this proxy was started without a SOCKS5 listener"
        return (self.host, self.socks_port)

    @property
    def socks_url(self) -> str:
        assert self.socks, "this proxy was started without a SOCKS5 listener"
        return f"socks5h://{self.host}:{self.socks_port}"

    # ------------------------------------------------------------ lifecycle
    def command(self) -> list[str]:
        cmd = [
            sluice_executable(),
            "proxy",
            "--policy",
            str(self.policy_file),
            "--listen",
            f"{self.host}:{self.port}",
            "--audit-log",
            str(self.audit_file),
        ]
        if self.socks:
            cmd += ["--mode", "regular", "--mode", f"socks5@{self.socks_port}"]
        if not any(a == "--admin" or a.startswith("--admin=") for a in self.extra_args):
            # Its own admin port (the default, 127.0.0.1:9090, is one per machine).
            cmd += ["--admin", f"{self.host}:{self.admin_port}"]
        if not any(a == "--drain-timeout" or a.startswith("--drain-timeout=") for a in self.extra_args):
            # stop() sends SIGTERM: a tunnel a test left open must not hold
            # the module's end for the default 30 s drain.
            cmd += ["--drain-timeout", "2"]
        cmd += list(self.extra_args)
        return cmd

    @property
    def admin_url(self) -> str:
        return f"http://{self.host}:{self.admin_port}"

    def start(self) -> SluiceProcess:
        if isinstance(self.policy, str):
            self.policy_file.write_text(self.policy)
        else:
            self.policy_file.write_text(yaml.safe_dump(self.policy, sort_keys=False))
        self.port = free_port(self.host)
        if self.socks:
            while (p := free_port(self.host)) == self.port:
                pass
            self.socks_port = p
        while (p := free_port(self.host)) in (self.port, self.socks_port):
            pass
        self.admin_port = p
        env = clean_env()
        if self.home is not None:
            env["HOME"] = str(self.home)  # mitmproxy's confdir (~/.mitmproxy) lands here
        env["PYTHONUNBUFFERED"] = "1"
        self._stdout_fh = open(self.stdout_file, "wb")
        self.proc = subprocess.Popen(
            self.command(),
            stdin=subprocess.DEVNULL,
            stdout=self._stdout_fh,
            stderr=subprocess.PIPE,
            env=env,
            cwd=self.workdir,
        )
        LIVE.append(self)
        self._reader = threading.Thread(target=self._read_stderr, name=f"{self.name}-stderr", daemon=True)
        self._reader.start()
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if self._ready.wait(0.1):
                return self
            if self.proc.poll() is not None:
                self._reader.join(timeout=2)
                break
        rc = self.proc.poll()
        self.stop()
        why = f"exited with {rc}" if rc is not None else f"did not print {READY_PREFIX!r} within {self.ready_timeout}s"
        raise RuntimeError(
            f"{self.name} {why}.\ncommand: {' '.join(self.command())}\n"
            f"policy:\n{self.policy_file.read_text()}\nstderr:\n{self.stderr_text()}"
        )

    def _read_stderr(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        for raw in self.proc.stderr:
            line = raw.decode("utf-8", "replace").rstrip("\n")
            with self._stderr_lock:
                self._stderr_lines.append(line)
            if line.startswith(READY_PREFIX) and not self._ready.is_set():
                self.ready_line = line
                self._ready.set()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = 10) -> int | None:
        if self in LIVE:
            LIVE.remove(self)
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        if self._reader is not None:
            self._reader.join(timeout=2)
        if self._stdout_fh is not None:
            self._stdout_fh.close()
            self._stdout_fh = None
        return self.proc.returncode

    # ------------------------------------------------------------ output
    def stderr_text(self, tail: int | None = None) -> str:
        with self._stderr_lock:
            lines = list(self._stderr_lines)
        if tail is not None:
            lines = lines[-tail:]
        return "\n".join(lines)

    def stderr_mark(self) -> int:
        with self._stderr_lock:
            return len(self._stderr_lines)

    def stderr_since(self, mark: int) -> str:
        with self._stderr_lock:
            return "\n".join(self._stderr_lines[mark:])

    def audit(self) -> list[dict]:
        """Every complete JSON line of the audit log so far."""
        if not self.audit_file.exists():
            return []
        entries = []
        for line in self.audit_file.read_text(encoding="utf-8", errors="replace").splitlines():
            line = line.strip()
            if not line:
                continue
            try:
                entries.append(json.loads(line))
            except json.JSONDecodeError:
                # A line still being written: stop at it.
                break
        return entries

    def audit_mark(self) -> int:
        return len(self.audit())

    def wait_audit(
        self,
        predicate: Callable[[dict], bool],
        since: int = 0,
        timeout: float = 5.0,
        what: str = "a matching audit entry",
    ) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            entries = self.audit()[since:]
            for e in entries:
                try:
                    if predicate(e):
                        return e
                except (KeyError, TypeError):
                    continue
            if time.monotonic() > deadline:
                shown = "\n".join(json.dumps(e) for e in entries[-20:])
                raise AssertionError(f"no {what} in the audit log within {timeout}s; entries since mark:\n{shown}")
            time.sleep(0.05)

    def __repr__(self) -> str:
        return f"<SluiceProcess {self.name} {self.proxy_url} pid={self.proc.pid if self.proc else None}>"


def ready_line_of(command: list[str], *, env: dict[str, str], cwd: Path | str, timeout: float = 60) -> str:
    """Start a `sluice proxy` command line as it is (no harness options), wait
    for its ready line, stop it, and return that line; fail with its stderr
    if it never comes."""
    proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env=env, cwd=cwd)
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        for line in proc.stderr:
            lines.append(line)
            if line.startswith(READY_PREFIX):
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        assert ready.wait(timeout), "".join(lines)
    finally:
        proc.terminate()
        proc.wait(30)
    return next(line for line in lines if line.startswith(READY_PREFIX))
