"""robots.txt through a real Sluice proxy (issue 25 item 8).

Origins on the "public" address 1.1.1.1, one robots.txt behaviour per port:
rules for Sluice (RULES), a 503 (SERVER_ERROR), none at all (MISSING), a
robots.txt that redirects to the metadata address, which the proxy refuses
(REFUSED), and one that changes, with a one-second max-age (FRESH).
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from harness import default_policy
from harness.http import read_request_head
from sluice.webtools import robots
from sluice.webtools.client import WebClient
from sluice.webtools.fetch import fetch
from sluice.webtools.read import read
from sluice.webtools.request import request
from sluice.webtools.sitemap import sitemap
from sluice.webtools.store import SourceStore
from harness.loops import stop_loop_thread

pytestmark = pytest.mark.netns

ORIGIN = "1.1.1.1"
RULES, SERVER_ERROR, MISSING, REFUSED, FRESH = 8190, 8191, 8192, 8193, 8194
ROBOTS_TXT = b"""User-agent: *
Disallow: /

User-agent: Sluice
Disallow: /private/
Allow: /private/open$
"""
PAGE = (b"<html><head><title>Open</title></head><body><main><p>" + b"An open page of words. " * 20
        + b"</p></main></body></html>")
SITEMAP = (b'<urlset '
           b'xmlns="http://www.sitemaps.org/schemas/sitemap/0.9"><url><loc>https://a.example/</loc></url></urlset>')


class RobotsOrigin:
    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.requests: list[tuple[int, str, dict]] = []
        self.fresh_rule = b"/first"

    def start(self):
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)
        return self

    async def _start(self):
        self.servers = [await asyncio.start_server(self._handle, ORIGIN, port)
                        for port in (RULES, SERVER_ERROR, MISSING, REFUSED, FRESH)]

    def stop(self):
        stop_loop_thread(self.loop, self.thread, self.servers)

    def seen(self, port: int, path: str) -> int:
        return sum(1 for p, t, _ in self.requests if p == port and t == path)

    async def _handle(self, reader, writer):
        port = writer.get_extra_info("sockname")[1]
        try:
            while True:
                _, target, headers = await read_request_head(reader)
                path = "/" + target.split("://", 1)[1].split("/", 1)[1] if "://" in target else target
                self.requests.append((port, path, headers))
                status, ctype, body, extra = self._route(port, path)
                head = [f"HTTP/1.1 {status} X", f"Content-Type: {ctype}", f"Content-Length: {len(body)}", *extra]
                writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + body)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, OSError, ValueError):
            return
        finally:
            writer.close()

    def _route(self, port, path):
        if path == "/robots.txt":
            if port == RULES:
                return 200, "text/plain", ROBOTS_TXT, []
            if port == SERVER_ERROR:
                return 503, "text/plain", b"down", []
            if port == REFUSED:
                return 302, "text/plain", b"", ["Location: http://169.254.169.254/robots.txt"]
            if port == FRESH:
                rules = b"User-agent: Sluice\nDisallow: " + self.fresh_rule + b"\n"
                return 200, "text/plain", rules, ["Cache-Control: max-age=1"]
            return 404, "text/plain", b"no robots here", []
        if path == "/to-private":
            return 302, "text/plain", b"", [f"Location: http://{ORIGIN}:{RULES}/private/x"]
        if path == "/sitemap.xml" or path == "/private/sitemap.xml":
            return 200, "application/xml", SITEMAP, []
        if path.endswith(".json"):
            return 200, "application/json", b'{"ok": true}', []
        return 200, "text/html", PAGE, []


@pytest.fixture(scope="module")
def origin(netns):
    server = RobotsOrigin().start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def proxy(sluice_factory, origin):
    return sluice_factory(default_policy(ports=[RULES, SERVER_ERROR, MISSING, REFUSED, FRESH]), name="webtools-robots")


@pytest.fixture(autouse=True)
def fresh_cache():
    robots.CACHE.clear()
    yield
    robots.CACHE.clear()


@pytest.fixture
def client(proxy):
    with WebClient(env={"SLUICE_PROXY": proxy.proxy_url}) as c:
        yield c


def code(result: dict) -> str | None:
    return result.get("error", {}).get("code")


def test_disallowed_urls_are_refused_by_every_tool_with_the_rule(client, origin):
    base = f"http://{ORIGIN}:{RULES}"
    store = SourceStore(":memory:")
    ok = fetch(f"{base}/open", client=client, store=store, owner="a")
    assert ok["title"] == "Open", ok
    assert fetch(f"{base}/private/open", client=client, store=store, owner="a")["kind"] == "page"  # Allow ...$ wins
    for result in (fetch(f"{base}/private/x", client=client, store=store, owner="a"),
                   read(f"{base}/private/x", client=client),
                   request(f"{base}/private/x.json", client=client),
                   sitemap(f"{base}/private/sitemap.xml", client=client)):
        e = result["error"]
        assert e["code"] == "web_robots_disallowed" and e["rule"] == "Disallow: /private/", result
        assert e["robots_url"] == f"{base}/robots.txt"
    assert not any(p.startswith("/private/x") or p == "/private/sitemap.xml" for _, p, _ in origin.requests)
    assert origin.seen(RULES, "/robots.txt") == 1  # read once, then cached for the origin
    agent = next(h["user-agent"] for port, p, h in origin.requests if p == "/robots.txt")
    assert agent.startswith("Sluice/") and "+https://" in agent


def test_each_redirect_target_is_checked(client, origin):
    r = fetch(f"http://{ORIGIN}:{MISSING}/to-private", client=client, store=SourceStore(":memory:"), owner="a")
    assert code(r) == "web_robots_disallowed" and r["error"]["url"] == f"http://{ORIGIN}:{RULES}/private/x", r
    assert origin.seen(RULES, "/private/x") == 0


def test_ignore_turns_it_off(proxy, origin):
    asked = origin.seen(RULES, "/robots.txt")
    with WebClient(env={"SLUICE_PROXY": proxy.proxy_url, "SLUICE_WEB_ROBOTS": "ignore"}) as c:
        r = fetch(f"http://{ORIGIN}:{RULES}/private/x", client=c, store=SourceStore(":memory:"), owner="a")
    assert r["kind"] == "page" and origin.seen(RULES, "/private/x") == 1
    assert origin.seen(RULES, "/robots.txt") == asked  # not even asked
    with WebClient(env={"SLUICE_PROXY": proxy.proxy_url, "SLUICE_WEB_ROBOTS": "maybe"}) as c:
        assert code(fetch(f"http://{ORIGIN}:{RULES}/open", client=c,
                          store=SourceStore(":memory:"))) == "web_bad_argument"


def test_a_5xx_disallows_missing_and_refused_allow(client, origin, canaries):
    down = fetch(f"http://{ORIGIN}:{SERVER_ERROR}/page", client=client, store=SourceStore(":memory:"), owner="a")
    assert code(down) == "web_robots_disallowed" and down["error"]["rule"] == "robots.txt status 503", down
    assert origin.seen(SERVER_ERROR, "/page") == 0
    for port in (MISSING, REFUSED):
        r = fetch(f"http://{ORIGIN}:{port}/page", client=client, store=SourceStore(":memory:"), owner="a")
        assert r.get("title") == "Open", (port, r)
    canaries.assert_untouched()  # the refused robots.txt redirect went nowhere


def test_robots_freshness_is_honoured(client, origin):
    base = f"http://{ORIGIN}:{FRESH}"
    assert code(fetch(f"{base}/first", client=client, store=SourceStore(":memory:"))) == "web_robots_disallowed"
    origin.fresh_rule = b"/second"
    assert code(fetch(f"{base}/second", client=client, store=SourceStore(":memory:"))) is None  # still the cached rules
    time.sleep(1.2)
    assert code(fetch(f"{base}/second", client=client, store=SourceStore(":memory:"))) == "web_robots_disallowed"
    assert origin.seen(FRESH, "/robots.txt") == 2
