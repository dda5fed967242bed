"""The canary guard shared by the integration and reliability suites: reset
every origin/canary counter before a test, fail it if a canary accepted a
connection the test did not explicitly allow."""

from __future__ import annotations

import pytest


class CanaryGuard:
    def __init__(self, net):
        self.net = net
        self.allowed: set[tuple[str, int]] = set()

    def allow(self, ip: str, port: int) -> None:
        """This test means to reach this listener (e.g. private_networks)."""
        self.allowed.add((ip, port))

    def hits(self, *ips: str) -> dict[str, int]:
        """Connections accepted by canaries (on these IPs, or all) so far."""
        return {
            c.name: c.connections
            for (ip, port), c in self.net.canaries.items()
            if c.connections and (not ips or ip in ips) and (ip, port) not in self.allowed
        }

    def assert_untouched(self, *ips: str) -> None:
        hits = self.hits(*ips)
        assert not hits, f"canary listeners were connected to: {hits}"


def guard_canaries(request, suite: str):
    """Body of a suite's autouse `canaries` fixture (a generator: yield from it)."""
    if request.node.get_closest_marker("netns") is None:
        pytest.fail(f"{request.node.nodeid}: {suite} tests must be marked @pytest.mark.netns", pytrace=False)
    net = request.getfixturevalue("net")
    net.reset()
    guard = CanaryGuard(net)
    yield guard
    hits = guard.hits()
    if hits:
        pytest.fail(f"canary listeners were connected to during this test: {hits}", pytrace=False)
