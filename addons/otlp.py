"""The audit records as OpenTelemetry logs (OTLP over HTTP/protobuf).

`sluice proxy --otlp-endpoint URL` (the option `sluice_otlp_endpoint`), or
the standard OTEL_EXPORTER_OTLP_LOGS_ENDPOINT / OTEL_EXPORTER_OTLP_ENDPOINT
variables, sends every audit record (addons/audit.py, through its
`listeners`) to a collector as one log record: the body is the record as
JSON, each field `F` that is not null is the attribute `sluice.F`, the time
is the record's, severity INFO for allow and ok, WARN for refuse and failed.
The resource says `service.name=sluice`, the version, and which instance
(`service.instance.id` = host name and pid, so each worker of `--workers N`
is its own), plus whatever OTEL_RESOURCE_ATTRIBUTES adds. The JSON audit
log is unchanged.

Never blocking the proxy: the event loop only appends the record's dict to
a bounded queue (QUEUE_LIMIT); one daemon thread encodes and exports batches
(up to BATCH_SIZE, at least every FLUSH_SECONDS) with the SDK's exporter,
whose own timeout and retries bound each export. A record that finds the
queue full, or whose batch the collector did not take, is dropped and
counted (`sluice_otlp_dropped_total`, and `dropped` here); stderr gets one
line when exporting starts failing and one when it works again.

The collector is infrastructure, like the DNS server: dialled directly with
the exporter's own HTTP session, which ignores HTTP(S)_PROXY (they may point
at Sluice itself) and .netrc. The SDK's logs API lives in private `_logs`
modules: the SDK is pinned exactly (pyproject.toml) and imported here only,
and only when exporting is on.
"""

from __future__ import annotations

import calendar
import collections
import json
import logging
import os
import socket
import sys
import threading
import time
from urllib.parse import urlsplit

from mitmproxy import exceptions

QUEUE_LIMIT = 10_000  # records waiting for the exporter; more are dropped
BATCH_SIZE = 512
FLUSH_SECONDS = 1.0
SHUTDOWN_SECONDS = 2.0  # at exit, time given to what is queued
LOGS_PATH = "/v1/logs"

logger = logging.getLogger("sluice.otlp")


def resolve_endpoint(option: str, environ=os.environ) -> tuple[str | None, str]:
    """(the logs URL or None for off, where it came from); ValueError for a bad URL.

    The option is the collector's OTLP/HTTP address like
    OTEL_EXPORTER_OTLP_ENDPOINT: `/v1/logs` is appended unless the path
    already ends with it. 'off' turns exporting off whatever the environment
    says; OTEL_LOGS_EXPORTER=none turns off the variables."""
    option = option.strip()
    if option == "off":
        return None, "--otlp-endpoint"
    if option:
        url, source = option, "--otlp-endpoint"
    elif environ.get("OTEL_LOGS_EXPORTER", "").strip().lower() == "none":
        return None, "OTEL_LOGS_EXPORTER"
    elif environ.get("OTEL_EXPORTER_OTLP_LOGS_ENDPOINT", "").strip():
        return _checked(environ["OTEL_EXPORTER_OTLP_LOGS_ENDPOINT"].strip(), "OTEL_EXPORTER_OTLP_LOGS_ENDPOINT"), \
            "OTEL_EXPORTER_OTLP_LOGS_ENDPOINT"
    elif environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip():
        url, source = environ["OTEL_EXPORTER_OTLP_ENDPOINT"].strip(), "OTEL_EXPORTER_OTLP_ENDPOINT"
    else:
        return None, ""
    _checked(url, source)
    if not url.rstrip("/").endswith(LOGS_PATH):
        url = url.rstrip("/") + LOGS_PATH
    return url, source


def _checked(url: str, source: str) -> str:
    try:
        parts = urlsplit(url)
        ok = parts.scheme in ("http", "https") and bool(parts.hostname)
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"{source} {url!r} is not an http:// or https:// URL; give the collector's OTLP/HTTP "
                         "address, e.g. http://otel-collector:4318")
    return url


def attributes(record: dict) -> dict:
    """The record's fields that are not null, as `sluice.FIELD` attributes."""
    return {f"sluice.{k}": v for k, v in record.items() if v is not None}


class Exporter:
    """The bounded queue and the one thread that exports it."""

    def __init__(self, endpoint: str, on_drop=None) -> None:
        # The only import of the SDK's private logs API (pinned exactly).
        import requests
        from opentelemetry._logs import LogRecord, SeverityNumber
        from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter
        from opentelemetry.sdk._logs import ReadableLogRecord
        from opentelemetry.sdk._logs.export import LogRecordExportResult
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope

        from sluice.cli import version_text

        self._LogRecord, self._Readable, self._Severity = LogRecord, ReadableLogRecord, SeverityNumber
        self._success = LogRecordExportResult.SUCCESS
        session = requests.Session()
        session.trust_env = False  # never HTTP(S)_PROXY (perhaps Sluice itself) nor .netrc: dialled directly
        self.endpoint = endpoint
        self._exporter = OTLPLogExporter(endpoint=endpoint, session=session)
        version = version_text().split()[1]
        self._resource = Resource.create({
            "service.name": "sluice", "service.version": version,
            "service.instance.id": f"{socket.gethostname()}:{os.getpid()}",
            "host.name": socket.gethostname(), "process.pid": os.getpid(),
        })
        self._scope = InstrumentationScope("sluice.audit", version)
        # The exporter's own warnings (a retry, a failed batch) would be one
        # stderr line per batch: this class reports failures once instead.
        logging.getLogger("opentelemetry").setLevel(logging.CRITICAL)
        self._queue: collections.deque = collections.deque()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._on_drop = on_drop
        self.dropped = 0
        self.exported = 0
        self._failing = False
        self._deadline = float("inf")  # set by shutdown: when what is left is dropped
        self._thread = threading.Thread(target=self._run, name="sluice-otlp", daemon=True)
        self._thread.start()

    # ---- the event loop's side: never waits -----------------------------

    def submit(self, record: dict) -> None:
        if len(self._queue) >= QUEUE_LIMIT or self._stop.is_set():
            self._drop(1)
            return
        self._queue.append(record)
        if len(self._queue) >= BATCH_SIZE:
            self._wake.set()

    def _drop(self, count: int) -> None:
        self.dropped += count
        if self._on_drop is not None:
            try:
                self._on_drop(count)
            except Exception:  # a metrics problem must not cost the proxy anything
                pass

    # ---- the exporting thread -----------------------------------------------

    def _run(self) -> None:
        while True:
            stopping = self._stop.is_set()
            if not stopping:
                self._wake.wait(FLUSH_SECONDS)
                self._wake.clear()
            while self._queue:
                batch = []
                while self._queue and len(batch) < BATCH_SIZE:
                    batch.append(self._queue.popleft())
                self._export(batch)
                if self._stop.is_set() and time.monotonic() > self._deadline:
                    self._drop(len(self._queue))
                    self._queue.clear()
            if stopping:
                return

    def _export(self, batch: list[dict]) -> None:
        try:
            result = self._exporter.export([self._log(record) for record in batch])
            ok, why = result == self._success, "the collector did not accept the batch"
        except Exception as e:  # never a traceback: the proxy goes on without its collector
            ok, why = False, f"{type(e).__name__}: {e}"
        if ok:
            self.exported += len(batch)
            if self._failing:
                self._failing = False
                print(f"sluice: OTLP export to {self.endpoint} works again ({self.dropped} audit records dropped "
                      "so far)", file=sys.stderr, flush=True)
            return
        self._drop(len(batch))
        if not self._failing:
            self._failing = True
            print(f"sluice: OTLP export to {self.endpoint} failed ({why}); audit records are dropped and "
                  "counted (sluice_otlp_dropped_total) until it works again", file=sys.stderr, flush=True)

    def _log(self, record: dict):
        refused = record.get("decision") in ("refuse", "failed")
        severity = self._Severity.WARN if refused else self._Severity.INFO
        try:  # the record's own time (RFC 3339 UTC with milliseconds)
            when = calendar.timegm(time.strptime(record["time"][:19], "%Y-%m-%dT%H:%M:%S"))
            timestamp = (when * 1000 + int(record["time"][20:23])) * 1_000_000
        except (TypeError, ValueError, KeyError):
            timestamp = time.time_ns()
        log = self._LogRecord(
            timestamp=timestamp, observed_timestamp=time.time_ns(), severity_number=severity,
            severity_text="WARN" if refused else "INFO", body=json.dumps(record, separators=(",", ":")),
            attributes=attributes(record), event_name="sluice.audit",
        )
        return self._Readable(log_record=log, resource=self._resource, instrumentation_scope=self._scope)

    def shutdown(self, timeout: float = SHUTDOWN_SECONDS) -> None:
        """Export what is queued for up to `timeout` seconds, then stop."""
        self._deadline = time.monotonic() + timeout
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)
        self._exporter.shutdown()  # aborts a retry still waiting (the thread is a daemon)


class OtlpExport:
    """The addon: watches the audit log's records and feeds the exporter."""

    def __init__(self, audit, on_drop=None) -> None:
        self.on_drop = on_drop
        self.endpoint: str | None = None
        self.exporter: Exporter | None = None
        self._resolved = False
        audit.listeners.append(self.observe)

    def load(self, loader) -> None:
        loader.add_option(
            "sluice_otlp_endpoint", str, "",
            "Export the audit records as OTLP logs (HTTP/protobuf) to this collector address, e.g. "
            "http://otel-collector:4318 (/v1/logs is appended); empty: OTEL_EXPORTER_OTLP_LOGS_ENDPOINT or "
            "OTEL_EXPORTER_OTLP_ENDPOINT if set; 'off': never.",
        )

    def configure(self, updated) -> None:
        if "sluice_otlp_endpoint" in updated:
            from mitmproxy import ctx

            try:
                self.endpoint, _ = resolve_endpoint(ctx.options.sluice_otlp_endpoint)
            except ValueError as e:
                raise exceptions.OptionsError(str(e)) from None
            self._resolved = True

    def running(self) -> None:
        if not self._resolved:  # mitmdump -s without the option: the variables alone
            try:
                self.endpoint, _ = resolve_endpoint("")
            except ValueError as e:
                logger.error(f"{e}; not exporting audit records over OTLP")
                self.endpoint = None
            self._resolved = True
        if self.endpoint and self.exporter is None:
            self.exporter = Exporter(self.endpoint, self.on_drop)

    def observe(self, record: dict) -> None:
        if self.exporter is not None:
            self.exporter.submit(record)

    def done(self) -> None:
        if self.exporter is not None:
            self.exporter.shutdown()
