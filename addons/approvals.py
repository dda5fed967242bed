"""Approvals in the proxy (issue 22): the grants snapshot, asks, waits, the
audit records and the webhook. The decision is policy.approvals.judge(),
applied inside admit() (sluice/admission.py) with this addon's snapshot.

- The gate reads grants from an in-memory snapshot (`view`): never the
  store. A task refreshes it from the store at most every second, off the
  event loop, so grants and revocations from another process (a worker's
  sibling, the supervisor's admin endpoint, another replica on the same
  state store) apply within a second; the admin endpoint of this process
  refreshes it at once.
- Where approvals live is chosen by sluice.approvals_store.open_approvals:
  the policy's state store when it has `state` (sluice/approvals_redis.py),
  else SQLite in --state-dir. A reload that changes `state` switches: the
  snapshot starts empty and is read from the new place at once (grants are
  not copied; those left in the old place apply again if it comes back).
- A store that fails keeps the snapshot as last read (its grants still
  expire on time), with one stderr line when it fails and one when it is
  back. A new ask is answered approval_pending at once either way: it is
  recorded within the store's `timeout` if it answers, else in the
  background, and an ask the store could not take is recorded again at the
  next refresh that reaches it.
- The process whose record made a new ask writes `approval_requested` and
  sends the webhook. The refresh writes `grant_expired` for the grants it
  deleted and the queued admin events (`approval_granted` with who,
  `approval_denied`, `grant_revoked`).
- `wait`: a refused request is held until its ask is answered or `wait`
  passes, then decided again.
- The webhook goes through this proxy's own HTTP listener, so the gate, the
  dialer and the audit log treat it like any egress (a private webhook
  needs private_networks). It is signed (HMAC-SHA256 of the body,
  `Sluice-Signature: sha256=<hex>`), retried with backoff, never awaited by
  a request.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import time
from dataclasses import replace
from typing import Any, Protocol

from sluice.admission import Admission, ApprovalView
from sluice.approvals_store import ApprovalsUnavailable, Snapshot, open_approvals, same_place
from sluice.policy.approvals import DEFAULT_GRANT_FOR, ApprovalSettings, Ask, Grant, Judgement, Notify, Verdict
from sluice.policy.state import StateSettings

logger = logging.getLogger("sluice.approvals")

REFRESH_SECONDS = 1.0
UNRECORDED_MAX = 1000  # asks a failed store could not take, kept to record when it is back
WEBHOOK_ATTEMPTS = 4
WEBHOOK_FIRST_BACKOFF = 0.5  # seconds, doubled after each failed attempt
WEBHOOK_TIMEOUT = 10.0
SIGNATURE_HEADER = "Sluice-Signature"
# Sent to the proxy itself on the webhook's own request (a proxy header: never
# forwarded): a webhook the policy refuses is refused, never asked about (an
# ask about the webhook would send a webhook). Its value is keyed by the
# notify secret, so every worker recognises it and no agent can make it.
WEBHOOK_HEADER = "Sluice-Webhook"


def webhook_marker(notify: Notify) -> str | None:
    if not notify.secret.known:
        return None
    return hmac.new(notify.secret.reveal().encode(), b"sluice webhook request", hashlib.sha256).hexdigest()


def is_webhook(policy: Any, marker: str) -> bool:
    """Whether `marker` is the Sluice-Webhook value of one of the policy's webhooks."""
    for rules in (policy.rules, *(c.rules for c in policy.clients)):
        notify = rules.approvals.notify if rules.approvals is not None else None
        expected = webhook_marker(notify) if notify is not None else None
        if expected is not None and hmac.compare_digest(expected, marker):
            return True
    return False


class ApprovalObserver(Protocol):
    """Told of each judgement and each snapshot (addons/metrics.py ApprovalMetrics)."""

    def judged(self, outcome: str) -> None: ...
    def counts(self, pending: int, grants: int) -> None: ...


def signature(secret: str, body: bytes) -> str:
    """The `Sluice-Signature` value a receiver recomputes to check a webhook body."""
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def webhook_body(ask: Ask) -> bytes:
    k = ask.key
    return json.dumps({"id": ask.id, "profile": k.profile or None, "user": k.user or None, "host": k.host,
                       "method": ask.method or None, "path": ask.path or None, "reason": ask.reason,
                       "time": ask.created}, separators=(",", ":")).encode()


class Approvals:
    def __init__(self, audit: Any, source: Any = None) -> None:
        self.audit = audit
        self.source = source  # the policy's `state` says where approvals live
        self.state_dir: str | None = None  # `sluice proxy --state-dir` (SQLite there when there is no state store)
        self.state: StateSettings | None = None
        self.store: Any = None  # an ApprovalStore or a RedisApprovalStore (one interface); `open` or `running` sets it
        self.snapshot = Snapshot()
        self._unavailable: str | None = None  # why the store last failed, until it answers again
        self._unrecorded: dict[str, tuple[Ask, float, ApprovalSettings | None, str | None]] = {}
        self.observer: ApprovalObserver | None = None
        self._refreshed: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._sending: set[asyncio.Task[None]] = set()
        self._wake: asyncio.Event | None = None  # set to refresh before the second is up
        if source is not None:
            source.on_reload(lambda live: self.switch(live.policy.state))

    # ---- where approvals live ----------------------------------------------------------

    def open(self, state: StateSettings | None, state_dir: str | None) -> None:
        """Open where approvals live (start-up; OSError or sqlite3.Error
        when --state-dir cannot keep them)."""
        self.state_dir = state_dir
        self.store, self.state = open_approvals(state, state_dir), state

    def switch(self, state: StateSettings | None) -> None:
        """A reload changed `state`: approvals move to where it says (see the module docstring)."""
        if self.store is None:
            return
        if same_place(state, self.state):
            self.state = state  # the same store: its timeout or on_error may differ
            return
        try:
            store = open_approvals(state, self.state_dir)
        except Exception as e:
            logger.warning(f"approvals: cannot keep them {state.where if state else self.state_dir} ({e}); they "
                           f"stay {self.store.where}")
            return
        old, self.store, self.state = self.store, store, state
        self._unavailable = None
        self._unrecorded.clear()
        self._apply(Snapshot(), [], [])
        where = store.where if store.where.startswith("in ") else f"in {store.where}"
        logger.warning(f"approvals: now {where} (the policy's state changed); grants are read from there")
        old.close()
        self.poke()

    # ---- lifecycle -------------------------------------------------------------------

    def running(self) -> None:
        if self.store is None:
            live = getattr(self.source, "current", None)
            self.open(live.policy.state if live is not None else None, None)
        self._loop = asyncio.get_running_loop()
        self._refreshed = asyncio.Event()
        self._wake = asyncio.Event()
        # Once before the first request (this runs before the ready line):
        # grants kept across a restart apply from the start. One small read.
        now = time.time()
        try:
            self._apply(*self.store.snapshot(now), self.store.claim_events(now))
        except ApprovalsUnavailable as e:
            self._failed(str(e))
        self._task = asyncio.create_task(self._refresh_loop())

    def done(self) -> None:
        for task in (self._task, *self._sending):
            if task is not None:
                task.cancel()

    def poke(self) -> None:
        """Refresh now (thread-safe): this process's admin endpoint just changed the store."""
        if self._loop is not None and self._wake is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    async def _refresh_loop(self) -> None:
        assert self._wake is not None
        while True:
            try:
                await self.refresh()
            except ApprovalsUnavailable as e:
                self._failed(str(e))
            except Exception:
                logger.exception("approvals: the state could not be read; keeping the last snapshot")
            try:
                await asyncio.wait_for(self._wake.wait(), REFRESH_SECONDS)
            except TimeoutError:
                pass
            self._wake.clear()

    async def refresh(self) -> None:
        store = self.store
        assert store is not None
        now = time.time()
        snapshot, expired = await asyncio.to_thread(store.snapshot, now)
        events = await asyncio.to_thread(store.claim_events, now)
        if store is not self.store:
            return  # switched meanwhile: this read is the old place's
        if self._unavailable is not None:
            self._unavailable = None
            logger.warning(f"approvals: {store.where.removeprefix('in ')} answers again; grants are read from it "
                           "again")
        self._apply(snapshot, expired, events)
        for ask, grant_for, settings, client in list(self._unrecorded.values()):
            del self._unrecorded[ask.id]
            await self._record(store, ask, grant_for, settings, client)

    def _failed(self, why: str) -> None:
        """The store did not answer: said once, until it does again."""
        if self._unavailable is None:
            logger.warning(f"approvals: {why}; the gate keeps the grants and denials as last read (they still "
                           "expire on time), and new asks are answered approval_pending and recorded once it is back")
        self._unavailable = why

    def _apply(self, snapshot: Snapshot, expired: list[Grant], events: list[dict[str, Any]]) -> None:
        for grant in expired:
            self.audit.write(event="grant_expired", id=grant.id, profile=grant.profile or None,
                             user=grant.user or None, host=grant.host, method=grant.method, path=grant.path,
                             decision="refuse" if grant.denied else "allow",
                             detail=f"the {'denial' if grant.denied else 'grant'} ({grant.scope} scope) expired")
        for record in events:
            self.audit.write(**record)
        self.snapshot = snapshot
        if self.observer is not None:
            self.observer.counts(len(snapshot.pending), sum(1 for g in snapshot.grants if not g.denied))
        if self._refreshed is not None:
            self._refreshed.set()
            self._refreshed = asyncio.Event()

    # ---- the gate's side ---------------------------------------------------------------

    def view(self, user: str | None) -> ApprovalView:
        return ApprovalView(self.snapshot.grants, user, time.time())

    async def judged(self, admission: Admission, settings: ApprovalSettings | None, client: str | None) -> None:
        """After admit(): count the judgement; record a new ask (once), audit
        it and notify."""
        judged = admission.approval
        if judged is None:
            return
        if self.observer is not None:
            self.observer.judged(judged.verdict.value if judged.verdict is not Verdict.ASK else "pending")
        if judged.verdict is not Verdict.ASK or judged.ask.id in self.snapshot.pending or self.store is None:
            return
        ask = judged.ask
        self.snapshot = replace(self.snapshot, pending=self.snapshot.pending | {ask.id})
        grant_for = settings.grant_for if settings is not None else DEFAULT_GRANT_FOR
        if self.state is not None and self._unavailable is not None:
            # Known down: no thread tied up waiting on it; the refresh that reaches it records the ask.
            if len(self._unrecorded) < UNRECORDED_MAX:
                self._unrecorded[ask.id] = (ask, grant_for, settings, client)
            return
        recording = asyncio.ensure_future(self._record(self.store, ask, grant_for, settings, client))
        if self.state is None:
            await recording  # SQLite on this machine: recorded before the answer
            return
        # A shared store: the answer waits at most the store's timeout (the ask's id needs no store).
        self._sending.add(recording)
        recording.add_done_callback(self._sending.discard)
        await asyncio.wait({recording}, timeout=self.state.timeout)

    async def _record(self, store: Any, ask: Ask, grant_for: float, settings: ApprovalSettings | None,
                      client: str | None) -> None:
        """Record a new ask; the process whose record made it audits it and notifies."""
        try:
            if not await asyncio.to_thread(store.record_ask, ask, grant_for):
                return
        except ApprovalsUnavailable as e:
            if store is self.store and len(self._unrecorded) < UNRECORDED_MAX:
                self._unrecorded[ask.id] = (ask, grant_for, settings, client)
            self._failed(str(e))
            return
        self.audit.write(event="approval_requested", id=ask.id, client=client, profile=ask.key.profile or None,
                         user=ask.key.user or None, method=ask.method or None, host=ask.key.host,
                         path=ask.path or None, decision="refuse", reason=ask.reason,
                         detail=f"{ask.key.host} asked for approval ({'path' if ask.key.path else 'host'} level)")
        if settings is not None and settings.notify is not None:
            task = asyncio.create_task(self._notify(settings.notify, ask))
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)

    async def wait_for_answer(self, judged: Judgement, seconds: float) -> bool:
        """Hold until the ask is answered (it leaves the pending set) or
        `seconds` pass; True if answered."""
        deadline = time.monotonic() + seconds
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self._refreshed is None:
                return False
            try:
                await asyncio.wait_for(self._refreshed.wait(), remaining)
            except TimeoutError:
                return False
            if judged.ask.id not in self.snapshot.pending:
                return True

    # ---- the webhook -------------------------------------------------------------------

    async def _notify(self, notify: Notify, ask: Ask) -> None:
        import httpx

        body = webhook_body(ask)
        proxy = self._proxy_url()
        if proxy is None:
            logger.warning(f"approvals: no HTTP proxy listener to send the webhook for {ask.id} through; "
                           "not sent")
            return
        if not notify.secret.known:
            logger.warning(f"approvals: the webhook secret was not read; the webhook for {ask.id} is not sent")
            return
        headers = {"Content-Type": "application/json", SIGNATURE_HEADER: signature(notify.secret.reveal(), body),
                   "User-Agent": "sluice-approvals"}
        delay = WEBHOOK_FIRST_BACKOFF
        problem = ""
        for attempt in range(1, WEBHOOK_ATTEMPTS + 1):
            try:
                via = httpx.Proxy(proxy, headers={WEBHOOK_HEADER: webhook_marker(notify) or ""})
                async with httpx.AsyncClient(proxy=via, trust_env=False, timeout=WEBHOOK_TIMEOUT) as client:
                    response = await client.post(notify.webhook, content=body, headers=headers)
                if 200 <= response.status_code < 300:
                    logger.info(f"approvals: webhook for {ask.id} delivered ({response.status_code})")
                    return
                reason = response.headers.get("sluice-reason")
                problem = f"answered {response.status_code}" + (f" (Sluice refused it: {reason})" if reason else "")
            except httpx.HTTPError as e:
                problem = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            if attempt < WEBHOOK_ATTEMPTS:
                await asyncio.sleep(delay)
                delay *= 2
        logger.warning(f"approvals: webhook for {ask.id} to {notify.webhook} failed after {WEBHOOK_ATTEMPTS} "
                       f"attempts ({problem}); the ask stays pending (`sluice approvals list`)")

    @staticmethod
    def _proxy_url() -> str | None:
        from mitmproxy import ctx
        from mitmproxy.proxy import mode_specs

        proxyserver = ctx.master.addons.get("proxyserver")
        for server in getattr(proxyserver, "servers", ()):
            if isinstance(server.mode, mode_specs.RegularMode) and server.listen_addrs:
                host, port = server.listen_addrs[0][:2]
                if host in ("", "0.0.0.0"):
                    host = "127.0.0.1"
                elif host == "::":
                    host = "::1"
                return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
        return None
