"""The policy as plain, immutable data. Built by policy.loader, read by policy.decide.

Defaults live here and nowhere else.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from sluice.policy.approvals import ApprovalSettings
from sluice.policy.credentials import Credential, Secret
from sluice.policy.matchers import AddressSet, HostMatcher
from sluice.policy.request_rules import RuleSet
from sluice.policy.state import StateSettings

DEFAULT_PORTS: frozenset[int] = frozenset({80, 443})
STANDARD_METHODS: frozenset[str] = frozenset(
    {"GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH"}
)
KIB = 1024
MIB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class DnsSettings:
    # (host, port) pairs; empty means the system's resolv.conf.
    nameservers: tuple[tuple[str, int], ...] = ()
    timeout: float = 3.0
    # Answers are cached for their TTL, clamped to this window.
    min_ttl: float = 5.0
    max_ttl: float = 300.0


@dataclass(frozen=True, slots=True)
class Limits:
    connect_timeout: float = 10.0
    request_timeout: float = 30.0
    idle_timeout: float = 60.0
    max_response_bytes: int = 10 * MIB
    max_request_bytes: int = 1 * MIB
    tunnel_max_bytes: int | None = None  # per direction; None = unlimited
    tunnel_max_seconds: float | None = None
    # The request head (request line and header fields). Global only: they
    # apply before the client is identified, so the top level sets them.
    max_header_bytes: int = 64 * KIB
    max_header_count: int = 100
    header_timeout: float = 10.0
    # HTTP/2 from the client (inside an intercepted tunnel), also global:
    # what the proxy holds for one stream the client does not read (past
    # it, that stream's origin is no longer read) and how many streams one
    # client connection may have open. Together they bound one connection's
    # buffers: h2_stream_buffer_bytes x h2_max_concurrent_streams.
    h2_stream_buffer_bytes: int = 1 * MIB
    h2_max_concurrent_streams: int = 100
    # Quotas (policy.quotas, addons/quotas.py); None = no limit. Counted per
    # source address (max_connections), per process (max_total_connections,
    # top level only), else per client: its proxy user once known, else its
    # source address. An IPv6 source is counted by its network of this many
    # bits (a host usually holds a whole /64); global, like login throttling.
    ipv6_client_prefix: int = 64
    max_connections: int | None = None
    max_total_connections: int | None = None
    # Upstream connections one client connection may hold open; over it the
    # least recently used idle one is closed (addons/upstreams.py).
    max_upstreams_per_connection: int = 16
    max_tunnels: int | None = None
    requests_per_second: float | None = None
    burst: int | None = None  # None: requests_per_second rounded up (at least 1)
    bytes_per_hour: int | None = None  # both directions
    max_requests_per_host_per_minute: int | None = None

    @property
    def rate_burst(self) -> int:
        """The token bucket's size: `burst`, else one second's worth of requests."""
        if self.burst is not None:
            return self.burst
        return max(1, math.ceil(self.requests_per_second or 1))


@dataclass(frozen=True, slots=True)
class UpstreamProxy:
    """A parent proxy (`upstream_proxy`) the dialer reaches origins through
    (sluice/dialer.py): `CONNECT <pinned IP>:<port>`, never a name."""

    host: str  # a name (resolved by the system resolver when dialled) or an IP literal
    port: int
    url: str  # as written (it never holds credentials: the loader refuses them)
    # The Proxy-Authorization value sent with each CONNECT, and where it comes
    # from for people ("file /run/secrets/parent"); None: no credentials.
    authorization: Secret | None = None
    credential_source: str | None = None
    origin: str = ""  # file:line of the `upstream_proxy` key


@dataclass(frozen=True, slots=True)
class Rules:
    """What one client profile (or the top level) may do."""

    action: str = "enforce"  # or "report"
    allow: HostMatcher | None = None  # None: every public host
    deny: HostMatcher = field(default_factory=HostMatcher)
    ports: frozenset[int] = DEFAULT_PORTS
    methods: frozenset[str] = STANDARD_METHODS
    private_networks: AddressSet = field(default_factory=AddressSet)
    limits: Limits = field(default_factory=Limits)
    intercept: HostMatcher = field(default_factory=HostMatcher)
    strip_request_headers: frozenset[str] = frozenset()
    # The operator's own sentence, appended to the refusals these rules'
    # clients get (who to ask for access, say).
    refusal_note: str | None = None
    # Proxy-held credentials (policy.credentials): a profile's own entries,
    # then the top level's it did not replace. Values are redacted Secrets.
    credentials: tuple[Credential, ...] = ()
    # Request rules (`rules:`, policy.request_rules), first match wins; a
    # profile's list replaces the top level's.
    request_rules: RuleSet = field(default_factory=RuleSet)
    # A parent proxy every dial of these rules goes through; None: direct.
    upstream_proxy: UpstreamProxy | None = None
    # Which refusals become requests for an operator's approval (`approvals:`,
    # policy.approvals); a profile's keys override the top level's.
    approvals: ApprovalSettings | None = None


@dataclass(frozen=True, slots=True)
class ClientProfile:
    name: str
    rules: Rules
    usernames: frozenset[str] = frozenset()
    # username -> verifier: "pbkdf2_sha256$iter$salt$hash" (password_hash), or
    # for a password_file the secret's keyed hash made at load time (see
    # policy.clients.secret_verifier), or "file:<path>" when loaded from text
    credentials: tuple[tuple[str, str], ...] = ()
    sources: AddressSet = field(default_factory=AddressSet)
    origin: str = ""  # file:line where the profile is defined


@dataclass(frozen=True, slots=True)
class Policy:
    version: int = 1
    rules: Rules = field(default_factory=Rules)
    dns: DnsSettings = field(default_factory=DnsSettings)
    clients: tuple[ClientProfile, ...] = ()
    require_client: bool = False
    source: str = "<default>"
    # The host's own addresses it cannot see on its interfaces (a cloud VM's
    # NAT'd public address), canonical IP text: dials to them are proxy_loop.
    proxy_addresses: frozenset[str] = frozenset()
    # `state`: the store quotas and login throttles are shared through (None: in process)
    state: StateSettings | None = None

    def profile(self, name: str) -> ClientProfile | None:
        """The client profile called `name`, if the policy has one."""
        return next((profile for profile in self.clients if profile.name == name), None)
