"""`sluice policy check` and `sluice policy hash-password`."""

from __future__ import annotations

import io
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sluice.policy.clients import verify_password
from sluice.policy.loader import load_policy_text

ROOT = Path(__file__).resolve().parents[2]


# ---- check -----------------------------------------------------------------------


def test_check_ok_prints_a_summary(cli, write):
    path = write("p.yaml", """\
version: 1
allow: ["**.example.org", pypi.org]
deny: [bad.example.org]
methods: [GET, HEAD]
private_networks: ["10.0.0.5/32:8080"]
dns: {nameservers: ["127.0.0.53"], timeout: 2s}
require_client: true
clients:
  - name: ci
    sources: [10.20.0.0/16]
    action: report
""")
    result = cli(["policy", "check", path])
    assert result.code == 0 and result.err == ""
    assert result.out.splitlines() == [
        f"{path}: OK (enforce mode)",
        "  reaches 2 allowed host pattern(s) on ports 80, 443, except 1 denied pattern(s)",
        "  methods: GET, HEAD",
        "  private networks opened: 10.0.0.5/32:8080",
        "  limits: connect 10s, request 30s, idle 1m; bodies: request 1MiB, response 10MiB; tunnels: no byte cap, no "
        "time cap",
        "  quotas: 16 upstream sockets per client connection",
        "  unreachable: https:// (clients reach HTTPS through CONNECT tunnels; CONNECT is not in methods and no host "
        "is intercepted)",
        "  DNS: 127.0.0.53:53, timeout 2s",
        "  client 'ci' (sources 10.20.0.0/16):",
        "    reaches 2 allowed host pattern(s) on ports 80, 443, except 1 denied pattern(s)",
        "    report mode: host and method refusals are logged, not enforced",
        "    methods: GET, HEAD",
        "    private networks opened: 10.0.0.5/32:8080",
        "    limits: connect 10s, request 30s, idle 1m; bodies: request 1MiB, response 10MiB; tunnels: no byte cap, no "
        "time cap",
        "    quotas: 16 upstream sockets per client connection",
        "  clients matching no profile are refused (407)",
        "  request heads (every client): at most 64KiB and 100 fields, whole within 10s",
        "  every client: HTTP/2 at most 100 streams per connection, 1MiB held per stream; IPv6 clients counted per /64",
    ]


def test_check_the_default_policy(cli):
    result = cli(["policy", "check", ROOT / "sluice" / "starter_policy.yaml"])
    assert result.code == 0
    assert "reaches any public host on ports 80, 443" in result.out
    assert "no private networks opened (public internet only)" in result.out


def test_check_names_internal_hosts_opened_next_to_star(cli, write):
    path = write("p.yaml", 'version: 1\nallow: ["*", searxng]\n')
    out = cli(["policy", "check", path]).out
    assert "reaches any public host and the internal name(s) searxng on ports 80, 443" in out


def test_check_invalid_prints_file_line_col_and_exits_1(cli, write):
    path = write("p.yaml", "version: 1\nalow: [x]\nclients:\n  - name: a\n  - name: a\n    sources: [10.0.0.1/8]\n")
    result = cli(["policy", "check", path])
    assert result.code == 1 and result.out == ""
    assert result.err.splitlines() == [
        f"{path}:2:1: unknown key 'alow' in the policy; did you mean 'allow'?",
        f"{path}:4:5: client profile 'a' matches nobody: give it `users` or `sources`",
        f"{path}:5:11: client profile 'a' is defined twice (first at line 4)",
        f"{path}: 3 problem(s)",
    ]


@pytest.mark.parametrize("content", ["", b"\xff\xfe\x00", "version: [1\n", "!!python/object:os.system {}\n"])
def test_check_never_prints_a_traceback(cli, write, content):
    path = write("p.yaml", content)
    result = cli(["policy", "check", path])
    assert result.code == 1 and "Traceback" not in result.err
    assert re.match(rf"^{re.escape(str(path))}:\d+:\d+: ", result.err)


def test_check_missing_file_and_directory(cli, tmp_path):
    result = cli(["policy", "check", tmp_path / "nope.yaml"])
    assert result.code == 1 and result.err.startswith(f"{tmp_path / 'nope.yaml'}:1:1: cannot read the policy")
    result = cli(["policy", "check", tmp_path])
    assert result.code == 1 and "cannot read the policy" in result.err


def test_check_survives_a_loader_bug(cli, write, monkeypatch):
    def broken(path):
        raise RuntimeError("boom")

    monkeypatch.setattr("sluice.policy_cli.read_policy_file", broken)
    path = write("p.yaml", "version: 1\n")
    result = cli(["policy", "check", path])
    assert result.code == 1
    assert result.err.splitlines()[0] == f"{path}:1:1: cannot load the policy (RuntimeError: boom); please report this"


def test_policy_without_subcommand_is_a_usage_error(cli):
    assert cli(["policy"]).code == 2
    assert cli(["policy", "frobnicate"]).code == 2


# ---- hash-password ---------------------------------------------------------------------


class FakeStdin(io.StringIO):
    def __init__(self, text: str, tty: bool = False) -> None:
        super().__init__(text)
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.mark.parametrize(("stdin", "password"), [("s3cret\n", "s3cret"), ("s3cret", "s3cret"), ("s3cret\r\n", "s3cret"),
                                                  ("with space \n", "with space ")])
def test_hash_password_from_stdin(cli, monkeypatch, stdin, password):
    monkeypatch.setattr("sys.stdin", FakeStdin(stdin))
    result = cli(["policy", "hash-password"])
    assert result.code == 0 and result.err == ""
    verifier = result.out.strip()
    assert result.out.count("\n") == 1 and verifier.startswith("pbkdf2_sha256$200000$")
    assert verify_password(verifier, password) and not verify_password(verifier, password + "x")
    # and the policy takes it
    policy = load_policy_text(f'version: 1\nclients:\n  - name: a\n    users: {{bot: {{password_hash: '
                              f'"{verifier}"}}}}\n')
    assert policy.clients[0].credentials == (("bot", verifier),)


def test_hash_password_refuses_an_empty_password(cli, monkeypatch):
    monkeypatch.setattr("sys.stdin", FakeStdin("\n"))
    result = cli(["policy", "hash-password"])
    assert result.code == 2 and result.out == ""
    assert result.err.strip() == "sluice policy hash-password: error: the password is empty"


def test_hash_password_prompts_twice_on_a_terminal(cli, monkeypatch):
    answers = iter(["tty-secret", "tty-secret"])
    prompts = []

    def fake_getpass(prompt=""):
        prompts.append(prompt)
        return next(answers)

    monkeypatch.setattr("sys.stdin", FakeStdin("", tty=True))
    monkeypatch.setattr("getpass.getpass", fake_getpass)
    result = cli(["policy", "hash-password"])
    assert result.code == 0 and len(prompts) == 2
    assert verify_password(result.out.strip(), "tty-secret")


def test_hash_password_mismatch_on_a_terminal(cli, monkeypatch):
    answers = iter(["one", "two"])
    monkeypatch.setattr("sys.stdin", FakeStdin("", tty=True))
    monkeypatch.setattr("getpass.getpass", lambda prompt="": next(answers))
    result = cli(["policy", "hash-password"])
    assert result.code == 2 and result.out == "" and "do not match" in result.err


def test_hash_password_eof_on_a_terminal(cli, monkeypatch):
    def eof(prompt=""):
        raise EOFError

    monkeypatch.setattr("sys.stdin", FakeStdin("", tty=True))
    monkeypatch.setattr("getpass.getpass", eof)
    result = cli(["policy", "hash-password"])
    assert result.code == 2 and "could not read a password" in result.err


# ---- warnings: what the proxy cannot enforce as written (issue 10, item 1) -------------------

UNSEEN = """\
version: 1
allow: [pypi.org, "**.github.com", "*.example.org"]
methods: [GET, HEAD, CONNECT]
strip_request_headers: [Cookie]
intercept: ["**.github.com"]
clients:
  - name: same
    sources: [10.1.0.0/16]
  - name: ci
    sources: [10.20.0.0/16]
    methods: [GET, CONNECT]
    intercept: ["*"]
  - name: bot
    users: {bot: {password_hash: "BOT_VERIFIER"}}
    allow: ["*"]
""".replace("BOT_VERIFIER", "pbkdf2_sha256$200000$fcf7938b15596eeef59b6826ab15c393$"
                            "933006f51aa2a740be1a48d798464a2597fcb632eee42dad60e1cfb6b8e23c39")


def real_sluice(*args) -> subprocess.CompletedProcess:
    return subprocess.run([str(Path(sys.executable).parent / "sluice"), *map(str, args)], capture_output=True,
                          text=True, timeout=60, env={"PATH": "/usr/bin:/bin", "HOME": "/nonexistent"})


def test_check_warns_about_methods_and_headers_for_https_hosts_not_intercepted(write):
    path = write("p.yaml", UNSEEN)
    result = real_sluice("policy", "check", path)
    assert result.returncode == 0 and result.stdout.startswith(f"{path}: OK (enforce mode)")
    assert result.stderr.splitlines() == [
        f"{path}:3:1: warning: methods [CONNECT, GET, HEAD] cannot be enforced on https:// URLs to pypi.org, "
        "*.example.org (not under `intercept`): such a request is a CONNECT tunnel whose method the proxy never sees "
        "(a DELETE passes inside it). Intercept those hosts (`intercept:`; the client must then trust `sluice ca`), "
        "or leave CONNECT out of `methods` to refuse those tunnels",
        f"{path}:4:1: warning: strip_request_headers [cookie] cannot be applied on https:// URLs to pypi.org, "
        "*.example.org (not under `intercept`): such a request is a CONNECT tunnel whose headers the proxy never sees. "
        "Intercept those hosts (`intercept:`; the client must then trust `sluice ca`), or leave CONNECT out of "
        "`methods` to refuse those tunnels",
        # profile `same` inherits everything (warned once, above); `ci` intercepts every host
        f"{path}:3:1: warning: client profile 'bot': methods [CONNECT, GET, HEAD] cannot be enforced on https:// URLs "
        "to any public host not under `intercept`: such a request is a CONNECT tunnel whose method the proxy never "
        "sees (a DELETE passes inside it). Intercept those hosts (`intercept:`; the client must then trust "
        "`sluice ca`), or leave CONNECT out of `methods` to refuse those tunnels",
        f"{path}:4:1: warning: client profile 'bot': strip_request_headers [cookie] cannot be applied on https:// URLs "
        "to any public host not under `intercept`: such a request is a CONNECT tunnel whose headers the proxy never "
        "sees. Intercept those hosts (`intercept:`; the client must then trust `sluice ca`), or leave CONNECT out of "
        "`methods` to refuse those tunnels",
        f"{path}: 4 warning(s)",
    ]
    assert "intercepts TLS (methods and headers checked inside HTTPS) for: **.github.com" in result.stdout


def test_check_strict_fails_on_warnings(write):
    path = write("p.yaml", UNSEEN)
    result = real_sluice("policy", "check", "--strict", path)
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.splitlines()[-1] == f"{path}: 4 warning(s); --strict makes them errors"
    assert len(result.stderr.splitlines()) == 5


@pytest.mark.parametrize(
    "text",
    [
        "version: 1\nmethods: [GET, HEAD, CONNECT]\nintercept: ['*']\n",
        "version: 1\nallow: [a.example, '**.b.example', '*.c.example']\nmethods: [GET, CONNECT]\n"
        "intercept: ['**.a.example', b.example, '*.b.example', '**.c.example']\n",
        "version: 1\nallow: [a.example]\nmethods: [GET, HEAD, CONNECT]\nintercept: [a.example]\n"
        "strip_request_headers: [Cookie]\n",
        "version: 1\nallow: ['**.github.com']\n",  # every method: nothing claimed
    ],
)
def test_check_strict_passes_policies_that_claim_only_what_is_enforced(write, text):
    path = write("p.yaml", text)
    result = real_sluice("policy", "check", "--strict", path)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""


@pytest.mark.parametrize(
    ("text", "who"),
    [
        ("version: 1\nmethods: [GET, HEAD]\nstrip_request_headers: [Cookie]\n", "the top level"),  # no CONNECT
        ("version: 1\nmethods: [GET, HEAD, POST, PUT, DELETE, OPTIONS, TRACE, PATCH]\nclients:\n"
         "  - name: ci\n    sources: [10.0.0.0/8]\n    methods: [GET]\n", "client 'ci'"),  # refuses every tunnel
        ("version: 1\nports: [80]\n", "the top level"),
    ],
)
def test_check_strict_fails_a_policy_that_reaches_no_https(write, text, who):
    path = write("p.yaml", text)
    assert real_sluice("policy", "check", path).returncode == 0  # without --strict: a summary line only
    result = real_sluice("policy", "check", "--strict", path)
    assert result.returncode == 1 and result.stdout == ""
    assert f"{path}: {who} can reach no https:// host: " in result.stderr
    assert result.stderr.splitlines()[-1] == (f"{path}: --strict fails a policy under which a client can reach no "
                                              "https:// at all")


@pytest.mark.parametrize(
    ("text", "where"),
    [
        # **.b.example also names b.example itself, which only *.b.example does not cover
        ("version: 1\nallow: ['**.b.example']\nmethods: [GET, CONNECT]\nintercept: ['*.b.example']\n", "**.b.example"),
        ("version: 1\nallow: ['*.c.example']\nmethods: [GET, CONNECT]\nintercept: [x.c.example]\n", "*.c.example"),
        ("version: 1\nallow: ['8.8.8.0/24']\nmethods: [GET, CONNECT]\nintercept: ['8.8.8.0/24']\n", "8.8.8.0/24"),
        ("version: 1\naction: report\nmethods: [GET, CONNECT]\n", "any public host (nothing is under `intercept`)"),
    ],
)
def test_check_warns_when_intercept_leaves_some_host_out(cli, write, text, where):
    path = write("p.yaml", text)
    result = cli(["policy", "check", path])
    assert result.code == 0
    assert f"cannot be enforced on https:// URLs to {where}" in result.err


def test_check_strict_on_an_invalid_policy_reports_its_problems(cli, write):
    path = write("p.yaml", "version: 1\nallow: ['*.internal']\n")
    result = cli(["policy", "check", "--strict", path])
    assert result.code == 1 and result.err.splitlines() == [
        f"{path}:2:9: allow entry '*.internal' can never match: every name it covers is an internal name (*.internal), "
        "which Sluice refuses before any rule is read; only an exact entry makes an internal name reachable "
        "(e.g. 'wiki.internal'), never a wildcard",
        f"{path}: 1 problem(s)",
    ]
