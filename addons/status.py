"""The process's readiness and policy facts, which the admin endpoints
(sluice/admin.py) serve: ready (every listener up, a policy loaded),
draining, and the loaded policy's facts. In a worker of `--workers N` it is
also published as a JSON file for the supervisor.
"""

from __future__ import annotations

import json
import logging
import os
import time

from sluice.addons.audit import rfc3339
from sluice.admin import WORKER_DIR_ENV

logger = logging.getLogger("sluice.admin")


class Status:
    """The mitmproxy addon holding what /readyz and /policy say: ready (every
    listener up, a policy loaded), draining, and the loaded policy's facts,
    kept from PolicySource and the audit log's reload records."""

    def __init__(self, audit, source) -> None:
        self.source = source
        self.listening = False
        self.draining = False
        self.generation: int | None = None
        self.loaded_at: str | None = None
        self.last_reload: dict | None = None  # {"result": "ok"|"failed", "time": ...}
        self.publish_dir = os.environ.get(WORKER_DIR_ENV) or None
        audit.listeners.append(self.observe)

    @property
    def ready(self) -> bool:
        return self.listening and not self.draining and self.source.current is not None

    def observe(self, record: dict) -> None:
        if record["event"] == "reload":
            self.last_reload = {"result": record["decision"], "time": record["time"]}
            self._policy_seen()

    def _policy_seen(self) -> None:
        live = self.source.current
        if live is not None and live.generation != self.generation:
            self.generation = live.generation
            self.loaded_at = rfc3339(time.time())
        self.publish()

    # ---- mitmproxy hooks ---------------------------------------------------

    def configure(self, updated) -> None:
        if "sluice_policy" in updated:
            self._policy_seen()

    def running(self) -> None:
        self.listening = True
        self._policy_seen()

    def drain(self) -> None:
        self.draining = True
        self.publish()

    # ---- what the endpoints say ----------------------------------------------

    def policy(self) -> dict:
        from mitmproxy import ctx

        live = self.source.current
        try:
            path = ctx.options.sluice_policy or None
        except (AttributeError, KeyError):
            path = None
        return {
            "path": path,
            "sha256": live.digest if live is not None else None,
            "generation": live.generation if live is not None else None,
            "loaded_at": self.loaded_at,
            "last_reload": self.last_reload,
        }

    def snapshot(self) -> dict:
        return {"pid": os.getpid(), "ready": self.ready, "draining": self.draining, "policy": self.policy()}

    def publish(self) -> None:
        """In a worker: write the snapshot for the supervisor (atomically)."""
        if self.publish_dir is None:
            return
        path = os.path.join(self.publish_dir, f"status-{os.getpid()}.json")
        try:
            with open(path + ".tmp", "w", encoding="utf-8") as f:
                json.dump(self.snapshot(), f)
            os.replace(path + ".tmp", path)
        except OSError as e:
            logger.warning(f"cannot publish the worker status to {path}: {e.strerror or e}")
