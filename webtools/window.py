"""Windows over a page, and the envelope only the tool can close (pure).

A page reaches a model in windows of at most `max_chars` characters.
Characters are Unicode code points (Python `str` indices), so a window never
splits a character's bytes, whatever its UTF-8 length: concatenating
`content` over `offset = next_offset` reproduces the page exactly.

The envelope: `<page url="…" title="…" end="NONCE">…</page end="NONCE">`
with a NONCE drawn fresh for every call (128 random bits, base32) and never
one that occurs in the page, so a page that writes its own closing tag cannot
end the envelope early. Attribute values are escaped (`&`, `<`, `>`, `"`,
`'`) after the one sanitiser (webtools.sanitize.clean: control characters
and separators become spaces, bidi and zero-width characters go).
"""

from __future__ import annotations

import base64
import html
import secrets

from sluice.webtools.errors import WebError
from sluice.webtools.sanitize import clean

DEFAULT_MAX_CHARS = 40_000
MAX_MAX_CHARS = 200_000


def check_window_args(offset, max_chars) -> None:
    """Raise web_bad_offset / web_bad_argument for arguments no window takes."""
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise WebError("web_bad_offset",
                       f"offset must be a non-negative whole number (got {offset!r}); start with offset=0")
    if isinstance(max_chars, bool) or not isinstance(max_chars, int) or not 1 <= max_chars <= MAX_MAX_CHARS:
        raise WebError("web_bad_argument",
                       f"max_chars must be a whole number from 1 to {MAX_MAX_CHARS} (got {max_chars!r})")


def window(content: str, offset: int = 0, max_chars: int = DEFAULT_MAX_CHARS) -> dict:
    """{total_chars, offset, end, next_offset, content} for [offset, end)."""
    check_window_args(offset, max_chars)
    total = len(content)
    if offset > total or (offset == total and total > 0):
        raise WebError(
            "web_offset_past_end",
            f"offset {offset} is past the end of the page, which has {total} characters; "
            f"pass an offset below {total}" if total else "the page is empty; pass offset=0",
            total_chars=total,
        )
    end = min(total, offset + max_chars)
    return {
        "total_chars": total,
        "offset": offset,
        "end": end,
        "next_offset": end if end < total else None,
        "content": content[offset:end],
    }


def paging_note(w: dict) -> str | None:
    """`showing characters A–B of N; pass offset=B to continue`, or None for
    a page that fits one window (no paging note at all)."""
    total, start, end = w["total_chars"], w["offset"], w["end"]
    if start == 0 and end == total:
        return None
    note = f"showing characters {start}–{end} of {total}"
    if w["next_offset"] is not None:
        note += f"; pass offset={end} to continue"
    else:
        note += " (the end of the page)"
    return note


def new_nonce() -> str:
    return base64.b32encode(secrets.token_bytes(16)).decode("ascii").rstrip("=")


def attribute(value: str | None) -> str:
    return html.escape(clean(value), quote=True)


def envelope(body: str, *, url: str, title: str | None = None, tag: str = "page", nonce: str | None = None) -> str:
    """The body inside `<tag url=… title=… end=NONCE>…</tag end=NONCE>`."""
    while nonce is None or nonce in body:
        nonce = new_nonce()
    attrs = f'url="{attribute(url)}"'
    if title is not None:
        attrs += f' title="{attribute(title)}"'
    return f'<{tag} {attrs} end="{nonce}">\n{body}\n</{tag} end="{nonce}">'
