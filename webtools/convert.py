"""HTML → main content → markdown, and HTML → visible text (pure functions).

`html_to_markdown` is what `fetch` shows a model: the page reduced to its main
content (menus, banners, cookie notices, sidebars and footers out; headings,
lists, tables, code blocks and links kept, links made absolute), converted to
markdown (trafilatura on Sluice's lxml pre-reduction; Sluice's own reducer and
html2text as the fallback: webtools/_extract.py). `visible_text` is what `read`
hashes: every word a reader could see, markup removed and whitespace collapsed
to single spaces.

Both take untrusted bytes. They never raise on garbage (they return what they
can), and their work is bounded: one lxml parse and a few linear passes over
the tree before the extractor sees a fraction of it, which is why the pipeline
is faster than html2text alone on a boilerplate-heavy page (see README,
"Web tools: extraction quality and speed"). Callers cap the input's size
(fetch reads at most 2 MiB). Output is bounded as it is produced: markdown at
most twice the input and at most `max_chars` (`Converted.cut`), link targets
and `<base href>` over 2,048 characters dropped, the title at 4,096
characters; visible text is never longer than the input. Inputs that made
libxml2, the fence or a codec superlinear are capped (webtools._extract).
Given the call's deadline, both run in a worker process that is killed at
the deadline (webtools._convert_worker), as C code in a thread cannot be
stopped.

Text a reader cannot see (webtools._hidden: hidden attributes, and hiding
styles in `style` attributes and the page's own `<style>` elements; external
stylesheets are not fetched) is dropped by both and counted in `hidden_chars`.

Decoding (webtools.charsets, the WHATWG Encoding Standard's labels): a byte
order mark wins, as in browsers; else the charset the caller gives (from
Content-Type), else the document's own `<meta charset>` (first 4 KiB), else
UTF-8. A label that is not a WHATWG label (`undefined`, `punycode`, `idna`)
is no encoding; undecodable bytes become U+FFFD.
"""

from __future__ import annotations

from dataclasses import dataclass

from sluice.webtools import _extract, charsets

__all__ = ["Converted", "Visible", "decode_html", "html_to_markdown", "page_text", "visible_text"]


@dataclass(frozen=True, slots=True)
class Converted:
    title: str | None
    markdown: str  # the page's main content as markdown
    needs_javascript: bool  # an app shell: almost no text, scripts present
    cut: bool = False  # the markdown reached its bound (2x the input, or max_chars) and was cut there
    hidden_chars: int = 0  # characters of text a reader cannot see, dropped (webtools._hidden)


@dataclass(frozen=True, slots=True)
class Visible:
    title: str | None
    text: str  # every word a reader could see, whitespace collapsed to single spaces
    hidden_chars: int  # characters of text a reader cannot see, dropped


def decode_html(html: bytes | str, encoding: str | None = None) -> str:
    """The document as text, decoded as a browser does (webtools.charsets): a BOM,
    else the `encoding` label, else `<meta charset>`, else UTF-8 (with replacement)."""
    if isinstance(html, str):
        return html
    return charsets.decode_html(html, encoding)


def html_to_markdown(html: bytes | str, base_url: str | None = None, *, encoding: str | None = None,
                     max_chars: int | None = None, deadline: float | None = None) -> Converted:
    """The page's main content as markdown, its title, and whether it looks like a JavaScript app shell.

    The markdown is at most twice the input's length and at most `max_chars`
    (`cut` says when it reached that bound). With a `deadline` (time.monotonic())
    the conversion runs in a worker process killed at the deadline
    (webtools._convert_worker): ConversionTimeout, or ConversionFailed when the
    worker died (its memory bound)."""
    if deadline is None:
        return html_to_markdown_here(html, base_url, encoding=encoding, max_chars=max_chars)
    from sluice.webtools._convert_worker import POOL

    answer = POOL.run("markdown", html, {"base_url": base_url, "encoding": encoding, "max_chars": max_chars},
                      deadline)
    return Converted(title=answer["title"], markdown=answer["markdown"], needs_javascript=answer["needs_javascript"],
                     cut=answer["cut"], hidden_chars=answer["hidden_chars"])


def html_to_markdown_here(html: bytes | str, base_url: str | None = None, *, encoding: str | None = None,
                          max_chars: int | None = None) -> Converted:
    """html_to_markdown in this process, with no deadline (the worker calls it)."""
    text = decode_html(html, encoding)
    bound = 2 * max(len(html), 1)
    if max_chars is not None:
        bound = min(bound, max(max_chars, 0))
    return _extract.convert(text, base_url, max_chars=bound)


def page_text(html: bytes | str, *, encoding: str | None = None, deadline: float | None = None) -> Visible:
    """The title, the whole visible text (no longer than the input), and how much hidden text was dropped.

    With a `deadline`, in a worker process killed at the deadline (as html_to_markdown)."""
    if deadline is None:
        return page_text_here(html, encoding=encoding)
    from sluice.webtools._convert_worker import POOL

    answer = POOL.run("page_text", html, {"encoding": encoding}, deadline)
    return Visible(answer["title"], answer["text"], answer["hidden_chars"])


def page_text_here(html: bytes | str, *, encoding: str | None = None) -> Visible:
    """page_text in this process, with no deadline (the worker calls it)."""
    title, text, hidden_chars = _extract.visible(decode_html(html, encoding))
    return Visible(title, text, hidden_chars)


def visible_text(html: bytes | str, *, encoding: str | None = None) -> tuple[str | None, str]:
    """(title or None, the whole visible text with whitespace collapsed to single spaces)."""
    v = page_text(html, encoding=encoding)
    return v.title, v.text
