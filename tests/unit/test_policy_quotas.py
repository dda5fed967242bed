"""sluice.policy.quotas: token buckets, windows and concurrent counts with an
injected clock (nothing here waits or measures time), the refusals they
give, bounded memory, and the quota keys in the loader."""

from __future__ import annotations

import math

import pytest

from sluice.policy import quotas
from sluice.policy.loader import PolicyInvalid, load_policy_text
from sluice.policy.model import Limits
from sluice.policy.quotas import MemoryCounters, check_request, client_key
from sluice.policy.reasons import Reason
from harness.settle import settled

ALICE = client_key("agents", "alice", "10.0.0.5")
BOB = client_key("agents", "bob", "10.0.0.5")


def test_a_client_is_its_user_once_known_else_its_address():
    assert client_key("agents", "alice", "10.0.0.5") != client_key("agents", "bob", "10.0.0.5")
    assert client_key("agents", None, "10.0.0.5") == client_key("other", None, "10.0.0.5")
    assert client_key(None, None, "10.0.0.5") != client_key(None, None, "10.0.0.6")


def test_bucket_allows_the_burst_then_refuses_with_the_honest_wait():
    c = MemoryCounters()
    for _ in range(3):
        assert settled(c.take("k", 2.0, 3, now=100.0)) == 0.0
    wait = settled(c.take("k", 2.0, 3, now=100.0))
    assert wait == pytest.approx(0.5)
    assert settled(c.take("k", 2.0, 3, now=100.0 + wait - 0.01)) > 0  # not yet
    assert settled(c.take("k", 2.0, 3, now=100.0 + wait)) == 0.0  # exactly the wait it gave
    assert settled(c.take("k", 2.0, 3, now=100.0 + wait)) > 0


def test_bucket_refills_to_its_size_and_no_further():
    c = MemoryCounters()
    settled(c.take("k", 1.0, 2, now=0.0))
    settled(c.take("k", 1.0, 2, now=0.0))
    # an hour idle refills two tokens, not 3,600
    assert [settled(c.take("k", 1.0, 2, now=3600.0)) for _ in range(3)][:2] == [0.0, 0.0]
    assert settled(c.take("k", 1.0, 2, now=3600.0)) > 0


def test_a_refused_take_takes_nothing():
    c = MemoryCounters()
    assert settled(c.take("k", 1.0, 1, now=0.0)) == 0.0
    for _ in range(50):
        assert settled(c.take("k", 1.0, 1, now=0.5)) == pytest.approx(0.5)
    assert settled(c.take("k", 1.0, 1, now=1.0)) == 0.0


def test_window_counts_until_it_resets():
    c = MemoryCounters()
    assert c.spend("b", 600, 1000, 3600.0, now=10.0) == 600
    assert c.spend("b", 600, 1000, 3600.0, now=20.0) == 400  # only what fits
    assert c.spend("b", 1, 1000, 3600.0, now=30.0) == 0
    assert settled(c.window("b", 3600.0, now=30.0)) == (1000, pytest.approx(3580.0))
    assert c.spend("b", 5, None, 3600.0, now=40.0) == 5  # no limit: counted anyway
    assert settled(c.window("b", 3600.0, now=3610.0)) == (0, 3600.0)  # the hour from the first byte ended
    assert c.spend("b", 7, 1000, 3600.0, now=3610.0) == 7


def test_concurrent_counts():
    c = MemoryCounters()
    assert settled(c.acquire("t", 2)) and settled(c.acquire("t", 2))
    assert not settled(c.acquire("t", 2))
    assert settled(c.count("t")) == 2
    c.release("t")
    assert settled(c.acquire("t", 2))
    assert settled(c.acquire("u", None)) and settled(c.count("u")) == 1
    for _ in range(3):
        c.release("t")
    c.release("u")
    assert len(c) == 0  # a count back at zero is forgotten


def test_idle_keys_expire_and_memory_is_bounded():
    c = MemoryCounters(max_keys=50)
    for i in range(1000):
        settled(c.take(("rate", i), 1.0, 5, now=float(i) / 1000))
        c.spend(("bytes", i), 10, 100, 60.0, now=float(i) / 1000)
    assert len(c) <= 100
    c.sweep(now=3600.0)  # every bucket refilled, every window ended
    assert len(c) == 0
    # a client that keeps using its bucket keeps it
    settled(c.take("busy", 1.0, 1, now=3600.0))
    c.sweep(now=3600.5)
    assert len(c) == 1


def test_check_request_order_and_messages():
    c = MemoryCounters()
    limits = Limits(requests_per_second=1.0, burst=2, max_requests_per_host_per_minute=3, bytes_per_hour=1000)
    assert settled(check_request(c, limits, ALICE, "a.example", 0.0)) is None
    assert settled(check_request(c, limits, ALICE, "a.example", 0.0)) is None
    refusal = settled(check_request(c, limits, ALICE, "a.example", 0.0))
    assert refusal.reason is Reason.RATE_LIMITED and refusal.status == 429 and refusal.retry_after == 1
    assert "1 requests a second" in refusal.detail and "Retry after 1 s" in refusal.message
    # another client is not affected
    assert settled(check_request(c, limits, BOB, "a.example", 0.0)) is None
    # the third request to one host in a minute (rate tokens to spare) is over its per-host limit
    assert settled(check_request(c, limits, ALICE, "a.example", 1.0)) is None
    refusal = settled(check_request(c, limits, ALICE, "A.example", 5.0))
    assert refusal.reason is Reason.HOST_RATE_LIMITED and "3 requests a minute to A.example" in refusal.detail
    assert refusal.retry_after == math.ceil((1 - (5.0 / 20.0)) * 20.0)  # a token per 20 s
    assert settled(check_request(c, limits, ALICE, "b.example", 6.0)) is None  # another host
    # the hour's transfer used up: refused first, with when it resets
    c.spend(quotas.bytes_key(ALICE), 1000, None, quotas.HOUR, 10.0)
    refusal = settled(check_request(c, limits, ALICE, "b.example", 10.0 + 37 * 60))
    assert refusal.reason is Reason.QUOTA_EXCEEDED and refusal.retry_after == 23 * 60
    assert refusal.detail == "this agent has used its hourly transfer quota of 1000 bytes; it resets in 23 minutes"
    assert settled(check_request(c, limits, ALICE, "b.example", 10.0 + 3600)) is None


def test_no_limits_counts_nothing():
    c = MemoryCounters()
    for _ in range(100):
        assert settled(check_request(c, Limits(), ALICE, "a.example", 0.0)) is None
    assert len(c) == 0


def test_burst_defaults_to_one_second_of_requests():
    assert Limits(requests_per_second=5).rate_burst == 5
    assert Limits(requests_per_second=0.5).rate_burst == 1
    assert Limits(requests_per_second=2.5).rate_burst == 3
    assert Limits(requests_per_second=5, burst=20).rate_burst == 20


def test_connection_and_tunnel_admission():
    c = MemoryCounters()
    limits = Limits(max_connections=2, max_tunnels=1)
    assert settled(quotas.admit_connection(c, limits, "10.0.0.5")) is None
    assert settled(quotas.admit_connection(c, limits, "10.0.0.5")) is None
    refusal = settled(quotas.admit_connection(c, limits, "10.0.0.5"))
    assert refusal.reason is Reason.TOO_MANY_CONNECTIONS and refusal.retry_after is None
    assert "10.0.0.5 already has 2 connections" in refusal.message and "Reuse an open connection" in refusal.message
    assert settled(quotas.admit_connection(c, limits, "10.0.0.6")) is None  # per source address
    assert settled(quotas.admit_tunnel(c, limits, ALICE)) is None
    assert settled(quotas.admit_tunnel(c, limits, ALICE)).reason is Reason.TOO_MANY_TUNNELS
    assert settled(quotas.admit_tunnel(c, limits, BOB)) is None
    assert settled(quotas.admit_total(c, 1)) is None
    assert "max_total_connections" in settled(quotas.admit_total(c, 1))


def test_transfer_meter_grants_what_is_left():
    c = MemoryCounters()
    meter = quotas.TransferMeter(c, ALICE, 100)
    assert meter(60, 0.0) == 60
    assert meter(60, 1.0) == 40
    assert meter(1, 2.0) == 0
    _, resets_in = settled(c.window(quotas.bytes_key(ALICE), quotas.HOUR, 2.0))
    cut = quotas.transfer_refusal(Limits(bytes_per_hour=100), resets_in, cut=True)
    assert cut.reason is Reason.QUOTA_EXCEEDED and "used up its hourly transfer quota of 100 bytes" in cut.detail
    assert "resets in 60 minutes" in cut.detail


def test_when_is_said_in_seconds_then_minutes():
    assert quotas.transfer_refusal(Limits(bytes_per_hour=2048), 1.2).detail.endswith("resets in 2 seconds")
    assert quotas.transfer_refusal(Limits(bytes_per_hour=2048), 61).detail.endswith("resets in 61 seconds")
    assert quotas.transfer_refusal(Limits(bytes_per_hour=2048),
                                   1380).detail.endswith("of 2 KiB; it resets in 23 minutes")


# ---- the loader -------------------------------------------------------------


def test_loader_reads_the_quota_keys_top_level_and_per_profile():
    policy = load_policy_text(
        "version: 1\n"
        "limits: {max_total_connections: 500, max_connections: 20, requests_per_second: 10, burst: 40,\n"
        "         bytes_per_hour: 1GiB, max_requests_per_host_per_minute: 120, max_tunnels: 16}\n"
        "clients:\n"
        "  - name: slow\n"
        "    sources: [10.1.0.0/16]\n"
        "    limits: {requests_per_second: 0.5, burst: 2, max_tunnels: null}\n"
    )
    top = policy.rules.limits
    assert (top.max_total_connections, top.max_connections, top.requests_per_second, top.burst) == (500, 20, 10.0, 40)
    assert (top.bytes_per_hour, top.max_requests_per_host_per_minute, top.max_tunnels) == (2**30, 120, 16)
    slow = policy.clients[0].rules.limits
    assert (slow.requests_per_second, slow.burst, slow.max_tunnels, slow.bytes_per_hour) == (0.5, 2, None, 2**30)


def test_loader_defaults_are_no_limit():
    limits = load_policy_text("version: 1\n").rules.limits
    assert (limits.max_connections, limits.max_total_connections, limits.max_tunnels, limits.requests_per_second,
            limits.burst, limits.bytes_per_hour, limits.max_requests_per_host_per_minute) == (None,) * 7


@pytest.mark.parametrize("text,message", [
    ("limits: {requests_per_second: 0}", "a rate must be greater than zero"),
    ("limits: {requests_per_second: fast}", "is not a rate"),
    ("limits: {requests_per_second: .inf}", "is not a rate"),
    ("limits: {burst: 5}", "limits.burst has no effect without limits.requests_per_second"),
    ("limits: {max_tunnels: 0}", "a count must be greater than zero"),
    ("limits: {max_connections: 2.5}", "is not a count"),
    ("limits: {bytes_per_hour: lots}", "is not a size"),
    ("clients:\n  - name: a\n    sources: [10.0.0.0/8]\n    limits: {max_total_connections: 5}",
     "limits.max_total_connections is global"),
])
def test_loader_refuses_bad_quota_values(text, message):
    with pytest.raises(PolicyInvalid) as e:
        load_policy_text("version: 1\n" + text)
    assert message in str(e.value)


# ---- source groups (issue 18 item 6) --------------------------------------------


def test_an_ipv6_source_is_counted_by_its_network():
    source_group = quotas.source_group
    assert source_group("2001:db8:1:2::5") == source_group("2001:db8:1:2:ffff::9") == "2001:db8:1:2::/64"
    assert source_group("2001:db8:1:3::5") != source_group("2001:db8:1:2::5")
    assert source_group("2001:db8:1:2::5", 56) == source_group("2001:db8:1:3::5", 56) == "2001:db8:1::/56"
    assert source_group("2001:db8:1:2::5", 128) == "2001:db8:1:2::5/128"
    assert source_group("fe80::1%eth0") == "fe80::/64"
    assert source_group("10.0.0.5") == "10.0.0.5" and source_group(None) is None


def test_ipv6_client_prefix_loads_at_the_top_level_only():
    policy = load_policy_text("version: 1\nlimits:\n  ipv6_client_prefix: 56\n", "p.yaml")
    assert policy.rules.limits.ipv6_client_prefix == 56
    assert load_policy_text("version: 1\n", "p.yaml").rules.limits.ipv6_client_prefix == 64
    for bad in ("0", "129", "64.5", "'64'", "true"):
        with pytest.raises(PolicyInvalid) as info:
            load_policy_text(f"version: 1\nlimits:\n  ipv6_client_prefix: {bad}\n", "p.yaml")
        assert "not an IPv6 prefix length" in str(info.value.problems[0].message), bad
    with pytest.raises(PolicyInvalid) as info:
        load_policy_text("version: 1\nclients:\n  - name: a\n    sources: [10.0.0.0/8]\n"
                         "    limits:\n      ipv6_client_prefix: 48\n", "p.yaml")
    assert "limits.ipv6_client_prefix is global" in info.value.problems[0].message
