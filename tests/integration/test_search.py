"""web_search through a real Sluice proxy (issue 12).

One mock origin plays every provider on its real host name: the fake DNS
points google.serper.dev, api.search.brave.com, api.tavily.com,
api.firecrawl.dev and html.duckduckgo.com at the "public" 93.184.215.14:443
(TLS, a certificate for those names from this module's own trustme CA, given
to the tools as SLUICE_CA_CERT), so the tools run their production code path
(real URLs, CONNECT through the proxy). SearXNG and a self-hosted Firecrawl
answer plain HTTP on :8888, publicly (searx.example.com) and at the private
10.0.0.1, which the proxy refuses unless its policy opens 10.0.0.1/32:8888.
The mock checks keys and answers in each provider's shape
(../shared/reference/search-providers.md); the query word picks the case.
"""

from __future__ import annotations

import asyncio
import json
import os
import ssl
import subprocess
import threading
from urllib.parse import parse_qs, quote, urlsplit

import pytest

from harness import default_policy
from harness.sluice import sluice_executable
from harness.http import read_request_head
from sluice.webtools.client import WebToolLimits, WebClient
from sluice.webtools.search import search
from harness.loops import stop_loop_thread

pytestmark = pytest.mark.netns

MOCK = "93.184.215.14"
PRIVATE = "10.0.0.1"
PLAIN = 8888
NAMES = ["google.serper.dev", "api.search.brave.com", "api.tavily.com", "api.firecrawl.dev", "html.duckduckgo.com"]
KEYS = {"serper": "serper-KEY-5a1f9e", "brave": "brave-KEY-77c3b2", "tavily": "tvly-KEY-0d9e41",
        "firecrawl": "fc-KEY-e3b0c4"}
ENV_VARS = {"serper": "SERPER_API_KEY", "brave": "BRAVE_SEARCH_API_KEY", "tavily": "TAVILY_API_KEY",
            "firecrawl": "FIRECRAWL_API_KEY"}
# What every provider "finds" (before the tool's clean-up): duplicates after normalisation,
# a javascript: link and a metadata address, which the tool drops.
FOUND = [("Tide <b>Tables</b>", "https://tides.example/charts?utm_source=search", "Times for every port"),
         ("Tides again", "https://TIDES.example:443/charts/#today", "the same page"),
         ("Click", "javascript:alert(1)", "a script"),
         ("Metadata", "http://169.254.169.254/latest/meta-data/", "cloud credentials"),
         ("Moon", "https://moon.example/why", "Why the moon pulls"),
         ("Sun", "https://sun.example/", "and the sun too")]
CLEAN = ["https://tides.example/charts?utm_source=search", "https://moon.example/why", "https://sun.example/"]


def many(n):
    return [(f"Result {i}", f"https://r{i}.example/", f"snippet {i}") for i in range(n)]


def jbody(obj):
    return json.dumps(obj).encode()


class Mock:
    """The providers. `requests` records (host, method, path, headers, body)."""

    def __init__(self, ctx: ssl.SSLContext):
        self.ctx = ctx
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.requests: list[dict] = []

    def start(self):
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)
        return self

    async def _start(self):
        self.servers = [await asyncio.start_server(self._handle, MOCK, 443, ssl=self.ctx),
                        await asyncio.start_server(self._handle, MOCK, PLAIN),
                        await asyncio.start_server(self._handle, PRIVATE, PLAIN)]

    def stop(self):
        stop_loop_thread(self.loop, self.thread, self.servers)

    def seen(self, host=None, path=None):
        return [r for r in self.requests if (host is None or r["host"] == host) and (path is None or r["path"] == path)]

    async def _handle(self, reader, writer):
        local = writer.get_extra_info("sockname")[0]
        try:
            while True:
                method, target, headers = await read_request_head(reader)
                body = await reader.readexactly(int(headers.get("content-length", "0") or 0))
                if "://" in target:
                    target = "/" + target.split("://", 1)[1].split("/", 1)[1]
                host = headers.get("host", "")
                host = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
                path, _, query = target.partition("?")
                req = {"host": host, "local": local, "method": method, "path": path, "query": parse_qs(query),
                       "headers": headers, "body": body}
                self.requests.append(req)
                status, ctype, payload, extra, delay = self.route(req)
                if delay:
                    await asyncio.sleep(delay)
                head = [f"HTTP/1.1 {status} X", f"Content-Type: {ctype}", f"Content-Length: {len(payload)}", *extra]
                writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + payload)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, OSError, ssl.SSLError, ValueError):
            return
        finally:
            writer.close()

    # ------------------------------------------------------------ providers

    def route(self, r):
        host, path, h = r["host"], r["path"], r["headers"]
        J = "application/json"
        if host == "google.serper.dev" and path == "/search":
            body = json.loads(r["body"])
            q, num = body["q"], body.get("num", 10)
            if h.get("x-api-key") != KEYS["serper"]:
                return 403, J, jbody({"message": "Unauthorized.", "statusCode": 403}), [], 0
            if q == "credits":
                return 400, J, jbody({"message": "Not enough credits", "statusCode": 400}), [], 0
            if c := self.common(q, J, b'{"organic": [', {"message": "Too many requests", "statusCode": 429}):
                return c
            found = many(30) if q == "many" else [] if q == "empty" else FOUND[:num]
            return 200, J, jbody({"searchParameters": {"q": q, "type": "search", "engine": "google"},
                                  "organic": [{"title": t, "link": u, "snippet": s, "position": i + 1}
                                              for i, (t, u, s) in enumerate(found)], "credits": 1}), [], 0
        if host == "api.search.brave.com" and path == "/res/v1/web/search":
            q = r["query"]["q"][0]
            token = h.get("x-subscription-token")
            if token is None:
                return 422, J, jbody(brave_error("VALIDATION", "Unable to validate request parameter(s)",
                                                 errors=[{"type": "missing", "loc": ["header", "x-subscription-token"],
                                                          "msg": "Field required"}])), [], 0
            if token != KEYS["brave"]:
                return 422, J, jbody(brave_error("SUBSCRIPTION_TOKEN_INVALID",
                                                 "The provided subscription token is invalid.")), [], 0
            if q == "redirect":
                return 302, "text/plain", b"", ["Location: https://html.duckduckgo.com/landing"], 0
            if c := self.common(q, J, b'{"type": "search", "web": ',
                                brave_error("RATE_LIMITED", "Request rate limit exceeded for plan")):
                return c
            if q == "empty":
                return 200, J, jbody({"type": "search", "query": {"original": q}}), [], 0
            count = int(r["query"]["count"][0])
            return 200, J, jbody({"type": "search", "query": {"original": q}, "web": {"type": "search", "results": [
                {"title": t, "url": u, "description": s, "meta_url": {"hostname": urlsplit(u).hostname or ""}}
                for t, u, s in FOUND[:count]]}}), [], 0
        if host == "api.tavily.com" and path == "/search":
            body = json.loads(r["body"])
            if h.get("authorization") != f"Bearer {KEYS['tavily']}":
                return 401, J, jbody({"detail": {"error": "Unauthorized: missing or invalid API key."}}), [], 0
            if body["query"] == "plan":
                return 432, J, jbody({"detail": {"error": "This request exceeds your plan's set usage limit."}}), [], 0
            if c := self.common(body["query"], J, b'{"results": [{', {"detail": {"error": "Rate limit exceeded"}}):
                return c
            return 200, J, jbody({"query": body["query"], "answer": None, "images": [], "response_time": 0.4,
                                  "results": [{"title": t, "url": u, "content": s, "score": 0.5, "raw_content": None}
                                              for t, u, s in FOUND[:body["max_results"]]]}), [], 0
        if path == "/v2/search" and (host == "api.firecrawl.dev" or r["local"] == PRIVATE):
            body = json.loads(r["body"])
            if host == "api.firecrawl.dev" and h.get("authorization") != f"Bearer {KEYS['firecrawl']}":
                return 401, J, jbody({"success": False, "error": "Unauthorized: Invalid token"}), [], 0
            if body["query"] == "credits":
                return 402, J, jbody({"success": False,
                                      "error": "Insufficient credits to perform this request."}), [], 0
            if c := self.common(body["query"], J, b'{"success": true, "data": {',
                                {"success": False, "error": "Rate limit exceeded"}):
                return c
            return 200, J, jbody({"success": True, "data": {"web": [
                {"url": u, "title": t, "description": s, "position": i + 1}
                for i, (t, u, s) in enumerate(FOUND[:body["limit"]])]}}), [], 0
        if path == "/search" and r["local"] in (MOCK, PRIVATE) and host != "google.serper.dev":  # SearXNG
            q = r["query"]["q"][0]
            if r["query"].get("format") != ["json"] or q == "json-off":
                return 403, "text/html", b"<html><body><h1>403 Forbidden</h1></body></html>", [], 0
            if q == "limit":
                return 429, "text/plain", b"Too Many Requests", [], 0
            if c := self.common(q, J, b'{"results": [', {}):
                return c
            found = [] if q == "empty" else FOUND
            engines = ["google", "bing", "qwant", "brave", "mojeek", "wikipedia"]
            return 200, J, jbody({"query": q, "number_of_results": 0, "answers": [], "corrections": [],
                                  "infoboxes": [], "suggestions": [], "unresponsive_engines": [],
                                  "results": [{"url": u, "title": t, "content": s, "engine": engines[i],
                                               "engines": [engines[i]], "score": 1.0, "category": "general"}
                                              for i, (t, u, s) in enumerate(found)]}), [], 0
        if host == "html.duckduckgo.com" and path == "/html/" and r["method"] == "POST":
            q = parse_qs(r["body"].decode())["q"][0]
            if q == "challenge":
                return 202, "text/html", DDG_CHALLENGE, [], 0
            if q == "nothing":
                return 200, "text/html", ddg_page('<div class="no-results">No  results.</div>'), [], 0
            return 200, "text/html", ddg_page(ddg_result("https://ads.example/buy", "Buy tides", "Ad", ad=True),
                                              *[ddg_result(u, t, s) for t, u, s in FOUND]), [], 0
        if host == "html.duckduckgo.com" and path == "/landing":
            return 200, "application/json", jbody({"type": "search", "web": {"results": [
                {"title": "Landed", "url": "https://landed.example/", "description": "after a redirect"}]}}), [], 0
        return 404, "text/plain", b"not found", [], 0

    @staticmethod
    def common(q, ctype, truncated, limit_body):
        if q == "garbage":
            return 200, ctype, truncated, [], 0
        if q == "limit":
            return 429, ctype, jbody(limit_body), ["Retry-After: 7"], 0
        if q == "limit-bare":
            return 429, ctype, jbody(limit_body), [], 0
        if q == "slow":
            return 200, ctype, b"{}", [], 4
        if q == "down":
            return 503, ctype, jbody(limit_body), [], 0
        return None


def brave_error(code, detail, **meta):
    return {"type": "ErrorResponse", "error": {"id": "e1", "status": 0, "code": code, "detail": detail, "meta": meta},
            "time": 1700000000}


def ddg_result(target, title, snippet, ad=False):
    href = (f"https://duckduckgo.com/y.js?ad_domain=ads.example&amp;u3={quote(target, safe='')}" if ad
            else f"//duckduckgo.com/l/?uddg={quote(target, safe='')}&amp;rut=5f0c")
    cls = "result results_links results_links_deep web-result" + (" result--ad" if ad else "")
    return (f'<div class="{cls}"><div class="links_main links_deep result__body"><h2 class="result__title">'
            f'<a rel="nofollow" class="result__a" href="{href}">{title}</a></h2>'
            f'<a class="result__snippet" href="{href}">{snippet}</a></div></div>')


def ddg_page(*parts):
    return ('<!DOCTYPE html><html><head><title>DuckDuckGo</title></head><body><div id="links" class="results">'
            + "".join(parts) + "</div></body></html>").encode()


DDG_CHALLENGE = (b'<html><body><div class="anomaly-modal__title">Unfortunately, bots use DuckDuckGo too.</div>'
                 b'<form id="challenge-form" action="//duckduckgo.com/anomaly.js?sv=html&amp;cc=botnet" method="POST">'
                 b'</form></body></html>')


# ------------------------------------------------------------------ fixtures

@pytest.fixture(scope="module")
def ca(tmp_path_factory):
    import trustme

    authority = trustme.CA()
    d = tmp_path_factory.mktemp("search-ca")
    authority.cert_pem.write_to_path(str(d / "ca.pem"))
    return authority, str(d / "ca.pem")


@pytest.fixture(scope="module")
def mock(netns, ca):
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca[0].issue_cert(*NAMES).configure_cert(ctx)
    server = Mock(ctx).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def proxy(sluice_factory, fake_dns, mock):
    for name in NAMES + ["searx.example.com"]:
        fake_dns.set(name, a=[MOCK])
    fake_dns.set("searx-private.example.com", a=[PRIVATE])
    return sluice_factory(default_policy(ports=[80, 443, PLAIN]), name="search")


@pytest.fixture(scope="module")
def proxy_private(sluice_factory, fake_dns, mock):
    # The one story for a private sidecar (issue 26 item 5): its address with its port under
    # private_networks; `ports` is not widened.
    return sluice_factory(default_policy(private_networks=[f"{PRIVATE}/32:{PLAIN}"]), name="search-private")


@pytest.fixture
def go(proxy, ca, mock):
    """go(env_extra, query, **kw): search through `proxy` with only these variables."""
    outputs = []

    def run(extra=None, query="tide tables", *, via=None, timeout=20.0, **kw):
        env = {"SLUICE_PROXY": (via or proxy).proxy_url, "SLUICE_CA_CERT": ca[1], **(extra or {})}
        with WebClient(env=env, limits=WebToolLimits(timeout=timeout)) as client:
            result = search(query, client=client, **kw)
        outputs.append(json.dumps(result))
        return result

    run.outputs = outputs
    mock.requests.clear()
    yield run
    leaked = [o for o in outputs if any(k in o for k in KEYS.values())]
    assert not leaked, leaked


def code(r):
    return r.get("error", {}).get("code")


def keyed(provider, key=None):
    return {ENV_VARS[provider]: key or KEYS[provider]}


# ------------------------------------------------------------------ happy paths

@pytest.mark.parametrize("provider", ["serper", "brave", "tavily", "firecrawl"])
def test_keyed_providers_through_the_proxy(go, mock, provider):
    r = go(keyed(provider))
    assert r["provider"] == provider and r["query"] == "tide tables", r
    assert [x["url"] for x in r["results"]] == CLEAN  # order kept, duplicates and bad links gone
    assert r["results"][0] == {"title": "Tide Tables", "url": CLEAN[0], "snippet": "Times for every port",
                               "source": provider}
    (seen,) = mock.requests
    assert seen["local"] == MOCK and seen["host"] in NAMES


def test_searxng_public_and_duckduckgo(go, mock):
    r = go({"SEARXNG_URL": f"http://searx.example.com:{PLAIN}/"})
    assert r["provider"] == "searxng" and [x["url"] for x in r["results"]] == CLEAN
    assert [x["source"] for x in r["results"]] == ["google", "mojeek", "wikipedia"]  # the engines
    r = go({})
    assert r["provider"] == "duckduckgo" and [x["url"] for x in r["results"]] == CLEAN  # uddg unwrapped, ad skipped
    assert all("duckduckgo.com" not in x["url"] for x in r["results"])


def test_empty_answers_are_empty_results(go):
    for extra in (keyed("serper"), keyed("brave"), {"SEARXNG_URL": f"http://searx.example.com:{PLAIN}"}):
        r = go(extra, "empty")
        assert r["results"] == [] and "error" not in r, r
    r = go({}, "nothing")
    assert r == {"provider": "duckduckgo", "query": "nothing", "results": []}


def test_count_is_capped_and_passed_on(go, mock):
    r = go(keyed("serper"), "many", count=50)
    assert len(r["results"]) == 20 and json.loads(mock.requests[-1]["body"])["num"] == 20
    r = go(keyed("serper"), "many", count=3)
    assert [x["url"] for x in r["results"]] == ["https://r0.example/", "https://r1.example/", "https://r2.example/"]
    r = go(keyed("brave"), count=0)
    assert len(r["results"]) == 1 and mock.requests[-1]["query"]["count"] == ["1"]


# ------------------------------------------------------------------ failures told as failures

@pytest.mark.parametrize("provider,status", [("serper", 403), ("brave", 422), ("tavily", 401), ("firecrawl", 401)])
def test_bad_keys(go, provider, status):
    r = go(keyed(provider, "wrong-key-123"))
    assert code(r) == "search_bad_key" and r["error"]["status"] == status and r["error"]["provider"] == provider, r
    assert ENV_VARS[provider] in r["error"]["message"]


@pytest.mark.parametrize("extra", [keyed("serper"), keyed("brave"), keyed("tavily"), keyed("firecrawl"),
                                   {"SEARXNG_URL": f"http://searx.example.com:{PLAIN}"}])
def test_rate_limits_malformed_bodies_and_outages(go, extra):
    r = go(extra, "limit")
    assert code(r) == "search_rate_limited" and r["error"]["status"] == 429, r
    if "SEARXNG_URL" not in extra:
        assert r["error"]["retry_after"] == 7
        r = go(extra, "limit-bare")
        assert code(r) == "search_rate_limited" and "retry_after" not in r["error"], r
    else:
        assert "Too Many Requests" in r["error"]["message"]  # SearXNG's plain-text limiter
    r = go(extra, "garbage")
    assert code(r) == "search_provider_error" and r["error"]["status"] == 200, r
    r = go(extra, "down")
    assert code(r) == "search_provider_error" and r["error"]["status"] == 503, r


def test_provider_specific_errors(go):
    r = go(keyed("serper"), "credits")
    assert code(r) == "search_provider_error" and r["error"]["provider_message"] == "Not enough credits", r
    r = go(keyed("tavily"), "plan")
    assert code(r) == "search_provider_error" and r["error"]["status"] == 432 and "usage limit" in r["error"]["message"]
    r = go(keyed("firecrawl"), "credits")
    assert code(r) == "search_provider_error" and r["error"]["status"] == 402
    r = go({"SEARXNG_URL": f"http://searx.example.com:{PLAIN}"}, "json-off")
    assert code(r) == "search_provider_error" and r["error"]["status"] == 403
    assert "search.formats" in r["error"]["message"]
    r = go({}, "challenge")
    assert code(r) == "search_blocked" and r["error"]["status"] == 202, r


def test_timeout(go):
    r = go(keyed("brave"), "slow", timeout=1.5)
    assert code(r) == "search_timeout" and r["error"]["provider"] == "brave", r


def test_none_and_no_silent_switch(go, mock):
    r = go({**keyed("brave"), "SLUICE_SEARCH_PROVIDER": "none"})
    assert code(r) == "search_not_configured" and "web_fetch still works" in r["error"]["message"]
    assert not mock.requests
    # Serper first in the order; its failure is its own, Brave is never asked.
    r = go({**keyed("serper", "wrong-key-123"), **keyed("brave")})
    assert code(r) == "search_bad_key" and r["error"]["provider"] == "serper"
    assert [x["host"] for x in mock.requests] == ["google.serper.dev"]
    r = go({**keyed("serper"), **keyed("brave"), "SLUICE_SEARCH_PROVIDER": "brave"})
    assert r["provider"] == "brave" and mock.requests[-1]["host"] == "api.search.brave.com"


def test_keys_stay_with_their_provider(go, mock, proxy):
    # A key held by the proxy: the tool names the provider, sends none, and says so when refused.
    r = go({"SLUICE_SEARCH_PROVIDER": "brave"})
    assert code(r) == "search_bad_key" and "neither the tool" in r["error"]["message"]
    assert "x-subscription-token" not in mock.requests[-1]["headers"]
    # A redirect to another origin drops the key.
    r = go(keyed("brave"), "redirect")
    assert [x["url"] for x in r["results"]] == ["https://landed.example/"]
    (landing,) = mock.seen("html.duckduckgo.com", "/landing")
    assert "x-subscription-token" not in landing["headers"]
    assert mock.seen("api.search.brave.com")[-1]["headers"]["x-subscription-token"] == KEYS["brave"]
    audit = proxy.audit_file.read_text() if proxy.audit_file.exists() else ""
    assert not any(k in audit + proxy.stderr_text() for k in KEYS.values())


# ------------------------------------------------------------------ private, self-hosted

def test_private_provider_refused_then_opened_by_policy(go, mock, proxy_private):
    for url in (f"http://{PRIVATE}:{PLAIN}", f"http://searx-private.example.com:{PLAIN}"):
        r = go({"SEARXNG_URL": url})
        e = r.get("error", {})
        assert e.get("code") == "search_unreachable" and e["by"] == "proxy", r
        assert e["reason"] in ("address_not_public", "dns_answer_not_public")
        assert "private_networks" in e["message"] and urlsplit(url).hostname in e["message"]
        assert '(e.g. "10.0.0.5/32:8080")' in e["message"] and "its port under ports" not in e["message"]
        named = urlsplit(url).hostname != PRIVATE
        assert (f'allow: ["*", {urlsplit(url).hostname}]' in e["message"]) is named, e["message"]
    assert not [x for x in mock.requests if x["local"] == PRIVATE]
    # Opened: SearXNG and a self-hosted Firecrawl (no key) at the private address.
    r = go({"SEARXNG_URL": f"http://{PRIVATE}:{PLAIN}"}, via=proxy_private)
    assert r["provider"] == "searxng" and [x["url"] for x in r["results"]] == CLEAN, r
    r = go({"FIRECRAWL_URL": f"http://{PRIVATE}:{PLAIN}"}, via=proxy_private)
    assert r["provider"] == "firecrawl" and [x["url"] for x in r["results"]] == CLEAN, r
    assert "authorization" not in mock.requests[-1]["headers"] and mock.requests[-1]["local"] == PRIVATE


def test_proxy_refusing_a_provider_host(sluice_factory, go, mock):
    strict = sluice_factory(default_policy(ports=[80, 443, PLAIN], allow=["api.search.brave.com"]),
                            name="search-strict")
    r = go(keyed("tavily"), via=strict)
    e = r.get("error", {})
    assert e.get("code") == "search_unreachable" and e["reason"] == "host_not_allowed" and e["by"] == "proxy", r
    assert not mock.seen("api.tavily.com")
    assert go(keyed("brave"), via=strict)["provider"] == "brave"


# ------------------------------------------------------------------ CLI

def test_cli(proxy, ca, mock):
    env = {k: v for k, v in os.environ.items() if not k.endswith(("_PROXY", "_proxy")) and k not in ENV_VARS.values()}
    env.update(SLUICE_PROXY=proxy.proxy_url, SLUICE_CA_CERT=ca[1], **keyed("brave"))
    exe = sluice_executable()
    p = subprocess.run([exe, "search", "tide", "tables", "--count", "5"], env=env, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    assert "Search: tide tables · brave · 2 results" in p.stdout and "https://moon.example/why" in p.stdout
    p = subprocess.run([exe, "search", "tide tables", "--json", "--provider", "serper"], env=env, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 1 and json.loads(p.stdout)["error"]["code"] == "search_bad_key"
    p = subprocess.run([exe, "search", "limit"], env={**env, "BRAVE_SEARCH_API_KEY": "x"}, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 1 and "search_bad_key" in p.stderr
    for out in (p.stdout, p.stderr):
        assert not any(k in out for k in KEYS.values())


def test_web_search_over_mcp(proxy, ca, mock):
    """The same search through `sluice mcp` (the SDK's own stdio client): the
    structured content is the function's result; a failure is a tool error
    carrying the same error dict."""
    import anyio
    from mcp import Client
    from mcp.client.stdio import StdioServerParameters

    env = {"SLUICE_PROXY": proxy.proxy_url, "SLUICE_CA_CERT": ca[1], "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
           **keyed("brave")}

    async def main():
        params = StdioServerParameters(command=sluice_executable(), args=["mcp"], env=env)
        with anyio.fail_after(60):
            async with Client(params) as client:
                listed = {t.name for t in (await client.list_tools()).tools}
                ok = await client.call_tool("web_search", {"query": "tide tables", "count": 5})
                bad = await client.call_tool("web_search", {"query": "tide tables", "provider": "serper"})
                empty = await client.call_tool("web_search", {"query": "   "})
                return listed, ok, bad, empty

    listed, ok, bad, empty = anyio.run(main)
    assert "web_search" in listed
    assert not ok.is_error and ok.structured_content["provider"] == "brave"
    with WebClient(env=env) as client:
        direct = search("tide tables", count=5, client=client)
    # The results travel once, in the text's envelope; the structured content is the metadata.
    assert ok.structured_content == {k: v for k, v in direct.items() if k != "results"}
    assert direct["results"] and all(r["url"] in ok.content[0].text for r in direct["results"])
    assert bad.is_error and "search_bad_key" in bad.content[0].text  # serper has no key here
    assert empty.is_error and "search_bad_query" in empty.content[0].text
    for result in (ok, bad, empty):
        assert not any(k in result.content[0].text for k in KEYS.values())
