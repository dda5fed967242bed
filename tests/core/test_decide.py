"""The decision functions over plain data: ports, schemes, private networks,
DNS answers (mixed, CNAME to internal), report mode."""

from sluice.policy.decide import Destination, check_address, check_answers, check_request
from sluice.policy.loader import load_policy_text
from sluice.policy.model import Rules

RULES = Rules()


def rules(text: str) -> Rules:
    return load_policy_text("version: 1\n" + text).rules


def pending(r: Rules, host="public.example", port=80, method="GET"):
    d = check_request(r, Destination(host, port, "http", method))
    assert d.allowed and d.needs_dns
    return d


def test_public_name_resolving_public_is_allowed_and_pinned_to_one_answer():
    d = check_answers(RULES, pending(RULES), ["2606:4700:4700::1111", "8.8.8.8", "1.1.1.1"])
    assert d.allowed and d.address == "8.8.8.8"
    assert d.addresses == ("2606:4700:4700::1111", "8.8.8.8", "1.1.1.1")


def test_one_non_public_answer_refuses_the_name():
    d = check_answers(RULES, pending(RULES), ["8.8.8.8", "10.0.0.1"])
    assert not d.allowed and d.refusal.reason == "dns_answer_not_public"
    assert "10.0.0.1" in d.refusal.detail


def test_aaaa_only_internal_is_refused():
    d = check_answers(RULES, pending(RULES), ["fd00:ec2::254"])
    assert not d.allowed and d.refusal.reason == "dns_answer_not_public"


def test_cname_to_internal_name_is_refused_even_with_public_answers():
    d = check_answers(RULES, pending(RULES), ["8.8.8.8"], cnames=["metadata.google.internal"])
    assert not d.allowed and d.refusal.reason == "dns_answer_not_public"


def test_no_answers_fails_closed():
    d = check_answers(RULES, pending(RULES), [])
    assert not d.allowed and d.refusal.reason == "dns_failed" and d.refusal.status == 502


def test_ports_schemes_credentials():
    assert check_request(RULES, Destination("public.example", 8080, "http", "GET")).refusal.reason == "port_not_allowed"
    assert check_request(RULES, Destination("public.example", 21, "ftp", "GET")).refusal.reason == "scheme_not_allowed"
    assert check_request(RULES, Destination("public.example", 80, "http", "GET",
                                            has_credentials=True)).refusal.reason == "url_credentials"
    assert check_request(RULES, Destination("public.example", 0, "http", "GET")).refusal.reason == "port_not_allowed"


def test_private_networks_open_exactly_what_they_name():
    r = rules('private_networks: ["10.0.0.5/32:8080", "192.168.1.0/24"]\n')
    assert check_request(r, Destination("10.0.0.5", 8080, "http", "GET")).allowed
    assert check_request(r, Destination("10.0.0.5", 80, "http", "GET")).refusal.reason == "address_not_public"
    assert check_request(r, Destination("10.0.0.6", 8080, "http", "GET")).refusal.reason == "address_not_public"
    assert check_request(r, Destination("192.168.1.7", 443, "https", "GET")).allowed
    assert check_request(r, Destination("192.168.1.7", 8443, "https", "GET")).refusal.reason == "port_not_allowed"
    # a public address on the sidecar's port is still not on an allowed port
    assert check_request(r, Destination("8.8.8.8", 8080, "http", "GET")).refusal.reason == "port_not_allowed"
    assert check_address(r, "10.0.0.5", 8080) is None
    assert check_address(r, "127.0.0.1", 80).reason == "address_not_public"


def test_internal_name_only_with_an_exact_allow_entry_and_opened_address():
    r = rules('allow: [searxng, "**.example.org"]\nprivate_networks: ["10.0.0.5/32:8080"]\n')
    p = check_request(r, Destination("searxng", 8080, "http", "GET"))
    assert p.needs_dns
    assert check_answers(r, p, ["10.0.0.5"]).allowed
    assert check_answers(r, p, ["10.0.0.6"]).refusal.reason == "dns_answer_not_public"
    assert check_request(r, Destination("other", 8080, "http", "GET")).refusal.reason == "internal_hostname"


def test_allow_deny_and_report_mode():
    # (an allow CIDR nothing opens would be a load error: private_networks opens half of it)
    r = rules('allow: ["**.example.org", "203.0.113.0/24"]\ndeny: [bad.example.org]\nprivate_networks: '
              '["203.0.113.128/25"]\n')
    assert check_request(r, Destination("www.example.org", 443, "https", "GET")).needs_dns
    assert check_request(r, Destination("bad.example.org", 443, "https", "GET")).refusal.reason == "host_denied"
    # with CIDRs on the allow list, a name off it is decided by its answers
    p = check_request(r, Destination("example.com", 443, "https", "GET"))
    assert p.needs_dns
    assert check_answers(r, p, ["8.8.8.8"]).refusal.reason == "host_not_allowed"
    assert check_answers(r, p, ["203.0.113.9"]).refusal.reason == "dns_answer_not_public"  # TEST-NET stays refused
    names_only = rules('allow: ["**.example.org"]\n')
    assert check_request(names_only,
                         Destination("example.com", 443, "https", "GET")).refusal.reason == "host_not_allowed"
    report = rules('action: report\nallow: ["**.example.org"]\nmethods: [GET]\n')
    d = check_request(report, Destination("example.com", 443, "https", "POST"))
    assert d.allowed and d.needs_dns and d.would_refuse.reason in ("method_not_allowed", "host_not_allowed")
    d2 = check_answers(report, d, ["8.8.8.8"])
    assert d2.allowed and d2.would_refuse is not None
    # report mode never relaxes the address rules
    d3 = check_request(report, Destination("169.254.169.254", 80, "http", "GET"))
    assert not d3.allowed and d3.refusal.reason == "address_not_public"
    assert not check_answers(report, d, ["10.0.0.1"]).allowed


def test_refusal_message_is_one_actionable_sentence():
    d = check_request(RULES, Destination("169.254.169.254", 80, "http", "GET"))
    assert d.refusal.status == 403
    assert "link-local (cloud metadata)" in d.refusal.message
    assert "egress policy" in d.refusal.message and "do not retry" in d.refusal.message
