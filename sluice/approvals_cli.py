"""`sluice approvals list | approve ID | deny ID | revoke ID`: the operator's
side of approvals (issue 22), against a running proxy's admin listener.

`list` is read-only; approve, deny and revoke send the bearer token from
`--token-file` (or $SLUICE_ADMIN_TOKEN), which the proxy checks against its
`--admin-token-file`. The admin listener is dialled directly (never through
HTTP_PROXY: it is the proxy's own endpoint).
"""

from __future__ import annotations

import http.client
import json
import os
import sys
import time
from typing import Any

from sluice.policy.loader import parse_duration

DEFAULT_ADMIN = "127.0.0.1:9090"
TOKEN_ENV = "SLUICE_ADMIN_TOKEN"
EXIT_FAILED = 1
EXIT_USAGE = 2


def add_parser(sub: Any) -> None:
    p = sub.add_parser("approvals", help="list and answer approval requests on a running proxy",
                       description="Exit codes: 0 done, 1 the proxy refused or failed (no such id, bad token), "
                                   "2 usage error or the admin endpoint is unreachable.")
    p.add_argument("--admin", default=os.environ.get("SLUICE_ADMIN", DEFAULT_ADMIN), metavar="HOST:PORT",
                   help="the proxy's admin listener (default: $SLUICE_ADMIN or %(default)s)")
    p.add_argument("--token-file", default=None, metavar="FILE",
                   help=f"a file holding the admin bearer token (default: ${TOKEN_ENV})")
    verbs = p.add_subparsers(dest="approvals_command", required=True, metavar="VERB")
    listing = verbs.add_parser("list", help="pending requests, grants and denials in force")
    listing.add_argument("--json", action="store_true", help="the admin endpoint's JSON as is")
    approve = verbs.add_parser("approve", help="grant a pending request")
    approve.add_argument("id")
    approve.add_argument("--for", dest="duration", default=None, metavar="DURATION",
                         help="how long (e.g. 30m, 2h; default: the policy's approvals.grant_for)")
    approve.add_argument("--scope", choices=("host", "path"), default=None,
                         help="the whole host, or the request's method and path (default: the request's level)")
    deny = verbs.add_parser("deny", help="refuse a pending request, remembered for a while")
    deny.add_argument("id")
    deny.add_argument("--for", dest="duration", default=None, metavar="DURATION",
                      help="how long the denial is remembered (default: 1d)")
    deny.add_argument("--scope", choices=("host", "path"), default=None)
    revoke = verbs.add_parser("revoke", help="end a grant or denial now")
    revoke.add_argument("id")


def dispatch(args: Any) -> int:
    from sluice.listen import parse_listen

    try:
        host, port = parse_listen(args.admin)
    except ValueError:
        return _fail(EXIT_USAGE, f"--admin {args.admin!r}: expected HOST:PORT (the proxy's admin listener)")
    verb = args.approvals_command
    if verb == "list":
        status, body = _call(host, port, "GET", "/approvals", None, None)
        if status is None:
            return _fail(EXIT_USAGE, body)
        if status != 200:
            return _fail(EXIT_FAILED, _answer_text(status, body))
        data = json.loads(body)
        if args.json:
            print(json.dumps(data, indent=2))
        else:
            print(listing_text(data, time.time()))
        return 0
    token = _token(args.token_file)
    if isinstance(token, int):
        return token
    payload: dict[str, Any] = {}
    if getattr(args, "duration", None) is not None:
        try:
            payload["for"] = parse_duration(args.duration)
        except ValueError as e:
            return _fail(EXIT_USAGE, f"--for {args.duration!r}: {e}")
    if getattr(args, "scope", None) is not None:
        payload["scope"] = args.scope
    status, body = _call(host, port, "POST", f"/approvals/{args.id}/{verb}", token, json.dumps(payload).encode())
    if status is None:
        return _fail(EXIT_USAGE, body)
    if status != 200:
        return _fail(EXIT_FAILED, _answer_text(status, body))
    grant = json.loads(body)
    print(_done_text(verb, grant))
    return 0


def _token(path: str | None) -> str | int:
    if path is not None:
        try:
            with open(path, encoding="utf-8") as f:
                words = f.read(65536).split()
        except OSError as e:
            return _fail(EXIT_USAGE, f"--token-file {path}: cannot read it ({e.strerror or e})")
        except UnicodeDecodeError:
            return _fail(EXIT_USAGE, f"--token-file {path}: not UTF-8 text")
        if not words:
            return _fail(EXIT_USAGE, f"--token-file {path}: holds no token")
        return words[-1]  # a line of the proxy's token file (NAME TOKEN) works as is
    token = os.environ.get(TOKEN_ENV, "").strip()
    if not token:
        return _fail(EXIT_USAGE, f"approve, deny and revoke need the admin token: --token-file FILE or ${TOKEN_ENV}")
    return token


def _call(host: str, port: int, method: str, path: str, token: str | None,
          body: bytes | None) -> tuple[int | None, str]:
    headers = {"Content-Type": "application/json"} if body is not None else {}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    shown = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    connection = http.client.HTTPConnection(host, port, timeout=10)
    try:
        connection.request(method, path, body=body, headers=headers)
        response = connection.getresponse()
        return response.status, response.read(1 << 20).decode("utf-8", "replace")
    except OSError as e:
        return None, f"cannot reach the admin endpoint at {shown} ({e.strerror or e}); is the proxy running with " \
                     "--admin there? (--admin HOST:PORT or $SLUICE_ADMIN)"
    finally:
        connection.close()


def _answer_text(status: int, body: str) -> str:
    text = body.strip() or f"HTTP {status}"
    if status == 401:
        return f"the admin endpoint wants a token: {text}"
    if status == 403:
        return f"the admin endpoint refused the token: {text}"
    return text


def _fail(code: int, message: str) -> int:
    print(f"sluice: {message}", file=sys.stderr)
    return code


def _until(expires: float, now: float) -> str:
    left = max(0, int(expires - now))
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(expires))
    return f"until {when} ({left // 3600}h{left % 3600 // 60:02d}m{left % 60:02d}s left)"


def _client(entry: dict[str, Any]) -> str:
    profile = entry.get("profile") or "(top level)"
    return f"{profile}/{entry['user']}" if entry.get("user") else profile


def _what(entry: dict[str, Any]) -> str:
    if entry.get("path"):
        return f"{entry.get('method') or '*'} {entry['host']}{entry['path']}"
    return entry["host"]


def listing_text(data: dict[str, list[dict[str, Any]]], now: float) -> str:
    lines = []
    pending = data.get("pending", [])
    lines.append(f"pending: {len(pending)}")
    for ask in pending:
        request = f"{ask.get('method') or '-'} {ask['host']}{ask.get('path') or ''}"
        lines.append(f"  {ask['id']}  {_client(ask)}  {request}  ({ask['reason']}, {ask['level']} level, asked "
                     f"{int(now - ask['time'])}s ago)")
    for kind in ("grants", "denials"):
        entries = data.get(kind, [])
        lines.append(f"{kind}: {len(entries)}")
        for g in entries:
            lines.append(f"  {g['id']}  {_client(g)}  {_what(g)}  ({g['scope']} scope, by {g['who']}, "
                         f"{_until(g['expires'], now)})")
    return "\n".join(lines)


def _done_text(verb: str, grant: dict[str, Any]) -> str:
    if verb == "revoke":
        return f"revoked {grant['id']}: {_client(grant)} {_what(grant)}"
    done = "approved" if verb == "approve" else "denied"
    return f"{done} {grant['id']}: {_client(grant)} {_what(grant)} ({grant['scope']} scope, " \
           f"{_until(grant['expires'], time.time())})"
