"""The packages install and run outside the clone (issue 26 item 1): the
wheel built here goes into fresh virtual environments in a temporary
directory, one with the agent side's dependencies only (no mitmproxy) and
one with the proxy extra's too; the agent side's tools work there and
never import mitmproxy, `sluice proxy` without the extra says in one line
what to install, and with it the proxy starts on the packaged starter policy.

Offline by design (tests run without a package registry): the wheel is built
without isolation, and each fresh environment sees exactly the locked
distributions of its side, linked from this venv, never the clone's
editable install. The proxy started here listens on 127.0.0.1 and is sent
nothing."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
from packaging.utils import canonicalize_name

from harness.sluice import ready_line_of
from test_lock import AGENT_LOCK, LOCK, locked  # tests/unit is on the path (rootdir conftest)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    built = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(ROOT)],
                           capture_output=True, text=True, timeout=300, cwd=out)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    assert len(list(out.glob("sluice-*.tar.gz"))) == 1, "no sdist"
    wheels = list(out.glob("sluice-*.whl"))
    assert len(wheels) == 1, list(out.iterdir())
    return wheels[0]


def _top_levels(dist: metadata.Distribution) -> set[str]:
    return {Path(f).parts[0] for f in dist.files or () if not str(f).startswith("..")}


def fresh_env(where: Path, lock: Path, wheel: Path) -> Path:
    """A venv in `where` holding the wheel and, linked from this venv, exactly
    the distributions `lock` pins (and their files, nothing else)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where / "venv")], check=True, timeout=120)
    python = where / "venv" / "bin" / "python"
    farm = where / "deps"
    farm.mkdir()
    wanted = set(locked(lock))
    site = Path(sysconfig.get_paths()["purelib"])
    for dist in metadata.distributions(path=[str(site)]):
        if canonicalize_name(dist.metadata["Name"]) in wanted:
            for name in _top_levels(dist):
                if (site / name).exists() and not (farm / name).exists():
                    (farm / name).symlink_to(site / name)
    target = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                            capture_output=True, text=True, check=True).stdout.strip()
    (Path(target) / "locked-deps.pth").write_text(f"{farm}\n")
    install = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-index",
                              "--no-deps", str(wheel)], capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr
    return where / "venv" / "bin"


def run(bin_dir: Path, *args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(cwd)}
    return subprocess.run([str(bin_dir / args[0]), *args[1:]], capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def test_the_wheel_holds_one_package_and_the_starter_policy(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert "sluice/starter_policy.yaml" in names
    assert "sluice/addons/gate.py" in names and "sluice/policy/decide.py" in names
    assert "sluice/webtools/tools.py" in names
    assert not [n for n in names if n.split("/")[0] in ("addons", "policy", "webtools", "tests", "bench")]
    requires = [line for line in zipfile.ZipFile(wheel).read(
        next(n for n in names if n.endswith(".dist-info/METADATA"))).decode().splitlines()
        if line.startswith("Requires-Dist: mitmproxy")]
    assert requires and all('extra == "proxy"' in line for line in requires), requires


def test_the_agent_side_installs_and_runs_without_mitmproxy(wheel, tmp_path):
    bin_dir = fresh_env(tmp_path, AGENT_LOCK, wheel)
    elsewhere = tmp_path / "work"
    elsewhere.mkdir()
    probe = run(bin_dir, "python", "-c", "import importlib.util, sys, sluice; "
                "import sluice.webtools.tools, sluice.webtools.mcp_server, sluice.webtools.cli, sluice.policy_cli; "
                "assert importlib.util.find_spec('mitmproxy') is None, 'mitmproxy is installed'; "
                "assert not [m for m in sys.modules if m.startswith('mitmproxy')]; print(sluice.__file__)",
                cwd=elsewhere)
    assert probe.returncode == 0, probe.stderr
    assert not probe.stdout.startswith(str(ROOT)), "imported the clone, not the wheel"
    schema = run(bin_dir, "sluice", "tools", "schema", "--format", "anthropic", cwd=elsewhere)
    assert schema.returncode == 0 and '"web_fetch"' in schema.stdout, schema.stderr
    assert run(bin_dir, "sluice", "mcp", "--help", cwd=elsewhere).returncode == 0
    check = run(bin_dir, "sluice", "policy", "check", cwd=elsewhere)  # the packaged starter
    assert check.returncode == 0 and "reaches any public host on ports 80, 443" in check.stdout, check.stderr
    assert run(bin_dir, "sluice", "policy", "init", "mine.yaml", cwd=elsewhere).returncode == 0
    assert run(bin_dir, "sluice", "policy", "check", "--strict", "mine.yaml", cwd=elsewhere).returncode == 0
    for command in ("proxy", "ca"):
        refused = run(bin_dir, "sluice", command, cwd=elsewhere)
        assert refused.returncode == 2 and refused.stdout == ""
        assert refused.stderr.splitlines() == [
            f"sluice: `sluice {command}` needs the proxy extra, which is not installed: pip install 'sluice[proxy]'"]


@pytest.mark.skipif(os.path.lexists("/etc/sluice/policy.yaml"), reason="this machine has /etc/sluice/policy.yaml")
def test_the_proxy_extra_installs_and_starts_on_the_starter_policy(wheel, tmp_path):
    bin_dir = fresh_env(tmp_path, LOCK, wheel)
    elsewhere = tmp_path / "work"
    elsewhere.mkdir()
    line = ready_line_of([str(bin_dir / "sluice"), "proxy", "--listen", "127.0.0.1:0", "--admin", "off"],
                         env={"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(elsewhere)}, cwd=elsewhere, timeout=90)
    assert "policy starter policy (any public host)" in line
