"""web_search adapters (issue 12): each provider's request and its parsing of
recorded-shape bodies (../shared/reference/search-providers.md), success and
error bodies, through a fake client (no network). Through a real proxy with
mock providers: tests/integration/test_search.py."""

from __future__ import annotations

import json
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest

from sluice.webtools.client import Fetched, WebToolLimits
from sluice.webtools.errors import WebError
from sluice.webtools.search import parse_duckduckgo, search

KEY = "sk-SECRET-0123456789"


class FakeClient:
    """Answers every request with one canned response (or raises a WebError)."""

    def __init__(self, env, status=200, body=b"", headers=None, raises=None):
        self.env, self.limits = env, WebToolLimits()
        self.status, self.body, self.headers, self.raises = status, body, headers or {}, raises
        self.calls = []

    def request(self, url, *, classify, headers=None, credentials=None, check=True, method="GET", content=None):
        self.calls.append({"url": url, "headers": headers or {}, "credentials": credentials, "check": check,
                           "method": method, "content": content})
        if self.raises:
            raise self.raises
        body = self.body if isinstance(self.body, bytes) else json.dumps(self.body).encode()
        h = httpx.Headers(self.headers)
        f = Fetched(url, url, self.status, h.get("content-type", "application/json"), "application/json", None, h)
        assert classify(f).cap >= len(body)
        f.body = body
        return f


def run(env, status=200, body=b"", headers=None, provider=None, count=10, query="tide tables", raises=None):
    client = FakeClient(env, status, body, headers, raises)
    return search(query, count=count, provider=provider, client=client), client


def code(r):
    return r.get("error", {}).get("code")


# ------------------------------------------------------------------ Serper

SERPER_OK = {"searchParameters": {"q": "tide tables", "type": "search", "engine": "google"},
             "organic": [{"title": "Tide <b>Tables</b> &amp; Charts", "link": "https://tides.example/", "position": 1,
                          "snippet": "Tide times for\n  every port.",
                          "sitelinks": [{"title": "x", "link": "https://x"}]},
                         {"title": "Moon", "link": "https://moon.example/a?utm_source=serper", "position": 2,
                          "snippet": "Why tides", "date": "Jan 1, 2026"}],
             "relatedSearches": [{"query": "tides today"}], "credits": 1}


def test_serper_request_and_results():
    r, c = run({"SERPER_API_KEY": KEY}, body=SERPER_OK, count=7)
    assert r == {"provider": "serper", "query": "tide tables", "results": [
        {"title": "Tide Tables & Charts", "url": "https://tides.example/", "snippet": "Tide times for every port.",
         "source": "serper"},
        {"title": "Moon", "url": "https://moon.example/a?utm_source=serper", "snippet": "Why tides",
         "source": "serper"}]}
    call = c.calls[0]
    assert (call["method"], call["url"], call["check"]) == ("POST", "https://google.serper.dev/search", True)
    assert call["credentials"] == {"X-API-KEY": KEY} and KEY not in json.dumps(call["headers"])
    assert json.loads(call["content"]) == {"q": "tide tables", "num": 7}


@pytest.mark.parametrize("status,body,expect,provider_message", [
    (403, {"message": "Unauthorized.", "statusCode": 403}, "search_bad_key", None),
    (400, {"message": "Not enough credits", "statusCode": 400}, "search_provider_error", "Not enough credits"),
    (500, b"<html>oops</html>", "search_provider_error", "<html>oops</html>"),
    (200, b"{not json", "search_provider_error", ""),
    (200, {"organic": "nope"}, "search_provider_error", ""),
])
def test_serper_failures(status, body, expect, provider_message):
    r, _ = run({"SERPER_API_KEY": KEY}, status, body)
    assert code(r) == expect, r
    assert r["error"]["provider"] == "serper" and r["error"]["status"] == status
    if provider_message is not None:
        assert r["error"]["provider_message"] == provider_message
    if expect == "search_bad_key":
        assert "rejected the key in SERPER_API_KEY" in r["error"]["message"]


def test_serper_no_organic_is_an_answer_with_no_results():
    r, _ = run({"SERPER_API_KEY": KEY}, body={"searchParameters": {"q": "zzqx"}, "credits": 1})
    assert r == {"provider": "serper", "query": "tide tables", "results": []}


# ------------------------------------------------------------------ Brave

BRAVE_OK = {"type": "search", "query": {"original": "tide tables", "more_results_available": True},
            "web": {"type": "search", "results": [
                {"title": "Tides", "url": "https://tides.example/p", "description": "All <strong>tide</strong> times",
                 "page_age": "2026-01-01", "language": "en", "extra_snippets": ["a"],
                 "meta_url": {"scheme": "https", "netloc": "tides.example", "hostname": "tides.example",
                              "path": "/p"}}]}}


def test_brave_request_and_results():
    r, c = run({"BRAVE_SEARCH_API_KEY": KEY}, body=BRAVE_OK, count=30)
    assert r["results"] == [{"title": "Tides", "url": "https://tides.example/p", "snippet": "All tide times",
                             "source": "brave"}]
    call = c.calls[0]
    u = urlsplit(call["url"])
    assert (call["method"], u.netloc, u.path) == ("GET", "api.search.brave.com", "/res/v1/web/search")
    assert parse_qs(u.query) == {"q": ["tide tables"], "count": ["20"]}  # capped to 20
    assert call["credentials"] == {"X-Subscription-Token": KEY} and call["headers"]["Accept"] == "application/json"


def brave_error(status, code_, detail, **meta):
    return {"type": "ErrorResponse", "error": {"id": "abc", "status": status, "code": code_, "detail": detail,
                                               "meta": meta}, "time": 1700000000}


def test_brave_422_is_a_bad_key_and_429_rate_limited():
    r, _ = run({"BRAVE_SEARCH_API_KEY": KEY}, 422, brave_error(422, "SUBSCRIPTION_TOKEN_INVALID",
                                                                  "The provided subscription token is invalid."))
    assert code(r) == "search_bad_key" and "SUBSCRIPTION_TOKEN_INVALID" in r["error"]["message"]
    r, _ = run({"BRAVE_SEARCH_API_KEY": KEY}, 422, brave_error(
        422, "VALIDATION", "Unable to validate request parameter(s)",
        errors=[{"type": "missing", "loc": ["header", "x-subscription-token"], "msg": "Field required"}]))
    assert code(r) == "search_bad_key"
    r, _ = run({"BRAVE_SEARCH_API_KEY": KEY}, 422, brave_error(422, "VALIDATION", "count must be <= 20",
                                                                  errors=[{"loc": ["query", "count"]}]))
    assert code(r) == "search_provider_error" and r["error"]["status"] == 422
    r, _ = run({"BRAVE_SEARCH_API_KEY": KEY}, 429, brave_error(429, "RATE_LIMITED",
                                                                  "Request rate limit exceeded for plan"),
               headers={"Retry-After": "3"})
    assert code(r) == "search_rate_limited" and r["error"]["retry_after"] == 3
    assert "Request rate limit exceeded for plan" in r["error"]["message"]
    r, _ = run({"BRAVE_SEARCH_API_KEY": KEY}, 429, brave_error(429, "RATE_LIMITED", "x"))
    assert code(r) == "search_rate_limited" and "retry_after" not in r["error"]


def test_brave_without_web_section_is_no_results_and_garbage_is_a_failure():
    r, _ = run({"BRAVE_SEARCH_API_KEY": KEY}, body={"type": "search", "query": {"original": "zzqx"}})
    assert r["results"] == []
    r, _ = run({"BRAVE_SEARCH_API_KEY": KEY}, body=b"")
    assert code(r) == "search_provider_error"


# ------------------------------------------------------------------ Tavily

TAVILY_OK = {"query": "tide tables", "answer": None, "images": [], "follow_up_questions": None, "response_time": 0.9,
             "results": [{"title": "Tides", "url": "https://tides.example/", "content": "Tide times.", "score": 0.9,
                          "raw_content": None}]}


def test_tavily_request_results_and_errors():
    r, c = run({"TAVILY_API_KEY": KEY}, body=TAVILY_OK, count=3)
    assert r["results"] == [{"title": "Tides", "url": "https://tides.example/", "snippet": "Tide times.",
                             "source": "tavily"}]
    call = c.calls[0]
    assert (call["method"], call["url"]) == ("POST", "https://api.tavily.com/search")
    assert call["credentials"] == {"Authorization": f"Bearer {KEY}"}
    assert json.loads(call["content"]) == {"query": "tide tables", "max_results": 3}
    r, _ = run({"TAVILY_API_KEY": KEY}, 401, {"detail": {"error": "Unauthorized: missing or invalid API key."}})
    assert code(r) == "search_bad_key" and "invalid API key" in r["error"]["message"]
    r, _ = run({"TAVILY_API_KEY": KEY}, 432, {"detail": {"error": "This request exceeds your plan's set usage limit."}})
    assert code(r) == "search_provider_error" and r["error"]["status"] == 432
    assert "usage limit" in r["error"]["provider_message"]
    r, _ = run({"TAVILY_API_KEY": KEY}, 429, {"detail": {"error": "Rate limit exceeded"}},
               headers={"Retry-After": "Wed, 21 Oct 2015 07:28:00 GMT"})
    assert code(r) == "search_rate_limited" and r["error"]["retry_after"] == 0
    r, _ = run({"TAVILY_API_KEY": KEY}, 200, {"query": "x"})
    assert code(r) == "search_provider_error"


# ------------------------------------------------------------------ Firecrawl

FIRECRAWL_V2 = {"success": True, "data": {"web": [
    {"url": "https://tides.example/", "title": "Tides", "description": "Times.", "position": 1}], "images": [],
                                          "news": []}}
FIRECRAWL_V1 = {"success": True, "data": [{"url": "https://moon.example/", "title": "Moon", "description": "Pull."}]}


def test_firecrawl_cloud_and_self_hosted():
    r, c = run({"FIRECRAWL_API_KEY": KEY}, body=FIRECRAWL_V2)
    assert r["results"][0] == {"title": "Tides", "url": "https://tides.example/", "snippet": "Times.",
                               "source": "firecrawl"}
    call = c.calls[0]
    assert (call["url"], call["check"], call["credentials"]) == (
        "https://api.firecrawl.dev/v2/search", True, {"Authorization": f"Bearer {KEY}"})
    assert json.loads(call["content"]) == {"query": "tide tables", "limit": 10}
    r, c = run({"FIRECRAWL_URL": "http://10.0.0.5:3002/"}, body=FIRECRAWL_V1)
    assert r["provider"] == "firecrawl" and r["results"][0]["url"] == "https://moon.example/"
    call = c.calls[0]
    assert (call["url"], call["check"], call["credentials"]) == ("http://10.0.0.5:3002/v2/search", False, None)


def test_firecrawl_errors():
    r, _ = run({"FIRECRAWL_API_KEY": KEY}, 401, {"success": False, "error": "Unauthorized: Invalid token"})
    assert code(r) == "search_bad_key"
    r, _ = run({"FIRECRAWL_API_KEY": KEY}, 402, {"success": False, "error": "Insufficient credits"})
    assert code(r) == "search_provider_error" and r["error"]["provider_message"] == "Insufficient credits"
    r, _ = run({"FIRECRAWL_API_KEY": KEY}, 200, {"success": False, "error": "Search failed"})
    assert code(r) == "search_provider_error" and "Search failed" in r["error"]["message"]
    r, _ = run({"FIRECRAWL_URL": "ftp://x"}, body=FIRECRAWL_V1)
    assert code(r) == "search_not_configured"


# ------------------------------------------------------------------ SearXNG

SEARX_OK = {"query": "tide tables", "number_of_results": 0, "results": [
    {"url": "https://tides.example/", "title": "Tides", "content": "Times", "engine": "duckduckgo",
     "engines": ["duckduckgo", "brave"], "score": 2.0, "category": "general"},
    {"url": "https://moon.example/", "title": "Moon", "content": "", "engines": ["qwant"], "score": 1.0}],
    "answers": [], "corrections": [], "infoboxes": [], "suggestions": [], "unresponsive_engines": []}


def test_searxng_request_results_and_errors():
    env = {"SEARXNG_URL": "http://searx.internal:8080/"}
    r, c = run(env, body=SEARX_OK)
    assert [(x["url"], x["source"]) for x in r["results"]] == [("https://tides.example/", "duckduckgo"),
                                                               ("https://moon.example/", "qwant")]
    call = c.calls[0]
    assert call["check"] is False and call["method"] == "GET"
    u = urlsplit(call["url"])
    assert (u.netloc, u.path, parse_qs(u.query)["format"]) == ("searx.internal:8080", "/search", ["json"])
    r, _ = run(env, 403, b"<html>403 Forbidden</html>", headers={"content-type": "text/html"})
    assert code(r) == "search_provider_error" and "search.formats" in r["error"]["message"]
    r, _ = run(env, 429, b"Too Many Requests", headers={"content-type": "text/plain"})
    assert code(r) == "search_rate_limited" and "Too Many Requests" in r["error"]["message"]
    r, _ = run(env, body={**SEARX_OK, "results": [], "unresponsive_engines": [["google", "timeout"]]})
    assert code(r) == "search_provider_error" and "google" in r["error"]["message"]
    r, _ = run(env, body={**SEARX_OK, "results": []})
    assert r["results"] == []
    r, _ = run({}, provider="searxng")
    assert code(r) == "search_not_configured" and "SEARXNG_URL" in r["error"]["message"]


# ------------------------------------------------------------------ DuckDuckGo

def ddg_result(target, title, snippet, ad=False):
    from urllib.parse import quote

    href = (f"https://duckduckgo.com/y.js?ad_domain={quote(target)}&u3=x" if ad
            else f"//duckduckgo.com/l/?uddg={quote(target, safe='')}&amp;rut=abc123")
    cls = "result results_links results_links_deep web-result" + (" result--ad" if ad else "")
    return (f'<div class="{cls}"><div class="links_main links_deep result__body">'
            f'<h2 class="result__title"><a rel="nofollow" class="result__a" href="{href}">{title}</a></h2>'
            f'<div class="result__extras"><a class="result__url" href="{href}">{target}</a></div>'
            f'<a class="result__snippet" href="{href}">{snippet}</a></div></div>')


def ddg_page(*results):
    return ('<!DOCTYPE html><html><head><title>tide tables at DuckDuckGo</title></head><body>'
            '<div id="links" class="results">' + "".join(results) + "</div></body></html>").encode()


DDG_CHALLENGE = (b'<html><body><div class="anomaly-modal__title">Unfortunately, bots use DuckDuckGo too.</div>'
                 b'<form id="challenge-form" action="//duckduckgo.com/anomaly.js?sv=html&amp;cc=botnet" method="POST">'
                 b'<input type="hidden" name="challenge"></form></body></html>')
DDG_NONE = ddg_page('<div class="no-results">No  results.</div>')


def test_duckduckgo_parsing_unwraps_and_skips_ads():
    page = ddg_page(ddg_result("https://ads.example/buy", "Buy tides", "Ad", ad=True),
                    ddg_result("https://tides.example/a?x=1&y=2", "Tide <b>Tables</b>", "Times for <b>tides</b>"),
                    ddg_result("https://moon.example/", "Moon", "Pull"))
    results, kind = parse_duckduckgo(page)
    assert kind == "results"
    assert [(r["url"], r["title"]) for r in results] == [("https://tides.example/a?x=1&y=2", "Tide Tables"),
                                                          ("https://moon.example/", "Moon")]
    assert parse_duckduckgo(DDG_CHALLENGE) == ([], "challenge")
    assert parse_duckduckgo(DDG_NONE) == ([], "no_results")
    assert parse_duckduckgo(b"<html><body>maintenance</body></html>") == ([], "unknown")
    assert parse_duckduckgo(b"") == ([], "unknown")


def test_duckduckgo_search_request_and_outcomes():
    page = ddg_page(ddg_result("https://tides.example/", "Tides", "Times"))
    r, c = run({}, body=page, headers={"content-type": "text/html"})
    assert r["provider"] == "duckduckgo" and r["results"][0]["url"] == "https://tides.example/"
    call = c.calls[0]
    assert (call["method"], call["url"], call["credentials"]) == ("POST", "https://html.duckduckgo.com/html/", None)
    assert parse_qs(call["content"].decode(), keep_blank_values=True)["q"] == ["tide tables"]
    assert call["headers"]["Content-Type"] == "application/x-www-form-urlencoded"
    r, _ = run({}, 202, DDG_CHALLENGE)
    assert code(r) == "search_blocked" and r["error"]["status"] == 202
    r, _ = run({}, 202, page)  # parse first: a 202 that has results is results
    assert len(r["results"]) == 1
    r, _ = run({}, 200, DDG_NONE)
    assert r["results"] == []
    r, _ = run({}, 200, b"<html><body>maintenance</body></html>")
    assert code(r) == "search_provider_error"
    r, _ = run({}, 403, b"")
    assert code(r) == "search_blocked"
    r, _ = run({}, 429, b"", headers={"Retry-After": "60"})
    assert code(r) == "search_rate_limited" and r["error"]["retry_after"] == 60


# ------------------------------------------------------------------ selection, keys, transport errors

def test_selection_order_and_explicit_names():
    keys = {"SERPER_API_KEY": "s", "BRAVE_SEARCH_API_KEY": "b", "TAVILY_API_KEY": "t", "FIRECRAWL_API_KEY": "f",
            "SEARXNG_URL": "http://searx:8080"}
    order = ["serper", "brave", "tavily", "firecrawl", "searxng"]
    for i, name in enumerate(order):
        env = {k: v for k, v in keys.items() if order.index(
            {"SERPER_API_KEY": "serper", "BRAVE_SEARCH_API_KEY": "brave", "TAVILY_API_KEY": "tavily",
             "FIRECRAWL_API_KEY": "firecrawl", "SEARXNG_URL": "searxng"}[k]) >= i}
        r, _ = run(env, 500, b"")
        assert r["error"]["provider"] == name, (env, r)
    r, _ = run({}, 500, b"")
    assert r["error"]["provider"] == "duckduckgo"
    r, _ = run({"FIRECRAWL_URL": "http://fc:3002"}, 500, b"")
    assert r["error"]["provider"] == "firecrawl"
    r, _ = run({**keys, "SLUICE_SEARCH_PROVIDER": "Tavily"}, 500, b"")
    assert r["error"]["provider"] == "tavily"
    r, _ = run({**keys, "SLUICE_SEARCH_PROVIDER": "tavily"}, 500, b"", provider="brave")  # the argument wins
    assert r["error"]["provider"] == "brave"
    r, c = run({**keys, "SLUICE_SEARCH_PROVIDER": "none"})
    assert code(r) == "search_not_configured" and "web_fetch still works" in r["error"]["message"] and not c.calls
    r, c = run({}, provider="bing")
    assert code(r) == "search_unknown_provider" and "serper" in r["error"]["message"] and not c.calls


def test_a_failing_provider_is_never_swapped_for_another():
    r, c = run({"SERPER_API_KEY": KEY, "BRAVE_SEARCH_API_KEY": "b"}, 429, {"message": "Too many"})
    assert code(r) == "search_rate_limited" and r["error"]["provider"] == "serper" and len(c.calls) == 1


def test_key_files_and_missing_keys(tmp_path):
    f = tmp_path / "brave.key"
    f.write_text(KEY + "\n")
    r, c = run({"BRAVE_SEARCH_API_KEY_FILE": str(f)}, body=BRAVE_OK)
    assert r["provider"] == "brave" and c.calls[0]["credentials"] == {"X-Subscription-Token": KEY}
    r, c = run({"BRAVE_SEARCH_API_KEY_FILE": str(tmp_path / "missing")}, body=BRAVE_OK)
    assert code(r) == "search_not_configured" and "BRAVE_SEARCH_API_KEY_FILE" in r["error"]["message"] and not c.calls
    # Named explicitly with no key (the proxy injects it): sent without one; a 422 says neither supplied it.
    r, c = run({"SLUICE_SEARCH_PROVIDER": "brave"}, 422, brave_error(422, "SUBSCRIPTION_TOKEN_INVALID", "invalid"))
    assert c.calls[0]["credentials"] is None
    assert code(r) == "search_bad_key"
    assert "neither the tool" in r["error"]["message"] and "proxy" in r["error"]["message"]


def test_keys_never_in_results_or_errors():
    echo = {"message": f"Unauthorized key {KEY}", "statusCode": 403}
    r, _ = run({"SERPER_API_KEY": KEY}, 403, echo)
    assert code(r) == "search_bad_key" and KEY not in json.dumps(r)
    r, _ = run({"TAVILY_API_KEY": KEY}, 500, {"detail": {"error": f"bad {KEY}"}})
    assert KEY not in json.dumps(r)


@pytest.mark.parametrize("raised,expect", [
    (WebError("web_blocked", "Sluice refused it", reason="address_not_public", by="proxy", url="u", status=403),
     "search_unreachable"),
    (WebError("web_timeout", "slow"), "search_timeout"),
    (WebError("web_unreachable", "refused"), "search_unreachable"),
    (WebError("web_tls_error", "bad cert"), "search_unreachable"),
    (WebError("web_too_large", "big", limit=1), "search_provider_error"),
    (WebError("web_no_proxy", "none"), "web_no_proxy"),
    (WebError("web_proxy_auth", "407"), "web_proxy_auth"),
])
def test_transport_errors_are_the_providers_failures(raised, expect):
    r, _ = run({"SEARXNG_URL": "http://10.0.0.5:8080"}, raises=raised)
    assert code(r) == expect and r["error"]["provider"] == "searxng", r
    if raised.code == "web_blocked":
        e = r["error"]
        assert e["reason"] == "address_not_public" and e["by"] == "proxy"
        assert "10.0.0.5" in e["message"] and "private_networks" in e["message"]


def test_bad_queries_and_counts_before_any_request():
    for q in ("", "   ", None, 3, "x" * 401):
        r, c = run({}, query=q)
        assert code(r) == "search_bad_query" and not c.calls
    for n in ("5", 2.5, True):
        r, c = run({}, count=n)
        assert code(r) == "web_bad_argument" and not c.calls
