"""deploy/k8s: every manifest validates against Kubernetes' own schemas
(kubernetes-validate, offline, strict), and the essentials hold: replicas,
anti-affinity, a locked-down securityContext, probes on the admin listener,
a grace period above the drain timeout, the policy as a directory mount, one
CA from a Secret, PDB, HPA, and NetworkPolicies whose exceptions are exactly
Sluice's own table of non-public ranges."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import netaddr
import pytest
import yaml

from sluice.cli import main
from sluice.policy import ranges

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
KUBERNETES_VERSION = "1.30"  # the oldest release these manifests are checked against (and the newest below)


def documents() -> dict[tuple[str, str, str], dict]:
    """(kind, namespace, name) -> manifest, over every file the kustomization
    lists and the ConfigMaps its configMapGenerator makes (as kustomize does,
    with disableNameSuffixHash)."""
    found = {}
    for name in kustomization()["resources"]:
        for doc in yaml.safe_load_all((K8S / name).read_text()):
            if doc:
                found[(doc["kind"], doc["metadata"].get("namespace", ""), doc["metadata"]["name"])] = doc
    options = kustomization().get("generatorOptions", {})
    assert options.get("disableNameSuffixHash") is True, "a hashed ConfigMap name restarts pods instead of hot reload"
    for generator in kustomization().get("configMapGenerator", []):
        data = {Path(f).name: (K8S / f).read_text() for f in generator["files"]}
        doc = {"apiVersion": "v1", "kind": "ConfigMap", "data": data,
               "metadata": {"name": generator["name"], "namespace": generator["namespace"],
                            "labels": options.get("labels", {})}}
        found[("ConfigMap", generator["namespace"], generator["name"])] = doc
    return found


def kustomization() -> dict:
    return yaml.safe_load((K8S / "kustomization.yaml").read_text())


def one(kind: str, name: str | None = None, namespace: str | None = None) -> dict:
    matches = [d for (k, ns, n), d in documents().items()
               if k == kind and (name is None or n == name) and (namespace is None or ns == namespace)]
    assert len(matches) == 1, f"expected one {kind} {name or ''}, found {len(matches)}"
    return matches[0]


def sluice_container() -> dict:
    containers = one("Deployment", "sluice")["spec"]["template"]["spec"]["containers"]
    return next(c for c in containers if c["name"] == "sluice")


def arg(container: dict, flag: str, default: str | None = None) -> str | None:
    args = container.get("args", [])
    values = [args[i + 1] for i, a in enumerate(args[:-1]) if a == flag]
    return values[-1] if values else default


def test_the_kustomization_lists_every_manifest():
    listed = set(kustomization()["resources"])
    generated = {f for g in kustomization().get("configMapGenerator", []) for f in g["files"]}
    assert generated == {"policy.yaml"}
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"} - generated
    assert listed == on_disk


@pytest.mark.parametrize("version", [KUBERNETES_VERSION, "1.37.0"])
def test_every_manifest_validates_against_the_kubernetes_schemas(version):
    problems = []
    for (kind, _, name), doc in documents().items():
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            problems.append(f"{kind}/{name}: {e.message} at {'.'.join(map(str, e.path))}")
        except kubernetes_validate.SchemaNotFoundError as e:  # pragma: no cover - a typo in apiVersion/kind
            problems.append(f"{kind}/{name}: no schema ({e})")
    assert problems == []


def test_the_deployment_is_replicated_spread_and_locked_down():
    deployment = one("Deployment", "sluice")
    spec = deployment["spec"]
    pod = spec["template"]["spec"]
    labels = spec["template"]["metadata"]["labels"]
    assert spec["replicas"] >= 2
    assert spec["selector"]["matchLabels"].items() <= labels.items()
    term = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"].items() <= labels.items()
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    assert pod["automountServiceAccountToken"] is False
    context = sluice_container()["securityContext"]
    assert context["runAsNonRoot"] is True
    assert context["readOnlyRootFilesystem"] is True
    assert context["allowPrivilegeEscalation"] is False
    assert context.get("privileged", False) is False
    assert context["capabilities"]["drop"] == ["ALL"] and not context["capabilities"].get("add")
    resources = sluice_container()["resources"]
    assert {"cpu", "memory"} <= set(resources["requests"]) and {"cpu", "memory"} <= set(resources["limits"])


def test_probes_reach_the_admin_listener_and_the_grace_period_outlasts_the_drain():
    container = sluice_container()
    assert arg(container, "--admin") == "0.0.0.0:9090"
    admin_ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert admin_ports["admin"] == 9090
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "admin"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "admin"}
    assert container["startupProbe"]["httpGet"]["path"] == "/readyz"
    drain = float(arg(container, "--drain-timeout", "30"))
    grace = one("Deployment", "sluice")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > drain + 5, "SIGKILL must not come before the drain is over"


def test_the_container_ports_are_the_listeners_the_args_open():
    container = sluice_container()
    ports = {p["containerPort"] for p in container["ports"]}
    modes = [a for i, a in enumerate(container["args"]) if i and container["args"][i - 1] == "--mode"]
    expected = {8080, 9090} | {int(m.split("@")[1]) for m in modes if "@" in m}
    assert ports == expected
    service = one("Service", "sluice")
    assert {p["port"] for p in service["spec"]["ports"]} == expected - {9090}, "the agents' Service has no admin port"


def test_the_policy_is_a_configmap_mounted_as_a_directory_and_valid(tmp_path):
    pod = one("Deployment", "sluice")["spec"]["template"]["spec"]
    mount = next(m for m in sluice_container()["volumeMounts"] if m["mountPath"] == "/etc/sluice")
    assert "subPath" not in mount, "a subPath mount never sees ConfigMap updates"
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    configmap = one("ConfigMap", volume["configMap"]["name"])
    assert set(configmap["data"]) == {"policy.yaml"}  # the file the image's --policy names
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text(configmap["data"]["policy.yaml"])
    assert main(["policy", "check", "--strict", "--policy", str(policy_file)]) == 0


def test_one_ca_from_a_read_only_secret_with_a_writable_tmpdir():
    pod = one("Deployment", "sluice")["spec"]["template"]["spec"]
    container = sluice_container()
    ca_dir = arg(container, "--ca-dir")
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == ca_dir)
    assert mount["readOnly"] is True
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert volume["secret"]["secretName"] == "sluice-ca" and not volume["secret"].get("optional")
    env = {e["name"]: e["value"] for e in container.get("env", [])}
    tmp = next(m for m in container["volumeMounts"] if m["mountPath"] == env.get("TMPDIR", "/tmp"))
    tmp_volume = next(v for v in pod["volumes"] if v["name"] == tmp["name"])
    assert tmp_volume["emptyDir"]["medium"] == "Memory", "the key's private copy stays off the node's disk"


def test_the_pdb_and_hpa_keep_two_replicas_and_scale_on_cpu():
    labels = one("Deployment", "sluice")["spec"]["template"]["metadata"]["labels"]
    pdb = one("PodDisruptionBudget", "sluice")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert pdb["spec"]["minAvailable"] >= 1
    hpa = one("HorizontalPodAutoscaler", "sluice")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "sluice"}
    assert hpa["spec"]["minReplicas"] >= 2 and hpa["spec"]["maxReplicas"] > hpa["spec"]["minReplicas"]
    assert [m["resource"]["name"] for m in hpa["spec"]["metrics"]] == ["cpu"]


def merged(version: int) -> set[str]:
    table = ranges.IPV4_NON_PUBLIC if version == 4 else ranges.IPV6_NON_PUBLIC
    return {str(n) for n in netaddr.cidr_merge([r.cidr for r in table])}


def test_sluice_egress_is_the_internet_minus_every_non_public_range_of_the_table():
    policy = one("NetworkPolicy", "sluice", "sluice")
    assert set(policy["spec"]["policyTypes"]) == {"Ingress", "Egress"}
    blocks = {b["ipBlock"]["cidr"]: set(b["ipBlock"].get("except", []))
              for rule in policy["spec"]["egress"] for b in rule.get("to", []) if "ipBlock" in b}
    assert blocks["0.0.0.0/0"] == merged(4), ("the except list must be netaddr.cidr_merge(sluice.policy.ranges' IPv4 "
                                              "table)")
    assert blocks["::/0"] == merged(6)
    # And nothing the table calls non-public is reachable through any other ipBlock.
    for cidr in set(blocks) - {"0.0.0.0/0", "::/0"}:
        pytest.fail(f"an extra ipBlock {cidr}: it must match a private_networks entry of the policy")


def test_sluice_may_reach_the_resolver_its_policy_uses_and_its_private_networks():
    configmap = one("ConfigMap", "sluice-policy")
    policy = yaml.safe_load(configmap["data"]["policy.yaml"])
    egress = one("NetworkPolicy", "sluice", "sluice")["spec"]["egress"]
    blocks = {b["ipBlock"]["cidr"] for rule in egress for b in rule.get("to", []) if "ipBlock" in b}
    for network in policy.get("private_networks") or []:
        assert network in blocks, f"private_networks opens {network}: the NetworkPolicy must too"
    nameservers = (policy.get("dns") or {}).get("nameservers") or []
    for server in nameservers:
        host = server.rsplit(":", 1)[0] if server.count(":") == 1 else server
        assert f"{host}/32" in blocks or f"{host}/128" in blocks, f"nameserver {server} is not reachable"
    if not nameservers:  # the pod's resolv.conf: the cluster resolver
        dns = [rule for rule in egress if any(
            b.get("podSelector", {}).get("matchLabels") == {"k8s-app": "kube-dns"} for b in rule.get("to", []))]
        assert dns and {(p["protocol"], p["port"]) for p in dns[0]["ports"]} == {("UDP", 53), ("TCP", 53)}


def test_agents_may_reach_only_sluices_proxy_ports():
    policy = one("NetworkPolicy", namespace="agents")
    spec = policy["spec"]
    assert spec["podSelector"] == {} and spec["policyTypes"] == ["Egress"]
    assert len(spec["egress"]) == 1, "agents get one way out: Sluice"
    rule = spec["egress"][0]
    labels = one("Deployment", "sluice")["spec"]["template"]["metadata"]["labels"]
    (peer,) = rule["to"]
    assert "ipBlock" not in peer
    assert peer["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "sluice"}
    assert peer["podSelector"]["matchLabels"].items() <= labels.items()
    service_ports = {p["port"] for p in one("Service", "sluice")["spec"]["ports"]}
    assert {p["port"] for p in rule["ports"]} == service_ports
    # The agents' namespace carries the label Sluice's ingress rule admits.
    agents = one("Namespace", "agents")
    ingress = one("NetworkPolicy", "sluice", "sluice")["spec"]["ingress"][0]["from"][0]["namespaceSelector"]
    assert ingress["matchLabels"].items() <= agents["metadata"]["labels"].items()
