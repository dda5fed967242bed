"""PDFs built by hand for the tests: real ones with text, scanned-looking ones
with none, and hostile ones (bombs, loops, deep nesting).

`build(objects)` writes objects 1..N (object 1 the catalog) with a correct
cross-reference table; `text_pdf(pages)` is a PDF whose page i shows the
lines of pages[i] in Helvetica.
"""

from __future__ import annotations

import zlib


def build(objects: list[bytes], *, info: bytes | None = None) -> bytes:
    """A PDF of `objects` (object n is objects[n-1]; 1 is the catalog)."""
    out = bytearray(b"%PDF-1.7\n%\xe2\xe3\xcf\xd3\n")
    offsets = []
    for n, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % n + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % o for o in offsets)
    trailer = b"/Size %d /Root 1 0 R" % (len(objects) + 1) + (b" /Info " + info if info else b"")
    out += b"trailer\n<<" + trailer + b">>\nstartxref\n%d\n%%%%EOF\n" % xref
    return bytes(out)


def stream(data: bytes, *, compress: bool = False, extra: bytes = b"") -> bytes:
    if compress:
        data = zlib.compress(data, 9)
        extra += b" /Filter /FlateDecode"
    return b"<< /Length %d%s >>\nstream\n" % (len(data), extra) + data + b"\nendstream"


def _escape(text: str) -> bytes:
    return text.encode("latin-1").replace(b"\\", b"\\\\").replace(b"(", b"\\(").replace(b")", b"\\)")


def text_pdf(pages: list[list[str]], *, title: str | None = None, compress: bool = True) -> bytes:
    """Page i shows the lines pages[i], top to bottom."""
    n = len(pages)
    font = 3 + 2 * n  # object numbers: 1 catalog, 2 pages, then (page, content) pairs, then the font
    kids = b" ".join(b"%d 0 R" % (3 + 2 * i) for i in range(n))
    objects = [b"<< /Type /Catalog /Pages 2 0 R >>", b"<< /Type /Pages /Kids [%s] /Count %d >>" % (kids, n)]
    for i, lines in enumerate(pages):
        ops = b"BT /F1 12 Tf 72 760 Td 14 TL " + b" ".join(b"(%s) Tj T*" % _escape(line) for line in lines) + b" ET"
        objects.append(b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents %d 0 R "
                       b"/Resources << /Font << /F1 %d 0 R >> >> >>" % (4 + 2 * i, font))
        objects.append(stream(ops, compress=compress))
    objects.append(b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica /Encoding /WinAnsiEncoding >>")
    info = None
    if title is not None:
        objects.append(b"<< /Title (%s) >>" % _escape(title))
        info = b"%d 0 R" % len(objects)
    return build(objects, info=info)


def image_only_pdf(pages: int = 2) -> bytes:
    """Pages that paint an image and no text: what a scan looks like."""
    kids = b" ".join(b"%d 0 R" % (3 + 2 * i) for i in range(pages))
    image = 3 + 2 * pages
    objects = [b"<< /Type /Catalog /Pages 2 0 R >>", b"<< /Type /Pages /Kids [%s] /Count %d >>" % (kids, pages)]
    for i in range(pages):
        objects.append(b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents %d 0 R "
                       b"/Resources << /XObject << /Im1 %d 0 R >> >> >>" % (4 + 2 * i, image))
        objects.append(stream(b"q 612 0 0 792 0 0 cm /Im1 Do Q"))
    objects.append(stream(b"\x80" * (8 * 8), extra=b" /Type /XObject /Subtype /Image /Width 8 /Height 8 "
                          b"/ColorSpace /DeviceGray /BitsPerComponent 8"))
    return build(objects)


def bomb_pdf(inflated: int = 1 << 30) -> bytes:
    """One page whose content stream inflates to `inflated` bytes of spaces (a 1 GiB bomb is ~1 MiB)."""
    z = zlib.compressobj(9)
    chunk = b" " * (1 << 20)
    data = b"".join(z.compress(chunk) for _ in range(inflated // len(chunk))) + z.flush()
    objects = [b"<< /Type /Catalog /Pages 2 0 R >>", b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
               b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R >>",
               b"<< /Length %d /Filter /FlateDecode >>\nstream\n" % len(data) + data + b"\nendstream"]
    return build(objects)


def looping_pdf() -> bytes:
    """A page tree whose Pages node is its own kid, and whose page's Parent is that node."""
    return build([b"<< /Type /Catalog /Pages 2 0 R >>",
                  b"<< /Type /Pages /Kids [2 0 R 3 0 R] /Count 2 >>",
                  b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 3 0 R >>"])


def deep_pdf(depth: int = 200_000) -> bytes:
    """A content stream (and a resource) of arrays nested `depth` deep."""
    nested = b"[" * depth + b"]" * depth
    objects = [b"<< /Type /Catalog /Pages 2 0 R >>", b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
               b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R /Resources << /X " + nested
               + b" >> >>", stream(nested + b" Tj")]
    return build(objects)
