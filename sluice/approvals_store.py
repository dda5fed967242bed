"""Where approvals live (issue 22): pending asks, grants and denials, in SQLite.

`open_approvals` (at the end) is the one place that chooses: this SQLite
store, or the policy's state store when it has `state`
(sluice/approvals_redis.py, the same interface: Snapshot, ApprovalError,
ApprovalsUnavailable and the JSON shapes are defined here for both).

`--state-dir DIR` keeps them in DIR/approvals.sqlite3 (WAL mode), shared by
every process that opens it (the workers of `--workers N` and their
supervisor's admin endpoint) and kept across restarts. Without it they are in
this process's memory only. A file that is not a readable approvals database
is moved aside and the store starts empty, with one line on stderr.

Every method does blocking I/O: the proxy calls them off its event loop
(asyncio.to_thread) and reads grants from an in-memory snapshot it refreshes
at most every second (addons/approvals.py). The admin endpoint's threads call
them directly. One connection per store, behind a lock.

Audit records of what the admin endpoint did (a grant, a denial, a revoke)
are queued in the `events` table: the admin endpoint of `--workers N` has no
audit log, so a proxy process claims each event once (`claim_events`) and
writes its line. An ask is recorded once by its unique key: the process whose
insert made it writes `approval_requested`; an expired grant is deleted once:
the process whose delete removed it writes `grant_expired`.
"""

from __future__ import annotations

import json
import os
import sqlite3
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from sluice.policy.approvals import DEFAULT_DENY_FOR, Ask, AskKey, Grant, scoped
from sluice.policy.state import StateSettings

FILE_NAME = "approvals.sqlite3"
SCHEMA_VERSION = 1
# An ask nobody answers is forgotten after this long (a new request asks again).
ASK_LIFETIME = 86400.0
# Claimed events are kept this long (for another process's late look), then dropped.
EVENT_LIFETIME = 3600.0

_SCHEMA = """
CREATE TABLE IF NOT EXISTS asks (
    id TEXT PRIMARY KEY, profile TEXT NOT NULL, user TEXT NOT NULL, host TEXT NOT NULL,
    method TEXT NOT NULL, path TEXT NOT NULL, req_method TEXT NOT NULL, req_path TEXT NOT NULL,
    reason TEXT NOT NULL, created REAL NOT NULL, grant_for REAL NOT NULL,
    UNIQUE (profile, user, host, method, path)
);
CREATE TABLE IF NOT EXISTS grants (
    id TEXT PRIMARY KEY, profile TEXT NOT NULL, user TEXT NOT NULL, host TEXT NOT NULL,
    method TEXT, path TEXT, expires REAL NOT NULL, denied INTEGER NOT NULL, who TEXT NOT NULL,
    created REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, record TEXT NOT NULL, created REAL NOT NULL,
    claimed INTEGER NOT NULL DEFAULT 0
);
"""


class ApprovalError(Exception):
    """An admin request that cannot be done (no such id, a bad scope), as a sentence."""


class ApprovalsUnavailable(Exception):
    """The approvals' store did not answer (or holds what is not Sluice's), as
    a sentence: the gate keeps its last snapshot, the admin verbs answer 503."""


@dataclass(frozen=True, slots=True)
class Snapshot:
    """What the gate decides with: grants and denials in force, and the ids of pending asks."""

    grants: tuple[Grant, ...] = ()
    pending: frozenset[str] = frozenset()
    taken: float = 0.0


class ApprovalStore:
    def __init__(self, state_dir: str | None, *, announce_new: bool = True) -> None:
        self.path = os.path.join(state_dir, FILE_NAME) if state_dir else None
        self.announce_new = announce_new  # say so when the file is not there yet
        self._lock = threading.Lock()
        self._db = self._open()

    @property
    def persistent(self) -> bool:
        return self.path is not None

    @property
    def where(self) -> str:
        return self.path or "memory (this process only; --state-dir keeps them)"

    # ---- opening ------------------------------------------------------------------

    def _open(self) -> sqlite3.Connection:
        if self.path is None:
            db = sqlite3.connect(":memory:", check_same_thread=False, isolation_level=None)
            db.executescript(_SCHEMA)
            return db
        existed = os.path.exists(self.path)
        try:
            return self._connect(self.path)
        except sqlite3.DatabaseError as e:
            aside = f"{self.path}.corrupt-{int(time.time())}"
            for suffix in ("", "-wal", "-shm"):
                try:
                    os.replace(self.path + suffix, aside + suffix)
                except FileNotFoundError:
                    pass
            print(f"sluice: the approvals state {self.path} is unreadable ({e}); moved it to {aside} and starting "
                  "with no approvals", file=sys.stderr)
            return self._connect(self.path)
        finally:
            if not existed and self.announce_new:
                print(f"sluice: no approvals state at {self.path} yet; starting with no approvals", file=sys.stderr)

    @staticmethod
    def _connect(path: str) -> sqlite3.Connection:
        db = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=5.0)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            version = db.execute("PRAGMA user_version").fetchone()[0]
            if version not in (0, SCHEMA_VERSION):
                raise sqlite3.DatabaseError(f"schema version {version}, not {SCHEMA_VERSION}")
            db.executescript(_SCHEMA)
            db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
            db.execute("SELECT count(*) FROM asks").fetchone()
            db.execute("SELECT count(*) FROM grants").fetchone()
        except sqlite3.DatabaseError:
            db.close()
            raise
        return db

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _tx(self) -> Any:
        return _Transaction(self._db, self._lock)

    # ---- the proxy's side ---------------------------------------------------------

    def snapshot(self, now: float) -> tuple[Snapshot, list[Grant]]:
        """Grants and denials in force and the pending ids; and the grants that
        had expired, which this call deleted (the caller audits them)."""
        with self._tx() as db:
            expired = [_grant(row) for row in db.execute(
                "DELETE FROM grants WHERE expires <= ? RETURNING id, profile, user, host, method, path, expires, "
                "denied, who", (now,))]
            db.execute("DELETE FROM asks WHERE created <= ?", (now - ASK_LIFETIME,))
            grants = tuple(_grant(row) for row in db.execute(
                "SELECT id, profile, user, host, method, path, expires, denied, who FROM grants ORDER BY created"))
            pending = frozenset(row[0] for row in db.execute("SELECT id FROM asks"))
        return Snapshot(grants, pending, now), expired

    def record_ask(self, ask: Ask, grant_for: float) -> bool:
        """Record a pending ask (with the asking rules' `grant_for`, the
        default lifetime of its grant); False if an identical one is pending
        already (the unique key) or it was answered meanwhile."""
        k = ask.key
        with self._tx() as db:
            if db.execute("SELECT 1 FROM grants WHERE id = ?", (ask.id,)).fetchone():
                return False
            cursor = db.execute(
                "INSERT OR IGNORE INTO asks (id, profile, user, host, method, path, req_method, req_path, reason, "
                "created, grant_for) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (ask.id, k.profile, k.user, k.host, k.method, k.path, ask.method, ask.path, ask.reason, ask.created,
                 grant_for))
            return cursor.rowcount == 1

    def claim_events(self, now: float) -> list[dict[str, Any]]:
        """The audit records nobody has written yet; each is claimed once."""
        with self._tx() as db:
            rows = db.execute("UPDATE events SET claimed = 1 WHERE claimed = 0 RETURNING seq, record").fetchall()
            db.execute("DELETE FROM events WHERE claimed = 1 AND created <= ?", (now - EVENT_LIFETIME,))
        return [json.loads(record) for _seq, record in sorted(rows)]

    # ---- the operator's side (the admin endpoint) -----------------------------------

    def listing(self, now: float) -> dict[str, list[dict[str, Any]]]:
        with self._tx() as db:
            asks = [_ask(row) for row in db.execute(
                "SELECT id, profile, user, host, method, path, req_method, req_path, reason, created FROM asks "
                "WHERE created > ? ORDER BY created", (now - ASK_LIFETIME,))]
            grants = [_grant(row) for row in db.execute(
                "SELECT id, profile, user, host, method, path, expires, denied, who FROM grants WHERE expires > ? "
                "ORDER BY created", (now,))]
        return {"pending": [ask_json(a) for a in asks], "grants": [grant_json(g) for g in grants if not g.denied],
                "denials": [grant_json(g) for g in grants if g.denied]}

    def answer(self, ask_id: str, *, denied: bool, seconds: float | None, scope: str | None, who: str,
               now: float) -> Grant:
        """Grant (or deny) the pending ask `ask_id` for `seconds` (else the
        asking rules' `grant_for`, or a day for a denial) in `scope`; queues
        its audit event."""
        with self._tx() as db:
            row = db.execute("SELECT id, profile, user, host, method, path, req_method, req_path, reason, created, "
                             "grant_for FROM asks WHERE id = ?", (ask_id,)).fetchone()
            if row is None:
                raise ApprovalError(f"no pending approval request {ask_id!r} (`sluice approvals list` shows them; "
                                    "an answered one is under grants or denials)")
            ask, default_seconds = _ask(row[:-1]), row[-1]
            try:
                method, path = scoped(ask, scope)
            except ValueError as e:
                raise ApprovalError(str(e)) from None
            lifetime = seconds if seconds is not None else (DEFAULT_DENY_FOR if denied else default_seconds)
            grant = Grant(ask.id, ask.key.profile, ask.key.user, ask.key.host, method, path, now + lifetime,
                          denied, who)
            db.execute("DELETE FROM asks WHERE id = ?", (ask_id,))
            db.execute("INSERT OR REPLACE INTO grants (id, profile, user, host, method, path, expires, denied, who, "
                       "created) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                       (grant.id, grant.profile, grant.user, grant.host, grant.method, grant.path, grant.expires,
                        int(denied), who, now))
            event = "approval_denied" if denied else "approval_granted"
            _queue(db, grant_record(event, grant, ask.reason, detail=f"{'denied' if denied else 'granted'} by {who} "
                                    f"for {lifetime:g}s ({grant.scope} scope)"), now)
        return grant

    def revoke(self, grant_id: str, who: str, now: float) -> Grant:
        """End a grant or denial now; queues its audit event (grant_revoked)."""
        with self._tx() as db:
            row = db.execute("DELETE FROM grants WHERE id = ? AND expires > ? RETURNING id, profile, user, host, "
                             "method, path, expires, denied, who", (grant_id, now)).fetchone()
            if row is None:
                raise ApprovalError(f"no grant or denial {grant_id!r} in force (`sluice approvals list` shows them)")
            grant = _grant(row)
            _queue(db, grant_record("grant_revoked", grant, None, detail=f"revoked by {who}"), now)
        return grant


class _Transaction:
    """The store's lock and one SQLite transaction (BEGIN IMMEDIATE: writers
    in other processes wait their turn instead of failing)."""

    def __init__(self, db: sqlite3.Connection, lock: threading.Lock) -> None:
        self.db, self.lock = db, lock

    def __enter__(self) -> sqlite3.Connection:
        self.lock.acquire()
        try:
            self.db.execute("BEGIN IMMEDIATE")
        except BaseException:
            self.lock.release()
            raise
        return self.db

    def __exit__(self, kind: object, *_: object) -> None:
        try:
            self.db.execute("COMMIT" if kind is None else "ROLLBACK")
        finally:
            self.lock.release()


def _queue(db: sqlite3.Connection, record: dict[str, Any], now: float) -> None:
    db.execute("INSERT INTO events (record, created) VALUES (?, ?)", (json.dumps(record), now))


def _grant(row: tuple[Any, ...]) -> Grant:
    gid, profile, user, host, method, path, expires, denied, who = row
    return Grant(gid, profile, user, host, method, path, expires, bool(denied), who)


def _ask(row: tuple[Any, ...]) -> Ask:
    aid, profile, user, host, method, path, req_method, req_path, reason, created = row
    return Ask(aid, AskKey(profile, user, host, method, path), req_method, req_path, reason, created)


def ask_json(ask: Ask) -> dict[str, Any]:
    return {"id": ask.id, "profile": ask.key.profile or None, "user": ask.key.user or None, "host": ask.key.host,
            "method": ask.method or None, "path": ask.path or None, "reason": ask.reason,
            "level": "path" if ask.key.path else "host", "time": ask.created}


def grant_json(grant: Grant) -> dict[str, Any]:
    return {"id": grant.id, "profile": grant.profile or None, "user": grant.user or None, "host": grant.host,
            "method": grant.method, "path": grant.path, "scope": grant.scope, "expires": grant.expires,
            "who": grant.who}


def grant_record(event: str, grant: Grant, reason: str | None, detail: str) -> dict[str, Any]:
    """An audit record (addons/audit.py fields) about a grant or denial."""
    return {"event": event, "id": grant.id, "profile": grant.profile or None, "user": grant.user or None,
            "host": grant.host, "method": grant.method, "path": grant.path,
            "decision": "refuse" if grant.denied else "allow", "reason": reason, "detail": detail}


def same_place(a: StateSettings | None, b: StateSettings | None) -> bool:
    """Whether approvals under `a` and `b` live in the same place: the same
    store (its `timeout` and `on_error` aside), or both without one."""
    if a is None or b is None:
        return a is b
    return (a.url, a.password_source) == (b.url, b.password_source) and a.password == b.password


def open_approvals(state: StateSettings | None, state_dir: str | None, *, announce_new: bool = True) -> Any:
    """Where approvals live, chosen in this one place: the policy's state
    store when it has `state` (sluice/approvals_redis.py; no file is made or
    read), else SQLite in `state_dir` (in memory without one). Raises
    OSError or sqlite3.Error when the file cannot be kept there."""
    if state is not None:
        from sluice.approvals_redis import RedisApprovalStore

        return RedisApprovalStore(state)
    return ApprovalStore(state_dir, announce_new=announce_new)
