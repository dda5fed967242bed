"""`bench --baseline-tree` (bench/baseline.py) without running a bench: a
checkout's split layout (addons/, policy/, webtools/ beside sluice/) gets an
import root in the installed layout, so a child Python imports every Sluice
module from the baseline's tree (PYTHONPATH=TREE alone took the subpackages
from this venv's install: the current code); a commit is exported; a
baseline that would mix the two trees, or is neither a checkout nor a
commit, is refused with a sentence. Uses small fake checkouts, no proxy."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # the repository's bench/ package
from bench import baseline  # noqa: E402
from bench.baseline import Baseline, BaselineError  # noqa: E402

PYPROJECT = """[tool.setuptools.package-dir]
"sluice" = "sluice"
"sluice.addons" = "addons"
"sluice.policy" = "policy"
"sluice.webtools" = "webtools"
"""
FILES = {"sluice/__init__.py": "", "sluice/cli.py": "", "addons/__init__.py": "", "addons/gate.py": "",
         "policy/__init__.py": "", "policy/decide.py": "", "webtools/__init__.py": "", "config/policy.yaml": ""}


def checkout(root: Path, marker: str = "") -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "pyproject.toml").write_text(PYPROJECT)
    for name, text in FILES.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text or f"MARK = {marker!r}\n")
    return root


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.invalid",
                           *args], check=True, capture_output=True, text=True).stdout.strip()


def test_the_import_root_makes_every_module_come_from_the_baselines_tree(tmp_path):
    tree = checkout(tmp_path / "base")
    root = baseline.import_root(tree, tmp_path / "imports")
    files = baseline.imported_files(dict(os.environ, PYTHONPATH=str(root)))
    assert set(files) == set(baseline.PROBED)
    assert baseline.mixed(files, tree) == []
    assert files["sluice.addons.gate"] == str((tree / "addons" / "gate.py").resolve())
    assert files["sluice.policy.decide"] == str((tree / "policy" / "decide.py").resolve())


def test_pythonpath_at_the_tree_alone_mixes_in_the_current_code_and_verify_refuses_it(tmp_path):
    tree = checkout(tmp_path / "base")
    files = baseline.imported_files(dict(os.environ, PYTHONPATH=str(tree)))
    assert files["sluice.cli"] == str((tree / "sluice" / "cli.py").resolve())
    assert baseline.mixed(files, tree) == ["sluice.addons.gate", "sluice.policy.decide", "sluice.webtools"]
    logged: list[str] = []
    with pytest.raises(BaselineError, match="from outside .*not a like-for-like comparison"):
        baseline.verify(Baseline(tree, tree, "old way"), logged.append)
    assert len(logged) == len(baseline.PROBED)


def test_verify_says_which_file_each_side_imports(tmp_path):
    tree = checkout(tmp_path / "base")
    base = Baseline(tree, baseline.import_root(tree, tmp_path / "imports"), "test")
    logged: list[str] = []
    baseline.verify(base, logged.append)
    gate = next(line for line in logged if line.startswith("bench: sluice.addons.gate: "))
    assert gate.startswith(f"bench: sluice.addons.gate: current {REPO / 'addons' / 'gate.py'}; ")
    assert gate.endswith(f"baseline {(tree / 'addons' / 'gate.py').resolve()}")


def test_a_commit_is_exported_as_it_was_committed_and_laid_out(tmp_path):
    repo = checkout(tmp_path / "repo", marker="committed")
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "baseline")
    commit = git(repo, "rev-parse", "HEAD")
    (repo / "addons" / "gate.py").write_text("MARK = 'changed since'\n")  # the work tree moved on
    base = baseline.prepare(commit[:10], repo, tmp_path / "work")
    assert base.label == commit[:12] and base.tree == tmp_path / "work" / f"baseline-{commit[:12]}"
    assert (base.tree / "addons" / "gate.py").read_text() == "MARK = 'committed'\n"
    files = baseline.imported_files(base.env())
    assert baseline.mixed(files, base.tree) == []
    assert git(repo, "worktree", "list").count("\n") == 0  # nothing added to the repository


def test_a_directory_that_is_not_a_checkout_or_an_unknown_commit_is_refused_with_a_sentence(tmp_path):
    repo = checkout(tmp_path / "repo")
    git(repo, "init", "-q")
    with pytest.raises(BaselineError, match="is not a Sluice checkout"):
        baseline.prepare(str(tmp_path), repo, tmp_path / "work")
    with pytest.raises(BaselineError, match="is neither a directory nor a commit of .*give a checkout's directory"):
        baseline.prepare("no-such-commit", repo, tmp_path / "work")
