"""sitemap(url): an XML sitemap's entries, or a sitemap index's sitemaps.

A urlset gives `{kind: "sitemap", url, final_url, complete, total, urls:
[{loc, lastmod?}]}` in document order; a sitemap index gives `kind:
"sitemap_index"` with `sitemaps` (not followed). More entries than the result
cap (5,000) gives `complete: false`, `total` and no list: that is not an empty
sitemap. Gzip works (as Content-Encoding, or a .xml.gz body). A sitemap may be
as large as the protocol allows (50,000 entries, 50 MiB decoded), beyond
fetch's 2 MiB; past those it is `web_too_large`. Anything else is
`web_not_sitemap`.

The XML is parsed by defusedxml: no DTDs, no entity expansion, no external
entities; the parse is bounded by the byte cap, and entries by the count.
`parse_sitemap` is the pure part (bytes -> result).
"""

from __future__ import annotations

import io
from xml.etree.ElementTree import ParseError

import defusedxml
import defusedxml.ElementTree as SafeET

from sluice.webtools.client import Fetched, ReadPlan, WebClient, _Over, _ZlibStage, call_client
from sluice.webtools.errors import WebError
from sluice.webtools.fetch import status_not_ok

MAX_ENTRIES = 50_000
RESULT_CAP = 5_000
SITEMAP_TYPES = frozenset({
    "application/xml", "text/xml", "application/gzip", "application/x-gzip", "application/octet-stream",
    "text/plain", "",
})


def _local(tag: str) -> str:
    return tag.rsplit("}", 1)[-1] if isinstance(tag, str) else ""


def parse_sitemap(data: bytes, *, where: str = "the document", result_cap: int = RESULT_CAP,
                  max_entries: int = MAX_ENTRIES, max_bytes: int = 50 * 1024 * 1024) -> dict:
    """{kind, complete, total, urls|sitemaps} from sitemap bytes (gzip or not)."""
    if data[:2] == b"\x1f\x8b":
        try:
            data = _ZlibStage(31)(data, max_bytes)
        except _Over:
            raise WebError("web_too_large", f"{where} inflates to more than the {max_bytes:,}-byte sitemap cap",
                           limit=max_bytes, decoded=True) from None
        except Exception as e:  # zlib.error
            raise WebError("web_not_sitemap", f"{where} is gzip data that cannot be inflated ({e})") from None
    not_sitemap = f"{where} is not an XML sitemap (a <urlset> or a <sitemapindex>)"
    kind = None
    entries: list[dict] = []
    total = 0
    depth = 0
    try:
        for event, elem in SafeET.iterparse(io.BytesIO(data), events=("start", "end"), forbid_dtd=True,
                                            forbid_entities=True, forbid_external=True):
            name = _local(elem.tag)
            if event == "start":
                depth += 1
                if depth == 1:
                    if name == "urlset":
                        kind, entry_tag, list_key = "sitemap", "url", "urls"
                    elif name == "sitemapindex":
                        kind, entry_tag, list_key = "sitemap_index", "sitemap", "sitemaps"
                    else:
                        raise WebError("web_not_sitemap", f"{not_sitemap}: its root element is <{name}>")
                continue
            depth -= 1
            if depth == 1 and name == entry_tag:
                loc = lastmod = None
                for child in elem:
                    child_name = _local(child.tag)
                    if child_name == "loc":
                        loc = (child.text or "").strip()
                    elif child_name == "lastmod":
                        lastmod = (child.text or "").strip() or None
                elem.clear()
                if not loc:
                    continue
                total += 1
                if total > max_entries:
                    raise WebError("web_too_large", f"{where} has more than {max_entries:,} entries, the sitemap "
                                   "protocol's limit", limit_entries=max_entries, decoded=False)
                if total <= result_cap:
                    entry = {"loc": loc}
                    if lastmod:
                        entry["lastmod"] = lastmod
                    entries.append(entry)
                else:
                    entries = []
    except (ParseError, defusedxml.DefusedXmlException) as e:
        raise WebError("web_not_sitemap", f"{not_sitemap}: {e}") from None
    if kind is None:
        raise WebError("web_not_sitemap", f"{not_sitemap}: it is empty")
    complete = total <= result_cap
    result = {"kind": kind, "complete": complete, "total": total}
    if complete:
        result[list_key] = entries
    return result


def sitemap(url: str, *, client: WebClient | None = None, result_cap: int = RESULT_CAP) -> dict:
    try:
        def classify(f: Fetched) -> ReadPlan:
            if not 200 <= f.status < 300:
                raise status_not_ok(f)
            if f.mime not in SITEMAP_TYPES and not f.mime.endswith("+xml"):
                raise WebError("web_not_sitemap", f"{f.final_url} is {f.mime}, not an XML sitemap",
                               content_type=f.content_type, url=f.url, final_url=f.final_url)
            return ReadPlan(client.limits.sitemap_bytes)

        with call_client(client) as client:
            fetched = client.get(url, classify=classify)
        parsed = parse_sitemap(fetched.body, where=fetched.final_url, result_cap=result_cap,
                               max_bytes=client.limits.sitemap_bytes)
        return {"kind": parsed.pop("kind"), "url": fetched.url, "final_url": fetched.final_url, **parsed}
    except WebError as e:
        return e.as_dict()
