"""fetch and source_read: a page as markdown, in windows, in an envelope.

fetch(url, offset=0, max_chars=40000) reads a page through the proxy (up to
2 MiB, marked `truncated` past that), reduces HTML and XHTML to their main
content as markdown (webtools.convert), keeps plain text, markdown, JSON and
XML as they are, stores the result as a source owned by the caller, and
returns one window of it. Images (jpeg, png, gif, webp; <= 5 MiB) and PDFs
(<= 10 MiB) come back whole as base64 `data`, never truncated, once their
magic bytes match the declared type (webtools.sniff; `web_type_mismatch`
otherwise); other types are refused from the headers, before the body is read.
A PDF also comes back as text (webtools.pdf: page markers, `pages`,
`scanned`, `text_incomplete`, within the call's deadline and the read cap),
windowed and stored like a page (kind "pdf"), so source_read pages through it.

Repeat fetches: a fetch of a URL this owner fetched less than
SLUICE_WEB_REUSE ago (5 minutes by default; 0 turns it off), matched on
`reuse_key` (the URL as requested, and whether it was rendered), returns
that stored source with `cached: true` and its `captured_at`, and sends no
request; a fresh fetch says `cached: false`.

source_read(source_id, offset=0, max_chars=40000) returns a window of a page
fetched earlier by the same owner, from the store, with no request.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import os
import time
from datetime import datetime, UTC

from sluice.webtools import charsets
from sluice.policy.loader import parse_duration
from sluice.webtools.client import MAX_URL_CHARS, Fetched, WebToolLimits, ReadPlan, WebClient, call_client, request_url
from sluice.webtools.errors import WebError
from sluice.webtools.sniff import check_signature
from sluice.webtools.sanitize import TITLE_CHARS, URL_CHARS, clean, clean_optional, media_type
from sluice.webtools.store import SourceStore, default_owner, default_store
from sluice.webtools.window import (DEFAULT_MAX_CHARS, check_window_args, envelope, paging_note, window)

IMAGE_TYPES = frozenset({"image/jpeg", "image/png", "image/gif", "image/webp"})
PDF_TYPE = "application/pdf"
HTML_TYPES = frozenset({"text/html", "application/xhtml+xml"})
TEXT_APPLICATION_TYPES = frozenset({
    "application/json", "application/xml", "application/javascript", "application/ecmascript",
    "application/x-ndjson", "application/yaml", "application/x-yaml", "application/toml",
})


def is_text_type(mime: str) -> bool:
    """Text a model can read as it is (HTML excepted: it is converted).
    No image type is text, not even SVG (image/svg+xml)."""
    if mime.startswith("image/"):
        return False
    return (mime.startswith("text/") or mime in TEXT_APPLICATION_TYPES
            or mime.endswith("+json") or mime.endswith("+xml"))


def decode_text(body: bytes, charset: str | None) -> str:
    """Bytes -> str as a browser decodes them (webtools.charsets): a BOM wins, then
    the declared charset if it is a WHATWG label, then UTF-8; undecodable bytes
    become U+FFFD. Never raises (`charset=undefined` or `idna` is UTF-8)."""
    return charsets.decode(body, charset)


def now_rfc3339() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def status_not_ok(fetched: Fetched) -> WebError:
    return WebError("web_status_not_ok", f"{fetched.final_url} answered {fetched.status}, not a 2xx status; "
                    "the page was not read", status=fetched.status, url=fetched.url, final_url=fetched.final_url)


@contextlib.contextmanager
def conversion_errors(url: str, timeout: float):
    """The converter's worker (webtools._convert_worker) overrunning the call's
    deadline is web_timeout; the worker dying (its memory bound) is web_too_large."""
    from sluice.webtools._convert_worker import WORKER_MEMORY, ConversionFailed, ConversionTimeout

    try:
        yield
    except ConversionTimeout:
        raise WebError("web_timeout", f"{url} was read, but converting it did not finish within the tools' deadline "
                       f"({timeout:g} s): the page is too costly to convert; try another URL", url=url) from None
    except ConversionFailed:
        raise WebError("web_too_large", f"{url} was read, but converting it needed more than the converter's "
                       f"memory bound ({WORKER_MEMORY // 2**20} MiB); try another URL", limit=WORKER_MEMORY,
                       url=url) from None


def _fetch_plan(limits: WebToolLimits):
    def classify(f: Fetched) -> ReadPlan:
        if not 200 <= f.status < 300:
            raise status_not_ok(f)
        if f.mime in HTML_TYPES or is_text_type(f.mime):
            return ReadPlan(limits.text_bytes, truncate=True)
        if f.mime in IMAGE_TYPES:
            return ReadPlan(limits.image_bytes)
        if f.mime == PDF_TYPE:
            return ReadPlan(limits.pdf_bytes)
        shown = f.mime or "none (no Content-Type)"
        hint = ("only JPEG, PNG, GIF and WebP images are passed to a model" if f.mime.startswith("image/")
                else "fetch reads HTML, text, markdown, JSON, XML, images (JPEG, PNG, GIF, WebP) and PDF")
        raise WebError("web_unsupported_type", f"{f.final_url} is of type {shown}, which fetch does not read: {hint}; "
                       "the body was not downloaded", content_type=media_type(f.content_type), url=f.url,
                       final_url=f.final_url)
    return classify


def fetch(url: str, offset: int = 0, max_chars: int = DEFAULT_MAX_CHARS, render: bool = False,
          screenshot: bool = False, *, client: WebClient | None = None, store: SourceStore | None = None,
          owner: str | None = None) -> dict:
    try:
        check_window_args(offset, max_chars)
        started = time.monotonic()
        if not isinstance(render, bool) or not isinstance(screenshot, bool):
            raise WebError("web_bad_argument", "render and screenshot are true or false")
        if screenshot and not render:
            raise WebError("web_bad_argument",
                           "screenshot=true needs render=true (a screenshot is of the rendered page)")
        owner = default_owner() if owner is None else owner
        with call_client(client) as client:
            reuse = reuse_seconds(getattr(client, "env", None))
            # A screenshot is not stored, so a call that wants one is never answered from the store.
            key = reuse_key(url, rendered=render) if reuse and not screenshot else None
            if key is not None:
                try:
                    store = store or default_store()
                    hit = store.recent(owner, key, reuse)
                except WebError:
                    hit = None  # the store's trouble is said where a source is kept (images keep none)
                if hit is not None:  # this owner fetched it moments ago: the stored source, no request
                    return page_result(hit, offset, max_chars, cached=reuse)
            if render:
                client.check_robots(url)  # the page itself; its subrequests and the browser's redirects are not asked
                rendered = _render(url, client, screenshot)
                if rendered.is_html:
                    return _rendered_page(rendered, client, store, owner, offset, max_chars, key)
            fetched = client.request(url, classify=_fetch_plan(client.limits), robots=True)
        if fetched.mime in IMAGE_TYPES or fetched.mime == PDF_TYPE:
            check_signature(fetched.mime, fetched.body, fetched.final_url)  # an "image" of HTML is refused
        if fetched.mime in IMAGE_TYPES:
            return _binary(fetched)
        extra = None
        if fetched.mime == PDF_TYPE:
            from sluice.webtools.pdf import extract

            pdf = extract(fetched.body, seconds=started + client.limits.timeout - time.monotonic(),
                          max_chars=client.limits.text_bytes)
            title, content, needs_js, hidden_chars, cut = pdf.title, pdf.text, False, 0, False
            extra = {"pages": pdf.pages, "pages_read": pdf.pages_read, "scanned": pdf.scanned,
                     "text_incomplete": pdf.incomplete}
        elif fetched.mime in HTML_TYPES:
            from sluice.webtools.convert import html_to_markdown

            with conversion_errors(fetched.final_url, client.limits.timeout):
                converted = html_to_markdown(fetched.body, fetched.final_url, encoding=fetched.charset,
                                             max_chars=client.limits.text_bytes,
                                             deadline=started + client.limits.timeout)
            title, content, needs_js = converted.title, converted.markdown, converted.needs_javascript
            hidden_chars, cut = converted.hidden_chars, converted.cut
        else:
            title, content, needs_js = None, decode_text(fetched.body, fetched.charset), False
            hidden_chars, cut = 0, False
        source = {
            "url": fetched.url, "final_url": fetched.final_url, "status": fetched.status,
            "content_type": fetched.content_type, "title": title, "needs_javascript": needs_js,
            "truncated": fetched.truncated, "captured_at": now_rfc3339(), "content": content,
            "hidden_chars": hidden_chars, "markdown_truncated": cut,
        }
        if extra is not None:
            source.update(kind="pdf", extra=extra)
        if key is not None:
            source["reuse_key"] = key
        if fetched.truncated:
            source["read_cap"] = client.limits.text_bytes  # the notice names the cap that cut it
        source.update(header_values(source))
        store = store or default_store()
        # put() may cut content to the per-source cap (and mark it): the
        # window is then over what was stored, as source_read will see it.
        source["source_id"] = store.put(owner, source)
        return page_result(source, offset, max_chars, binary=_binary(fetched) if extra is not None else None,
                           cached=0)
    except WebError as e:
        return e.as_dict()


def _render(url: str, client: WebClient, screenshot: bool):
    """The page loaded in the browser (webtools.render), through the proxy the client would use."""
    from sluice.webtools.client import check_url, proxy_for
    from sluice.webtools.render import render_page

    env = os.environ if client.env is None else client.env
    target = check_url(url)  # the first-line check, as for a static fetch
    return render_page(target, proxy_url=proxy_for(target.split(":", 1)[0], env), env=env,
                       timeout=client.limits.timeout, screenshot=screenshot)


def _rendered_page(rendered, client: WebClient, store, owner, offset: int, max_chars: int,
                   key: str | None = None) -> dict:
    """A rendered DOM through the same conversion, store and windows as a static page."""
    from sluice.webtools.convert import html_to_markdown
    from sluice.webtools.render import screenshot_part

    html = rendered.html
    truncated = rendered.truncated
    if len(html) > client.limits.text_bytes:  # the same read cap as a static page
        html, truncated = html[:client.limits.text_bytes], True
    converted = html_to_markdown(html, rendered.final_url, encoding="utf-8", max_chars=client.limits.text_bytes)
    source = {
        "url": rendered.url, "final_url": rendered.final_url, "status": rendered.status,
        "content_type": rendered.content_type, "title": converted.title,
        "needs_javascript": converted.needs_javascript, "truncated": truncated, "captured_at": now_rfc3339(),
        "content": converted.markdown, "hidden_chars": converted.hidden_chars,
        "markdown_truncated": converted.cut, "rendered": True, "render": rendered.stats,
        "extra": {"rendered": True}, "reuse_key": key,
    }
    if truncated and len(rendered.html) > client.limits.text_bytes:
        source["read_cap"] = client.limits.text_bytes
    source.update(header_values(source))
    store = store or default_store()
    source["source_id"] = store.put(default_owner() if owner is None else owner, source)
    result = page_result(source, offset, max_chars, cached=0)
    shot = screenshot_part(rendered)
    if shot is not None:
        result["screenshot"] = {k: v for k, v in shot.items() if k != "data"}
        result["screenshot_data"] = shot["data"]
    return result


DEFAULT_REUSE_SECONDS = 300.0


def reuse_seconds(env: dict | None = None) -> float:
    """SLUICE_WEB_REUSE: for how long a fetch returns the owner's stored
    source of the same URL instead of fetching again (a duration, `5m` by
    default; 0 turns reuse off)."""
    raw = ((os.environ if env is None else env).get("SLUICE_WEB_REUSE") or "").strip()
    if not raw:
        return DEFAULT_REUSE_SECONDS
    try:
        return parse_duration(raw, allow_zero=True)
    except ValueError as e:
        raise WebError("web_bad_argument", f"SLUICE_WEB_REUSE: {clean(e, 200)} (0 turns reuse off)") from None


def reuse_key(url, *, rendered: bool) -> str | None:
    """What a repeat fetch is matched on: the URL as it would be requested
    (scheme and host lower-case, the default port dropped, the host
    canonical; no fragment) and whether it was rendered. None when the URL
    would not be requested at all (fetch then says why)."""
    if not isinstance(url, str) or len(url) > MAX_URL_CHARS:
        return None
    try:
        target = request_url(url.strip())
    except WebError:
        return None
    return f"{'rendered' if rendered else 'plain'} {target.copy_with(fragment=None)}"


def source_read(source_id: str, offset: int = 0, max_chars: int = DEFAULT_MAX_CHARS, *,
                store: SourceStore | None = None, owner: str | None = None) -> dict:
    try:
        check_window_args(offset, max_chars)
        store = store or default_store()
        source = store.get(default_owner() if owner is None else owner, source_id)
        if source is None:
            raise WebError("web_source_not_found", f"there is no source {source_id!r} for this owner (unknown, expired "
                           "or evicted, or fetched by someone else); fetch the URL again", source_id=source_id)
        return page_result(source, offset, max_chars)
    except WebError as e:
        return e.as_dict()


def header_values(r: dict) -> dict:
    """The values a header line shows, bounded and sanitised (webtools.sanitize):
    URLs and title one clean line (the title cut to 300 characters), the
    content type as type/subtype only."""
    out = {"url": clean(r["url"], URL_CHARS), "final_url": clean(r["final_url"], URL_CHARS),
           "content_type": media_type(r["content_type"])}
    if "title" in r:
        out["title"] = clean_optional(r["title"], TITLE_CHARS)
    return out


def page_result(source: dict, offset: int, max_chars: int, *, binary: dict | None = None,
                cached: float | None = None) -> dict:
    """One window of a stored source. A PDF's (kind "pdf") carries its page
    counts and, from fetch, the PDF itself (`binary`: bytes, sha256, data).
    From fetch, `cached` is 0 for a fresh capture, else the reuse window (s)
    within which the stored source was returned instead (`cached: true`)."""
    source = {**source, **header_values(source)}
    try:
        w = window(source["content"], offset, max_chars)
    except WebError as e:
        e.fields["source_id"] = source["source_id"]
        raise
    result = {
        "kind": source.get("kind") or "page",
        "url": source["url"],
        "final_url": source["final_url"],
        "status": source["status"],
        "content_type": source["content_type"],
        "title": source["title"],
        "captured_at": source["captured_at"],
        "source_id": source["source_id"],
        "total_chars": w["total_chars"],
        "offset": w["offset"],
        "end": w["end"],
        "next_offset": w["next_offset"],
        "truncated": source["truncated"],
        "store_truncated": source.get("store_truncated", False),
        "markdown_truncated": source.get("markdown_truncated", False),
        "needs_javascript": source["needs_javascript"],
        "hidden_chars": source.get("hidden_chars", 0),
        "rendered": bool(source.get("rendered") or (source.get("extra") or {}).get("rendered")),
        "content": w["content"],
    }
    if source.get("render"):
        result["render"] = source["render"]
    if source.get("read_cap"):
        result["read_cap"] = source["read_cap"]
    if cached is not None:
        result["cached"] = bool(cached)
        if cached:
            result["reuse_seconds"] = cached
    if result["kind"] == "pdf":
        extra = source.get("extra") or {}
        result.update({name: extra.get(name) for name in ("pages", "pages_read", "text_incomplete")})
        result["scanned"] = bool(extra.get("scanned"))
        if binary is not None:
            result.update(bytes=binary["bytes"], sha256=binary["sha256"], data=binary["data"])
    result["text"] = page_text(result)
    return result


# Why a PDF's text stops early (webtools.pdf's `incomplete`), as the header says it.
PDF_INCOMPLETE = {
    "page_cap": "only the first {pages_read:,} of its {pages:,} pages were read (the page cap)",
    "char_cap": "its text reached the read cap; the pages after page {pages_read:,} were not read",
    "deadline": "reading its text ran out of the call's time after {pages_read:,} pages",
    "memory": "reading its text ran out of memory after {pages_read:,} pages",
    "encrypted": "it is encrypted with a password, so its text cannot be read",
    "unreadable": "its text cannot be read (it is damaged, or not a PDF the parser understands)",
}


def pdf_notes(r: dict) -> list[str]:
    """The header lines about a PDF's text: how much of it there is, and why not more."""
    attached = ("the PDF itself is attached for models that read PDFs" if r.get("data")
                else "web_fetch's result carried the PDF itself, for models that read PDFs")
    if r.get("scanned"):
        return [f"[this PDF has no text layer: its pages are images (a scan), so no text was extracted; {attached}]"]
    why = r.get("text_incomplete")
    lines = []
    if why in PDF_INCOMPLETE:
        said = PDF_INCOMPLETE[why].format(pages=r.get("pages") or 0, pages_read=r.get("pages_read") or 0)
        lines.append(f"[incomplete text: {said}; {attached}]")
    elif not r["total_chars"]:
        lines.append(f"[this PDF has no text to extract; {attached}]")
    return lines


def page_text(r: dict) -> str:
    lines = []
    if r["kind"] == "pdf":
        pages = f", {r['pages']:,} pages" if r.get("pages") is not None else ""
        lines.append(binary_header(r) if r.get("data") else f"PDF text{pages}, from {r['final_url']}")
    if r["title"]:
        lines.append(f"Title: {r['title']}")
    lines.append(f"URL: {r['final_url']}")
    lines.append(f"Status: {r['status']} · source_id: {r['source_id']} · captured {r['captured_at']}")
    note = paging_note(r)
    if note:
        lines.append(note)
    if r.get("store_truncated"):
        lines.append("[truncated: the converted page was longer than the source store keeps for one source; "
                     "only its start was kept]")
    elif r["truncated"] and (r.get("read_cap") or not (r.get("render") or {}).get("cut")):
        cap = r.get("read_cap")
        size = f"{cap:,} bytes" if cap else "SLUICE_WEB_TEXT_BYTES when it was fetched, 2 MiB by default"
        lines.append(f"[truncated: the page was longer than the read cap ({size}); only its start was read]")
    elif r.get("markdown_truncated"):
        lines.append("[truncated: the page's markdown reached its bound (twice the page's size, and the read cap); "
                     "only its start was kept]")
    if r.get("hidden_chars"):
        lines.append(f"[{r['hidden_chars']:,} characters of text a reader cannot see (hidden by the page's markup "
                     "or its own styles) were left out]")
    if r.get("cached"):
        lines.append(f"[cached: this owner fetched it at {r['captured_at']}, less than {r['reuse_seconds']:g} s ago "
                     "(SLUICE_WEB_REUSE), so no new request was made; this is the source as it was then]")
    if r["kind"] == "pdf":
        lines += pdf_notes(r)
    if r.get("render"):
        lines.append(render_note(r["render"]))
    if r["needs_javascript"] and not r.get("rendered"):
        lines.append("[this page needs JavaScript: it is an app shell with almost no text, and no scripts ran; "
                     "fetch it again with render=true, or look for another source]")
    elif r["needs_javascript"]:
        lines.append("[even rendered, this page has almost no text; look for another source]")
    lines.append(envelope(r["content"], url=r["final_url"], title=r["title"]))
    return "\n".join(lines)


_CUT_WORDS = {"requests": "its request cap", "bytes": "its data cap", "dom_nodes": "its DOM cap (only the first "
              "elements were kept)", "screenshot_bytes": "the screenshot cap (no screenshot)"}


def render_note(stats: dict) -> str:
    """One line on what the browser did: requests, the proxy's refusals, failed tunnels, caps."""
    parts = [f"rendered in a browser: {stats.get('requests', 0)} requests"]
    refused = stats.get("refused") or {}
    if refused:
        reasons = ", ".join(f"{reason} x{n}" for reason, n in sorted(refused.items()))
        parts.append(f"{sum(refused.values())} refused by the proxy ({reasons})")
    if stats.get("failed_tunnels"):
        parts.append(f"{stats['failed_tunnels']} tunnels refused or failed")
    if not stats.get("network_quiet", True):
        parts.append("the network was still busy at the deadline")
    cut = [_CUT_WORDS.get(c, c) for c in stats.get("cut") or ()]
    if cut:
        parts.append("stopped at " + " and ".join(cut))
    return "[" + "; ".join(parts) + "]"


def _binary(f: Fetched) -> dict:
    kind = "pdf" if f.mime == PDF_TYPE else "image"
    return {
        "kind": kind,
        "url": clean(f.url, URL_CHARS),
        "final_url": clean(f.final_url, URL_CHARS),
        "status": f.status,
        "content_type": media_type(f.mime),
        "bytes": len(f.body),
        "sha256": hashlib.sha256(f.body).hexdigest(),
        "data": base64.b64encode(f.body).decode("ascii"),
    }


def binary_header(r: dict) -> str:
    """The one-line text header that goes with an image or PDF part."""
    pages = f", {r['pages']:,} pages" if r.get("pages") is not None else ""
    return (f"{'PDF' if r['kind'] == 'pdf' else 'Image'} {r['content_type']}, {r['bytes']:,} bytes{pages}, "
            f"from {r['final_url']} (sha256 {r['sha256']})")
