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
import hmac
import json
import logging
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sluice.addons.status import Status


logger = logging.getLogger("sluice.admin")

# A worker of `sluice proxy --workers N` publishes its status (and its
# metrics, as PROMETHEUS_MULTIPROC_DIR) in this directory for the supervisor.
WORKER_DIR_ENV = "SLUICE_WORKER_DIR"

Response = tuple[int, str, bytes]  # status, content type, body
TEXT = "text/plain; charset=utf-8"
JSON = "application/json"


# ---- approvals (issue 22): list, and the verbs that need a token ---------------


class AdminTokens:
    """`--admin-token-file`: one token a line, `TOKEN` (it acts as "admin")
    or `NAME TOKEN` (audited as NAME); blank lines and `#` comments ignored."""

    def __init__(self, tokens: dict[str, str]) -> None:
        self._tokens = tokens  # token -> name

    @classmethod
    def load(cls, path: str | None) -> AdminTokens:
        """ValueError with a sentence for a file that cannot be used."""
        if path is None:
            return cls({})
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read(65536)
        except OSError as e:
            raise ValueError(f"--admin-token-file {path}: cannot read it ({e.strerror or e})") from None
        except UnicodeDecodeError:
            raise ValueError(f"--admin-token-file {path}: not UTF-8 text") from None
        tokens: dict[str, str] = {}
        for number, line in enumerate(text.splitlines(), 1):
            words = line.split()
            if not words or words[0].startswith("#"):
                continue
            if len(words) > 2:
                raise ValueError(f"--admin-token-file {path}:{number}: expected TOKEN or NAME TOKEN")
            name, token = (words[0], words[1]) if len(words) == 2 else ("admin", words[0])
            if len(token) < 16:
                raise ValueError(f"--admin-token-file {path}:{number}: a token needs at least 16 characters "
                                 "(e.g. from `openssl rand -hex 32`)")
            tokens[token] = name
        if not tokens:
            raise ValueError(f"--admin-token-file {path}: holds no token")
        return cls(tokens)

    def who(self, authorization: str | None) -> tuple[int, str]:
        """(200, the token's name), or the status and sentence that refuse."""
        if not self._tokens:
            return 403, ("this proxy accepts no admin token; start it with --admin-token-file FILE to answer "
                         "approvals")
        scheme, _, given = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            return 401, "this admin request needs a bearer token (Authorization: Bearer TOKEN; `sluice approvals " \
                        "--token-file FILE`)"
        given = given.strip()
        for token, name in self._tokens.items():
            if hmac.compare_digest(token.encode(), given.encode()):
                return 200, name
        return 403, "the admin token is wrong (not one in the proxy's --admin-token-file)"


class ApprovalDesk:
    """The /approvals endpoints over the store where approvals live now
    (`current_store()`: a reload may move them; their threads do its I/O).
    `changed` tells this process's proxy to refresh its snapshot at once.
    A store that does not answer is a 503 with its sentence."""

    def __init__(self, current_store: Callable[[], Any], tokens: AdminTokens,
                 changed: Callable[[], None] | None = None) -> None:
        self.current_store = current_store
        self.tokens = tokens
        self.changed = changed

    def listing(self) -> Response:
        from sluice.approvals_store import ApprovalsUnavailable

        try:
            return json_response(self.current_store().listing(time.time()))
        except ApprovalsUnavailable as e:
            return unavailable(e)

    def act(self, path: str, authorization: str | None, body: bytes) -> Response:
        from sluice.approvals_store import ApprovalError, ApprovalsUnavailable, grant_json

        parts = path.strip("/").split("/")
        if len(parts) != 3 or parts[0] != "approvals" or parts[2] not in ("approve", "deny", "revoke"):
            return 404, TEXT, b"not found: POST /approvals/ID/approve, /approvals/ID/deny, /approvals/ID/revoke\n"
        status, who = self.tokens.who(authorization)
        if status != 200:
            return status, TEXT, (who + "\n").encode()
        try:
            args = json.loads(body or b"{}")
            if not isinstance(args, dict):
                raise ValueError
            seconds = args.get("for")
            scope = args.get("scope")
            if seconds is not None and (isinstance(seconds, bool) or not isinstance(seconds, (int, float))
                                        or not 0 < seconds <= 366 * 86400):
                return 400, TEXT, b"`for` must be a number of seconds from 1 to a year\n"
            if scope not in (None, "host", "path"):
                return 400, TEXT, b"`scope` must be host or path\n"
        except ValueError:
            return 400, TEXT, b"the body must be a JSON object: {\"for\": SECONDS, \"scope\": \"host\"|\"path\"}\n"
        ident, verb = parts[1], parts[2]
        store = self.current_store()
        try:
            if verb == "revoke":
                grant = store.revoke(ident, who, time.time())
            else:
                grant = store.answer(ident, denied=verb == "deny", seconds=seconds, scope=scope, who=who,
                                     now=time.time())
        except ApprovalError as e:
            return 404, TEXT, (str(e) + "\n").encode()
        except ApprovalsUnavailable as e:
            return unavailable(e)
        if self.changed is not None:
            self.changed()
        return json_response(grant_json(grant))


class Endpoints:
    """What one process serves: its own Status and the default registry."""

    def __init__(self, status: Status, approvals: ApprovalDesk | None = None) -> None:
        self.status = status
        self.approvals = approvals

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


def unavailable(error: Exception) -> Response:
    """503: where approvals live did not answer; nothing was changed."""
    return 503, TEXT, (f"{error}; try again once it is back (nothing was changed; the proxies keep the grants as "
                       "last read meanwhile)\n").encode()


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
        desk: ApprovalDesk | None = getattr(endpoints, "approvals", None)
        if desk is not None:
            routes["/approvals"] = desk.listing

        class Handler(BaseHTTPRequestHandler):
            server_version = "sluice-admin"
            sys_version = ""

            def do_GET(self) -> None:
                self._answer(head=False)

            def do_HEAD(self) -> None:
                self._answer(head=True)

            def do_POST(self) -> None:
                try:
                    length = int(self.headers.get("Content-Length") or 0)
                except ValueError:
                    length = -1
                if desk is None or not 0 <= length <= 4096:
                    status, kind, body = (404, TEXT, b"not found\n") if desk is None else \
                        (400, TEXT, b"a body of at most 4096 bytes, with Content-Length\n")
                else:
                    try:
                        status, kind, body = desk.act(self.path.split("?", 1)[0], self.headers.get("Authorization"),
                                                      self.rfile.read(length))
                    except Exception:
                        logger.exception(f"admin endpoint POST {self.path} failed")
                        status, kind, body = 500, TEXT, b"internal error\n"
                self._send(status, kind, body, head=False)

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
                self._send(status, kind, body, head)

            def _send(self, status: int, kind: str, body: bytes, head: bool) -> None:
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Cache-Control", "no-store")
                if status == 401:
                    self.send_header("WWW-Authenticate", 'Bearer realm="sluice-admin"')
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
