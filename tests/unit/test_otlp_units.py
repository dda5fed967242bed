"""addons/otlp.py without a proxy: where the endpoint comes from, the bounded
queue that drops and counts instead of waiting, and a bad URL as one line
and exit 2. No test here sends a packet off loopback (the one exporter
dials a loopback port nobody listens on)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from sluice.addons import otlp
from sluice.addons.otlp import Exporter, attributes, resolve_endpoint

SLUICE = str(Path(sys.executable).parent / "sluice")


@pytest.mark.parametrize("option, env, expected", [
    ("", {}, None),
    ("http://collector:4318", {}, "http://collector:4318/v1/logs"),
    ("http://collector:4318/", {}, "http://collector:4318/v1/logs"),
    ("https://collector/v1/logs", {}, "https://collector/v1/logs"),
    ("", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, "http://c:4318/v1/logs"),
    ("", {"OTEL_EXPORTER_OTLP_LOGS_ENDPOINT": "http://c:4318/x"}, "http://c:4318/x"),
    # The logs variable wins over the general one; the option over both; 'off' over everything.
    ("", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://a:1", "OTEL_EXPORTER_OTLP_LOGS_ENDPOINT": "http://b:2/l"}, "http://b:2/l"),
    ("http://o:3", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://a:1"}, "http://o:3/v1/logs"),
    ("off", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://a:1"}, None),
    ("", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://a:1", "OTEL_LOGS_EXPORTER": "none"}, None),
])
def test_where_the_endpoint_comes_from(option, env, expected):
    assert resolve_endpoint(option, env)[0] == expected


@pytest.mark.parametrize("bad", ["ftp://c:21", "collector:4318", "http://", "http://c:port"])
def test_a_bad_endpoint_is_a_sentence(bad):
    with pytest.raises(ValueError, match="not an http:// or https:// URL"):
        resolve_endpoint(bad, {})


def test_attributes_are_the_fields_that_are_not_null():
    assert attributes({"event": "request", "status": 403, "user": None, "would_refuse": True}) == {
        "sluice.event": "request", "sluice.status": 403, "sluice.would_refuse": True}


def free_loopback_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_full_queue_drops_and_counts_without_waiting(monkeypatch):
    monkeypatch.setattr(otlp, "QUEUE_LIMIT", 5)
    monkeypatch.setattr(otlp, "FLUSH_SECONDS", 60.0)  # the thread stays asleep while the queue fills
    monkeypatch.setattr(otlp, "BATCH_SIZE", 1000)
    counted = []
    exporter = Exporter(f"http://127.0.0.1:{free_loopback_port()}/v1/logs", on_drop=counted.append)
    try:
        for i in range(12):
            exporter.submit({"event": "request", "id": str(i)})
        assert exporter.dropped == 7 and sum(counted) == 7
        assert len(exporter._queue) == 5
    finally:
        exporter.shutdown(timeout=0.5)


def test_a_bad_endpoint_exits_2_in_one_line(tmp_path):
    for args, env in ((["--otlp-endpoint", "ftp://collector"], {}),
                      ([], {"OTEL_EXPORTER_OTLP_LOGS_ENDPOINT": "collector:4318"})):
        result = subprocess.run([SLUICE, "proxy", "--ca-dir", str(tmp_path / "ca"), "--admin", "off",
                                 "--listen", "127.0.0.1:0", *args], capture_output=True, text=True, timeout=60,
                                env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), **env}, cwd=tmp_path)
        assert result.returncode == 2
        assert result.stderr.count("\n") == 1 and "is not an http:// or https:// URL" in result.stderr
        assert "Traceback" not in result.stderr
