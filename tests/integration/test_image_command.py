"""The image's command line, run as the image runs it.

CI has no container engine, so the image is never built here. Instead the
Dockerfile's final stage is parsed and its ENTRYPOINT + CMD are started
exactly, substituting only paths (the `sluice` executable, the policy file
the image copies to /etc/sluice/policy.yaml, the CA directory of its ENV),
inside a namespace of its own as a container would be (it listens on
0.0.0.0:8080 there, and reaches the test origins through a veth). The
HEALTHCHECK command is run inside that namespace too.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.agentns import AgentNamespace, missing_tools
from harness.clients import curl
from harness.sluice import SluiceProcess, default_policy, sluice_executable

pytestmark = pytest.mark.netns

ROOT = Path(__file__).resolve().parents[2]
IMAGE_POLICY = "/etc/sluice/policy.yaml"


def final_stage() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile's last stage, continuations joined."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    stages: list[list[tuple[str, str]]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        word, _, rest = line.partition(" ")
        word = word.upper()
        if word == "FROM":
            stages.append([])
        stages[-1].append((word, rest.strip()))
    return stages[-1]


def exec_form(instruction: str) -> list[str]:
    found = [rest for word, rest in final_stage() if word == instruction]
    assert found, f"the Dockerfile's final stage has no {instruction}"
    value = json.loads(found[-1])  # exec form only: a shell form would need a shell in the image
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), f"{instruction} is not in exec form"
    return value


def image_env() -> dict[str, str]:
    env: dict[str, str] = {}
    for word, rest in final_stage():
        if word == "ENV":
            for item in shlex.split(rest):
                name, _, value = item.partition("=")
                env[name] = value
    return env


def copied_policy_source() -> Path:
    for word, rest in final_stage():
        if word == "COPY" and rest.split()[-1] == IMAGE_POLICY:
            return ROOT / rest.split()[-2]
    raise AssertionError(f"the image does not COPY a policy to {IMAGE_POLICY}")


def healthcheck() -> list[str]:
    for word, rest in final_stage():
        if word == "HEALTHCHECK":
            cmd = rest[rest.index("CMD ") + 4:]
            return json.loads(cmd)
    raise AssertionError("the image has no HEALTHCHECK")


def has_admin_listener() -> bool:
    out = subprocess.run([sluice_executable(), "proxy", "--help"], capture_output=True, text=True, timeout=60)
    return "--admin" in out.stdout


class ImageCommand(SluiceProcess):
    """Runs the image's argv (paths substituted) inside a container-like namespace."""

    def __init__(self, workdir: Path, container: AgentNamespace, argv: list[str]):
        super().__init__(workdir, copied_policy_source().read_text(), name="image")
        self.container = container
        self.argv = argv

    def command(self) -> list[str]:
        self.host, self.port = self.container.inner_ip, 8080
        paths = {"sluice": sluice_executable(), IMAGE_POLICY: str(self.policy_file)}
        return self.container.wrap([paths.get(a, a) for a in self.argv])


@pytest.fixture(scope="module")
def container(netns):
    missing = missing_tools()
    if missing:
        pytest.skip(f"needs {', '.join(missing)} to make a container-like namespace")
    with AgentNamespace("img", "10.199.1") as ns:
        yield ns


@pytest.fixture(scope="module")
def image(container, net, tmp_path_factory):
    argv = exec_form("ENTRYPOINT") + exec_form("CMD")
    env = image_env()
    # Every ENV of the image is reproduced; paths point into the test's directory.
    assert set(env) == {"PYTHONDONTWRITEBYTECODE", "PYTHONUNBUFFERED", "PATH", "SLUICE_CA_DIR"}, env
    workdir = tmp_path_factory.mktemp("image")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SLUICE_CA_DIR", str(workdir / "var-lib-sluice" / "ca"))
        mp.setenv("PYTHONDONTWRITEBYTECODE", env["PYTHONDONTWRITEBYTECODE"])
        proc = ImageCommand(workdir, container, argv).start()
    yield proc
    proc.stop()


def test_the_image_command_is_the_documented_one():
    assert exec_form("ENTRYPOINT") + exec_form("CMD") == [
        "sluice", "proxy", "--policy", IMAGE_POLICY, "--listen", "0.0.0.0:8080"]
    exposed = [rest for word, rest in final_stage() if word == "EXPOSE"]
    assert exposed == ["8080"], "EXPOSE only what the default command listens on"


def test_the_image_command_listens_where_it_says_and_enforces_the_bundled_policy(image, container, net):
    assert image.ready_line is not None
    assert image.ready_line.startswith("sluice: ready on 0.0.0.0:8080 (mode regular;"), image.ready_line
    proxy = f"http://{container.inner_ip}:8080"
    ok = curl("-x", proxy, "http://8.8.8.8/image-ok")
    assert ok.status == 200, ok
    refused = curl("-x", proxy, "http://169.254.169.254/latest/meta-data/")
    assert refused.status == 403 and refused.headers.get("sluice-reason") == "address_not_public", refused
    # The audit log goes to stdout (the container's log).
    deadline = time.monotonic() + 5
    while True:
        lines = [json.loads(line) for line in image.stdout_file.read_text().splitlines() if line.startswith("{")]
        if any(e.get("host") == "169.254.169.254" and e.get("reason") == "address_not_public" for e in lines):
            break
        assert time.monotonic() < deadline, f"no audit line for the refusal on stdout: {lines}"
        time.sleep(0.05)


def test_the_ca_lands_in_the_images_ca_directory(image):
    ca = Path(image.workdir) / "var-lib-sluice" / "ca"
    assert (ca / "mitmproxy-ca.pem").is_file() and (ca / "mitmproxy-ca-cert.pem").is_file()


def test_the_healthcheck_command_passes_inside_the_container(image, container):
    if not has_admin_listener():
        pytest.skip("`sluice proxy` has no --admin listener yet: the HEALTHCHECK calls its /readyz")
    argv = healthcheck()
    assert argv[0] == "python"
    out = container.run([sys.executable, *argv[1:]], timeout=20)
    assert out.returncode == 0, out.stderr


# ------------------------------------------------ one CA for every replica

class ReadOnlyCAReplica(SluiceProcess):
    """`sluice proxy --ca-dir SECRET` where SECRET is bind-mounted read-only
    in the process's own mount namespace, as the kubelet mounts a Secret."""

    def __init__(self, *args, secret: Path, **kwargs):
        super().__init__(*args, **kwargs)
        self.secret = secret

    def command(self) -> list[str]:
        user = [] if os.geteuid() == 0 else ["-r"]
        script = 'mount --bind "$1" "$1" && mount -o remount,bind,ro "$1" && shift && exec "$@"'
        return ["unshare", "-m", *user, "sh", "-c", script, "sh", str(self.secret),
                *super().command(), "--ca-dir", str(self.secret)]


def test_replicas_given_one_read_only_ca_present_certificates_from_it(netns, fake_dns, net, tls_ca, tmp_path):
    if shutil.which("unshare") is None or shutil.which("mount") is None:
        pytest.skip("needs unshare and mount (util-linux) for a read-only bind mount")
    secret = tmp_path / "secret"
    made = subprocess.run([sluice_executable(), "ca", "--ca-dir", str(secret)], capture_output=True, text=True,
                          timeout=60)
    assert made.returncode == 0, made.stderr
    for path in secret.iterdir():
        path.chmod(0o444)
    before = {p.name: p.read_bytes() for p in secret.iterdir()}
    policy = default_policy(intercept=["example.com"])
    replicas = [ReadOnlyCAReplica(tmp_path / f"r{i}", policy, name=f"replica{i}", secret=secret,
                                  extra_args=("--set", f"ssl_verify_upstream_trusted_ca={tls_ca.cafile}"))
                for i in range(2)]
    try:
        for replica in replicas:
            replica.start()
        for replica in replicas:
            # The agent trusts the Secret's certificate only; each replica's leaf chains to it.
            got = curl("-x", replica.proxy_url, "--cacert", str(secret / "mitmproxy-ca-cert.pem"),
                       "https://example.com/shared-ca")
            assert got.status == 200, got
        assert {p.name: p.read_bytes() for p in secret.iterdir()} == before, "nothing is written into the Secret"
    finally:
        for replica in replicas:
            replica.stop()
