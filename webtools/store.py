"""Captured sources: pages fetch kept so source_read can page through them
again with no network request.

SQLite, one table. Each source belongs to the owner that fetched it
(`SLUICE_OWNER`, or the MCP server's `--owner`; with neither, the CLI's owner
is the OS user and an MCP server's a random name it prints on stderr, see
`default_owner`); another owner's id and an unknown id read the same (`None`
here, `web_source_not_found` in the tool), so an id leaks nothing. Ids are 128
random bits.

Bounded, counting every byte stored (content, title, URLs, type, owner, id):
- one source is at most `source_cap` bytes (default 2 MiB): a longer one is
  cut at a character boundary and marked (`truncated` and `store_truncated`);
- each owner has a share, `owner_bytes` (default 64 MiB) and `owner_sources`
  (2,500): an insert over it evicts that owner's own oldest sources, never
  another owner's;
- sources older than `max_age` seconds (default 7 days) are gone;
- the whole store holds at most `max_bytes` (256 MiB) and `max_sources`
  (10,000): only when several owners together are over it are the oldest
  sources of the owner holding the most evicted.
A source has a `kind` ("page", or "pdf" for a PDF's text) and `extra`, its
kind's metadata as JSON (a PDF's page counts; at most 4,096 characters),
and `reuse_key`, the fetch that captured it (`recent` finds the owner's
newest one within SLUICE_WEB_REUSE, so a repeat fetch is no request).
The newest source always stays. Path: `SLUICE_SOURCES`, else
`sources.sqlite3` in the user's data directory (platformdirs); `:memory:`
keeps it in the process (tests).
"""

from __future__ import annotations

import getpass
import json
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
DEFAULT_OWNER_BYTES = 64 * 1024 * 1024
DEFAULT_OWNER_SOURCES = 2_500
DEFAULT_SOURCE_CAP = 2 * 1024 * 1024
ROW_OVERHEAD = 64  # the numeric columns and SQLite's own bookkeeping, roughly
# The most any field but content may take of a source (they are bounded
# before they get here; this keeps the store's own bound whatever the caller).
FIELD_CAPS = {"url": 8192, "final_url": 8192, "content_type": 256, "title": 1024, "captured_at": 64, "reuse_key": 8256}

# `truncated` column: bit flags, why the content is not the whole page
# (MARKDOWN_CAP: the markdown reached its bound, webtools.convert).
READ_CAP, STORE_CAP, MARKDOWN_CAP = 1, 2, 4

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
    hidden_chars INTEGER NOT NULL DEFAULT 0,
    kind TEXT NOT NULL DEFAULT 'page',
    extra TEXT,
    reuse_key TEXT,
    size INTEGER NOT NULL,
    content TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS sources_created ON sources (created);
CREATE INDEX IF NOT EXISTS sources_owner_created ON sources (owner, created);
"""

_FIELDS = ("url", "final_url", "status", "content_type", "title", "needs_javascript", "truncated", "captured_at",
           "content",
           "hidden_chars", "kind", "extra", "reuse_key")
# Columns later versions added, with their definitions: an older store gains them on open.
_ADDED_COLUMNS = {"hidden_chars": "INTEGER NOT NULL DEFAULT 0", "kind": "TEXT NOT NULL DEFAULT 'page'", "extra": "TEXT",
                  "reuse_key": "TEXT"}
EXTRA_CHARS = 4096  # a source's kind-specific metadata (`extra`, JSON: a PDF's page counts)


def default_path() -> str:
    explicit = os.environ.get("SLUICE_SOURCES")
    if explicit:
        return explicit
    import platformdirs

    return str(Path(platformdirs.user_data_dir("sluice", appauthor=False)) / "sources.sqlite3")


def _utf8_len(value: str) -> int:
    return len(value.encode("utf-8", "surrogatepass"))


def _cut_utf8(value: str, limit: int) -> str:
    """The longest start of `value` that is at most `limit` UTF-8 bytes."""
    if len(value) * 4 <= limit:
        return value
    return value.encode("utf-8", "surrogatepass")[: max(limit, 0)].decode("utf-8", "ignore")


def row_size(source_id: str, owner: str, source: dict) -> int:
    """What a row takes: every text column in UTF-8 bytes, plus the overhead."""
    text = [source_id, owner] + [source.get(f) for f in _FIELDS if f != "extra" and isinstance(source.get(f), str)]
    return ROW_OVERHEAD + sum(_utf8_len(t) for t in text)


class SourceStore:
    def __init__(self, path: str | None = None, *, max_bytes: int = DEFAULT_MAX_BYTES,
                 max_age: float = DEFAULT_MAX_AGE, max_sources: int = DEFAULT_MAX_SOURCES,
                 owner_bytes: int = DEFAULT_OWNER_BYTES, owner_sources: int = DEFAULT_OWNER_SOURCES,
                 source_cap: int = DEFAULT_SOURCE_CAP) -> None:
        self.path = path or default_path()
        self.max_bytes, self.max_age, self.max_sources = max_bytes, max_age, max_sources
        self.owner_bytes, self.owner_sources, self.source_cap = owner_bytes, owner_sources, source_cap
        self._lock = threading.Lock()
        try:
            if self.path != ":memory:":
                Path(self.path).parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            self._db = sqlite3.connect(self.path, check_same_thread=False, timeout=10)
            self._db.executescript(_SCHEMA)
            columns = {row[1] for row in self._db.execute("PRAGMA table_info(sources)")}
            for column, definition in _ADDED_COLUMNS.items():
                if column not in columns:  # a store made by an older version
                    self._db.execute(f"ALTER TABLE sources ADD COLUMN {column} {definition}")
            self._db.execute("CREATE INDEX IF NOT EXISTS sources_reuse ON sources (owner, reuse_key, created)")
            if self.path != ":memory:":
                os.chmod(self.path, 0o600)
        except (OSError, sqlite3.Error) as e:
            raise WebError("web_store_error", f"the source store {self.path} cannot be opened ({e}); "
                           "set SLUICE_SOURCES to a writable file path") from None

    def put(self, owner: str, source: dict) -> str:
        """Keep a source; returns its new id. A source over the per-source
        cap is cut to it first, in `source` itself (`content`, `truncated`,
        `store_truncated`), so the caller returns what was stored."""
        source_id = "src_" + secrets.token_hex(16)
        source.setdefault("kind", "page")
        extra = source.get("extra") or None
        if isinstance(extra, dict):
            extra = json.dumps(extra, ensure_ascii=False)
        if extra is not None and len(extra) > EXTRA_CHARS:
            raise ValueError(f"a source's extra metadata is {len(extra):,} characters (at most {EXTRA_CHARS:,})")
        self._fit(source_id, owner, source, len(extra or ""))
        size = row_size(source_id, owner, source) + len(extra or "")
        flags = (READ_CAP if source["truncated"] and not source.get("store_truncated") else 0) | (
            STORE_CAP if source.get("store_truncated") else 0) | (MARKDOWN_CAP if source.get("markdown_truncated")
                                                                  else 0)
        values = {"hidden_chars": 0, "kind": "page", "reuse_key": None, **source, "truncated": flags, "extra": extra}
        now = time.time()
        try:
            with self._lock, self._db:
                self._db.execute(
                    "INSERT INTO sources (id, owner, created, size, " + ", ".join(_FIELDS) + ") "
                    "VALUES (?, ?, ?, ?, " + ", ".join("?" * len(_FIELDS)) + ")",
                    (source_id, owner, now, size, *(_column(values[f]) for f in _FIELDS)),
                )
                self._evict(now, owner, source_id)
        except sqlite3.Error as e:
            raise WebError("web_store_error", f"the source store {self.path} cannot be written ({e})") from None
        return source_id

    def _fit(self, source_id: str, owner: str, source: dict, extra_bytes: int = 0) -> None:
        for field, cap in FIELD_CAPS.items():
            value = source.get(field)
            if isinstance(value, str) and _utf8_len(value) > cap:
                source[field] = _cut_utf8(value, cap)
        content = source["content"]
        room = self.source_cap - row_size(source_id, owner, {**source, "content": ""}) - extra_bytes
        if _utf8_len(content) > room:
            source["content"] = _cut_utf8(content, room)
            source["truncated"] = source["store_truncated"] = True

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
        flags = int(source["truncated"])
        source["needs_javascript"] = bool(source["needs_javascript"])
        source["truncated"] = bool(flags & (READ_CAP | STORE_CAP))
        source["store_truncated"] = bool(flags & STORE_CAP)
        source["markdown_truncated"] = bool(flags & MARKDOWN_CAP)
        source["source_id"] = source_id
        try:
            source["extra"] = json.loads(source["extra"]) if source["extra"] else {}
        except ValueError:
            source["extra"] = {}
        return source

    def recent(self, owner: str, reuse_key: str, max_age: float) -> dict | None:
        """The owner's newest source captured under `reuse_key` at most
        `max_age` seconds ago (what fetch reuses), or None."""
        if max_age <= 0:
            return None
        try:
            with self._lock:
                row = self._db.execute(
                    "SELECT id FROM sources WHERE owner = ? AND reuse_key = ? AND created >= ? "
                    "ORDER BY created DESC, rowid DESC LIMIT 1",
                    (owner, reuse_key, time.time() - min(max_age, self.max_age))).fetchone()
        except sqlite3.Error as e:
            raise WebError("web_store_error", f"the source store {self.path} cannot be read ({e})") from None
        return self.get(owner, row[0]) if row is not None else None

    def usage(self, owner: str | None = None) -> tuple[int, int]:
        """(sources, bytes) held, by one owner or by all."""
        where, args = ("WHERE owner = ?", (owner,)) if owner is not None else ("", ())
        with self._lock:
            count, total = self._db.execute(
                f"SELECT COUNT(*), COALESCE(SUM(size), 0) FROM sources {where}", args).fetchone()
        return count, total

    def _evict(self, now: float, owner: str, keep: str) -> None:
        db = self._db
        db.execute("DELETE FROM sources WHERE created < ?", (now - self.max_age,))
        # The owner's share: its own oldest go, never another owner's.
        self._evict_oldest(owner, keep, self.owner_sources, self.owner_bytes)
        # The whole store: over it only when many owners are near their
        # share; the owner holding the most gives up its oldest.
        while True:
            count, total = db.execute("SELECT COUNT(*), COALESCE(SUM(size), 0) FROM sources").fetchone()
            if count <= self.max_sources and total <= self.max_bytes:
                return
            biggest = db.execute("SELECT owner, SUM(size) AS held FROM sources WHERE id != ? GROUP BY owner "
                                 "ORDER BY held DESC LIMIT 1", (keep,)).fetchone()
            if biggest is None:
                return
            held_count, held = db.execute("SELECT COUNT(*), COALESCE(SUM(size), 0) FROM sources WHERE owner = ?",
                                          (biggest[0],)).fetchone()
            # Down by what the store is over (at least one source goes: one bound is over).
            self._evict_oldest(biggest[0], keep, held_count - max(count - self.max_sources, 0),
                               held - max(total - self.max_bytes, 0))

    def _evict_oldest(self, owner: str, keep: str, max_count: int, max_bytes: int) -> None:
        db = self._db
        count, total = db.execute("SELECT COUNT(*), COALESCE(SUM(size), 0) FROM sources WHERE owner = ?",
                                  (owner,)).fetchone()
        if count <= max_count and total <= max_bytes:
            return
        drop = []
        for source_id, size in db.execute("SELECT id, size FROM sources WHERE owner = ? AND id != ? "
                                          "ORDER BY created, rowid", (owner, keep)):
            if count <= max_count and total <= max_bytes:
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
    """SLUICE_OWNER, else the OS user ("user:NAME"): so one user's CLI calls
    share their sources (fetch, then source-read) and nobody falls into one
    empty owner shared by every process. `sluice mcp` without --owner sets a
    random SLUICE_OWNER for its own life (webtools.mcp_server.run)."""
    explicit = (os.environ.get("SLUICE_OWNER") or "").strip()
    if explicit:
        return explicit
    try:
        return "user:" + getpass.getuser()
    except (KeyError, OSError, ImportError):  # no name for this uid (containers)
        return f"uid:{os.getuid()}" if hasattr(os, "getuid") else "user:unknown"
