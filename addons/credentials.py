"""Proxy-held credentials: the proxy sets the policy's `credentials` headers
on requests it really sees and checks, so the agent holds no key.

Runs right after the gate (addons/sluice_addon.py), in `requestheaders`, so
after the gate's `strip_request_headers`, and only on requests the gate
allowed:

- plain http:// requests on the front door, and requests inside intercepted
  tunnels (TLS or plaintext). A raw tunnel is never touched (the proxy does
  not see its requests; the loader refuses a credentials host that is not
  intercepted).
- The entry is chosen with the host the gate decided on (the tunnel's host
  inside a tunnel, whose Host, SNI and `:authority` must name it, else the
  gate already refused `host_mismatch`; the request's own host on the front
  door, whose Host header the gate made agree), per request: a redirect's
  next hop, a later request on a keep-alive connection, a tunnel to another
  host are each matched on their own host.
- The header replaces whatever the client sent in it. A plain http request
  to a host whose entry lacks `allow_plain_http` is refused
  (`credential_plain_http`), never sent.
- The audit line's `credential` field names the entry (`file:line`); the
  value goes nowhere but the request.

Values from files are re-read whenever the policy is reloaded (the loader
reads them), and between reloads this addon polls each file (at the policy's
poll interval): a changed file's value is used from the next request; a file
that becomes missing or unusable keeps its last good value, and is reported
like a failed reload (stderr and a `reload` audit line, without the value).
"""

from __future__ import annotations

import asyncio
import logging
import os

from mitmproxy import http

from sluice.addons.audit import CREDENTIAL_META, AuditLog
from sluice.failsafe import fail_closed
from sluice.addons.policy_source import LivePolicy, PolicySource
from sluice.refusals import refusal_response
from sluice.outcome import ADMISSION_META, outcome_of
from sluice.policy.credentials import CredentialHeader, format_value, value_problem
from sluice.policy.loader import MAX_SECRET_BYTES, FileRefused, read_regular_file
from sluice.policy.model import Policy

logger = logging.getLogger("sluice.credentials")


class CredentialInjector:
    def __init__(self, source: PolicySource, audit: AuditLog) -> None:
        self.source = source
        self.audit = audit
        self._generation: int | None = None  # the policy generation the fields below belong to
        self._texts: dict[str, str] = {}  # path -> the file's text, re-read since that policy was loaded
        self._signatures: dict[str, tuple | None] = {}  # path -> what the file looked like when last read
        self._failing: set[str] = set()  # paths whose last read failed (reported once)
        self._poller: asyncio.Task | None = None

    # ---- the requests --------------------------------------------------

    @fail_closed()
    def requestheaders(self, flow: http.HTTPFlow) -> None:
        if flow.response is not None or flow.request.method == "CONNECT":
            return
        outcome = outcome_of(flow)
        if outcome is None or outcome.rules is None or not outcome.decision.allowed or outcome.cap is not None:
            return
        admission = flow.metadata.get(ADMISSION_META)  # the gate chose the entry (sluice.admission)
        if admission is None:
            return
        if admission.credential_refusal is not None:
            outcome.cut(admission.credential_refusal)
            flow.response = refusal_response(outcome.cap)
            return
        entry = admission.credential
        if entry is None:
            return
        live = self.source.current
        for header in entry.headers:
            flow.request.headers[header.name] = self._value(header, live.generation if live else None)
        flow.metadata[CREDENTIAL_META] = entry.origin

    def _value(self, header: CredentialHeader, generation: int | None) -> str:
        """The header's value: the policy's, or its file's text re-read since."""
        if header.path is not None and generation == self._generation and header.path in self._texts:
            return format_value(self._texts[header.path], header.format)
        return header.value.reveal()

    # ---- watching the files --------------------------------------------

    def running(self) -> None:
        if self.source.poll_seconds > 0 and self._poller is None:
            self._poller = asyncio.ensure_future(self._poll())

    def done(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            self._poller = None

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.source.poll_seconds)
            try:
                await self.refresh()
            except asyncio.CancelledError:
                raise
            except Exception:  # the watcher must never die
                logger.exception("credential file watcher error")

    async def refresh(self) -> None:
        """Re-read every credential file that changed since it was last read."""
        live = self.source.current
        if live is None:
            return
        if live.generation != self._generation:
            # A new policy: the loader has just read every file.
            self._generation = live.generation
            self._texts, self._signatures, self._failing = {}, {}, set()
        changed = False
        for path, header in _files(live.policy).items():
            signature = _signature(path)
            if path in self._signatures and signature == self._signatures[path]:
                continue
            outcome = await asyncio.to_thread(_read, path)
            if live is not self.source.current:
                return  # reloaded meanwhile: the next round starts over
            known = path in self._signatures  # else the first read since this policy was loaded
            self._signatures[path] = signature
            if isinstance(outcome, str) and outcome.startswith(_PROBLEM):
                self._report_failure(live, path, outcome[len(_PROBLEM):])
                continue
            was_failing = path in self._failing
            self._failing.discard(path)
            before = self._value(header, live.generation)
            self._texts[path] = outcome
            changed = changed or known or was_failing
            if format_value(outcome, header.format) != before or was_failing:
                logger.warning(f"{path}: credential file re-read; its value is in use from the next request "
                               f"(generation {live.generation})")
                self.audit.write(event="reload", decision="ok", detail=f"credential file {path} re-read")
        if changed:
            # A policy edit refused while a file was missing or unusable can
            # load now: read the policy again (an unchanged one stays as is).
            self.source.request_reload()

    def _report_failure(self, live: LivePolicy, path: str, why: str) -> None:
        if path in self._failing:
            return
        self._failing.add(path)
        logger.error(f"{path}: credential file {why}; keeping its last good value (generation {live.generation})")
        self.audit.write(event="reload", decision="failed",
                         detail=f"credential file {path} {why}; last good value kept")


_PROBLEM = "\0problem:"  # marks a failed read's message (a header value never holds a NUL)


def _files(policy: Policy) -> dict[str, CredentialHeader]:
    """Every credential file of the policy -> one header whose value it holds."""
    out: dict[str, CredentialHeader] = {}
    for rules in (policy.rules, *(p.rules for p in policy.clients)):
        for entry in rules.credentials:
            for header in entry.headers:
                if header.path is not None and header.path not in out and header.value.known:
                    out[header.path] = header
    return out


def _read(path: str) -> str:
    """In a worker thread: the file's text as the loader reads it, or a
    problem (never quoting the file)."""
    try:
        text = read_regular_file(path, MAX_SECRET_BYTES).decode("utf-8").strip("\r\n")
    except FileNotFoundError:
        return _PROBLEM + "is missing"
    except OSError as e:
        return _PROBLEM + f"cannot be read ({e.strerror or type(e).__name__})"
    except FileRefused as e:
        return _PROBLEM + f"cannot be read: {e}"
    except UnicodeDecodeError:
        return _PROBLEM + "is not UTF-8 text"
    wrong = value_problem(text)
    return _PROBLEM + wrong if wrong else text


def _signature(path: str) -> tuple | None:
    try:
        st = os.stat(path)
        return (os.path.realpath(path), st.st_ino, st.st_size, st.st_mtime_ns)
    except OSError:
        return None
