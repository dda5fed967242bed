"""`sluice policy test FILE CASES`: one line per failure, `N passed, M failed`,
exit 0 / 1; cases files validated with FILE:LINE:COL problems."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

POLICY = """\
version: 1
allow: ["**.example.org", searxng]
deny: [bad.example.org]
methods: [GET, HEAD, CONNECT]
private_networks: ["10.0.0.5/32:8080"]
clients:
  - name: ci
    sources: [10.0.0.0/8]
    methods: [GET]
  - name: watcher
    sources: [10.1.0.0/16]
    action: report
"""

PASSING = """\
- url: https://www.example.org/
  resolve: {www.example.org: 93.184.215.14}
  expect: allow
- name: several answers, one private
  url: https://api.example.org/
  resolve:
    api.example.org: [93.184.215.14, 10.0.0.1]
  expect: refuse
  reason: dns_answer_not_public
- url: https://example.com/
  expect: refuse
  reason: host_not_allowed
- url: https://bad.example.org/
  expect: refuse
  reason: host_denied
- url: http://searxng:8080/
  resolve: {searxng: 10.0.0.5}
  expect: allow
- url: http://searxng:8080/
  resolve: {SEARXNG.: "10.0.0.6"}
  expect: refuse
  reason: dns_answer_not_public
- url: https://www.example.org/
  method: HEAD
  client: ci
  resolve: {www.example.org: 93.184.215.14}
  expect: refuse
  reason: method_not_allowed
- name: report mode allows, and the expected reason is what it would refuse
  url: https://example.com/
  client: watcher
  resolve: {example.com: 93.184.215.14}
  expect: allow
  reason: host_not_allowed
- name: no resolve entry means the name is unresolvable
  url: https://unlisted.example.org/
  expect: refuse
  reason: dns_failed
- url: http://169.254.169.254/
  expect: refuse
  reason: address_not_public
"""


@pytest.fixture
def policy(write):
    return write("policy.yaml", POLICY)


@pytest.fixture
def run(cli, policy, write):
    def _run(cases: str, *extra):
        path = write("cases.yaml", cases)
        return path, cli(["policy", "test", policy, path, *extra])

    return _run


def test_all_cases_pass(run):
    _, result = run(PASSING)
    assert result.code == 0, result.out + result.err
    assert result.out == "10 passed, 0 failed\n" and result.err == ""


def test_verbose_lists_every_case(run):
    path, result = run(PASSING, "-v")
    assert result.code == 0
    lines = result.out.splitlines()
    assert len(lines) == 11 and lines[-1] == "10 passed, 0 failed"
    assert lines[0] == f"{path}:1: ok: GET https://www.example.org/: allow [tunnel: the method is not visible]"
    assert lines[1] == (f"{path}:4: ok: several answers, one private: refuse (dns_answer_not_public) [tunnel: the "
                        "method is not visible]")
    assert lines[4] == f"{path}:16: ok: GET http://searxng:8080/: allow"


def test_failures_print_one_line_each_and_exit_1(run, policy):
    cases = """\
- url: https://example.com/
  expect: allow
- url: https://bad.example.org/
  expect: refuse
  reason: host_not_allowed
- url: https://www.example.org/
  resolve: {www.example.org: 93.184.215.14}
  expect: refuse
- url: https://www.example.org/
  resolve: {www.example.org: 93.184.215.14}
  expect: allow
"""
    path, result = run(cases)
    assert result.code == 1
    assert result.out.splitlines() == [
        f"{path}:1: FAIL: GET https://example.com/: expected allow, got refuse (host_not_allowed) [tunnel: the method "
        "is not visible]: "
        "example.com is not on this policy's allow list",
        f"{path}:3: FAIL: GET https://bad.example.org/: expected refuse (host_not_allowed), got refuse (host_denied) "
        f"[tunnel: the method is not visible] [rule {policy}:3]: bad.example.org is denied by the rule "
        "'bad.example.org'",
        f"{path}:6: FAIL: GET https://www.example.org/: expected refuse, got allow [tunnel: the method is not visible] "
        f"[rule {policy}:2]",
        "1 passed, 3 failed",
    ]


def test_a_reason_on_an_allow_must_match_would_refuse(run):
    cases = ("- url: https://www.example.org/\n  resolve: {www.example.org: 1.1.1.1}\n  expect: allow\n  reason: "
             "host_denied\n")
    _, result = run(cases)
    assert result.code == 1 and "expected allow (host_denied), got allow" in result.out


def test_cases_never_touch_the_network(run):
    # no_network (conftest) fails the test if any lookup leaves the case's own table
    _, result = run("- url: https://www.example.org/\n  expect: refuse\n  reason: dns_failed\n")
    assert result.code == 0


@pytest.mark.parametrize(
    ("cases", "expected"),
    [
        ("url: x\n", ["1:1: the cases file must be a list of cases"]),
        ("[]\n", ["1:1: the cases file has no cases"]),
        ("~\n", ["1:1: the cases file has no cases"]),
        ("", ["1:1: the cases file is empty"]),
        ("- https://example.com/\n", ["1:3: each case must be a mapping"]),
        ("- expect: allow\n", ["1:3: this case has no `url`"]),
        ("- url: http://8.8.8.8/\n", ["1:3: this case has no `expect`"]),
        ("- url: http://8.8.8.8/\n  expcet: allow\n",
         ["1:3: this case has no `expect`", "2:3: unknown key 'expcet' in a case; did you mean 'expect'?"]),
        ("- url: http://8.8.8.8/\n  expect: allowed\n", ["2:11: expect must be 'allow' or 'refuse', not 'allowed'"]),
        ("- url: http://8.8.8.8/\n  expect: refuse\n  reason: host_not_alowed\n",
         ["3:11: 'host_not_alowed' is not a reason code; did you mean 'host_not_allowed'?"]),
        ("- url: http://8.8.8.8/\n  expect: allow\n  client: nobody\n",
         ["3:11: client: no client profile named 'nobody'"]),
        ("- url: example.com\n  expect: allow\n", ["1:8: url: 'example.com' is not an absolute URL"]),
        ("- url: 42\n  expect: allow\n", ["1:8: url must be a non-empty string"]),
        ("- url: http://8.8.8.8/\n  method: G ET\n  expect: allow\n", ["2:11: method: 'G ET' is not an HTTP method"]),
        ("- url: http://a.example.org/\n  resolve: 1.1.1.1\n  expect: allow\n",
         ["2:12: resolve must map each host name"]),
        ("- url: http://a.example.org/\n  resolve: {a.example.org: 0x7f.1}\n  expect: allow\n",
         ["2:28: resolve: '0x7f.1' is not an IP address"]),
        ("- url: http://a.example.org/\n  resolve: {a.example.org: [1.1.1.1, {}]}\n  expect: allow\n",
         ["2:38: resolve: 'a.example.org' must map to an IP address string"]),
        ("- url: http://a.example.org/\n  resolve: {a.example.org: []}\n  expect: allow\n",
         ["2:28: resolve: 'a.example.org' has no addresses"]),
        ("- url: http://a.example.org/\n  resolve: {1.2.3.4: 1.1.1.1}\n  expect: allow\n",
         ["2:13: resolve: '1.2.3.4' is an IP address"]),
        ("- url: http://a.example.org/\n  resolve: {a.example.org: 1.1.1.1, A.example.org.: 1.1.1.2}\n  expect: "
         "allow\n",
         ["2:37: resolve: 'a.example.org' appears twice"]),
        ("- url: http://8.8.8.8/\n  url: http://1.1.1.1/\n  expect: allow\n",
         ["2:3: 'url' appears twice in this case"]),
        ("- url: !!python/object/apply:os.system [true]\n  expect: allow\n",
         ["1:8: the YAML tag '!!python/object/apply:os.system' is not allowed in a cases file"]),
        ("- url: [unclosed\n  expect: allow\n", ["YAML syntax:"]),
    ],
)
def test_bad_cases_files_are_reported_with_positions(run, cases, expected):
    path, result = run(cases)
    assert result.code == 1 and result.out == ""
    lines = result.err.splitlines()
    assert lines[-1] == f"{path}: {len(lines) - 1} problem(s)"
    assert len(lines) - 1 == len(expected), lines
    for line, want in zip(lines, expected):
        if want.startswith("YAML"):
            assert line.startswith(f"{path}:") and want in line
        else:
            assert line.startswith(f"{path}:{want}"), (line, want)


def test_every_bad_case_is_reported_before_anything_runs(run):
    cases = ("- url: http://8.8.8.8/\n  expect: maybe\n- url: nope\n  expect: allow\n- url: http://8.8.8.8/\n  expect: "
             "allow\n")
    path, result = run(cases)
    assert result.code == 1 and result.out == ""
    assert [line.split(": ")[0] for line in result.err.splitlines()[:2]] == [f"{path}:2:11", f"{path}:3:8"]


def test_an_invalid_policy_is_reported_first(cli, write):
    policy = write("bad.yaml", "version: 1\nports: [0]\n")
    cases = write("cases.yaml", "- url: http://8.8.8.8/\n  expect: allow\n")
    result = cli(["policy", "test", policy, cases])
    assert result.code == 1 and result.err.splitlines()[0] == f"{policy}:2:9: ports: 0 is not a port number (1-65535)"


def test_an_alias_bomb_in_a_cases_file_is_refused(run):
    lines = ["- &a0 {url: http://8.8.8.8/, expect: allow}"]
    for i in range(1, 12):
        lines.append(f"- &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]")
    path, result = run("\n".join(lines) + "\n")
    assert result.code == 1
    assert result.err.splitlines()[0] == (
        f"{path}:1:1: the cases file expands to more than 500000 YAML nodes (an alias bomb?); refusing it")


def test_a_missing_or_binary_cases_file(cli, policy, write, tmp_path):
    result = cli(["policy", "test", policy, tmp_path / "nope.yaml"])
    assert result.code == 1 and "cannot read the cases file" in result.err
    binary = write("cases.bin", b"\xff\xfe- url")
    result = cli(["policy", "test", policy, binary])
    assert result.code == 1 and "is not UTF-8 text" in result.err


def test_usage_errors_exit_2(cli, policy):
    assert cli(["policy", "test", policy]).code == 2


# ---- https:// cases are judged as the proxy meets them (issue 10, item 1) ----------------------

DOWNLOAD_ONLY = """\
version: 1
allow: ["**.github.com"]
clients:
  - name: tunnels
    sources: [10.20.0.0/16]
    methods: [GET, HEAD, CONNECT]
  - name: intercepted
    sources: [10.30.0.0/16]
    methods: [GET, HEAD]
    intercept: ["**.github.com"]
"""

PUSH = """\
- name: CI may not push
  url: https://github.com/psf/requests.git/git-receive-pack
  client: {client}
  method: POST
  resolve: {{github.com: 140.82.121.4}}
  expect: refuse
  reason: method_not_allowed
"""


def real_sluice(*args) -> subprocess.CompletedProcess:
    """The installed `sluice` command itself, in a subprocess (cases never query DNS)."""
    return subprocess.run([str(Path(sys.executable).parent / "sluice"), *map(str, args)], capture_output=True,
                          text=True, timeout=60, env={"PATH": "/usr/bin:/bin", "HOME": "/nonexistent"})


def test_a_method_refusal_expected_inside_a_tunnel_fails_and_says_to_intercept(write):
    policy = write("download.yaml", DOWNLOAD_ONLY)
    cases = write("cases.yaml", PUSH.format(client="tunnels"))
    result = real_sluice("policy", "test", policy, cases)
    assert result.returncode == 1
    assert result.stdout.splitlines() == [
        f"{cases}:1: FAIL: CI may not push: expected refuse (method_not_allowed), got allow "
        f"[tunnel: the method is not visible] [rule {policy}:2]; the host must be intercepted for its methods to be "
        "checked: the proxy sees only CONNECT github.com:443, never the POST inside the tunnel (add the host to "
        "`intercept`; the client must then trust `sluice ca`)",
        "0 passed, 1 failed",
    ]


def test_the_same_case_passes_when_the_host_is_intercepted(write):
    policy = write("download.yaml", DOWNLOAD_ONLY)
    cases = write("cases.yaml", PUSH.format(client="intercepted"))
    result = real_sluice("policy", "test", "-v", policy, cases)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines() == [
        f"{cases}:1: ok: CI may not push: refuse (method_not_allowed) [intercepted]", "1 passed, 0 failed"]


def test_a_method_refusal_without_a_reason_gets_the_hint_too(run):
    cases = ("- url: https://www.example.org/\n  method: DELETE\n  resolve: {www.example.org: 93.184.215.14}\n"
             "  expect: refuse\n")
    _, result = run(cases)
    assert result.code == 1 and "the host must be intercepted for its methods to be checked" in result.out
    # a refusal by host is not about methods: no hint
    _, result = run("- url: https://www.example.org/\n  resolve: {www.example.org: 93.184.215.14}\n  expect: refuse\n"
                    "  reason: host_denied\n")
    assert result.code == 1 and "intercepted" not in result.out.split("[rule")[-1]


def test_a_tunnel_case_is_decided_by_its_connect(run):
    cases = """\
- name: ci lists no CONNECT, so its tunnels are refused whatever the method
  url: https://www.example.org/
  client: ci
  resolve: {www.example.org: 93.184.215.14}
  expect: refuse
  reason: method_not_allowed
- name: an explicit CONNECT is the same decision
  url: https://www.example.org/
  method: CONNECT
  resolve: {www.example.org: 93.184.215.14}
  expect: allow
- name: credentials in an https URL go inside the tunnel
  url: https://user:pw@www.example.org/
  resolve: {www.example.org: 93.184.215.14}
  expect: allow
- name: over plain http the proxy sees them
  url: http://user:pw@www.example.org/
  expect: refuse
  reason: url_credentials
"""
    _, result = run(cases, "-v")
    assert result.code == 0, result.out
    assert result.out.splitlines()[-1] == "4 passed, 0 failed"
