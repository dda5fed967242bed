"""Captured sources: pages fetch kept so source_read can page through them
again with no network request.

SQLite, one table. Each source belongs to the owner that fetched it
(`SLUICE_OWNER`, or the MCP server's `--owner`); another owner's id and an
unknown id read the same (`None` here, `web_source_not_found` in the tool),
so an id leaks nothing. Ids are 128 random bits.

Bounded: sources older than `max_age` seconds (default 7 days) are gone, and
after each insert the oldest are evicted until the store holds at most
`max_bytes` of content (default 256 MiB) and `max_sources` rows (default
10,000). Path: `SLUICE_SOURCES`, else `sources.sqlite3` in the user's data
directory (platformdirs); `:memory:` keeps it in the process (tests).
"""

from __future__ import annotations

import os
import secrets
import sqlite3
import threading
import time
from pathlib import Path

from sluice.webtools.errors import WebError

DEFAULT_MAX_BYTES = 256 * 1024 * 1024
DEFAULT_MAX_AGE = 7 * 24 * 3600
DEFAULT_MAX_SOURCES = 10_000

_SCHEMA = """
CREATE TABLE IF NOT EXISTS sources (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    created REAL NOT NULL,
    captured_at TEXT NOT NULL,
    url TEXT NOT NULL,
    final_url TEXT NOT NULL,
    status INTEGER NOT NULL,
    content_type TEXT NOT NULL,
    title TEXT,
    needs_javascript INTEGER NOT NULL,
    truncated INTEGER NOT NULL,
    size INTEGER NOT NULL,
    content TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS sources_created ON sources (created);
"""

_FIELDS = ("url", "final_url", "status", "content_type", "title", "needs_javascript", "truncated", "captured_at", "content")


def default_path() -> str:
    explicit = os.environ.get("SLUICE_SOURCES")
    if explicit:
        return explicit
    import platformdirs

    return str(Path(platformdirs.user_data_dir("sluice", appauthor=False)) / "sources.sqlite3")


class SourceStore:
    def __init__(self, path: str | None = None, *, max_bytes: int = DEFAULT_MAX_BYTES,
                 max_age: float = DEFAULT_MAX_AGE, max_sources: int = DEFAULT_MAX_SOURCES) -> None:
        self.path = path or default_path()
        self.max_bytes, self.max_age, self.max_sources = max_bytes, max_age, max_sources
        self._lock = threading.Lock()
        try:
            if self.path != ":memory:":
                Path(self.path).parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            self._db = sqlite3.connect(self.path, check_same_thread=False, timeout=10)
            self._db.executescript(_SCHEMA)
            if self.path != ":memory:":
                os.chmod(self.path, 0o600)
        except (OSError, sqlite3.Error) as e:
            raise WebError("web_store_error", f"the source store {self.path} cannot be opened ({e}); "
                           "set SLUICE_SOURCES to a writable file path") from None

    def put(self, owner: str, source: dict) -> str:
        """Keep a source; returns its new id."""
        source_id = "src_" + secrets.token_hex(16)
        content = source["content"]
        size = len(content.encode("utf-8", "surrogatepass"))
        now = time.time()
        try:
            with self._lock, self._db:
                self._db.execute(
                    "INSERT INTO sources (id, owner, created, size, " + ", ".join(_FIELDS) + ") "
                    "VALUES (?, ?, ?, ?, " + ", ".join("?" * len(_FIELDS)) + ")",
                    (source_id, owner, now, size, *(_column(source[f]) for f in _FIELDS)),
                )
                self._evict(now)
        except sqlite3.Error as e:
            raise WebError("web_store_error", f"the source store {self.path} cannot be written ({e})") from None
        return source_id

    def get(self, owner: str, source_id: str) -> dict | None:
        """The source if it exists, is this owner's and has not expired."""
        if not isinstance(source_id, str):
            return None
        try:
            with self._lock:
                row = self._db.execute(
                    "SELECT " + ", ".join(_FIELDS) + " FROM sources WHERE id = ? AND owner = ? AND created >= ?",
                    (source_id, owner, time.time() - self.max_age),
                ).fetchone()
        except sqlite3.Error as e:
            raise WebError("web_store_error", f"the source store {self.path} cannot be read ({e})") from None
        if row is None:
            return None
        source = dict(zip(_FIELDS, row))
        source["needs_javascript"] = bool(source["needs_javascript"])
        source["truncated"] = bool(source["truncated"])
        source["source_id"] = source_id
        return source

    def _evict(self, now: float) -> None:
        db = self._db
        db.execute("DELETE FROM sources WHERE created < ?", (now - self.max_age,))
        count, total = db.execute("SELECT COUNT(*), COALESCE(SUM(size), 0) FROM sources").fetchone()
        if count <= self.max_sources and total <= self.max_bytes:
            return
        # Oldest first, until both bounds hold (the newest source always stays).
        drop = []
        for source_id, size in db.execute("SELECT id, size FROM sources ORDER BY created, rowid"):
            if (count <= self.max_sources and total <= self.max_bytes) or count <= 1:
                break
            drop.append((source_id,))
            count -= 1
            total -= size
        db.executemany("DELETE FROM sources WHERE id = ?", drop)

    def close(self) -> None:
        with self._lock:
            self._db.close()


def _column(value):
    return int(value) if isinstance(value, bool) else value


_DEFAULT: dict[str, SourceStore] = {}
_DEFAULT_LOCK = threading.Lock()


def default_store() -> SourceStore:
    """One store per path per process (SLUICE_SOURCES or the default path)."""
    path = default_path()
    with _DEFAULT_LOCK:
        store = _DEFAULT.get(path)
        if store is None:
            store = _DEFAULT[path] = SourceStore(path)
        return store


def default_owner() -> str:
    return os.environ.get("SLUICE_OWNER", "")
