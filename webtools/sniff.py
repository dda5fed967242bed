"""Magic bytes: a binary body must be what its Content-Type says.

fetch hands images to a model as image parts and PDFs as PDF resources on
the strength of the origin's Content-Type alone, so a page could pass HTML
(or anything) off as a PNG. Before a binary part goes out, its first bytes
are checked against the signature of its declared type (the WHATWG MIME
Sniffing Standard's patterns, at offset 0); a mismatch is
`web_type_mismatch`, naming the declared type and what the bytes look like.
"""

from __future__ import annotations

from sluice.webtools.errors import WebError

# type -> (name, test on the first bytes)
SIGNATURES: dict[str, tuple[str, object]] = {
    "image/jpeg": ("JPEG", lambda b: b.startswith(b"\xff\xd8\xff")),
    "image/png": ("PNG", lambda b: b.startswith(b"\x89PNG\r\n\x1a\n")),
    "image/gif": ("GIF", lambda b: b.startswith((b"GIF87a", b"GIF89a"))),
    "image/webp": ("WebP", lambda b: b.startswith(b"RIFF") and b[8:12] == b"WEBP"),
    "application/pdf": ("PDF", lambda b: b.startswith(b"%PDF-")),
}
_MARKUP = (  # what HTML and XML start with, after whitespace (case-insensitive)
    (b"<!doctype html", "HTML"), (b"<html", "HTML"), (b"<head", "HTML"), (b"<body", "HTML"), (b"<script", "HTML"),
    (b"<iframe", "HTML"), (b"<div", "HTML"), (b"<p", "HTML"), (b"<!--", "HTML"), (b"<svg", "SVG"), (b"<?xml", "XML"),
)


def looks_like(body: bytes) -> str:
    """A short name for what `body` appears to be."""
    head = body[:64]
    for name, matches in SIGNATURES.values():
        if matches(head):
            return name
    if not body:
        return "an empty body"
    text = head.lstrip(b"\xef\xbb\xbf \t\r\n\f").lower()
    for prefix, name in _MARKUP:
        if text.startswith(prefix):
            return name
    if text[:1] in (b"{", b"["):
        return "JSON"
    if all(32 <= c < 127 or c in (9, 10, 13) for c in text):
        return "text"
    return "unknown binary data"


def check_signature(mime: str, body: bytes, url: str) -> None:
    """Raise web_type_mismatch unless `body` starts with `mime`'s signature
    (types without one in SIGNATURES pass)."""
    signature = SIGNATURES.get(mime)
    if signature is None or signature[1](body[:64]):
        return
    seen = looks_like(body)
    raise WebError("web_type_mismatch", f"{url} says its body is {mime} ({signature[0]}), but its bytes look like "
                   f"{seen}; it was not passed on. Do not retry: the site mislabels it or is trying to pass one "
                   "thing off as another", content_type=mime, looks_like=seen, url=url)
