"""robots.txt (RFC 9309) for the model-initiated requests: fetch, read,
request and sitemap, and every redirect hop of theirs; never the search
providers' APIs.

Before a URL is requested, its origin's robots.txt (scheme, host, port) is
read with the tools' own client, through the proxy, and parsed by protego
(RFC 9309: `*` and `$` patterns, the longest match wins, Allow over
Disallow on a tie) for the product token `Sluice`. A disallowed URL is
`web_robots_disallowed`, naming the rule. What the origin answers decides:
- 2xx: its rules, cached for its HTTP freshness (Cache-Control max-age, else
  Expires), at most 24 hours (RFC 9309 §2.4), and 24 hours when it says none;
- 4xx, or unreachable (a refused connection, a timeout, a robots.txt the
  proxy refuses, a redirect loop): no rules, everything allowed, for
  UNREACHABLE_SECONDS before asking again;
- 5xx: the origin is "unreachable" in RFC 9309's sense: everything is
  disallowed for SERVER_ERROR_SECONDS, then asked again.
Every byte of it is hostile: at most MAX_BYTES (500 KiB, the least RFC 9309
says must be parsed; the rest is cut off) within ROBOTS_SECONDS of the
call's deadline, and parsing is linear in its size (about 2 s for 500 KiB
of 25,000 wildcard rules on the slow test machine). Up to 5 redirects are
followed, each hop checked like any other.

`SLUICE_WEB_ROBOTS=ignore` turns it off: for a URL a person gave the agent
to read (a user pasting a link is not a crawler); the default is `obey`.
The cache is per process (an MCP server's life), at most MAX_ORIGINS origins.
"""

from __future__ import annotations

import email.utils
import os
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from sluice.webtools.errors import WebError
from sluice.webtools.sanitize import URL_CHARS, clean

PRODUCT_TOKEN = "Sluice"  # what robots.txt groups are matched on (RFC 9309 §2.2.1)
MAX_BYTES = 500 * 1024
ROBOTS_SECONDS = 5.0
MAX_FRESH_SECONDS = 24 * 3600.0
UNREACHABLE_SECONDS = 300.0
SERVER_ERROR_SECONDS = 300.0
MAX_ORIGINS = 1024
_MAX_AGE = re.compile(r"(?:^|,)\s*(?:s-maxage|max-age)\s*=\s*\"?(\d{1,12})", re.I)


def mode(env: dict | None = None) -> str:
    """SLUICE_WEB_ROBOTS: `obey` (the default) or `ignore`."""
    raw = ((os.environ if env is None else env).get("SLUICE_WEB_ROBOTS") or "obey").strip().lower()
    if raw not in ("obey", "ignore"):
        raise WebError("web_bad_argument", f"SLUICE_WEB_ROBOTS={clean(raw, 40)!r} is not obey or ignore "
                       "(ignore only for URLs a person gave the agent to read)")
    return raw


@dataclass(frozen=True)
class Rules:
    """One origin's robots.txt as last read: `parser` (protego) for a 2xx,
    None for allow-all; `server_error` set (the status) when a 5xx disallows all."""

    parser: object | None
    expires: float  # time.monotonic() after which it is read again
    robots_url: str
    server_error: int | None = None


def freshness(headers) -> float:
    """Seconds a 2xx robots.txt stays fresh: max-age, else Expires - Date, else 24 h; at most 24 h."""
    cache_control = headers.get("cache-control", "")
    if "no-store" in cache_control.lower() or "no-cache" in cache_control.lower():
        return 0.0
    m = _MAX_AGE.search(cache_control)
    if m:
        return min(float(m.group(1)), MAX_FRESH_SECONDS)
    expires = headers.get("expires")
    if expires:
        try:
            then = email.utils.parsedate_to_datetime(expires).timestamp()
            date = headers.get("date")
            now = email.utils.parsedate_to_datetime(date).timestamp() if date else time.time()
            return min(max(then - now, 0.0), MAX_FRESH_SECONDS)
        except (TypeError, ValueError, OverflowError):
            return 0.0  # an invalid Expires means already expired (RFC 9111 §5.3)
    return MAX_FRESH_SECONDS


def parse(body: bytes):
    """A protego parser for the first MAX_BYTES of `body` (UTF-8; undecodable bytes replaced)."""
    from protego import Protego

    return Protego.parse(body[:MAX_BYTES].decode("utf-8", "replace"))


def matching_rule(parser, url: str) -> str:
    """The rule of `parser` that decides `url` for Sluice, as written
    (`Disallow: /private/`): RFC 9309's longest match. protego does not
    return it, so its rule set is read here (the lock pins protego)."""
    try:
        from protego._utils import _quote_path

        rule_set = parser._get_matching_rule_set(PRODUCT_TOKEN)
        path = _quote_path(url)
        for rule in rule_set._rules:  # sorted longest first, Allow first on a tie
            if rule.value.match(path):
                return f"{rule.field.capitalize()}: {rule.value._pattern}"
    except Exception:  # noqa: BLE001 - only the sentence loses its rule
        pass
    return "a Disallow rule"


class RobotsCache:
    """Origin -> Rules, the least recently used dropped past MAX_ORIGINS."""

    def __init__(self, max_origins: int = MAX_ORIGINS) -> None:
        self.max_origins = max_origins
        self._rules: OrderedDict[tuple, Rules] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, origin: tuple) -> Rules | None:
        with self._lock:
            rules = self._rules.get(origin)
            if rules is None or rules.expires <= time.monotonic():
                return None
            self._rules.move_to_end(origin)
            return rules

    def put(self, origin: tuple, rules: Rules) -> None:
        with self._lock:
            self._rules[origin] = rules
            self._rules.move_to_end(origin)
            while len(self._rules) > self.max_origins:
                self._rules.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._rules.clear()


CACHE = RobotsCache()


def verdict(rules: Rules, url: str) -> WebError | None:
    """web_robots_disallowed for `url` under `rules`, or None (allowed)."""
    shown = clean(url, URL_CHARS)
    if rules.server_error is not None:
        return WebError("web_robots_disallowed", f"{rules.robots_url} answered {rules.server_error} (a server "
                        "error), which RFC 9309 reads as disallowing the whole site for now; try again in a few "
                        "minutes or use another source", url=shown, robots_url=rules.robots_url,
                        rule=f"robots.txt status {rules.server_error}")
    if rules.parser is None or rules.parser.can_fetch(url, PRODUCT_TOKEN):
        return None
    rule = clean(matching_rule(rules.parser, url), 300)
    return WebError("web_robots_disallowed", f"the site's robots.txt ({rules.robots_url}) disallows {shown} for "
                    f"Sluice's user agent ({rule}); do not retry it: use another source", url=shown,
                    robots_url=rules.robots_url, rule=rule)
