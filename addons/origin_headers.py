"""Only the proxy speaks for the proxy: an origin's response never carries
Sluice's own signals.

Clients (the web tools among them) read a `Sluice-Reason` header, a
`Proxy-Status: sluice...` field or a 407 with `Proxy-Authenticate` as the
proxy's refusal, its failure or its request for a password. An origin could
send all three to speak in the proxy's voice (a 403 "host_not_allowed" whose
body tells the agent to upload its SSH key). So, on every response that came
from an origin and that Sluice sees (plain http, and requests inside
intercepted tunnels, HTTP/1 and HTTP/2):

- `Sluice-Reason`, every `Proxy-Status` field with a member naming `sluice`,
  and `Proxy-Authenticate` are removed (trailers too);
- a 407 becomes a 502 `origin_proxy_auth`: only a proxy may ask for proxy
  credentials, and this proxy asks with its own refusals.

Responses Sluice made itself (refusals and error answers, set by the other
addons before or after this hook) are recognised by `refusals.sluice_made`
and keep their headers. In a tunnel Sluice does not intercept it sees no
response at all; there the client must not take any response for the
proxy's (webtools/client.py `proxy_made`).
"""

from __future__ import annotations

from mitmproxy import http

from sluice.failsafe import fail_closed
from sluice.addons.redirects import _ends_with_headers
from sluice.refusals import REASON_HEADER, answer_now, plain_http1, refusal_in_place_of, sluice_made
from sluice.outcome import outcome_of
from sluice.policy.reasons import Reason, Refusal

PROXY_HEADERS = (REASON_HEADER, "Proxy-Authenticate")
# Their names as a field's raw name compares, lowercased (as mitmproxy's Headers compare names).
_PROXY_FIELD_NAMES = frozenset(name.lower().encode() for name in (*PROXY_HEADERS, "Proxy-Status"))


def strip_proxy_headers(headers: http.Headers) -> bool:
    """Remove the proxy's own header fields from an origin's headers (in
    place); True when there was one."""
    # One pass over the raw fields first: almost no response has any of them,
    # and each lookup by name below walks every field again.
    if not any(name.lower() in _PROXY_FIELD_NAMES for name, _ in headers.fields):
        return False
    found = False
    for name in PROXY_HEADERS:
        if name in headers:
            del headers[name]
            found = True
    fields = headers.get_all("Proxy-Status")
    if fields:
        kept = [f for f in fields if not any(_names_sluice(m) for m in f.split(","))]
        if len(kept) != len(fields):
            headers.set_all("Proxy-Status", kept)
            found = True
    return found


def _names_sluice(member: str) -> bool:
    return member.split(";", 1)[0].strip().strip('"').lower().startswith("sluice")


class OriginHeaders:
    @fail_closed(response_phase=True)
    def responseheaders(self, flow: http.HTTPFlow) -> None:
        response = flow.response
        if response is None or sluice_made(response):
            return
        strip_proxy_headers(response.headers)
        if response.status_code != 407:
            return
        outcome = outcome_of(flow)
        if outcome is not None and outcome.cap is not None:
            return  # already cut by a cap: that refusal stands
        refusal = Refusal(Reason.ORIGIN_PROXY_AUTH, f"the origin {flow.request.host} answered 407 Proxy Authentication "
                          "Required, which only a proxy may send; this proxy's own refusals say when it wants "
                          "credentials, so the origin's answer was dropped",
                          advice="The origin, not the egress policy, failed: this page cannot be fetched as it is.")
        if outcome is not None:
            outcome.cut(refusal)
        if plain_http1(flow) and not _ends_with_headers(flow):
            answer_now(flow, refusal)  # written to the client now; the origin's body is never read
            return
        # Replaced inside mitmproxy; the redirect guard's `response` hook puts
        # the refusal body in when the origin's response ended with its headers.
        flow.response = refusal_in_place_of(flow, refusal)

    @fail_closed()
    def response(self, flow: http.HTTPFlow) -> None:
        response = flow.response
        if response is not None and response.trailers and not sluice_made(response):
            strip_proxy_headers(response.trailers)
