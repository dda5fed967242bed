"""bench's shared-store phase (bench/store.py) without running it: the policy it
gives the store-backed Sluice loads and counts in the bench's redis-server, and
without redis-server the phase is skipped with one line, in the log and in the
report."""

from __future__ import annotations

import sys
from pathlib import Path

from sluice.policy.loader import load_policy_file

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # bench/ is a directory of the checkout, not an installed package

from bench import policies, report, run  # noqa: E402
from bench import store as shared_store  # noqa: E402


def test_the_store_policy_is_the_limits_policy_counted_in_the_bench_store(tmp_path):
    path = policies.write_store(tmp_path, shared_store.url(), f"{shared_store.TIMEOUT:g}s")
    policy = load_policy_file(path)
    assert policy.state is not None
    assert policy.state.url == f"redis://{shared_store.HOST}:{shared_store.PORT}/0"
    assert policy.state.timeout == shared_store.TIMEOUT and policy.state.password is None
    local = load_policy_file(policies.write_all(tmp_path)["limits"])
    assert local.state is None and policy.rules.limits == local.rules.limits


def test_without_redis_server_the_phase_is_skipped_with_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(shared_store.shutil, "which", lambda name: None)
    results: dict = {"machine": {}, "settings": {"run_phases": ("store",)}}
    files: dict[str, Path] = {}
    lines: list[str] = []
    assert run._start_store(tmp_path, files, results, lines.append) is None
    assert "limits-store" not in files
    assert len(lines) == 1 and "redis-server is not installed" in lines[0]
    assert report.store_lines(results) == [f"Shared limits (phase `store`): skipped ({results['store']['skipped']})"]
