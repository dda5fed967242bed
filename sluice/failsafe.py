"""Fail closed: an exception inside a deciding hook refuses the exchange.

mitmproxy logs an exception raised by an addon and carries on with the flow,
so a bug in a check would let the request through unchecked. Every hook that
decides or enforces is wrapped here instead: the exception is logged with its
traceback and the exchange is refused with `internal_error`.
"""

from __future__ import annotations

import functools
import inspect
import logging

from mitmproxy import http
from mitmproxy.proxy.server_hooks import ServerConnectionHookData

from sluice import open_files
from sluice.refusals import answer_now, refusal_response
from sluice.outcome import META, Outcome, outcome_of
from sluice.policy.decide import Decision
from sluice.policy.reasons import Reason, Refusal

logger = logging.getLogger("sluice")

INTERNAL = Refusal(Reason.INTERNAL_ERROR, "Sluice failed while checking this request, so it refuses it")


def _refuse(target, response_started: bool) -> None:
    if isinstance(target, ServerConnectionHookData):
        target.server.error = f"{INTERNAL.reason.value}: {INTERNAL.message}"
        return
    if isinstance(target, http.HTTPFlow):
        outcome = outcome_of(target)
        if outcome is None:
            target.metadata[META] = Outcome(target.request.host, target.request.port,
                                            Decision(False, None, INTERNAL), None, None)
        else:
            outcome.fail(INTERNAL)
        if response_started:
            answer_now(target, INTERNAL)  # headers not sent yet, but a body may be on its way
        else:
            target.response = refusal_response(INTERNAL)
        return
    # Anything else (a tunnel, a client): end it.
    kill = getattr(target, "kill", None)
    if callable(kill):
        kill()


def _log_failure(addon, hook, error: Exception) -> None:
    if open_files.is_out_of_files(error):
        # Out of file descriptors (a DNS socket, say): no bug, the one line.
        open_files.report(f"running {type(addon).__name__}.{hook.__name__}", error)
        return
    logger.error(f"sluice: {type(addon).__name__}.{hook.__name__} failed; refusing", exc_info=error)


def fail_closed(*, response_phase: bool = False):
    """Decorate a hook (sync or async) of a deciding addon."""

    def wrap(hook):
        if inspect.iscoroutinefunction(hook):
            @functools.wraps(hook)
            async def guarded(self, target):
                try:
                    return await hook(self, target)
                except Exception as e:
                    _log_failure(self, hook, e)
                    _refuse(target, response_phase)
        else:
            @functools.wraps(hook)
            def guarded(self, target):
                try:
                    return hook(self, target)
                except Exception as e:
                    _log_failure(self, hook, e)
                    _refuse(target, response_phase)
        return guarded

    return wrap
