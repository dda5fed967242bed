"""Which client profile's rules apply to a client: a pure function.

A client is matched by its proxy username (Proxy-Authorization Basic, checked
against the profile's verifier) or else by its source address (the most
specific `sources` CIDR wins). Wrong credentials never fall back to another
profile. An unmatched client gets the top-level rules, unless
`require_client` is set, which refuses it with 407.

`identify` decides everything but the password hash and says which verifier
applies (`PasswordCheck`); `checked` finishes the match once the edge has the
hash's answer. `match_client` does both in one call.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

import netaddr

from policy.model import ClientProfile, Policy, Rules
from policy.reasons import Reason, Refusal


@dataclass(frozen=True, slots=True)
class ClientMatch:
    rules: Rules
    profile: str | None  # None: the top-level policy
    refusal: Refusal | None = None  # set when the client must be refused (407)


def verify_password(verifier: str, password: str) -> bool:
    """Constant-time check of a password against a `password_hash` verifier."""
    if verifier.startswith("sha256:"):
        digest = hashlib.sha256(password.encode()).hexdigest()
        return hmac.compare_digest(digest, verifier[7:])
    parts = verifier.split("$")
    if len(parts) != 4 or parts[0] != "pbkdf2_sha256":
        return False
    _, iterations, salt, expected = parts
    digest = hashlib.pbkdf2_hmac("sha256", password.encode(), bytes.fromhex(salt), int(iterations))
    return hmac.compare_digest(digest.hex(), expected)


def _source_address(source: str) -> netaddr.IPAddress:
    """The client's address as its profile CIDRs are written: a dual-stack
    listener reports IPv4 clients as ::ffff:a.b.c.d, and a link-local peer
    may carry a zone id (fe80::1%eth0)."""
    ip = netaddr.IPAddress(source.split("%", 1)[0])
    if ip.version == 6 and ip.is_ipv4_mapped():
        ip = ip.ipv4()
    return ip


def _profile_for_user(policy: Policy, username: str) -> tuple[ClientProfile, str] | None:
    for profile in policy.clients:
        for user, verifier in profile.credentials:
            if user == username:
                return profile, verifier
    return None


@dataclass(frozen=True, slots=True)
class PasswordCheck:
    """A password the edge must check before the client is matched: which
    verifier applies. Kept apart from `verify_password` so the edge can run the
    slow hash off its event loop and throttle guessers (addons/identity.py)."""

    username: str
    verifier: str | None  # None: no such user, so no password is right (nothing to hash)
    profile: ClientProfile | None


def identify(
    policy: Policy, source: str | None, username: str | None = None, password: str | None = None,
) -> ClientMatch | PasswordCheck:
    """Everything that decides the client without hashing: a ClientMatch, or
    the PasswordCheck whose result `checked` turns into one.

    Credentials count only when the policy defines users: an agent whose proxy
    URL carries a habitual user:pass is not refused by a policy without users."""
    if username is not None and any(profile.credentials for profile in policy.clients):
        if password is None:
            return _wrong_credentials(policy)
        found = _profile_for_user(policy, username)
        if found is None:
            return PasswordCheck(username, None, None)
        return PasswordCheck(username, found[1], found[0])
    if source is not None:
        best: tuple[int, ClientProfile] | None = None
        ip = _source_address(source)
        for profile in policy.clients:
            if not profile.sources:
                continue
            entry = profile.sources.match_entry(int(ip), ip.version)
            if entry is not None and (best is None or entry.prefixlen > best[0]):
                best = (entry.prefixlen, profile)
        if best is not None:
            return ClientMatch(best[1].rules, best[1].name)
    if policy.require_client:
        return ClientMatch(policy.rules, None, Refusal(
            Reason.CLIENT_UNKNOWN, "this proxy serves only known clients; authenticate with the username and password you were given (Proxy-Authorization)"))
    return ClientMatch(policy.rules, None)


def checked(policy: Policy, check: PasswordCheck, ok: bool) -> ClientMatch:
    """The client once its password check came out `ok` or not."""
    if ok and check.profile is not None:
        return ClientMatch(check.profile.rules, check.profile.name)
    return _wrong_credentials(policy)


def throttled(policy: Policy, retry_after: int, busy: bool = False) -> ClientMatch:
    """Refused without checking the password: too many wrong ones from this
    address or for this user, or (`busy`) too many checks already waiting."""
    why = ("the proxy is busy checking other proxy passwords" if busy else
           "too many wrong proxy passwords came from this address or for this username")
    return ClientMatch(policy.rules, None, Refusal(
        Reason.AUTH_THROTTLED,
        f"{why}; wait {retry_after} s (Retry-After) and retry once with the username and password your proxy URL "
        "carries, and check them if this repeats",
        retry_after=retry_after))


def _wrong_credentials(policy: Policy) -> ClientMatch:
    return ClientMatch(policy.rules, None, Refusal(
        Reason.CLIENT_UNKNOWN, "the proxy credentials were not accepted; check the username and password your proxy URL carries"))


def match_client(
    policy: Policy,
    source: str | None,
    username: str | None = None,
    password: str | None = None,
    verify=verify_password,
) -> ClientMatch:
    """`identify`, then `verify(verifier, password) -> bool` if a password
    decides: the whole match in one synchronous call (CLI, tests)."""
    step = identify(policy, source, username, password)
    if isinstance(step, PasswordCheck):
        return checked(policy, step, step.verifier is not None and verify(step.verifier, password))
    return step
