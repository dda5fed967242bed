"""sluice.policy.clients.match_client: users, sources, require_client."""

from __future__ import annotations

import hashlib

import pytest

from sluice.policy.clients import match_client, verify_password
from sluice.policy.loader import hash_password, load_policy_text

# Few iterations: these tests check matching, not the cost of the hash.
ALICE = hash_password("alice-pw", iterations=10_000, salt=b"a" * 16)
BOB_SHA = hash_password("bob-pw", iterations=10_000, salt=b"b" * 16)


def policy(extra: str = "", require: bool = False):
    text = f"""\
version: 1
methods: [GET, HEAD, POST, CONNECT]
require_client: {'true' if require else 'false'}
clients:
  - name: lab
    sources: [10.0.0.0/8, "fd00::/8"]
    methods: [GET]
  - name: lab-gpu
    sources: [10.1.0.0/16]
    methods: [GET, HEAD]
  - name: one-box
    # ::ffff:0:0/96 proves IPv4-mapped sources are read as IPv4 (else it would win at /96)
    sources: [10.1.2.3/32, "::ffff:0:0/96"]
    methods: [HEAD]
  - name: agents
    users:
      alice: {{password_hash: "{ALICE}"}}
      bob: {{password_hash: "{BOB_SHA}"}}
    methods: [POST]
{extra}"""
    return load_policy_text(text, "p.yaml")


@pytest.fixture(scope="module")
def p():
    return policy()


def test_a_user_with_the_right_password_gets_their_profile(p):
    m = match_client(p, "192.0.2.7", "alice", "alice-pw")
    assert m.profile == "agents" and m.refusal is None and m.rules.methods == {"POST"}
    assert match_client(p, None, "bob", "bob-pw").profile == "agents"


@pytest.mark.parametrize(("user", "password"),
                         [("alice", "wrong"), ("alice", ""), ("alice", None), ("mallory", "x"), ("", "")])
def test_wrong_or_unknown_credentials_are_refused_with_407(p, user, password):
    m = match_client(p, "10.1.2.3", user, password)
    assert m.profile is None
    assert m.refusal is not None and m.refusal.reason == "client_unknown" and m.refusal.status == 407
    assert "credentials were not accepted" in m.refusal.detail


def test_wrong_credentials_never_fall_back_to_the_source_profile(p):
    # 10.1.2.3 would match `one-box` by source; a bad password still refuses
    assert match_client(p, "10.1.2.3", "alice", "nope").refusal is not None


def test_username_wins_over_source(p):
    assert match_client(p, "10.1.2.3", "alice", "alice-pw").profile == "agents"


@pytest.mark.parametrize(
    ("source", "profile"),
    [
        ("10.200.0.1", "lab"),
        ("10.1.9.9", "lab-gpu"),  # /16 beats /8
        ("10.1.2.3", "one-box"),  # /32 beats both
        ("fd12::1", "lab"),
        ("::ffff:10.1.9.9", "lab-gpu"),  # a dual-stack listener's view of an IPv4 client
        ("::ffff:10.1.2.3", "one-box"),
        ("fd00::1%eth0", "lab"),  # zone ids are not part of the address
        ("192.0.2.1", None),
        ("2001:db8::1", None),
    ],
)
def test_source_cidr_most_specific_wins(p, source, profile):
    m = match_client(p, source)
    assert m.profile == profile and m.refusal is None
    if profile is None:
        assert m.rules is p.rules


def test_no_source_and_no_user_gets_the_top_level(p):
    m = match_client(p, None)
    assert m.profile is None and m.refusal is None and m.rules is p.rules


def test_require_client_refuses_the_unmatched():
    p = policy(require=True)
    m = match_client(p, "192.0.2.1")
    assert m.refusal.reason == "client_unknown" and m.refusal.status == 407
    assert "serves only known clients" in m.refusal.detail
    assert match_client(p, None).refusal is not None
    assert match_client(p, "10.0.0.1").profile == "lab"
    assert match_client(p, None, "alice", "alice-pw").profile == "agents"


def test_verify_is_injectable():
    calls = []

    def verify(verifier, password):
        calls.append((verifier, password))
        return password == "let-me-in"

    p = policy()
    assert match_client(p, None, "alice", "let-me-in", verify=verify).profile == "agents"
    assert calls == [(ALICE, "let-me-in")]


def test_verify_password_formats():
    assert verify_password(ALICE, "alice-pw") and not verify_password(ALICE, "alice-pw ")
    assert verify_password(BOB_SHA, "bob-pw") and not verify_password(BOB_SHA, "bob")
    # Unsalted sha256: verifiers are no longer a format at all.
    unsalted = "sha256:" + hashlib.sha256(b"bob-pw").hexdigest()
    for bad in ("", "plain", "md5$1$00$00", "pbkdf2_sha256$10000$00", unsalted):
        assert not verify_password(bad, "x")


def test_credentials_are_ignored_when_the_policy_defines_no_users():
    from sluice.policy.loader import load_policy_text

    plain = load_policy_text("version: 1\nclients:\n  - name: net\n    sources: [10.0.0.0/8]\n")
    m = match_client(plain, "10.1.2.3", "someone", "anything")
    assert m.refusal is None and m.profile == "net"
    assert match_client(plain, "8.8.8.8", "someone", "x").refusal is None


def test_profile_lookup_by_name():
    p = policy()
    assert p.profile("lab-gpu").rules.methods == frozenset({"GET", "HEAD"})
    assert p.profile("lab").name == "lab"  # a name that prefixes another still finds itself
    assert p.profile("nobody") is None
    assert p.profile("LAB") is None  # names are exact
