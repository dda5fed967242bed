"""A reload matches an open connection's client again (policy/clients.py
`rematch`, used by addons/gate.py `redecide` for tunnels and pipes): the
user it proved to be, or its source address, against the new profiles."""

from __future__ import annotations

from sluice.addons.gate import redecide
from sluice.outcome import Outcome
from sluice.policy.clients import identity_of, rematch
from sluice.policy.decide import Decision
from sluice.policy.loader import hash_password, load_policy_text

HASH = hash_password("pw-a", iterations=10_000)
OTHER_HASH = hash_password("pw-b", iterations=10_000)


def policy(alice_in: str | None, lab_in: str = "plain", alice_hash: str = HASH, require_client: bool = True):
    profiles = {"holders": [], "plain": []}
    if alice_in:
        profiles[alice_in].append(f"    users: {{alice: {{password_hash: '{alice_hash}'}}}}")
    profiles[lab_in].append("    sources: [127.0.0.2/32]")
    text = f"version: 1\nrequire_client: {'true' if require_client else 'false'}\nclients:\n"
    for name in ("holders", "plain"):
        members = profiles[name] or ["    users: {bob: {password_hash: '" + OTHER_HASH + "'}}"]
        ports = 443 if name == 'holders' else '443, 8443'
        text += f"  - name: {name}\n" + "\n".join(members) + f"\n    ports: [{ports}]\n"
    return load_policy_text(text)


def test_a_user_is_matched_again_by_username_and_verifier():
    before = policy("holders")
    who = identity_of(before, "127.0.0.1", "alice")
    assert rematch(before, who).profile == "holders"
    assert rematch(policy("plain"), who).profile == "plain"  # moved
    # removed (wrong credentials, as a new request)
    assert rematch(policy(None), who).refusal.reason == "client_unknown"
    assert rematch(policy("holders", alice_hash=OTHER_HASH), who).refusal.reason == "client_unknown"  # password changed


def test_a_source_is_matched_again_by_address():
    before = policy("holders", lab_in="holders")
    who = identity_of(before, "127.0.0.2", None)
    assert rematch(before, who).profile == "holders"
    assert rematch(policy("holders", lab_in="plain"), who).profile == "plain"
    stranger = identity_of(before, "127.0.0.9", None)
    assert rematch(before, stranger).refusal.reason == "client_unknown"  # require_client
    assert rematch(policy("holders", require_client=False), stranger).profile is None  # the top level


def test_redecide_moves_a_tunnel_or_refuses_it():
    before = policy("holders")
    tunnel = Outcome("8.8.8.8", 8443, Decision(True, address="8.8.8.8", addresses=("8.8.8.8",)), "holders", None)
    tunnel.identity = identity_of(before, "127.0.0.1", "alice")
    # holders has port 443 only: had the tunnel stayed there, 8443 would be refused; in plain it is allowed.
    assert redecide(policy("plain"), tunnel) is None and tunnel.profile == "plain" and 8443 in tunnel.rules.ports
    refusal = redecide(policy("holders"), tunnel)  # back to holders: its ports refuse 8443
    # a refused tunnel keeps its line's profile
    assert refusal.reason == "port_not_allowed" and tunnel.profile == "plain"
    refusal = redecide(policy(None), tunnel)
    assert refusal.reason == "client_unknown" and "matches no client profile" in refusal.detail
