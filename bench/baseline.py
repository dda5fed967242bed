"""`--baseline-tree`: another checkout's (or commit's) Sluice, run beside the current one.

The checkout is not laid out as it is installed: `sluice.addons`,
`sluice.policy` and `sluice.webtools` live in `addons/`, `policy/` and
`webtools/` beside `sluice/` (pyproject's `[tool.setuptools.package-dir]`).
`PYTHONPATH=TREE` alone therefore imports TREE's `sluice/*.py` but, for the
subpackages it cannot find there, falls through to this venv's editable
install: the current checkout's addons and policy, a mix of the two trees.
So the baseline gets an import root of its own, links in the installed
layout (as `make lint` builds for mypy), and before any round the bench asks
a child Python, with each side's environment, which file each Sluice module
comes from, and refuses to run a mix.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import tomllib
from dataclasses import dataclass
from pathlib import Path

# What is checked: the command, an addon, the policy engine, the web tools.
PROBED = ("sluice.cli", "sluice.addons.gate", "sluice.policy.decide", "sluice.webtools")


class BaselineError(Exception):
    """The baseline cannot be run as asked; the text says why and what to do."""


@dataclass
class Baseline:
    tree: Path  # the checkout (or the commit's files): its config/policy.yaml is the baseline's policy
    import_root: Path  # first on PYTHONPATH: `import sluice...` loads `tree`'s code
    label: str  # a commit (short hash) or the directory

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """The environment the baseline's Sluice runs in (with `python -P`,
        so the current directory's checkout is not put first either)."""
        return dict(os.environ if base is None else base, PYTHONPATH=str(self.import_root))


def prepare(spec: str, repo: Path, work: Path) -> Baseline:
    """`spec` is a Sluice checkout's directory or a commit of `repo` (whose
    files are exported under `work`, no worktree left behind); either way
    its import root is built under `work`."""
    path = Path(spec)
    if path.is_dir():
        tree = path.resolve()
        if not (tree / "sluice" / "cli.py").is_file():
            raise BaselineError(f"{spec} is not a Sluice checkout (it has no sluice/cli.py)")
        label = _git(["-C", str(tree), "rev-parse", "--short", "HEAD"]) or str(tree)
    else:
        commit = _git(["-C", str(repo), "rev-parse", "--verify", "--quiet", f"{spec}^{{commit}}"])
        if not commit:
            raise BaselineError(f"{spec} is neither a directory nor a commit of {repo}; give a checkout's "
                                "directory or a commit (a hash, a tag, a branch)")
        tree = work / f"baseline-{commit[:12]}"
        export(repo, commit, tree)
        if not (tree / "sluice" / "cli.py").is_file():
            raise BaselineError(f"commit {commit[:12]} has no sluice/cli.py: it predates the `sluice` command")
        label = commit[:12]
    return Baseline(tree, import_root(tree, work / "baseline-imports"), label)


def export(repo: Path, commit: str, into: Path) -> None:
    """The files of `commit` in `into` (`git archive`: the repository is not changed)."""
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(repo), "archive", "--format=tar", commit], capture_output=True,
                             timeout=120)
    if archive.returncode != 0:
        raise BaselineError(f"git archive {commit[:12]} failed: {archive.stderr.decode(errors='replace').strip()}")
    tar = into.with_suffix(".tar")
    tar.write_bytes(archive.stdout)
    with tarfile.open(tar) as t:
        t.extractall(into, filter="data")
    tar.unlink()


def package_dirs(tree: Path) -> dict[str, str]:
    """The tree's package -> directory mapping (pyproject's package-dir);
    without one, each package is where its name says."""
    try:
        data = tomllib.loads((tree / "pyproject.toml").read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError):
        data = {}
    mapping = data.get("tool", {}).get("setuptools", {}).get("package-dir") or {}
    return {str(k): str(v) for k, v in mapping.items() if k} or {"sluice": "sluice"}


def import_root(tree: Path, into: Path) -> Path:
    """A directory of links giving `tree`'s packages their installed layout:
    `into/sluice/cli.py -> tree/sluice/cli.py`, `into/sluice/addons -> tree/addons`'s
    files, and so on. Parents are laid out before their subpackages, which
    replace whatever link of the parent's sits at their place."""
    into.mkdir(parents=True, exist_ok=True)
    for package, directory in sorted(package_dirs(tree).items(), key=lambda item: item[0].count(".")):
        source = (tree / directory).resolve()
        target = into.joinpath(*package.split("."))
        if target.is_symlink():
            target.unlink()
        target.mkdir(parents=True, exist_ok=True)
        for entry in source.iterdir():
            if entry.name == "__pycache__" or (target / entry.name).exists():
                continue
            (target / entry.name).symlink_to(entry)
    return into


def imported_files(env: dict[str, str], python: str = sys.executable,
                   modules: tuple[str, ...] = PROBED) -> dict[str, str]:
    """Module -> the real path of the file a child `python -P` imports it
    from, in `env`."""
    probe = ("import importlib, json, os, sys\n"
             "print(json.dumps({m: os.path.realpath(importlib.import_module(m).__file__) for m in sys.argv[1:]}))")
    done = subprocess.run([python, "-P", "-c", probe, *modules], env=env, capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise BaselineError(f"the baseline's Sluice does not import: {last}")
    return json.loads(done.stdout)


def mixed(files: dict[str, str], tree: Path) -> list[str]:
    """The modules in `files` that do not come from `tree`."""
    root = tree.resolve()
    return [module for module, file in files.items() if not Path(file).is_relative_to(root)]


def verify(baseline: Baseline, log=print) -> None:
    """Say which file each side imports each probed module from, and refuse
    a baseline that is not wholly its own tree's code."""
    current = imported_files(dict(os.environ))
    theirs = imported_files(baseline.env())
    for module in PROBED:
        log(f"bench: {module}: current {current[module]}; baseline {theirs[module]}")
    wrong = mixed(theirs, baseline.tree)
    if wrong:
        raise BaselineError(f"the baseline would import {', '.join(wrong)} from outside {baseline.tree} "
                            f"({theirs[wrong[0]]}): not a like-for-like comparison")


def _git(args: list[str]) -> str:
    try:
        done = subprocess.run(["git", *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""
