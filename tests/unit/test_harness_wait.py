"""The shared polling helper (tests/harness/wait.py)."""

import pytest

from harness.wait import wait_until


def test_returns_the_first_true_result():
    calls = iter([0, "", "found", "later"])
    assert wait_until(lambda: next(calls), timeout=5, interval=0) == "found"


def test_gives_the_last_falsy_result_at_the_deadline():
    calls = []
    assert wait_until(lambda: calls.append(1), timeout=0.05, interval=0.01) is None
    assert len(calls) >= 2  # polled, then once more at the deadline


def test_with_what_it_fails_saying_what_never_happened():
    with pytest.raises(AssertionError, match="not within 0.02s: the gauge back to 0"):
        wait_until(lambda: False, timeout=0.02, interval=0.005, what="the gauge back to 0")
