"""How a refusal looks on the wire: status, `Sluice-Reason`, RFC 9209
`Proxy-Status`, and the one-sentence body. Used for every refusal."""

from __future__ import annotations

import weakref

from mitmproxy import http
from mitmproxy.net.http import status_codes

from sluice.addons import connections
from sluice.outcome import outcome_of
from sluice.policy.reasons import REASONS, Reason, Refusal

REASON_HEADER = "Sluice-Reason"

# Every response Sluice itself makes (refusals, error answers). Only these may
# carry Sluice-Reason, `Proxy-Status: sluice` or Proxy-Authenticate: the
# origin-headers addon strips them from every other (an origin's) response.
_SLUICE_MADE: weakref.WeakSet[http.Response] = weakref.WeakSet()


def sluice_made(response: http.Response) -> bool:
    return response in _SLUICE_MADE

_PROXY_STATUS_ERRORS = {
    Reason.DNS_FAILED: "dns_error",
    Reason.CONNECT_TIMEOUT: "connection_timeout",
    Reason.REQUEST_TIMEOUT: "http_response_timeout",
    Reason.RESPONSE_TOO_LARGE: "http_response_body_size",
    Reason.REQUEST_TOO_LARGE: "http_request_error",
    Reason.CLIENT_UNKNOWN: "http_request_denied",
    # The request itself is at fault, not the destination.
    Reason.BAD_REQUEST: "http_request_error",
    Reason.NOT_HTTP: "http_request_error",
    Reason.CLIENT_PROTOCOL_REFUSED: "http_request_error",
    Reason.SCHEME_NOT_ALLOWED: "http_request_error",
    Reason.PROXY_LOOP: "proxy_loop_detected",
    # The next hop (the policy's parent proxy) was down, slow or refused the CONNECT: whichever, it is
    # unavailable for this request; `proxy_internal_error` would blame Sluice.
    Reason.UPSTREAM_PROXY_FAILED: "destination_unavailable",
    # Throttles and limits: refused by configuration and never forwarded, not a fault of the proxy.
    Reason.RATE_LIMITED: "http_request_denied",
    Reason.HOST_RATE_LIMITED: "http_request_denied",
    Reason.QUOTA_EXCEEDED: "http_request_denied",
    Reason.TOO_MANY_CONNECTIONS: "http_request_denied",
    Reason.TOO_MANY_TUNNELS: "http_request_denied",
    Reason.AUTH_THROTTLED: "http_request_denied",
    Reason.HEADERS_TOO_LARGE: "http_request_error",
}


def refusal_headers(refusal: Refusal) -> dict[str, str]:
    error = _PROXY_STATUS_ERRORS.get(
        refusal.reason, "destination_ip_prohibited" if REASONS[refusal.reason].status == 403 else "proxy_internal_error"
    )
    headers = {
        "Content-Type": "text/plain; charset=utf-8",
        REASON_HEADER: refusal.reason.value,
        "Proxy-Status": f'sluice; error={error}; details="{refusal.reason.value}"',
        "Cache-Control": "no-store",
    }
    if refusal.reason in (Reason.CLIENT_UNKNOWN, Reason.AUTH_THROTTLED):
        headers["Proxy-Authenticate"] = 'Basic realm="sluice"'
    if refusal.retry_after is not None:
        headers["Retry-After"] = str(refusal.retry_after)
    return headers


def refusal_body(refusal: Refusal) -> bytes:
    # backslashreplace: a detail quoting client bytes (a lone surrogate from a
    # non-UTF-8 method, say) must never make the refusal itself fail.
    return (refusal.message + "\n").encode("utf-8", "backslashreplace")


def refusal_phrase(refusal: Refusal) -> str:
    """The HTTP/1 reason phrase of a refusal: `Sluice <code>`, e.g.
    `HTTP/1.1 403 Sluice address_not_public`. A client that sees only the
    status line (a refused CONNECT: httpx/httpcore, curl and most libraries
    drop its headers and body) still learns the reason code from it."""
    return f"Sluice {refusal.reason.value}"


def refusal_response(refusal: Refusal) -> http.Response:
    response = http.Response.make(refusal.status, refusal_body(refusal), refusal_headers(refusal))
    response.reason = refusal_phrase(refusal)
    _SLUICE_MADE.add(response)
    return response


def refusal_bytes(refusal: Refusal) -> bytes:
    """The whole refusal as raw HTTP/1 (Connection: close): for a client
    that gets it in place of one of mitmproxy's own error pages, or straight
    on its socket."""
    return connections.http1_response_bytes(
        refusal.status, refusal_phrase(refusal), refusal_headers(refusal), refusal_body(refusal)
    )


def error_response(status: int, message: str) -> http.Response:
    """A failure that is not a refusal (the origin could not be reached or
    answered badly), in place of mitmproxy's own answer: plain text, no
    `Sluice-Reason` (no rule refused anything)."""
    phrase = status_codes.RESPONSES.get(status, "")
    text = "".join(c if " " <= c <= "~" else "?" for c in message)[:300].strip().rstrip(". ")
    body = f"Sluice could not complete this request ({status} {phrase}): {text or 'no details'}.\n".encode()
    headers = {"Content-Type": "text/plain; charset=utf-8", "Proxy-Status": "sluice", "Cache-Control": "no-store"}
    response = http.Response.make(status, body, headers)
    _SLUICE_MADE.add(response)
    return response


def error_bytes(status: int, message: str) -> bytes:
    """error_response as raw HTTP/1 (Connection: close), in place of one of
    mitmproxy's HTML error pages."""
    response = error_response(status, message)
    headers = {k: v for k, v in response.headers.items() if k.lower() != "content-length"}
    return connections.http1_response_bytes(status, response.reason, headers, response.raw_content)


def answer_now(f: http.HTTPFlow, refusal: Refusal) -> None:
    """Refuse an exchange whose response mitmproxy has not started sending,
    without waiting for (or buffering) a body.

    - A plain-text HTTP/1 client: the refusal is written straight to its
      socket and the connection closed.
    - A client only mitmproxy's layers can write to (TLS inside an
      intercepted tunnel, HTTP/2): the refusal becomes the flow's response.
      Before the request body, mitmproxy then sends it once the client's body
      has arrived (which mitmproxy drops, never buffers: mitm_patches
      `refused_body_discard`); after the origin's response headers, it
      replaces that response and the origin's body is dropped as it streams.

    The refusal ends with the operator's sentence for the flow's client."""
    refusal = noted(f, refusal)
    if plain_http1(f):
        connections.write_to_client(f.client_conn, refusal_bytes(refusal))
        if f.killable:
            f.kill()
        return
    if f.response is None:
        f.response = refusal_response(refusal)
        if not f.request.is_http2 and not f.request.is_http3:
            f.response.headers["Connection"] = "close"
    else:
        f.response = refusal_in_place_of(f, refusal)


def noted(flow: http.HTTPFlow, refusal: Refusal) -> Refusal:
    """The refusal with the `refusal_note` of the rules the flow's client was
    matched to (a refused client's refusal already carries the top level's)."""
    outcome = outcome_of(flow)
    rules = outcome.rules if outcome is not None else None
    return refusal.with_note(rules.refusal_note) if rules is not None else refusal


def plain_http1(flow: http.HTTPFlow) -> bool:
    """The client speaks HTTP/1 straight on its socket (no TLS that only
    mitmproxy's layers can write), so bytes can be written to it directly."""
    return not (flow.client_conn.tls or flow.request.is_http2 or flow.request.is_http3)


def refusal_in_place_of(flow: http.HTTPFlow, refusal: Refusal) -> http.Response:
    """A fresh response (the origin's object stays with mitmproxy's HTTP/1
    client, which still frames and reuses the upstream connection by it)."""
    response = refusal_response(noted(flow, refusal))  # Content-Length: the body's length
    response.timestamp_start = flow.response.timestamp_start
    response.stream = RefusalBody(b"" if flow.request.method.upper() == "HEAD" else response.raw_content)
    return response


class RefusalBody:
    """Stream callable: the whole refusal body on the first call (origin data
    or the origin's end of body), nothing after it; origin bytes are dropped."""

    __slots__ = ("body", "sent")

    def __init__(self, body: bytes) -> None:
        self.body = body
        self.sent = False

    def __call__(self, chunk: bytes) -> bytes | list[bytes]:
        if self.sent:
            return []  # b"" would be a zero-length chunk: an end of body
        self.sent = True
        return self.body if self.body else []
