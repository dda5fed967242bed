"""The one table of the web tools' error codes, and the error type.

Every tool returns either its result dict or `{"error": {"code", "message",
...fields}}`. Codes are stable API (agents match on them; add codes, never
rename one). `message` is one sentence an agent can act on. The README's
"Web tools" error table is generated from `ERRORS` (a test keeps them equal).
"""

from __future__ import annotations

from typing import Any

from sluice.webtools.sanitize import FIELD_CHARS, MESSAGE_CHARS, clean

# code -> what it means (one line, for the README table and tool descriptions)
ERRORS: dict[str, str] = {
    "web_no_proxy": "no proxy is configured (SLUICE_PROXY, or HTTPS_PROXY/HTTP_PROXY/ALL_PROXY by scheme); the tools "
                    "never connect directly",
    "web_proxy_unreachable": "the configured proxy did not accept the connection (not running, wrong address)",
    "web_proxy_auth": "the proxy answered 407: it wants client credentials (user:pass@ in SLUICE_PROXY), or the ones "
                      "given are wrong",
    "web_blocked": "the egress policy refused the request; `reason` is the Sluice reason code (from the proxy, `by: "
                   "\"proxy\"`, believed only from a response the proxy made: plain http, or a tunnel it intercepts, "
                   "by its CA; or the tools' own first-line URL check, `by: \"client\"`); a refused redirect hop is "
                   "`redirect_refused`",
    "web_bad_url": "the URL is not an absolute http(s) URL, or URL parsers would read its host part differently (a "
                   "backslash in it, say)",
    "web_bad_argument": "an argument has the wrong type or is out of range (the message names it)",
    "web_timeout": "the request took longer than the tools' deadline (20 s by default)",
    "web_unreachable": "the proxy could not complete the request (the origin refused or failed the connection, or "
                       "answered garbage)",
    "web_response_incomplete": "the connection closed before the whole response arrived (the origin, or a cap of the "
                               "proxy, cut it)",
    "web_tls_error": "the TLS handshake with the origin (or the intercepting proxy) failed, e.g. an untrusted "
                     "certificate: set SLUICE_CA_CERT for an intercepting Sluice",
    "web_too_many_redirects": "more than 5 redirects; the last `location` is given",
    "web_too_large": "the body is over the cap for its kind (`limit` bytes; `decoded: true` when the cap was reached "
                     "inflating a compressed body); nothing was truncated",
    "web_unsupported_encoding": "the response uses a Content-Encoding the tools cannot decode (named)",
    "web_unsupported_type": "fetch cannot hand this content type to a model (named); refused before the body was read",
    "web_type_mismatch": "an image or PDF whose bytes are not of its declared type (`content_type`; `looks_like` says "
                         "what they look like); nothing of it is returned",
    "web_internal_error": "a bug in the web tools, not in the request (the exception is named); nothing was returned: "
                          "report it",
    "web_busy": "the MCP server is already running its limit of calls at once (SLUICE_WEB_CONCURRENCY, 8 by default); "
                "try again when one has answered",
    "web_render_unavailable": "render=true needs the render extra (`pip install 'sluice[render]'`), Debian's Chromium, "
                              "and, as root, SLUICE_RENDER_USER (the message says which is missing)",
    "web_render_failed": "the browser crashed or went over its memory cap while rendering; fetch without render may "
                         "still read the page",
    "web_status_not_ok": "the origin answered with a status outside 2xx (`status`)",
    "web_bad_offset": "offset is not a non-negative whole number",
    "web_offset_past_end": "offset is past the end of the page (`total_chars`)",
    "web_source_not_found": "no source with this id belongs to this owner (unknown, expired, evicted or another "
                            "owner's)",
    "web_store_error": "the source store could not be opened or written (SLUICE_SOURCES)",
    "web_not_html": "read takes HTML or XHTML pages only; use request for text and JSON, sitemap for sitemaps",
    "web_robots_disallowed": "the origin's robots.txt disallows this URL for Sluice's user agent (`rule`, "
                             "`robots_url`), or answered a 5xx, which disallows the whole site for a few minutes; "
                             "SLUICE_WEB_ROBOTS=ignore turns the check off",
    "web_page_too_large": "the page's visible text is longer than one result (`chars`, `sha256`); no text is returned",
    "web_method_not_allowed": "request sends GET only",
    "web_header_not_allowed": "request may set only accept and accept-language (the refused header is named)",
    "web_not_text": "request returns text and JSON bodies only (the type is named)",
    "web_body_too_large": "the body is longer than one result (`bytes`, `sha256`); no body is returned",
    "web_not_sitemap": "the document is not an XML sitemap (urlset) or sitemap index",
    "search_bad_query": "the search query is empty (or longer than 400 characters)",
    "search_unknown_provider": "no search provider has this name (`providers` lists them)",
    "search_not_configured": "search is off (`SLUICE_SEARCH_PROVIDER=none`), or the chosen provider lacks its URL, or "
                             "its key file cannot be read; fetch still works",
    "search_bad_key": "the provider refused the key (Serper 403, Brave 422, Tavily/Firecrawl 401); the message says "
                      "whether a key was sent at all (none: neither the tool nor the proxy supplied one)",
    "search_rate_limited": "the provider answered 429 (`retry_after` seconds when it said)",
    "search_provider_error": "the provider failed: an HTTP error (`status`, `provider_message`: its own words, e.g. "
                             "Serper's \"Not enough credits\"), SearXNG's 403 with JSON output disabled, or a body "
                             "that is not its API's answer; never an empty result",
    "search_blocked": "DuckDuckGo answered with its bot challenge (202) or refused (403) instead of results",
    "search_unreachable": "the provider could not be reached: Sluice refused its address (`reason`, `by`; a private "
                          "address must be opened in the policy's private_networks) or the connection failed (`cause`)",
    "search_timeout": "the provider did not answer within the tools' deadline",
}

# Codes only the operator can fix (setup: proxy, TLS/CA, store, keys, a bug): the
# tool descriptions leave them to their own message, which names the fix.
SETUP_CODES = frozenset({"web_no_proxy", "web_proxy_unreachable", "web_proxy_auth", "web_tls_error",
                         "web_store_error", "web_internal_error", "search_bad_key",
                         "web_render_unavailable"})


class WebError(Exception):
    """A tool error: a stable code, one sentence, and extra JSON-able fields."""

    def __init__(self, code: str, message: str, **fields: Any) -> None:
        if code not in ERRORS:
            raise ValueError(f"unknown web tool error code {code!r}")
        super().__init__(message)
        self.code = code
        self.message = message
        self.fields = fields

    def as_dict(self) -> dict[str, Any]:
        """The error dict, its message and string fields through the one
        sanitiser (webtools.sanitize): they embed web-derived values (URLs,
        Location headers, provider messages) and are printed as Sluice's words."""
        fields = {k: clean(v, FIELD_CHARS) if isinstance(v, str) else v for k, v in self.fields.items()}
        return {"error": {"code": self.code, "message": clean(self.message, MESSAGE_CHARS), **fields}}


def is_error(result: dict) -> bool:
    return isinstance(result, dict) and "error" in result


def markdown_table() -> str:
    """The README's error table."""
    rows = ["| Code | Meaning |", "|---|---|"]
    rows += [f"| `{code}` | {meaning.replace('|', '\\|')} |" for code, meaning in ERRORS.items()]
    return "\n".join(rows)
