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


class LoopDidNotStop(AssertionError):
    """A test server's tasks or thread did not finish when told to: the
    handler swallows cancellation or blocks its loop (a harness bug)."""


def stop_loop_thread(loop: asyncio.AbstractEventLoop, thread: threading.Thread,
                     servers: Iterable[asyncio.AbstractServer] = (), timeout: float = 10.0) -> None:
    """Close `servers`, cancel every task on `loop` and wait for them to
    finish (their `finally` blocks run now, on the running loop), let the
    transports they closed deliver `connection_lost`, then stop the loop,
    join its thread and close the loop. Raises LoopDidNotStop, after stopping
    the loop anyway, if a task or the thread outlives `timeout`."""

    async def finish() -> list[str]:
        for server in servers:
            server.close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        stuck: set[asyncio.Task[object]] = set()
        if tasks:
            _, stuck = await asyncio.wait(tasks, timeout=timeout)
        # A closed transport's connection_lost is scheduled with call_soon,
        # and an SSL transport's close takes a few more turns: run them here,
        # not from a finaliser after the loop has gone.
        for _ in range(3):
            await asyncio.sleep(0)
        await loop.shutdown_asyncgens()
        return [repr(t) for t in stuck]

    stuck: list[str] = []
    if loop.is_running():
        try:
            stuck = asyncio.run_coroutine_threadsafe(finish(), loop).result(timeout + 5)
        finally:
            loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout)
    if thread.is_alive():
        raise LoopDidNotStop(f"{thread.name}: the loop thread is still running {timeout} s after stop")
    if not loop.is_closed():
        loop.close()
    if stuck:
        raise LoopDidNotStop(f"{thread.name}: tasks ignored cancellation: {stuck}")
