"""Integration-test harness for Sluice: fake DNS, origins, canaries, the proxy process.

Everything here binds the test addresses that `scripts/in-netns.sh` puts on
`lo` inside a private network namespace; nothing is ever sent off loopback.
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
