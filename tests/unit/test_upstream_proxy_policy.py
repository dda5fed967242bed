"""`upstream_proxy` in the policy: the loader (URL, credentials from a file or
an environment variable, never inline; per profile, null for direct) and what
`sluice policy check` says about it."""

from __future__ import annotations

import base64

import pytest

from sluice.policy.loader import PolicyInvalid, load_policy_text, parse_upstream_proxy_url

SECRET = "alice:s3cr3t-parent-never-shown"


def load(text: str, files: dict[str, str] | None = None, environ: dict[str, str] | None = None):
    files = files or {}

    def read_secret(path: str) -> str:
        if path not in files:
            raise FileNotFoundError(2, "No such file or directory")
        return files[path]

    return load_policy_text(text, "p.yaml", read_secret, environ or {})


def problems(text: str, **kw) -> list[str]:
    with pytest.raises(PolicyInvalid) as e:
        load(text, **kw)
    return [str(p) for p in e.value.problems]


def test_a_parent_with_file_credentials_is_basic_auth():
    policy = load("version: 1\nupstream_proxy:\n  url: http://corp-proxy:3128\n  credentials: {file: parent}\n",
                  files={"parent": SECRET})
    parent = policy.rules.upstream_proxy
    assert (parent.host, parent.port, parent.url) == ("corp-proxy", 3128, "http://corp-proxy:3128")
    assert parent.authorization.reveal() == "Basic " + base64.b64encode(SECRET.encode()).decode()
    assert parent.credential_source == "file parent" and parent.origin == "p.yaml:3"
    assert SECRET not in repr(policy) and "s3cr3t" not in repr(policy)


def test_env_credentials_with_a_format_are_sent_as_written():
    policy = load('version: 1\nupstream_proxy: {url: "http://10.0.0.2:3128", '
                  'credentials: {env: PARENT_TOKEN, format: "Bearer {}"}}\n', environ={"PARENT_TOKEN": "tok"})
    assert policy.rules.upstream_proxy.authorization.reveal() == "Bearer tok"
    assert policy.rules.upstream_proxy.host == "10.0.0.2"


def test_profiles_inherit_replace_or_clear_the_parent():
    policy = load("""\
version: 1
upstream_proxy: {url: "http://corp-proxy:3128"}
clients:
  - name: inherits
    sources: [10.1.0.0/16]
  - name: own
    sources: [10.2.0.0/16]
    upstream_proxy: {url: "http://[fd00::5]:8080"}
  - name: direct
    sources: [10.3.0.0/16]
    upstream_proxy: null
""")
    by_name = {p.name: p.rules.upstream_proxy for p in policy.clients}
    assert policy.rules.upstream_proxy.authorization is None
    assert by_name["inherits"] == policy.rules.upstream_proxy
    assert (by_name["own"].host, by_name["own"].port) == ("fd00::5", 8080)
    assert by_name["direct"] is None


@pytest.mark.parametrize("url, message", [
    ("https://corp:3128", "is a https:// parent; Sluice speaks only plain http://"),
    ("socks5://corp:1080", "is a socks5:// parent"),
    ("http://corp", "has no port"),
    ("http://corp:0", "outside 1-65535"),
    ("http://corp:3128/path", "no path, query or fragment"),
    ("ftp://corp:21", "must be http://HOST:PORT"),
    ("corp:3128", "must be http://HOST:PORT"),
    ("http://-x-:3128", "neither an IP address nor a DNS name"),
    ("http://corp :3128", "spaces or control characters"),
])
def test_bad_urls_are_clear_problems(url, message):
    found = problems(f'version: 1\nupstream_proxy: {{url: "{url}"}}\n')
    assert len(found) == 1 and found[0].startswith("p.yaml:2:") and message in found[0], found


def test_credentials_in_the_url_are_refused_without_quoting_them():
    found = problems('version: 1\nupstream_proxy: {url: "http://alice:pw-in-url@corp:3128"}\n')
    assert len(found) == 1 and "carries credentials; they never go in the policy" in found[0]
    assert "pw-in-url" not in found[0]


@pytest.mark.parametrize("text, message", [
    ('upstream_proxy: {credentials: {file: parent}}', "upstream_proxy needs url: http://HOST:PORT"),
    ('upstream_proxy: "http://corp:3128"', "upstream_proxy must be a mapping: {url: http://HOST:PORT}"),
    ('upstream_proxy: {url: "http://corp:3128", proxy: x}', "unknown key"),
    ('upstream_proxy: {url: "http://corp:3128", credentials: "alice:inline-pw"}', "is written inline"),
    ('upstream_proxy: {url: "http://corp:3128", credentials: {file: missing}}',
     "upstream_proxy.credentials: cannot read 'missing' (No such file or directory)"),
    ('upstream_proxy: {url: "http://corp:3128", credentials: {env: NOT_SET}}',
     "upstream_proxy.credentials: the environment variable 'NOT_SET' is not set"),
    ('upstream_proxy: {url: "http://corp:3128", credentials: {file: nocolon}}', "must hold user:password"),
    ('upstream_proxy: {url: "http://corp:3128", credentials: {file: parent, env: X}}', "exactly one of file"),
])
def test_bad_blocks_are_clear_problems(text, message):
    found = problems(f"version: 1\n{text}\n", files={"parent": SECRET, "nocolon": "justatoken"})
    assert len(found) == 1 and message in found[0], found
    assert "inline-pw" not in found[0] and "justatoken" not in found[0]


def test_parse_upstream_proxy_url_canonicalises():
    assert parse_upstream_proxy_url("http://CORP.Example.:3128/") == ("corp.example", 3128)
    assert parse_upstream_proxy_url("http://[FD00::0005]:3128") == ("fd00::5", 3128)


def test_policy_check_summary_names_the_parent_and_never_the_secret(cli, tmp_path):
    (tmp_path / "parent").write_text(SECRET + "\n")
    path = tmp_path / "p.yaml"
    path.write_text("version: 1\nupstream_proxy:\n  url: http://corp-proxy:3128\n  credentials: {file: parent}\n"
                    "clients:\n  - name: direct\n    sources: [10.3.0.0/16]\n    upstream_proxy: null\n")
    result = cli(["policy", "check", path])
    assert result.code == 0, result.err
    lines = result.out.splitlines()
    parent_lines = [line for line in lines if "parent proxy" in line]
    assert parent_lines == [
        f"  through the parent proxy http://corp-proxy:3128 (CONNECT to each pinned IP, never a name, credentials "
        f"from file parent; {path}:3)"], lines
    assert "s3cr3t" not in result.out + result.err


@pytest.mark.parametrize("text", [
    'upstream_proxy: {url: "https://corp:3128"}',
    'upstream_proxy: {url: "http://corp:3128", credentials: {file: /nonexistent/parent}}',
    "upstream_proxy: [1, 2]",
])
def test_policy_check_reports_problems_without_a_traceback(cli, tmp_path, text):
    path = tmp_path / "p.yaml"
    path.write_text(f"version: 1\n{text}\n")
    result = cli(["policy", "check", path])
    assert result.code == 1 and "Traceback" not in result.err and f"{path}:2:" in result.err, result.err
