"""config/examples/: every example policy is valid and passes its cases file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from sluice.policy.loader import load_policy_file

EXAMPLES = Path(__file__).resolve().parents[2] / "config" / "examples"
NAMES = ["research-agent", "coding-agent", "searxng-sidecar"]


def cases(name: str) -> list[dict]:
    return yaml.safe_load((EXAMPLES / f"{name}.cases.yaml").read_text(encoding="utf-8"))


def test_every_example_has_a_cases_file():
    policies = sorted(p.name for p in EXAMPLES.glob("*.yaml") if not p.name.endswith(".cases.yaml"))
    assert policies == sorted(f"{n}.yaml" for n in NAMES)
    for name in NAMES:
        assert (EXAMPLES / f"{name}.cases.yaml").is_file()


@pytest.mark.parametrize("name", NAMES)
def test_example_checks(cli, name):
    result = cli(["policy", "check", EXAMPLES / f"{name}.yaml"])
    assert result.code == 0, result.err
    assert result.out.startswith(f"{EXAMPLES / name}.yaml: OK (enforce mode)")


@pytest.mark.parametrize("name", NAMES)
def test_example_claims_only_what_the_proxy_enforces(cli, name):
    # --strict: no warning either, e.g. no `methods` for HTTPS hosts that are not intercepted
    result = cli(["policy", "check", "--strict", EXAMPLES / f"{name}.yaml"])
    assert result.code == 0 and result.err == "", result.err


@pytest.mark.parametrize("name", NAMES)
def test_example_passes_its_cases(cli, name):
    result = cli(["policy", "test", EXAMPLES / f"{name}.yaml", EXAMPLES / f"{name}.cases.yaml"])
    assert result.code == 0, result.out + result.err
    assert result.out.endswith(f"{len(cases(name))} passed, 0 failed\n")


@pytest.mark.parametrize("name", NAMES)
def test_example_cases_cover_allows_and_refusals_with_reasons(name):
    found = cases(name)
    assert any(c["expect"] == "allow" for c in found)
    refusals = [c for c in found if c["expect"] == "refuse"]
    assert refusals and all("reason" in c for c in refusals)


def test_the_examples_together_cover_the_main_reasons():
    reasons = {c.get("reason") for name in NAMES for c in cases(name)}
    assert reasons >= {
        "address_not_public", "internal_hostname", "malformed_host", "dns_answer_not_public", "dns_failed",
        "port_not_allowed", "scheme_not_allowed", "url_credentials", "host_denied", "host_not_allowed",
        "method_not_allowed",
    }


def test_research_agent_is_read_only_and_open():
    rules = load_policy_file(EXAMPLES / "research-agent.yaml").rules
    assert rules.methods == {"GET", "HEAD"} and rules.allow is None and len(rules.deny) >= 3
    assert rules.intercept.everything  # read-only inside HTTPS too
    assert any(c["url"].startswith("http://169.254.169.254") and c["reason"] == "address_not_public"
               for c in cases("research-agent"))


def test_coding_agent_has_an_allow_list_and_both_kinds_of_profile():
    policy = load_policy_file(EXAMPLES / "coding-agent.yaml")
    allow = policy.rules.allow
    for host in ("pypi.org", "files.pythonhosted.org", "registry.npmjs.org", "github.com", "codeload.github.com",
                 "api.github.com", "objects.githubusercontent.com", "crates.io", "static.crates.io",
                 "proxy.golang.org", "deb.debian.org"):
        assert allow.match_name(host), host
    assert not allow.match_name("example.com")
    by_source = [p for p in policy.clients if p.sources]
    by_user = [p for p in policy.clients if p.credentials]
    assert by_source and by_user
    assert all(v.startswith("pbkdf2_sha256$") for p in by_user for _, v in p.credentials)
    assert {c.get("client") for c in cases("coding-agent")} >= {None, by_source[0].name, by_user[0].name}
    # "download only" is enforced: the runners' HTTPS is intercepted and a push is refused inside it
    ci = by_source[0].rules
    assert ci.intercept.everything and ci.methods == {"GET", "HEAD"}
    assert any(c.get("client") == by_source[0].name and c.get("method") == "POST" and c["url"].startswith("https://")
               and c.get("reason") == "method_not_allowed" for c in cases("coding-agent"))


def test_searxng_sidecar_opens_exactly_one_service():
    policy = load_policy_file(EXAMPLES / "searxng-sidecar.yaml")
    rules = policy.rules
    assert [e.rule.text for e in rules.private_networks.entries] == ["10.0.0.5/32:8080"]
    assert rules.allow.exact.get("searxng") and rules.allow.everything


@pytest.mark.parametrize("name", NAMES)
def test_every_expected_method_refusal_is_one_the_proxy_can_see(cli, name):
    """A method refusal needs a request the proxy sees: plain http://, an
    intercepted host, or the CONNECT itself (CONNECT not in `methods`)."""
    for case in cases(name):
        if case.get("reason") != "method_not_allowed":
            continue
        args = ["policy", "explain", "--policy", EXAMPLES / f"{name}.yaml", "--method", case.get("method", "GET")]
        if case.get("client"):
            args += ["--client", case["client"]]
        for host, ips in (case.get("resolve") or {}).items():
            args += ["--resolve", f"{host}={ips if isinstance(ips, str) else ','.join(ips)}"]
        result = cli([*args, case["url"]])
        data = json.loads(result.out)
        assert result.code == 3 and data["reason"] == "method_not_allowed", (case, data)
        assert data["via"] in ("request",
                               "intercepted") or "the method CONNECT is not allowed" in data["detail"], (case, data)


def test_explain_an_example(cli):
    result = cli(["policy", "explain", "--policy", EXAMPLES / "searxng-sidecar.yaml",
                  "--resolve", "searxng=10.0.0.5", "http://searxng:8080/search?q=sluice"])
    assert result.code == 0 and '"decision": "allow"' in result.out
