"""Integration-test harness for Sluice: fake DNS, origins, canaries, the proxy process.

Everything here binds the test addresses that `scripts/in-netns.sh` puts on
`lo` inside a private network namespace; nothing is ever sent off loopback.
Run the integration tests only as

    make test            # or: scripts/in-netns.sh .venv/bin/pytest -q tests/integration

Pieces (fixtures in tests/conftest.py wrap them):
- fakedns.FakeDNS   programmable DNS on 127.0.0.53:53 (UDP+TCP)   -> `fake_dns`
- servers.NetServers origins on 8.8.8.8, 1.1.1.1, [2606:4700:4700::1111]
                     (:80, :8080, TLS :443) and canaries on 127.0.0.1, 10.0.0.1,
                     169.254.169.254, 100.100.100.200, [fd00:ec2::254], [::1]
                     (:80, :443, :8080)                            -> `net`
- sluice.SluiceProcess `sluice proxy` as a subprocess              -> `sluice_factory`
- clients            raw HTTP / CONNECT / SOCKS5 clients and a clean-env curl
- http.read_request_head  one HTTP/1 request head, for the test origins
- netns.netns_problem the guard behind the `netns` session fixture
Set SLUICE_BIN to run the tests against another `sluice` executable.
"""

from .clients import (
    CurlResult,
    Response,
    SocksResult,
    Tunnel,
    absolute_form,
    connect,
    curl,
    http_request,
    origin_form,
    socks5_connect,
)
from .fakedns import FakeDNS
from .netns import RUN_HINT, netns_problem
from .servers import NetServers
from .sluice import SluiceProcess, default_policy, free_port

__all__ = [
    "RUN_HINT",
    "CurlResult",
    "FakeDNS",
    "NetServers",
    "Response",
    "SluiceProcess",
    "SocksResult",
    "Tunnel",
    "absolute_form",
    "connect",
    "curl",
    "default_policy",
    "free_port",
    "http_request",
    "netns_problem",
    "origin_form",
    "socks5_connect",
]
