"""Transparent mode end to end: an agent that ignores proxy variables is
still enforced.

An "agent" network namespace is joined to the test namespace by a veth
pair; the test namespace (the gateway) redirects every TCP connection
arriving from the agent to Sluice's transparent listener and drops
everything else from it, with exactly the nftables rules docs/deploy.md
gives (harness.agentns.TRANSPARENT_RULES). The agent then connects straight to addresses, no
proxy configured: an allowed origin answers through Sluice, the metadata
address and a private canary are refused by Sluice, and no canary sees a
connection.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest

from harness.agentns import (TRANSPARENT_RULES, AgentNamespace, missing_tools, nft, redirect_to_sluice,
                             transparent_gateway)
from harness.sluice import SluiceProcess, default_policy

pytestmark = pytest.mark.netns

@pytest.fixture(scope="module")
def agent(netns):
    missing = missing_tools("nft")
    if missing:
        pytest.skip(f"transparent mode needs {', '.join(missing)} (nftables: apt-get install nftables); "
                    "untested without it")
    with AgentNamespace("tp", "10.199.2") as ns:
        yield ns


@pytest.fixture(scope="module")
def transparent(agent, fake_dns, net, tmp_path_factory, sluice_home):
    proc = transparent_gateway(agent, tmp_path_factory.mktemp("transparent"), default_policy(),
                               name="transparent", home=sluice_home)
    proc.start()
    loaded = redirect_to_sluice(agent, proc.port, "sluice_transparent")
    if loaded.returncode != 0:
        proc.stop()
        pytest.fail(f"nft could not load the documented rules: {loaded.stderr}")
    yield proc
    nft("delete", "table", "inet", "sluice_transparent")
    proc.stop()


def agent_curl(agent: AgentNamespace, *args: str) -> subprocess.CompletedProcess:
    # No proxy anywhere: curl's environment has none and --noproxy '*' ignores any.
    env = {"PATH": "/usr/bin:/bin:/usr/sbin:/sbin"}
    return agent.run(["curl", "-q", "-sS", "--noproxy", "*", "--max-time", "10", "-o", "/dev/null",
                      "-D", "-", "-w", "%{http_code}\n", *args], env=env)


def test_the_rules_doc_and_the_test_agree():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "deploy.md").read_text()
    shown = TRANSPARENT_RULES.format(table="sluice_transparent", agent_if="veth-agent", port=15001)
    assert shown in doc, "docs/deploy.md must show exactly the rules this test loads"


def test_an_agent_ignoring_proxy_variables_reaches_an_allowed_origin(agent, transparent):
    if shutil.which("curl") is None:
        pytest.skip("needs curl")
    mark = transparent.audit_mark()
    out = agent_curl(agent, "http://8.8.8.8/transparent-ok")
    assert out.stdout.strip().endswith("200"), out
    entry = transparent.wait_audit(lambda e: e.get("host") == "8.8.8.8", since=mark)
    assert entry["decision"] == "allow" and entry["client"].startswith(agent.inner_ip)


def refused(agent: AgentNamespace, transparent: SluiceProcess, url: str, host: str, reason: str) -> None:
    """Transparent connections are decided at dial time: a refused one is
    closed before any byte reaches a destination (no HTTP answer: the agent
    spoke to the address itself, not to a proxy), with an audit line."""
    mark = transparent.audit_mark()
    out = agent_curl(agent, url)
    assert out.returncode != 0 and out.stdout.strip() == "000", out
    entry = transparent.wait_audit(lambda e: e.get("host") == host, since=mark)
    assert (entry["decision"], entry["reason"]) == ("refuse", reason), entry
    assert entry["client"].startswith(agent.inner_ip)


def test_the_metadata_address_is_refused_for_an_agent_ignoring_proxy_variables(agent, transparent):
    if shutil.which("curl") is None:
        pytest.skip("needs curl")
    refused(agent, transparent, "http://169.254.169.254/latest/meta-data/", "169.254.169.254", "address_not_public")


def test_private_addresses_and_other_ports_are_refused_too(agent, transparent):
    if shutil.which("curl") is None:
        pytest.skip("needs curl")
    refused(agent, transparent, "http://10.0.0.1/", "10.0.0.1", "address_not_public")
    refused(agent, transparent, "http://8.8.8.8:8080/", "8.8.8.8", "port_not_allowed")


def test_udp_from_the_agent_goes_nowhere(agent, transparent):
    # A UDP service on the gateway (as a DNS resolver would be): the agent's datagrams are dropped.
    import socket
    import sys

    server = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    server.bind((agent.outer_ip, 0))
    server.settimeout(3)
    port = server.getsockname()[1]
    probe = ("import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(1);"
             f"s.sendto(b'ping', ('{agent.outer_ip}', {port}))\n"
             "try:\n    s.recv(512); print('answered')\nexcept OSError: print('silent')")
    try:
        out = agent.run([sys.executable, "-c", probe])
        assert out.stdout.strip() == "silent", out
        with pytest.raises(TimeoutError):
            server.recvfrom(512)
    finally:
        server.close()
