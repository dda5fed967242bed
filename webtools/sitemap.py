"""sitemap(url): an XML sitemap's entries, or a sitemap index's sitemaps.

A urlset gives `{kind: "sitemap", url, final_url, complete, total, dropped,
urls: [{loc, lastmod?}]}` in document order; a sitemap index gives `kind:
"sitemap_index"` with `sitemaps` (not followed). Each `loc` must be an
absolute http(s) URL of at most 2,048 characters with no whitespace,
control, bidi or zero-width character; other entries are dropped and
counted (`dropped`), never listed. A `lastmod` is kept when it is one short
clean value. More entries than the result cap (5,000), or a list longer
than 200,000 characters, gives `complete: false`, `total` and no list: that
is not an empty sitemap. Gzip works (as Content-Encoding, or a .xml.gz
body). A sitemap may be as large as the protocol allows (50,000 entries,
50 MiB decoded), beyond fetch's 2 MiB; past those, or past 1,000,000
elements, it is `web_too_large`. Anything else is `web_not_sitemap`.

The XML is parsed by expat as a stream, building no tree: memory is the
body plus the listed entries, whatever the document holds (48 MB of `<x/>`
costs no more than 48 bytes of it), and time is bounded by the element
budget. No DTD is accepted (so no entity is ever declared or expanded, and
no external entity fetched); nesting deeper than 8 is not a sitemap.
`parse_sitemap` is the pure part (bytes -> result).
"""

from __future__ import annotations

from xml.parsers import expat

from sluice.policy.urls import split_url
from sluice.webtools.client import Fetched, ReadPlan, WebClient, _Over, _ZlibStage, call_client
from sluice.webtools.errors import WebError
from sluice.webtools.fetch import status_not_ok
from sluice.webtools.sanitize import URL_CHARS, clean, is_clean, media_type
from sluice.webtools.window import envelope

MAX_ENTRIES = 50_000
MAX_ELEMENTS = 1_000_000
MAX_DEPTH = 8
MAX_LOC = 2048
MAX_LASTMOD = 64
RESULT_CAP = 5_000
RESULT_CHARS = 200_000
ENTRY_OVERHEAD = 16  # what an entry's line costs beyond its loc and lastmod
_FEED = 1 << 16
SITEMAP_TYPES = frozenset({
    "application/xml", "text/xml", "application/gzip", "application/x-gzip", "application/octet-stream",
    "text/plain", "",
})


def _local(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]


def valid_loc(loc: str | None) -> bool:
    """An absolute http(s) URL with a host, at most MAX_LOC characters, all of
    them visible (no whitespace, controls, bidi or zero-width characters)."""
    if not loc or len(loc) > MAX_LOC or not is_clean(loc) or any(c.isspace() for c in loc):
        return False
    if loc.partition(":")[0].lower() not in ("http", "https"):
        return False
    try:
        target = split_url(loc)
    except ValueError:
        return False
    return bool(target.host) and not target.has_credentials


class _Parse:
    """The expat handlers: one pass, no tree, bounded state."""

    def __init__(self, where: str, result_cap: int, result_chars: int, max_entries: int, max_elements: int):
        self.where, self.result_cap, self.result_chars = where, result_cap, result_chars
        self.max_entries, self.max_elements = max_entries, max_elements
        self.kind = self.entry_tag = self.list_key = None
        self.depth = self.elements = self.seen = self.total = self.dropped = self.chars = 0
        self.entries: list[dict] | None = []
        self.in_entry = False
        self.field: str | None = None
        self.values: dict[str, str] = {}
        self.buf: list[str] = []
        self.buf_len = 0

    def not_sitemap(self, why: str) -> WebError:
        return WebError("web_not_sitemap",
                        f"{self.where} is not an XML sitemap (a <urlset> or a <sitemapindex>): {why}")

    def start(self, name, attrs):
        self.elements += 1
        if self.elements > self.max_elements:
            raise WebError("web_too_large", f"{self.where} has more than {self.max_elements:,} XML elements, more "
                           "than any sitemap needs", limit_elements=self.max_elements, decoded=False)
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise self.not_sitemap(f"its elements nest deeper than {MAX_DEPTH}")
        local = _local(name)
        if self.depth == 1:
            if local == "urlset":
                self.kind, self.entry_tag, self.list_key = "sitemap", "url", "urls"
            elif local == "sitemapindex":
                self.kind, self.entry_tag, self.list_key = "sitemap_index", "sitemap", "sitemaps"
            else:
                raise self.not_sitemap(f"its root element is <{clean(local, 64)}>")
        elif self.depth == 2 and local == self.entry_tag:
            self.in_entry, self.values = True, {}
        elif self.depth == 3 and self.in_entry and local in ("loc", "lastmod") and local not in self.values:
            self.field, self.buf, self.buf_len = local, [], 0

    def text(self, data):
        if self.field is None:
            return
        if not self.buf_len:
            data = data.lstrip()
        room = MAX_LOC + 256 - self.buf_len  # kept: enough to tell an over-long value, whatever trails it
        if room > 0:
            self.buf.append(data[:room])
        self.buf_len += len(data)

    def end(self, name):
        if self.depth == 3 and self.field is not None:
            value = "".join(self.buf).strip()
            self.values[self.field] = value if self.buf_len <= MAX_LOC + 256 else None  # over-long: dropped
            self.field = None
        elif self.depth == 2 and self.in_entry:
            self.in_entry = False
            self.entry(self.values.get("loc"), self.values.get("lastmod"))
        self.depth -= 1

    def entry(self, loc, lastmod):
        self.seen += 1
        if self.seen > self.max_entries:
            raise WebError("web_too_large", f"{self.where} has more than {self.max_entries:,} entries, the sitemap "
                           "protocol's limit", limit_entries=self.max_entries, decoded=False)
        if not valid_loc(loc):
            self.dropped += 1
            return
        self.total += 1
        if self.entries is None:
            return
        item = {"loc": loc}
        if lastmod and len(lastmod) <= MAX_LASTMOD and is_clean(lastmod):
            item["lastmod"] = lastmod
        self.chars += len(loc) + len(item.get("lastmod", "")) + ENTRY_OVERHEAD
        if self.total > self.result_cap or self.chars > self.result_chars:
            self.entries = None  # incomplete: no partial list, ever
        else:
            self.entries.append(item)


def _refuse_dtd(*args):
    raise WebError("web_not_sitemap", "the document declares a DTD; a sitemap has none (DTDs and entities are "
                   "refused: no entity is expanded or fetched)")


def parse_sitemap(data: bytes, *, where: str = "the document", result_cap: int = RESULT_CAP,
                  result_chars: int = RESULT_CHARS, max_entries: int = MAX_ENTRIES,
                  max_bytes: int = 50 * 1024 * 1024, max_elements: int = MAX_ELEMENTS) -> dict:
    """{kind, complete, total, dropped, urls|sitemaps} from sitemap bytes (gzip or not)."""
    if data[:2] == b"\x1f\x8b":
        try:
            data = _ZlibStage(31)(data, max_bytes)
        except _Over:
            raise WebError("web_too_large", f"{where} inflates to more than the {max_bytes:,}-byte sitemap cap",
                           limit=max_bytes, decoded=True) from None
        except Exception as e:  # zlib.error
            raise WebError("web_not_sitemap", f"{where} is gzip data that cannot be inflated ({e})") from None
    state = _Parse(where, result_cap, result_chars, max_entries, max_elements)
    parser = expat.ParserCreate(namespace_separator="}")
    parser.buffer_text = True
    parser.SetParamEntityParsing(expat.XML_PARAM_ENTITY_PARSING_NEVER)
    parser.StartDoctypeDeclHandler = _refuse_dtd
    parser.EntityDeclHandler = _refuse_dtd
    parser.UnparsedEntityDeclHandler = _refuse_dtd
    parser.ExternalEntityRefHandler = _refuse_dtd
    parser.StartElementHandler = state.start
    parser.EndElementHandler = state.end
    parser.CharacterDataHandler = state.text
    try:
        view = memoryview(data)
        for at in range(0, len(data), _FEED):
            parser.Parse(bytes(view[at:at + _FEED]), False)
        parser.Parse(b"", True)
    except expat.ExpatError as e:
        raise state.not_sitemap(expat.ErrorString(e.code) + f" (line {e.lineno})") from None
    if state.kind is None:
        raise state.not_sitemap("it is empty")
    complete = state.entries is not None
    result = {"kind": state.kind, "complete": complete, "total": state.total, "dropped": state.dropped}
    if complete:
        result[state.list_key] = state.entries
    return result


def sitemap(url: str, *, client: WebClient | None = None, result_cap: int = RESULT_CAP) -> dict:
    try:
        def classify(f: Fetched) -> ReadPlan:
            if not 200 <= f.status < 300:
                raise status_not_ok(f)
            if f.mime not in SITEMAP_TYPES and not f.mime.endswith("+xml"):
                raise WebError("web_not_sitemap", f"{f.final_url} is {f.mime}, not an XML sitemap",
                               content_type=media_type(f.content_type), url=f.url, final_url=f.final_url)
            return ReadPlan(client.limits.sitemap_bytes)

        with call_client(client) as client:
            fetched = client.request(url, classify=classify, robots=True)
        parsed = parse_sitemap(fetched.body, where=fetched.final_url, result_cap=result_cap,
                               max_bytes=client.limits.sitemap_bytes)
        return {"kind": parsed.pop("kind"), "url": clean(fetched.url, URL_CHARS),
                "final_url": clean(fetched.final_url, URL_CHARS), **parsed}
    except WebError as e:
        return e.as_dict()


def render(result: dict) -> str:
    """The model-facing text: Sluice's header line, then the entries (web
    data) inside a `<sitemap … end=NONCE>` envelope."""
    listed = result.get("urls", result.get("sitemaps"))
    what = "Sitemap index" if result["kind"] == "sitemap_index" else "Sitemap"
    head = f"{what}: {result['final_url']} · {result['total']:,} entries"
    if result.get("dropped"):
        head += f" · {result['dropped']:,} dropped (not an http(s) URL of at most {MAX_LOC:,} characters)"
    if listed is None:
        return head + (f"\n[incomplete: {result['total']:,} entries are more than one result holds; none are listed]")
    body = "\n".join(e["loc"] + (f"  (lastmod {e['lastmod']})" if "lastmod" in e else "") for e in listed)
    return head + "\n" + envelope(body, url=result["final_url"], tag="sitemap")
