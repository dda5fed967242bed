"""The image's command line, run as the image runs it.

CI has no container engine, so the image is never built here. Instead the
Dockerfile's final stage is parsed and its ENTRYPOINT + CMD are started
exactly, substituting only paths (the `sluice` executable, the policy file
the image copies to /etc/sluice/policy.yaml, here the packaged starter
policy in place of config/policy.yaml, the CA directory of its ENV),
inside a namespace of its own as a container would be (it listens on
0.0.0.0:8080 there, and reaches the test origins through a veth). The
HEALTHCHECK command is run inside that namespace too.

As the image's USER (uid 10001, no capabilities: harness/image_user.py),
the ENTRYPOINT with compose.intercept.yaml's command and its read-only CA
mount intercepts with a CA directory given to that user as docs/deploy.md
says, and a directory left to root is one line naming the fix.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from harness import image_user
from harness.agentns import AgentNamespace, missing_tools
from harness.clients import curl
from harness.fakedns import FakeDNS
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


def image_policy_text() -> str:
    """The policy the image's command runs with here. The image COPYs
    config/policy.yaml, the user's copy to edit, which tests never read (an
    edit must not fail `make test`): the packaged starter policy, which that
    copy starts as, stands in for it."""
    assert any(word == "COPY" and rest.split()[-1] == IMAGE_POLICY for word, rest in final_stage()), \
        f"the image does not COPY a policy to {IMAGE_POLICY}"
    return (ROOT / "sluice" / "starter_policy.yaml").read_text()


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
        super().__init__(workdir, image_policy_text(), name="image")
        self.container = container
        self.argv = argv

    def command(self) -> list[str]:
        return self.container.wrap(self.image_argv())

    def image_argv(self) -> list[str]:
        """The image's argv, its paths pointing into the test's directory."""
        self.host, self.port = self.container.inner_ip, 8080
        paths = {"sluice": sluice_executable(), IMAGE_POLICY: str(self.policy_file)}
        return [paths.get(a, a) for a in self.argv]


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


def test_the_image_command_listens_where_it_says_and_enforces_the_starter_policy(image, container, net):
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


# ------------------------------------------------ a mounted CA directory, as the image's user

COMPOSE_INTERCEPT = ROOT / "deploy" / "compose" / "compose.intercept.yaml"


def image_user_ids() -> tuple[int, int]:
    """The final stage's USER, uid:gid (numeric, as runAsNonRoot needs)."""
    found = [rest for word, rest in final_stage() if word == "USER"]
    assert found, "the image sets no USER: it would run as root"
    uid, _, gid = found[-1].partition(":")
    return int(uid), int(gid or uid)


def compose_intercept() -> tuple[list[str], str, bool]:
    """compose.intercept.yaml's Sluice: its command (the image's CMD), where it
    mounts ./ca, and whether read-only."""
    sluice = yaml.safe_load(COMPOSE_INTERCEPT.read_text())["services"]["sluice"]
    [volume] = [v for v in sluice["volumes"] if v.split(":")[0] == "./ca"]
    _, target, *mode = volume.split(":")
    assert target in sluice["command"], "the compose command does not give the mounted CA as --ca-dir"
    return sluice["command"], target, mode == ["ro"]


class ImageUserCommand(ImageCommand):
    """The image's ENTRYPOINT + compose.intercept's command, run as the image's
    user with the CA directory mounted as compose mounts it."""

    def __init__(self, workdir: Path, container: AgentNamespace, ca: Path, readable: list[Path],
                 extra: tuple[str, ...] = ()):
        command, self.ca_target, self.ca_read_only = compose_intercept()
        super().__init__(workdir, container, exec_form("ENTRYPOINT") + command + list(extra))
        self.ca, self.readable = ca, readable

    def image_argv(self) -> list[str]:
        return [str(self.ca) if a == self.ca_target else a for a in super().image_argv()]

    def command(self) -> list[str]:
        uid, gid = image_user_ids()
        return self.container.wrap(image_user.as_user(
            self.image_argv(), uid=uid, gid=gid, stash=self.container.stash / self.workdir.name,
            readable=[*image_user.interpreter_paths(), *self.readable, self.workdir],
            read_only=[self.ca] if self.ca_read_only else []))


@pytest.fixture(scope="module")
def user_container(netns):
    missing = missing_tools() or ([why] if (why := image_user.missing()) else [])
    if missing:
        pytest.skip(f"running the image's command as its user: {', '.join(missing)}")
    with AgentNamespace("imgu", "10.199.9") as ns:
        # The container's resolver: reached over the veth, as a cluster's DNS service is.
        dns = FakeDNS(ns.outer_ip, 53)
        dns.set("example.com", a=["8.8.8.8"])
        dns.start()
        ns.stash = Path(tempfile.mkdtemp(prefix="sluice-image-user-"))  # outside pytest's closed directories
        try:
            yield ns
        finally:
            dns.stop()
            shutil.rmtree(ns.stash, ignore_errors=True)


def image_user_workdir(tmp_path: Path) -> Path:
    """The test's directory as the image's filesystem has it: the policy
    readable by all, a HOME (the image's /var/lib/sluice) its user's own."""
    uid, gid = image_user_ids()
    tmp_path.chmod(0o755)
    home = tmp_path / "var-lib-sluice"
    (home / "ca").mkdir(parents=True)
    for path in (home, home / "ca"):
        os.chown(path, uid, gid)
    (home / "ca").chmod(0o700)
    return tmp_path


def make_ca(directory: Path, *args: str) -> None:
    made = subprocess.run([sluice_executable(), "ca", "--ca-dir", str(directory), *args], capture_output=True,
                          text=True, timeout=60)
    assert made.returncode == 0, made.stderr


def run_as_image_user(proc: ImageUserCommand, monkeypatch) -> ImageUserCommand:
    monkeypatch.setenv("HOME", str(proc.workdir / "var-lib-sluice"))
    monkeypatch.setenv("SLUICE_CA_DIR", str(proc.workdir / "var-lib-sluice" / "ca"))
    return proc


@pytest.mark.parametrize("how", ["sluice ca --owner", "chown -R"])
def test_a_ca_directory_given_to_the_image_user_is_mounted_and_intercepts(user_container, net, tls_ca, tmp_path,
                                                                          monkeypatch, how):
    uid, gid = image_user_ids()
    workdir = image_user_workdir(tmp_path)
    ca = workdir / "ca"
    if how == "chown -R":  # docs/deploy.md: made on the host, then given to the image's user
        make_ca(ca)
        subprocess.run(["chown", "-R", f"{uid}:{gid}", str(ca)], check=True, timeout=10)
    else:
        make_ca(ca, "--owner", f"{uid}:{gid}")
    key = ca / "mitmproxy-ca.pem"
    assert (ca.stat().st_uid, ca.stat().st_gid, key.stat().st_uid) == (uid, gid, uid)
    assert (stat_mode(ca), stat_mode(key)) == (0o700, 0o600), "the CA stays owner-only"
    before = {p.name: p.read_bytes() for p in ca.iterdir()}
    policy = default_policy(intercept=["example.com"],
                            dns={"nameservers": [f"{user_container.outer_ip}:53"], "timeout": "2s"})
    proc = ImageUserCommand(workdir, user_container, ca, readable=[Path(tls_ca.cafile)],
                            extra=("--set", f"ssl_verify_upstream_trusted_ca={tls_ca.cafile}"))
    proc.policy = policy
    run_as_image_user(proc, monkeypatch).start()
    try:
        assert proc.ready_line is not None and proc.ready_line.startswith("sluice: ready on 0.0.0.0:8080"), \
            proc.ready_line
        assert process_ids(proc.proc.pid) == (uid, gid), "the proxy must run as the image's user, not root"
        # The agent trusts only the mounted CA's certificate: the intercepted leaf chains to it.
        got = curl("-x", f"http://{user_container.inner_ip}:8080", "--cacert", str(ca / "mitmproxy-ca-cert.pem"),
                   "https://example.com/image-user-ca")
        assert got.status == 200, (got, proc.stderr_text())
    finally:
        proc.stop()
    assert {p.name: p.read_bytes() for p in ca.iterdir()} == before, "nothing is written into the mounted CA"


def test_a_ca_directory_left_to_root_is_one_line_naming_the_fix(user_container, tmp_path, monkeypatch):
    uid, gid = image_user_ids()
    workdir = image_user_workdir(tmp_path)
    ca = workdir / "ca"
    make_ca(ca)  # as root: root's, 0700, key 0600 (not what docs/deploy.md says to mount)
    proc = run_as_image_user(ImageUserCommand(workdir, user_container, ca, readable=[]), monkeypatch)
    proc.policy_file.write_text(image_policy_text())
    out = subprocess.run(proc.command(), capture_output=True, text=True, timeout=60, env={**os.environ})
    assert out.returncode == 2, out
    assert "Traceback" not in out.stderr
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"sluice: the CA directory {ca} is owned by 0:0 with mode 0700"), \
        out.stderr
    assert f"runs as {uid}:{gid}" in lines[0] and f"chown -R {uid}:{gid} DIR" in lines[0]
    assert f"sluice ca --ca-dir DIR --owner {uid}:{gid}" in lines[0]


def stat_mode(path: Path) -> int:
    return path.stat().st_mode & 0o7777


def process_ids(pid: int) -> tuple[int, int]:
    """A process's real uid and gid, from /proc."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return int(fields["Uid"].split()[0]), int(fields["Gid"].split()[0])
