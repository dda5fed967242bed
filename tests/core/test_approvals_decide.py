"""Approvals (issue 22), the pure part: the `approvals` block's loader and
judge(), the decision over a refusal and the grants and denials in force."""

from __future__ import annotations

import itertools

import pytest

from sluice.policy.approvals import (
    ASKABLE, RETRY_AFTER, ApprovalSettings, AskKey, Grant, Requester, Verdict, ask_id, granted_rules, judge, scoped,
)
from sluice.policy.decide import HOSTILE_PATH_ADVICE, Destination, check_request
from sluice.policy.loader import PolicyInvalid, load_policy_text
from sluice.policy.reasons import Reason, Refusal

SETTINGS = ApprovalSettings(ask=frozenset(ASKABLE))
NOW = 1_000_000.0
NOT_ALLOWED = Refusal(Reason.HOST_NOT_ALLOWED, "api.example is not on this policy's allow list")
RULE = Refusal(Reason.RULE_DENIED, "DELETE /x on api.example is denied by the rule at p.yaml:3", "p.yaml:3")


def who(profile="ci", user="alice", host="api.example", method="GET", target="/a/b?q=1"):
    return Requester(profile, user, host, method, target)


def grant(host="api.example", *, profile="ci", user="alice", method=None, path=None, expires=NOW + 60, denied=False):
    return Grant("g1", profile, user, host, method, path, expires, denied)


# ---- which refusals are askable --------------------------------------------------


@pytest.mark.parametrize("reason", list(Reason))
def test_only_the_listed_askable_reasons_are_judged(reason):
    refusal = Refusal(reason, "x")
    judged = judge(SETTINGS, refusal, who(), [], NOW)
    assert (judged is not None) == (reason in ASKABLE)


def test_a_reason_not_in_ask_is_not_judged_and_no_settings_means_none():
    only_rules = ApprovalSettings(ask=frozenset({Reason.RULE_DENIED}))
    assert judge(only_rules, NOT_ALLOWED, who(), [grant()], NOW) is None
    assert judge(None, NOT_ALLOWED, who(), [grant()], NOW) is None
    assert judge(SETTINGS, None, who(), [grant()], NOW) is None


def test_a_hostile_path_spelling_is_not_askable_the_agent_fixes_it():
    hostile = Refusal(Reason.RULE_DENIED, "the path contains %2F", "p.yaml:3", advice=HOSTILE_PATH_ADVICE)
    assert judge(SETTINGS, hostile, who(), [], NOW) is None


# ---- asks ---------------------------------------------------------------------------


def test_an_ask_is_pending_with_a_request_id_and_retry_after():
    judged = judge(SETTINGS, NOT_ALLOWED, who(), [], NOW)
    assert judged is not None and judged.verdict is Verdict.ASK
    refusal = judged.refusal(NOT_ALLOWED)
    assert refusal.reason is Reason.APPROVAL_PENDING and refusal.status == 403
    assert refusal.retry_after == RETRY_AFTER
    assert judged.ask.id in refusal.message and "wait" in refusal.message and "Retry after" in refusal.message
    assert (judged.ask.method, judged.ask.path, judged.ask.reason) == ("GET", "/a/b", "host_not_allowed")


def test_identical_host_level_asks_share_an_id_whatever_the_path_or_method():
    ids = {judge(SETTINGS, NOT_ALLOWED, who(method=m, target=t), [], NOW).ask.id
           for m, t in itertools.product(["GET", "POST"], ["/a", "/b?x", None])}
    assert len(ids) == 1


def test_path_level_asks_are_keyed_by_method_and_normalised_path():
    a = judge(SETTINGS, RULE, who(method="DELETE", target="/x/./y?z=1"), [], NOW).ask
    b = judge(SETTINGS, RULE, who(method="delete", target="/x//y"), [], NOW).ask
    c = judge(SETTINGS, RULE, who(method="DELETE", target="/x/z"), [], NOW).ask
    d = judge(SETTINGS, RULE, who(method="POST", target="/x/y"), [], NOW).ask
    assert a.id == b.id and len({a.id, c.id, d.id}) == 3
    assert a.key == AskKey("ci", "alice", "api.example", "DELETE", "/x/y")


@pytest.mark.parametrize("field,value", [("profile", "other"), ("profile", None), ("user", "bob"), ("user", None),
                                         ("host", "b.example")])
def test_asks_from_another_client_or_host_get_another_id(field, value):
    base = judge(SETTINGS, NOT_ALLOWED, who(), [], NOW).ask.id
    other = judge(SETTINGS, NOT_ALLOWED, who(**{field: value}), [], NOW).ask.id
    assert other != base


def test_ask_id_is_stable_across_processes():
    assert ask_id(AskKey("ci", "", "api.example", "", "")) == ask_id(AskKey("ci", "", "api.example", "", ""))
    assert len(ask_id(AskKey("", "", "h", "", ""))) == 12


# ---- grants -------------------------------------------------------------------------


def test_a_host_grant_covers_every_method_and_path_on_that_host():
    for method, target in [("GET", "/"), ("POST", "/z"), (None, None)]:
        judged = judge(SETTINGS, NOT_ALLOWED, who(method=method, target=target), [grant()], NOW)
        assert judged.verdict is Verdict.GRANTED and judged.grant.id == "g1"
    judged = judge(SETTINGS, RULE, who(method="DELETE", target="/x"), [grant()], NOW)
    assert judged.verdict is Verdict.GRANTED


def test_a_path_grant_covers_that_method_and_path_only():
    path_grant = grant(method="DELETE", path="/x/y")
    assert judge(SETTINGS, RULE, who(method="DELETE", target="/x/y?a"), [path_grant], NOW).verdict is Verdict.GRANTED
    assert judge(SETTINGS, RULE, who(method="DELETE", target="/x/z"), [path_grant], NOW).verdict is Verdict.ASK
    assert judge(SETTINGS, RULE, who(method="GET", target="/x/y"), [path_grant], NOW).verdict is Verdict.ASK
    prefix = grant(method="DELETE", path="/x/*")
    assert judge(SETTINGS, RULE, who(method="DELETE", target="/x/z/w"), [prefix], NOW).verdict is Verdict.GRANTED
    assert judge(SETTINGS, RULE, who(method="DELETE", target="/y"), [prefix], NOW).verdict is Verdict.ASK


def test_a_grant_is_scoped_to_its_host_profile_and_user():
    assert judge(SETTINGS, NOT_ALLOWED, who(host="b.example"), [grant()], NOW).verdict is Verdict.ASK
    assert judge(SETTINGS, NOT_ALLOWED, who(profile="other"), [grant()], NOW).verdict is Verdict.ASK
    assert judge(SETTINGS, NOT_ALLOWED, who(profile=None), [grant()], NOW).verdict is Verdict.ASK
    assert judge(SETTINGS, NOT_ALLOWED, who(user="bob"), [grant()], NOW).verdict is Verdict.ASK
    # A grant without a user (the ask had none) covers the profile's every user.
    assert judge(SETTINGS, NOT_ALLOWED, who(user="bob"), [grant(user="")], NOW).verdict is Verdict.GRANTED


def test_an_expired_grant_or_denial_is_ignored():
    assert judge(SETTINGS, NOT_ALLOWED, who(), [grant(expires=NOW)], NOW).verdict is Verdict.ASK
    assert judge(SETTINGS, NOT_ALLOWED, who(), [grant(expires=NOW - 1, denied=True)], NOW).verdict is Verdict.ASK
    assert judge(SETTINGS, NOT_ALLOWED, who(), [grant(expires=NOW + 0.001)], NOW).verdict is Verdict.GRANTED


# ---- denials ------------------------------------------------------------------------


def test_a_denial_is_remembered_and_refuses_as_before():
    judged = judge(SETTINGS, NOT_ALLOWED, who(), [grant(denied=True)], NOW)
    assert judged.verdict is Verdict.DENIED
    refusal = judged.refusal(NOT_ALLOWED)
    assert refusal.reason is Reason.HOST_NOT_ALLOWED and refusal.retry_after is None
    assert "denied" in refusal.message and "g1" in refusal.message


def test_a_denial_wins_over_a_grant():
    both = [grant(), grant(denied=True)]
    assert judge(SETTINGS, NOT_ALLOWED, who(), both, NOW).verdict is Verdict.DENIED
    assert judge(SETTINGS, NOT_ALLOWED, who(), list(reversed(both)), NOW).verdict is Verdict.DENIED


# ---- what a grant opens, and scopes ---------------------------------------------------


def _rules(text):
    return load_policy_text("version: 1\n" + text).rules


def test_granted_rules_open_the_askable_steps_and_nothing_else():
    rules = _rules("allow: [a.example]\ndeny: [d.example]\nmethods: [GET]\n")
    for host, method in [("b.example", "GET"), ("d.example", "GET"), ("a.example", "PROPFIND")]:
        assert not check_request(rules, Destination(host, 443, "https", method, target="/")).allowed
        assert check_request(granted_rules(rules, method), Destination(host, 443, "https", method,
                                                                        target="/")).allowed
    opened = granted_rules(rules, "GET")
    for dest, reason in [(Destination("10.0.0.1", 443, "https", "GET", target="/"), Reason.ADDRESS_NOT_PUBLIC),
                         (Destination("b.example", 8443, "https", "GET", target="/"), Reason.PORT_NOT_ALLOWED),
                         (Destination("db.internal", 443, "https", "GET", target="/"), Reason.INTERNAL_HOSTNAME)]:
        assert check_request(opened, dest).refusal.reason is reason


def test_scoped_defaults_to_the_asks_level_and_refuses_a_path_scope_without_a_path():
    host_ask = judge(SETTINGS, NOT_ALLOWED, who(method="POST", target="/p?q"), [], NOW).ask
    rule_ask = judge(SETTINGS, RULE, who(method="DELETE", target="/x"), [], NOW).ask
    connect_ask = judge(SETTINGS, NOT_ALLOWED, who(method="CONNECT", target=None), [], NOW).ask
    assert scoped(host_ask, None) == (None, None)
    assert scoped(host_ask, "path") == ("POST", "/p")
    assert scoped(rule_ask, None) == ("DELETE", "/x")
    assert scoped(rule_ask, "host") == (None, None)
    with pytest.raises(ValueError, match="--scope host"):
        scoped(connect_ask, "path")
    with pytest.raises(ValueError, match="host or path"):
        scoped(host_ask, "everything")


# ---- the loader -------------------------------------------------------------------


def test_the_block_loads_at_the_top_and_a_profile_overrides_its_keys():
    policy = load_policy_text("""\
version: 1
allow: [a.example]
approvals:
  ask: [host_not_allowed, rule_denied]
  grant_for: 1h
  wait: 2s
  notify: {webhook: "https://hooks.example.com/sluice", secret: {env: HOOK}}
clients:
  - name: ci
    sources: [10.1.0.0/16]
    approvals: {grant_for: 10m, ask: [method_not_allowed]}
  - name: quiet
    sources: [10.2.0.0/16]
    approvals: null
""", environ={"HOOK": "s3cret"})
    top = policy.rules.approvals
    assert top.ask == {Reason.HOST_NOT_ALLOWED, Reason.RULE_DENIED} and (top.grant_for, top.wait) == (3600, 2)
    assert top.notify.webhook == "https://hooks.example.com/sluice" and top.notify.secret.reveal() == "s3cret"
    ci = policy.clients[0].rules.approvals
    assert ci.ask == {Reason.METHOD_NOT_ALLOWED} and ci.grant_for == 600 and ci.wait == 2 and ci.notify == top.notify
    assert policy.clients[1].rules.approvals is None


@pytest.mark.parametrize("block,message", [
    ("{ask: [address_not_public]}", "'address_not_public' is never askable: the destination is outside the public"),
    ("{ask: [port_not_allowed]}", "never askable: ports are opened"),
    ("{ask: [rate_limited]}", "never askable: only host, method and request-rule refusals"),
    ("{ask: [nope]}", "never askable: it is not a reason code"),
    ("{grant_for: 1h}", "approvals needs `ask`"),
    ("{ask: [host_denied], grant_for: 0s}", "approvals.grant_for: a duration must be greater than zero"),
    ("{ask: [host_denied], wait: 1h}", "approvals.wait is at most 300s"),
    ("{ask: [host_denied], wait: soon}", "approvals.wait: 'soon' is not a duration"),
    ("{ask: [host_denied], expire: 1h}", "expire"),
    ("{ask: [host_denied], notify: {webhook: 'ftp://x/'}}", "approvals.notify needs secret"),
    ("{ask: [host_denied], notify: {webhook: 'ftp://x/', secret: {env: H}}}", "must be an http(s) URL with a host"),
    ("{ask: [host_denied], notify: {webhook: 'https://u:p@x/', secret: {env: H}}}", "must not carry user:password@"),
    ("{ask: [host_denied], notify: {webhook: 'https://x/', secret: {env: H, file: f}}}", "exactly one of file"),
    ("{ask: [host_denied], notify: {webhook: 'https://x/', secret: 's3cret'}}", "must be a mapping"),
    ("{ask: [host_denied], notify: {webhook: 'https://x/', secret: {env: UNSET}}}", "'UNSET' is not set"),
    ("{ask: [host_denied], notify: {webhook: 'https://x/', secret: {file: /nonexistent/k}}}",
     "approvals.notify.secret: cannot read '/nonexistent/k'"),
])
def test_bad_blocks_are_clear_problems_with_a_position(block, message):
    def read_secret(path):
        with open(path) as f:
            return f.read()
    with pytest.raises(PolicyInvalid) as e:
        load_policy_text(f"version: 1\napprovals: {block}\n", "p.yaml", read_secret=read_secret, environ={"H": "k"})
    text = str(e.value)
    assert message in text and text.startswith("p.yaml:2:"), text


def test_policy_check_summary_shows_the_block_and_never_the_secret():
    from sluice.policy_cli import summarise

    policy = load_policy_text("""\
version: 1
approvals:
  ask: [host_denied]
  wait: 5s
  notify: {webhook: "https://hooks.example.com/s", secret: {env: HOOK}}
""", "p.yaml", environ={"HOOK": "very-secret-value"})
    text = "\n".join(summarise(policy))
    assert "approvals: asks an operator about host_denied (p.yaml:3)" in text, text
    assert "grants last 1h" in text and "held up to 5s" in text
    assert "https://hooks.example.com/s" in text and "env HOOK" in text and "very-secret-value" not in text
