"""Installing Sluice puts one top-level import package on a user's path:
`sluice` (with `sluice.addons` and `sluice.policy`), never modules named
`addons` or `policy` that would shadow a user's own."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_distribution_declares_only_the_sluice_package():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert all(p == "sluice" or p.startswith("sluice.") for p in config["packages"])
    assert config["package-dir"] == {"sluice": "sluice", "sluice.addons": "addons", "sluice.policy": "policy",
                                     "sluice.webtools": "webtools"}


def test_outside_the_checkout_only_sluice_imports(tmp_path):
    probe = (
        "import importlib.util, sluice.addons.gate, sluice.policy.decide;"
        "print(importlib.util.find_spec('addons'), importlib.util.find_spec('policy'))"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["None", "None"]


def test_no_module_imports_the_old_top_level_names():
    offenders = []
    for path in [*ROOT.glob("addons/*.py"), *ROOT.glob("policy/*.py"), *ROOT.glob("sluice/*.py"),
                 *ROOT.glob("bench/*.py"), *ROOT.glob("tests/**/*.py")]:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            stripped = line.strip()
            if stripped.startswith(("from addons", "import addons", "from policy", "import policy")):
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {stripped}")
    assert offenders == []
