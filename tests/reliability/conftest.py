"""The reliability suite: load, faults, bad input and a DNS-rebinding soak,
all inside the private network namespace (`make test`, or
`scripts/in-netns.sh .venv/bin/pytest -q tests/reliability`).

Every test must carry @pytest.mark.netns. The autouse `canaries` guard here is
this directory's own equivalent of tests/integration's: it resets every
origin/canary counter before a test and fails the test if any canary
listener (127.0.0.1, 10.0.0.1, 169.254.169.254, 100.100.100.200,
[fd00:ec2::254], [::1] on 80/443/8080) accepted a connection.

Counts are short by default; SLUICE_LONG=1 runs the long variants.
"""

from __future__ import annotations

import pytest

from relkit import FaultOrigin


class CanaryGuard:
    def __init__(self, net):
        self.net = net

    def hits(self) -> dict[str, int]:
        return {c.name: c.connections for c in self.net.canaries.values() if c.connections}

    def assert_untouched(self) -> None:
        hits = self.hits()
        assert not hits, f"canary listeners were connected to: {hits}"


@pytest.fixture(autouse=True)
def canaries(request, netns):
    if request.node.get_closest_marker("netns") is None:
        pytest.fail(f"{request.node.nodeid}: reliability tests must be marked @pytest.mark.netns", pytrace=False)
    net = request.getfixturevalue("net")
    net.reset()
    guard = CanaryGuard(net)
    yield guard
    hits = guard.hits()
    if hits:
        pytest.fail(f"canary listeners were connected to during this test: {hits}", pytrace=False)


@pytest.fixture(scope="session")
def fault_origin(net):
    origin = FaultOrigin().start()
    yield origin
    origin.stop()
