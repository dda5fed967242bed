"""sluice.policy.loader: every kind of problem, reported as FILE:LINE:COL: message."""

from __future__ import annotations

import time

import pytest

from sluice.policy.clients import verify_password
from sluice.policy.loader import (
    MAX_NODES,
    MAX_POLICY_BYTES,
    PolicyInvalid,
    Problem,
    hash_password,
    load_policy_file,
    load_policy_text,
    parse_duration,
    parse_size,
)
from sluice.policy.model import DEFAULT_PORTS, MIB, STANDARD_METHODS, Limits


def problems(text: str) -> list[tuple[int, int, str]]:
    with pytest.raises(PolicyInvalid) as info:
        load_policy_text(text, "p.yaml")
    for p in info.value.problems:
        assert p.file == "p.yaml"
    return [(p.line, p.col, p.message) for p in info.value.problems]


def one(text: str) -> tuple[int, int, str]:
    found = problems(text)
    assert len(found) == 1, found
    return found[0]


# ---- what loads --------------------------------------------------------------


def test_minimal_policy_gets_the_defaults():
    policy = load_policy_text("version: 1\n", "p.yaml")
    r = policy.rules
    assert policy.source == "p.yaml" and policy.version == 1
    assert r.action == "enforce" and r.allow is None and not r.deny
    assert r.ports == DEFAULT_PORTS and r.methods == STANDARD_METHODS
    assert not r.private_networks and r.limits == Limits()
    assert policy.clients == () and policy.require_client is False


def test_a_full_policy_loads_with_every_key():
    text = """\
version: 1
action: report
allow: ["**.example.com", pypi.org, "8.8.4.0/24", "2606:4700::/32"]
deny: [bad.example.com]
ports: [443, 8443]
methods: [get, HEAD]
private_networks: ["10.0.0.5/32:8080", "192.168.0.0/16", "[fd00::/64]:9000"]
strip_request_headers: [Authorization, X-Api-Key]
intercept: ["*.example.com"]
limits:
  connect_timeout: 500ms
  request_timeout: 2m
  idle_timeout: 1h
  max_response_bytes: 20MiB
  max_request_bytes: 512KiB
  tunnel_max_bytes: 1GB
  tunnel_max_seconds: 90
dns:
  nameservers: ["127.0.0.53", "[::1]:5353", "10.0.0.2:53"]
  timeout: 2s
  min_ttl: 1s
  max_ttl: 10m
require_client: true
clients:
  - name: ci
    sources: [10.20.0.0/16]
    methods: [GET]
"""
    policy = load_policy_text(text, "p.yaml")
    r = policy.rules
    assert r.action == "report"
    assert len(r.allow) == 4 and len(r.deny) == 1
    assert r.ports == {443, 8443} and r.methods == {"GET", "HEAD"}
    assert len(r.private_networks) == 3
    assert r.strip_request_headers == {"authorization", "x-api-key"}
    assert r.limits == Limits(0.5, 120.0, 3600.0, 20 * MIB, 512 * 1024, 10**9, 90.0)
    assert policy.dns.nameservers == (("127.0.0.53", 53), ("::1", 5353), ("10.0.0.2", 53))
    assert (policy.dns.timeout, policy.dns.min_ttl, policy.dns.max_ttl) == (2.0, 1.0, 600.0)
    assert policy.require_client
    (ci,) = policy.clients
    # a profile overrides the keys it names and inherits the rest
    assert ci.name == "ci" and ci.origin == "p.yaml:25"
    assert ci.rules.methods == {"GET"} and ci.rules.ports == {443, 8443} and ci.rules.action == "report"
    assert ci.rules.allow is r.allow


def test_rules_remember_where_they_were_written():
    policy = load_policy_text("version: 1\nallow:\n  - a.example\n  - b.example\n", "p.yaml")
    assert [rule.origin for rule in policy.rules.allow.rules] == ["p.yaml:3", "p.yaml:4"]


def test_optional_limits_may_be_null_and_null_lists_are_empty():
    policy = load_policy_text("version: 1\nlimits: {tunnel_max_bytes: null, tunnel_max_seconds: ~}\ndeny:\n")
    assert policy.rules.limits.tunnel_max_bytes is None and not policy.rules.deny


def test_durations_and_sizes():
    assert parse_duration("250ms") == 0.25 and parse_duration(3) == 3.0 and parse_duration("1.5m") == 90.0
    assert parse_size("1KiB") == 1024 and parse_size("2kb") == 2000 and parse_size(7) == 7
    for bad in ("0s", "-1s", "ten", True, "5 fortnights"):
        with pytest.raises(ValueError):
            parse_duration(bad)
    for bad in (0, "12 parsecs", False, "-1MiB"):
        with pytest.raises(ValueError):
            parse_size(bad)


# ---- the file as a whole -------------------------------------------------------


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n", "---\n", "~\n", "null\n"])
def test_empty_policy(text):
    assert one(text) == (1, 1, "the policy is empty; it needs at least `version: 1`")


@pytest.mark.parametrize("text", ["- version: 1\n", "just text\n", "42\n", "[]\n"])
def test_root_must_be_a_mapping(text):
    line, col, message = one(text)
    assert (line, col) == (1, 1) and message == "the policy must be a mapping of keys to values"


def test_version_is_required_and_must_be_the_integer_one():
    assert one("allow: [a.example]\n") == (1, 1, "the policy needs `version: 1` at the top")
    assert one("version: 2\n")[:2] == (1, 10)
    assert "unsupported policy version 2" in one("version: 2\n")[2]
    # A value that is not a number says what it is instead (issue 10 item 6).
    assert one("version: true\n")[2] == "version must be the number 1, not a boolean (True)"
    assert one("version: 1.0\n")[2] == "version must be the number 1, not a float (1.0)"
    assert one("version: '1'\n")[2] == "version is the string '1'; write the number 1 without quotes (`version: 1`)"


def test_yaml_syntax_error_has_its_position():
    line, col, message = one("version: 1\nallow: [a.example\nports: [80]\n")
    assert line == 3 and message.startswith("YAML syntax:")
    line, col, message = one("version: 1\n\tallow: []\n")
    assert message.startswith("YAML syntax:") and "'\\t'" in message


def test_a_second_document_is_refused():
    assert "YAML syntax" in one("version: 1\n---\nversion: 1\n")[2]


def test_every_problem_is_reported_sorted_by_position():
    found = problems("version: 1\nports: [0]\nmethods: [FETCH]\naction: block\nalow: []\n")
    assert [(line, col) for line, col, _ in found] == [(2, 9), (3, 11), (4, 9), (5, 1)]


def test_problem_text_is_file_line_col_message():
    assert str(Problem("p.yaml", 3, 7, "boom")) == "p.yaml:3:7: boom"
    with pytest.raises(PolicyInvalid) as info:
        load_policy_text("version: 1\nports: [0]\n", "p.yaml")
    assert str(info.value) == "p.yaml:2:9: ports: 0 is not a port number (1-65535)"


# ---- unknown and duplicate keys -------------------------------------------------


@pytest.mark.parametrize(
    ("text", "where", "expected"),
    [
        ("version: 1\nalow: []\n", (2, 1), "unknown key 'alow' in the policy; did you mean 'allow'?"),
        ("version: 1\nport: [80]\n", (2, 1), "did you mean 'ports'?"),
        ("version: 1\nlimits:\n  conect_timeout: 1s\n", (3, 3),
         "unknown key 'conect_timeout' in limits; did you mean 'connect_timeout'?"),
        ("version: 1\ndns:\n  nameserver: []\n", (3, 3), "did you mean 'nameservers'?"),
        ("version: 1\nclients:\n  - name: a\n    sources: [10.0.0.0/8]\n    methds: [GET]\n", (5, 5),
         "unknown key 'methds' in a client profile; did you mean 'methods'?"),
        ("version: 1\nzzz: 1\n", (2, 1), "unknown key 'zzz' in the policy; known keys: version, action, allow"),
    ],
)
def test_unknown_key_with_did_you_mean(text, where, expected):
    line, col, message = one(text)
    assert (line, col) == where
    assert expected in message


def test_duplicate_key():
    assert one("version: 1\nports: [80]\nports: [443]\n") == (3, 1,
                                                              "'ports' appears twice in the policy (first at line 2)")


def test_non_string_key():
    assert one("version: 1\n1: x\n") == (2, 1, "keys in the policy must be strings")


# ---- wrong types ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "where", "expected"),
    [
        ("version: 1\nports: 80\n", (2, 8), "ports must be a list"),
        ("version: 1\nports: ['80']\n", (2, 9), "ports: '80' is not a port number (1-65535)"),
        ("version: 1\nports: [65536]\n", (2, 9), "ports: 65536 is not a port number"),
        ("version: 1\nports: [true]\n", (2, 9), "ports: True is not a port number"),
        ("version: 1\nports: []\n", (2, 8), "ports is empty"),
        ("version: 1\nmethods: [GETT]\n", (2, 11),
         "methods: 'GETT' is not a standard HTTP method; did you mean 'GET'?"),
        ("version: 1\nmethods: [1]\n", (2, 11), "methods: 1 is not an HTTP method"),
        ("version: 1\naction: block\n", (2, 9), "action must be 'enforce' or 'report', not 'block'"),
        ("version: 1\nrequire_client: maybe\n", (2, 17), "require_client must be true or false, not 'maybe'"),
        ("version: 1\nlimits: {connect_timeout: ten}\n", (2, 27), "limits.connect_timeout: 'ten' is not a duration"),
        ("version: 1\nlimits: {connect_timeout: 0}\n", (2, 27), "a duration must be greater than zero"),
        ("version: 1\nlimits: {max_response_bytes: 10 parsecs}\n", (2, 30), "is not a size"),
        ("version: 1\nlimits: {connect_timeout: [1]}\n", (2, 27), "limits.connect_timeout must be a single value"),
        ("version: 1\nlimits: [1]\n", (2, 9), "limits must be a mapping"),
        ("version: 1\ndns: {timeout: {a: 1}}\n", (2, 16), "dns.timeout must be a single value"),
        ("version: 1\ndns: {nameservers: [dns.google]}\n", (2, 21), "a nameserver must be an IP address, not a name"),
        ("version: 1\ndns: {nameservers: ['1.2.3.4:99999']}\n", (2, 21), "has a bad port"),
        ("version: 1\ndns: {min_ttl: 10m, max_ttl: 1m}\n", (2, 6), "dns.min_ttl is greater than dns.max_ttl"),
        ("version: 1\nstrip_request_headers: ['Bad Header']\n", (2, 25), "is not a header name"),
        ("version: 1\nallow: [{a: 1}]\n", (2, 9), "in allow: each entry must be a host pattern string"),
        ("version: 1\nallow: [1]\n", (2, 9), "in allow: a host pattern must be a string, not int"),
        ("version: 1\nallow: example.com\n", (2, 8), "allow must be a list"),
        ("version: 1\nprivate_networks: [{a: 1}]\n", (2, 20), "private_networks: this entry must be a CIDR string"),
    ],
)
def test_wrong_types(text, where, expected):
    line, col, message = one(text)
    assert (line, col) == where, message
    assert expected in message


# ---- host patterns ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("pattern", "expected"),
    [
        ("http://example.com", "looks like a URL or path"),
        ("example.com/path", "looks like a URL or path"),
        ("example.com:443", "has a port; list ports under `ports`"),
        ("exa*mple.com", "'*' may appear only as a whole leading label"),
        ("*.*.example.com", "'*' may appear only as a whole leading label"),
        ("*example.com", "'*' may appear only as a whole leading label"),
        ("*.10.0.0.1", "wildcards apply to names, not IP addresses"),
        ("**.[::1]", "wildcards apply to names"),
        (" example.com", "has surrounding spaces or is empty"),
        ("", "has surrounding spaces or is empty"),
        ("exa mple.com", "is not a valid host pattern"),
        ("-bad-.example.com", "is not a valid host pattern"),
        ("xn--zz.example.com", "invalid punycode label"),
        ("example..com", "is not a valid host pattern"),
        ("300.1.1.1", "is not a valid host pattern"),
        ("10.0.0.1/8", "has host bits set; did you mean 10.0.0.0/8?"),
        ("10/8", "is not a valid IP address or CIDR"),
    ],
)
def test_bad_host_patterns(pattern, expected):
    line, col, message = one(f'version: 1\ndeny:\n  - "{pattern}"\n')
    assert (line, col) == (3, 5)
    assert message.startswith("in deny: ") and expected in message, message


def test_a_pattern_listed_twice_after_normalisation():
    assert one("version: 1\nallow:\n  - example.com\n  - EXAMPLE.com.\n") == (
        4, 5, "in allow: 'EXAMPLE.com.' is listed twice (first at line 3)")


# ---- CIDRs -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("entry", "expected"),
    [
        ("10.0.0.1/8", "has host bits set; did you mean 10.0.0.0/8?"),
        ("10/8", "is not a valid IP address or CIDR"),
        ("300.1.1.1/32", "is not a valid IP address or CIDR"),
        ("10.0.0.0/33", "is not a valid IP address or CIDR"),
        ("fd00::1/64", "has host bits set; did you mean fd00::/64?"),
        ("fd00::/64:8080", "is not a valid IP address or CIDR"),
        ("10.0.0.5/32:0", "has an invalid port '0'"),
        ("10.0.0.5/32:http", "has an invalid port 'http'"),
        ("10.0.0.5/32:70000", "has an invalid port '70000'"),
        ("example.com", "is not a valid IP address or CIDR"),
    ],
)
def test_bad_cidrs(entry, expected):
    line, col, message = one(f'version: 1\nprivate_networks:\n  - "{entry}"\n')
    assert (line, col) == (3, 5)
    assert message.startswith("private_networks: ") and expected in message, message


def test_bad_source_cidr_names_sources():
    line, col, message = one('version: 1\nclients:\n  - name: a\n    sources: ["10.1.2.3/16"]\n')
    assert (line, col) == (4, 15)
    assert message == "sources: '10.1.2.3/16' has host bits set; did you mean 10.1.0.0/16?"


# ---- client profiles -----------------------------------------------------------------

GOOD_HASH = hash_password("correct horse", iterations=10_000, salt=b"0123456789abcdef")


def test_duplicate_profiles():
    text = f"""\
version: 1
clients:
  - name: ci
    sources: [10.0.0.0/8]
  - name: ci
    users: {{bot: {{password_hash: "{GOOD_HASH}"}}}}
"""
    assert one(text) == (5, 11, "client profile 'ci' is defined twice (first at line 3)")


def test_one_user_in_two_profiles():
    text = f"""\
version: 1
clients:
  - name: a
    users: {{bot: {{password_hash: "{GOOD_HASH}"}}}}
  - name: b
    users: {{bot: {{password_hash: "{GOOD_HASH}"}}}}
"""
    assert one(text) == (6, 13, "user 'bot' is already in profile 'a': a username selects exactly one profile, "
                                "so this entry could never be used")


@pytest.mark.parametrize(
    ("profile", "expected"),
    [
        ("{sources: [10.0.0.0/8]}", "every client profile needs a `name`"),
        ("{name: lonely}", "client profile 'lonely' matches nobody: give it `users` or `sources`"),
        ("{name: a, users: {bot: {password: hunter2}}}",
         "unknown key 'password' in user 'bot'; did you mean 'password_hash'?"),
        ("{name: a, users: {bot: {password_hash: hunter2}}}",
         "password_hash for 'bot': expected 'pbkdf2_sha256$ITERATIONS$SALT$HASH'"),
        ("{name: a, users: {bot: {password_hash: 'pbkdf2_sha256$1000$00$00'}}}", "password_hash for 'bot'"),
        ("{name: a, users: {bot: {password_hash: 'sha256:abc'}}}",
         "password_hash for 'bot': unsalted 'sha256:' hashes are not accepted"),
        ("{name: a, users: {'a:b': {password_hash: x}}}", "'a:b' is not a valid username (no ':' allowed)"),
        ("{name: a, users: [bot]}", "users must map each username to {password_hash: ...} or {password_file: ...}"),
        ("{name: a, users: {bot: {password_hash: x, password_file: y}}}",
         "needs exactly one of password_hash or password_file"),
        ("{name: a, users: {bot: null}}", "user 'bot' must be a mapping"),
        ("just-a-name", "a client profile must be a mapping"),
    ],
)
def test_bad_profiles(profile, expected):
    found = problems(f"version: 1\nclients:\n  - {profile}\n")
    assert any(expected in message for _, _, message in found), found
    assert all(line == 3 for line, _, _ in found)


def test_require_client_without_clients():
    assert one("version: 1\nrequire_client: true\n") == (
        2, 1, "require_client is true but no `clients` are defined: every client would be refused")


def test_password_file_is_read_relative_to_the_policy(tmp_path):
    (tmp_path / "secrets").mkdir()
    (tmp_path / "secrets" / "bot.txt").write_text("s3cret\n")
    policy_path = tmp_path / "policy.yaml"
    policy_path.write_text("version: 1\nclients:\n  - name: a\n    users: {bot: {password_file: secrets/bot.txt}}\n")
    (profile,) = load_policy_file(policy_path).clients
    (user, verifier), = profile.credentials
    assert user == "bot" and verify_password(verifier, "s3cret") and not verify_password(verifier, "s3cret\n")


def test_password_file_missing_or_empty(tmp_path):
    (tmp_path / "empty.txt").write_text("\n")
    policy_path = tmp_path / "policy.yaml"
    policy_path.write_text("version: 1\nclients:\n  - name: a\n    users:\n      x: {password_file: nope.txt}\n"
                           "      y: {password_file: empty.txt}\n")
    with pytest.raises(PolicyInvalid) as info:
        load_policy_file(policy_path)
    messages = [(p.line, p.message) for p in info.value.problems]
    assert messages[0][0] == 5 and "cannot read 'nope.txt'" in messages[0][1]
    assert messages[1] == (6, "password_file for 'y': 'empty.txt' is empty")


def test_hash_password_round_trips():
    verifier = hash_password("correct horse")
    assert verifier.startswith("pbkdf2_sha256$200000$")
    assert verify_password(verifier, "correct horse") and not verify_password(verifier, "wrong")
    assert load_policy_text(f'version: 1\nclients:\n  - name: a\n    users: {{bot: {{password_hash: "{verifier}"}}}}\n')


# ---- shadowed allow entries ----------------------------------------------------------


@pytest.mark.parametrize(
    ("allow", "deny", "shadowed"),
    [
        ("a.example.com", '"*.example.com"', True),
        ("a.example.com", '"**.example.com"', True),
        ("example.com", "example.com", True),
        ('"*.example.com"', '"**.example.com"', True),
        ('"*.example.com"', '"*.example.com"', True),
        ('"**.example.com"', '"**.example.com"', True),
        ("a.example.com", '"*"', True),
        ('"**.b.example.com"', '"*.example.com"', True),
        ('"**.example.com"', "example.com", False),  # subdomains still match
        ('"**.example.com"', '"*.example.com"', False),  # the apex still matches
        ('"*.example.com"', "example.com", False),
        ("example.com", '"*.example.com"', False),
        ("a.example.com", "b.example.com", False),
    ],
)
def test_shadowed_allow_entries(allow, deny, shadowed):
    text = f"version: 1\nallow:\n  - {allow}\ndeny:\n  - {deny}\n"
    if not shadowed:
        load_policy_text(text, "p.yaml")
        return
    line, col, message = one(text)
    assert (line, col) == (3, 5)
    assert "can never match: the deny rule" in message and "(p.yaml:5) always wins" in message


def test_deny_entries_that_together_cover_an_allow_entry_shadow_it():
    # example.com takes the apex, *.example.com every subdomain: nothing is left for the allow entry.
    text = 'version: 1\nallow:\n  - "**.example.com"\ndeny:\n  - example.com\n  - "*.example.com"\n'
    line, col, message = one(text)
    assert (line, col) == (3, 5) and "can never match: the deny rule" in message


def test_shadowing_is_checked_inside_profiles_too():
    text = ('version: 1\ndeny: ["**.evil.example"]\nclients:\n  - name: a\n    sources: [10.0.0.0/8]\n    allow: '
            '[x.evil.example]\n')
    line, col, message = one(text)
    assert (line, col) == (6, 13) and "can never match" in message


# ---- hostile input ---------------------------------------------------------------------


def test_alias_bomb_is_refused_quickly():
    lines = ["version: 1", "a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    for i in range(1, 12):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]")
    start = time.monotonic()
    found = problems("\n".join(lines) + "\n")
    assert time.monotonic() - start < 2.0
    assert found == [(1, 1, f"the policy expands to more than {MAX_NODES} YAML nodes (an alias bomb?); refusing it")]


def test_a_policy_over_4_mib_is_refused_before_parsing(tmp_path):
    big = "version: 1\n#" + "x" * MAX_POLICY_BYTES + "\n"
    assert one(big) == (1, 1, "the policy is larger than 4 MiB; refusing to parse it")
    path = tmp_path / "big.yaml"
    path.write_text(big)
    with pytest.raises(PolicyInvalid) as info:
        load_policy_file(path)
    (problem,) = info.value.problems
    assert (problem.file, problem.line, problem.col) == (str(path), 1, 1)
    assert "over the 4 MiB limit; refusing to read it" in problem.message


def test_deep_nesting_is_refused():
    assert one("version: 1\nallow: " + "[" * 5000 + "]" * 5000 + "\n") == (
        1, 1, "the policy nests lists or mappings too deeply; refusing it")


@pytest.mark.parametrize(
    ("text", "where", "expected"),
    [
        ("version: 1\naction: !!python/object/apply:os.system ['touch /tmp/pwned']\n", (2, 9),
         "the YAML tag '!!python/object/apply:os.system' is not allowed in a policy"),
        ("!!python/object:__main__.Evil\nversion: 1\n", (1, 1),
         "the YAML tag '!!python/object:__main__.Evil' is not allowed"),
        ("version: 1\nallow: !!python/name:os.system\n", (2, 8),
         "the YAML tag '!!python/name:os.system' is not allowed"),
        ("version: 1\naction: !custom enforce\n", (2, 9), "the YAML tag '!custom' is not allowed"),
        ("version: 1\nallow: !!set {a.example: null}\n", (2, 8), "the YAML tag '!!set' is not allowed"),
        ("version: 1\naction: !!binary ZW5mb3JjZQ==\n", (2, 9), "the YAML tag '!!binary' is not allowed"),
        ("version: 1\nbase: &b {ports: [80]}\n<<: *b\n", (3, 1), "YAML merge keys (<<) are not supported"),
        ("version: !!int one\n", (1, 10), "'one' is not a valid int"),
        ("version: 1\nlimits: {connect_timeout: !!float fast}\n", (2, 27), "'fast' is not a valid float"),
        ("version: 1\naction: 2001-13-45\n", (2, 9), "'2001-13-45' is not a valid timestamp"),
    ],
)
def test_unsafe_or_broken_yaml_tags_are_refused(text, where, expected, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    found = problems(text)
    assert (found[0][0], found[0][1]) == where
    assert expected in found[0][2], found
    assert not (tmp_path / "pwned").exists()


def test_a_file_that_is_not_utf8(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_bytes(b"version: 1\nallow: [caf\xe9.example]\n")
    with pytest.raises(PolicyInvalid) as info:
        load_policy_file(path)
    assert "the policy is not UTF-8 text" in info.value.problems[0].message


def test_a_missing_file(tmp_path):
    with pytest.raises(PolicyInvalid) as info:
        load_policy_file(tmp_path / "nope.yaml")
    (problem,) = info.value.problems
    assert problem.line == 1 and "cannot read the policy: No such file or directory" in problem.message


# ---- rules that can never match are errors (issue 10, item 2) ----------------------------


@pytest.mark.parametrize(
    ("key", "pattern", "suffix"),
    [
        ("allow", '"*.internal"', "internal"),
        ("allow", '"**.localhost"', "localhost"),
        ("allow", '"*.local"', "local"),
        ("allow", '"*.svc.cluster.local"', "cluster.local"),
        ("allow", '"**.corp"', "corp"),
        ("allow", '"*.home.arpa"', "home.arpa"),
        ("deny", '"*.internal"', "internal"),
        ("deny", '"**.onion"', "onion"),
        ("deny", '"*.a.b.test"', "test"),
    ],
)
def test_a_wildcard_over_internal_names_only_is_an_error(key, pattern, suffix):
    line, col, message = one(f"version: 1\n{key}:\n  - example.org\n  - {pattern}\n")
    assert (line, col) == (4, 5)
    assert message.startswith(f"{key} entry {pattern.strip(chr(34))!r} can never match: every name it covers is an "
                              f"internal name (*.{suffix})")
    if key == "allow":
        assert "only an exact entry makes an internal name reachable" in message
    else:
        assert message.endswith("remove it")


@pytest.mark.parametrize(
    "text",
    [
        # exact internal names under allow: reachable by design
        'version: 1\nallow: ["*", searxng, wiki.internal, metadata]\n',
        # public names too
        'version: 1\nallow: ["**.com", "*.internal.example.com", "**.metadata", "*.kubernetes.default"]\n',
        'version: 1\ndeny: ["*.example.local.com", "**.localhost.example"]\n',
        # deny still bites an internal name that allow lists exactly
        'version: 1\nallow: [wiki.internal, searxng]\ndeny: ["*.internal.example"]\nclients:\n'
        '  - name: a\n    sources: [10.0.0.0/8]\n    deny: ["*.internal", searxng]\n',
    ],
)
def test_patterns_that_can_still_match_load(text):
    load_policy_text(text, "p.yaml")


@pytest.mark.parametrize(("name", "why"), [("localhost", "a reserved internal name"), ("redis", "a single-label name"),
                                           ("db.svc", "an internal name (*.svc)")])
def test_an_exact_internal_name_under_deny_alone_is_an_error(name, why):
    line, col, message = one(f"version: 1\ndeny: [example.org, {name}]\n")
    assert (line, col) == (2, 21)
    assert message.startswith(f"deny entry {name!r} can never match: {name} is {why}")


def test_a_top_level_deny_of_internal_names_counts_when_a_profile_allows_one_exactly():
    text = ('version: 1\ndeny: ["*.internal", searxng]\nclients:\n  - name: a\n    sources: [10.0.0.0/8]\n'
            '    allow: ["*", wiki.internal, searxng]\n')
    # Profile a inherits the deny list, which then denies both: the deny entries
    # do match there (the profile's allow entries are the dead ones).
    found = problems(text)
    assert [(line, col) for line, col, _ in found] == [(6, 18), (6, 33)]
    assert all("the deny rule" in message for _, _, message in found)
    own_deny = text + "    deny: [evil.example]\n"  # its own deny list: it inherits none
    found = problems(own_deny)
    assert [(line, col) for line, col, _ in found] == [(2, 8), (2, 22)]
    assert all("can never match: " in message and "which Sluice refuses" in message for _, _, message in found)


def test_internal_wildcards_are_checked_in_profiles():
    text = 'version: 1\nclients:\n  - name: a\n    sources: [10.0.0.0/8]\n    allow: ["**.lan"]\n'
    line, col, message = one(text)
    assert (line, col) == (5, 13) and "allow entry '**.lan' can never match" in message


@pytest.mark.parametrize(
    ("cidr", "named"),
    [
        ("10.0.0.0/8", "10.0.0.0/8 is private-use"),
        ("10.1.2.3", "10.0.0.0/8 is private-use"),
        ("169.254.169.254", "169.254.169.254/32 is link-local (cloud metadata)"),
        ("127.0.0.0/8", "127.0.0.0/8 is loopback"),
        ("203.0.113.0/24", "203.0.113.0/24 is documentation (TEST-NET-3)"),
        ("198.18.0.0/15", "198.18.0.0/15 is benchmarking"),
        ("fd00::/8", "fc00::/7 is unique local"),
        ("2001:db8::/32", "2001:db8::/32 is documentation"),
        ("::ffff:0:0/96", "::ffff:0.0.0.0/96 is IPv4-mapped"),
    ],
)
def test_an_allow_cidr_that_is_wholly_non_public_is_an_error(cidr, named):
    line, col, message = one(f'version: 1\nallow: [example.org, "{cidr}"]\n')
    assert (line, col) == (2, 22)
    assert message.startswith(f"allow entry {cidr!r} can never match: every address in it is non-public ({named}")
    assert "no `private_networks` entry opens any of it" in message


@pytest.mark.parametrize(
    "text",
    [
        # some address is public
        'version: 1\nallow: ["8.8.8.0/24", "0.0.0.0/0", "::/0", "100.0.0.0/8", "2606:4700::/32"]\n',
        'version: 1\nallow: ["10.0.0.0/8"]\nprivate_networks: ["10.0.0.5/32:8080"]\n',  # partly opened
        'version: 1\nallow: ["10.0.0.5"]\nprivate_networks: ["10.0.0.0/24"]\n',
        'version: 1\ndeny: ["10.0.0.0/8", "169.254.169.254"]\n',  # deny CIDRs are belt and braces, not errors
        # a profile that inherits the top-level allow list opens it
        'version: 1\nallow: ["10.9.0.0/16"]\nclients:\n  - name: a\n    sources: [10.20.0.0/16]\n    private_networks: '
        '["10.9.1.0/24"]\n',
    ],
)
def test_allow_cidrs_that_can_match_load(text):
    load_policy_text(text, "p.yaml")


def test_a_top_level_allow_cidr_opened_only_by_a_profile_with_its_own_allow_is_an_error():
    text = ('version: 1\nallow: ["10.9.0.0/16"]\nclients:\n  - name: a\n    sources: [10.20.0.0/16]\n'
            '    allow: ["*"]\n    private_networks: ["10.9.1.0/24"]\n')
    line, col, message = one(text)
    assert (line, col) == (2, 9) and "allow entry '10.9.0.0/16' can never match" in message


def test_a_profile_allow_cidr_is_checked_against_its_own_private_networks():
    ok = ('version: 1\nclients:\n  - name: a\n    sources: [10.20.0.0/16]\n    allow: ["10.9.0.0/16"]\n    '
          'private_networks: ["10.9.0.0/16"]\n')
    load_policy_text(ok, "p.yaml")
    bad = ('version: 1\nprivate_networks: ["10.8.0.0/16"]\nclients:\n  - name: a\n    sources: [10.20.0.0/16]\n    '
           'allow: ["10.9.0.0/16"]\n')
    line, col, message = one(bad)
    assert (line, col) == (6, 13) and "allow entry '10.9.0.0/16' can never match" in message


def test_two_profiles_with_the_same_source_network_is_an_error():
    text = """\
version: 1
clients:
  - name: ci
    sources: [10.20.0.0/16, "fd00:20::/64"]
  - name: builders
    sources: [10.30.0.0/16, "fd00:20:0:0::/64"]
"""
    line, col, message = one(text)
    assert (line, col) == (6, 29)
    assert message == ("sources entry 'fd00:20:0:0::/64' is also in client profile 'ci' (line 4): a client from there "
                       "always matches 'ci', the first profile, so this entry never matches; give each network to one "
                       "profile")


def test_nested_source_networks_are_fine_the_most_specific_wins():
    load_policy_text("version: 1\nclients:\n  - name: a\n    sources: [10.0.0.0/8]\n  - name: b\n    sources: "
                     "[10.20.0.0/16]\n", "p.yaml")
