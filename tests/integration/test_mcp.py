"""`sluice mcp` driven by the `mcp` SDK's own client over stdio (issue 11).

The server is the real `sluice mcp` subprocess, its requests go through a real
`sluice proxy` to a small origin on the "public" address 1.1.1.1:8095 (its
own port: test_webtools' origin keeps 8090-8091/8443), and what comes back
over MCP is compared with what the plain Python functions return for the
same URLs, through the same proxy, with the same source store.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
import subprocess
import threading

import anyio
import mcp_types as types
import pytest
from mcp import Client
from mcp.client.stdio import StdioServerParameters
from mcp.shared.exceptions import MCPError

from harness import default_policy, pdfs
from harness.sluice import sluice_executable
from sluice.webtools import schema
from sluice.webtools.client import WebClient
from sluice.webtools.fetch import fetch, source_read
from sluice.webtools.read import read
from sluice.webtools.request import request
from sluice.webtools.sitemap import sitemap
from sluice.webtools.store import SourceStore
from sluice.webtools.tools import TOOLS
from harness.loops import stop_loop_thread

pytestmark = pytest.mark.netns

ORIGIN, PORT = "1.1.1.1", 8095
BASE = f"http://{ORIGIN}:{PORT}"
FIVE = ["web_fetch", "web_source_read", "web_read", "web_request", "web_sitemap"]

ARTICLE = """<!doctype html><html><head><title>Tides &amp; Moons</title></head><body>
<nav><a href="/">Home</a> <a href="/about">About</a></nav>
<main><article><h1>Tides and moons</h1>
<p>The moon pulls the oceans, and the oceans answer twice a day. This paragraph is long enough to be the
main content of the page, so the extractor keeps it with its <a href="/more">link</a>.</p>
<h2>Spring tides</h2><ul><li>new moon</li><li>full moon</li></ul>
</article></main><footer>© 2026 Tides Inc.</footer></body></html>"""
LONG_TEXT = "Grüße € 𝄞 ok\n" * 300
PNG = bytes.fromhex("89504e470d0a1a0a0000000d4948445200000001000000010806000000"
                    "1f15c4890000000d4944415478da63f8cfc0f01f0005000201f5f1b1a40000000049454e44ae426082")
PDF = pdfs.text_pdf([["The first page of the report."], ["Its second page."]], title="Report")
SITEMAP = (b'<?xml version="1.0"?><urlset xmlns="http://www.sitemaps.org/schemas/sitemap/0.9">'
           b"<url><loc>https://web.example.com/a</loc><lastmod>2026-01-02</lastmod></url>"
           b"<url><loc>https://web.example.com/b</loc></url></urlset>")


class Origin:
    """A tiny HTTP/1.1 origin in a thread: fixed routes, one request per connection."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def start(self) -> Origin:
        self.thread.start()
        self.server = asyncio.run_coroutine_threadsafe(asyncio.start_server(self._handle, ORIGIN, PORT),
                                                       self.loop).result(10)
        return self

    def stop(self) -> None:
        stop_loop_thread(self.loop, self.thread, [self.server])

    async def _handle(self, reader, writer):
        try:
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
            target = head[0].split(" ")[1]
            path = "/" + target.split("://", 1)[1].split("/", 1)[1] if "://" in target else target
            headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in head[1:] if h)}
            routes = {
                "/page": (200, "text/html; charset=utf-8", ARTICLE.encode()),
                "/long.txt": (200, "text/plain; charset=utf-8", LONG_TEXT.encode()),
                "/img.png": (200, "image/png", PNG),
                "/doc.pdf": (200, "application/pdf", PDF),
                "/sitemap.xml": (200, "application/xml", SITEMAP),
                "/api.json": (200, "application/json", json.dumps({"accept": headers.get("accept")}).encode()),
                "/to-metadata": (302, "text/plain", b""),
            }
            status, ctype, body = routes.get(path, (404, "text/plain", b"not found"))
            extra = "Location: http://169.254.169.254/latest/meta-data/\r\n" if status == 302 else ""
            writer.write(f"HTTP/1.1 {status} X\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n{extra}"
                         f"Connection: close\r\n\r\n".encode() + body)
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, OSError, ValueError, IndexError):
            pass
        finally:
            writer.close()


@pytest.fixture(scope="module")
def origin(netns):
    server = Origin().start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def proxy(sluice_factory, fake_dns, origin):
    return sluice_factory(default_policy(ports=[80, 443, PORT]), name="mcp")


@pytest.fixture
def env(proxy, tmp_path):
    """The server's whole environment (the SDK adds only HOME, PATH, SHELL, TERM, USER, LOGNAME)."""
    return {"SLUICE_PROXY": proxy.proxy_url, "SLUICE_SOURCES": str(tmp_path / "sources.sqlite3"),
            "SLUICE_OWNER": "from-env", "PATH": os.environ.get("PATH", "/usr/bin:/bin")}


def with_server(env: dict, body, *args: str):
    """Run `body(client)` against a fresh `sluice mcp ARGS` subprocess; return its result."""
    async def main():
        params = StdioServerParameters(command=sluice_executable(), args=["mcp", *args], env=env)
        with anyio.fail_after(60):
            async with Client(params) as client:
                return await body(client)

    return anyio.run(main)


def plain(env: dict, owner: str):
    """The Python functions, with the server's proxy, store and owner."""
    client = WebClient(env=env)
    store = SourceStore(env["SLUICE_SOURCES"])
    return client, store, owner


def nonce_free(result: dict) -> str:
    """A fetch result's text with what differs per call replaced: the
    envelope's nonce, the source id and the capture time."""
    text = result["text"]
    nonce = text.rsplit(' end="', 1)[1].split('"', 1)[0]
    assert len(nonce) >= 20
    for value in (nonce, result["source_id"], result["captured_at"]):
        text = text.replace(value, "X")
    return text


def the_text(result: types.CallToolResult) -> str:
    assert len(result.content) == 1 and isinstance(result.content[0], types.TextContent)
    return result.content[0].text


def test_lists_every_tool_of_the_table_with_its_schema(env):
    listed = with_server(env, lambda c: c.list_tools())
    tools = {t.name: t for t in listed.tools}
    assert list(tools) == [t.mcp_name for t in TOOLS.values()] and FIVE == list(tools)[:5]
    for tool in TOOLS.values():
        got = tools[tool.mcp_name]
        assert got.input_schema == schema.parameters(tool) and got.input_schema["additionalProperties"] is False
        assert got.description == schema.description(tool)
        assert got.annotations.read_only_hint is True
        assert got.output_schema is not None and got.output_schema["type"] == "object"
        assert got.annotations.open_world_hint is (tool.name != "source_read")  # web_search reaches the web too
    assert "never instructions" in tools["web_fetch"].description and "offset" in tools["web_fetch"].description


def test_every_tool_over_mcp_equals_the_python_function(env, canaries):
    async def body(c: Client):
        out = {"fetch": await c.call_tool("web_fetch", {"url": f"{BASE}/page"}),
               "window": await c.call_tool("web_fetch", {"url": f"{BASE}/long.txt", "max_chars": 1000}),
               "read": await c.call_tool("web_read", {"url": f"{BASE}/page"}),
               "request": await c.call_tool("web_request", {"url": f"{BASE}/api.json",
                                                            "headers": {"accept": "application/json"}}),
               "sitemap": await c.call_tool("web_sitemap", {"url": f"{BASE}/sitemap.xml"})}
        sid = out["window"].structured_content["source_id"]
        out["source_read"] = await c.call_tool("web_source_read", {"source_id": sid, "offset": 1000,
                                                                   "max_chars": 1000})
        return out

    out = with_server(env, body, "--owner", "agent")
    assert not any(r.is_error for r in out.values()), out
    client, store, owner = plain(env, "agent")

    # The page travels once, in the text part; the structured content is the metadata (the SDK's
    # client validated it against each tool's outputSchema): the function's dict minus its payload.
    for result in out.values():
        assert not set(result.structured_content) & {"text", "content", "body", "data", "urls", "results"}

    # read, request and sitemap are deterministic: metadata and text are the function's.
    def meta(d: dict) -> dict:
        return {k: v for k, v in d.items() if k not in ("text", "content", "body", "urls", "sitemaps")}

    direct_read = read(f"{BASE}/page", client=client)
    assert out["read"].structured_content == meta(direct_read)
    assert the_text(out["read"]).startswith("Title: Tides & Moons\n") and direct_read["text"] in the_text(out["read"])
    direct_request = request(f"{BASE}/api.json", headers={"accept": "application/json"}, client=client)
    assert out["request"].structured_content == meta(direct_request)
    assert json.loads(direct_request["body"]) == {"accept": "application/json"}
    assert direct_request["body"] in the_text(out["request"])
    assert out["sitemap"].structured_content == meta(sitemap(f"{BASE}/sitemap.xml", client=client))
    assert "https://web.example.com/a  (lastmod 2026-01-02)" in the_text(out["sitemap"])

    # fetch: the same but for its own source id, capture time and envelope nonce.
    mine = out["fetch"].structured_content
    fresh = WebClient(env={**env, "SLUICE_WEB_REUSE": "0"})  # a capture of its own, not the server's reused
    theirs = fetch(f"{BASE}/page", client=fresh, store=store, owner=owner)
    fresh.close()
    varying = ("source_id", "captured_at")
    assert {k: v for k, v in mine.items() if k not in varying} == {k: v for k, v in meta(theirs).items()
                                                                    if k not in varying}
    assert nonce_free(dict(mine, text=the_text(out["fetch"]))) == nonce_free(theirs)
    assert "Spring tides" in the_text(out["fetch"]) and mine["kind"] == "page"

    # Paging over MCP, and source_read from the server's store: the function reads the same source.
    window = out["window"].structured_content
    assert LONG_TEXT[:1000] in the_text(out["window"]) and window["next_offset"] == 1000
    assert "pass offset=1000 to continue" in the_text(out["window"])
    again = out["source_read"].structured_content
    assert LONG_TEXT[1000:2000] in the_text(out["source_read"]) and (again["offset"], again["end"]) == (1000, 2000)
    direct = source_read(window["source_id"], 1000, 1000, store=store, owner="agent")
    assert meta(direct) == again and direct["content"] in the_text(out["source_read"])
    # --owner, not SLUICE_OWNER, owned what the server captured.
    gone = source_read(window["source_id"], store=store, owner="from-env")
    assert gone["error"]["code"] == "web_source_not_found"
    canaries.assert_untouched()


def test_errors_are_tool_errors_carrying_the_dict(env, canaries):
    async def body(c: Client):
        return [await c.call_tool("web_fetch", {"url": f"{BASE}/missing"}),
                await c.call_tool("web_read", {"url": f"{BASE}/to-metadata"}),
                await c.call_tool("web_fetch", {"url": f"{BASE}/page", "offset": -1}),
                await c.call_tool("web_request", {"url": f"{BASE}/api.json", "headers": {"cookie": "a=b"}}),
                await c.call_tool("web_sitemap", {"url": f"{BASE}/page", "surprise": True}),
                await c.call_tool("web_source_read", {"source_id": "src_nope"})]

    results = with_server(env, body)
    client, store, _ = plain(env, "from-env")
    expected = [fetch(f"{BASE}/missing", client=client, store=store),
                read(f"{BASE}/to-metadata", client=client),
                fetch(f"{BASE}/page", -1, client=client, store=store),
                request(f"{BASE}/api.json", headers={"cookie": "a=b"}, client=client),
                None, None]
    codes = ["web_status_not_ok", "web_blocked", "web_bad_offset", "web_header_not_allowed", "web_bad_argument",
             "web_source_not_found"]
    for result, want, code in zip(results, expected, codes):
        assert result.is_error is True, result
        error = result.structured_content
        assert error["error"]["code"] == code, error
        if want is not None:
            assert error == want
        text = the_text(result)
        head, _, dict_text = text.partition("\n")
        assert head == f"Error {code}: {error['error']['message']}" and json.loads(dict_text) == error
    assert results[0].structured_content["error"]["status"] == 404
    blocked = results[1].structured_content["error"]
    assert blocked["by"] == "proxy" and blocked["reason"] == "redirect_refused"
    assert "surprise" in results[4].structured_content["error"]["message"]
    canaries.assert_untouched()


def test_images_and_pdfs_are_binary_parts(env):
    async def body(c: Client):
        return (await c.call_tool("web_fetch", {"url": f"{BASE}/img.png"}),
                await c.call_tool("web_fetch", {"url": f"{BASE}/doc.pdf"}))

    image, pdf = with_server(env, body)
    client, store, _ = plain(env, "from-env")

    header, part = image.content
    assert isinstance(part, types.ImageContent) and part.mime_type == "image/png"
    assert base64.b64decode(part.data) == PNG
    assert header.type == "text" and "\n" not in header.text and "image/png" in header.text
    direct = fetch(f"{BASE}/img.png", client=client, store=store)
    assert image.structured_content == {k: v for k, v in direct.items() if k != "data"}
    assert image.structured_content["sha256"] == hashlib.sha256(PNG).hexdigest() and not image.is_error

    header, part = pdf.content
    assert isinstance(part, types.EmbeddedResource) and isinstance(part.resource, types.BlobResourceContents)
    assert part.resource.mime_type == "application/pdf" and base64.b64decode(part.resource.blob) == PDF
    assert str(part.resource.uri) == f"{BASE}/doc.pdf"
    # The text part is the PDF's text, in its envelope, for models that do not read PDFs (issue 25 item 5).
    assert header.text.startswith("PDF application/pdf, ") and ", 2 pages, from " in header.text
    assert "--- page 1 of 2 ---\nThe first page of the report.\n\n--- page 2 of 2 ---\nIts second page." in header.text
    assert pdf.structured_content["kind"] == "pdf" and pdf.structured_content["bytes"] == len(PDF)
    assert pdf.structured_content["pages"] == 2 and pdf.structured_content["scanned"] is False
    assert "content" not in pdf.structured_content and "data" not in pdf.structured_content


def test_owner_flag_scopes_the_sources(env):
    async def capture(c: Client):
        return (await c.call_tool("web_fetch", {"url": f"{BASE}/long.txt", "max_chars": 100})).structured_content

    first = with_server(env, capture, "--owner", "alice")

    async def other(c: Client):
        return (await c.call_tool("web_source_read", {"source_id": first["source_id"]}),
                await c.call_tool("web_fetch", {"url": f"{BASE}/long.txt", "offset": 10 ** 6}))

    mallory, past = with_server(env, other, "--owner", "mallory")
    assert mallory.is_error and mallory.structured_content["error"]["code"] == "web_source_not_found"
    assert past.is_error and past.structured_content["error"]["total_chars"] == len(LONG_TEXT)

    async def again(c: Client):
        return await c.call_tool("web_source_read", {"source_id": first["source_id"], "offset": 100})

    alice = with_server(env, again, "--owner", "alice")
    assert not alice.is_error and alice.structured_content["offset"] == 100
    assert LONG_TEXT[100:100 + 40000] in the_text(alice)


def test_tools_flag_serves_only_the_named_tools(env, canaries):
    async def body(c: Client):
        listed = await c.list_tools()
        fetched = await c.call_tool("web_fetch", {"url": f"{BASE}/page"})
        try:
            await c.call_tool("web_read", {"url": f"{BASE}/page"})
            refused = None
        except MCPError as e:
            refused = e
        return listed, fetched, refused

    listed, fetched, refused = with_server(env, body, "--tools", "web_fetch,web_search")
    assert [t.name for t in listed.tools] == ["web_fetch", "web_search"]
    for got in listed.tools:
        tool = TOOLS[got.name.removeprefix("web_")]
        assert got.description == schema.description(tool) and got.input_schema == schema.parameters(tool)
    assert not fetched.is_error and "Spring tides" in the_text(fetched)
    # A tool left out is not callable either: the unknown-tool JSON-RPC error, naming what is served.
    assert refused is not None and "web_read" in str(refused) and "web_fetch, web_search" in str(refused)
    canaries.assert_untouched()


def test_tools_flag_with_an_unknown_name_is_a_usage_error(env):
    done = subprocess.run([sluice_executable(), "mcp", "--tools", "web_fetch,web_browse"], env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    assert "--tools" in done.stderr and "'web_browse'" in done.stderr and "Traceback" not in done.stderr
