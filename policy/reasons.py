"""The one list of refusal reason codes: their HTTP status and what they mean.

Codes are stable API: agents and operators match on them (the `Sluice-Reason`
response header and the audit log's `reason`). Add codes; never rename one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum


class Reason(StrEnum):
    ADDRESS_NOT_PUBLIC = "address_not_public"
    INTERNAL_HOSTNAME = "internal_hostname"
    MALFORMED_HOST = "malformed_host"
    DNS_ANSWER_NOT_PUBLIC = "dns_answer_not_public"
    DNS_FAILED = "dns_failed"
    PORT_NOT_ALLOWED = "port_not_allowed"
    SCHEME_NOT_ALLOWED = "scheme_not_allowed"
    URL_CREDENTIALS = "url_credentials"
    HOST_DENIED = "host_denied"
    HOST_NOT_ALLOWED = "host_not_allowed"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    CLIENT_UNKNOWN = "client_unknown"
    REQUEST_TOO_LARGE = "request_too_large"
    RESPONSE_TOO_LARGE = "response_too_large"
    CONNECT_TIMEOUT = "connect_timeout"
    REQUEST_TIMEOUT = "request_timeout"
    TUNNEL_TOO_LARGE = "tunnel_too_large"
    TUNNEL_TIMEOUT = "tunnel_timeout"
    REDIRECT_REFUSED = "redirect_refused"
    HOST_MISMATCH = "host_mismatch"
    INTERNAL_ERROR = "internal_error"
    PIN_MISMATCH = "pin_mismatch"
    CLIENT_PROTOCOL_REFUSED = "client_protocol_refused"
    UPGRADE_REFUSED = "upgrade_refused"
    NOT_HTTP = "not_http"
    BAD_REQUEST = "bad_request"
    HEADERS_TOO_LARGE = "request_headers_too_large"
    HEADER_TIMEOUT = "header_timeout"
    AUTH_THROTTLED = "auth_throttled"
    TUNNEL_REVOKED = "tunnel_revoked"
    PROXY_LOOP = "proxy_loop"
    RATE_LIMITED = "rate_limited"
    HOST_RATE_LIMITED = "host_rate_limited"
    QUOTA_EXCEEDED = "quota_exceeded"
    TOO_MANY_CONNECTIONS = "too_many_connections"
    TOO_MANY_TUNNELS = "too_many_tunnels"
    SHUTDOWN = "shutdown"
    CREDENTIAL_PLAIN_HTTP = "credential_plain_http"
    ORIGIN_PROXY_AUTH = "origin_proxy_auth"
    RULE_DENIED = "rule_denied"
    UPSTREAM_PROXY_FAILED = "upstream_proxy_failed"
    APPROVAL_PENDING = "approval_pending"
    STATE_STORE_UNAVAILABLE = "state_store_unavailable"


@dataclass(frozen=True, slots=True)
class ReasonInfo:
    status: int
    meaning: str  # one line for the README's table and `sluice reasons`


REASONS: dict[Reason, ReasonInfo] = {
    Reason.ADDRESS_NOT_PUBLIC: ReasonInfo(403, "the destination is an IP address outside the public internet "
                                               "(loopback, private, link-local, metadata, reserved, ...)"),
    Reason.INTERNAL_HOSTNAME: ReasonInfo(403, "the host name is an internal name (localhost, *.internal, *.local, "
                                              "single-label, cluster and metadata names)"),
    Reason.MALFORMED_HOST: ReasonInfo(403, "the host is neither a valid DNS name nor an IP address"),
    Reason.DNS_ANSWER_NOT_PUBLIC: ReasonInfo(403, "the name resolved (directly or through a CNAME) to at least one "
                                                  "non-public address"),
    Reason.DNS_FAILED: ReasonInfo(502,
                                  "the name could not be resolved; Sluice fails closed. No such name (NXDOMAIN) or no "
                                  "address: retrying will not help. A timeout or SERVFAIL may be transient: retrying "
                                  "later is reasonable"),
    Reason.PORT_NOT_ALLOWED: ReasonInfo(403, "the destination port is not in the policy's `ports`"),
    Reason.SCHEME_NOT_ALLOWED: ReasonInfo(403, "only http and https URLs may pass (https through CONNECT); Sluice "
                                               "proxies no other protocol"),
    Reason.URL_CREDENTIALS: ReasonInfo(403, "the URL carries user:password@ credentials"),
    Reason.HOST_DENIED: ReasonInfo(403, "the host matches a `deny` rule"),
    Reason.HOST_NOT_ALLOWED: ReasonInfo(403, "the policy has an `allow` list and the host is not on it"),
    Reason.METHOD_NOT_ALLOWED: ReasonInfo(403, "the HTTP method is not in the policy's `methods`"),
    Reason.CLIENT_UNKNOWN: ReasonInfo(407, "`require_client` is set and the client matched no profile (or gave wrong "
                                           "credentials)"),
    Reason.REQUEST_TOO_LARGE: ReasonInfo(413, "the request body is over `limits.max_request_bytes`"),
    Reason.RESPONSE_TOO_LARGE: ReasonInfo(502,
                                          "the response body is over `limits.max_response_bytes`, or an HTTP/2 client "
                                                 "left a stream unread past twice `limits.h2_stream_buffer_bytes` (the "
                                                 "stream is reset)"),
    Reason.CONNECT_TIMEOUT: ReasonInfo(504, "the origin did not accept the connection within `limits.connect_timeout`"),
    Reason.REQUEST_TIMEOUT: ReasonInfo(504, "the whole exchange took longer than `limits.request_timeout`"),
    Reason.TUNNEL_TOO_LARGE: ReasonInfo(502, "a tunnel carried more than `limits.tunnel_max_bytes` in one direction"),
    Reason.TUNNEL_TIMEOUT: ReasonInfo(504, "a tunnel stayed open longer than `limits.tunnel_max_seconds`"),
    Reason.REDIRECT_REFUSED: ReasonInfo(403, "the response redirects to a destination the policy refuses"),
    Reason.HOST_MISMATCH: ReasonInfo(403, "inside an intercepted tunnel, the Host header or SNI names another host "
                                          "than the CONNECT target"),
    Reason.INTERNAL_ERROR: ReasonInfo(500, "Sluice failed while deciding (a bug; the proxy log has the details); it "
                                           "refuses rather than guess"),
    Reason.PIN_MISMATCH: ReasonInfo(502, "an upstream dial or connection was not to the address the gate validated for "
                                         "this client connection; it is closed before any byte passes"),
    Reason.CLIENT_PROTOCOL_REFUSED: ReasonInfo(400, "the client spoke something the proxy port does not accept: TLS or "
                                                    "HTTP/2 to the proxy itself, SOCKS4, SOCKS5 BIND or UDP ASSOCIATE"),
    Reason.UPGRADE_REFUSED: ReasonInfo(403, "a protocol upgrade other than WebSocket (`Upgrade:` / `101 Switching "
                                            "Protocols`)"),
    Reason.NOT_HTTP: ReasonInfo(400, "inside an intercepted tunnel the client sent bytes that are not an HTTP request; "
                                     "intercepted tunnels carry only HTTP"),
    Reason.BAD_REQUEST: ReasonInfo(400, "the request is malformed HTTP (an unparseable request line or header, both "
                                        "Content-Length and Transfer-Encoding, no Host, ...)"),
    Reason.HEADERS_TOO_LARGE: ReasonInfo(431, "the request head is over `limits.max_header_bytes` or has more than "
                                              "`limits.max_header_count` fields"),
    Reason.HEADER_TIMEOUT: ReasonInfo(408, "the request head did not arrive whole within `limits.header_timeout`"),
    Reason.AUTH_THROTTLED: ReasonInfo(407, "too many wrong proxy passwords from this address or for this user, or too "
                                           "many password checks waiting; retry after the `Retry-After` seconds"),
    Reason.TUNNEL_REVOKED: ReasonInfo(403,
                                      "an open tunnel or WebSocket pipe was closed because a reloaded policy refuses "
                                      "it: its destination, or its client, which a reload matches again (user, source) "
                                      "and which now belongs to a profile that refuses it, or to none"),
    Reason.PROXY_LOOP: ReasonInfo(403,
                                  "the destination is an address of the proxy's own host, on any port: a listener's "
                                  "address, every interface address when the proxy listens on a wildcard, or one of "
                                  "`proxy_addresses`"),
    Reason.RATE_LIMITED: ReasonInfo(429, "the client is over its `limits.requests_per_second` (and `burst`); retry "
                                         "after the `Retry-After` seconds"),
    Reason.HOST_RATE_LIMITED: ReasonInfo(429,
                                         "the client is over its `limits.max_requests_per_host_per_minute` for this "
                                         "host; retry after the `Retry-After` seconds (other hosts are not affected)"),
    Reason.QUOTA_EXCEEDED: ReasonInfo(429,
                                      "the client has used its `limits.bytes_per_hour`; new requests are refused until "
                                      "the hour's window resets (`Retry-After`), and whatever is in flight (exchanges, "
                                      "HTTP/2 streams, tunnels, WebSocket pipes) is cut when the quota runs out"),
    Reason.TOO_MANY_CONNECTIONS: ReasonInfo(429,
                                            "the source address has `limits.max_connections` connections open (the "
                                            "extra connection is refused and closed), the proxy has "
                                            "`limits.max_total_connections` or the source its share of them (closed at "
                                            "accept), a client connection's upstreams are all busy at "
                                            "`limits.max_upstreams_per_connection`, or the proxy is out of file "
                                            "descriptors"),
    Reason.TOO_MANY_TUNNELS: ReasonInfo(429, "the client has `limits.max_tunnels` tunnels (CONNECT, SOCKS5, "
                                             "transparent, WebSocket pipes) open"),
    Reason.SHUTDOWN: ReasonInfo(503, "the proxy was shutting down and the exchange or tunnel was still open when "
                                     "`--drain-timeout` ran out; retrying (through another replica) is reasonable"),
    Reason.CREDENTIAL_PLAIN_HTTP: ReasonInfo(403, "the proxy holds a credential for this host and sends it over HTTPS "
                                                  "only (no `allow_plain_http`), and the request is plain http"),
    Reason.RULE_DENIED: ReasonInfo(403,
                                   "a request rule (`rules:`) denies this method, path or query on this host (the "
                                   "refusal names the rule's `file:line`), or the path is spelled in a way origins "
                                   "disagree about (`%2F`, `%5C`, `%2E%2E`, a backslash, `;`) on a host the rules "
                                   "name"),
    Reason.APPROVAL_PENDING: ReasonInfo(403,
                                        "the policy refuses this request for a reason its `approvals.ask` lists, so "
                                        "Sluice asked an operator (the refusal carries the approval request's id): "
                                        "wait and retry after the `Retry-After` seconds; identical requests share one "
                                        "ask"),
    Reason.ORIGIN_PROXY_AUTH: ReasonInfo(502,
                                         "the origin answered 407 Proxy Authentication Required, which only the proxy "
                                         "may send (an origin could pose as Sluice asking for a password); Sluice "
                                         "answers 502 instead"),
    Reason.UPSTREAM_PROXY_FAILED: ReasonInfo(502,
                                             "the parent proxy (`upstream_proxy`) refused the CONNECT (its status "
                                             "line is quoted), or was down, unreachable or did not answer within "
                                             "`limits.connect_timeout`"),
    Reason.STATE_STORE_UNAVAILABLE: ReasonInfo(503,
                                               "the proxy's shared limit store (`state.store`) is unreachable and "
                                               "the policy's `state.on_error` is `closed`, so a request that needs a "
                                               "shared limit (or a proxy password not yet accepted, which needs the "
                                               "shared throttle of wrong passwords) is refused until the store is "
                                               "back; retry after the `Retry-After` seconds"),
}

# Sent with every refusal so an agent knows this is deliberate and final
# (unless the refusal gives its own advice, as a DNS failure does).
POLICY_SUFFIX = (
    "This is the network's egress policy, not a transient error: do not retry "
    "or try another route; ask the operator if this access is needed."
)
# dns_failed: the lookup failed in a way that may pass (timeout, SERVFAIL).
DNS_TRANSIENT_ADVICE = (
    "This may be a temporary DNS failure, not the egress policy: retrying later "
    "is reasonable; if it keeps failing, ask the operator."
)
# dns_failed: the name does not exist, or has no address.
DNS_NO_NAME_ADVICE = (
    "The name does not resolve, so retrying will not help: check the host name."
)
# bad_request: the request itself is broken, not refused by the policy.
BAD_REQUEST_ADVICE = (
    "The request is not valid HTTP/1.1, so no policy was applied to it: fix the "
    "request (its request line, headers or body framing); sending it unchanged "
    "gets the same answer."
)
# scheme_not_allowed: a protocol Sluice does not carry, whatever the policy.
SCHEME_ADVICE = (
    "Use an http or https URL for this resource; retrying this one will not help."
)
# shutdown: the proxy stopped, not the policy.
SHUTDOWN_ADVICE = (
    "The proxy is shutting down, not refusing by policy: retrying shortly is reasonable."
)
# upstream_proxy_failed: the parent proxy failed, not Sluice's policy.
UPSTREAM_PROXY_ADVICE = (
    "The parent proxy this network goes through failed, not Sluice's policy: retrying later may help; if it keeps "
    "failing, ask the operator (the parent may refuse CONNECT to this port, or want other credentials)."
)
# What to do after a refusal whose cause is not the policy (the default is POLICY_SUFFIX).
REASON_ADVICE: dict[Reason, str] = {
    Reason.BAD_REQUEST: BAD_REQUEST_ADVICE,
    Reason.SCHEME_NOT_ALLOWED: SCHEME_ADVICE,
    Reason.SHUTDOWN: SHUTDOWN_ADVICE,
    Reason.UPSTREAM_PROXY_FAILED: UPSTREAM_PROXY_ADVICE,
}
# The longest operator sentence (the policy's `refusal_note`) a refusal carries.
MAX_NOTE_CHARS = 300


@dataclass(frozen=True, slots=True)
class Refusal:
    reason: Reason
    detail: str  # what was refused and why, e.g. "169.254.169.254 is link-local (cloud metadata)"
    rule: str | None = None  # where the deciding rule lives (file:line), when a rule decided
    retry_after: int | None = None  # seconds, sent as Retry-After (throttling refusals)
    advice: str | None = None  # what to do, instead of REASON_ADVICE / POLICY_SUFFIX (e.g. a DNS failure that may pass)
    note: str | None = None  # the operator's own sentence (the policy's `refusal_note`), appended last

    @property
    def status(self) -> int:
        return REASONS[self.reason].status

    @property
    def message(self) -> str:
        if self.retry_after is not None:
            # Throttling is transient by design: say when to retry instead.
            text = f"Sluice refused this request: {self.detail}. Retry after {self.retry_after} s."
        else:
            advice = self.advice or REASON_ADVICE.get(self.reason, POLICY_SUFFIX)
            text = f"Sluice refused this request: {self.detail}. {advice}"
        return f"{text} {self.note}" if self.note else text

    def with_note(self, note: str | None) -> Refusal:
        """This refusal with the operator's sentence for the client's rules
        (a refusal that already carries one keeps it)."""
        if not note or self.note is not None:
            return self
        return replace(self, note=note)
