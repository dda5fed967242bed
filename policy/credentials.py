"""Proxy-held credentials: the policy's `credentials` entries as plain data,
and which entry applies to a request, as pure functions.

An entry names hosts and the request headers the proxy sets on requests to
them, with values read from a file or an environment variable (by the
loader, never written in the policy). The value is a `Secret`: its repr and
str are redacted, so a policy, a rule set or an entry can be printed, logged
or put in an exception message without giving the value away. Only the
injecting addon calls `Secret.reveal()`.

Which entry applies is decided on the host the proxy itself decided on (the
tunnel's host inside an intercepted tunnel, the request's host on the front
door), never on a header the client controls, and per request: the first
entry of the client's rules whose `hosts` match (a profile's own entries
first, then the top level's it did not replace). `allow_plain_http` says
whether the entry may travel over plain HTTP; otherwise such a request is
refused (`credential_plain_http`), never sent without the value or with it.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sluice.policy.hosts import Host, HostError, parse_host
from sluice.policy.matchers import HostMatcher
from sluice.policy.reasons import Reason, Refusal

if TYPE_CHECKING:
    from sluice.policy.model import Rules

# Headers a credential may not set: they frame or route the request (a Host
# would be domain fronting), or belong to the proxy hop.
FORBIDDEN_HEADERS = frozenset({
    "host", "content-length", "transfer-encoding", "connection", "upgrade", "te", "trailer", "keep-alive",
    "proxy-connection", "proxy-authorization", "proxy-authenticate",
})
FORMAT_SLOT = "{}"
MAX_VALUE_CHARS = 8 * 1024  # one header value


class Secret:
    """A credential's value. Its repr and str never show it; `reveal()` does."""

    __slots__ = ("_value",)

    def __init__(self, value: str | None) -> None:
        self._value = value  # None: not read (a policy loaded from text only)

    @property
    def known(self) -> bool:
        return self._value is not None

    def reveal(self) -> str:
        if self._value is None:
            raise LookupError("this credential value was not read (the policy was loaded without its files)")
        return self._value

    def __repr__(self) -> str:
        return "Secret(<redacted>)" if self._value is not None else "Secret(<not read>)"

    __str__ = __repr__

    def __format__(self, spec: str) -> str:
        return repr(self)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Secret):
            return NotImplemented
        if self._value is None or other._value is None:
            return self._value is other._value
        return hmac.compare_digest(self._value.encode(), other._value.encode())

    def __hash__(self) -> int:
        return hash(("Secret", self._value))


@dataclass(frozen=True, slots=True)
class CredentialHeader:
    name: str  # as written in the policy
    source: str  # where the value comes from, for people: "file /run/secrets/brave" or "env GITHUB_TOKEN"
    value: Secret  # the header value, format applied
    path: str | None = None  # a file source's path (relative ones made absolute against the policy's directory)
    format: str | None = None  # "Bearer {}": the value is put in place of {}


@dataclass(frozen=True, slots=True)
class Credential:
    """One `credentials` entry."""

    hosts: HostMatcher
    hosts_text: tuple[str, ...]  # the hosts list as written: a profile's entry with the same text replaces this one
    headers: tuple[CredentialHeader, ...]
    allow_plain_http: bool = False
    origin: str = ""  # file:line of the entry

    @property
    def header_names(self) -> tuple[str, ...]:
        return tuple(h.name for h in self.headers)


def merge(own: tuple[Credential, ...], inherited: tuple[Credential, ...]) -> tuple[Credential, ...]:
    """A profile's entries: its own, then the inherited ones whose `hosts`
    list is not the same text as one of its own (those it replaces)."""
    replaced = {c.hosts_text for c in own}
    return own + tuple(c for c in inherited if c.hosts_text not in replaced)


def credential_for(rules: Rules, host: Host | str | None) -> Credential | None:
    """The entry of these rules that applies to a request to `host` (as the
    proxy decided it: a Host, or its text), or None. Pure."""
    if not rules.credentials or host is None:
        return None
    if isinstance(host, str):
        try:
            host = parse_host(host)
        except HostError:
            return None
    for entry in rules.credentials:
        if entry.hosts.match_host(host) is not None:
            return entry
    return None


def plain_http_refusal(entry: Credential, host: Host | str | None, scheme: str | None) -> Refusal | None:
    """A refusal when `entry` would be sent in clear (plain http) and does not allow it."""
    if entry.allow_plain_http or (scheme or "").lower() != "http" or not entry.headers:
        return None
    return Refusal(
        Reason.CREDENTIAL_PLAIN_HTTP,
        f"the proxy holds a credential for {host} ({entry.origin}) that it sends over HTTPS only, and this request "
        f"is plain http; use https://",
        entry.origin,
    )


def apply_to(rules: Rules, host: Host | str | None, scheme: str | None) -> tuple[Credential | None, Refusal | None]:
    """What the proxy does with credentials for one request it sees whole:
    (the entry whose headers it sets, None) or (None, a refusal)."""
    entry = credential_for(rules, host)
    if entry is None or not entry.headers:
        return None, None
    refusal = plain_http_refusal(entry, host, scheme)
    return (None, refusal) if refusal is not None else (entry, None)


def format_value(raw: str, fmt: str | None) -> str:
    return raw if fmt is None else fmt.replace(FORMAT_SLOT, raw, 1)


def value_problem(value: str) -> str | None:
    """What makes `value` unusable as a header value, never quoting it."""
    if not value:
        return "is empty"
    if len(value) > MAX_VALUE_CHARS:
        return f"is {len(value)} characters, over the {MAX_VALUE_CHARS} a header value may have here"
    if any((c < " " and c != "\t") or c == "\x7f" for c in value):
        return "holds a line break or another control character (a header value is one line)"
    if value != value.strip():
        return "starts or ends with white space"
    return None
