"""Guard: integration tests only ever run inside the private test namespace.

`scripts/in-netns.sh` makes a network namespace whose only interface is `lo`
and puts the test hosts on it (8.8.8.8, 1.1.1.1, 10.0.0.1, ...). Outside it,
a connection to "8.8.8.8" would leave the machine, so every netns fixture goes
through `netns_problem()` first and the run fails (not skips) if it says no.

The environment variable alone is not trusted: we also check that the only
interface is `lo` and that the test addresses are really local here.
"""

from __future__ import annotations

import os
import socket

RUN_HINT = (
    "integration tests must run inside the private test network namespace: "
    "run `make test` (or `scripts/in-netns.sh .venv/bin/pytest ...`); "
    "to run only unit tests use `make unit` / `pytest -m 'not netns'`"
)

# Addresses in-netns.sh puts on `lo`; each must be bindable here.
TEST_ADDRESSES_V4 = (
    "8.8.8.8",
    "1.1.1.1",
    "93.184.215.14",
    "10.0.0.1",
    "169.254.169.254",
    "100.100.100.200",
)
TEST_ADDRESSES_V6 = ("2606:4700:4700::1111", "fd00:ec2::254")


def _bindable(family: int, address: str) -> bool:
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.bind((address, 0))
        return True
    except OSError:
        return False
    finally:
        s.close()


def netns_problem() -> str | None:
    """Why this process is NOT safely inside the test namespace, or None."""
    if os.environ.get("SLUICE_NETNS") != "1":
        return "SLUICE_NETNS is not 1. " + RUN_HINT
    interfaces = sorted(name for _, name in socket.if_nameindex())
    if interfaces != ["lo"]:
        return (
            f"SLUICE_NETNS=1 but the network interfaces are {interfaces}, not just ['lo']: "
            "this is not the private test namespace. " + RUN_HINT
        )
    for address in TEST_ADDRESSES_V4:
        if not _bindable(socket.AF_INET, address):
            return f"test address {address} is not on lo. " + RUN_HINT
    for address in TEST_ADDRESSES_V6:
        if not _bindable(socket.AF_INET6, address):
            return f"test address {address} is not on lo. " + RUN_HINT
    return None
