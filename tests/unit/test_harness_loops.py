"""tests/harness/loops.py: a test server's loop thread stops with its
handlers finished on the running loop (their `finally` blocks run there,
not later from a finaliser on a closed loop, which pytest reports as an
unraisable exception, an error in this suite), the loop closed; a handler
that ignores cancellation is named instead of hanging the teardown."""

from __future__ import annotations

import asyncio
import threading

import pytest

from harness.loops import LoopDidNotStop, stop_loop_thread


def loop_thread() -> tuple[asyncio.AbstractEventLoop, threading.Thread]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="test-loop", daemon=True)
    thread.start()
    return loop, thread


def start(loop: asyncio.AbstractEventLoop, coro_fn) -> None:
    async def spawn():
        loop.create_task(coro_fn())
        await asyncio.sleep(0)  # it runs up to its first wait
    asyncio.run_coroutine_threadsafe(spawn(), loop).result(5)


def test_a_suspended_handler_is_cancelled_and_finishes_on_the_loop_which_is_then_closed():
    loop, thread = loop_thread()
    finished: list[bool] = []

    async def handler():
        try:
            await asyncio.Event().wait()  # a kept-alive connection waiting for its next request
        finally:
            finished.append(loop.is_running())

    start(loop, handler)
    stop_loop_thread(loop, thread)
    assert finished == [True]  # its finally ran while the loop was still running
    assert loop.is_closed() and not thread.is_alive()


def test_a_handler_that_ignores_cancellation_is_named_and_the_loop_still_stops():
    loop, thread = loop_thread()

    async def stubborn():
        while True:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                continue

    start(loop, stubborn)
    with pytest.raises(LoopDidNotStop, match="tasks ignored cancellation: .*stubborn"):
        stop_loop_thread(loop, thread, timeout=0.5)
    assert not thread.is_alive() and loop.is_closed()
