"""Run a coroutine that must finish without suspending.

The in-process quota counters (policy.quotas.MemoryCounters) are async only
so that a shared store can implement the same interface; each step of
theirs is atomic and never yields to the event loop. `settled` proves that
while returning the value, so a pure test needs no event loop."""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any


def settled[T](step: Coroutine[Any, Any, T]) -> T:
    try:
        step.send(None)
    except StopIteration as done:
        return done.value
    step.close()
    raise AssertionError(f"{step!r} suspended: an in-process counter step must never wait")
