"""The reliability suite: load, faults, bad input and a DNS-rebinding soak,
all inside the private network namespace (`make test`, or
`scripts/in-netns.sh .venv/bin/pytest -q tests/reliability`).

Every test must carry @pytest.mark.netns. The autouse `canaries` guard
(tests/harness/canaries.py, shared with tests/integration): it resets every
origin/canary counter before a test and fails the test if any canary
listener (127.0.0.1, 10.0.0.1, 169.254.169.254, 100.100.100.200,
[fd00:ec2::254], [::1] on 80/443/8080) accepted a connection.

Counts are short by default; SLUICE_LONG=1 runs the long variants. Every
test here is marked `reliability`, so `make test PYTEST_ARGS='-m "not
reliability"'` leaves the slow suite out while developing (CI runs it).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.canaries import guard_canaries
from relkit import FaultOrigin

_HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    # A conftest hook sees the whole session's items: mark only this folder's.
    for item in items:
        if _HERE in item.path.resolve().parents:
            item.add_marker(pytest.mark.reliability)


@pytest.fixture(autouse=True)
def canaries(request, netns):
    yield from guard_canaries(request, "reliability")


@pytest.fixture(scope="session")
def fault_origin(net):
    origin = FaultOrigin().start()
    yield origin
    origin.stop()
