"""How a refusal looks on the wire: status, `Sluice-Reason`, RFC 9209
`Proxy-Status`, and the one-sentence body. Used for every refusal."""

from __future__ import annotations

from mitmproxy import http
from mitmproxy.net.http import status_codes

from addons import connections
from policy.reasons import REASONS, Reason, Refusal

REASON_HEADER = "Sluice-Reason"

_PROXY_STATUS_ERRORS = {
    Reason.DNS_FAILED: "dns_error",
    Reason.CONNECT_TIMEOUT: "connection_timeout",
    Reason.REQUEST_TIMEOUT: "http_response_timeout",
    Reason.RESPONSE_TOO_LARGE: "http_response_content_length",
    Reason.REQUEST_TOO_LARGE: "http_request_error",
    Reason.CLIENT_UNKNOWN: "http_request_denied",
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


def refusal_response(refusal: Refusal) -> http.Response:
    return http.Response.make(refusal.status, refusal_body(refusal), refusal_headers(refusal))


def answer_now(f: http.HTTPFlow, refusal: Refusal) -> None:
    """Refuse an exchange whose response mitmproxy has not started sending:
    write the refusal straight to an HTTP/1 client and close the connection
    (an HTTP/2 stream is just killed). Used where setting flow.response is
    too late or would make mitmproxy buffer a body first."""
    if not (f.request.is_http2 or f.request.is_http3):
        raw = connections.http1_response_bytes(
            refusal.status, status_codes.RESPONSES.get(refusal.status, ""), refusal_headers(refusal), refusal_body(refusal)
        )
        connections.write_to_client(f.client_conn, raw)
    if f.killable:
        f.kill()
