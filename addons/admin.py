"""The admin listener: /healthz, /readyz, /metrics and /policy.

`sluice proxy --admin HOST:PORT` (default 127.0.0.1:9090, `off` disables it)
serves, on its own port, never a proxy port:

- `/healthz`: 200 `ok` while the process runs;
- `/readyz`: 200 `ready` once every listener is up and a policy is loaded,
  503 before that and while draining (after SIGTERM);
- `/metrics`: Prometheus text (addons/metrics.py);
- `/policy`: JSON about the loaded policy: its file's path and sha256, when
  it was loaded, its generation and the last reload's result. Never its
  content, and never a reload's problem text (which may quote the file):
  that goes to stderr and the audit log.

The server is a small threaded HTTP server on a daemon thread, so a scrape
never waits for the proxy's event loop (and the supervisor of `--workers N`,
which has no event loop, serves the same endpoints for all its workers:
sluice/workers.py). `Status` is the process's state the endpoints read; in a
worker it is also published as a JSON file for the supervisor.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from collections.abc import Callable

from sluice.addons.audit import rfc3339

logger = logging.getLogger("sluice.admin")

# A worker of `sluice proxy --workers N` publishes its status (and its
# metrics, as PROMETHEUS_MULTIPROC_DIR) in this directory for the supervisor.
WORKER_DIR_ENV = "SLUICE_WORKER_DIR"

Response = tuple[int, str, bytes]  # status, content type, body
TEXT = "text/plain; charset=utf-8"
JSON = "application/json"


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


class Endpoints:
    """What one process serves: its own Status and the default registry."""

    def __init__(self, status: Status) -> None:
        self.status = status

    def readyz(self) -> Response:
        return readyz(self.status.ready, self.status.draining)

    def metrics(self) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

        return 200, CONTENT_TYPE_LATEST, generate_latest(REGISTRY)

    def policy(self) -> Response:
        return json_response(self.status.policy())


def readyz(ready: bool, draining: bool) -> Response:
    if draining:
        return 503, TEXT, b"draining\n"
    return (200, TEXT, b"ready\n") if ready else (503, TEXT, b"not ready\n")


def json_response(value: dict) -> Response:
    return 200, JSON, (json.dumps(value, indent=2) + "\n").encode()


class AdminServer:
    """Serves `endpoints` (readyz, metrics, policy: each returning a Response)
    and /healthz on host:port from a daemon thread. Binding happens in the
    constructor: an OSError there is the caller's start-up error."""

    def __init__(self, host: str, port: int, endpoints) -> None:
        routes: dict[str, Callable[[], Response]] = {
            "/healthz": lambda: (200, TEXT, b"ok\n"),
            "/readyz": endpoints.readyz,
            "/metrics": endpoints.metrics,
            "/policy": endpoints.policy,
        }

        class Handler(BaseHTTPRequestHandler):
            server_version = "sluice-admin"
            sys_version = ""

            def do_GET(self) -> None:
                self._answer(head=False)

            def do_HEAD(self) -> None:
                self._answer(head=True)

            def _answer(self, head: bool) -> None:
                route = routes.get(self.path.split("?", 1)[0])
                if route is None:
                    status, kind, body = 404, TEXT, b"not found: /healthz /readyz /metrics /policy\n"
                else:
                    try:
                        status, kind, body = route()
                    except Exception:
                        logger.exception(f"admin endpoint {self.path} failed")
                        status, kind, body = 500, TEXT, b"internal error\n"
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", "no-store")
                self.end_headers()
                if not head:
                    self.wfile.write(body)

            def log_message(self, format, *args) -> None:  # no access log on stderr
                pass

        class Server(ThreadingHTTPServer):
            address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
            daemon_threads = True
            allow_reuse_address = True

        self.httpd = Server((host, port), Handler)
        self.address = self.httpd.server_address[:2]
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="sluice-admin", daemon=True)

    def start(self) -> AdminServer:
        self._thread.start()
        return self

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def parse_admin(text: str) -> tuple[str, int] | None:
    """`--admin HOST:PORT` or `off` (None); raises ValueError."""
    from sluice.listen import parse_listen

    if text.strip().lower() == "off":
        return None
    try:
        return parse_listen(text)
    except ValueError:
        raise ValueError(f"--admin {text!r}: expected HOST:PORT (e.g. 127.0.0.1:9090 or [::1]:9090) or off") from None


def same_listener(a: tuple[str, int], b: tuple[str, int]) -> bool:
    """Whether two TCP listen addresses would be the same port (a wildcard
    host overlaps every address)."""
    wildcard = ("", "0.0.0.0", "::", "*")
    return a[1] == b[1] and (a[0] == b[0] or a[0] in wildcard or b[0] in wildcard)


def admin_problem(host: str, port: int, error: OSError) -> str:
    """Why the admin listener could not bind host:port, as one sentence."""
    shown = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    hint = "choose another address with --admin HOST:PORT, or --admin off"
    if error.errno == errno.EADDRINUSE:
        return f"the admin address {shown} is already in use (another process is listening there); {hint}"
    return f"cannot serve the admin endpoint on {shown}: {error.strerror or error}; {hint}"
