"""The one polling helper the tests share: wait for something another process
or thread does (a log line, a metric, a closed socket). Checks that only need
time to pass use the injectable clocks instead (quotas' Counters take `now`,
identity's throttle takes `clock`)."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until[T](predicate: Callable[[], T], timeout: float = 8.0, interval: float = 0.05,
                  what: str | None = None) -> T:
    """Call `predicate` until it returns something true, and return that; at
    `timeout` seconds, call it once more and return what it gives (falsy), or,
    with `what`, fail the test saying what never happened."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = predicate()
        if result:
            return result
        time.sleep(interval)
    result = predicate()
    if not result and what is not None:
        raise AssertionError(f"not within {timeout}s: {what}")
    return result
