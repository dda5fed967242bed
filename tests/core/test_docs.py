"""The README's reason table is generated from nowhere but must match policy/reasons.py."""

import re
from pathlib import Path

from sluice.policy.reasons import REASONS

ROOT = Path(__file__).resolve().parents[2]


def test_readme_reason_table_matches_the_code():
    text = (ROOT / "README.md").read_text()
    rows = re.findall(r"^\| `([a-z_]+)` \| (\d{3}) \| (.+) \|$", text, re.M)
    documented = {code: (int(status), meaning) for code, status, meaning in rows}
    expected = {r.value: (info.status, info.meaning) for r, info in REASONS.items()}
    assert documented == expected


def test_readme_shows_the_two_commands_first():
    text = (ROOT / "README.md").read_text()
    first_block = text.split("```")[1]
    assert "make run" in first_block and "make test" in first_block


def test_test_module_names_are_unique():
    # pytest imports test modules by basename (no packages under tests/): two
    # files with one name stop the whole run at collection.
    names = [p.name for p in (ROOT / "tests").rglob("test_*.py")]
    assert sorted({n for n in names if names.count(n) > 1}) == []
