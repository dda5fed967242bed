"""requirements.lock pins every runtime dependency (version and hashes), and
both the Makefile's set-up and the Dockerfile install from it.

When one of these fails after a dependency was added to or changed in
pyproject.toml, regenerate the lock with `make lock` and commit it."""

from __future__ import annotations

import re
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / "requirements.lock"
FIX = "run `make lock` (regenerates requirements.lock from pyproject.toml) and commit requirements.lock"


def locked() -> dict[str, tuple[str, list[str], str]]:
    """name -> (version, hashes, marker text) for each entry of the lock."""
    entries: dict[str, tuple[str, list[str], str]] = {}
    text = LOCK.read_text().replace("\\\n", " ")
    for line in text.splitlines():
        line = line.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        requirement, _, options = line.partition(" --hash=")
        options = "--hash=" + options if options else ""
        req = Requirement(requirement.strip())
        pins = [s for s in req.specifier if s.operator == "=="]
        assert len(pins) == 1 and len(req.specifier) == 1, f"requirements.lock: {line!r} is not pinned with =="
        hashes = re.findall(r"--hash=sha256:([0-9a-f]{64})", options)
        entries[canonicalize_name(req.name)] = (pins[0].version, hashes, str(req.marker or ""))
    return entries


def runtime_requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [Requirement(r) for r in project["dependencies"]]


def test_every_runtime_dependency_is_locked_at_a_version_it_accepts():
    lock = locked()
    missing, mismatched = [], []
    for req in runtime_requirements():
        name = canonicalize_name(req.name)
        if name not in lock:
            missing.append(str(req))
        elif not req.specifier.contains(lock[name][0], prereleases=True):
            mismatched.append(f"{req} (locked: {lock[name][0]})")
    assert not missing, f"pyproject.toml dependencies missing from requirements.lock: {missing}; {FIX}"
    assert not mismatched, f"requirements.lock pins versions pyproject.toml no longer accepts: {mismatched}; {FIX}"


def test_every_locked_entry_has_hashes():
    unhashed = [name for name, (_, hashes, _) in locked().items() if not hashes]
    assert not unhashed, f"requirements.lock entries without --hash: {unhashed}; {FIX}"


def test_the_lock_is_closed_under_the_installed_dependencies():
    """Every dependency (on this platform) of every runtime dependency, walked
    through the installed distributions, is in the lock too."""
    lock = locked()
    env = default_environment()
    seen, todo, missing = set(), [canonicalize_name(r.name) for r in runtime_requirements()], []
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue  # not installed here: the first test reports a runtime dependency missing from the lock
        for text in requires:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate({**env, "extra": ""}):
                continue
            dep = canonicalize_name(req.name)
            if dep not in lock:
                missing.append(f"{dep} (needed by {name})")
            todo.append(dep)
    assert not missing, f"dependencies missing from requirements.lock: {sorted(set(missing))}; {FIX}"


def test_the_set_up_and_the_image_install_from_the_lock():
    makefile = (ROOT / "Makefile").read_text()
    assert "LOCK := requirements.lock" in makefile
    assert re.search(r"pip install -q --require-hashes -r \$\(LOCK\)", makefile)
    assert re.search(r"^\$\(VENV\)/\.installed: pyproject\.toml \$\(LOCK\)$", makefile, re.M)
    assert re.search(r"^lock: ", makefile, re.M), "the Makefile has no `lock` target"
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "COPY requirements.lock" in dockerfile
    assert re.search(r"pip install [^\n]*--require-hashes[^\n]*-r requirements\.lock", dockerfile)
    assert re.search(r"pip install [^\n]*--no-deps", dockerfile), "the image must install Sluice itself with --no-deps"
