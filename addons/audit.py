"""The audit log: one JSON line per decision, to stdout or a file.

Every decision the proxy makes is recorded here and only here, with its reason
code, so operators have one canonical place to look (like Smokescreen's
decision line). Allowed exchanges are logged when they end, with bytes and
duration; refusals are logged at once. Policy reloads are logged too.
"""

from __future__ import annotations

import json
import sys
import time
from typing import IO, Any

from mitmproxy import ctx

# The one list of audit fields, in output order. Absent values are null.
FIELDS = (
    "time", "event", "id", "client", "profile", "method", "scheme", "host", "port",
    "address", "decision", "reason", "would_refuse", "rule", "status",
    "bytes_in", "bytes_out", "duration", "detail",
)


class AuditLog:
    def __init__(self) -> None:
        self._out: IO[str] | None = None
        self._path: str | None = None

    def load(self, loader) -> None:
        loader.add_option(
            "sluice_audit_log", str, "-",
            "Where Sluice writes its JSON audit lines: '-' for stdout, or a file path (appended).",
        )

    def configure(self, updated) -> None:
        if "sluice_audit_log" in updated:
            self._open(ctx.options.sluice_audit_log)

    def _open(self, path: str) -> None:
        if self._out is not None and self._out is not sys.stdout:
            self._out.close()
        self._path = path
        self._out = sys.stdout if path in ("", "-") else open(path, "a", encoding="utf-8", buffering=1)

    def done(self) -> None:
        if self._out is not None and self._out is not sys.stdout:
            self._out.close()
        self._out = None

    def write(self, **record: Any) -> None:
        record.setdefault("time", round(time.time(), 3))
        line = {k: record.get(k) for k in FIELDS}
        out = self._out or sys.stdout
        out.write(json.dumps(line, separators=(",", ":"), ensure_ascii=False) + "\n")
        out.flush()
