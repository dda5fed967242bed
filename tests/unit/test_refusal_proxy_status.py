"""The RFC 9209 error type each refusal's `Proxy-Status` names: `proxy_internal_error` says the proxy
itself broke, so it is kept for failures that are Sluice's own, never for a refusal by configuration
or a failing next hop."""

from __future__ import annotations

import pytest

from sluice.policy.reasons import Reason, Refusal
from sluice.refusals import refusal_headers


def error_type(reason: Reason) -> str:
    field = refusal_headers(Refusal(reason, "detail"))["Proxy-Status"]
    members = dict(part.strip().partition("=")[::2] for part in field.split(";")[1:])
    assert field.startswith("sluice;") and members["details"] == f'"{reason.value}"', field
    return members["error"]


def test_a_failing_parent_proxy_is_the_next_hop_unavailable():
    assert error_type(Reason.UPSTREAM_PROXY_FAILED) == "destination_unavailable"


@pytest.mark.parametrize("reason", [Reason.RATE_LIMITED, Reason.HOST_RATE_LIMITED, Reason.QUOTA_EXCEEDED,
                                    Reason.TOO_MANY_CONNECTIONS, Reason.TOO_MANY_TUNNELS, Reason.AUTH_THROTTLED])
def test_throttles_and_limits_are_requests_denied_by_configuration(reason):
    assert error_type(reason) == "http_request_denied"


def test_an_oversized_request_head_is_a_request_error():
    assert error_type(Reason.HEADERS_TOO_LARGE) == "http_request_error"


# RFC 9209 section 2.3's error types: every refusal names one of them.
RFC_9209_TYPES = {
    "dns_timeout", "dns_error", "destination_not_found", "destination_unavailable", "destination_ip_prohibited",
    "destination_ip_unroutable", "connection_refused", "connection_terminated", "connection_timeout",
    "connection_read_timeout", "connection_write_timeout", "connection_limit_reached", "tls_protocol_error",
    "tls_certificate_error", "tls_alert_received", "http_request_error", "http_request_denied",
    "http_response_incomplete", "http_response_header_section_size", "http_response_header_size",
    "http_response_body_size", "http_response_trailer_section_size", "http_response_trailer_size",
    "http_response_transfer_coding", "http_response_content_coding", "http_response_timeout",
    "http_upgrade_failed", "http_protocol_error", "proxy_internal_response", "proxy_internal_error",
    "proxy_configuration_error", "proxy_loop_detected",
}


@pytest.mark.parametrize("reason", list(Reason))
def test_every_refusal_names_a_registered_error_type(reason):
    assert error_type(reason) in RFC_9209_TYPES
