"""Request rules (issue 21): the loader, path normalisation, the matcher, the
hostile-spelling refusal, the host index and the decision they feed."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings, strategies as st

from sluice.policy.decide import Destination, check_answers, check_request
from sluice.policy.hosts import parse_host
from sluice.policy.loader import PolicyInvalid, load_policy_text
from sluice.policy.reasons import Reason
from sluice.policy.request_rules import (
    PathPattern,
    PathPatternError,
    hostile_spelling,
    normalise_path,
    rule_warnings,
)

GITHUB = """\
version: 1
intercept: [api.github.com]
rules:
  - deny:  {hosts: [api.github.com], methods: [DELETE]}
  - allow: {hosts: [api.github.com], methods: [GET, HEAD], paths: ["/repos/acme/**", "/user"]}
  - allow: {hosts: [api.github.com], methods: [POST], paths: ["/repos/acme/*/issues"]}
  - deny:  {hosts: [api.github.com]}          # the rest of this host
"""


def decide(policy_text: str, method: str | None, url_host: str, target: str | None, *, profile: str | None = None,
           scheme: str | None = "https", port: int = 443, answers=("140.82.112.6",)):
    policy = load_policy_text(policy_text, "p.yaml")
    rules = policy.rules if profile is None else next(p.rules for p in policy.clients if p.name == profile)
    d = check_request(rules, Destination(url_host, port, scheme, method, target=target))
    if d.needs_dns:
        d = check_answers(rules, d, answers)
    return d


# ---- normalisation ---------------------------------------------------------


@pytest.mark.parametrize("raw, normal", [
    ("/", "/"),
    ("/a/b", "/a/b"),
    ("/a/", "/a/"),
    ("//a///b", "/a/b"),
    ("/a/./b", "/a/b"),
    ("/a/b/../c", "/a/c"),
    ("/../../etc", "/etc"),
    ("/a/..", "/"),
    ("/a/b/..", "/a/"),
    ("/a/.", "/a/"),
    ("/%7Euser/%41%62", "/~user/Ab"),
    ("/a%2db%5Fc%2E", "/a-b_c."),
    ("/%2e./x", "/x"),  # a single encoded dot decodes, then resolves
    ("/a%3ab", "/a%3Ab"),  # reserved stays encoded, in upper case
    ("/a%20b", "/a%20b"),
    ("*", "*"),
])
def test_normalise_path(raw, normal):
    assert normalise_path(raw) == normal


SEGMENT = st.text(alphabet="ab.%2E7eA~-_", min_size=0, max_size=5)


@settings(max_examples=400, deadline=None)
@given(st.lists(SEGMENT, max_size=8), st.booleans())
def test_normalised_paths_are_fixed_points_without_dot_segments(segments, trailing):
    raw = "/" + "/".join(segments) + ("/" if trailing else "")
    normal = normalise_path(raw)
    assert normal.startswith("/")
    assert normalise_path(normal) == normal
    assert "//" not in normal
    assert not any(s in (".", "..") for s in normal.split("/"))


@pytest.mark.parametrize("path, what", [
    ("/a%2Fb", "encoded slash"), ("/a%2fb", "encoded slash"), ("/a%5cb", "encoded backslash"),
    ("/a/%2E%2E/b", "encoded dot-dot"), ("/a/%2e%2E/b", "encoded dot-dot"), ("/a\\b", "backslash"),
    ("/a;jsessionid=1", "semicolon"), ("/a/b;/c", "semicolon"),
])
def test_hostile_spellings(path, what):
    assert what in hostile_spelling(path)


@pytest.mark.parametrize("path", ["/a/b", "/a%20b", "/%7E", "/a/../b", "/a.b/c"])
def test_plain_spellings_are_not_hostile(path):
    assert hostile_spelling(path) is None


# ---- patterns --------------------------------------------------------------


@pytest.mark.parametrize("pattern, path, expected", [
    ("/user", "/user", True),
    ("/user", "/user/", False),  # `/a` does not match `/a/`
    ("/user/", "/user", False),
    ("/user", "/User", False),  # case-sensitive
    ("/repos/*", "/repos/x", True),
    ("/repos/*", "/repos/x/y", False),  # one segment
    ("/repos/*", "/repos/", False),  # one non-empty segment
    ("/repos/**", "/repos", True),  # any number, none included
    ("/repos/**", "/repos/", True),
    ("/repos/**", "/repos/a/b/c", True),
    ("/repos/**", "/reposx", False),
    ("/a/**/z", "/a/z", True),
    ("/a/**/z", "/a/b/c/z", True),
    ("/a/**/z", "/a/b/c/zz", False),
    ("/**", "/", True),
    ("/**", "/anything/at/all", True),
    ("/", "/", True),
    ("/", "/a", False),
    ("/files/*.txt", "/files/a.txt", True),
    ("/files/*.txt", "/files/a/b.txt", False),
    ("/files/*.txt", "/files/aXtxt", False),  # '.' is literal
    ("/a+b/(c)", "/a+b/(c)", True),  # regex characters are literal
])
def test_path_patterns(pattern, path, expected):
    assert PathPattern.compile(pattern).matches(path) is expected


@pytest.mark.parametrize("pattern, message", [
    ("repos", "must start with '/'"),
    ("/a?b=1", "no query"),
    ("/a%2Fb", "encoded slash"),
    ("/a;b", "semicolon"),
    ("/a//b", "not normalised"),
    ("/a/../b", "not normalised"),
    ("/%7Euser", "'/~user'"),
    ("/a**", "whole segment"),
    ("/a b", "spaces"),
    ("", "non-empty"),
])
def test_bad_path_patterns(pattern, message):
    with pytest.raises(PathPatternError, match=re.escape(message)):
        PathPattern.compile(pattern)


# ---- loading ---------------------------------------------------------------


def problems(text: str) -> list[str]:
    with pytest.raises(PolicyInvalid) as e:
        load_policy_text(text, "p.yaml")
    return [str(p) for p in e.value.problems]


def test_rules_load_with_file_and_line():
    policy = load_policy_text(GITHUB, "p.yaml")
    rules = policy.rules.request_rules.rules
    assert [(r.action, r.origin) for r in rules] == [("deny", "p.yaml:4"), ("allow", "p.yaml:5"), ("allow", "p.yaml:6"),
                                                     ("deny", "p.yaml:7")]
    assert rules[1].methods == {"GET", "HEAD"} and [p.text for p in rules[1].paths] == ["/repos/acme/**", "/user"]
    assert rules[3].host_only and not rules[0].host_only


def test_a_profiles_rules_replace_the_top_levels():
    text = GITHUB + """\
clients:
  - name: ci
    sources: [10.0.0.0/8]
    rules:
      - allow: {hosts: [api.github.com], methods: [DELETE], paths: ["/repos/acme/tmp-*"]}
  - name: inherits
    sources: [192.168.0.0/16]
"""
    policy = load_policy_text(text, "p.yaml")
    ci, inherits = policy.clients
    assert [r.origin for r in ci.rules.request_rules.rules] == ["p.yaml:12"]
    assert inherits.rules.request_rules is policy.rules.request_rules
    assert decide(text, "DELETE", "api.github.com", "/repos/acme/tmp-1", profile="ci").allowed
    assert not decide(text, "DELETE", "api.github.com", "/repos/acme/tmp-1", profile="inherits").allowed


@pytest.mark.parametrize("entry, message", [
    ("- allow: {methods: [GET]}", "needs `hosts`"),
    ("- allow: {hosts: [api.github.com]}\n    deny: {hosts: [x.example]}", "one of `allow"),
    ("- permit: {hosts: [api.github.com]}", "unknown key 'permit'"),
    ("- allow: {hosts: [api.github.com], verbs: [GET]}", "unknown key 'verbs'"),
    ("- allow: {hosts: [api.github.com], methods: [CONNECT]}", "CONNECT never reaches"),
    ("- allow: {hosts: [api.github.com], methods: [FETCH]}", "not a standard HTTP method"),
    ("- allow: {hosts: [api.github.com], methods: []}", "methods is empty"),
    ("- allow: {hosts: [api.github.com], paths: []}", "paths is empty"),
    ("- allow: {hosts: [api.github.com], paths: [repos]}", "must start with '/'"),
    ("- allow: {hosts: [api.github.com], query: {}}", "rules query must map"),
    ("- allow: {hosts: [api.github.com], query: {state: [a]}}", "must be text"),
    ("- allow: {hosts: []}", "rules hosts is empty"),
    ("- allow: {hosts: ['https://api.github.com/']}", "looks like a URL"),
    ("- allow: api.github.com", "must be a mapping"),
])
def test_bad_rules_are_errors_at_their_line(entry, message):
    text = f"version: 1\nintercept: ['*']\nrules:\n  {entry}\n"
    found = problems(text)
    assert any(message in p and p.startswith("p.yaml:4:") for p in found), found


def test_a_rule_on_methods_or_paths_needs_interception():
    text = GITHUB.replace("intercept: [api.github.com]\n", "intercept: [other.example]\n")
    found = problems(text)
    assert len(found) == 3, found  # the three rules with methods or paths; the host-only one is fine
    assert all("`intercept`" in p and "api.github.com" in p for p in found)
    # Per profile: a profile whose own intercept drops the host is an error there.
    text = GITHUB + "clients:\n  - name: p\n    sources: [10.0.0.0/8]\n    intercept: [other.example]\n"
    assert any("client profile 'p'" in p for p in problems(text))


def test_host_only_rules_need_no_interception():
    load_policy_text("version: 1\nrules:\n  - deny: {hosts: [api.github.com]}\n", "p.yaml")


# ---- deciding --------------------------------------------------------------


@pytest.mark.parametrize("method, target, allowed, rule_line", [
    ("GET", "/repos/acme/widget", True, 5),
    ("HEAD", "/user", True, 5),
    ("GET", "/user/", False, 7),  # trailing slash: no match, the host's last rule denies
    ("GET", "/User", False, 7),  # case
    ("GET", "/repos/ACME/widget", False, 7),
    ("DELETE", "/repos/acme/widget", False, 4),  # the first rule wins
    ("POST", "/repos/acme/widget/issues", True, 6),
    ("POST", "/repos/acme/widget/pulls", False, 7),
    ("GET", "/repos/acme/../other/x", False, 7),  # matched normalised
    ("GET", "/repos//acme/./widget", True, 5),
    ("GET", "/repos/acme/widget?per_page=100", True, 5),  # the query is ignored
    ("GET", "/%72epos/acme/x", True, 5),  # unreserved encoded: decoded
])
def test_the_github_example(method, target, allowed, rule_line):
    d = decide(GITHUB, method, "api.github.com", target)
    assert d.allowed is allowed, d
    if allowed:
        assert d.rule.origin == f"p.yaml:{rule_line}" and d.request_rule.origin == f"p.yaml:{rule_line}"
        assert d.path == target.split("?")[0].replace("//", "/").replace("/./", "/").replace("%72", "r")
    else:
        assert d.refusal.reason is Reason.RULE_DENIED and d.refusal.rule == f"p.yaml:{rule_line}"
        assert f"p.yaml:{rule_line}" in d.refusal.message
        assert d.refusal.status == 403


@pytest.mark.parametrize("target", ["/repos/acme%2Fx", "/repos/acme/%2E%2E/x", "/repos/acme\\x", "/repos/acme;x/y",
                                    "/repos/acme/x%5C"])
def test_hostile_paths_are_refused_on_hosts_a_rule_names(target):
    d = decide(GITHUB, "GET", "api.github.com", target)
    assert not d.allowed and d.refusal.reason is Reason.RULE_DENIED
    assert "send it again" in d.refusal.message  # the agent can fix this one itself
    # A host no rule names is not judged by the rules at all.
    other = decide(GITHUB, "GET", "example.com", target, answers=("93.184.216.34",))
    assert other.allowed and other.path is None


def test_no_matching_rule_falls_through_to_the_host_level():
    text = """\
version: 1
intercept: ['*']
deny: [blocked.example]
methods: [GET]
rules:
  - allow: {hosts: [blocked.example], paths: ["/open/**"]}
  - deny: {hosts: [api.example], paths: ["/admin/**"]}
"""
    # An allow rule replaces the host-level deny and methods step...
    assert decide(text, "POST", "blocked.example", "/open/x", answers=("93.184.216.34",)).allowed
    # ...only where it matches.
    d = decide(text, "GET", "blocked.example", "/closed", answers=("93.184.216.34",))
    assert d.refusal.reason is Reason.HOST_DENIED
    d = decide(text, "POST", "api.example", "/x", answers=("93.184.216.34",))
    assert d.refusal.reason is Reason.METHOD_NOT_ALLOWED
    assert decide(text, "GET", "api.example", "/x", answers=("93.184.216.34",)).allowed


def test_an_allow_rule_never_opens_addresses_names_or_ports():
    text = """\
version: 1
intercept: ['*']
rules:
  - allow: {hosts: ['*'], paths: ["/**"]}
"""
    assert decide(text, "GET", "10.0.0.1", "/x", scheme="http", port=80).refusal.reason is Reason.ADDRESS_NOT_PUBLIC
    assert decide(text, "GET", "evil.example", "/x",
                  answers=("127.0.0.1",)).refusal.reason is Reason.DNS_ANSWER_NOT_PUBLIC
    assert decide(text, "GET", "db.internal", "/x").refusal.reason is Reason.INTERNAL_HOSTNAME
    assert decide(text, "GET", "example.com", "/x", port=8080).refusal.reason is Reason.PORT_NOT_ALLOWED


def test_an_allow_rule_replaces_a_host_level_deny_by_address():
    text = """\
version: 1
intercept: ['*']
deny: [93.184.216.0/24]
rules:
  - allow: {hosts: [api.example], paths: ["/ok"]}
"""
    assert decide(text, "GET", "api.example", "/ok", answers=("93.184.216.34",)).allowed
    assert decide(text, "GET", "api.example", "/no", answers=("93.184.216.34",)).refusal.reason is Reason.HOST_DENIED


def test_query_globs():
    text = """\
version: 1
intercept: ['*']
rules:
  - allow: {hosts: [api.example], paths: ["/search"], query: {q: "*", page: "[0-9]"}}
  - allow: {hosts: [api.example], paths: ["/issues"], query: {state: open}}
  - deny: {hosts: [api.example]}
"""
    ok = lambda target: decide(text, "GET", "api.example", target, answers=("93.184.216.34",)).allowed  # noqa: E731
    assert ok("/issues?state=open") and ok("/issues?state=open&x=1")
    assert not ok("/issues?state=closed") and not ok("/issues") and not ok("/issues?state=open&state=closed")
    assert ok("/search?q=x&page=[0-9]")  # only `*` is special in a glob
    assert not ok("/search?q=x&page=3")
    assert not ok("/search?page=[0-9]")  # a listed parameter must be present


def test_report_mode_lets_rule_refusals_through_as_would_refuse():
    d = decide("action: report\n" + GITHUB, "DELETE", "api.github.com", "/repos/acme/x")
    assert d.allowed and d.would_refuse.reason is Reason.RULE_DENIED and d.would_refuse.rule == "p.yaml:5"
    d = decide("action: report\n" + GITHUB, "GET", "api.github.com", "/a%2Fb")
    assert d.allowed and d.would_refuse.reason is Reason.RULE_DENIED


def test_tunnels_meet_host_only_rules_and_intercepted_ones_none():
    text = """\
version: 1
intercept: [seen.example]
rules:
  - allow: {hosts: [seen.example], methods: [GET]}
  - deny: {hosts: [seen.example, raw.example]}
"""
    # A raw tunnel (not intercepted): the first host-only rule decides it.
    d = decide(text, "CONNECT", "raw.example", None, scheme=None)
    assert d.refusal.reason is Reason.RULE_DENIED and d.refusal.rule == "p.yaml:5"
    assert decide(text, None, "raw.example", None, scheme=None).refusal.reason is Reason.RULE_DENIED  # SOCKS5
    # An intercepted tunnel is not judged: each request inside is.
    assert decide(text, None, "seen.example", None, scheme=None).allowed
    assert decide(text, "GET", "seen.example", "/x").allowed
    assert decide(text, "POST", "seen.example", "/x").refusal.reason is Reason.RULE_DENIED


def test_the_index_keeps_policy_order_across_pattern_kinds():
    text = """\
version: 1
intercept: ['*']
rules:
  - deny: {hosts: ['*'], paths: ["/a"]}
  - allow: {hosts: ['**.example.com'], paths: ["/b"]}
  - deny: {hosts: [api.example.com], paths: ["/b", "/c"]}
  - allow: {hosts: ['*.example.com'], paths: ["/c", "/a"]}
  - allow: {hosts: [93.184.216.34], paths: ["/ip"]}
"""
    policy = load_policy_text(text, "p.yaml")
    rules = policy.rules.request_rules
    assert [r.line for r in rules.for_host(parse_host("api.example.com"))] == [4, 5, 6, 7]
    assert [r.line for r in rules.for_host(parse_host("example.com"))] == [4, 5]
    assert [r.line for r in rules.for_host(parse_host("other.org"))] == [4]
    assert [r.line for r in rules.for_host(parse_host("93.184.216.34"))] == [4, 8]
    outcome = lambda host, target: decide(text, "GET", host, target, answers=("93.184.216.34",))  # noqa: E731
    assert outcome("api.example.com", "/b").request_rule.line == 5
    assert outcome("api.example.com", "/c").refusal.rule == "p.yaml:6"
    assert outcome("api.example.com", "/a").refusal.rule == "p.yaml:4"
    assert outcome("www.example.com", "/c").request_rule.line == 7
    assert outcome("93.184.216.34", "/ip").request_rule.line == 8


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["GET", "POST", None]),
                          st.sampled_from(["/a", "/a/*", "/a/**", "/b/*/c", "/**", None]),
                          st.sampled_from(["allow", "deny"])), min_size=1, max_size=12),
       st.sampled_from(["GET", "POST"]), st.sampled_from(["/a", "/a/x", "/a/x/y", "/b/x/c", "/c", "/a/"]))
def test_the_indexed_scan_agrees_with_first_match_in_order(entries, method, path):
    lines = ["version: 1", "intercept: ['*']", "rules:"]
    for m, p, action in entries:
        parts = ["hosts: [api.example]"] + ([f"methods: [{m}]"] if m else []) + ([f"paths: ['{p}']"] if p else [])
        lines.append(f"  - {action}: {{{', '.join(parts)}}}")
    policy = load_policy_text("\n".join(lines) + "\n", "p.yaml")
    ruleset = policy.rules.request_rules
    expected = next((r for r in ruleset.rules if r.matches(method, path, None)), None)
    assert ruleset.judge(parse_host("api.example"), method, path).rule is expected


# ---- warnings --------------------------------------------------------------


def test_shadowed_rules_and_case_twins_are_warned_about():
    text = """\
version: 1
intercept: ['*']
rules:
  - allow: {hosts: ['**.example.com'], methods: [GET, HEAD], paths: ["/repos/**"]}
  - deny: {hosts: [api.example.com], methods: [GET], paths: ["/repos/acme/x"]}
  - deny: {hosts: [api.example.com], methods: [POST], paths: ["/repos/acme/x"]}
  - allow: {hosts: [api.example.com], paths: ["/Repos/**"]}
  - deny: {hosts: [api.example.com]}
  - deny: {hosts: [api.example.com], methods: [PUT]}
"""
    policy = load_policy_text(text, "p.yaml")
    warnings = [(r.line, m) for r, m in rule_warnings(policy.rules.request_rules)]
    lines = sorted(line for line, _ in warnings)
    assert lines == [5, 7, 9], warnings
    assert any("never decides" in m and "p.yaml:4" in m for line, m in warnings if line == 5)
    assert any("only by case" in m for line, m in warnings if line == 7)
    assert any("never decides" in m and "p.yaml:8" in m for line, m in warnings if line == 9)


def test_policy_check_prints_rule_warnings_at_their_lines(tmp_path, capsys):
    from sluice.policy_cli import check

    path = tmp_path / "p.yaml"
    path.write_text(GITHUB + "  - deny:  {hosts: [api.github.com], methods: [PUT]}\n")
    assert check(str(path)) == 0
    err = capsys.readouterr().err
    assert f"{path}:8:5: warning: the rule at {path}:8" in err and "never decides" in err
    assert check(str(path), strict=True) == 1


_VALUES = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.sampled_from(
    ["GET", "/a/**", "api.example", "*", "", "/a%2F", "CONNECT", "x"])),
    lambda inner: st.one_of(st.lists(inner, max_size=3),
                            st.dictionaries(st.sampled_from(["hosts", "methods", "paths", "query", "allow",
                                                             "deny", "q"]),
                                            inner, max_size=4)), max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(_VALUES)
def test_any_rules_value_loads_or_is_problems_never_a_crash(value):
    import json

    text = "version: 1\nintercept: ['*']\nrules: " + json.dumps(value) + "\n"
    try:
        load_policy_text(text, "p.yaml")
    except PolicyInvalid as e:
        assert all("could not be read" not in str(p) for p in e.problems), e.problems


def test_explain_and_test_decide_the_path_and_name_the_rule(tmp_path, capsys):
    import json as _json

    from sluice.policy_cli import explain, run_test

    policy = tmp_path / "p.yaml"
    policy.write_text(GITHUB)
    resolve = ["api.github.com=140.82.112.6"]
    assert explain(str(policy), "https://api.github.com/repos//acme/./x?y=1#top", resolve=resolve) == 0
    data = _json.loads(capsys.readouterr().out)
    assert (data["rule"], data["path"]) == (f"{policy}:5", "/repos/acme/x")
    assert explain(str(policy), "https://api.github.com/repos/acme/x", method="DELETE", resolve=resolve) == 3
    data = _json.loads(capsys.readouterr().out)
    assert (data["reason"], data["rule"]) == ("rule_denied", f"{policy}:4")
    cases = tmp_path / "cases.yaml"
    cases.write_text("- {url: 'https://api.github.com/user', expect: allow, resolve: {api.github.com: 140.82.112.6}}\n"
                     "- {url: 'https://api.github.com/user/', expect: allow, resolve: {api.github.com: "
                     "140.82.112.6}}\n")
    assert run_test(str(policy), str(cases)) == 1
    out = capsys.readouterr().out
    assert "cases.yaml:2: FAIL" in out and f"[rule {policy}:7]" in out and "1 passed, 1 failed" in out
