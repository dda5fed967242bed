"""The pure parts of issue 18 items 2-3: the upstream limit's key, the
per-source reserve, the derived max_total_connections, the check a user
profile's max_connections makes at a connection's first request, and the
rate-limited out-of-files line."""

from __future__ import annotations

import errno
import io

import pytest

from sluice.open_files import LINE_EVERY_SECONDS, OutOfFiles, Reporter, is_out_of_files
from sluice.policy import quotas
from sluice.policy.loader import PolicyInvalid, load_policy_text
from sluice.policy.model import Limits
from sluice.policy.quotas import MemoryCounters
from sluice.policy.reasons import Reason
from harness.settle import settled


def test_max_upstreams_per_connection_loads_top_level_and_per_profile():
    policy = load_policy_text(
        "version: 1\n"
        "limits: {max_upstreams_per_connection: 4}\n"
        "clients:\n"
        "  - name: crawler\n"
        "    sources: [10.1.0.0/16]\n"
        "    limits: {max_upstreams_per_connection: 64}\n"
    )
    assert policy.rules.limits.max_upstreams_per_connection == 4
    assert policy.clients[0].rules.limits.max_upstreams_per_connection == 64
    assert load_policy_text("version: 1\n").rules.limits.max_upstreams_per_connection == 16
    with pytest.raises(PolicyInvalid, match="max_upstreams_per_connection"):
        load_policy_text("version: 1\nlimits: {max_upstreams_per_connection: 0}\n")


@pytest.mark.parametrize("total, reserve",
                         [(2, 1), (20, 10), (32, 16), (40, 16), (320, 16), (2000, 100), (10_000, 500)])
def test_the_source_reserve_is_max_16_or_5_percent_at_most_half(total, reserve):
    assert quotas.source_reserve(total) == reserve


def test_one_source_holds_its_share_and_no_more():
    counters = MemoryCounters()
    for _ in range(24):
        assert settled(quotas.admit_source_share(counters, 40, "10.0.0.5")) is None
    why = settled(quotas.admit_source_share(counters, 40, "10.0.0.5"))
    assert why is not None and "24 of the proxy's 40" in why and "16 kept for other sources" in why
    assert settled(quotas.admit_source_share(counters, 40, "10.0.0.6")) is None  # another source
    counters.release(quotas.source_slots_key("10.0.0.5"))
    assert settled(quotas.admit_source_share(counters, 40, "10.0.0.5")) is None


def test_the_derived_total_is_two_fds_a_connection_after_a_reserve():
    assert quotas.default_total_connections(1_048_576) == (1_048_576 - 64) // 2
    assert quotas.default_total_connections(1024) == 480
    assert quotas.default_total_connections(10) == 1


def test_a_user_profiles_max_connections_applies_at_the_first_request():
    counters = MemoryCounters()
    for _ in range(3):  # counted at accept under the top level's (no) limit
        assert settled(quotas.admit_connection(counters, Limits(), "10.0.0.5")) is None
    assert settled(quotas.over_connections(counters, Limits(max_connections=3), "10.0.0.5")) is None
    refusal = settled(quotas.over_connections(counters, Limits(max_connections=2), "10.0.0.5"))
    assert refusal is not None and refusal.reason is Reason.TOO_MANY_CONNECTIONS
    assert "already has 2 connections open" in refusal.detail
    assert settled(quotas.over_connections(counters, Limits(), "10.0.0.5")) is None


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_out_of_files_line_is_rate_limited_and_counts_what_it_skipped():
    clock, out = Clock(), io.StringIO()
    reporter = Reporter(clock=clock, out=out)
    error = OSError(errno.EMFILE, "Too many open files")
    for _ in range(50):
        reporter.report("accepting connections", error)
    clock.now += LINE_EVERY_SECONDS
    reporter.report("dialling an origin", error)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith("sluice: out of file descriptors (EMFILE: Too many open files) while accepting")
    assert "(49 more since the last line)" in lines[1] and "Raise the open-files limit" in lines[1]


def test_the_loop_handler_passes_everything_else_on():
    seen = []
    handler = OutOfFiles(lambda loop, context: seen.append(context))
    handler(None, {"message": "boom", "exception": ValueError("x")})
    handler(None, {"message": "no exception"})
    assert len(seen) == 2
    assert is_out_of_files(OSError(errno.ENFILE, "x")) and not is_out_of_files(OSError(errno.ECONNRESET, "x"))
