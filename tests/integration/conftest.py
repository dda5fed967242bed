"""Every integration test: must carry @pytest.mark.netns, and no canary may be hit.

The `canaries` guard is autouse: it resets every origin/canary counter before
the test and, after it, fails the test if any canary accepted a connection the
test did not explicitly allow with `canaries.allow(ip, port)`.
"""

from __future__ import annotations

import pytest

from harness.canaries import guard_canaries


@pytest.fixture(autouse=True)
def canaries(request, netns):
    yield from guard_canaries(request, "integration")
