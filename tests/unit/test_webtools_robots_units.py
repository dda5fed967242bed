"""robots.txt's pure parts (issue 25 item 8): RFC 9309 matching for Sluice,
the rule named, freshness, the 5xx verdict, the setting, the cache's bound."""

from __future__ import annotations

import time

import httpx
import pytest

from sluice.webtools import robots
from sluice.webtools.errors import WebError

ROBOTS = b"""User-agent: *
Disallow: /

User-agent: Sluice
Disallow: /private/
Allow: /private/open$
Disallow: /*.secret$
"""


def rules(body: bytes = ROBOTS) -> robots.Rules:
    return robots.Rules(robots.parse(body), time.monotonic() + 60, "https://a.example/robots.txt")


def test_sluice_group_longest_match_and_the_rule_named():
    r = rules()
    assert robots.verdict(r, "https://a.example/") is None  # the Sluice group, not *'s Disallow: /
    assert robots.verdict(r, "https://a.example/private/open") is None  # Allow: the longer match
    e = robots.verdict(r, "https://a.example/private/open/more")
    assert e.code == "web_robots_disallowed" and e.fields["rule"] == "Disallow: /private/", e.fields
    assert "robots.txt (https://a.example/robots.txt) disallows https://a.example/private/open/more" in e.message
    assert robots.verdict(r, "https://a.example/x/y.secret").fields["rule"] == "Disallow: /*.secret$"
    assert robots.verdict(r, "https://a.example/x/y.secret.txt") is None  # $ anchors the end


def test_no_rules_and_server_errors():
    assert robots.verdict(robots.Rules(None, 0, "u"), "https://a.example/x") is None
    e = robots.verdict(robots.Rules(None, 0, "https://a.example/robots.txt", server_error=503), "https://a.example/x")
    assert e.code == "web_robots_disallowed" and e.fields["rule"] == "robots.txt status 503" and "503" in e.message


def test_only_the_first_500_kib_is_parsed():
    body = b"User-agent: Sluice\nDisallow: /early\n" + b"# " + b"x" * (robots.MAX_BYTES) + b"\nDisallow: /late\n"
    r = rules(body)
    assert robots.verdict(r, "https://a.example/early") is not None and robots.verdict(r,
                                                                                       "https://a.example/late") is None


@pytest.mark.parametrize("headers, seconds", [
    ({}, 24 * 3600), ({"cache-control": "max-age=60"}, 60), ({"cache-control": "public, max-age=999999999"}, 24 * 3600),
    ({"cache-control": "no-store"}, 0), ({"expires": "garbage"}, 0),
    ({"date": "Wed, 02 Dec 2026 00:00:00 GMT", "expires": "Wed, 02 Dec 2026 01:00:00 GMT"}, 3600),
])
def test_freshness_is_http_and_at_most_a_day(headers, seconds):
    assert robots.freshness(httpx.Headers(headers)) == seconds


def test_the_setting():
    assert robots.mode({}) == "obey" and robots.mode({"SLUICE_WEB_ROBOTS": "IGNORE"}) == "ignore"
    with pytest.raises(WebError) as e:
        robots.mode({"SLUICE_WEB_ROBOTS": "sometimes"})
    assert e.value.code == "web_bad_argument" and "obey or ignore" in e.value.message


def test_the_cache_is_bounded_and_expires():
    cache = robots.RobotsCache(max_origins=2)
    fresh = robots.Rules(None, time.monotonic() + 60, "u")
    for n in range(3):
        cache.put(("https", f"h{n}", 443), fresh)
    assert cache.get(("https", "h0", 443)) is None and cache.get(("https", "h2", 443)) is fresh
    cache.put(("https", "old", 443), robots.Rules(None, time.monotonic() - 1, "u"))
    assert cache.get(("https", "old", 443)) is None


def test_the_user_agent_names_sluice_and_a_url():
    from sluice.webtools.client import USER_AGENT

    assert USER_AGENT.startswith(robots.PRODUCT_TOKEN + "/") and "(+https://" in USER_AGENT
