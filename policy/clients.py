"""Which client profile's rules apply to a client: a pure function.

A client is matched by its proxy username (Proxy-Authorization Basic, or
SOCKS5 username/password, checked against the profile's verifier) or else by
its source address (the most specific `sources` CIDR wins). Wrong credentials never fall back to another
profile. An unmatched client gets the top-level rules, unless
`require_client` is set, which refuses it with 407.

`identify` decides everything but the password hash and says which verifier
applies (`PasswordCheck`); `checked` finishes the match once the edge has the
hash's answer. `match_client` does both in one call.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import os
from collections.abc import Callable
from dataclasses import dataclass

import netaddr

from sluice.policy.model import ClientProfile, Policy, Rules
from sluice.policy.quotas import STORE_DOWN_RETRY_AFTER
from sluice.policy.reasons import Reason, Refusal


@dataclass(frozen=True, slots=True)
class ClientMatch:
    rules: Rules
    profile: str | None  # None: the top-level policy
    refusal: Refusal | None = None  # set when the client must be refused (407)


# How a client can name itself, for the message that asks it to.
VIA_HTTP = "http"  # Proxy-Authorization (the HTTP proxy port)
VIA_SOCKS5 = "socks5"  # SOCKS5 username/password (RFC 1929)
VIA_SOURCE = "source"  # nothing but its source address (transparent mode)

_KNOWN_CLIENTS_ONLY = {
    VIA_HTTP: "this proxy serves only known clients; authenticate with the username and password you were given "
              "(Proxy-Authorization)",
    VIA_SOCKS5: "this proxy serves only known clients; authenticate with the username and password you were given "
                "(SOCKS5 username/password authentication, e.g. socks5h://USER:PASSWORD@proxy:port)",
    VIA_SOURCE: "this proxy serves only known clients, and this connection's source address matches no client "
                "profile (a transparently redirected connection is known by its source address only)",
}

# A password_file's secret is kept only as an HMAC-SHA256 under this key,
# made when the process starts and never written anywhere: no verifier a
# policy file could hold matches it, and the file itself is what must be
# protected. (Policy files take only salted, slow `pbkdf2_sha256` hashes.)
_SECRET_KEY = os.urandom(32)
SECRET_PREFIX = "secret-hmac$"


def secret_verifier(secret: str) -> str:
    """The in-memory verifier of a `password_file` secret."""
    return SECRET_PREFIX + hmac.new(_SECRET_KEY, secret.encode(), hashlib.sha256).hexdigest()


def verify_password(verifier: str, password: str) -> bool:
    """Constant-time check of a password against a verifier: a
    `pbkdf2_sha256$...` password_hash, or a password_file's secret_verifier."""
    if verifier.startswith(SECRET_PREFIX):
        digest = hmac.new(_SECRET_KEY, password.encode(), hashlib.sha256).hexdigest()
        return hmac.compare_digest(digest, verifier[len(SECRET_PREFIX):])
    parts = verifier.split("$")
    if len(parts) != 4 or parts[0] != "pbkdf2_sha256":
        return False
    _, iterations, salt, expected = parts
    derived = hashlib.pbkdf2_hmac("sha256", password.encode(), bytes.fromhex(salt), int(iterations))
    return hmac.compare_digest(derived.hex(), expected)


@functools.lru_cache(maxsize=4096)  # a pure function of the text; every request of a connection asks it again
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
    slow hash off its event loop and throttle guessers (sluice/identity.py)."""

    username: str
    verifier: str | None  # None: no such user, so no password is right (nothing to hash)
    profile: ClientProfile | None


def identify(
    policy: Policy, source: str | None, username: str | None = None, password: str | None = None,
    via: str = VIA_HTTP,
) -> ClientMatch | PasswordCheck:
    """Everything that decides the client without hashing: a ClientMatch, or
    the PasswordCheck whose result `checked` turns into one. `via` is how the
    client could have named itself (VIA_HTTP, VIA_SOCKS5, VIA_SOURCE): what
    a `require_client` refusal tells it to do.

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
            Reason.CLIENT_UNKNOWN, _KNOWN_CLIENTS_ONLY.get(via, _KNOWN_CLIENTS_ONLY[VIA_HTTP]),
            note=policy.rules.refusal_note))
    return ClientMatch(policy.rules, None)


def profile_match(policy: Policy, name: str | None) -> ClientMatch:
    """The client already identified as profile `name` (None: the top level),
    with the rules the policy has for it now; refused if it is gone."""
    if name is None:
        return ClientMatch(policy.rules, None)
    profile = policy.profile(name)
    if profile is not None:
        return ClientMatch(profile.rules, profile.name)
    return ClientMatch(policy.rules, None, Refusal(
        Reason.CLIENT_UNKNOWN, f"this connection's client profile {name!r} is no longer in the policy; reconnect",
        note=policy.rules.refusal_note))


@dataclass(frozen=True, slots=True)
class ClientIdentity:
    """Who an open connection's client proved to be when it was matched: its
    source address, and the username and verifier its password passed (only
    when the policy had users). Enough to match it again against a reloaded
    policy without its password (`rematch`)."""

    source: str | None
    username: str | None = None
    verifier: str | None = None
    via: str = VIA_HTTP


def identity_of(policy: Policy, source: str | None, username: str | None, via: str = VIA_HTTP) -> ClientIdentity:
    """The identity of a client that `policy` just matched (its password, if
    any, was right), for `rematch` after a reload."""
    if username is None or not any(profile.credentials for profile in policy.clients):
        return ClientIdentity(source, None, None, via)
    found = _profile_for_user(policy, username)
    return ClientIdentity(source, username, found[1] if found else None, via)


def rematch(policy: Policy, identity: ClientIdentity) -> ClientMatch:
    """The client of an open connection matched against a reloaded policy, as
    a new request with the same credentials would be: a user is matched only
    while the policy still lists that username with the same verifier (a
    changed or removed password no longer proves anything: wrong
    credentials); else by source address, else the top level (refused with
    `require_client`)."""
    if identity.username is not None and any(profile.credentials for profile in policy.clients):
        found = _profile_for_user(policy, identity.username)
        if found is None or identity.verifier is None or not hmac.compare_digest(found[1], identity.verifier):
            return _wrong_credentials(policy)
        return ClientMatch(found[0].rules, found[0].name)
    step = identify(policy, identity.source, None, None, identity.via)
    assert isinstance(step, ClientMatch)  # no username: no password to check
    return step


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
        retry_after=retry_after, note=policy.rules.refusal_note))


def throttle_store_down(policy: Policy) -> ClientMatch:
    """Refused without checking the password: the throttle of wrong passwords
    lives in the shared store, which is down, and `state.on_error` is
    `closed`. A password already accepted by this process never gets here."""
    return ClientMatch(policy.rules, None, Refusal(
        Reason.STATE_STORE_UNAVAILABLE,
        "the proxy's shared limit store is unreachable, so this proxy password cannot be checked against the shared "
        "throttle of wrong passwords, and the policy refuses such checks until the store is back "
        "(state.on_error: closed)",
        retry_after=STORE_DOWN_RETRY_AFTER, note=policy.rules.refusal_note))


def _wrong_credentials(policy: Policy) -> ClientMatch:
    return ClientMatch(policy.rules, None, Refusal(
        Reason.CLIENT_UNKNOWN,
        "the proxy credentials were not accepted; check the username and password your proxy URL carries",
        note=policy.rules.refusal_note))


def match_client(
    policy: Policy,
    source: str | None,
    username: str | None = None,
    password: str | None = None,
    verify: Callable[[str, str], bool] = verify_password,
    via: str = VIA_HTTP,
) -> ClientMatch:
    """`identify`, then `verify(verifier, password) -> bool` if a password
    decides: the whole match in one synchronous call (CLI, tests)."""
    step = identify(policy, source, username, password, via)
    if isinstance(step, PasswordCheck):
        # identify() asks for a password check only when a password was given.
        return checked(policy, step, step.verifier is not None and password is not None
                       and verify(step.verifier, password))
    return step
