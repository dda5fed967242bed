"""A policy is found without a path (issue 26 item 2): `--policy FILE`, else
$SLUICE_POLICY, else /etc/sluice/policy.yaml, else the starter policy
packaged with Sluice; a named file that is missing is an error, never a
fallback; `sluice policy init` writes the starter; the ready line names the
policy it loaded and the admin address.

The proxy started here listens on 127.0.0.1 only and is sent nothing."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from harness.sluice import ready_line_of
from sluice.policy_location import ENV, STARTER_LABEL, STARTER_NAME, locate, starter_path

SLUICE = str(Path(sys.executable).parent / "sluice")
ROOT = Path(__file__).resolve().parents[2]


def sluice(*args, env_extra: dict[str, str] | None = None, home: Path, timeout: float = 60):
    env = {"PATH": "/usr/bin:/bin", "HOME": str(home), **(env_extra or {})}
    return subprocess.run([SLUICE, *map(str, args)], capture_output=True, text=True, timeout=timeout, env=env,
                          stdin=subprocess.DEVNULL, cwd=home)


def test_an_explicit_path_wins_and_is_never_replaced(tmp_path):
    missing = str(tmp_path / "typo.yaml")
    assert locate(missing, {ENV: "/elsewhere.yaml"}, system=str(tmp_path / "system.yaml")).path == missing


def test_the_environment_variable_comes_next_even_when_its_file_is_missing(tmp_path):
    system = tmp_path / "system.yaml"
    system.write_text("version: 1\n")
    where = locate(None, {ENV: str(tmp_path / "typo.yaml")}, system=str(system))
    assert where.path == str(tmp_path / "typo.yaml") and "$SLUICE_POLICY" in where.label


def test_the_system_policy_then_the_starter(tmp_path):
    system = tmp_path / "system.yaml"
    assert locate(None, {}, system=str(system)).path == starter_path()
    assert locate(None, {}, system=str(system)).label == STARTER_LABEL
    system.symlink_to(tmp_path / "dangling")  # present but unreadable: an error later, not a fallback
    assert locate(None, {ENV: ""}, system=str(system)).path == str(system)


def test_the_starter_is_package_data_and_a_valid_policy(tmp_path):
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert STARTER_NAME in project["tool"]["setuptools"]["package-data"]["sluice"]
    assert Path(starter_path()).is_file()
    out = sluice("policy", "check", "--strict", starter_path(), home=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "reaches any public host on ports 80, 443" in out.stdout


def test_check_without_a_path_reads_the_environment_variable(tmp_path):
    policy = tmp_path / "mine.yaml"
    policy.write_text("version: 1\nallow: [example.com]\n")
    out = sluice("policy", "check", home=tmp_path, env_extra={ENV: str(policy)})
    assert out.returncode == 0 and out.stdout.startswith(f"{policy}: OK"), out.stdout + out.stderr


def test_a_missing_named_policy_is_an_error_not_a_fallback(tmp_path):
    typo = tmp_path / "typo.yaml"
    for args, env in ((["--policy", typo], {}), ([], {ENV: str(typo)})):
        out = sluice("proxy", *args, "--listen", "127.0.0.1:0", "--admin", "off", home=tmp_path, env_extra=env)
        assert out.returncode == 2, out.stderr
        assert f"{typo}" in out.stderr and "No such file" in out.stderr
        assert "ready" not in out.stderr
    out = sluice("policy", "check", home=tmp_path, env_extra={ENV: str(typo)})
    assert out.returncode == 1 and str(typo) in out.stdout + out.stderr


def test_init_writes_the_starter_and_keeps_an_existing_file(tmp_path):
    out = sluice("policy", "init", "p.yaml", home=tmp_path)
    assert out.returncode == 0, out.stderr
    written = tmp_path / "p.yaml"
    assert written.read_text() == Path(starter_path()).read_text()
    assert "sluice policy check p.yaml" in out.stderr
    written.write_text("version: 1\n# mine\n")
    out = sluice("policy", "init", "p.yaml", home=tmp_path)
    assert out.returncode == 2 and "already exists" in out.stderr and "--force" in out.stderr
    assert written.read_text() == "version: 1\n# mine\n"
    assert sluice("policy", "init", "p.yaml", "--force", home=tmp_path).returncode == 0
    assert written.read_text() == Path(starter_path()).read_text()
    printed = sluice("policy", "init", "-", home=tmp_path)
    assert printed.returncode == 0 and printed.stdout == Path(starter_path()).read_text()


@pytest.mark.skipif(os.path.lexists("/etc/sluice/policy.yaml"), reason="this machine has /etc/sluice/policy.yaml")
def test_the_proxy_without_a_policy_loads_the_starter_and_says_so(tmp_path):
    line = ready_line_of([SLUICE, "proxy", "--listen", "127.0.0.1:0", "--admin", "127.0.0.1:0"],
                         env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}, cwd=tmp_path)
    assert f"policy {STARTER_LABEL}" in line
    assert "; admin 127.0.0.1:" in line
