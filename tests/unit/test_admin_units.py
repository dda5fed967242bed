"""The admin listener's pure parts: --admin parsing and clashes, readiness,
the audit-record-to-metric mapping, and the workers' aggregation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

from sluice.addons.status import Status
from sluice.admin import parse_admin, readyz, same_listener
from sluice.addons.audit import FIELDS, AuditLog
from sluice.workers import _admin_clash


def test_parse_admin():
    assert parse_admin("127.0.0.1:9090") == ("127.0.0.1", 9090)
    assert parse_admin("[::1]:9090") == ("::1", 9090)
    assert parse_admin("0.0.0.0:9090") == ("0.0.0.0", 9090)
    assert parse_admin("off") is None and parse_admin("OFF") is None
    for bad in ("9090", "host", "127.0.0.1:99999", ""):
        with pytest.raises(ValueError, match="--admin"):
            parse_admin(bad)


def test_same_listener():
    assert same_listener(("127.0.0.1", 8080), ("127.0.0.1", 8080))
    assert same_listener(("0.0.0.0", 8080), ("127.0.0.1", 8080))
    assert same_listener(("127.0.0.1", 8080), ("::", 8080))
    assert not same_listener(("127.0.0.1", 9090), ("127.0.0.1", 8080))
    assert not same_listener(("127.0.0.2", 8080), ("127.0.0.1", 8080))


def test_workers_admin_clash_covers_mode_ports():
    listen = ("127.0.0.1", 8080)
    assert _admin_clash(("127.0.0.1", 8080), listen, [])
    assert _admin_clash(("127.0.0.1", 1080), listen, ["regular", "socks5@1080"])
    assert _admin_clash(("0.0.0.0", 1080), listen, ["socks5@10.0.0.5:1080"])
    assert not _admin_clash(("127.0.0.1", 9090), listen, ["regular", "socks5@1080"])


def test_readyz_answers():
    assert readyz(True, False)[:2] == (200, "text/plain; charset=utf-8")
    assert readyz(False, False)[0] == 503 and readyz(False, False)[2] == b"not ready\n"
    assert readyz(True, True) == (503, "text/plain; charset=utf-8", b"draining\n")


def status(current=True) -> Status:
    source = SimpleNamespace(current=SimpleNamespace(generation=1, digest="ab" * 32) if current else None)
    return Status(AuditLog(), source)


def record(**fields) -> dict:
    return {k: fields.get(k) for k in FIELDS}


def test_status_is_ready_only_when_listening_with_a_policy_and_not_draining(monkeypatch):
    monkeypatch.delenv("SLUICE_WORKER_DIR", raising=False)
    s = status()
    assert not s.ready  # before `running`: listeners not up
    s.listening = True
    assert s.ready
    s.drain()
    assert not s.ready and s.draining
    nopolicy = status(current=False)
    nopolicy.listening = True
    assert not nopolicy.ready


def test_status_keeps_the_last_reload_result_without_its_detail(monkeypatch):
    monkeypatch.delenv("SLUICE_WORKER_DIR", raising=False)
    audit = AuditLog()
    source = SimpleNamespace(current=SimpleNamespace(generation=1, digest="ab" * 32))
    s = Status(audit, source)
    s.observe(record(event="reload", decision="failed", time="2026-01-01T00:00:00.000Z", detail="p.yaml:3:1: secret"))
    assert s.last_reload == {"result": "failed", "time": "2026-01-01T00:00:00.000Z"}
    source.current = SimpleNamespace(generation=2, digest="cd" * 32)
    s.observe(record(event="reload", decision="ok", time="2026-01-01T00:00:01.000Z"))
    assert s.generation == 2 and s.loaded_at is not None and s.last_reload["result"] == "ok"
    s.observe(record(event="request", decision="allow"))
    assert s.last_reload["result"] == "ok"


def test_status_publishes_for_the_supervisor(tmp_path, monkeypatch):
    monkeypatch.setenv("SLUICE_WORKER_DIR", str(tmp_path))
    s = status()
    s.listening = True
    s.publish()
    published = json.loads((tmp_path / f"status-{os.getpid()}.json").read_text())
    assert published["pid"] == os.getpid() and published["ready"] is True and published["draining"] is False
    assert published["policy"]["sha256"] == "ab" * 32
    s.drain()
    assert json.loads((tmp_path / f"status-{os.getpid()}.json").read_text())["draining"] is True


MAPPING = textwrap.dedent("""
    import json, sys
    from types import SimpleNamespace
    from prometheus_client import REGISTRY
    from sluice.addons.audit import FIELDS, AuditLog
    from sluice.addons.metrics import Metrics

    def rec(**f):
        return {k: f.get(k) for k in FIELDS}

    audit = AuditLog()
    source = SimpleNamespace(current=SimpleNamespace(generation=1, digest="ab" * 32))
    m = Metrics(audit, source, lambda: [])
    m.policy_changed()
    for r in [
        rec(event="request", decision="allow", profile="agents", bytes_in=100, bytes_out=7),
        rec(event="request", decision="refuse", reason="host_denied", profile="agents", bytes_in=0, bytes_out=0),
        rec(event="connect", decision="refuse", reason="connect_timeout"),
        rec(event="tunnel", decision="allow", profile="agents", bytes_in=5, bytes_out=6),
        rec(event="tunnel", decision="refuse", reason="tunnel_too_large", profile="agents", bytes_in=9),
        rec(event="tunnel", decision="refuse", reason="shutdown"),
        rec(event="reload", decision="failed"),
    ]:
        m.observe(r)
    source.current = SimpleNamespace(generation=2, digest="cd" * 32)
    m.observe(rec(event="reload", decision="ok"))
    out = {}
    for family in REGISTRY.collect():
        for s in family.samples:
            if s.name.startswith("sluice_") and s.value:
                out[s.name + json.dumps(s.labels, sort_keys=True)] = s.value
    print(json.dumps(out))
""")


FRESH = textwrap.dedent("""
    import json
    from types import SimpleNamespace
    from prometheus_client import REGISTRY
    from sluice.addons.audit import AuditLog
    from sluice.addons.metrics import Metrics

    Metrics(AuditLog(), SimpleNamespace(current=None), lambda: [])
    out = [[s.name, s.labels, s.value] for family in REGISTRY.collect() for s in family.samples
           if s.name.startswith("sluice_")]
    print(json.dumps(out))
""")


def test_known_label_values_are_series_before_anything_happened():
    # rate(sluice_policy_reloads_total{result="failed"}[5m]) must be 0, not
    # "no data", on a proxy that has never reloaded.
    from sluice.addons.metrics import CAP_REASONS

    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    samples = json.loads(subprocess.run([sys.executable, "-c", FRESH], capture_output=True, text=True, check=True,
                                        env=env, timeout=60).stdout)
    present = {(name, json.dumps(labels, sort_keys=True)): value for name, labels, value in samples}
    for result in ("ok", "failed"):
        assert present.get(("sluice_policy_reloads_total", json.dumps({"result": result}))) == 0, samples
        assert present.get(("sluice_dns_lookup_seconds_count", json.dumps({"result": result}))) == 0, samples
    for reason in CAP_REASONS:
        assert present.get(("sluice_caps_tripped_total", json.dumps({"kind": reason.value}))) == 0, reason


def test_audit_records_become_metrics(tmp_path):
    # A fresh interpreter: the metrics live in the process's default registry.
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    out = json.loads(subprocess.run([sys.executable, "-c", MAPPING], capture_output=True, text=True, check=True,
                                    env=env, timeout=60).stdout)
    L = lambda name, **labels: out.get(name + json.dumps(labels, sort_keys=True))  # noqa: E731
    assert L("sluice_requests_total", event="request", decision="allow", reason="", profile="agents") == 1
    assert L("sluice_requests_total", event="request", decision="refuse", reason="host_denied", profile="agents") == 1
    assert L("sluice_requests_total", event="connect", decision="refuse", reason="connect_timeout", profile="") == 1
    assert L("sluice_tunnels_total", decision="allow", reason="", profile="agents") == 1
    assert L("sluice_tunnels_total", decision="refuse", reason="shutdown", profile="") == 1
    assert L("sluice_received_bytes_total", profile="agents") == 114
    assert L("sluice_sent_bytes_total", profile="agents") == 13
    assert L("sluice_caps_tripped_total", kind="connect_timeout") == 1
    assert L("sluice_caps_tripped_total", kind="tunnel_too_large") == 1
    assert L("sluice_caps_tripped_total", kind="host_denied") is None  # a policy refusal, not a cap
    assert L("sluice_caps_tripped_total", kind="shutdown") is None
    assert L("sluice_policy_reloads_total", result="failed") == 1 and L("sluice_policy_reloads_total", result="ok") == 1
    assert L("sluice_policy_info", sha256="cd" * 32) == 1 and L("sluice_policy_info", sha256="ab" * 32) is None


WORKERS = textwrap.dedent("""
    import os, sys
    from types import SimpleNamespace
    from sluice.addons.audit import FIELDS, AuditLog
    from sluice.addons.metrics import Metrics

    source = SimpleNamespace(current=SimpleNamespace(generation=1, digest=sys.argv[1]))
    m = Metrics(AuditLog(), source, lambda: [])
    m.policy_changed()
    if len(sys.argv) > 2:  # a reload to another policy
        source.current = SimpleNamespace(generation=2, digest=sys.argv[2])
        m.policy_changed()
    m.observe({**{k: None for k in FIELDS}, "event": "request", "decision": "allow", "bytes_in": 10})
""")


def test_the_supervisor_sums_the_workers(tmp_path):
    from prometheus_client import generate_latest

    from sluice.addons.metrics import workers_registry

    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
    for args in (["aa"], ["aa", "bb"]):
        subprocess.run([sys.executable, "-c", WORKERS, *args], check=True, env=env, timeout=60)
    text = generate_latest(workers_registry(str(tmp_path), lambda: [])).decode()
    assert 'sluice_requests_total{decision="allow",event="request",profile="",reason=""} 2.0' in text
    assert 'sluice_received_bytes_total{profile=""} 20.0' in text
    assert 'sluice_policy_info{sha256="bb"} 1.0' in text and 'sluice_policy_info{sha256="aa"} 1.0' in text
    assert "process_cpu_seconds_total" in text


def metric_names() -> set[str]:
    """Every sample name the metrics module can produce."""
    from prometheus_client import REGISTRY

    import sluice.addons.metrics  # noqa: F401 - registers them

    names = set()
    for family in REGISTRY.collect():
        if family.name.startswith("sluice_"):
            base = family.name + ("_total" if family.type == "counter" else "")
            names |= {base, family.name + "_bucket", family.name + "_count", family.name + "_sum"}
    return names


def test_the_dashboard_uses_only_real_metrics():
    import re
    from pathlib import Path

    dashboard = json.loads((Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "sluice.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    used = {name for e in exprs for name in re.findall(r"\b(sluice_[a-z_]+)", e)}
    assert used and used <= metric_names(), used - metric_names()
    titles = " ".join(p["title"].lower() for p in dashboard["panels"])
    for topic in ("refusals by reason", "latency", "reloads", "open client connections"):
        assert topic in titles
    assert "audit log" in json.dumps(dashboard)  # where top refused hosts are


def test_the_readme_lists_every_metric():
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    from prometheus_client import REGISTRY

    import sluice.addons.metrics  # noqa: F401

    for family in REGISTRY.collect():
        if family.name.startswith("sluice_"):
            name = family.name + ("_total" if family.type == "counter" else "")
            assert f"`{name}" in readme, name
