"""Approvals (issue 22) as plain data and one pure decision: no files, no clock.

A refusal whose reason the rules' `approvals.ask` lists becomes a request for
approval. An operator grants it (for a while, for the host or for one method
and path) or denies it (remembered for a while, so the agent is not asking in
a loop). `judge()` decides, for one refused request and the grants and
denials in force at `now`, whether it is granted (the caller decides it again
with `granted_rules`), denied (refused as before), or asked (refused
`approval_pending` with the ask's id). The proxy keeps the grants in SQLite
(sluice/approvals_store.py) or the policy's state store
(sluice/approvals_redis.py); `sluice policy explain/test` pass none.
"""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, NamedTuple

from sluice.policy.credentials import Secret
from sluice.policy.matchers import HostMatcher
from sluice.policy.reasons import Reason, Refusal
from sluice.policy.request_rules import RuleSet, normalise_path, split_target

if TYPE_CHECKING:
    from sluice.policy.model import Rules  # the model imports this module

# The refusals an operator may answer: what the policy's host, method and
# request rules say. The rest are never askable, and why (the loader's message).
ASKABLE: frozenset[Reason] = frozenset(
    {Reason.HOST_NOT_ALLOWED, Reason.HOST_DENIED, Reason.METHOD_NOT_ALLOWED, Reason.RULE_DENIED}
)
_NEVER_ASKABLE_WHY = {
    Reason.ADDRESS_NOT_PUBLIC: "the destination is outside the public internet; open it with private_networks",
    Reason.DNS_ANSWER_NOT_PUBLIC: "the name resolves outside the public internet; open it with private_networks",
    Reason.INTERNAL_HOSTNAME: "internal names are never reachable by approval",
    Reason.MALFORMED_HOST: "the host is not a valid name or address",
    Reason.DNS_FAILED: "the name did not resolve; no approval can fix that",
    Reason.PORT_NOT_ALLOWED: "ports are opened with `ports` or private_networks, not by approval",
    Reason.PROXY_LOOP: "the proxy's own host is never a destination",
}
NEVER_ASKABLE_DEFAULT = "only host, method and request-rule refusals are askable (address, name, DNS, port and " \
                        "limit refusals never are)"
DEFAULT_GRANT_FOR = 3600.0
DEFAULT_DENY_FOR = 86400.0
MAX_WAIT = 300.0  # a held request holds its client connection
# Retry-After of approval_pending: long enough for a person to answer.
RETRY_AFTER = 30


def never_askable_why(reason: str) -> str:
    """Why `reason` cannot be in `ask` (for the loader's message)."""
    try:
        return _NEVER_ASKABLE_WHY.get(Reason(reason), NEVER_ASKABLE_DEFAULT)
    except ValueError:
        return "it is not a reason code (`sluice reasons` lists them)"


@dataclass(frozen=True, slots=True)
class Notify:
    """Where a new ask is announced: a webhook, HMAC-signed with the secret."""

    webhook: str
    secret: Secret
    secret_source: str  # "file PATH" or "env NAME", for the summary (never the value)


@dataclass(frozen=True, slots=True)
class ApprovalSettings:
    """One rules' `approvals` block (a profile's keys override the top level's)."""

    ask: frozenset[Reason] = frozenset()
    grant_for: float = DEFAULT_GRANT_FOR  # seconds a grant lasts unless the operator says
    wait: float = 0.0  # seconds a refused request is held for an answer (0: answered at once)
    notify: Notify | None = None
    origin: str = ""  # file:line of the block


class AskKey(NamedTuple):
    """What makes two asks the same one: the client (profile, user) and the
    host, plus method and path when a request rule refused (path-level)."""

    profile: str  # "" for the top level
    user: str  # "" when the client gave no user
    host: str
    method: str  # "" for a host-level ask
    path: str  # "" for a host-level ask


def ask_id(key: AskKey) -> str:
    """The id of the ask for `key`: derived from it, so identical asks (in
    any worker, after a restart) share one id without coordination."""
    return hashlib.sha256("\0".join(key).encode()).hexdigest()[:12]


@dataclass(frozen=True, slots=True)
class Grant:
    """A grant (`denied` False) or a remembered denial, in force until `expires`
    (epoch seconds). `method`/`path` None: the whole host; else that method and
    path (a trailing `*` matches every path under the prefix)."""

    id: str
    profile: str
    user: str  # "": any user of the profile
    host: str
    method: str | None
    path: str | None
    expires: float
    denied: bool = False
    who: str = ""  # who granted or denied it (the admin token's name)

    @property
    def scope(self) -> str:
        return "host" if self.path is None else "path"

    def covers(self, key: AskKey, method: str, path: str) -> bool:
        if key.profile != self.profile or key.host != self.host:
            return False
        if self.user and self.user != key.user:
            return False
        if self.path is None:
            return True
        if self.method is not None and self.method != method:
            return False
        if self.path.endswith("*"):
            return path.startswith(self.path[:-1])
        return path == self.path


class Verdict(enum.Enum):
    GRANTED = "granted"  # a grant covers it: decide again with granted_rules
    DENIED = "denied"  # a denial covers it: refused as before
    ASK = "ask"  # refused approval_pending; the ask is recorded


@dataclass(frozen=True, slots=True)
class Ask:
    """A request for approval, as recorded and listed."""

    id: str
    key: AskKey
    method: str  # the request's method and path, even for a host-level ask (shown; `--scope path` uses them)
    path: str
    reason: str  # the refusal it replaced
    created: float


@dataclass(frozen=True, slots=True)
class Judgement:
    verdict: Verdict
    ask: Ask
    grant: Grant | None = None  # the grant or denial that decided (GRANTED, DENIED)

    def refusal(self, original: Refusal) -> Refusal:
        """What the client is answered unless it was granted."""
        if self.verdict is Verdict.DENIED:
            assert self.grant is not None
            return replace(original, detail=f"{original.detail}; an operator denied access (approval "
                                            f"{self.grant.id}) for now")
        return pending_refusal(self.ask, original)


def pending_refusal(ask: Ask, original: Refusal) -> Refusal:
    return Refusal(Reason.APPROVAL_PENDING,
                   f"{original.detail}, so Sluice asked an operator to approve it (approval request {ask.id}); wait "
                   "for the answer and send the request again", original.rule, retry_after=RETRY_AFTER,
                   note=original.note)


class Requester(NamedTuple):
    """The refused request, as approvals see it."""

    profile: str | None
    user: str | None
    host: str  # canonical host text (lower-case name, or canonical IP)
    method: str | None  # None for a dial
    target: str | None  # origin-form path and query; None for a CONNECT or dial


def askable(settings: ApprovalSettings | None, refusal: Refusal | None) -> bool:
    """Whether this refusal is one the rules ask about. A refusal that says how
    the agent can fix the request itself (a hostile path spelling) is not."""
    return (settings is not None and refusal is not None and refusal.reason in settings.ask
            and refusal.advice is None)


def judge(settings: ApprovalSettings | None, refusal: Refusal | None, requester: Requester,
          grants: tuple[Grant, ...] | list[Grant], now: float) -> Judgement | None:
    """The approvals' say on one refused request: None when its refusal is not
    askable; else granted, denied (a denial in force wins over a grant) or
    asked. Grants and denials past `expires` are ignored."""
    if not askable(settings, refusal):
        return None
    assert refusal is not None
    method = (requester.method or "").upper()
    path = normalise_path(split_target(requester.target)[0]) if requester.target else ""
    path_level = refusal.reason is Reason.RULE_DENIED
    key = AskKey(requester.profile or "", requester.user or "", requester.host,
                 method if path_level else "", path if path_level else "")
    ask = Ask(ask_id(key), key, method, path, refusal.reason.value, now)
    live = [g for g in grants if g.expires > now and g.covers(key, method, path)]
    for grant in live:
        if grant.denied:
            return Judgement(Verdict.DENIED, ask, grant)
    if live:
        return Judgement(Verdict.GRANTED, ask, live[0])
    return Judgement(Verdict.ASK, ask)


def granted_rules(rules: Rules, method: str | None) -> Rules:
    """The rules a granted request is decided again with: the askable steps
    (allow, deny, methods, request rules) open for it; every other check
    (public addresses, ports, internal names, the proxy's own host) as before."""
    methods = rules.methods | {method.upper()} if method else rules.methods
    return replace(rules, allow=None, deny=HostMatcher(), methods=methods, request_rules=RuleSet(),
                   action="enforce")


def scoped(ask: Ask, scope: str | None) -> tuple[str | None, str | None]:
    """(method, path) of a grant or denial for `ask` in `scope` ("host",
    "path", None: the ask's own level). ValueError if the ask has no path."""
    if scope is None:
        scope = "path" if ask.key.path else "host"
    if scope == "host":
        return None, None
    if scope != "path":
        raise ValueError(f"scope must be host or path, not {scope!r}")
    if not ask.path:
        raise ValueError(f"approval request {ask.id} has no path (a tunnel or a dial); grant it with --scope host")
    return ask.method or None, ask.path
