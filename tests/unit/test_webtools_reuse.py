"""Repeat fetches (issue 25 item 9): the owner's source of the same URL,
captured within SLUICE_WEB_REUSE, is returned with no request."""

from __future__ import annotations

import time

import httpx

from harness import pdfs
from sluice.webtools.client import Fetched, WebToolLimits
from sluice.webtools.fetch import DEFAULT_REUSE_SECONDS, fetch, reuse_key, reuse_seconds
from sluice.webtools.store import SourceStore


class CountingClient:
    """Answers every URL with a text page (or a PDF) and counts the requests (no network)."""

    limits = WebToolLimits()

    def __init__(self, env=None, body=b"the page, version 1", mime="text/plain"):
        self.env, self.body, self.mime, self.urls = env or {}, body, mime, []

    def request(self, url, *, classify, **kwargs):
        self.urls.append(url)
        return Fetched(url, url, 200, self.mime, self.mime, None, httpx.Headers(), self.body)


def test_a_repeat_fetch_returns_the_stored_source_and_sends_nothing():
    store, client = SourceStore(":memory:"), CountingClient()
    first = fetch("https://a.example/p", client=client, store=store, owner="o")
    client.body = b"the page, version 2"
    again = fetch("HTTPS://A.example:443/p#part", 3, 5, client=client, store=store, owner="o")
    assert client.urls == ["https://a.example/p"] and first["cached"] is False and again["cached"] is True
    assert again["source_id"] == first["source_id"] and again["captured_at"] == first["captured_at"]
    assert again["content"] == " page" and again["offset"] == 3  # "the page, version 1"[3:8]
    assert f"[cached: this owner fetched it at {first['captured_at']}, less than 300 s ago" in again["text"]
    assert "[cached" not in first["text"]
    # Another owner, another URL: each a request of its own.
    assert fetch("https://a.example/p", client=client, store=store, owner="other")["cached"] is False
    assert fetch("https://a.example/p?q=1", client=client, store=store, owner="o")["cached"] is False
    assert len(client.urls) == 3


def test_reuse_off_and_expired():
    store = SourceStore(":memory:")
    off = CountingClient(env={"SLUICE_WEB_REUSE": "0"})
    for _ in range(3):
        assert fetch("https://a.example/p", client=off, store=store, owner="o")["cached"] is False
    assert len(off.urls) == 3
    short = CountingClient(env={"SLUICE_WEB_REUSE": "300ms"})
    fetch("https://a.example/q", client=short, store=store, owner="o")
    assert fetch("https://a.example/q", client=short, store=store, owner="o")["cached"] is True
    time.sleep(0.4)
    assert fetch("https://a.example/q", client=short, store=store, owner="o")["cached"] is False
    assert len(short.urls) == 2


def test_a_pdf_reused_is_its_text_without_the_pdf_again():
    store = SourceStore(":memory:")
    client = CountingClient(body=pdfs.text_pdf([["one page"]]), mime="application/pdf")
    first = fetch("https://a.example/d.pdf", client=client, store=store, owner="o")
    again = fetch("https://a.example/d.pdf", client=client, store=store, owner="o")
    assert "data" in first and "data" not in again and again["kind"] == "pdf" and again["cached"] is True
    assert again["content"] == first["content"] == "--- page 1 of 1 ---\none page" and len(client.urls) == 1


def test_images_are_not_stored_so_never_reused():
    png = bytes.fromhex("89504e470d0a1a0a") + b"\0" * 32
    client = CountingClient(body=png, mime="image/png")
    store = SourceStore(":memory:")
    for _ in range(2):
        assert fetch("https://a.example/i.png", client=client, store=store, owner="o")["kind"] == "image"
    assert len(client.urls) == 2


def test_the_setting_and_the_key():
    assert reuse_seconds({}) == DEFAULT_REUSE_SECONDS == 300 and reuse_seconds({"SLUICE_WEB_REUSE": "2m"}) == 120
    assert reuse_seconds({"SLUICE_WEB_REUSE": "0"}) == 0
    r = fetch("https://a.example/p", client=CountingClient(env={"SLUICE_WEB_REUSE": "soon"}),
              store=SourceStore(":memory:"), owner="o")
    assert r["error"]["code"] == "web_bad_argument" and "SLUICE_WEB_REUSE" in r["error"]["message"], r
    assert reuse_key("https://A.EXAMPLE:443/x?y#z", rendered=False) == "plain https://a.example/x?y"
    assert reuse_key("https://a.example/x", rendered=True) == "rendered https://a.example/x"
    assert reuse_key("http://10.0.0.1/", rendered=False) is None  # never requested: fetch says why
    assert reuse_key("not a url", rendered=False) is None


def test_a_failed_fetch_is_not_reused():
    store = SourceStore(":memory:")

    class Failing(CountingClient):
        def request(self, url, *, classify, **kwargs):
            self.urls.append(url)
            return classify(Fetched(url, url, 503, "text/plain", "text/plain", None, httpx.Headers(), b"down"))

    client = Failing()
    for _ in range(2):
        assert fetch("https://a.example/p", client=client, store=store,
                     owner="o")["error"]["code"] == "web_status_not_ok"
    assert len(client.urls) == 2
