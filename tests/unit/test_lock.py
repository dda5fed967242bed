"""requirements.lock pins every runtime dependency (version and hashes), the
proxy extra's included, and both the Makefile's set-up and the Dockerfile
install from it; requirements-agent.lock pins the agent side alone
(`pip install sluice`) at the same versions, without mitmproxy.

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
AGENT_LOCK = ROOT / "requirements-agent.lock"
FIX = ("run `make lock` (regenerates requirements.lock and requirements-agent.lock from pyproject.toml) "
       "and commit both")
PROXY_ONLY = {"mitmproxy", "prometheus-client", "opentelemetry-sdk", "opentelemetry-exporter-otlp-proto-http"}


def locked(path: Path = LOCK) -> dict[str, tuple[str, list[str], str]]:
    """name -> (version, hashes, marker text) for each entry of the lock."""
    entries: dict[str, tuple[str, list[str], str]] = {}
    text = path.read_text().replace("\\\n", " ")
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


def agent_requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [Requirement(r) for r in project["dependencies"]]


def runtime_requirements() -> list[Requirement]:
    """The agent side plus the proxy extra: what requirements.lock pins."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return agent_requirements() + [Requirement(r) for r in project["optional-dependencies"]["proxy"]]


def test_the_agent_side_needs_no_proxy_dependency():
    names = {canonicalize_name(r.name) for r in agent_requirements()}
    assert not names & PROXY_ONLY, f"pyproject.toml's dependencies hold proxy-only packages: {names & PROXY_ONLY}"
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert {canonicalize_name(Requirement(r).name) for r in extras["proxy"]} >= PROXY_ONLY


def test_the_agent_lock_is_the_full_locks_subset_at_the_same_versions():
    full, agent = locked(LOCK), locked(AGENT_LOCK)
    differ = {name: (entry[0], full.get(name, ("absent",))[0]) for name, entry in agent.items()
              if name not in full or full[name][0] != entry[0]}
    assert not differ, (f"requirements-agent.lock pins versions requirements.lock does not (agent, full): {differ}; "
                        f"{FIX}")
    missing = [str(r) for r in agent_requirements() if canonicalize_name(r.name) not in agent]
    assert not missing, f"agent dependencies missing from requirements-agent.lock: {missing}; {FIX}"
    assert not set(agent) & PROXY_ONLY, f"requirements-agent.lock holds proxy-only packages; {FIX}"
    assert all(hashes for _, hashes, _ in agent.values()), f"requirements-agent.lock entries without --hash; {FIX}"


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
    assert "AGENT_LOCK := requirements-agent.lock" in makefile
    assert re.search(r"^\$\(VENV\)/\.installed: pyproject\.toml \$\(LOCK\)$", makefile, re.M)
    assert re.search(r"^lock: ", makefile, re.M), "the Makefile has no `lock` target"
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "COPY requirements.lock" in dockerfile
    assert re.search(r"pip install [^\n]*--require-hashes[^\n]*-r requirements\.lock", dockerfile)
    assert re.search(r"pip install [^\n]*--no-deps", dockerfile), "the image must install Sluice itself with --no-deps"
