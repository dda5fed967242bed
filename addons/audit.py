"""The audit log: one JSON line per decision, to stdout or a file.

Every decision the proxy makes is recorded here and only here, with its reason
code, so operators have one canonical place to look (like Smokescreen's
decision line). Allowed exchanges are logged when they end, with bytes and
duration; refusals are logged at once. Policy reloads are logged too.

Observers (addons/metrics.py, addons/status.py) see every record through
`listeners`: each is called with the line's dict after it is written, so
metrics count exactly the decisions the log records.

`time` is RFC 3339 in UTC with milliseconds (`2026-11-29T09:15:02.118Z`).

A file survives log rotation: it is reopened on SIGHUP (PolicySource's
handler calls `reopen`), and before each line if the path no longer leads to
the file being written (moved away, deleted, replaced), so a `mv` by
logrotate or by hand never leaves lines going to the old file. A file that
cannot be opened at start-up is an OptionsError (one line, exit 2).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import IO, Any

from mitmproxy import connection, ctx, exceptions, http, tcp

from sluice.outcome import Outcome, outcome_of
from sluice.policy.decide import Decision
from sluice.policy.request_rules import MAX_AUDIT_PATH, split_target

# The one list of audit fields, in output order. Absent values are null.
FIELDS = (
    "time", "event", "id", "connect_id", "client", "user", "profile", "method", "scheme", "host", "port", "path",
    "address", "decision", "reason", "would_refuse", "rule", "credential", "status",
    "bytes_in", "bytes_out", "duration", "detail",
)

# flow.metadata key: the `file:line` of the credentials entry whose headers
# the proxy set on this request (addons/credentials.py); never the value.
CREDENTIAL_META = "sluice_credential"

logger = logging.getLogger("sluice.audit")


# The date and time of the last whole second formatted: lines come in bursts
# within one second, and strftime is most of a line's formatting cost.
# (One tuple, replaced whole: a reader in another thread sees a matching pair.)
_last_second: tuple[int, str] = (-1, "")


def rfc3339(when: float) -> str:
    """`when` (seconds since the epoch) as RFC 3339 UTC with milliseconds."""
    global _last_second
    seconds, ms = divmod(round(when * 1000), 1000)
    last = _last_second
    if seconds != last[0]:
        last = _last_second = (seconds, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)))
    return f"{last[1]}.{ms:03d}Z"


# One encoder for every line (json.dumps with options builds one per call).
# ASCII JSON: hosts and details quoting client bytes (even lone surrogates)
# are escaped, so a line can always be written.
_encode_line = json.JSONEncoder(separators=(",", ":")).encode


class AuditLog:
    def __init__(self) -> None:
        self._out: IO[str] | None = None
        self._path: str | None = None
        self._identity: tuple[int, int] | None = None  # (st_dev, st_ino) of the open file
        self._reopen_failed = False  # reported once until a reopen works
        self.listeners: list = []  # called with each record (a dict of FIELDS) after it is written

    def load(self, loader) -> None:
        loader.add_option(
            "sluice_audit_log", str, "-",
            "Where Sluice writes its JSON audit lines: '-' for stdout, or a file path (appended).",
        )

    def configure(self, updated) -> None:
        if "sluice_audit_log" in updated:
            path = ctx.options.sluice_audit_log
            try:
                self._open(path)
            except OSError as e:
                hint = " (create the directory first)" if isinstance(e, FileNotFoundError) else ""
                raise exceptions.OptionsError(f"cannot open the audit log {path}: {e.strerror or e}{hint}") from None

    def _open(self, path: str) -> None:
        """Open `path` for appending (raises OSError); then close the old file."""
        if path in ("", "-"):
            out, identity = sys.stdout, None
        else:
            out = open(path, "a", encoding="utf-8", buffering=1)
            st = os.fstat(out.fileno())
            identity = (st.st_dev, st.st_ino)
        self._close()
        self._path, self._out, self._identity = path, out, identity

    def _close(self) -> None:
        if self._out is not None and self._out is not sys.stdout:
            self._out.close()
        self._out = None

    def reopen(self) -> None:
        """Open the file at the path again (SIGHUP after a rotation). On
        failure the old file is kept and the problem reported once."""
        if self._path in (None, "", "-"):
            return
        try:
            self._open(self._path)
            self._reopen_failed = False
        except OSError as e:
            if not self._reopen_failed:
                logger.error(f"cannot reopen the audit log {self._path}: {e.strerror or e}; still writing to the file "
                             "it was")
                self._reopen_failed = True

    def _rotated(self) -> bool:
        """Whether the path no longer leads to the open file."""
        try:
            st = os.stat(self._path)
        except OSError:
            return True
        return (st.st_dev, st.st_ino) != self._identity

    def done(self) -> None:
        self._close()

    def write(self, **record: Any) -> None:
        record.setdefault("time", rfc3339(time.time()))
        line = {k: record.get(k) for k in FIELDS}
        if self._identity is not None and self._rotated():
            self.reopen()
        out = self._out or sys.stdout
        out.write(_encode_line(line) + "\n")
        out.flush()
        for listener in self.listeners:
            try:
                listener(line)
            except Exception:  # an observer's bug must never cost an audit line or a decision
                logger.exception(f"audit listener {listener!r} failed")

    # ---- hooks: this addon runs last, after every cap and guard ---------

    def response(self, flow: http.HTTPFlow) -> None:
        self.http_flow(flow)

    def error(self, flow: http.HTTPFlow) -> None:
        self.http_flow(flow)

    def http_connect_error(self, flow: http.HTTPFlow) -> None:
        self.http_flow(flow)

    def tcp_end(self, flow: tcp.TCPFlow) -> None:
        self.tunnel(flow)

    def tcp_error(self, flow: tcp.TCPFlow) -> None:
        self.tunnel(flow)

    # ---- the three kinds of decision line --------------------------------

    def http_flow(self, flow: http.HTTPFlow) -> None:
        """One line when an HTTP exchange (or a refused CONNECT) ends."""
        outcome = outcome_of(flow)
        if outcome is None or outcome.logged:
            return
        outcome.logged = True
        d = outcome.decision
        refusal = outcome.refusal
        soft = d.would_refuse
        response = flow.response
        connect = flow.request.method == "CONNECT"
        self.write(
            event="connect" if connect else "request",
            id=flow.id, connect_id=outcome.connect_id,
            client=peer(flow.client_conn), user=outcome.user, profile=outcome.profile,
            method=flow.request.method, scheme=None if connect else flow.request.scheme,
            host=str(d.host) if d.host else outcome.host, port=outcome.port,
            path=None if connect else audit_path(flow.request.path), address=d.address,
            decision="refuse" if refusal else "allow",
            reason=(refusal or soft).reason.value if (refusal or soft) else None,
            would_refuse=True if soft else None,
            rule=_rule(d, refusal),
            credential=flow.metadata.get(CREDENTIAL_META),
            status=outcome.status(response.status_code if response else None),
            bytes_out=outcome.bytes_from_client or (len(flow.request.raw_content or b"") if d.allowed else 0),
            bytes_in=outcome.bytes_from_server or (len(response.raw_content or b"") if response and d.allowed else 0),
            duration=round(time.time() - outcome.started, 4),
            detail=refusal.detail if refusal else (flow.error.msg if flow.error else None),
        )

    def tunnel(self, flow: tcp.TCPFlow) -> None:
        """One line when a tunnel's TCP flow ends."""
        outcome = outcome_of(flow)
        if outcome is None:  # not decided by the gate: should not happen; log what we know
            server = flow.server_conn
            address = server.peername[0] if server.peername else (server.address[0] if server.address else "?")
            outcome = Outcome(address, server.address[1] if server.address else 0, Decision(True, address=address),
                              None, None)
        self.tunnel_line(outcome, flow.client_conn, flow.id, flow.error.msg if flow.error else None)

    def tunnel_line(self, outcome: Outcome, client: connection.Client, flow_id: str | None = None, error: str
                    | None = None) -> None:
        """One line when a tunnel (CONNECT, SOCKS5, transparent) closes or is cut."""
        if outcome.logged:
            return
        outcome.logged = True
        d = outcome.decision
        self.write(
            event="tunnel", id=flow_id or outcome.connect_id, connect_id=outcome.connect_id,
            client=peer(client), user=outcome.user, profile=outcome.profile,
            host=str(d.host) if d.host else outcome.host, port=outcome.port, address=d.address,
            decision="refuse" if outcome.cap else "allow",
            reason=(outcome.cap or d.would_refuse).reason.value if (outcome.cap or d.would_refuse) else None,
            would_refuse=True if d.would_refuse else None, rule=_rule(d, outcome.cap),
            bytes_out=outcome.bytes_from_client, bytes_in=outcome.bytes_from_server,
            duration=round(time.time() - outcome.started, 4),
            detail=outcome.cap.detail if outcome.cap else error,
        )

    def refused_connection(self, client: connection.Client, host: str, port: int, decision: Decision, profile: str
                           | None) -> None:
        """A connection refused at dial time (SOCKS5, transparent, last gate)."""
        refusal = decision.refusal
        self.write(
            event="connect", client=peer(client), profile=profile,
            host=str(decision.host) if decision.host else host, port=port,
            decision="refuse", reason=refusal.reason.value, rule=refusal.rule, detail=refusal.detail,
        )


def audit_path(target: str | None) -> str | None:
    """A request's path for its audit line: as forwarded (normalised where
    request rules judged it), without the query, at most MAX_AUDIT_PATH characters."""
    if not target:
        return None
    return split_target(target)[0][:MAX_AUDIT_PATH]


def _rule(d: Decision, refusal) -> str | None:
    if refusal is not None:
        return refusal.rule
    if d.would_refuse is not None:
        return d.would_refuse.rule
    return d.rule.origin if d.rule else None


def peer(conn: connection.Client) -> str | None:
    if not conn.peername:
        return None
    host, port = conn.peername[:2]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def quote_client(text: str | bytes, limit: int = 100) -> str:
    """Client bytes or text for a `detail`: printable ASCII only (anything
    else escaped as in a Python literal) and at most `limit` characters."""
    if isinstance(text, bytes):
        text = repr(text)[2:-1]
    else:
        text = "".join(c if " " <= c <= "~" else ascii(c)[1:-1] for c in text)
    return text if len(text) <= limit else text[: limit - 3] + "..."
