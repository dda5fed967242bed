"""Approvals in the proxy (issue 22): the grants snapshot, asks, waits, the
audit records and the webhook. The decision is policy.approvals.judge(),
applied inside admit() (sluice/admission.py) with this addon's snapshot.

- The gate reads grants from an in-memory snapshot (`view`): never SQLite.
  A task refreshes it from the store (sluice/approvals_store.py) at most
  every second, off the event loop, so grants and revocations from another
  process (a worker's sibling, the supervisor's admin endpoint) apply within
  a second; the admin endpoint of this process refreshes it at once.
- A new ask is recorded off the loop; the process whose insert made it
  writes `approval_requested` and sends the webhook. The refresh writes
  `grant_expired` for the grants it deleted and the queued admin events
  (`approval_granted` with who, `approval_denied`, `grant_revoked`).
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
from sluice.approvals_store import ApprovalStore, Snapshot
from sluice.policy.approvals import DEFAULT_GRANT_FOR, ApprovalSettings, Ask, Grant, Judgement, Notify, Verdict

logger = logging.getLogger("sluice.approvals")

REFRESH_SECONDS = 1.0
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
    def __init__(self, audit: Any) -> None:
        self.audit = audit
        self.store: ApprovalStore | None = None  # `sluice proxy` sets it (--state-dir); else in memory at start
        self.snapshot = Snapshot()
        self.observer: ApprovalObserver | None = None
        self._refreshed: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._sending: set[asyncio.Task[None]] = set()
        self._wake: asyncio.Event | None = None  # set to refresh before the second is up

    # ---- lifecycle -------------------------------------------------------------------

    def running(self) -> None:
        if self.store is None:
            self.store = ApprovalStore(None)
        self._loop = asyncio.get_running_loop()
        self._refreshed = asyncio.Event()
        self._wake = asyncio.Event()
        # Once before the first request (this runs before the ready line):
        # grants kept across a restart apply from the start. One small read.
        now = time.time()
        self._apply(*self.store.snapshot(now), self.store.claim_events(now))
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
        self._apply(snapshot, expired, events)

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
        if not await asyncio.to_thread(self.store.record_ask, ask, grant_for):
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
