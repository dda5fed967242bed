"""read(url): one HTML page's whole visible text, with a hash of exactly it.

Scripts, styles, templates and markup are removed and whitespace collapsed to
single spaces (webtools.convert.page_text); text a reader cannot see (the
`hidden` attribute, aria-hidden, and display:none, visibility:hidden,
opacity:0, font-size:0 or off-screen positioning in `style` attributes or the
page's own `<style>` elements; external stylesheets are not fetched) is left
out, and `hidden_chars` says how many characters that was; `title` is separate (null when
none) and not part of `text`; `sha256` is over `text` as UTF-8, so it changes
only when the words do. HTML and XHTML only. Refuse, don't truncate: a page
whose text is over the result cap (100,000 characters) is
`web_page_too_large` with `chars` and `sha256` and no text, and an HTML body
over the 2 MiB read cap is `web_too_large`.
"""

from __future__ import annotations

import hashlib
import time

from sluice.webtools.client import Fetched, ReadPlan, WebClient, call_client
from sluice.webtools.errors import WebError
from sluice.webtools.fetch import HTML_TYPES, conversion_errors, header_values, status_not_ok
from sluice.webtools.sanitize import media_type

MAX_TEXT_CHARS = 100_000


def read(url: str, *, client: WebClient | None = None, max_text_chars: int = MAX_TEXT_CHARS) -> dict:
    try:
        def classify(f: Fetched) -> ReadPlan:
            if not 200 <= f.status < 300:
                raise status_not_ok(f)
            if f.mime not in HTML_TYPES:
                raise WebError("web_not_html",
                               f"{f.final_url} is {f.mime or 'of no stated type'}, not HTML: read takes "
                               "HTML pages only; use request for text and JSON, sitemap for sitemaps",
                               content_type=media_type(f.content_type), url=f.url, final_url=f.final_url)
            return ReadPlan(client.limits.text_bytes)

        started = time.monotonic()
        with call_client(client) as client:
            fetched = client.request(url, classify=classify, robots=True)
        from sluice.webtools.convert import page_text

        with conversion_errors(fetched.final_url, client.limits.timeout):
            visible = page_text(fetched.body, encoding=fetched.charset, deadline=started + client.limits.timeout)
        title, text = visible.title, visible.text
        digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
        if len(text) > max_text_chars:
            raise WebError("web_page_too_large",
                           f"the visible text of {fetched.final_url} is {len(text):,} characters, "
                           f"more than one result holds ({max_text_chars:,}); no text is returned: this is not the "
                           "page, so do not summarise it; use fetch to page through it", chars=len(text), sha256=digest,
                           url=fetched.url, final_url=fetched.final_url)
        return {
            "kind": "page",
            **header_values({"url": fetched.url, "final_url": fetched.final_url,
                             "content_type": fetched.content_type, "title": title}),
            "status": fetched.status,
            "text": text,
            "chars": len(text),
            "sha256": digest,
            "hidden_chars": visible.hidden_chars,
        }
    except WebError as e:
        return e.as_dict()
