"""The optional Valkey recipes for shared limits (issue 23), checked offline:
deploy/k8s/valkey (a kustomize Component) rendered over the base as kustomize
renders it, and deploy/compose/compose.valkey.yaml merged over compose.yaml as
docker compose merges it. Both must give Valkey a password from a secret that
Sluice mounts where its policy reads it, admit only Sluice to Valkey, keep
Valkey off the agents' network, and carry the base policy plus a `state`
block that `sluice policy check` accepts."""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
from importlib import resources
from pathlib import Path
from urllib.parse import urlsplit

import jsonschema
import kubernetes_validate
import pytest
import yaml

from sluice.cli import main

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
COMPONENT = K8S / "valkey"
COMPOSE = ROOT / "deploy" / "compose"
STORE_PORT = 6379

Key = tuple[str, str, str]  # (kind, namespace, name)


# ---- kustomize, as far as these manifests use it ---------------------------------------


def load_kustomization(directory: Path) -> dict:
    return yaml.safe_load((directory / "kustomization.yaml").read_text())


def generated_configmaps(directory: Path, kustomization: dict) -> dict[Key, dict]:
    options = kustomization.get("generatorOptions", {})
    assert options.get("disableNameSuffixHash") is True, f"{directory}: a hashed ConfigMap name restarts pods"
    found = {}
    for generator in kustomization.get("configMapGenerator", []):
        data = {Path(f).name: (directory / f).read_text() for f in generator["files"]}
        doc = {"apiVersion": "v1", "kind": "ConfigMap", "data": data,
               "metadata": {"name": generator["name"], "namespace": generator["namespace"],
                            "labels": options.get("labels", {})}}
        found[("ConfigMap", generator["namespace"], generator["name"])] = doc
    return found


def resources_of(directory: Path, kustomization: dict) -> dict[Key, dict]:
    found = {}
    for name in kustomization.get("resources", []):
        for doc in yaml.safe_load_all((directory / name).read_text()):
            if doc:
                found[(doc["kind"], doc["metadata"].get("namespace", ""), doc["metadata"]["name"])] = doc
    return found


def json_patch_add(doc: dict, path: str, value: object) -> None:
    """RFC 6902 `add` (the only operation the component uses): `/-` appends."""
    *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in path.lstrip("/").split("/")]
    node = doc
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    if isinstance(node, list):
        node.append(value) if last == "-" else node.insert(int(last), value)
    else:
        node[last] = value


def set_images(docs: dict[Key, dict], images: list[dict]) -> None:
    """kustomize's `images:` (newName, newTag or digest) on every container."""
    for doc in docs.values():
        for c in doc.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
            for image in images:
                if c["image"].split("@")[0].split(":")[0] == image["name"]:
                    name = image.get("newName", image["name"])
                    c["image"] = (f"{name}@{image['digest']}" if "digest" in image
                                  else f"{name}:{image['newTag']}" if "newTag" in image else name)


def base() -> dict[Key, dict]:
    kustomization = load_kustomization(K8S)
    docs = resources_of(K8S, kustomization) | generated_configmaps(K8S, kustomization)
    set_images(docs, kustomization.get("images", []))
    return docs


def rendered() -> dict[Key, dict]:
    """The base with the component: its resources added, its generator replacing
    the base's ConfigMap, its patches applied to the one resource each targets."""
    component = load_kustomization(COMPONENT)
    assert component["kind"] == "Component" and component["apiVersion"] == "kustomize.config.k8s.io/v1alpha1"
    docs = copy.deepcopy(base())
    added = resources_of(COMPONENT, component)
    assert not set(added) & set(docs), "the component adds resources; it does not redefine the base's"
    docs |= added
    for generator in component.get("configMapGenerator", []):
        assert generator.get("behavior") == "replace"
        assert ("ConfigMap", generator["namespace"], generator["name"]) in docs, "it replaces a ConfigMap of the base"
    docs |= generated_configmaps(COMPONENT, component)
    for patch in component.get("patches", []):
        target = patch["target"]
        (key,) = [k for k in docs if k == (target["kind"], target.get("namespace", k[1]), target["name"])]
        for op in yaml.safe_load(patch["patch"]):
            assert op["op"] == "add", "only additions: the component widens the base, never rewrites it"
            json_patch_add(docs[key], op["path"], op["value"])
    return docs


def one(docs: dict[Key, dict], kind: str, name: str) -> dict:
    matches = [d for (k, _, n), d in docs.items() if k == kind and n == name]
    assert len(matches) == 1, f"expected one {kind} {name}, found {len(matches)}"
    return matches[0]


def pod_labels(docs: dict[Key, dict], name: str) -> dict[str, str]:
    return one(docs, "Deployment", name)["spec"]["template"]["metadata"]["labels"]


def selects(selector: dict, labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, "matchLabels only (matchExpressions are not checked here)"
    return selector.get("matchLabels", {}).items() <= labels.items()


def container(docs: dict[Key, dict], deployment: str) -> dict:
    (c,) = [c for c in one(docs, "Deployment", deployment)["spec"]["template"]["spec"]["containers"]
            if c["name"] == deployment]
    return c


def secret_file(docs: dict[Key, dict], deployment: str, secret: str) -> tuple[str, dict]:
    """(the path at which `deployment`'s container sees the Secret's one key, the mount)."""
    pod = one(docs, "Deployment", deployment)["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v.get("secret", {}).get("secretName") == secret]
    (item,) = volume["secret"]["items"]
    (mount,) = [m for m in container(docs, deployment)["volumeMounts"] if m["name"] == volume["name"]]
    return f"{mount['mountPath'].rstrip('/')}/{item['path']}", mount


def rendered_policy(docs: dict[Key, dict]) -> dict:
    return yaml.safe_load(one(docs, "ConfigMap", "sluice-policy")["data"]["policy.yaml"])


# ---- Kubernetes ---------------------------------------------------------------------------


def test_the_base_leaves_the_component_out_and_says_how_to_turn_it_on():
    assert "components" not in load_kustomization(K8S), "Valkey is optional: the base must not include it"
    text = (K8S / "kustomization.yaml").read_text()
    assert "# components:\n#   - valkey\n" in text
    listed = set(load_kustomization(COMPONENT)["resources"])
    generated = {f for g in load_kustomization(COMPONENT)["configMapGenerator"] for f in g["files"]}
    assert listed | generated == {p.name for p in COMPONENT.glob("*.yaml")} - {"kustomization.yaml"}


@pytest.mark.parametrize("version", ["1.30", "1.37.0"])
def test_the_rendered_manifests_validate_against_the_kubernetes_schemas(version):
    problems = []
    for (kind, _, name), doc in rendered().items():
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            problems.append(f"{kind}/{name}: {e.message} at {'.'.join(map(str, e.path))}")
    assert problems == []


def test_valkey_runs_pinned_non_root_read_only_with_limits_and_a_secret_password():
    docs = rendered()
    valkey = container(docs, "valkey")
    image, _, tag = valkey["image"].partition(":")
    assert image == "valkey/valkey" and tag and tag != "latest" and tag[0].isdigit(), "pinned by version tag"
    pod = one(docs, "Deployment", "valkey")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["automountServiceAccountToken"] is False
    context = valkey["securityContext"]
    assert context["readOnlyRootFilesystem"] is True and context["allowPrivilegeEscalation"] is False
    assert context["capabilities"] == {"drop": ["ALL"]}
    assert {"cpu", "memory"} <= set(valkey["resources"]["requests"]) <= set(valkey["resources"]["limits"])
    # The password comes from the Secret, read-only, and nowhere else: no env var, no literal.
    path, mount = secret_file(docs, "valkey", "valkey")
    assert mount["readOnly"] is True and "env" not in valkey
    command = " ".join(valkey["command"])
    assert f'--requirepass "$(cat {path})"' in command
    assert "--requirepass" not in valkey["args"]
    # The working directory is writable (the root filesystem is not).
    data = next(m for m in valkey["volumeMounts"] if m["mountPath"] == "/data")
    assert next(v for v in pod["volumes"] if v["name"] == data["name"]).keys() & {"emptyDir", "persistentVolumeClaim"}
    args = valkey["args"]
    assert args[args.index("--port") + 1] == str(STORE_PORT)


def test_the_service_reaches_valkey_and_only_valkey():
    docs = rendered()
    service = one(docs, "Service", "valkey")
    assert selects({"matchLabels": service["spec"]["selector"]}, pod_labels(docs, "valkey"))
    assert not selects({"matchLabels": service["spec"]["selector"]}, pod_labels(docs, "sluice"))
    (port,) = service["spec"]["ports"]
    ports = {p["name"]: p["containerPort"] for p in container(docs, "valkey")["ports"]}
    assert port["port"] == STORE_PORT and ports[port["targetPort"]] == STORE_PORT
    # Neither of the base's Services or Deployments selects Valkey's pods.
    for name in ("sluice", "sluice-admin"):
        assert not selects({"matchLabels": one(docs, "Service", name)["spec"]["selector"]}, pod_labels(docs, "valkey"))


def test_only_sluices_pods_may_reach_valkey_and_valkey_reaches_nothing():
    docs = rendered()
    policy = one(docs, "NetworkPolicy", "valkey")["spec"]
    assert selects(policy["podSelector"], pod_labels(docs, "valkey"))
    assert set(policy["policyTypes"]) == {"Ingress", "Egress"}
    assert policy["egress"] == [], "Valkey needs no egress"
    (rule,) = policy["ingress"]
    (peer,) = rule["from"]
    assert set(peer) == {"podSelector"}, "no namespaceSelector or ipBlock: Sluice's pods in this namespace only"
    assert selects(peer["podSelector"], pod_labels(docs, "sluice"))
    assert not selects(peer["podSelector"], pod_labels(docs, "valkey"))
    assert one(docs, "Deployment", "sluice")["metadata"]["namespace"] == one(docs, "NetworkPolicy", "valkey")[
        "metadata"]["namespace"]
    assert [(p["protocol"], p["port"]) for p in rule["ports"]] == [("TCP", STORE_PORT)]
    # The agents' own policy still leads only to Sluice's pods, so never to Valkey's.
    agents = one(docs, "NetworkPolicy", "agents-egress-through-sluice")["spec"]
    assert agents == one(base(), "NetworkPolicy", "agents-egress-through-sluice")["spec"]
    assert not any(selects(p["podSelector"], pod_labels(docs, "valkey")) for r in agents["egress"] for p in r["to"])


def test_sluices_egress_gains_exactly_valkey_on_its_port():
    before = one(base(), "NetworkPolicy", "sluice")["spec"]
    after = one(rendered(), "NetworkPolicy", "sluice")["spec"]
    assert after["ingress"] == before["ingress"]
    assert after["egress"][:len(before["egress"])] == before["egress"]
    (added,) = after["egress"][len(before["egress"]):]
    (peer,) = added["to"]
    assert set(peer) == {"podSelector"} and selects(peer["podSelector"], pod_labels(rendered(), "valkey"))
    assert [(p["protocol"], p["port"]) for p in added["ports"]] == [("TCP", STORE_PORT)]


def test_the_policy_names_the_service_and_the_mounted_secret(tmp_path):
    docs = rendered()
    state = rendered_policy(docs)["state"]
    url = urlsplit(state["store"]["url"])
    service = one(docs, "Service", "valkey")
    assert url.scheme in ("redis", "rediss") and url.hostname == service["metadata"]["name"]
    assert (url.port or STORE_PORT) == service["spec"]["ports"][0]["port"]
    assert service["metadata"]["namespace"] == one(docs, "Deployment", "sluice")["metadata"]["namespace"], \
        "a bare Service name resolves in Sluice's own namespace"
    path, mount = secret_file(docs, "sluice", "valkey")
    assert mount["readOnly"] is True
    assert state["store"]["password"] == {"file": path}
    assert secret_file(docs, "valkey", "valkey")[0] == path, "one Secret, one key, read by both"
    # The Secret is group-readable by the pod's fsGroup (Sluice's uid is not root).
    pod = one(docs, "Deployment", "sluice")["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert volume["secret"]["defaultMode"] & 0o040 and pod["securityContext"]["fsGroup"] == pod["securityContext"][
        "runAsGroup"]
    assert_checks(tmp_path, one(docs, "ConfigMap", "sluice-policy")["data"]["policy.yaml"], path)


def test_the_policy_is_the_base_policy_plus_its_state_block():
    with_state = rendered_policy(rendered())
    without = yaml.safe_load(one(base(), "ConfigMap", "sluice-policy")["data"]["policy.yaml"])
    assert "state" not in without
    assert {k: v for k, v in with_state.items() if k != "state"} == without, \
        "deploy/k8s/valkey/policy.yaml must stay deploy/k8s/policy.yaml plus state"
    # The store is dialled directly: it needs no private_networks entry (which would open it to agents).
    assert not with_state.get("private_networks")


def assert_checks(tmp_path: Path, policy_text: str, password_path: str) -> None:
    """`sluice policy check --strict` on the policy, its password file made real."""
    secret = tmp_path / "password"
    secret.write_text("a-test-password\n")
    assert policy_text.count(password_path) == 1
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text(policy_text.replace(password_path, str(secret)))
    assert main(["policy", "check", "--strict", "--policy", str(policy_file)]) == 0


# ---- Docker Compose -----------------------------------------------------------------------


def compose_file(name: str) -> dict:
    return yaml.safe_load((COMPOSE / name).read_text())


def merged_compose() -> dict:
    """compose.yaml with compose.valkey.yaml over it, as `docker compose -f A -f B`
    merges what these files use: services and top-level maps by key, a service's
    networks as a union, its volumes by target, other keys replaced."""
    merged = copy.deepcopy(compose_file("compose.yaml"))
    extra = compose_file("compose.valkey.yaml")
    for section in ("networks", "secrets", "volumes"):
        merged.setdefault(section, {}).update(extra.get(section, {}))
    for name, service in extra["services"].items():
        into = merged["services"].setdefault(name, {})
        for key, value in service.items():
            if key == "networks":
                into[key] = list(dict.fromkeys([*into.get(key, []), *value]))
            elif key == "volumes":
                by_target = {v.split(":")[1]: v for v in into.get(key, [])}
                by_target.update({v.split(":")[1]: v for v in value})
                into[key] = list(by_target.values())
            elif key == "depends_on":
                into[key] = {**into.get(key, {}), **value}
            else:
                into[key] = value
    return merged


def test_the_compose_overlay_validates_against_the_compose_spec():
    vendored = resources.files("check_jsonschema") / "builtin_schemas" / "vendor" / "compose-spec.json"
    schema = json.loads(vendored.read_text())
    validator = jsonschema.validators.validator_for(schema)(schema)
    for doc in (compose_file("compose.valkey.yaml"), merged_compose()):
        assert [f"{'/'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(doc)] == []


def test_valkey_sits_on_its_own_internal_network_with_sluice_alone_beside_it():
    compose = merged_compose()
    assert compose["networks"]["state"]["internal"] is True
    services = compose["services"]
    assert services["valkey"]["networks"] == ["state"]
    assert set(services["sluice"]["networks"]) == {"sandbox", "egress", "state"}
    on_state = {name for name, s in services.items() if "state" in s.get("networks", [])}
    assert on_state == {"sluice", "valkey"}, "only Sluice may reach Valkey: the agent must not"
    assert services["agent"]["networks"] == ["sandbox"]
    assert "ports" not in services["valkey"] and "network_mode" not in services["valkey"]


def test_compose_valkey_is_pinned_locked_down_and_reads_its_password_from_the_secret():
    valkey = merged_compose()["services"]["valkey"]
    image, _, tag = valkey["image"].partition(":")
    assert image == "valkey/valkey" and tag and tag[0].isdigit()
    assert valkey["read_only"] is True and valkey["cap_drop"] == ["ALL"]
    assert "no-new-privileges:true" in valkey["security_opt"]
    assert not valkey["user"].startswith("0")
    assert valkey["secrets"] == ["valkey-password"] and "environment" not in valkey
    assert '--requirepass "$$(cat /run/secrets/valkey-password)"' in " ".join(valkey["entrypoint"])
    assert "--requirepass" not in valkey["command"]
    assert merged_compose()["services"]["sluice"]["depends_on"]["valkey"]["condition"] == "service_healthy"


def test_compose_sluice_mounts_the_policy_with_state_and_the_secret_it_names(tmp_path):
    compose = merged_compose()
    sluice = compose["services"]["sluice"]
    (policy_mount,) = [v for v in sluice["volumes"] if v.split(":")[1] == "/etc/sluice"]
    assert policy_mount == "./policy-valkey:/etc/sluice:ro"
    assert "valkey-password" in sluice["secrets"]
    assert compose["secrets"]["valkey-password"] == {"file": "./secrets/valkey-password"}
    text = (COMPOSE / "policy-valkey" / "policy.yaml").read_text()
    policy = yaml.safe_load(text)
    url = urlsplit(policy["state"]["store"]["url"])
    assert url.scheme in ("redis", "rediss") and url.hostname == "valkey" and (url.port or STORE_PORT) == STORE_PORT
    assert "valkey" in compose["services"]
    assert policy["state"]["store"]["password"] == {"file": "/run/secrets/valkey-password"}  # compose's secret path
    base_policy = yaml.safe_load((COMPOSE / "policy" / "policy.yaml").read_text())
    assert {k: v for k, v in policy.items() if k != "state"} == base_policy, \
        "deploy/compose/policy-valkey/policy.yaml must stay policy/policy.yaml plus state"
    assert_checks(tmp_path, text, "/run/secrets/valkey-password")


KUSTOMIZE = shutil.which("kustomize") or shutil.which("kubectl")


@pytest.mark.skipif(KUSTOMIZE is None or os.environ.get("SLUICE_NETNS") != "1",
                    reason="needs kustomize or kubectl, run inside the test namespace (scripts/in-netns.sh)")
def test_kustomize_itself_renders_what_these_tests_model(tmp_path):
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump({
        "resources": [os.path.relpath(K8S, overlay)], "components": [os.path.relpath(COMPONENT, overlay)]}))
    argv = [KUSTOMIZE, "build", str(overlay)] if KUSTOMIZE.endswith("kustomize") else [KUSTOMIZE, "kustomize",
                                                                                       str(overlay)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    built = {(d["kind"], d["metadata"].get("namespace", ""), d["metadata"]["name"]): d
             for d in yaml.safe_load_all(done.stdout) if d}
    assert built == rendered()
