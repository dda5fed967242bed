"""Fixtures for the unit tests: pure functions and in-process CLI runs.

Nothing here may touch the network: `no_network` (autouse) makes any live DNS
lookup fail the test, so a case that forgets `resolve` cannot leak a query.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    async def refuse(self, name):
        raise AssertionError(f"a unit test tried a live DNS lookup of {name!r}")

    monkeypatch.setattr("sluice.resolver.PinnedResolver.resolve", refuse)
    monkeypatch.setattr("sluice.policy_cli.LiveResolver.resolve", refuse)


@dataclass
class Result:
    code: int
    out: str
    err: str


@pytest.fixture
def cli(capsys):
    """Run `sluice ARGS...` in-process: cli(["policy", "check", path]) -> Result."""
    from sluice.cli import main

    def run(args: list[str]) -> Result:
        capsys.readouterr()
        try:
            code = main([str(a) for a in args])
        except SystemExit as e:  # argparse usage errors
            code = e.code if isinstance(e.code, int) else 2
        captured = capsys.readouterr()
        return Result(code, captured.out, captured.err)

    return run


@pytest.fixture
def write(tmp_path):
    """write("policy.yaml", text) -> path of a file in this test's tmp dir."""

    def _write(name: str, text: str | bytes) -> Path:
        path = tmp_path / name
        if isinstance(text, bytes):
            path.write_bytes(text)
        else:
            path.write_text(text, encoding="utf-8")
        return path

    return _write
