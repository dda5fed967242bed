"""`sluice proxy --workers N`: N proxy processes sharing one listening port.

mitmproxy serves from one Python thread, so one process tops out at one
core. Workers are full `sluice proxy` processes whose listeners set
SO_REUSEPORT, so the kernel spreads new client connections across them.
Each keeps its own DNS cache and watches the policy file itself. This
supervisor forwards SIGHUP, prints one ready line when all are listening,
and exits (stopping the rest) if any dies.

SIGTERM/SIGINT drain: the supervisor forwards the signal (each worker stops
accepting and drains, addons/drain.py), /readyz turns 503, and it waits for
them (up to --drain-timeout and a margin); a second signal is forwarded too,
so every worker cuts what is left at once. The workers' stopping and
stopped lines become one of each.

The supervisor serves the one admin endpoint (sluice/admin.py) for all
workers; they bind none. Its approval verbs answer from where the workers
keep approvals (WorkersApprovals): the policy's state store, else the SQLite
file they share. Each worker writes its metrics to a private
directory (PROMETHEUS_MULTIPROC_DIR, prometheus_client's multiprocess mode)
and its readiness and policy facts as a JSON file there; /metrics sums the
workers' values, /readyz is ready when every worker is and none is
draining, /policy lists each worker's policy.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time

from sluice.cli import EXIT_USAGE

REUSE_PORT_ENV = "SLUICE_REUSE_PORT"


def enable_reuse_port() -> None:
    """In a worker: make mitmproxy's listeners share their port.

    mitmproxy binds with `asyncio.start_server` and exposes no reuse_port
    option, so this process's `start_server` gets that default instead."""
    original = asyncio.start_server

    async def start_server(*args, **kwargs):
        kwargs.setdefault("reuse_port", True)
        return await original(*args, **kwargs)

    asyncio.start_server = start_server


class WorkersEndpoints:
    """The admin endpoints of `--workers N`, aggregated over the workers."""

    approvals = None  # the /approvals endpoints (sluice/admin.py ApprovalDesk) over the shared state

    def __init__(self, directory: str, children: list[subprocess.Popen], state: dict) -> None:
        from sluice.addons.metrics import workers_registry

        self.directory, self.children, self.state = directory, children, state
        self.registry = workers_registry(directory, self.live_pids)

    def live_pids(self) -> list[int]:
        return [c.pid for c in self.children if c.poll() is None]

    def statuses(self) -> list[dict]:
        out = []
        for pid in self.live_pids():
            try:
                with open(os.path.join(self.directory, f"status-{pid}.json"), encoding="utf-8") as f:
                    out.append(json.load(f))
            except (OSError, ValueError):
                out.append({"pid": pid, "ready": False, "draining": False, "policy": None})
        return out

    def readyz(self):
        from sluice.admin import readyz

        statuses = self.statuses()
        draining = self.state["stopping"] or any(s["draining"] for s in statuses)
        ready = (self.state["announced"] and len(statuses) == len(self.children) and all(s["ready"] for s in statuses))
        return readyz(ready, draining)

    def metrics(self):
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return 200, CONTENT_TYPE_LATEST, generate_latest(self.registry)

    def policy(self):
        from sluice.admin import json_response

        workers = [{"pid": s["pid"], **(s["policy"] or {})} for s in self.statuses()]
        hashes = {w.get("sha256") for w in workers}
        first = dict(workers[0]) if workers else {}
        first.pop("pid", None)
        if len(hashes) != 1:
            first["sha256"] = None  # the workers disagree (a reload under way): see each
        return json_response({**first, "consistent": len(hashes) == 1, "workers": workers})


def _admin_clash(admin: tuple[str, int], listen: tuple[str, int], modes: list[str]) -> bool:
    from sluice.admin import same_listener

    addresses = [listen]
    for spec in modes:  # NAME@PORT or NAME@HOST:PORT
        _, at, where = spec.partition("@")
        if at:
            host, _, port = where.rpartition(":")
            if port.isdigit():
                addresses.append((host.strip("[]") or listen[0], int(port)))
    return any(same_listener(admin, a) for a in addresses)


_CUT = re.compile(r"\((\d+) cut by shutdown\)")


class WorkersApprovals:
    """Where the supervisor's approval verbs answer: the same place as the
    workers', chosen by sluice.approvals_store.open_approvals from the
    policy's `state` (read here too, and again when the file changes or on
    SIGHUP, as the workers reload it). A policy that does not load keeps
    the current place (the workers keep their last good policy too)."""

    def __init__(self, policy: str | None, state_dir: str, announce_new: bool) -> None:
        from sluice.approvals_store import open_approvals

        self.policy, self.state_dir = policy, state_dir
        self._seen = self._signature()
        self.state = self._state(None)
        self.store = open_approvals(self.state, state_dir, announce_new=announce_new)

    def _signature(self) -> tuple | None:
        try:
            st = os.stat(self.policy) if self.policy else None
        except OSError:
            return None
        return None if st is None else (st.st_ino, st.st_size, st.st_mtime_ns)

    def _state(self, current):
        from sluice.policy.loader import PolicyInvalid, read_policy_file

        if not self.policy:
            return current
        try:
            return read_policy_file(self.policy)[0].state
        except (PolicyInvalid, OSError, ValueError):
            return current

    def check(self, force: bool = False) -> None:
        """Follow the policy's `state` if the file changed (or `force`: SIGHUP)."""
        from sluice.approvals_store import open_approvals, same_place

        seen = self._signature()
        if not force and seen == self._seen:
            return
        self._seen = seen
        state = self._state(self.state)
        if same_place(state, self.state):
            return
        try:
            store = open_approvals(state, self.state_dir)
        except (OSError, sqlite3.Error) as e:
            print(f"sluice: approvals: cannot keep them in {self.state_dir} ({e}); the admin endpoint answers from "
                  f"{self.store.where}", file=sys.stderr, flush=True)
            return
        old, self.store, self.state = self.store, store, state
        old.close()


def supervise(count: int, worker_args: list[str], admin: str = "off", drain_timeout: float = 30.0,
              listen: tuple[str, int] = ("127.0.0.1", 0), modes: list[str] = (), state_dir: str | None = None,
              admin_token_file: str | None = None, policy: str | None = None) -> int:
    from sluice.admin import WORKER_DIR_ENV, AdminServer, AdminTokens, ApprovalDesk, admin_problem, parse_admin
    from sluice.own_host import ADMIN_ENV

    try:
        admin_address = parse_admin(admin)
        if not 0 <= drain_timeout <= 86400:
            raise ValueError("--drain-timeout takes a number of seconds from 0 to 86400")
        if state_dir is not None and not os.path.isdir(state_dir):
            raise ValueError(f"--state-dir {state_dir}: not a directory (create it first; approvals are kept there)")
        tokens = AdminTokens.load(admin_token_file)
    except ValueError as e:
        print(f"sluice: {e}", file=sys.stderr)
        return 2
    if admin_address is not None and _admin_clash(admin_address, listen, list(modes)):
        print(f"sluice: --admin {admin_address[0]}:{admin_address[1]} is a proxy listening address; the admin "
              "endpoint needs its own port: choose another with --admin HOST:PORT, or --admin off", file=sys.stderr)
        return 2
    directory = tempfile.mkdtemp(prefix="sluice-workers-")
    # Without a state store, approvals live in one SQLite file the workers
    # share and this process's admin endpoint answers from: --state-dir's,
    # else one in the private directory, gone at exit (the workers' ready
    # line names it). With one, they live there and no file is made.
    if state_dir is None:
        worker_args = ["--state-dir", directory, *worker_args]
    try:
        # A private file is new by design: no "starting with no approvals" line for it.
        approvals = WorkersApprovals(policy, state_dir or directory, announce_new=state_dir is not None)
    except (OSError, sqlite3.Error) as e:
        shutil.rmtree(directory, ignore_errors=True)
        print(f"sluice: --state-dir {state_dir}: cannot keep the approvals state there ({e}); give a directory "
              "this user may write", file=sys.stderr)
        return 2
    children: list[subprocess.Popen] = []
    state = {"announced": False, "stopping": False}
    server = None
    if admin_address is not None:
        try:
            endpoints = WorkersEndpoints(directory, children, state)
            endpoints.approvals = ApprovalDesk(lambda: approvals.store, tokens)
            server = AdminServer(*admin_address, endpoints)
        except OSError as e:
            shutil.rmtree(directory, ignore_errors=True)
            print(f"sluice: {admin_problem(*admin_address, e)}", file=sys.stderr)
            return 2
    try:
        return _supervise(count, worker_args, drain_timeout, directory, children, state, server, approvals.check,
                          {**os.environ, REUSE_PORT_ENV: "1", WORKER_DIR_ENV: directory,
                           "PROMETHEUS_MULTIPROC_DIR": directory,
                           # Its workers refuse dials to it (sluice/own_host.py).
                           **({ADMIN_ENV: f"{admin_address[0]}:{admin_address[1]}"} if admin_address else {})})
    finally:
        if server is not None:
            server.close()
        shutil.rmtree(directory, ignore_errors=True)


def _supervise(count: int, worker_args: list[str], drain_timeout: float, directory: str,
               children: list[subprocess.Popen], state: dict, server, follow_policy, env: dict) -> int:
    """`follow_policy(force)` is called every second (force: on SIGHUP)."""
    command = [sys.executable, "-m", "sluice.cli", "proxy", *worker_args]
    children += [subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True, bufsize=1) for _ in range(count)]
    if server is not None:
        server.start()
    ready = threading.Semaphore(0)
    first_ready: list[str] = []
    cut: list[int] = []
    # Before the proxy is ready every worker reports the same start-up problem
    # (a bad policy, a port in use): say each line once, not once per worker.
    said_at_start: set[str] = set()
    said_lock = threading.Lock()

    def relay(child: subprocess.Popen) -> None:
        for line in child.stderr:
            if not state["announced"] and not line.startswith("sluice: ready"):
                with said_lock:
                    if line in said_at_start:
                        continue
                    said_at_start.add(line)
            if line.startswith("sluice: ready") and not getattr(child, "_ready", False):
                child._ready = True  # type: ignore[attr-defined]
                first_ready.append(line.strip())
                ready.release()
            elif line.startswith("sluice: stopping:"):
                pass  # the supervisor says it once
            elif line.startswith("sluice: stopped after "):
                m = _CUT.search(line)
                cut.append(int(m.group(1)) if m else 0)
            else:
                sys.stderr.write(line)
                sys.stderr.flush()

    relays = [threading.Thread(target=relay, args=(child,), daemon=True) for child in children]
    for thread in relays:
        thread.start()

    stopping = threading.Event()
    signals = [0]
    started_stopping = [0.0]

    def forward_stop() -> None:
        for child in children:
            if child.poll() is None:
                child.terminate()

    def stop(*_):
        signals[0] += 1
        if not stopping.is_set():
            stopping.set()
            state["stopping"] = True
            started_stopping[0] = time.monotonic()
            print(f"sluice: stopping: no new connections; waiting up to {drain_timeout:g}s for exchanges and "
                  f"tunnels in flight [{len(children)} workers] (signal again to stop at once)", file=sys.stderr,
                  flush=True)
        forward_stop()  # a second signal reaches the workers too: they cut what is left at once

    hupped = threading.Event()

    def hup(*_):
        hupped.set()
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGHUP)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGHUP, hup)

    failed = False
    followed = time.monotonic()
    try:
        while True:
            if hupped.is_set() or time.monotonic() - followed >= 1.0:
                follow_policy(hupped.is_set())
                hupped.clear()
                followed = time.monotonic()
            if not state["announced"] and all(getattr(c, "_ready", False) for c in children):
                where = first_ready[0].removeprefix("sluice: ready on ")
                print(f"sluice: ready on {where} [{count} workers]", file=sys.stderr, flush=True)
                state["announced"] = True
            dead = [c for c in children if c.poll() is not None]
            if len(dead) == len(children):
                break
            if dead and not stopping.is_set():
                print(f"sluice: worker {dead[0].pid} exited with {dead[0].returncode}; stopping the others",
                      file=sys.stderr, flush=True)
                failed = True
                stopping.set()
                state["stopping"] = True
                started_stopping[0] = time.monotonic()
                forward_stop()
            if stopping.is_set() and time.monotonic() > started_stopping[0] + drain_timeout + 15:
                break  # workers that outlive their own drain by far are killed below
            time.sleep(0.05)
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
            child.wait()
        for thread in relays:
            thread.join(timeout=2)
    if stopping.is_set() and not failed and cut:
        elapsed = time.monotonic() - started_stopping[0]
        print(f"sluice: stopped after {elapsed:.1f}s ({sum(cut)} cut by shutdown) [{count} workers]", file=sys.stderr,
              flush=True)
    codes = [c.returncode for c in children]
    if not state["announced"] and not signals[0] and EXIT_USAGE in codes:
        return EXIT_USAGE  # a usage problem at start (bad policy, bad flag) exits as it does without --workers
    return 0 if stopping.is_set() and not failed and all(code in (0, -signal.SIGTERM) for code in codes) else 1
