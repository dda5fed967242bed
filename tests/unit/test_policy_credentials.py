"""Proxy-held credentials in the policy: the loader (`credentials` blocks,
values from files and environment variables, never inline), the redacted
Secret, and which entry applies to a (rules, host, scheme) as a pure function."""

from __future__ import annotations

import os

import pytest

from sluice.policy.credentials import Secret, apply_to, credential_for
from sluice.policy.loader import PolicyInvalid, load_policy_file, load_policy_text

SECRET = "s3cr3t-VALUE-never-shown"
ENV = {"GH_TOKEN": "gh-" + SECRET}

BASE = """\
version: 1
intercept: [api.example.com, "**.github.com", shared.example.com]
credentials:
  - hosts: [api.example.com]
    set_headers:
      X-Api-Key: {file: key.txt}
  - hosts: ["**.github.com"]
    set_headers:
      Authorization: {env: GH_TOKEN, format: "Bearer {}"}
  - hosts: [shared.example.com]
    set_headers:
      X-Shared: {env: GH_TOKEN}
    allow_plain_http: true
clients:
  - name: ci
    sources: [10.1.0.0/16]
    credentials:
      - hosts: ["**.github.com"]
        set_headers:
          Authorization: {env: GH_TOKEN, format: "token {}"}
  - name: untrusted
    sources: [10.2.0.0/16]
    credentials:
      - hosts: [api.example.com]
        set_headers: {}
"""


def load(text: str = BASE, *, files: dict[str, str] | None = None, environ: dict[str, str] | None = None,
         file="p.yaml"):
    files = {"key.txt": SECRET} if files is None else files

    def read_secret(path: str) -> str:
        if path not in files:
            raise FileNotFoundError(2, "No such file or directory")
        return files[path]

    return load_policy_text(text, file, read_secret=read_secret, environ=ENV if environ is None else environ)


def problems(text: str, **kw) -> list[str]:
    with pytest.raises(PolicyInvalid) as info:
        load(text, **kw)
    return [str(p) for p in info.value.problems]


def reveal(entry) -> dict[str, str]:
    return {h.name: h.value.reveal() for h in entry.headers}


def test_values_come_from_the_file_and_the_environment_with_format():
    policy = load()
    entry, refusal = apply_to(policy.rules, "api.example.com", "https")
    assert refusal is None and reveal(entry) == {"X-Api-Key": SECRET}
    assert entry.origin == "p.yaml:4"
    entry, _ = apply_to(policy.rules, "github.com", "https")
    assert reveal(entry) == {"Authorization": "Bearer gh-" + SECRET}
    entry, _ = apply_to(policy.rules, "API.GitHub.com.", "https")  # matched as a normalised host
    assert entry.origin == "p.yaml:7"


def test_no_entry_for_other_hosts():
    policy = load()
    for host in ("example.com", "api.example.com.evil.net", "xapi.example.com", "github.com.evil.net", "1.2.3.4",
                 "not a host"):
        assert credential_for(policy.rules, host) is None, host
        assert apply_to(policy.rules, host, "https") == (None, None)


def test_plain_http_is_refused_unless_the_entry_allows_it():
    policy = load()
    entry, refusal = apply_to(policy.rules, "api.example.com", "http")
    assert entry is None and refusal.reason.value == "credential_plain_http" and refusal.rule == "p.yaml:4"
    assert SECRET not in refusal.message
    entry, refusal = apply_to(policy.rules, "shared.example.com", "http")
    assert refusal is None and entry.origin == "p.yaml:10"


def test_a_profile_entry_replaces_the_top_levels_with_the_same_hosts_text():
    policy = load()
    ci, untrusted = policy.clients
    assert reveal(credential_for(ci.rules, "x.github.com")) == {"Authorization": "token gh-" + SECRET}
    assert credential_for(ci.rules, "x.github.com").origin == "p.yaml:18"
    assert credential_for(ci.rules, "api.example.com").origin == "p.yaml:4"  # inherited
    # An empty set_headers drops the top level's entry for that profile.
    assert apply_to(untrusted.rules, "api.example.com", "https") == (None, None)
    assert apply_to(untrusted.rules, "api.example.com", "http") == (None, None)
    assert credential_for(untrusted.rules, "github.com").origin == "p.yaml:7"


def test_the_secret_never_shows_in_repr_str_or_format():
    policy = load()
    for text in (repr(policy), str(policy), f"{policy.rules}", repr(policy.clients), repr(policy.rules.credentials)):
        assert SECRET not in text
    secret = Secret(SECRET)
    assert SECRET not in repr(secret) + str(secret) + f"{secret}" + f"{secret!r}" + "%s" % secret  # noqa: UP031 (%-formatting is one of the ways checked)
    assert secret == Secret(SECRET) and secret != Secret("other") and secret.reveal() == SECRET


def test_an_inline_value_is_an_error_that_does_not_quote_it():
    found = problems("version: 1\nintercept: [a.example.com]\ncredentials:\n  - hosts: [a.example.com]\n"
                     f"    set_headers:\n      X-Key: {SECRET}\n")
    assert len(found) == 1 and "written inline" in found[0] and found[0].startswith("p.yaml:6:14:")
    assert SECRET not in found[0]
    found = problems("version: 1\nintercept: [a.example.com]\ncredentials:\n  - hosts: [a.example.com]\n"
                     f"    set_headers:\n      X-Key: {{value: {SECRET}}}\n")
    assert any("unknown key 'value'" in p for p in found) and not any(SECRET in p for p in found)


def test_a_credentials_host_that_is_not_intercepted_names_the_intercept_entry_to_add():
    text = BASE.replace('intercept: [api.example.com, "**.github.com", shared.example.com]',
                        'intercept: ["*.github.com", shared.example.com]')
    found = problems(text)
    assert any("'api.example.com'" in p and "add 'api.example.com' to the top level's `intercept`" in p
               for p in found), found
    assert any("'**.github.com'" in p and "add '**.github.com'" in p for p in found), found
    # A profile that narrows intercept below an inherited credentials host.
    text = BASE.replace("    sources: [10.1.0.0/16]\n",
                        "    sources: [10.1.0.0/16]\n    intercept: [\"**.github.com\"]\n")
    found = problems(text)
    assert any("client profile 'ci'" in p and "add 'api.example.com'" in p for p in found), found


@pytest.mark.parametrize("snippet,expected", [
    ('hosts: ["*"]\n    set_headers: {X-K: {file: key.txt}}', "may not be '*'"),
    ('hosts: [10.0.0.0/8]\n    set_headers: {X-K: {file: key.txt}}', "is a network"),
    ('hosts: []\n    set_headers: {X-K: {file: key.txt}}', "hosts is empty"),
    ('set_headers: {X-K: {file: key.txt}}', "needs hosts"),
    ('hosts: [a.example.com]', "needs set_headers"),
    ('hosts: [a.example.com]\n    set_headers: {Host: {file: key.txt}}', "a credential cannot set it"),
    ('hosts: [a.example.com]\n    set_headers: {"Bad Name": {file: key.txt}}', "is not a header name"),
    ('hosts: [a.example.com]\n    set_headers: {X-K: {file: key.txt, env: GH_TOKEN}}', "exactly one of file"),
    ('hosts: [a.example.com]\n    set_headers: {X-K: {env: NOT_SET}}', "'NOT_SET' is not set"),
    ('hosts: [a.example.com]\n    set_headers: {X-K: {file: missing.txt}}', "cannot read 'missing.txt'"),
    ('hosts: [a.example.com]\n    set_headers: {X-K: {env: GH_TOKEN, format: "Bearer"}}', "exactly one {}"),
    ('hosts: [a.example.com]\n    set_headers: {X-K: {env: GH_TOKEN, format: "{} {}"}}', "exactly one {}"),
    ('hosts: [a.example.com]\n    set_headers: {X-K: {file: key.txt}}\n    allow_plain_http: yes please',
     "true or false"),
    ('hosts: [a.example.com]\n    set_headers: {}', "set_headers is empty"),
    ('hosts: [a.example.com]\n    set_headers: {X-K: {file: key.txt}, x-k: {file: key.txt}}', "listed twice"),
    ('hosts: [a.example.com]\n    set_headers: {X-K: {file: key.txt}}\n    header: x', "did you mean"),
])
def test_entry_problems(snippet, expected):
    text = f"version: 1\nintercept: [a.example.com]\ncredentials:\n  - {snippet}\n"
    found = problems(text)
    assert any(expected in p for p in found), found
    assert not any(SECRET in p for p in found)


@pytest.mark.parametrize("content,expected", [
    ("", "is empty"),
    ("two\nlines", "line break"),
    (" padded", "white space"),
    ("bell\x07", "control character"),
])
def test_unusable_secret_values_are_refused_without_quoting_them(content, expected):
    text = ("version: 1\nintercept: [a.example.com]\ncredentials:\n  - hosts: [a.example.com]\n    set_headers: {X-K: "
            "{file: key.txt}}\n")
    found = problems(text, files={"key.txt": content})
    assert any(expected in p for p in found), found
    if content:
        assert not any(content in p for p in found)


def test_the_same_hosts_list_twice_in_one_scope_is_an_error():
    text = ("version: 1\nintercept: [a.example.com]\ncredentials:\n"
            "  - hosts: [a.example.com]\n    set_headers: {X-K: {file: key.txt}}\n"
            "  - hosts: [a.example.com]\n    set_headers: {X-L: {file: key.txt}}\n")
    assert any("already an entry (line 4)" in p for p in problems(text))


def test_text_only_loading_reads_no_value():
    policy = load_policy_text(BASE, "p.yaml")
    header = credential_for(policy.rules, "api.example.com").headers[0]
    assert not header.value.known and header.path.endswith("key.txt")
    with pytest.raises(LookupError):
        header.value.reveal()


def test_load_policy_file_reads_files_relative_to_the_policy_and_the_environment(tmp_path, monkeypatch):
    (tmp_path / "key.txt").write_text(SECRET + "\n")
    (tmp_path / "p.yaml").write_text(BASE)
    monkeypatch.setenv("GH_TOKEN", "from-env")
    policy = load_policy_file(tmp_path / "p.yaml")
    header = credential_for(policy.rules, "api.example.com").headers[0]
    assert header.value.reveal() == SECRET and header.path == str(tmp_path / "key.txt")
    assert reveal(credential_for(policy.rules, "github.com")) == {"Authorization": "Bearer from-env"}
    os.unlink(tmp_path / "key.txt")
    with pytest.raises(PolicyInvalid) as info:
        load_policy_file(tmp_path / "p.yaml")
    assert "cannot read 'key.txt'" in str(info.value)
    (tmp_path / "key.txt").mkdir()  # not a regular file: refused by the safe reader
    with pytest.raises(PolicyInvalid) as info:
        load_policy_file(tmp_path / "p.yaml")
    assert "not a regular file" in str(info.value)


def test_explain_and_check_name_the_entry_never_the_value():
    import asyncio

    from sluice.resolver import StaticResolver
    from sluice.policy_cli import decision_json, judge, parse_url, summarise

    policy = load()
    resolver = StaticResolver({"api.example.com": ["93.184.215.14"], "shared.example.com": ["93.184.215.14"]})
    for url, expected in (("https://api.example.com/", "allow"), ("http://api.example.com/", "refuse"),
                          ("http://shared.example.com/", "allow")):
        dest = parse_url(url)
        data = decision_json(asyncio.run(judge(policy, None, dest, resolver)), dest)
        assert data["decision"] == expected, (url, data)
        assert SECRET not in repr(data)
        if expected == "refuse":
            assert data["reason"] == "credential_plain_http" and data["credential"] is None
        else:
            assert data["credential"]["entry"] in ("p.yaml:4", "p.yaml:10")
            assert data["credential"]["headers"] in (["X-Api-Key"], ["X-Shared"])
    lines = "\n".join(summarise(policy))
    assert "sets credentials X-Api-Key (file key.txt) on api.example.com (p.yaml:4)" in lines
    assert "token gh-" not in lines and SECRET not in lines
