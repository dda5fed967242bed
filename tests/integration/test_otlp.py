"""The audit records as OTLP logs (addons/otlp.py): a test collector on
127.0.0.1 (inside the namespace) decodes what the proxy sends with the
generated protobuf classes of opentelemetry-proto."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest, ExportLogsServiceResponse

from harness import default_policy
from harness.sluice import free_port

pytestmark = pytest.mark.netns


def value_of(any_value):
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind else None


class Collector:
    """An OTLP/HTTP logs receiver: every log record, flattened to a dict."""

    def __init__(self) -> None:
        self.records: list[dict] = []
        self.paths: list[str] = []
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = ExportLogsServiceRequest.FromString(body)
                for resource_logs in request.resource_logs:
                    resource = {a.key: value_of(a.value) for a in resource_logs.resource.attributes}
                    for scope_logs in resource_logs.scope_logs:
                        for log in scope_logs.log_records:
                            collector.records.append({
                                "resource": resource, "scope": scope_logs.scope.name,
                                "attributes": {a.key: value_of(a.value) for a in log.attributes},
                                "body": value_of(log.body), "severity": log.severity_text,
                                "time_unix_nano": log.time_unix_nano, "content_type": self.headers["Content-Type"],
                            })
                collector.paths.append(self.path)
                reply = ExportLogsServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def wait(self, predicate, timeout: float = 20.0) -> list[dict]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [r for r in list(self.records) if predicate(r)]
            if found:
                return found
            time.sleep(0.1)
        raise AssertionError(f"the collector got no such record in {timeout}s; it got {self.records!r}")

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def collector():
    c = Collector()
    yield c
    c.close()


def get(proxy, url: str) -> httpx.Response:
    with httpx.Client(proxy=proxy.proxy_url, trust_env=False, timeout=10) as c:
        return c.get(url)


def test_allowed_and_refused_records_reach_the_collector_with_their_fields(sluice_factory, collector):
    proxy = sluice_factory(default_policy(), name="otlp", extra_args=("--otlp-endpoint", collector.url))
    assert get(proxy, "http://public.example/").status_code == 200
    refused = get(proxy, "http://169.254.169.254/latest/meta-data/")
    assert refused.status_code == 403 and refused.headers["sluice-reason"] == "address_not_public"

    allowed = collector.wait(lambda r: r["attributes"].get("sluice.decision") == "allow")[0]
    refusal = collector.wait(lambda r: r["attributes"].get("sluice.reason") == "address_not_public")[0]
    assert collector.paths[0] == "/v1/logs" and allowed["content_type"] == "application/x-protobuf"
    lines = {line["id"]: line for line in proxy.audit() if line["event"] == "request"}
    for record in (allowed, refusal):
        line = lines[record["attributes"]["sluice.id"]]
        # Every field of the audit line that is not null, under sluice.FIELD; the body is the line.
        assert record["attributes"] == {f"sluice.{k}": v for k, v in line.items() if v is not None}
        assert json.loads(record["body"]) == line
        assert record["resource"]["service.name"] == "sluice"
        assert record["resource"]["service.instance.id"].endswith(f":{record['resource']['process.pid']}")
        assert record["scope"] == "sluice.audit"
    assert allowed["attributes"]["sluice.host"] == "public.example" and allowed["severity"] == "INFO"
    assert refusal["attributes"]["sluice.status"] == 403 and refusal["severity"] == "WARN"
    assert refusal["attributes"]["sluice.host"] == "169.254.169.254"
    assert allowed["time_unix_nano"] > 0
    metrics = httpx.get(proxy.admin_url + "/metrics", trust_env=False, timeout=10).text
    assert "sluice_otlp_dropped_total 0.0" in metrics


@pytest.mark.parametrize("variable, suffix, path", [
    ("OTEL_EXPORTER_OTLP_ENDPOINT", "", "/v1/logs"),  # the base address: /v1/logs appended
    ("OTEL_EXPORTER_OTLP_LOGS_ENDPOINT", "/custom/logs", "/custom/logs"),  # the logs URL, as it is
])
def test_the_standard_variables_turn_export_on(sluice_factory, collector, monkeypatch, variable, suffix, path):
    monkeypatch.setenv(variable, collector.url + suffix)
    proxy = sluice_factory(default_policy(), name="otlp-env")
    assert get(proxy, "http://public.example/").status_code == 200
    record = collector.wait(lambda r: r["attributes"].get("sluice.host") == "public.example")[0]
    assert record["resource"]["service.name"] == "sluice"
    assert collector.paths[0] == path


def dropped(proxy) -> float:
    for line in httpx.get(proxy.admin_url + "/metrics", trust_env=False, timeout=10).text.splitlines():
        if line.startswith("sluice_otlp_dropped_total "):
            return float(line.split()[1])
    raise AssertionError("no sluice_otlp_dropped_total in /metrics")


@pytest.mark.parametrize("collector_kind", ["nobody listening", "accepts and never answers"])
def test_a_dead_collector_costs_only_the_dropped_counter(sluice_factory, monkeypatch, collector_kind):
    silent = None
    if collector_kind == "nobody listening":
        port = free_port()
    else:
        silent = socket.socket()
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)  # the kernel completes the handshakes; nobody ever reads or answers
        port = silent.getsockname()[1]
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "3")  # the exporter's own bound per batch
    try:
        proxy = sluice_factory(default_policy(), name="otlp-dead", extra_args=("--otlp-endpoint", f"http://127.0.0.1:{port}"))
        for _ in range(20):
            started = time.monotonic()
            assert get(proxy, "http://public.example/").status_code == 200
            # Generous for a loaded machine, far below a stuck export (3 s and its retries).
            assert time.monotonic() - started < 2.5
            time.sleep(0.1)
        refused = get(proxy, "http://169.254.169.254/")
        assert refused.headers["sluice-reason"] == "address_not_public"
        deadline = time.monotonic() + 30
        while dropped(proxy) == 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert dropped(proxy) > 0
        assert len([line for line in proxy.audit() if line["event"] == "request"]) == 21  # the JSON log has them all
        stderr = proxy.stderr_text()
        assert "Traceback" not in stderr
        assert stderr.count("OTLP export to") == 1 and "sluice_otlp_dropped_total" in stderr
    finally:
        if silent is not None:
            silent.close()


def test_every_worker_exports(sluice_factory, collector):
    proxy = sluice_factory(default_policy(), name="otlp-workers",
                           extra_args=("--workers", "2", "--otlp-endpoint", collector.url))
    pids: set = set()
    for _ in range(40):  # a new connection each time: the kernel spreads them over the workers
        assert get(proxy, "http://public.example/").status_code == 200
    deadline = time.monotonic() + 20
    while len(pids) < 2 and time.monotonic() < deadline:
        pids = {r["resource"]["process.pid"] for r in list(collector.records)
                if r["attributes"].get("sluice.host") == "public.example"}
        time.sleep(0.2)
    assert len(pids) == 2, f"records came from the workers {pids}"
    assert all(r["resource"]["service.name"] == "sluice" for r in collector.records)


def test_the_collector_is_dialled_directly_whatever_http_proxy_says(sluice_factory, collector, monkeypatch):
    """HTTP(S)_PROXY in the proxy's environment (say, pointing at Sluice
    itself, or at nothing) is not the exporter's way to its collector."""
    import harness.sluice

    nowhere = f"http://127.0.0.1:{free_port()}"
    plain = harness.sluice.clean_env
    monkeypatch.setattr(harness.sluice, "clean_env",
                        lambda: {**plain(), "HTTP_PROXY": nowhere, "HTTPS_PROXY": nowhere, "http_proxy": nowhere})
    proxy = sluice_factory(default_policy(), name="otlp-direct", extra_args=("--otlp-endpoint", collector.url))
    assert get(proxy, "http://public.example/").status_code == 200
    collector.wait(lambda r: r["attributes"].get("sluice.host") == "public.example")
    assert dropped(proxy) == 0
