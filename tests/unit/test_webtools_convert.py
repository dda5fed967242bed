"""webtools.convert: main content as markdown, visible text, decoding, hostile input.

The realistic pages under tests/data/webtools/ (a news article, a docs page,
a forum thread, a product page) each come with the text that must survive and
the boilerplate that must not.
"""

from __future__ import annotations

import random
import re
import time
from pathlib import Path

import pytest

from sluice.webtools.convert import Converted, decode_html, html_to_markdown, visible_text

ROOT = Path(__file__).resolve().parents[2]
PAGES = ROOT / "tests" / "data" / "webtools"
BASE = "https://site.example/guide/page.html"


def page(name: str) -> Converted:
    return html_to_markdown((PAGES / f"{name}.html").read_bytes(), BASE)


def squash(s: str) -> str:
    return re.sub(r"\s+", " ", s)


# --- the realistic pages -----------------------------------------------------------

CASES = {
    "article": (
        ["# Harbour town votes to restore its tidal mill",
         "ending a decade of argument about what to do with the listed building",
         "## How a tidal mill works",
         "- High tide fills the mill pond through a one-way gate.",
         "[as it did for two hundred years](https://site.example/news/mill-history)",
         "[restoration diary](https://mill.example.org/diary)"],
        ["cookies", "Subscribe today", "Most read", "Advertisement", "Copyright 2024", "Privacy policy",
         "Skip to content", "Sign up", "dataLayer", "Share on Facebook", "Harbour wall repairs"],
    ),
    "docs": (
        ["# Configuring retries", "## Options", "| total | 3 | Maximum number of retries |",
         "pool = Pool(retry=Retry(total=3, backoff=0.5))",
         "[Retry](https://site.example/api/retry.html#tidepool.Retry)",
         "1. Set `methods=None`."],
        ["Table of contents", "Installation", "Changelog", "Search docs", "Built with a documentation generator",
         "searchtools"],
    ),
    "forum": (
        ["My rye starter is ten days old", "ethyl acetate. Feed it more often",
         "That is a healthy rise for a ten-day-old starter.", "the smell was gone within two days"],
        ["This forum uses cookies", "Log in", "Register", "Similar threads", "Forum rules", "Write a reply",
         "forumConfig"],
    ),
    "product": (
        ["# Trailhead 40L Hiking Backpack", "129.00 dollars", "- Ventilated trampoline back panel",
         "| Weight | 1.1 kg |", "[pack fitting guide](https://site.example/guides/pack-fitting)"],
        ["We value your privacy", "Free shipping", "Add to cart", "Store finder", "You may also like",
         "Summit 28L Daypack", "Cart (0)"],
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_main_content_kept_and_boilerplate_removed(name):
    c = page(name)
    kept, removed = CASES[name]
    for want in kept:
        assert want in c.markdown, f"{name}: lost {want!r}\n{c.markdown}"
    for unwanted in removed:
        assert unwanted not in c.markdown, f"{name}: kept {unwanted!r}\n{c.markdown}"
    assert c.needs_javascript is False


def test_titles():
    assert page("article").title == "Harbour town votes to restore its tidal mill | Coastal Courier"
    assert page("docs").title == "Configuring retries — tidepool 3.2 documentation"


def test_code_blocks_are_fenced_and_keep_their_lines():
    md = page("docs").markdown
    block = re.search(r"```[a-z]*\n(.*?)\n```", md, re.S)
    assert block, md
    assert "from tidepool import Pool, Retry" in block.group(1)
    assert 'response = pool.get("https://api.example/items")' in block.group(1)


def test_links_are_absolute_against_base_url_and_base_href():
    html = b'<html><head><base href="/docs/v2/"></head><body><article><h1>Links</h1>' \
           b'<p>' + b"Some words about the subject of this page, enough to be content. " * 8 + \
           b'Read <a href="intro.html">the intro</a> and <a href="https://other.example/x">that</a>.</p>' \
           b'</article></body></html>'
    md = html_to_markdown(html, "https://docs.example/a/b").markdown
    assert "[the intro](https://docs.example/docs/v2/intro.html)" in md
    assert "[that](https://other.example/x)" in md


def test_fallback_reducer_keeps_structure_when_the_extractor_finds_little():
    # A short page (under the extractor's minimum): Sluice's own reducer + html2text.
    html = ("<html><body><nav><a href='/'>Home</a><a href='/x'>X</a></nav>"
            "<div class='content'><h2>Install</h2><pre><code class='language-sh'>pip install tidepool\n\n"
            "tidepool --version</code></pre><ul><li>one</li><li>two</li></ul>"
            "<table><tr><th>k</th><th>v</th></tr><tr><td>a</td><td>1</td></tr></table>"
            "<p>See <a href='/more'>more</a>.</p></div><footer>Copyright</footer></body></html>")
    md = html_to_markdown(html, "https://t.example/p/").markdown
    assert "## Install" in md
    assert "```sh\npip install tidepool\n\ntidepool --version\n```" in md
    assert "one" in md and "two" in md
    assert re.search(r"k ?\| ?v", md) and re.search(r"a ?\| ?1", md)
    assert "[more](https://t.example/more)" in md
    assert "Copyright" not in md


# --- needs_javascript --------------------------------------------------------------


def test_app_shell_needs_javascript():
    shell = (b'<!doctype html><html><head><title>Dashboard</title><script src="/static/js/main.4f1a.js"></script>'
             b'</head><body><noscript>You need to enable JavaScript to run this app.</noscript>'
             b'<div id="root"></div><script>window.__INITIAL__={}</script></body></html>')
    c = html_to_markdown(shell, "https://app.example/")
    assert c.needs_javascript is True
    assert c.title == "Dashboard"
    assert "enable JavaScript" not in c.markdown


def test_short_page_without_scripts_does_not_need_javascript():
    c = html_to_markdown(b"<html><body><p>Moved to the new site.</p></body></html>")
    assert c.needs_javascript is False
    assert "Moved to the new site." in c.markdown


def test_real_pages_with_scripts_do_not_need_javascript():
    assert page("article").needs_javascript is False  # it has scripts, and plenty of text


# --- visible_text ------------------------------------------------------------------


def test_visible_text_rules():
    html = (b"<html><head><title>  The\n  Title </title><style>p{color:red}</style>"
            b"<script>var secret = 'not text';</script></head><body>\n"
            b"<h1>Heading</h1><p>First   line\n\tsecond\xc2\xa0line</p><template><p>tmpl</p></template>"
            b"<div>A<span>B</span> C</div><ul><li>one</li><li>two</li></ul>"
            b"<input type='hidden' value='x'><!-- a comment --><script>alert(1)</script>tail</body></html>")
    title, text = visible_text(html)
    assert title == "The Title"
    assert text == "Heading First line second line AB C one two tail"
    assert "Title" not in text and "secret" not in text and "tmpl" not in text and "comment" not in text


def test_visible_text_without_title_and_empty():
    assert visible_text(b"<p>just text</p>") == (None, "just text")
    assert visible_text(b"<html><head><title>  </title></head><body></body></html>") == (None, "")
    assert visible_text(b"") == (None, "")


def test_visible_text_changes_only_with_the_words():
    a = b"<html><head><script src='/app.1.js'></script></head><body><p>Same words here.</p></body></html>"
    b = (b"<html><head><script src='/app.2.js'></script></head><body>\n<div><p>Same   "
         b"words\nhere.</p></div></body></html>")
    assert visible_text(a) == visible_text(b)


# --- encodings ---------------------------------------------------------------------


def test_given_encoding_wins():
    html = "<html><head><meta charset='utf-8'></head><body><p>Crème brûlée</p></body></html>".encode("cp1252")
    assert visible_text(html, encoding="windows-1252")[1] == "Crème brûlée"


def test_meta_charset_used_when_no_encoding_given():
    html = "<html><head><meta charset='koi8-r'><title>Привет</title></head><body><p>Мир</p></body></html>"
    assert visible_text(html.encode("koi8-r")) == ("Привет", "Мир")
    html2 = ('<html><head><meta http-equiv="Content-Type" content="text/html; charset=Shift_JIS"></head>'
             '<body><p>日本語</p></body></html>')
    assert visible_text(html2.encode("shift_jis"))[1] == "日本語"


def test_latin1_label_means_windows_1252():
    html = b"<meta charset=iso-8859-1><p>\x93quoted\x94</p>"
    assert visible_text(html)[1] == "\u201cquoted\u201d"


def test_utf8_default_with_replacement_and_bom():
    assert visible_text(b"<p>caf\xc3\xa9 \xff ok</p>")[1] == "café \ufffd ok"
    assert visible_text(b"\xef\xbb\xbf<p>bom</p>")[1] == "bom"
    assert visible_text("<p>x</p>".encode("utf-16-le"), encoding="utf-16le")[1] == "x"  # the WHATWG label
    assert decode_html(b"<p>a</p>", "no-such-codec") == "<p>a</p>"
    assert decode_html(b"<p>a</p>", "base64") == "<p>a</p>"  # not a text encoding: ignored


def test_markdown_decoding_matches():
    html = ("<html><head><meta charset='cp1251'></head><body><article><p>Съешь же ещё этих мягких "
            "булок.</p></article></body></html>")
    assert "Съешь же ещё этих мягких булок." in html_to_markdown(html.encode("cp1251")).markdown


# --- hostile input -----------------------------------------------------------------

GARBAGE = [
    b"", b"   ", b"\x00\x00\x00", b"<", b"<<<<>>>>", b"<html", b"</p></div></body>", b"<?xml version='1.0'?>",
    b'<?xml version="1.0" encoding="utf-8"?><html xmlns="http://www.w3.org/1999/xhtml"><body><p>x</p></body></html>',
    b"<!DOCTYPE html><html><body><p>unclosed <b>bold <i>italic <a href='javascript:alert(1)'>js",
    b"<p>\xed\xa0\x80 surrogate</p>", b"<a href='http://[::1'>bad url</a>",
    b"<base href='http://[bad'><a href='x'>y</a>",
    b"<table><tr><td><table><td>nested</table></td>" * 50, b"<pre>" + b"`" * 100 + b"</pre>",
    "<p>\ud800 lone surrogate in str</p>",
]


@pytest.mark.parametrize("data", GARBAGE, ids=range(len(GARBAGE)))
def test_garbage_never_raises(data):
    c = html_to_markdown(data, "https://x.example/")
    assert isinstance(c.markdown, str)
    title, text = visible_text(data)
    assert isinstance(text, str) and (title is None or isinstance(title, str))


def test_random_bytes_never_raise():
    rng = random.Random(7)
    for _ in range(30):
        data = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 3000)))
        html_to_markdown(data, "https://x.example/")
        visible_text(data)
    tags = ["<div>", "</div>", "<p>", "<a href='/x'>", "</a>", "<pre>", "<table>", "<td>", "<script>", "</script>",
            "<nav>", "text, words ", "<!--", "-->", "<h2>", "&amp;", "&#0;", "<li>", "<template>"]
    for _ in range(30):
        data = "".join(rng.choice(tags) for _ in range(rng.randrange(1, 400)))
        html_to_markdown(data)
        visible_text(data)


def test_deep_nesting_is_bounded():
    deep = (b"<html><body><p>start</p>" + b"<div>" * 100_000 + b"deep" + b"</div>" * 100_000
            + b"<p>end</p></body></html>")
    t = time.perf_counter()
    c = html_to_markdown(deep, "https://x.example/")
    title, text = visible_text(deep)
    assert time.perf_counter() - t < 10
    assert "start" in c.markdown and "start" in text


def test_moderate_nesting_keeps_everything():
    html = b"<body><p>before</p>" + b"<div>" * 300 + b"deep" + b"</div>" * 300 + b"<p>after</p></body>"
    md = html_to_markdown(html).markdown
    assert "before" in md and "deep" in md and "after" in md
    assert visible_text(html)[1] == "before deep after"


def test_large_boilerplate_page_is_fast_and_reduced():
    import importlib.util

    spec = importlib.util.spec_from_file_location("extraction_pages", ROOT / "bench" / "extraction_pages.py")
    pages = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pages)
    data = pages.boilerplate_heavy(2 * 1024 * 1024)
    t = time.perf_counter()
    c = html_to_markdown(data, "https://news.example/")
    elapsed = time.perf_counter() - t
    assert "# Council approves the river budget" in c.markdown
    assert "Most read" not in c.markdown and "Accept all" not in c.markdown and "__STATE__" not in c.markdown
    assert len(c.markdown) < 40_000
    assert elapsed < 5  # about 0.15 s here; generous for a loaded CI machine (bench/ measures it properly)


def test_long_content_page_converted_whole():
    html = b"<body><nav><a href='/'>Home menu</a></nav>" + b"<p>word, word, word text sentence here ok.</p>" * 26000
    md = html_to_markdown(html).markdown
    assert md.count("word, word, word text sentence here ok.") == 26000
    assert "Home menu" not in md
