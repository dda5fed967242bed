"""private_networks entries with and without a port, against `ports`.

An entry with a port opens that address on that port; one without a port
opens the address on the policy's `ports` only, whichever other entries exist.
"""

from __future__ import annotations

import pytest

from sluice.policy.decide import Destination, check_address, check_answers, check_request
from sluice.policy.loader import load_policy_text

RULES = load_policy_text(
    'version: 1\nprivate_networks: ["10.0.0.5/32", "10.0.0.0/8:8080", "192.168.0.0/16", "192.168.1.1/32:9000"]\n'
).rules


@pytest.mark.parametrize(
    ("address", "port", "reason"),
    [
        ("10.0.0.5", 443, None),  # the /32 without a port, on a policy port
        ("10.0.0.5", 8080, None),  # the less specific /8 names this port
        ("10.0.0.5", 9000, "port_not_allowed"),
        ("10.1.1.1", 8080, None),
        ("10.1.1.1", 80, "address_not_public"),  # the /8 is opened on 8080 only
        ("192.168.1.1", 9000, None),
        ("192.168.1.1", 443, None),  # the /16 without a port
        ("192.168.7.7", 443, None),
        # port 8080 is open for 10/8 only: the port-less /16 must not ride on it
        ("192.168.7.7", 8080, "port_not_allowed"),
        ("192.168.1.1", 8080, "port_not_allowed"),
        ("192.168.7.7", 9000, "port_not_allowed"),
        ("8.8.8.8", 8080, "port_not_allowed"),
    ],
)
def test_ports_of_private_networks(address, port, reason):
    decision = check_request(RULES, Destination(address, port, "http", "GET"))
    assert decision.reason == reason, decision.refusal
    # the dial-time re-check agrees
    refusal = check_address(RULES, address, port)
    assert (refusal.reason if refusal else None) == reason
    # and so does a name resolving to the address
    pending = check_request(RULES, Destination("svc.example.com", port, "http", "GET"))
    if pending.needs_dns:
        resolved = check_answers(RULES, pending, [address])
        expected = "dns_answer_not_public" if reason == "address_not_public" else reason
        assert resolved.reason == expected
    else:
        assert reason == "port_not_allowed"
