"""Stopping a test server's own event loop thread cleanly.

A test origin that runs `asyncio` in a thread of its own must end with no
task left on its loop: a handler coroutine still suspended when the loop is
stopped is finalised later, by the garbage collector, and its `finally`
(closing its writer) then runs on a closed loop ('Event loop is closed'), an
exception nobody can catch that pytest reports as
PytestUnraisableExceptionWarning, an error in this suite (pyproject.toml).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterable


def stop_loop_thread(loop: asyncio.AbstractEventLoop, thread: threading.Thread,
                     servers: Iterable[asyncio.AbstractServer] = (), timeout: float = 10.0) -> None:
    """Close `servers`, cancel every task on `loop` and wait for them to
    finish (their `finally` blocks run now, on the running loop), then stop
    the loop, join its thread and close the loop."""

    async def finish() -> None:
        for server in servers:
            server.close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    if loop.is_running():
        asyncio.run_coroutine_threadsafe(finish(), loop).result(timeout)
        loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout)
    if not thread.is_alive() and not loop.is_closed():
        loop.close()
