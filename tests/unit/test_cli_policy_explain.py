"""`sluice policy explain`: the decision as JSON, exit 0 allow / 3 refuse /
2 usage error / 1 invalid policy. Every name is answered by --resolve."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sluice.resolver import DnsFailure, Resolution

POLICY = """\
version: 1
allow: ["*", searxng]
deny:
  - "**.pastebin.com"
ports: [80, 443]
methods: [GET, HEAD, CONNECT]
private_networks: ["10.0.0.5/32:8080"]
clients:
  - name: ci
    sources: [10.20.0.0/16]
    methods: [GET]
  - name: watcher
    sources: [10.30.0.0/16]
    action: report
    allow: ["**.example.org"]
"""

KEYS = {"decision", "reason", "would_refuse", "rule", "profile", "host", "port", "path", "addresses", "address",
        "status", "detail",
        "message", "via", "note", "credential"}


@pytest.fixture
def policy(write):
    return write("policy.yaml", POLICY)


@pytest.fixture
def explain(cli, policy):
    def run(*args, expect_code=None):
        result = cli(["policy", "explain", "--policy", policy, *args])
        if expect_code is not None:
            assert result.code == expect_code, (result.out, result.err)
        return result

    return run


def decided(result) -> dict:
    data = json.loads(result.out)
    assert set(data) == KEYS
    assert result.code == (0 if data["decision"] == "allow" else 3)
    return data


# ---- allowed -------------------------------------------------------------------


def test_allowed_request(explain, policy):
    data = decided(explain("--resolve", "example.com=93.184.215.14", "https://example.com/path?q=1", expect_code=0))
    assert data == {
        "decision": "allow", "reason": None, "would_refuse": False, "rule": f"{policy}:2", "profile": None,
        "host": "example.com", "port": 443, "path": None, "addresses": ["93.184.215.14"], "address": "93.184.215.14",
        "status": None, "detail": None, "message": None, "via": "tunnel",
        "note": "tunnel: the method is not visible: the proxy sees only CONNECT example.com:443 (the host is not under "
                "`intercept`) and decides it by host, port and address; the GET inside, its path and headers are never "
                "seen. Add the host to `intercept` to have them checked.",
        "credential": None,
    }


def test_several_answers_and_the_one_dialled(explain):
    data = decided(explain("--resolve", "example.com=2606:2800:21f:cb07:6820:80da:af6b:8b2c",
                           "--resolve", "example.com=93.184.215.14,1.1.1.1", "http://example.com/"))
    assert data["addresses"] == ["2606:2800:21f:cb07:6820:80da:af6b:8b2c", "93.184.215.14", "1.1.1.1"]
    assert data["address"] == "93.184.215.14"  # IPv4 first, deterministic


def test_resolve_names_are_normalised_like_hosts(explain):
    data = decided(explain("--resolve", "EXAMPLE.com.=1.1.1.1", "http://Example.COM/"))
    assert data["decision"] == "allow" and data["host"] == "example.com"
    data = decided(explain("--resolve", "bücher.example=1.1.1.1", "http://xn--bcher-kva.example/"))
    assert data["decision"] == "allow" and data["host"] == "xn--bcher-kva.example"
    data = decided(explain("--resolve", "v6.example=[2606:4700::1111]", "http://v6.example/"))
    assert data["address"] == "2606:4700::1111"


def test_an_internal_name_listed_exactly_and_its_opened_address(explain, policy):
    data = decided(explain("--resolve", "searxng=10.0.0.5", "http://searxng:8080/search?q=x"))
    assert data["decision"] == "allow" and data["host"] == "searxng" and data["port"] == 8080
    assert data["rule"] == f"{policy}:2" and data["address"] == "10.0.0.5"
    data = decided(explain("http://10.0.0.5:8080/"))  # an IP literal needs no lookup
    assert data["decision"] == "allow" and data["rule"] == f"{policy}:2"  # the allow rule "*" comes first


def test_the_private_networks_entry_is_the_rule_when_no_allow_rule_matched(cli, write):
    path = write("open.yaml", 'version: 1\nprivate_networks:\n  - "10.0.0.0/8"\n  - "10.0.0.5/32:8080"\n')
    data = decided(cli(["policy", "explain", "--policy", path, "http://10.0.0.5:8080/"]))
    assert data["decision"] == "allow" and data["rule"] == f"{path}:4"
    data = decided(cli(["policy", "explain", "--policy", path, "http://10.9.9.9/"]))
    assert data["decision"] == "allow" and data["rule"] == f"{path}:3"
    # the /8 has no port, so it opens only the policy's ports
    data = decided(cli(["policy", "explain", "--policy", path, "http://10.9.9.9:8080/"]))
    assert data["reason"] == "port_not_allowed"


def test_connect_and_head(explain):
    assert decided(explain("--method", "CONNECT", "--resolve", "example.com=1.1.1.1",
                           "https://example.com/"))["decision"] == "allow"
    assert decided(explain("--method", "head", "--resolve", "example.com=1.1.1.1",
                           "https://example.com/"))["decision"] == "allow"


def test_an_empty_port_means_the_default(explain):
    assert decided(explain("--resolve", "example.com=1.1.1.1", "http://example.com:/"))["port"] == 80


# ---- refused ---------------------------------------------------------------------


def test_refusal_carries_reason_rule_status_and_message(explain, policy):
    data = decided(explain("--resolve", "x.pastebin.com=1.1.1.1", "https://x.pastebin.com/raw/abc", expect_code=3))
    assert data["decision"] == "refuse" and data["reason"] == "host_denied" and data["status"] == 403
    assert data["rule"] == f"{policy}:4"
    assert data["message"].startswith("Sluice refused this request: x.pastebin.com is denied by the rule "
                                      "'**.pastebin.com'.")
    assert "do not retry" in data["message"] and data["address"] is None


@pytest.mark.parametrize(
    ("url", "reason", "host"),
    [
        ("http://169.254.169.254/latest/meta-data/", "address_not_public", "169.254.169.254"),
        ("http://0x7f.1/", "address_not_public", "127.0.0.1"),
        ("http://2130706433/", "address_not_public", "127.0.0.1"),
        ("http://0177.0.0.1/", "address_not_public", "127.0.0.1"),
        ("http://127.1/", "address_not_public", "127.0.0.1"),
        ("http://127。0。0。1/", "address_not_public", "127.0.0.1"),
        ("http://①②⑦.⓪.⓪.①/", "address_not_public", "127.0.0.1"),
        ("http://[::1]/", "address_not_public", "::1"),
        ("http://[::ffff:169.254.169.254]/", "address_not_public", "::ffff:169.254.169.254"),
        ("http://[fe80::1%25eth0]/", "address_not_public", "fe80::1"),
        ("http://[fd00:ec2::254]/", "address_not_public", "fd00:ec2::254"),
        ("http://ｌｏｃａｌｈｏｓｔ/", "internal_hostname", "localhost"),
        ("http://LOCALHOST./", "internal_hostname", "localhost"),
        ("http://metadata.google.internal/", "internal_hostname", "metadata.google.internal"),
        ("http://redis/", "internal_hostname", "redis"),
        ("http://exa%6dple.com/", "malformed_host", None),
        ("http://exa_mple..com/", "malformed_host", None),
        ("http://ｌｏｃａｌｈｏｓｔ：８０/", "malformed_host", None),  # a full-width colon is not a port separator
        ("http://256.1.1.1/", "malformed_host", None),
        ("http://10.0.0.5/", "address_not_public", "10.0.0.5"),  # opened on 8080 only
        ("http://10.0.0.6:8080/", "address_not_public", "10.0.0.6"),
        ("http://8.8.8.8:8080/", "port_not_allowed", "8.8.8.8"),
        ("http://8.8.8.8:22/", "port_not_allowed", "8.8.8.8"),
        ("http://8.8.8.8:0/", "port_not_allowed", "8.8.8.8"),
        ("http://8.8.8.8:99999/", "port_not_allowed", "8.8.8.8"),
        ("http://user:pass@example.com/", "url_credentials", "example.com"),
        ("http://user@example.com/", "url_credentials", "example.com"),
        ("http://good.example:pw@evil.example/", "url_credentials", "evil.example"),
        ("ftp://example.com/pub/", "scheme_not_allowed", "example.com"),
        ("FILE:///etc/passwd", "scheme_not_allowed", None),
        ("gopher://example.com:70/", "scheme_not_allowed", "example.com"),
        ("ws://example.com/socket", "scheme_not_allowed", "example.com"),
        ("mailto:someone@example.com", "scheme_not_allowed", None),
        ("javascript:alert(1)", "scheme_not_allowed", None),
    ],
)
def test_hosts_reach_the_policy_untouched(explain, url, reason, host):
    data = decided(explain(url, expect_code=3))
    assert (data["reason"], data["host"]) == (reason, host), data["detail"]


def test_backslash_ends_the_authority_as_browsers_and_urllib3_read_it(explain):
    data = decided(explain("--resolve", "a.example=1.1.1.1", "http://a.example\\@b.example/"))
    assert data["decision"] == "allow" and data["host"] == "a.example"


def test_dns_answers_are_checked(explain):
    data = decided(explain("--resolve", "rebind.example=8.8.8.8,10.0.0.1", "http://rebind.example/", expect_code=3))
    assert data["reason"] == "dns_answer_not_public" and data["addresses"] == ["8.8.8.8", "10.0.0.1"]
    assert "rebind.example resolves to 10.0.0.1" in data["detail"]
    data = decided(explain("--resolve", "searxng=10.0.0.5", "http://searxng/", expect_code=3))
    assert data["reason"] == "dns_answer_not_public"


def test_a_name_missing_from_the_resolve_table_is_unresolvable(explain):
    data = decided(explain("--resolve", "other.example=1.1.1.1", "http://nowhere.example/", expect_code=3))
    assert data["reason"] == "dns_failed" and data["status"] == 502


def test_method_not_allowed(explain):
    data = decided(explain("--method", "post", "--resolve", "example.com=1.1.1.1", "http://example.com/",
                           expect_code=3))
    assert data["reason"] == "method_not_allowed"
    assert decided(explain("--method", "PROPFIND", "http://8.8.8.8/", expect_code=3))["reason"] == "method_not_allowed"


# ---- client profiles -------------------------------------------------------------------


def test_client_selects_a_profile_by_name(explain):
    data = decided(explain("--client", "ci", "--method", "HEAD", "--resolve", "example.com=1.1.1.1",
                           "http://example.com/", expect_code=3))
    assert data["profile"] == "ci" and data["reason"] == "method_not_allowed"
    data = decided(explain("--client", "ci", "--resolve", "example.com=1.1.1.1", "http://example.com/", expect_code=0))
    assert data["profile"] == "ci"


def test_report_mode_allows_and_shows_what_it_would_refuse(explain):
    data = decided(explain("--client", "watcher", "--resolve", "example.com=1.1.1.1", "http://example.com/",
                           expect_code=0))
    assert data["decision"] == "allow" and data["would_refuse"] is True
    assert data["reason"] == "host_not_allowed" and data["status"] is None and data["message"] is None
    assert data["address"] == "1.1.1.1" and "not on this policy's allow list" in data["detail"]
    data = decided(explain("--client", "watcher", "--resolve", "www.example.org=1.1.1.1", "http://www.example.org/"))
    assert data["would_refuse"] is False and data["reason"] is None
    # report mode never relaxes the address rules
    data = decided(explain("--client", "watcher", "http://169.254.169.254/", expect_code=3))
    assert data["reason"] == "address_not_public" and data["would_refuse"] is False


def test_report_mode_names_the_deny_rule(cli, write):
    path = write("report.yaml", "version: 1\naction: report\ndeny:\n  - bad.example\n")
    result = cli(["policy", "explain", "--policy", path, "--resolve", "bad.example=1.1.1.1", "http://bad.example/"])
    data = decided(result)
    assert data["would_refuse"] is True and data["reason"] == "host_denied" and data["rule"] == f"{path}:4"


def test_require_client_refuses_a_client_matching_no_profile(cli, write):
    path = write("strict.yaml", "version: 1\nrequire_client: true\nclients:\n  - name: ci\n    sources: [10.0.0.0/8]\n")
    data = decided(cli(["policy", "explain", "--policy", path, "http://8.8.8.8/"]))
    assert data["reason"] == "client_unknown" and data["status"] == 407 and data["profile"] is None
    assert data["host"] == "8.8.8.8"
    data = decided(cli(["policy", "explain", "--policy", path, "--client", "ci", "http://8.8.8.8/"]))
    assert data["decision"] == "allow" and data["profile"] == "ci"


# ---- usage errors and invalid policies ---------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        [""],
        ["example.com"],
        ["example.com:80"],
        ["example.com:80/path"],
        ["127.0.0.1:80"],
        ["//example.com/"],
        ["http:/example.com"],
        ["http:example.com"],
        ["http://"],
        ["http:///path"],
        ["http://:80/"],
        ["http://user:pw@/"],
        ["http://[::1/"],
        ["http://[::1]x/"],
        ["http://::1/"],
        ["http://example.com:abc/"],
        ["http://example.com:８０/"],
        ["http://example.com:-1/"],
        ["http://exa mple.com/"],
        ["http://example.com/\n"],
        ["http://a\tb/"],
        ["--method", "G ET", "http://8.8.8.8/"],
        ["--method", "", "http://8.8.8.8/"],
        ["--resolve", "example.com", "http://example.com/"],
        ["--resolve", "=1.1.1.1", "http://example.com/"],
        ["--resolve", "example.com=", "http://example.com/"],
        ["--resolve", "example.com=999.1.1.1", "http://example.com/"],
        ["--resolve", "example.com=0x7f.1", "http://example.com/"],
        ["--resolve", "example.com=fe80::1%eth0", "http://example.com/"],
        ["--resolve", "example.com=1.1.1.1,", "http://example.com/"],
        ["--resolve", "1.2.3.4=1.1.1.1", "http://example.com/"],
        ["--resolve", "exa mple.com=1.1.1.1", "http://example.com/"],
        ["--client", "nobody", "http://8.8.8.8/"],
    ],
)
def test_usage_errors_are_one_line_and_exit_2(explain, args):
    result = explain(*args, expect_code=2)
    assert result.out == ""
    lines = result.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sluice policy explain: error: "), result.err
    assert "Traceback" not in result.err


def test_unknown_client_suggests_a_name(explain):
    err = explain("--client", "cii", "http://8.8.8.8/", expect_code=2).err
    assert "no client profile named 'cii'; did you mean 'ci'? profiles: ci, watcher" in err


def test_unknown_client_when_there_are_no_profiles(cli, write):
    path = write("plain.yaml", "version: 1\n")
    result = cli(["policy", "explain", "--policy", path, "--client", "ci", "http://8.8.8.8/"])
    assert result.code == 2 and "the policy has no client profiles" in result.err


def test_invalid_policy_exits_1_with_its_problems(cli, write):
    path = write("bad.yaml", "version: 1\nalow: []\nports: [0]\n")
    result = cli(["policy", "explain", "--policy", path, "http://8.8.8.8/"])
    assert result.code == 1 and result.out == ""
    assert result.err.splitlines() == [
        f"{path}:2:1: unknown key 'alow' in the policy; did you mean 'allow'?",
        f"{path}:3:9: ports: 0 is not a port number (1-65535)",
        f"{path}: 2 problem(s)",
    ]


def test_missing_policy_exits_1(cli, tmp_path):
    result = cli(["policy", "explain", "--policy", tmp_path / "nope.yaml", "http://8.8.8.8/"])
    assert result.code == 1 and "cannot read the policy" in result.err


def test_argparse_errors_exit_2(cli):
    assert cli(["policy", "explain", "--policy", "p.yaml"]).code == 2  # no URL
    assert cli(["policy"]).code == 2


# ---- without --resolve: the policy's own resolver --------------------------------------------


def test_without_resolve_names_go_to_the_policys_resolver(explain, monkeypatch):
    asked = []

    async def fake(self, name):
        asked.append((name, self.settings.timeout))
        return Resolution(("93.184.215.14",), (), 60.0)

    monkeypatch.setattr("sluice.policy_cli.LiveResolver.resolve", fake)
    data = decided(explain("http://WWW.Example.com/", expect_code=0))
    assert asked == [("www.example.com", 3.0)] and data["address"] == "93.184.215.14"


def test_the_live_resolver_fails_closed(monkeypatch):
    import asyncio

    from sluice.policy.model import DnsSettings
    from sluice.policy_cli import LiveResolver

    monkeypatch.undo()  # this test calls the real LiveResolver.resolve, with a broken PinnedResolver

    class Broken:
        def __init__(self, settings):
            raise RuntimeError("no resolv.conf")

    monkeypatch.setattr("sluice.policy_cli.PinnedResolver", Broken)
    with pytest.raises(DnsFailure, match="no resolv.conf"):
        asyncio.run(LiveResolver(DnsSettings()).resolve("example.com"))


# ---- the URL as a Destination -------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "host", "port", "scheme", "credentials"),
    [
        ("http://example.com", "example.com", 80, "http", False),
        ("HTTPS://Example.COM:8443/x", "Example.COM", 8443, "HTTPS", False),
        ("https://[::1]:8443/", "[::1]", 8443, "https", False),
        ("https://[fe80::1%25eth0]/", "[fe80::1%25eth0]", 443, "https", False),
        ("http://0x7f.1/", "0x7f.1", 80, "http", False),
        ("http://ｌｏｃａｌｈｏｓｔ/", "ｌｏｃａｌｈｏｓｔ", 80, "http", False),
        ("http://a:b@c.example:81/", "c.example", 81, "http", True),
        ("http://a@b@c.example/", "c.example", 80, "http", True),
        ("http://c.example/?next=http://a:b@d.example/", "c.example", 80, "http", False),
        ("http://c.example#@d.example", "c.example", 80, "http", False),
        ("http://c.example\\@d.example/", "c.example", 80, "http", False),
        ("ftp://c.example/", "c.example", 21, "ftp", False),
        ("file:///etc/passwd", "", 0, "file", False),
    ],
)
def test_parse_url(url, host, port, scheme, credentials):
    from sluice.policy_cli import parse_url

    dest = parse_url(url, "POST")
    assert (dest.host, dest.port, dest.scheme, dest.has_credentials, dest.method) == \
        (host, port, scheme, credentials, "POST")


# ---- https:// URLs are judged as the proxy meets them (issue 10, item 1) ----------------------

SLUICE = Path(sys.executable).parent / "sluice"

TUNNELS = """\
version: 1
methods: [GET, HEAD, CONNECT]
deny: [bad.example]
intercept: [api.example.org]
clients:
  - name: ci
    sources: [10.20.0.0/16]
    methods: [GET, HEAD]
    intercept: ["*"]
  - name: closed
    sources: [10.30.0.0/16]
    methods: [GET, HEAD]
"""


def real_sluice(*args) -> subprocess.CompletedProcess:
    """The installed `sluice` command itself, in a subprocess."""
    return subprocess.run([str(SLUICE), *map(str, args)], capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "HOME": "/nonexistent"})


@pytest.fixture
def tunnels(write):
    return write("tunnels.yaml", TUNNELS)


def test_an_https_url_not_intercepted_is_its_connect_and_the_method_is_not_visible(tunnels):
    result = real_sluice("policy", "explain", "--policy", tunnels, "--method", "POST",
                         "--resolve", "www.example.org=93.184.215.14", "https://www.example.org/upload")
    data = json.loads(result.stdout)
    assert result.returncode == 0, result.stderr  # the proxy lets the tunnel open: the POST inside is never seen
    assert data["decision"] == "allow" and data["via"] == "tunnel" and data["reason"] is None
    assert data["note"].startswith("tunnel: the method is not visible: the proxy sees only CONNECT www.example.org:443")
    assert "the POST inside" in data["note"] and "`intercept`" in data["note"]
    assert data["address"] == "93.184.215.14"


def test_a_tunnel_is_refused_by_host_port_and_address_with_the_note(explain, cli, tunnels):
    data = decided(cli(["policy", "explain", "--policy", tunnels, "--method", "DELETE", "https://bad.example/"]))
    assert (data["decision"], data["reason"], data["via"]) == ("refuse", "host_denied", "tunnel")
    data = decided(cli(["policy", "explain", "--policy", tunnels, "--resolve", "x.example=10.0.0.1",
                        "https://x.example/"]))
    assert (data["reason"], data["via"]) == ("dns_answer_not_public", "tunnel")
    data = decided(cli(["policy", "explain", "--policy", tunnels, "https://8.8.8.8:8443/"]))
    assert (data["reason"], data["via"]) == ("port_not_allowed", "tunnel")
    assert data["note"].startswith("tunnel: the method is not visible")


def test_without_connect_in_methods_every_tunnel_not_intercepted_is_refused(cli, tunnels):
    result = real_sluice("policy", "explain", "--policy", tunnels, "--client", "closed",
                         "--resolve", "www.example.org=93.184.215.14", "https://www.example.org/")
    data = json.loads(result.stdout)
    assert result.returncode == 3
    assert (data["decision"], data["reason"], data["via"]) == ("refuse", "method_not_allowed", "tunnel")
    assert data["detail"].startswith("the method CONNECT is not allowed")
    # a plain http:// GET from the same profile is a request, decided with its method
    data = decided(cli(["policy", "explain", "--policy", tunnels, "--client", "closed",
                        "--resolve", "www.example.org=93.184.215.14", "http://www.example.org/"]))
    assert (data["decision"], data["via"]) == ("allow", "request")
    assert data["note"] == "request: the proxy sees this GET request whole and decides it with its method"


def test_an_intercepted_host_is_decided_per_request_with_its_method(cli, tunnels):
    args = ["policy", "explain", "--policy", tunnels, "--resolve", "api.example.org=93.184.215.14"]
    data = decided(cli([*args, "--method", "POST", "https://api.example.org/repos", ]))
    assert (data["decision"], data["reason"], data["via"]) == ("refuse", "method_not_allowed", "intercepted")
    assert data["note"].startswith("intercepted: CONNECT api.example.org:443 is allowed without a method check")
    assert "decides the POST request inside on its own" in data["note"]
    data = decided(cli([*args, "https://api.example.org/repos"]))
    assert (data["decision"], data["via"], data["address"]) == ("allow", "intercepted", "93.184.215.14")
    # the profile intercepts everything and does not list CONNECT: intercepted CONNECTs need no method
    data = decided(cli([*args, "--client", "ci", "--method", "HEAD", "https://api.example.org/"]))
    assert (data["decision"], data["via"], data["profile"]) == ("allow", "intercepted", "ci")
    data = decided(cli([*args, "--client", "ci", "--method", "CONNECT", "https://api.example.org/"]))
    assert (data["decision"], data["via"]) == ("allow", "intercepted")
    assert "every request inside the tunnel is then decided on its own" in data["note"]
    data = decided(cli([*args, "--client", "ci", "--method", "PUT", "https://api.example.org/"]))
    assert (data["reason"], data["via"]) == ("method_not_allowed", "intercepted")


def test_an_intercepted_connect_that_is_refused_is_the_answer(cli, tunnels):
    data = decided(cli(["policy", "explain", "--policy", tunnels, "--client", "ci", "--method", "POST",
                        "https://bad.example/"]))
    assert (data["reason"], data["via"]) == ("host_denied", "intercepted")
    assert data["note"] == "intercepted: CONNECT bad.example:443 is refused, so no request reaches the tunnel."


def test_an_http_url_is_always_a_request_even_to_an_intercepted_host(cli, tunnels):
    data = decided(cli(["policy", "explain", "--policy", tunnels, "--method", "POST",
                        "--resolve", "api.example.org=93.184.215.14", "http://api.example.org/"]))
    assert (data["reason"], data["via"]) == ("method_not_allowed", "request")


def test_url_credentials_over_https_travel_inside_the_tunnel(cli, tunnels):
    data = decided(cli(["policy", "explain", "--policy", tunnels, "--resolve", "www.example.org=93.184.215.14",
                        "https://user:secret@www.example.org/"]))
    assert (data["decision"], data["via"]) == ("allow", "tunnel")
    assert "user:password@ is not seen either" in data["note"]
    data = decided(cli(["policy", "explain", "--policy", tunnels, "http://user:secret@www.example.org/"]))
    assert (data["reason"], data["via"]) == ("url_credentials", "request")


def test_the_coding_agent_push_that_the_live_proxy_let_through(write):
    # config/examples/coding-agent.yaml before issue 10: ci-runners "download only: no git push",
    # methods [GET, HEAD, CONNECT] and no intercept. explain said "refuse"; the proxy allowed the push.
    path = write("old.yaml", "version: 1\nallow: ['**.github.com']\nclients:\n  - name: ci-runners\n"
                             "    sources: [10.20.0.0/16]\n    methods: [GET, HEAD, CONNECT]\n")
    result = real_sluice("policy", "explain", "--policy", path, "--client", "ci-runners", "--method", "POST",
                         "--resolve", "github.com=140.82.121.4", "https://github.com/psf/requests.git/git-receive-pack")
    data = json.loads(result.stdout)
    assert result.returncode == 0 and (data["decision"], data["via"]) == ("allow", "tunnel")
