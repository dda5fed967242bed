"""`sluice proxy --workers N`: N proxy processes sharing one listening port.

mitmproxy serves from one Python thread, so one process tops out at one
core. Workers are full `sluice proxy` processes whose listeners set
SO_REUSEPORT, so the kernel spreads new client connections across them.
Each keeps its own DNS cache and watches the policy file itself. This
supervisor forwards SIGHUP, stops them all on SIGTERM/SIGINT, prints one
ready line when all are listening, and exits (stopping the rest) if any dies.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time

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


def supervise(count: int, worker_args: list[str]) -> int:
    env = {**os.environ, REUSE_PORT_ENV: "1"}
    command = [sys.executable, "-m", "sluice.cli", "proxy", *worker_args]
    children = [subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True, bufsize=1) for _ in range(count)]
    ready = threading.Semaphore(0)
    first_ready: list[str] = []

    def relay(child: subprocess.Popen) -> None:
        for line in child.stderr:
            if line.startswith("sluice: ready") and not getattr(child, "_ready", False):
                child._ready = True  # type: ignore[attr-defined]
                first_ready.append(line.strip())
                ready.release()
            else:
                sys.stderr.write(line)
                sys.stderr.flush()

    for child in children:
        threading.Thread(target=relay, args=(child,), daemon=True).start()

    stopping = threading.Event()

    def stop(*_):
        stopping.set()
        for child in children:
            if child.poll() is None:
                child.terminate()

    def hup(*_):
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGHUP)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGHUP, hup)

    announced = False
    try:
        while True:
            if not announced and all(getattr(c, "_ready", False) for c in children):
                where = first_ready[0].removeprefix("sluice: ready on ")
                print(f"sluice: ready on {where} [{count} workers]", file=sys.stderr, flush=True)
                announced = True
            dead = [c for c in children if c.poll() is not None]
            if dead:
                if not stopping.is_set():
                    print(f"sluice: worker {dead[0].pid} exited with {dead[0].returncode}; stopping the others",
                          file=sys.stderr, flush=True)
                stop()
                break
            time.sleep(0.1)
    finally:
        deadline = time.monotonic() + 10
        for child in children:
            try:
                child.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
    codes = [c.returncode for c in children]
    return 0 if stopping.is_set() and all(code in (0, -signal.SIGTERM) for code in codes) else 1
