"""search(query, count=10, provider=None): web search through the proxy.

Returns `{provider, query, results: [{title, url, snippet, source}]}` or an
error dict. `results` keep the provider's order; links that are not
http(s), that the first-line checks refuse (internal names, literal private
addresses, user:pass@), and duplicates are dropped. Duplicates are judged on
a normalised URL: scheme and host lower-cased, default port, trailing slash,
fragment and tracking parameters (`utm_*`, `gclid`, `fbclid`, ...) removed;
the URL returned is the first one as the provider gave it. `count` is capped
to 1-20. Titles and snippets are plain text (tags removed, entities decoded,
whitespace collapsed). `source` is the provider, or for SearXNG the engine.

Providers (`--provider`, `SLUICE_SEARCH_PROVIDER`): serper, brave, tavily,
firecrawl, searxng, duckduckgo, none. Without a name, the first configured
one in the order Serper (`SERPER_API_KEY`), Brave (`BRAVE_SEARCH_API_KEY`),
Tavily (`TAVILY_API_KEY`), Firecrawl (`FIRECRAWL_API_KEY` or
`FIRECRAWL_URL`), SearXNG (`SEARXNG_URL`); else DuckDuckGo's HTML page
(keyless). `none` answers `search_not_configured`. A key may also come from
a file named by `<VAR>_FILE`. A provider named explicitly may have no key
at all (the proxy injects it); a 401/422 then says neither supplied one.

Failures are failures: a provider's HTTP error, bad key, rate limit,
malformed body, challenge page, timeout or the proxy's refusal is an error
with a stable code (webtools.errors), never an empty list, and never a
silent switch to another provider. Keys travel only in headers to their
provider's origin (the client drops them on a redirect elsewhere) and are
scrubbed from any provider message that echoes them.

Operator-configured URLs (SEARXNG_URL, FIRECRAWL_URL) skip the tools'
first-line URL checks: the proxy's policy decides (`private_networks`, and
`allow` when reached by a name).
"""

from __future__ import annotations

import email.utils
import html
import ipaddress
import json
import os
import re
import time
from dataclasses import dataclass
from urllib.parse import parse_qs, parse_qsl, urlencode, urlsplit, urlunsplit

from sluice.webtools.client import Fetched, ReadPlan, WebClient, call_client, check_url
from sluice.webtools.errors import WebError
from sluice.webtools.sanitize import TITLE_CHARS, URL_CHARS, clean, is_clean
from sluice.policy.urls import split_url

PROVIDERS = ("serper", "brave", "tavily", "firecrawl", "searxng", "duckduckgo", "none")
AUTO_ORDER = ("serper", "brave", "tavily", "firecrawl", "searxng")
KEY_VARS = {"serper": "SERPER_API_KEY", "brave": "BRAVE_SEARCH_API_KEY", "tavily": "TAVILY_API_KEY",
            "firecrawl": "FIRECRAWL_API_KEY"}
URL_VARS = {"firecrawl": "FIRECRAWL_URL", "searxng": "SEARXNG_URL"}
DEFAULT_COUNT, MAX_COUNT = 10, 20
MAX_QUERY_CHARS = 400
MAX_TITLE, MAX_SNIPPET, MAX_SOURCE = TITLE_CHARS, 600, 64
BODY_CAP = 2 * 1024 * 1024
SERPER_URL = "https://google.serper.dev/search"
BRAVE_URL = "https://api.search.brave.com/res/v1/web/search"
TAVILY_URL = "https://api.tavily.com/search"
FIRECRAWL_CLOUD = "https://api.firecrawl.dev"
DDG_URL = "https://html.duckduckgo.com/html/"
TRACKING = frozenset({"gclid", "dclid", "fbclid", "msclkid", "mc_cid", "mc_eid", "igshid", "yclid", "_ga", "_gl",
                      "ref_src", "si", "spm", "oly_anon_id", "oly_enc_id", "vero_id", "wickedid", "twclid"})


# ---------------------------------------------------------------- configuration

def read_key(env, provider: str) -> str | None:
    """The provider's key from VAR, else from the file VAR_FILE names; None when neither is set."""
    var = KEY_VARS.get(provider)
    if var is None:
        return None
    value = (env.get(var) or "").strip()
    if value:
        return value
    path = (env.get(var + "_FILE") or "").strip()
    if not path:
        return None
    try:
        with open(path, "rb") as fh:
            data = fh.read(65537)
    except OSError as e:
        raise WebError("search_not_configured", f"{var}_FILE names {path}, which cannot be read "
                       f"({e.strerror or type(e).__name__})", provider=provider) from None
    value = data[:65536].decode("utf-8", "replace").strip()
    if not value or len(data) > 65536 or any(c in value for c in "\r\n\0"):
        raise WebError("search_not_configured", f"{var}_FILE names {path}, which does not hold one key on one line",
                       provider=provider)
    return value


def configured(env, provider: str) -> bool:
    key_var, url_var = KEY_VARS.get(provider), URL_VARS.get(provider)
    return bool((key_var and ((env.get(key_var) or "").strip() or (env.get(key_var + "_FILE") or "").strip()))
                or (url_var and (env.get(url_var) or "").strip()))


def choose(env, provider: str | None) -> tuple[str, bool]:
    """(provider name, named explicitly?)."""
    named = provider if provider not in (None, "") else (env.get("SLUICE_SEARCH_PROVIDER") or "").strip()
    if named:
        if not isinstance(named, str) or named.strip().lower() not in PROVIDERS:
            raise WebError("search_unknown_provider", f"there is no search provider {named!r}; the providers are "
                           f"{', '.join(PROVIDERS)}", providers=list(PROVIDERS))
        return named.strip().lower(), True
    for name in AUTO_ORDER:
        if configured(env, name):
            return name, False
    return "duckduckgo", False


def operator_url(env, var: str, provider: str) -> str:
    raw = (env.get(var) or "").strip()
    try:
        target = split_url(raw)
    except ValueError as e:
        raise WebError("search_not_configured", f"{var}={raw!r} is not an http(s) URL ({e})",
                       provider=provider) from None
    if target.scheme not in ("http", "https") or target.has_credentials:
        raise WebError("search_not_configured", f"{var} must be an http(s) URL without user:password@",
                       provider=provider)
    return raw.split("#", 1)[0].split("?", 1)[0].rstrip("/")


# ---------------------------------------------------------------- normalisation

def clean_text(value, limit: int) -> str:
    """Plain text of a provider's field: tags removed, entities decoded, then
    the one sanitiser (webtools.sanitize: one line, no controls, bidi or
    zero-width characters, at most `limit` characters)."""
    if not isinstance(value, str):
        return ""
    return clean(html.unescape(re.sub(r"<[^>]*>", "", value[: 8 * limit])), limit)


def result_url(url) -> str | None:
    """A result's URL as given, or None when it cannot be shown as it is:
    longer than 2,048 characters, or holding whitespace, control, bidi or
    zero-width characters."""
    if not isinstance(url, str):
        return None
    url = url.strip()
    if not url or len(url) > URL_CHARS or not is_clean(url) or any(c.isspace() for c in url):
        return None
    return url


def dedupe_key(url) -> str | None:
    """The URL as compared for duplicates, or None when the link is dropped
    (not http(s), malformed, or refused by the first-line checks)."""
    if not isinstance(url, str) or not url.strip():
        return None
    try:
        target = split_url(url.strip())
        parts = urlsplit(url.strip())
    except ValueError:
        return None
    scheme = target.scheme.lower()
    try:
        check_url(url)  # exactly fetch's check: the policy's refusals and the parser differentials (backslashes)
    except WebError:
        return None
    try:
        port = parts.port
    except ValueError:
        return None
    host = (parts.hostname or "").lower().rstrip(".")
    if ":" in host:
        host = f"[{host}]"
    netloc = host if port in (None, 80 if scheme == "http" else 443) else f"{host}:{port}"
    path = parts.path.rstrip("/")
    query = [(k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True)
             if not k.lower().startswith("utm_") and k.lower() not in TRACKING]
    return urlunsplit((scheme, netloc, path, urlencode(query), ""))


def finish(provider: str, query: str, raw: list[dict], count: int) -> dict:
    results, seen = [], set()
    for item in raw:
        url = result_url(item.get("url"))
        key = dedupe_key(url)
        if key is None or key in seen:
            continue
        seen.add(key)
        source = item.get("source")
        results.append({"title": clean_text(item.get("title"), MAX_TITLE) or url, "url": url,
                        "snippet": clean_text(item.get("snippet"), MAX_SNIPPET),
                        "source": (clean(source, MAX_SOURCE) if isinstance(source, str) else "") or provider})
        if len(results) >= count:
            break
    return {"provider": provider, "query": clean(query, MAX_QUERY_CHARS), "results": results}


# ---------------------------------------------------------------- errors

def retry_after(value: str | None) -> int | None:
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return int(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when is None:
        return None
    return max(0, int(when.timestamp() - time.time()))


@dataclass
class Call:
    provider: str
    key: str | None
    key_var: str | None
    env: dict

    def scrub(self, text: str) -> str:
        text = (text or "").strip()
        if self.key:
            text = text.replace(self.key, "***")
        return text[:300]

    def bad_key(self, f: Fetched, message: str) -> WebError:
        if self.key:
            why = f"rejected the key in {self.key_var}"
        else:
            why = (f"wants a key, and neither the tool ({self.key_var} / {self.key_var}_FILE) nor the proxy "
                   "(a credentials entry in the policy) supplied one")
        return WebError("search_bad_key", f"{self.provider} answered {f.status}: it {why}"
                        + (f" ({message})" if message else ""), provider=self.provider, status=f.status)

    def failed(self, f: Fetched, message: str, *, auth: bool = False) -> WebError:
        message = self.scrub(message)
        if auth:
            return self.bad_key(f, message)
        if f.status == 429:
            wait = retry_after(f.headers.get("retry-after"))
            fields = {"retry_after": wait} if wait is not None else {}
            return WebError("search_rate_limited", f"{self.provider} is rate limiting these searches (429"
                            + (f", retry after {wait} s" if wait is not None else "") + ")"
                            + (f": {message}" if message else ""), provider=self.provider, status=429, **fields)
        return WebError("search_provider_error", f"{self.provider} answered {f.status}"
                        + (f": {message}" if message else " with no message"), provider=self.provider,
                        status=f.status, provider_message=message)

    def malformed(self, f: Fetched, what: str) -> WebError:
        return WebError("search_provider_error", f"{self.provider} answered {f.status} with {what}; "
                        "this is the provider's failure, not an empty result", provider=self.provider,
                        status=f.status, provider_message="")


def _json(f: Fetched):
    try:
        return json.loads(f.body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return _NOT_JSON


_NOT_JSON = object()


def _exchange(client: WebClient, call: Call, method: str, url: str, *, headers: dict | None = None,
              credentials: dict | None = None, body=None, form: dict | None = None, check: bool = True) -> Fetched:
    send = dict(headers or {})
    content = None
    if body is not None:
        content = json.dumps(body).encode()
        send["Content-Type"] = "application/json"
    elif form is not None:
        content = urlencode(form).encode()
        send["Content-Type"] = "application/x-www-form-urlencoded"
    try:
        return client.request(url, classify=lambda f: ReadPlan(min(client.limits.text_bytes, BODY_CAP)), headers=send,
                              credentials=credentials, check=check, method=method, content=content)
    except WebError as e:
        raise translate(e, call.provider, url) from None


PRIVATE_REASONS = ("address_not_public", "dns_answer_not_public", "internal_hostname", "host_not_allowed",
                   "port_not_allowed")


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def translate(e: WebError, provider: str, url: str) -> WebError:
    """A transport error as the provider's failure."""
    fields = {k: v for k, v in e.fields.items() if k in ("reason", "by", "status")}
    if e.code == "web_blocked":
        host = urlsplit(url).hostname or url
        hint = ""
        if e.fields.get("reason") in PRIVATE_REASONS:
            named = "" if _is_ip(host) else (f", and adds {host} to allow beside the hosts already allowed "
                                              f"(allow: [\"*\", {host}])")
            hint = (f" A self-hosted provider at a private address works only when the proxy's policy opens that "
                    f"address with its port under private_networks (e.g. \"10.0.0.5/32:8080\"){named}.")
        return WebError("search_unreachable", f"Sluice refused the connection to {provider} at {host} "
                        f"({e.fields.get('reason')}): {e.message}{hint}", provider=provider, url=url, **fields)
    if e.code == "web_timeout":
        return WebError("search_timeout", f"{provider} did not answer within the deadline ({e.message})",
                        provider=provider, url=url)
    if e.code in ("web_unreachable", "web_tls_error", "web_response_incomplete", "web_bad_url",
                  "web_too_many_redirects", "web_unsupported_encoding"):
        return WebError("search_unreachable", f"{provider} could not be reached: {e.message}", provider=provider,
                        url=url, cause=e.code, **fields)
    if e.code == "web_too_large":
        return WebError("search_provider_error", f"{provider}'s answer is larger than {BODY_CAP:,} bytes; not read",
                        provider=provider, provider_message="")
    return WebError(e.code, e.message, provider=provider, **e.fields)  # proxy configuration: web_no_proxy, ...


# ---------------------------------------------------------------- providers

def _serper(client, call, query, count):
    creds = {"X-API-KEY": call.key} if call.key else None
    f = _exchange(client, call, "POST", SERPER_URL, body={"q": query, "num": count}, credentials=creds)
    data = _json(f)
    if not 200 <= f.status < 300:
        message = data.get("message", "") if isinstance(data, dict) else f.body[:300].decode("utf-8", "replace")
        raise call.failed(f, str(message), auth=f.status in (401, 403))
    if not isinstance(data, dict) or not isinstance(data.get("organic", []), list):
        raise call.malformed(f, "a body that is not Serper's JSON")
    return [{"title": r.get("title"), "url": r.get("link"), "snippet": r.get("snippet")}
            for r in data.get("organic", []) if isinstance(r, dict)]


def _brave(client, call, query, count):
    creds = {"X-Subscription-Token": call.key} if call.key else None
    url = BRAVE_URL + "?" + urlencode({"q": query, "count": count})
    f = _exchange(client, call, "GET", url, headers={"Accept": "application/json"}, credentials=creds)
    data = _json(f)
    if not 200 <= f.status < 300:
        err = data.get("error") if isinstance(data, dict) else None
        err = err if isinstance(err, dict) else {}
        code = str(err.get("code") or "")
        detail = str(err.get("detail") or "") or (f.body[:300].decode("utf-8", "replace") if data is _NOT_JSON else "")
        message = f"{code}: {detail}" if code and detail else code or detail
        token_invalid = code == "SUBSCRIPTION_TOKEN_INVALID" \
            or "subscription-token" in f.body.decode("utf-8", "replace").lower()
        auth = f.status in (401, 403) or (f.status == 422 and token_invalid)
        raise call.failed(f, message, auth=auth)
    if not isinstance(data, dict) or data.get("type") == "ErrorResponse":
        raise call.malformed(f, "a body that is not Brave's search JSON")
    web = data.get("web") or {}
    if not isinstance(web, dict) or not isinstance(web.get("results", []), list):
        raise call.malformed(f, "a malformed web section")
    return [{"title": r.get("title"), "url": r.get("url"), "snippet": r.get("description")}
            for r in web.get("results", []) if isinstance(r, dict)]


def _tavily(client, call, query, count):
    creds = {"Authorization": f"Bearer {call.key}"} if call.key else None
    f = _exchange(client, call, "POST", TAVILY_URL, credentials=creds,
                  body={"query": query, "max_results": count})
    data = _json(f)
    if not 200 <= f.status < 300:
        detail = data.get("detail") if isinstance(data, dict) else None
        if isinstance(detail, dict):
            detail = detail.get("error") or detail.get("message") or ""
        message = str(detail or "") if data is not _NOT_JSON else f.body[:300].decode("utf-8", "replace")
        raise call.failed(f, message, auth=f.status == 401)
    if not isinstance(data, dict) or not isinstance(data.get("results"), list):
        raise call.malformed(f, "a body that is not Tavily's JSON")
    return [{"title": r.get("title"), "url": r.get("url"), "snippet": r.get("content")}
            for r in data["results"] if isinstance(r, dict)]


def _firecrawl(client, call, query, count):
    own = (call.env.get("FIRECRAWL_URL") or "").strip()
    base = operator_url(call.env, "FIRECRAWL_URL", "firecrawl") if own else FIRECRAWL_CLOUD
    creds = {"Authorization": f"Bearer {call.key}"} if call.key else None
    f = _exchange(client, call, "POST", base + "/v2/search", body={"query": query, "limit": count},
                  credentials=creds, check=not own)
    data = _json(f)
    if not 200 <= f.status < 300 or (isinstance(data, dict) and data.get("success") is False):
        message = data.get("error", "") if isinstance(data, dict) else f.body[:300].decode("utf-8", "replace")
        if 200 <= f.status < 300:
            raise WebError("search_provider_error", f"firecrawl answered success: false: {call.scrub(str(message))}",
                           provider="firecrawl", status=f.status, provider_message=call.scrub(str(message)))
        raise call.failed(f, str(message), auth=f.status == 401)
    if not isinstance(data, dict):
        raise call.malformed(f, "a body that is not Firecrawl's JSON")
    items = data.get("data")
    if isinstance(items, dict):  # v2: {web: [...], news: [...], images: [...]}
        items = items.get("web", [])
    if not isinstance(items, list):
        raise call.malformed(f, "no data list")
    return [{"title": r.get("title"), "url": r.get("url"), "snippet": r.get("description")}
            for r in items if isinstance(r, dict)]


def _searxng(client, call, query, count):
    if not (call.env.get("SEARXNG_URL") or "").strip():
        raise WebError("search_not_configured", "searxng needs SEARXNG_URL, the base URL of the instance "
                       "(e.g. http://searxng:8080)", provider="searxng")
    base = operator_url(call.env, "SEARXNG_URL", "searxng")
    url = base + "/search?" + urlencode({"q": query, "format": "json", "pageno": 1})
    f = _exchange(client, call, "GET", url, headers={"Accept": "application/json"}, check=False)
    data = _json(f)
    if f.status == 403:
        raise WebError("search_provider_error", "searxng answered 403: its JSON output is probably disabled; add "
                       "json to search.formats in the instance's settings.yml", provider="searxng", status=403,
                       provider_message=call.scrub(f.body[:300].decode("utf-8", "replace")))
    if not 200 <= f.status < 300:
        raise call.failed(f, f.body[:300].decode("utf-8", "replace"))
    if not isinstance(data, dict) or not isinstance(data.get("results"), list):
        raise call.malformed(f, "a body that is not SearXNG's JSON")
    unresponsive = data.get("unresponsive_engines")
    if not data["results"] and isinstance(unresponsive, list) and unresponsive:
        # Each entry is [name, why] in SearXNG; anything else is shown as it is, bounded.
        engines = ", ".join(str(e[0] if isinstance(e, list) and e else e)[:60] for e in unresponsive[:20])
        raise WebError("search_provider_error", f"searxng answered, but its engines did not ({engines}); "
                       "that is not an empty result", provider="searxng", status=f.status, provider_message=engines)
    return [{"title": r.get("title"), "url": r.get("url"), "snippet": r.get("content"), "source": _searxng_engine(r)}
            for r in data["results"] if isinstance(r, dict)]


def _searxng_engine(result: dict) -> str:
    """The engine behind a SearXNG result: `engine`, else the first of `engines`
    (a list of names), else "searxng"; a value of another shape is not trusted."""
    engine = result.get("engine")
    if isinstance(engine, str) and engine:
        return engine
    engines = result.get("engines")
    if isinstance(engines, list) and engines and isinstance(engines[0], str) and engines[0]:
        return engines[0]
    return "searxng"


def parse_duckduckgo(body: bytes) -> tuple[list[dict], str]:
    """(results, what the page is: "results", "no_results", "challenge" or "unknown")."""
    import lxml.html

    text = body.decode("utf-8", "replace")
    try:
        doc = lxml.html.fromstring(text) if text.strip() else None
    except (ValueError, lxml.etree.ParserError):
        doc = None
    results = []
    if doc is not None:
        def has(cls):
            return f'contains(concat(" ", normalize-space(@class), " "), " {cls} ")'

        for div in doc.xpath(f"//div[{has('result')}]"):
            if "result--ad" in (div.get("class") or "").split():
                continue
            links = div.xpath(f".//a[{has('result__a')}]")
            if not links:
                continue
            url = unwrap_duckduckgo(links[0].get("href") or "")
            if url is None:
                continue
            snippet = div.xpath(f".//*[{has('result__snippet')}]")
            results.append({"title": links[0].text_content(), "url": url,
                            "snippet": snippet[0].text_content() if snippet else ""})
    if results:
        return results, "results"
    if "anomaly.js" in text or "anomaly-modal" in text:
        return [], "challenge"
    if re.search(r"No\s+results\.", text) or (doc is not None and doc.xpath('//*[contains(@class, "no-results")]')):
        return [], "no_results"
    return [], "unknown"


def unwrap_duckduckgo(href: str) -> str | None:
    """The target of a result link: `uddg` of a //duckduckgo.com/l/ redirect; None for ads (y.js)."""
    href = href.strip()
    if href.startswith("//"):
        href = "https:" + href
    parts = urlsplit(href)
    host = (parts.hostname or "").lower()
    if host == "duckduckgo.com" or host.endswith(".duckduckgo.com"):
        if parts.path == "/y.js":
            return None
        if parts.path.startswith("/l/"):
            target = parse_qs(parts.query).get("uddg")
            return target[0] if target else None
        return None
    return href or None


def _duckduckgo(client, call, query, count):
    f = _exchange(client, call, "POST", DDG_URL, form={"q": query, "b": "", "kl": ""},
                  headers={"Accept": "text/html"})
    if f.status == 429:
        raise call.failed(f, "")
    if f.status not in (200, 202):
        if f.status == 403:
            raise WebError("search_blocked", "duckduckgo refused the search (403); it blocks automated searches "
                           "at times: try later, or configure a provider with a key", provider="duckduckgo", status=403)
        raise call.failed(f, "")
    results, kind = parse_duckduckgo(f.body)
    if results:
        return results
    if f.status == 202 or kind == "challenge":
        raise WebError("search_blocked", "duckduckgo answered with its bot challenge instead of results; try later, "
                       "or configure a provider with a key (SERPER_API_KEY, BRAVE_SEARCH_API_KEY, ...)",
                       provider="duckduckgo", status=f.status)
    if kind == "no_results":
        return []
    raise call.malformed(f, "a page that has neither results nor its 'No results.' notice")


ADAPTERS = {"serper": _serper, "brave": _brave, "tavily": _tavily, "firecrawl": _firecrawl, "searxng": _searxng,
            "duckduckgo": _duckduckgo}

NOT_CONFIGURED = ("web search is not configured here (SLUICE_SEARCH_PROVIDER=none); web_fetch still works for URLs "
                  "you already know. An operator enables search with SERPER_API_KEY, BRAVE_SEARCH_API_KEY, "
                  "TAVILY_API_KEY, FIRECRAWL_API_KEY/FIRECRAWL_URL or SEARXNG_URL, or by unsetting "
                  "SLUICE_SEARCH_PROVIDER (DuckDuckGo).")


def search(query: str, count: int = DEFAULT_COUNT, provider: str | None = None, *,
           client: WebClient | None = None) -> dict:
    try:
        if not isinstance(query, str) or not query.strip():
            raise WebError("search_bad_query", "query must be non-empty text: the words to search for")
        query = re.sub(r"\s+", " ", query).strip()
        if len(query) > MAX_QUERY_CHARS:
            raise WebError("search_bad_query", f"the query is {len(query)} characters; at most {MAX_QUERY_CHARS}")
        if isinstance(count, bool) or not isinstance(count, int):
            raise WebError("web_bad_argument", "count must be a whole number from 1 to 20")
        count = max(1, min(MAX_COUNT, count))
        if provider is not None and not isinstance(provider, str):
            raise WebError("web_bad_argument", f"provider must be one of {', '.join(PROVIDERS)}")
        env = (client.env if client is not None and client.env is not None else os.environ)
        name, _ = choose(env, provider)
        if name == "none":
            raise WebError("search_not_configured", NOT_CONFIGURED, provider="none")
        call = Call(name, read_key(env, name), KEY_VARS.get(name), env)
        with call_client(client) as client:
            raw = ADAPTERS[name](client, call, query, count)
        return finish(name, query, raw, count)
    except WebError as e:
        return e.as_dict()


def render(result: dict) -> str:
    """The model-facing text of a search result (snippets are web data: inside the envelope)."""
    results = result["results"]
    head = f"Search: {result['query']} · {result['provider']} · "
    if not results:
        return head + "no results (the provider answered and found nothing; try other words)"
    from sluice.webtools.window import envelope

    lines = []
    for n, r in enumerate(results, 1):
        lines.append(f"{n}. {r['title']}\n   {r['url']}" + (f"\n   {r['snippet']}" if r["snippet"] else "")
                     + (f"\n   (via {r['source']})" if r["source"] != result["provider"] else ""))
    return head + f"{len(results)} result{'s' if len(results) != 1 else ''}\n" + envelope(
        "\n".join(lines), url=f"search:{result['provider']}", tag="results")
