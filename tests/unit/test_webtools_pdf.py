"""A PDF's text (webtools.pdf, issue 25 item 5): page markers, scans, caps,
and hostile PDFs (a decompression bomb, a looping page tree, deep nesting)
that cost at most the deadline, in a child process that is killed there."""

from __future__ import annotations

import base64
import sqlite3
import time

import httpx
import pytest

from harness import pdfs
from sluice.webtools import mcp_server, pdf
from sluice.webtools.client import Fetched, WebToolLimits
from sluice.webtools.fetch import fetch, source_read
from sluice.webtools.store import SourceStore
from sluice.webtools.tools import TOOLS, render

LINES = [["Tides and moons", "The moon pulls the oceans (twice a day)."], ["Spring tides", "Neap tides: between."],
         ["Last page"]]


def test_text_of_every_page_after_its_marker():
    got = pdf.extract(pdfs.text_pdf(LINES, title="Tides"), seconds=15, max_chars=100_000)
    assert got.text == ("--- page 1 of 3 ---\nTides and moons\nThe moon pulls the oceans (twice a day).\n\n"
                        "--- page 2 of 3 ---\nSpring tides\nNeap tides: between.\n\n--- page 3 of 3 ---\nLast page")
    assert (got.pages, got.pages_read, got.incomplete, got.scanned, got.title) == (3, 3, None, False, "Tides")


def test_a_scan_says_so():
    got = pdf.extract(pdfs.image_only_pdf(3), seconds=15, max_chars=100_000)
    assert got.text == "" and got.scanned is True and got.pages == got.pages_read == 3 and got.incomplete is None


def test_page_and_character_caps():
    many = pdfs.text_pdf([[f"page number {i}"] for i in range(1, 41)])
    got = pdf.extract(many, seconds=15, max_chars=100_000, max_pages=10)
    assert (got.pages, got.pages_read, got.incomplete) == (40, 10, "page_cap")
    assert got.text.endswith("--- page 10 of 40 ---\npage number 10") and not got.scanned
    small = pdf.extract(many, seconds=15, max_chars=200)
    assert len(small.text) <= 200 and small.incomplete == "char_cap" and small.text.startswith("--- page 1 of 40 ---")


@pytest.mark.parametrize("hostile", ["bomb", "loop", "deep", "garbage"])
def test_hostile_pdfs_are_bounded_and_never_raise(hostile):
    data = {"bomb": pdfs.bomb_pdf, "loop": pdfs.looping_pdf, "deep": pdfs.deep_pdf,
            "garbage": lambda: b"%PDF-1.7\n" + bytes(range(256)) * 100}[hostile]()
    started = time.monotonic()
    got = pdf.extract(data, seconds=8, max_chars=100_000)
    assert time.monotonic() - started < 9
    assert got.text == "" and not got.scanned, got  # nothing to read, and not mistaken for a scan


# A child under the real limits (webtools.pdf._limit) that then needs a gigabyte.
GREEDY_CHILD = """
import sys
from sluice.webtools.pdf import _limit
_limit(int(sys.argv[3]), int(sys.argv[4]))
sys.stdin.buffer.read()
print('{"pages": 2, "title": null}', flush=True)
print('{"page": 1, "text": "one"}', flush=True)
hog = bytearray(1 << 30)
"""


def test_the_memory_limit_holds_and_keeps_the_pages_done(monkeypatch):
    monkeypatch.setattr(pdf, "WORKER", ["-c", GREEDY_CHILD])
    got = pdf.extract(b"%PDF-1.7", seconds=8, max_chars=100_000, memory=256 * 1024 * 1024)
    assert (got.text, got.pages_read, got.incomplete) == ("--- page 1 of 2 ---\none", 1, "memory"), got


# A child that writes two pages, then hangs (as a parser in an endless loop does).
HANGING_CHILD = """
import sys, time
sys.stdin.buffer.read()
for line in ('{"pages": 3, "title": null}', '{"page": 1, "text": "one"}', '{"page": 2, "text": "two"}'):
    print(line, flush=True)
time.sleep(60)
"""


def test_the_deadline_kills_the_child_and_keeps_the_pages_done(monkeypatch):
    monkeypatch.setattr(pdf, "WORKER", ["-c", HANGING_CHILD])
    started = time.monotonic()
    got = pdf.extract(b"%PDF-1.7", seconds=2, max_chars=100_000)
    assert 1.9 < time.monotonic() - started < 6
    assert (got.text, got.pages, got.pages_read, got.incomplete) == (
        "--- page 1 of 3 ---\none\n\n--- page 2 of 3 ---\ntwo", 3, 2, "deadline")
    assert not got.scanned
    # A line the kill cut short is dropped; no time left at all reads nothing.
    cut = pdf._assemble(b'{"pages": 3, "title": null}\n{"page": 1, "text": "one"}\n{"page": 2, "te',
                        timed_out=True, returncode=-9, max_chars=1000)
    assert (cut.text, cut.pages_read, cut.incomplete) == ("--- page 1 of 3 ---\none", 1, "deadline")
    assert pdf.extract(b"%PDF-1.7", seconds=0, max_chars=100_000).incomplete == "deadline"


def test_encrypted_without_the_empty_password_is_said():
    pypdf = pytest.importorskip("pypdf")
    import io

    writer = pypdf.PdfWriter(clone_from=pypdf.PdfReader(io.BytesIO(pdfs.text_pdf(LINES))))
    writer.encrypt(user_password="secret", algorithm="RC4-128")
    out = io.BytesIO()
    writer.write(out)
    got = pdf.extract(out.getvalue(), seconds=15, max_chars=100_000)
    assert got.text == "" and got.incomplete == "encrypted" and not got.scanned


class PdfClient:
    """A client that answers every URL with one PDF (no network)."""

    limits = WebToolLimits()

    def __init__(self, body: bytes):
        self.body = body

    def request(self, url, *, classify, **kwargs):
        return Fetched(url, url, 200, "application/pdf", "application/pdf", None, httpx.Headers(), self.body)


def test_fetch_returns_the_pdf_and_its_text_windowed_and_stored():
    store = SourceStore(":memory:")
    data = pdfs.text_pdf(LINES, title="Tides")
    r = fetch("https://a.example/t.pdf", 0, 40, client=PdfClient(data), store=store, owner="o")
    assert r["kind"] == "pdf" and base64.b64decode(r["data"]) == data and r["bytes"] == len(data)
    assert r["pages"] == r["pages_read"] == 3 and r["scanned"] is False and r["text_incomplete"] is None
    assert r["content"] == "--- page 1 of 3 ---\nTides and moons\nThe " and r["next_offset"] == 40
    assert r["text"].startswith("PDF application/pdf, ") and ", 3 pages, from https://a.example/t.pdf" in r["text"]
    assert "pass offset=40 to continue" in r["text"] and "<page url=" in r["text"]
    assert render("web_fetch", r) == r["text"]  # function calling gets the text; the PDF goes as its own part
    rest = source_read(r["source_id"], 40, 10_000, store=store, owner="o")
    assert rest["kind"] == "pdf" and "data" not in rest and rest["pages"] == 3
    assert r["content"] + rest["content"] == pdf.extract(data, seconds=15, max_chars=100_000).text
    assert rest["text"].startswith("PDF text, 3 pages, from https://a.example/t.pdf")
    answer = mcp_server.to_call_result(TOOLS["fetch"], r)
    text, part = answer.content
    assert text.text == r["text"] and base64.b64decode(part.resource.blob) == data
    assert answer.structured_content["pages"] == 3 and "content" not in answer.structured_content


def test_fetch_of_a_scan_says_it_has_no_text_layer():
    r = fetch("https://a.example/scan.pdf", client=PdfClient(pdfs.image_only_pdf()), store=SourceStore(":memory:"),
              owner="o")
    assert r["kind"] == "pdf" and r["content"] == "" and r["scanned"] is True and r["total_chars"] == 0
    assert "no text layer: its pages are images (a scan)" in r["text"] and "attached" in r["text"]


def test_fetch_of_an_unreadable_pdf_still_returns_the_pdf():
    data = b"%PDF-1.4\n1 0 obj<<>>endobj\ntrailer<<>>\n%%EOF\n"
    r = fetch("https://a.example/broken.pdf", client=PdfClient(data), store=SourceStore(":memory:"), owner="o")
    assert r["kind"] == "pdf" and base64.b64decode(r["data"]) == data and r["text_incomplete"] == "unreadable"
    assert "[incomplete text: its text cannot be read" in r["text"] and r["scanned"] is False


def test_an_older_store_gains_the_new_columns(tmp_path):
    path = tmp_path / "old.sqlite3"
    db = sqlite3.connect(path)
    db.executescript("""CREATE TABLE sources (id TEXT PRIMARY KEY, owner TEXT NOT NULL, created REAL NOT NULL,
        captured_at TEXT NOT NULL, url TEXT NOT NULL, final_url TEXT NOT NULL, status INTEGER NOT NULL,
        content_type TEXT NOT NULL, title TEXT, needs_javascript INTEGER NOT NULL, truncated INTEGER NOT NULL,
        size INTEGER NOT NULL, content TEXT NOT NULL);""")
    db.execute("INSERT INTO sources VALUES ('src_old', 'o', ?, 'then', 'u', 'u', 200, 'text/plain', NULL, 0, 0, 9, "
               "'old')",
               (time.time(),))
    db.commit()
    db.close()
    store = SourceStore(str(path))
    old = store.get("o", "src_old")
    assert old["kind"] == "page" and old["extra"] == {} and old["hidden_chars"] == 0 and old["content"] == "old"
    r = fetch("https://a.example/t.pdf", client=PdfClient(pdfs.text_pdf(LINES)), store=store, owner="o")
    assert store.get("o", r["source_id"])["extra"]["pages"] == 3
