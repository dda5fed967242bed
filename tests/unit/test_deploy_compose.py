"""deploy/compose: the sandbox network validates against the compose-spec
JSON schema (the copy check-jsonschema vendors, with its license: no Docker
engine or network needed) and has the shape that makes Sluice the agent's
only way out."""

from __future__ import annotations

import ipaddress
import json
import re
from importlib import resources
from pathlib import Path

import jsonschema
import pytest
import yaml

from sluice.cli import main

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "deploy" / "compose"
FILES = ["compose.yaml", "compose.intercept.yaml", "compose.searxng.yaml"]


def load(name: str) -> dict:
    return yaml.safe_load((COMPOSE / name).read_text())


def compose_schema() -> dict:
    vendored = resources.files("check_jsonschema") / "builtin_schemas" / "vendor" / "compose-spec.json"
    return json.loads(vendored.read_text())


@pytest.mark.parametrize("name", FILES)
def test_the_compose_files_validate_against_the_compose_spec(name):
    schema = compose_schema()
    validator = jsonschema.validators.validator_for(schema)(schema)
    problems = [f"{'/'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(load(name))]
    assert problems == []


def test_the_schema_check_catches_a_mistake():
    schema = compose_schema()
    validator = jsonschema.validators.validator_for(schema)(schema)
    misspelt = load("compose.yaml")
    misspelt["services"]["agent"]["netwroks"] = misspelt["services"]["agent"].pop("networks")
    assert list(validator.iter_errors(misspelt))
    wrong_type = load("compose.yaml")
    wrong_type["networks"]["sandbox"]["internal"] = ["yes"]
    assert list(validator.iter_errors(wrong_type))


def image_ports() -> tuple[int, set[int]]:
    """The HTTP proxy port of the image's command, and every port the compose command adds."""
    dockerfile = (ROOT / "Dockerfile").read_text()
    entrypoint = json.loads(re.search(r"^ENTRYPOINT (\[.*\])$", dockerfile, re.M).group(1))
    http = int(entrypoint[entrypoint.index("--listen") + 1].rsplit(":", 1)[1])
    command = load("compose.yaml")["services"]["sluice"]["command"]
    modes = [command[i + 1] for i, a in enumerate(command) if a == "--mode"]
    return http, {int(m.split("@")[1]) for m in modes if "@" in m}


def test_the_agent_sits_on_an_internal_network_with_sluice_alone_outside():
    compose = load("compose.yaml")
    assert compose["networks"]["sandbox"]["internal"] is True
    assert not (compose["networks"]["egress"] or {}).get("internal")
    services = compose["services"]
    assert services["agent"]["networks"] == ["sandbox"]
    assert set(services["sluice"]["networks"]) == {"sandbox", "egress"}
    for name, service in services.items():
        if name != "sluice":
            assert "egress" not in service.get("networks", []), f"{name} must not reach the outside network"
            assert "network_mode" not in service and "ports" not in service and "extra_hosts" not in service


def test_the_agent_is_given_the_proxy_and_nothing_to_bypass_it():
    compose = load("compose.yaml")
    env = compose["services"]["agent"]["environment"]
    http, socks = image_ports()
    for key in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
        assert env[key] == f"http://sluice:{http}"
    for key in ("ALL_PROXY", "all_proxy"):
        assert env[key].startswith("socks5h://sluice:")  # socks5h: the proxy resolves names
        assert int(env[key].rsplit(":", 1)[1]) in socks
    assert env["NO_PROXY"] == "" and env["no_proxy"] == ""
    assert not any("CA" in key or "CERT" in key for key in env), "no CA unless interception is on"
    # No resolver that forwards anywhere: loopback only, where nothing listens.
    assert all(ipaddress.ip_address(server).is_loopback for server in compose["services"]["agent"]["dns"])
    assert compose["services"]["agent"]["depends_on"]["sluice"]["condition"] == "service_healthy"


def test_sluice_is_locked_down_and_mounts_the_policy_directory(tmp_path):
    sluice = load("compose.yaml")["services"]["sluice"]
    assert sluice["read_only"] is True and sluice["cap_drop"] == ["ALL"]
    assert "no-new-privileges:true" in sluice["security_opt"]
    (policy_mount,) = [v for v in sluice["volumes"] if v.split(":")[1] == "/etc/sluice"]
    source = COMPOSE / policy_mount.split(":")[0]
    assert source.is_dir() and policy_mount.endswith(":ro"), "the policy's directory, read-only"
    assert main(["policy", "check", "--strict", "--policy", str(source / "policy.yaml")]) == 0


def test_interception_adds_only_the_certificate_to_the_agent():
    base, extra = load("compose.yaml"), load("compose.intercept.yaml")
    command = extra["services"]["sluice"]["command"]
    assert command[:len(base["services"]["sluice"]["command"])] == base["services"]["sluice"]["command"]
    ca_dir = command[command.index("--ca-dir") + 1]
    (ca_mount,) = [v for v in extra["services"]["sluice"]["volumes"] if v.split(":")[1] == ca_dir]
    assert ca_mount.endswith(":ro")
    agent_volumes = extra["services"]["agent"]["volumes"]
    assert [v.split(":")[0] for v in agent_volumes] == ["./ca/mitmproxy-ca-cert.pem"], "the certificate, never the key"
    cert_path = agent_volumes[0].split(":")[1]
    assert set(extra["services"]["agent"]["environment"].values()) == {cert_path}


def test_the_searxng_overlay_mounts_settings_with_json_output_on():
    overlay = yaml.safe_load((COMPOSE / "compose.searxng.yaml").read_text())
    assert "./searxng:/etc/searxng" in overlay["services"]["searxng"]["volumes"]
    settings = yaml.safe_load((COMPOSE / "searxng" / "settings.yml").read_text())
    assert "json" in settings["search"]["formats"]
    header = (COMPOSE / "compose.searxng.yaml").read_text().split("services:", 1)[0]
    assert 'private_networks: ["172.30.0.10/32:8080"]' in header
    assert "ports: [80, 443, 8080]" not in header  # the entry's port opens it: ports is never widened
