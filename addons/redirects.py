"""Redirect revalidation: a 3xx whose Location the policy refuses becomes a
403 `redirect_refused` naming the target and why. The proxy never follows
redirects itself; the next hop is checked again when it arrives anyway.

The refusal always reaches the client whole (its body is exactly its
Content-Length), whatever the origin's body looks like. mitmproxy decides
after `responseheaders` whether a response streams: an origin response that
ends with its headers (Content-Length: 0, HEAD, 204/304, an h2 HEADERS frame
with END_STREAM) is never streamed, so a stream callable alone never runs
for it and the refusal would go out with its Content-Length and no body.
Two ways out, chosen per client:

- A plain-text HTTP/1 client whose origin response may still carry a body:
  the whole refusal is written to the client socket at once (with
  `Connection: close`) and the exchange is killed; the origin's body is
  never read (its connection goes with the client's). Nothing here waits
  for the origin, however slow or large its body.
- Otherwise (an origin response that ended with its headers, or a client
  inside an intercepted TLS tunnel, HTTP/1 or h2, whose socket carries TLS
  that only mitmproxy's layers can write) the refusal replaces the response
  inside mitmproxy: its headers carry the refusal's Content-Length, a
  stream callable sends the whole refusal body on its first call and drops
  every origin byte after it (nothing is buffered), and the `response` hook
  puts the body in when the origin's response ended with its headers (then
  mitmproxy sends headers and body together). The client's connection stays
  usable. A body the origin never finishes cannot hold the client past the
  policy's `request_timeout`: the connection is then closed.

A HEAD request gets the refusal's headers (Content-Length: the length the
GET refusal has) and no body, as HTTP requires.
"""

from __future__ import annotations

import asyncio
import time

from mitmproxy import http
from mitmproxy.net.http.http1 import expected_http_body_size

from sluice.addons import connections
from sluice.failsafe import fail_closed
from sluice.addons.policy_source import PolicySource
from sluice.refusals import RefusalBody, answer_now, plain_http1, refusal_in_place_of
from sluice.resolver import resolve_and_decide
from sluice.outcome import outcome_of
from sluice.policy.decide import Destination
from sluice.policy.reasons import Reason, Refusal
from sluice.policy.urls import resolve_redirect

METHOD_KEEPING = frozenset({307, 308})


class RedirectGuard:
    def __init__(self, source: PolicySource) -> None:
        self.source = source
        self._deadlines: dict[str, asyncio.TimerHandle] = {}  # flow id -> request_timeout for an unfinished refusal

    @fail_closed(response_phase=True)
    async def responseheaders(self, flow: http.HTTPFlow) -> None:
        outcome = outcome_of(flow)
        response = flow.response
        if outcome is None or outcome.rules is None or outcome.cap is not None or not outcome.decision.allowed:
            return
        if not (300 <= response.status_code < 400) or "location" not in response.headers:
            return
        location = response.headers["location"]
        host = outcome.host if ":" not in outcome.host or outcome.host.startswith("[") else f"[{outcome.host}]"
        base = f"{flow.request.scheme}://{host}:{outcome.port}{flow.request.path}"
        try:
            target = resolve_redirect(base, location)
        except ValueError as e:
            refusal = Refusal(Reason.REDIRECT_REFUSED,
                              f"the response redirects to {location!r}, which is not a valid URL ({e})")
        else:
            method = flow.request.method if response.status_code in METHOD_KEEPING else "GET"
            dest = Destination(target.host, target.port, target.scheme, method, target.has_credentials)
            decision = await resolve_and_decide(outcome.rules, dest, self.source.current.resolver)
            if decision.allowed:
                return
            refusal = Refusal(
                Reason.REDIRECT_REFUSED,
                f"the response redirects to {target.url}, which this policy refuses ({decision.refusal.reason.value}: "
                f"{decision.refusal.detail})",
            )
        outcome.cut(refusal)
        if plain_http1(flow) and not _ends_with_headers(flow):
            answer_now(flow, refusal)
            return
        flow.response = refusal_in_place_of(flow, refusal)
        remaining = outcome.started + outcome.limits.request_timeout - time.time()
        self._deadlines[flow.id] = asyncio.get_running_loop().call_later(max(0.0, remaining), self._expired, flow)

    @fail_closed()
    def response(self, flow: http.HTTPFlow) -> None:
        self._forget(flow)
        body = flow.response.stream if flow.response is not None else None
        if not isinstance(body, RefusalBody):
            return
        flow.response.trailers = None  # the origin's trailers are not the refusal's
        if not body.sent:
            # The origin's response ended with its headers, so nothing
            # streamed: mitmproxy sends this content right after this hook.
            body.sent = True
            flow.response.raw_content = body.body

    def error(self, flow: http.HTTPFlow) -> None:
        self._forget(flow)

    def _forget(self, flow: http.HTTPFlow) -> None:
        handle = self._deadlines.pop(flow.id, None)
        if handle is not None:
            handle.cancel()

    def _expired(self, flow: http.HTTPFlow) -> None:
        """The origin's body has not ended within request_timeout: end the
        client connection rather than keep it waiting for the refusal's end."""
        self._deadlines.pop(flow.id, None)
        if flow.live:
            connections.close_client(flow.client_conn)


def _ends_with_headers(flow: http.HTTPFlow) -> bool:
    """mitmproxy's own reading of this HTTP/1 response (the same function
    its HTTP/1 client uses): no body follows its headers."""
    response = flow.response
    if response.is_http2 or response.is_http3:
        return False  # an h2 HEADERS frame may or may not end the stream
    try:
        return expected_http_body_size(flow.request, response) == 0
    except ValueError:
        return False
