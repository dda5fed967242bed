"""`sluice policy suggest` (issue 21, learn mode): what it suggests from an
audit log, how it edits the file (comments and order kept), and what it
never suggests."""

from __future__ import annotations

import json
import os

import pytest

from sluice.cli import main
from sluice.policy.loader import load_policy_text
from sluice.policy_suggest import generalise_paths, generalise_segment

POLICY = """\
version: 1
action: report   # learning first
# the hosts agents may reach
allow:
  - example.com    # docs
intercept: [api.github.com]   # so paths are seen
clients:
  - name: ci
    sources: [10.0.0.0/8]
    allow: [pypi.org]
    intercept: ['*']
    rules:
      # keep this one
      - deny: {hosts: [api.github.com], methods: [DELETE]}
"""


def line(**fields) -> dict:
    base = {"time": "2026-12-02T01:00:00.000Z", "event": "request", "profile": None, "method": "GET",
            "host": "api.github.com", "path": "/", "decision": "allow", "reason": None, "would_refuse": None,
            "rule": None}
    base.update(fields)
    return base


def would(**fields) -> dict:
    return line(reason=fields.pop("reason", "host_not_allowed"), would_refuse=True, **fields)


def write(tmp_path, policy: str, lines: list[dict]):
    p = tmp_path / "policy.yaml"
    p.write_text(policy)
    a = tmp_path / "audit.jsonl"
    a.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return p, a


def run(capsys, *args) -> tuple[int, str, str]:
    code = main(["policy", "suggest", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("segment, general", [
    ("123", "*"), ("0", "*"), ("3f2a9c1", "*"), ("DEADBEEF01", "*"),
    ("123e4567-e89b-12d3-a456-426614174000", "*"),
    ("widget", "widget"), ("cafe", "cafe"), ("facade", "facade"), ("v1", "v1"), ("abc123x", "abc123x"),
    ("deadbeefcafe", "deadbeefcafe"),  # hex letters without a digit: a word
])
def test_identifier_segments_become_stars(segment, general):
    assert generalise_segment(segment) == general


def test_paths_generalise_and_many_siblings_become_a_subtree():
    assert generalise_paths({"/repos/acme/1/issues", "/repos/acme/22/issues"}) == ["/repos/acme/*/issues"]
    assert generalise_paths({"/user", "/user/"}) == ["/user", "/user/"]
    assert generalise_paths({"/"}) == ["/"]
    many = {f"/repos/acme/{name}/readme" for name in "abcdef"}
    assert generalise_paths(many | {"/user"}) == ["/repos/acme/**", "/user"]
    few = {f"/repos/acme/{name}/readme" for name in "abc"}
    assert generalise_paths(few) == [f"/repos/acme/{n}/readme" for n in "abc"]


def test_the_diff_keeps_comments_and_order_and_loads(tmp_path, capsys):
    lines = [would(path=f"/repos/acme/widget/issues/{i}") for i in (1, 2)]
    lines += [would(method="POST", path="/repos/acme/widget/issues"), line(path="/user")]
    lines += [would(event="connect", method="CONNECT", path=None, host="files.example")]
    p, a = write(tmp_path, POLICY, lines)
    code, out, err = run(capsys, "--policy", str(p), "--audit", str(a))
    assert code == 0, err
    assert out.startswith(f"--- {p}\n+++ {p}\n")
    added = [x[1:] for x in out.splitlines() if x.startswith("+") and not x.startswith("+++")]
    assert added == [
        "  - api.github.com",
        "  - files.example",
        "rules:",
        '  - allow: {hosts: [api.github.com], methods: [GET], paths: ["/repos/acme/widget/issues/*", "/user"]}',
        '  - allow: {hosts: [api.github.com], methods: [POST], paths: ["/repos/acme/widget/issues"]}',
        "  - deny: {hosts: [api.github.com]}",
    ], out
    assert not any(x.startswith("-") and not x.startswith("---") for x in out.splitlines())  # nothing removed
    assert p.read_text() == POLICY  # without --apply nothing is written


def test_apply_writes_checks_and_a_second_run_has_nothing_left(tmp_path, capsys):
    lines = [would(path="/repos/acme/x"), would(event="connect", method="CONNECT", path=None)]
    p, a = write(tmp_path, POLICY, lines)
    os.chmod(p, 0o640)
    code, out, err = run(capsys, "--policy", str(p), "--audit", str(a), "--apply")
    assert code == 0, err
    text = p.read_text()
    assert "# the hosts agents may reach" in text and "# keep this one" in text
    assert "api.github.com], methods: [GET], paths: [\"/repos/acme/x\"]}" in text
    assert "OK (report mode)" in out  # policy check ran on the written file
    assert oct(os.stat(p).st_mode & 0o777) == "0o640"
    policy = load_policy_text(text, str(p))
    assert [r.action for r in policy.rules.request_rules.rules] == ["allow", "deny"]
    code, out, err = run(capsys, "--policy", str(p), "--audit", str(a))
    assert (code, out) == (0, "") and "nothing to suggest" in err


def test_a_profile_with_its_own_rules_gets_them_first_and_explicit_denies_stay(tmp_path, capsys):
    lines = [would(profile="ci", path="/repos/acme/x", reason="rule_denied", rule=None),
             would(profile="ci", method="DELETE", path="/repos/acme/x", reason="rule_denied",
                   rule=f"{tmp_path}/policy.yaml:14"),
             would(profile="ci", event="connect", method="CONNECT", path=None, host="files.pythonhosted.org")]
    p, a = write(tmp_path, POLICY, lines)
    code, out, err = run(capsys, "--policy", str(p), "--audit", str(a), "--profile", "ci")
    assert code == 0, err
    assert "-    allow: [pypi.org]\n+    allow: [pypi.org, files.pythonhosted.org]\n" in out
    assert ("+      - allow: {hosts: [api.github.com], methods: [GET], paths: [\"/repos/acme/x\"]}\n"
            "       - deny: {hosts: [api.github.com], methods: [DELETE]}\n"
            "+      - deny: {hosts: [api.github.com]}\n") in out
    assert "DELETE api.github.com/repos/acme/x stays refused by the rule at" in err


def test_never_non_public_addresses_internal_names_or_hostile_paths(tmp_path, capsys):
    lines = [line(event="connect", method="CONNECT", path=None, host="10.1.2.3", decision="refuse",
                  reason="address_not_public"),
             would(event="connect", method="CONNECT", path=None, host="169.254.169.254"),
             would(event="connect", method="CONNECT", path=None, host="wiki.internal"),
             line(event="request", host="db.example", decision="refuse", reason="dns_answer_not_public"),
             would(path="/a%2Fb", reason="rule_denied")]
    p, a = write(tmp_path, POLICY, lines)
    code, out, err = run(capsys, "--policy", str(p), "--audit", str(a))
    assert (code, out) == (0, ""), out
    for text in ("10.1.2.3 stays refused", "169.254.169.254 stays refused", "wiki.internal stays refused",
                 "db.example stays refused (dns_answer_not_public)", "/a%2Fb stays refused"):
        assert text in err, err


def test_since_and_bad_input(tmp_path, capsys):
    old = would(time="2020-01-01T00:00:00.000Z", event="connect", method="CONNECT", path=None, host="old.example")
    p, a = write(tmp_path, POLICY, [old])
    a.write_text(a.read_text() + "not json\n")
    code, out, err = run(capsys, "--policy", str(p), "--audit", str(a), "--since", "1h")
    assert (code, out) == (0, "") and "1 line(s) are not JSON" in err
    code, out, err = run(capsys, "--policy", str(p), "--audit", str(a))
    assert code == 0 and "+  - old.example" in out
    assert run(capsys, "--policy", str(p), "--audit", str(a), "--since", "soon")[0] == 2
    assert run(capsys, "--policy", str(p), "--audit", str(a), "--profile", "nobody")[0] == 2
    code, out, err = run(capsys, "--policy", str(p), "--audit", str(tmp_path / "missing.jsonl"))
    assert code == 1 and "cannot read the audit log" in err and "Traceback" not in err
    code, out, err = run(capsys, "--policy", str(tmp_path), "--audit", str(a))
    assert code == 1 and "Traceback" not in err
