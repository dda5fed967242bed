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
(fetch reads at most 2 MiB).

Decoding: the encoding the caller gives (from Content-Type) wins, else a byte
order mark, else the document's own `<meta charset>` (first 4 KiB), else UTF-8;
undecodable bytes become U+FFFD.
"""

from __future__ import annotations

import codecs
import re
from dataclasses import dataclass

from sluice.webtools import _extract

__all__ = ["Converted", "decode_html", "html_to_markdown", "visible_text"]


@dataclass(frozen=True, slots=True)
class Converted:
    title: str | None
    markdown: str  # the page's main content as markdown
    needs_javascript: bool  # an app shell: almost no text, scripts present


_META_CHARSET = re.compile(
    rb"""<meta[^>]{0,512}?charset\s*=\s*["']?\s*([A-Za-z0-9_.:\-]{1,40})""", re.IGNORECASE
)
# WHATWG's encoding standard: these labels mean windows-1252 in a browser.
_ALIASES = {"iso-8859-1": "cp1252", "latin-1": "cp1252", "latin1": "cp1252", "us-ascii": "cp1252",
            "ascii": "cp1252", "iso8859-1": "cp1252", "l1": "cp1252", "x-user-defined": "cp1252",
            "unicode": "utf-16-le", "utf-16": "utf-16-le"}
_BOMS = ((codecs.BOM_UTF8, "utf-8"), (codecs.BOM_UTF16_LE, "utf-16-le"), (codecs.BOM_UTF16_BE, "utf-16-be"))


def _codec(name: str | bytes | None) -> str | None:
    if not name:
        return None
    if isinstance(name, bytes):
        name = name.decode("ascii", "replace")
    label = name.strip().strip("\"'").lower()
    label = _ALIASES.get(label, label)
    try:
        info = codecs.lookup(label)
    except (LookupError, ValueError):
        return None
    if info.name in {"utf-7", "rot-13", "base64", "hex", "zlib", "bz2", "quopri", "uu"}:  # not text encodings
        return None
    return info.name


def decode_html(html: bytes | str, encoding: str | None = None) -> str:
    """The document as text: `encoding`, else BOM, else `<meta charset>`, else UTF-8 (with replacement)."""
    if isinstance(html, str):
        return html
    data = bytes(html)
    codec = _codec(encoding)
    if codec is None:
        for bom, name in _BOMS:
            if data.startswith(bom):
                return data[len(bom):].decode(name, "replace")
        m = _META_CHARSET.search(data[:4096])
        codec = _codec(m.group(1)) if m else None
        if codec in {"utf-16-le", "utf-16-be", "utf-16", "utf-32"}:  # a meta tag we could read is not UTF-16
            codec = "utf-8"
    try:
        return data.decode(codec or "utf-8", "replace")
    except (LookupError, ValueError):  # pragma: no cover - _codec already vetted it
        return data.decode("utf-8", "replace")


def html_to_markdown(html: bytes | str, base_url: str | None = None, *, encoding: str | None = None) -> Converted:
    """The page's main content as markdown, its title, and whether it looks like a JavaScript app shell."""
    text = decode_html(html, encoding)
    return _extract.convert(text, base_url)


def visible_text(html: bytes | str, *, encoding: str | None = None) -> tuple[str | None, str]:
    """(title or None, the whole visible text with whitespace collapsed to single spaces)."""
    text = decode_html(html, encoding)
    return _extract.visible(text)
