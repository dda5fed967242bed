"""Redirect revalidation: a 3xx whose Location the policy refuses becomes a
403 `redirect_refused` naming the target and why. The proxy never follows
redirects itself; the next hop is checked again when it arrives anyway."""

from __future__ import annotations

from mitmproxy import http

from addons.failsafe import fail_closed
from addons.policy_source import PolicySource
from addons.refusals import refusal_body, refusal_headers
from addons.resolver import decide
from addons.verdict import verdict_of
from policy.decide import Destination
from policy.reasons import Reason, Refusal
from policy.urls import resolve_redirect

METHOD_KEEPING = frozenset({307, 308})


class RedirectGuard:
    def __init__(self, source: PolicySource) -> None:
        self.source = source

    @fail_closed(response_phase=True)
    async def responseheaders(self, flow: http.HTTPFlow) -> None:
        verdict = verdict_of(flow)
        response = flow.response
        if verdict is None or verdict.rules is None or verdict.cap is not None or not verdict.decision.allowed:
            return
        if not (300 <= response.status_code < 400) or "location" not in response.headers:
            return
        location = response.headers["location"]
        host = verdict.host if ":" not in verdict.host or verdict.host.startswith("[") else f"[{verdict.host}]"
        base = f"{flow.request.scheme}://{host}:{verdict.port}{flow.request.path}"
        try:
            target = resolve_redirect(base, location)
        except ValueError as e:
            refusal = Refusal(Reason.REDIRECT_REFUSED, f"the response redirects to {location!r}, which is not a valid URL ({e})")
        else:
            method = flow.request.method if response.status_code in METHOD_KEEPING else "GET"
            dest = Destination(target.host, target.port, target.scheme, method, target.has_credentials)
            decision = await decide(verdict.rules, dest, self.source.current.resolver)
            if decision.allowed:
                return
            refusal = Refusal(
                Reason.REDIRECT_REFUSED,
                f"the response redirects to {target.url}, which this policy refuses ({decision.refusal.reason.value}: {decision.refusal.detail})",
            )
        verdict.cap = refusal
        _replace(response, refusal)


def _replace(response: http.Response, refusal: Refusal) -> None:
    """Turn the origin's response into the refusal before its headers go out;
    the origin's body is read and dropped so the connection stays usable."""
    body = refusal_body(refusal)
    response.status_code = refusal.status
    response.reason = "Forbidden"
    response.headers = http.Headers([(k.encode(), v.encode()) for k, v in refusal_headers(refusal).items()])
    response.headers["Content-Length"] = str(len(body))
    response.stream = _DropThenSend(body)


class _DropThenSend:
    __slots__ = ("body",)

    def __init__(self, body: bytes) -> None:
        self.body = body

    def __call__(self, chunk: bytes) -> bytes | list[bytes]:
        # [] sends nothing (b"" would be a zero-length chunk: an end of body).
        return self.body if chunk == b"" else []
