"""Approvals in the policy's state store (issue 23): pending asks, grants,
denials and the admin events on Valkey/Redis, shared by every Sluice process
that points at the same store. Same interface as sluice/approvals_store.py
(the SQLite file of --state-dir), which `open_approvals` chooses between.

Keys (all under `sluice:approvals:`):

- `asks`: sorted set, ask id -> when it was recorded (the store's clock);
  `ask:<id>`: the ask as JSON, with a TTL of ASK_LIFETIME.
- `grants`: sorted set, id -> when the grant or denial expires (the store's
  clock); `grant:<id>`: the grant as JSON, kept GRACE past its expiry so the
  process that finds it expired can audit it.
- `events`: list of the admin's audit records (JSON), claimed once.
- `version`: hash (born, n), bumped by every change of asks or grants, so a
  refresh reads them only when they changed.

Every step that two processes may race is one Lua script: recording an ask
(one record and one `approval_requested` line per id), approving or denying
(decided once: the second answer finds no pending ask), revoking (once),
claiming events, and the snapshot, which deletes the grants that expired and
returns them to exactly one caller. Expiry is on the store's clock (`TIME`):
each snapshot converts expiry times to the caller's clock, so a grant ends
at the same moment in every process, whatever their clocks say.

Each method blocks (the synchronous client, a connection pool shared by
threads): the proxy calls them off its event loop and reads grants from its
in-memory snapshot (addons/approvals.py). A store that fails or holds values
that are not Sluice's raises ApprovalsUnavailable with a sentence; a single
record that is not Sluice's is skipped with one stderr line (once per key).
The store is dialled directly (infrastructure, like the DNS server), never
through the egress gate.
"""

from __future__ import annotations

import json
import sys
import threading
from typing import Any

from sluice.approvals_store import (
    ASK_LIFETIME, ApprovalError, ApprovalsUnavailable, Snapshot, ask_json, grant_json, grant_record,
)
from sluice.policy.approvals import DEFAULT_DENY_FOR, Ask, AskKey, Grant, scoped
from sluice.policy.state import StateSettings

PREFIX = "sluice:approvals:"
ASKS, GRANTS, EVENTS = PREFIX + "asks", PREFIX + "grants", PREFIX + "events"
# A grant's record outlives its expiry this long, for the expiry's audit line.
GRACE = 3600.0
# Admin events nobody claims (no proxy process running) are capped at this many.
MAX_EVENTS = 10000
# Off the request path: a store call may take this long before it counts as failed.
MIN_SOCKET_TIMEOUT = 1.0

# Checks that the fixed keys are Sluice's kind (or absent): a foreign value is
# an error naming the key, never a half-run script.
_CHECK = """
local function check(key, kind)
  local t = redis.call('TYPE', key)['ok']
  if t ~= 'none' and t ~= kind then
    error({err = 'SLUICEFOREIGN ' .. key .. ' ' .. t})
  end
end
local function now()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end
local function value(key)
  local v = redis.pcall('GET', key)
  if type(v) == 'table' and v['err'] then return 'SLUICEFOREIGN ' .. v['err'] end
  return v
end
-- The version of what a snapshot holds: bumped by every change of asks or
-- grants, and born anew with the key (a store that restarted empty is never
-- taken for the one a process last read).
local function version()
  local h = redis.call('HMGET', ARGV[1] .. 'version', 'born', 'n')
  return tostring(h[1]) .. ':' .. tostring(h[2])
end
local function bump()
  local key = ARGV[1] .. 'version'
  check(key, 'hash')
  redis.call('HSETNX', key, 'born', tostring(now()))
  redis.call('HINCRBY', key, 'n', 1)
end
"""

# KEYS asks, grants; ARGV prefix, ask lifetime, the version the caller holds.
# Deletes the grants that expired and returns them (to this caller only); then,
# unless the caller's version is current, the grants in force and the pending
# ids ({time, expired, false, false, version} when it is: nothing to read).
SNAPSHOT = _CHECK + """
check(KEYS[1], 'zset'); check(KEYS[2], 'zset'); check(ARGV[1] .. 'version', 'hash')
local t = now()
local expired, live = {}, {}
local gone = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', t, 'WITHSCORES')
for i = 1, #gone, 2 do
  local key = ARGV[1] .. 'grant:' .. gone[i]
  local v = value(key)
  redis.call('DEL', key)
  redis.call('ZREM', KEYS[2], gone[i])
  if v then table.insert(expired, gone[i]); table.insert(expired, v); table.insert(expired, gone[i + 1]) end
end
local dropped = redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', t - tonumber(ARGV[2]))
if #gone > 0 or dropped > 0 then bump() end
if version() == ARGV[3] then return {tostring(t), expired, false, false, ARGV[3]} end
local held = redis.call('ZRANGEBYSCORE', KEYS[2], '(' .. t, '+inf', 'WITHSCORES')
local lost = false
for i = 1, #held, 2 do
  local v = value(ARGV[1] .. 'grant:' .. held[i])
  if v then
    table.insert(live, held[i]); table.insert(live, v); table.insert(live, held[i + 1])
  else
    redis.call('ZREM', KEYS[2], held[i])  -- its record was deleted by hand: nothing in force
    lost = true
  end
end
if lost then bump() end
return {tostring(t), expired, live, redis.call('ZRANGE', KEYS[1], 0, -1), version()}
"""

# KEYS asks, grants; ARGV prefix. Read only: the pending asks (id, JSON) and
# the grants and denials in force (id, JSON, expiry).
LISTING = _CHECK + """
check(KEYS[1], 'zset'); check(KEYS[2], 'zset')
local t = now()
local asks, grants = {}, {}
for _, id in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  local v = value(ARGV[1] .. 'ask:' .. id)
  if v then table.insert(asks, id); table.insert(asks, v) end
end
local held = redis.call('ZRANGEBYSCORE', KEYS[2], '(' .. t, '+inf', 'WITHSCORES')
for i = 1, #held, 2 do
  local v = value(ARGV[1] .. 'grant:' .. held[i])
  if v then table.insert(grants, held[i]); table.insert(grants, v); table.insert(grants, held[i + 1]) end
end
return {tostring(t), asks, grants}
"""

# KEYS asks, grants; ARGV prefix, id, the ask's JSON, lifetime (s). 1 if this
# call recorded it; 0 if it is pending already or answered and in force.
RECORD = _CHECK + """
check(KEYS[1], 'zset'); check(KEYS[2], 'zset')
local t = now()
local until_ = redis.call('ZSCORE', KEYS[2], ARGV[2])
if until_ and tonumber(until_) > t then return 0 end
if redis.call('ZSCORE', KEYS[1], ARGV[2]) then return 0 end
redis.call('SET', ARGV[1] .. 'ask:' .. ARGV[2], ARGV[3], 'PX', math.ceil(tonumber(ARGV[4]) * 1000))
redis.call('ZADD', KEYS[1], t, ARGV[2])
bump()
return 1
"""

# KEYS asks, grants, events; ARGV prefix, id, the grant's JSON, lifetime (s),
# the audit record, grace (s), most events. The store's time if this call
# answered the ask; false if it is not pending (answered by someone else).
ANSWER = _CHECK + """
check(KEYS[1], 'zset'); check(KEYS[2], 'zset'); check(KEYS[3], 'list')
if not redis.call('ZSCORE', KEYS[1], ARGV[2]) then return false end
local t = now()
local lifetime = tonumber(ARGV[4])
redis.call('ZREM', KEYS[1], ARGV[2])
redis.call('DEL', ARGV[1] .. 'ask:' .. ARGV[2])
redis.call('SET', ARGV[1] .. 'grant:' .. ARGV[2], ARGV[3], 'PX', math.ceil((lifetime + tonumber(ARGV[6])) * 1000))
redis.call('ZADD', KEYS[2], string.format('%.6f', t + lifetime), ARGV[2])
redis.call('RPUSH', KEYS[3], ARGV[5])
redis.call('LTRIM', KEYS[3], -tonumber(ARGV[7]), -1)
bump()
return tostring(t)
"""

# KEYS grants, events; ARGV prefix, id, the grant's JSON as read, the audit
# record, most events. {expiry, the store's time} if this call revoked it;
# false if it is not in force or changed since it was read.
REVOKE = _CHECK + """
check(KEYS[1], 'zset'); check(KEYS[2], 'list')
local t = now()
local until_ = redis.call('ZSCORE', KEYS[1], ARGV[2])
if not until_ or tonumber(until_) <= t then return false end
local key = ARGV[1] .. 'grant:' .. ARGV[2]
if value(key) ~= ARGV[3] then return false end
redis.call('DEL', key)
redis.call('ZREM', KEYS[1], ARGV[2])
redis.call('RPUSH', KEYS[2], ARGV[4])
redis.call('LTRIM', KEYS[2], -tonumber(ARGV[5]), -1)
bump()
return {until_, tostring(t)}
"""

# KEYS events. Every queued record, each claimed by one caller.
CLAIM = _CHECK + """
check(KEYS[1], 'list')
local records = redis.call('LRANGE', KEYS[1], 0, -1)
redis.call('DEL', KEYS[1])
return records
"""


class RedisApprovalStore:
    """The approvals of every process on the store `settings` names (see the module docstring)."""

    persistent = True  # kept by the store: across a Sluice restart; across a store restart if it persists

    def __init__(self, settings: StateSettings, client: Any = None) -> None:
        self.settings = settings
        self._client = client if client is not None else _connect(settings)
        self._scripts = {name: self._client.register_script(text) for name, text in (
            ("snapshot", SNAPSHOT), ("listing", LISTING), ("record", RECORD), ("answer", ANSWER),
            ("revoke", REVOKE), ("claim", CLAIM))}
        self._reported: set[str] = set()  # records not Sluice's, said once each
        # The last snapshot's grants (expiry on the store's clock) and pending ids, and its version.
        self._held: tuple[tuple[tuple[Grant, ...], frozenset[str]], str] = (((), frozenset()), "")
        self._lock = threading.Lock()

    @property
    def where(self) -> str:
        return f"in the state store {self.settings.where}"

    def close(self) -> None:
        try:
            self._client.close()
        except Exception:
            pass

    # ---- the proxy's side ---------------------------------------------------------

    def snapshot(self, now: float) -> tuple[Snapshot, list[Grant]]:
        """As ApprovalStore.snapshot; expiry times in the caller's clock (`now`
        is its time now). Grants and asks are read only when they changed
        since this store's last snapshot (the store's version): an idle
        refresh is one short reply, however many grants are in force."""
        held, version = self._held
        store_now, expired, live, pending, now_version = self._run(
            "snapshot", [ASKS, GRANTS], [PREFIX, ASK_LIFETIME, version])
        if live is not None:
            held = (tuple(self._grants(live, 0.0)), frozenset(pending))  # expiry on the store's clock
            self._held = (held, now_version)
        shift = now - float(store_now)
        grants, pending_ids = held
        return (Snapshot(tuple(_with_expiry(g, g.expires + shift) for g in grants), pending_ids, now),
                list(self._grants(expired, shift)))

    def record_ask(self, ask: Ask, grant_for: float) -> bool:
        k = ask.key
        record = json.dumps({"id": ask.id, "profile": k.profile, "user": k.user, "host": k.host, "method": k.method,
                             "path": k.path, "req_method": ask.method, "req_path": ask.path, "reason": ask.reason,
                             "created": ask.created, "grant_for": grant_for}, separators=(",", ":"))
        return bool(self._run("record", [ASKS, GRANTS], [PREFIX, ask.id, record, ASK_LIFETIME]))

    def claim_events(self, now: float) -> list[dict[str, Any]]:
        records = []
        for text in self._run("claim", [EVENTS], []):
            record = self._decode(text, f"{EVENTS} entry")
            if isinstance(record, dict) and isinstance(record.get("event"), str):
                records.append(record)
            elif record is not None:
                self._report(f"{EVENTS} entry", "not an audit record")
        return records

    # ---- the operator's side (the admin endpoint) -----------------------------------

    def listing(self, now: float) -> dict[str, list[dict[str, Any]]]:
        store_now, asks, grants = self._run("listing", [ASKS, GRANTS], [PREFIX])
        shift = now - float(store_now)
        pending = [ask_json(a) for a, _ in (self._ask(asks[i], asks[i + 1]) for i in range(0, len(asks), 2))
                   if a is not None]
        held = list(self._grants(grants, shift))
        return {"pending": pending, "grants": [grant_json(g) for g in held if not g.denied],
                "denials": [grant_json(g) for g in held if g.denied]}

    def answer(self, ask_id: str, *, denied: bool, seconds: float | None, scope: str | None, who: str,
               now: float) -> Grant:
        """As ApprovalStore.answer; decided once whichever process answers
        first (the other finds no pending ask)."""
        text = self._call(lambda: self._client.get(PREFIX + "ask:" + ask_id)) if _id_text(ask_id) else None
        ask, default_seconds = self._ask(ask_id, text) if text is not None else (None, 0.0)
        if ask is None:
            raise ApprovalError(f"no pending approval request {ask_id!r} (`sluice approvals list` shows them; "
                                "an answered one is under grants or denials)")
        try:
            method, path = scoped(ask, scope)
        except ValueError as e:
            raise ApprovalError(str(e)) from None
        lifetime = seconds if seconds is not None else (DEFAULT_DENY_FOR if denied else default_seconds)
        grant = Grant(ask.id, ask.key.profile, ask.key.user, ask.key.host, method, path, 0.0, denied, who)
        event = "approval_denied" if denied else "approval_granted"
        record = grant_record(event, grant, ask.reason, detail=f"{'denied' if denied else 'granted'} by {who} for "
                              f"{lifetime:g}s ({grant.scope} scope)")
        answered = self._run("answer", [ASKS, GRANTS, EVENTS], [PREFIX, ask.id, _grant_text(grant), lifetime,
                                                               json.dumps(record), GRACE, MAX_EVENTS])
        if not answered:
            raise ApprovalError(f"approval request {ask_id!r} was answered meanwhile (`sluice approvals list` "
                                "shows it under grants or denials)")
        return _with_expiry(grant, now + lifetime)  # the store's expiry, in the caller's clock

    def revoke(self, grant_id: str, who: str, now: float) -> Grant:
        for _attempt in range(3):  # the record changed between the read and the script: read it again
            text = self._call(lambda: self._client.get(PREFIX + "grant:" + grant_id)) if _id_text(grant_id) else None
            grant = self._grant(grant_id, text, 0.0, 0.0) if text is not None else None
            if grant is None:
                break
            record = grant_record("grant_revoked", grant, None, detail=f"revoked by {who}")
            done = self._run("revoke", [GRANTS, EVENTS], [PREFIX, grant_id, text, json.dumps(record), MAX_EVENTS])
            if done:
                until, store_now = done
                return _with_expiry(grant, float(until) - float(store_now) + now)
        raise ApprovalError(f"no grant or denial {grant_id!r} in force (`sluice approvals list` shows them)")

    # ---- the store ------------------------------------------------------------------

    def _run(self, name: str, keys: list[str], args: list[Any]) -> Any:
        script = self._scripts[name]
        return self._call(lambda: script(keys=keys, args=args))

    def _call(self, step: Any) -> Any:
        import redis

        try:
            return step()
        except redis.ResponseError as e:
            text = str(e)
            if "SLUICEFOREIGN" in text:
                words = text.split("SLUICEFOREIGN ", 1)[1].split() + ["?", "?"]
                key, kind = words[0], words[1]
                raise ApprovalsUnavailable(
                    f"the state store {self.settings.where} holds a {kind} at {key}, which is not Sluice's "
                    f"approvals (another program writes there?); delete it (redis-cli DEL {key}) or use another "
                    "database number in state.store.url") from None
            raise ApprovalsUnavailable(f"the state store {self.settings.where} refused a step ({_short(e)})") from None
        except (redis.RedisError, OSError) as e:
            raise ApprovalsUnavailable(f"the state store {self.settings.where} is unavailable ({_short(e)})") from None

    # ---- records --------------------------------------------------------------------

    def _decode(self, text: object, what: str) -> Any:
        if not isinstance(text, str) or text.startswith("SLUICEFOREIGN "):
            self._report(what, "not a string value" if isinstance(text, str) else "not text")
            return None
        try:
            return json.loads(text)
        except ValueError:
            self._report(what, "not JSON")
            return None

    def _report(self, what: str, why: str) -> None:
        with self._lock:
            if what in self._reported:
                return
            self._reported.add(what)
        print(f"sluice: approvals: ignoring {what} in the state store {self.settings.where} ({why}): not a Sluice "
              "record (another program's, or another version's?)", file=sys.stderr, flush=True)

    def _grants(self, flat: list[Any], shift: float) -> Any:
        for i in range(0, len(flat), 3):
            grant = self._grant(flat[i], flat[i + 1], float(flat[i + 2]), shift)
            if grant is not None:
                yield grant

    def _grant(self, gid: str, text: object, expires: float, shift: float) -> Grant | None:
        what = f"{PREFIX}grant:{gid}"
        value = self._decode(text, what)
        if value is None:
            return None
        try:
            fields = [value[k] for k in ("profile", "user", "host", "method", "path", "denied", "who")]
            profile, user, host, method, path, denied, who = fields
            if not all(isinstance(v, str) for v in (profile, user, host, who)) or not isinstance(denied, bool) \
                    or not all(v is None or isinstance(v, str) for v in (method, path)):
                raise TypeError
        except (KeyError, TypeError):
            self._report(what, "a record without a grant's fields")
            return None
        return Grant(gid, profile, user, host, method, path, expires + shift, denied, who)

    def _ask(self, aid: str, text: object) -> tuple[Ask | None, float]:
        what = f"{PREFIX}ask:{aid}"
        value = self._decode(text, what)
        if value is None:
            return None, 0.0
        try:
            key = AskKey(*(value[k] for k in ("profile", "user", "host", "method", "path")))
            ask = Ask(aid, key, value["req_method"], value["req_path"], value["reason"], float(value["created"]))
            grant_for = float(value["grant_for"])
            if not all(isinstance(v, str) for v in (*key, ask.method, ask.path, ask.reason)):
                raise TypeError
        except (KeyError, TypeError, ValueError):
            self._report(what, "a record without an ask's fields")
            return None, 0.0
        return ask, grant_for


def _grant_text(grant: Grant) -> str:
    return json.dumps({"profile": grant.profile, "user": grant.user, "host": grant.host, "method": grant.method,
                       "path": grant.path, "denied": grant.denied, "who": grant.who}, separators=(",", ":"))


def _with_expiry(grant: Grant, expires: float) -> Grant:
    return Grant(grant.id, grant.profile, grant.user, grant.host, grant.method, grant.path, expires, grant.denied,
                 grant.who)


def _id_text(ident: str) -> bool:
    """An id as Sluice makes them (policy.approvals.ask_id): no key of another shape is read."""
    return 0 < len(ident) <= 64 and all(c in "0123456789abcdef" for c in ident)


def _connect(settings: StateSettings) -> Any:
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    password = settings.password.reveal() if settings.password is not None and settings.password.known else None
    timeout = max(settings.timeout * 20, MIN_SOCKET_TIMEOUT)
    # One retry: a pooled connection a store restart closed is dialled again once, not reported as down.
    return redis.Redis.from_url(settings.url, password=password, socket_timeout=timeout,
                                socket_connect_timeout=timeout, retry=Retry(NoBackoff(), 1), health_check_interval=0,
                                decode_responses=True)


def _short(error: BaseException) -> str:
    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    return text[:160]
