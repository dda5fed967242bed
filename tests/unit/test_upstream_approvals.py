"""The gate's per-connection approval table is bounded like the
connection's upstreams (issue 18 item 2): the most recent
max_upstreams_per_connection + 1 approvals, plus those of open tunnels."""

from __future__ import annotations

from types import SimpleNamespace

from mitmproxy.test import tflow

from sluice import connstate
from sluice.addons.gate import EgressGate
from sluice.outcome import Outcome
from sluice.policy.decide import Decision
from sluice.policy.model import Limits, Rules


def _gate() -> EgressGate:
    return EgressGate(source=None, audit=None, caps=SimpleNamespace(watch_tunnel=lambda *a: None))


def test_approvals_keep_the_most_recent_limit_plus_one():
    gate, client = _gate(), tflow.tclient_conn()
    rules = Rules(limits=Limits(max_upstreams_per_connection=2))
    for i in range(1, 11):
        gate._approve(client, f"8.8.4.{i}", 80, rules)
    assert list(connstate.state_of(client).approved) == [("8.8.4.8", 80), ("8.8.4.9", 80), ("8.8.4.10", 80)]
    # Approving an address again makes it the most recent.
    gate._approve(client, "8.8.4.8", 80, rules)
    gate._approve(client, "8.8.4.11", 80, rules)
    assert list(connstate.state_of(client).approved) == [("8.8.4.10", 80), ("8.8.4.8", 80), ("8.8.4.11", 80)]
    assert gate._approved_rules(client, "8.8.4.1", 80) is None


def test_an_open_tunnels_approval_is_never_dropped():
    gate, client = _gate(), tflow.tclient_conn()
    rules = Rules(limits=Limits(max_upstreams_per_connection=1))
    gate._approve(client, "1.1.1.1", 443, rules)
    tunnel = Outcome("1.1.1.1", 443, Decision(True, address="1.1.1.1", port=443), None, rules)
    gate._remember_tunnel(client, SimpleNamespace(id="s1"), tunnel)
    for i in range(1, 6):
        gate._approve(client, f"8.8.4.{i}", 80, rules)
    assert ("1.1.1.1", 443) in connstate.state_of(client).approved
    assert len(connstate.state_of(client).approved) == 3  # the tunnel's, and the most recent two
