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
sluice/workers.py). The endpoints read the process's state from the `Status`
addon (addons/status.py).
"""

from __future__ import annotations

import errno
import json
import logging
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sluice.addons.status import Status


logger = logging.getLogger("sluice.admin")

# A worker of `sluice proxy --workers N` publishes its status (and its
# metrics, as PROMETHEUS_MULTIPROC_DIR) in this directory for the supervisor.
WORKER_DIR_ENV = "SLUICE_WORKER_DIR"

Response = tuple[int, str, bytes]  # status, content type, body
TEXT = "text/plain; charset=utf-8"
JSON = "application/json"


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
