"""URL text -> (scheme, host text, port, credentials?) without trusting it.

The one URL splitter: `sluice policy explain/test` read URLs with it, and the
redirect guard reads `Location` targets with it after resolving them against
the request URL the way browsers do (WHATWG: tabs and newlines dropped,
backslashes are slashes in http(s) URLs, protocol-relative `//host` takes the
base scheme). The host text is handed to policy.hosts untouched, so every odd
spelling (0x7f.1, [::1], full-width letters, percent-encoding) is judged by
the same rules as any request.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import urljoin

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):")
_PORT_LIKE = re.compile(r"^[0-9]+(?:[/?#]|$)")
_DIGITS = re.compile(r"^[0-9]+$")
_DROPPED = re.compile(r"[\t\n\r]")
_EDGES = "".join(chr(c) for c in range(0x21))  # C0 controls and space
DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443, "ftp": 21, "gopher": 70}
# Schemes whose URLs treat a backslash like a slash (WHATWG "special"
# schemes; urllib3 parses the same way), so `http://a.example\@b.example/`
# connects to a.example.
SPECIAL_SCHEMES = frozenset({"http", "https", "ws", "wss", "ftp"})


@dataclass(frozen=True, slots=True)
class UrlTarget:
    url: str
    scheme: str  # as written
    host: str  # raw host text (brackets kept for IPv6); "" for mailto:, data:, ...
    port: int
    has_credentials: bool


def split_url(url: str) -> UrlTarget:
    """Split an absolute URL; raise ValueError (a sentence) if it is not one."""
    if not url:
        raise ValueError("the URL is empty")
    if any(ord(c) < 0x21 or ord(c) == 0x7F for c in url):
        raise ValueError(f"{url!r} contains whitespace or control characters")
    m = _SCHEME.match(url)
    if not m or _PORT_LIKE.match(url[m.end():]):
        raise ValueError(f"{url!r} is not an absolute URL; write it as http://host/path or https://host/path")
    scheme = m.group(1)
    lower = scheme.lower()
    rest = url[m.end():]
    if not rest.startswith("//"):
        if lower in ("http", "https"):
            raise ValueError(f"{url!r} has no //host after {scheme}:")
        # mailto:, data:, javascript: ... refused by the policy (scheme_not_allowed)
        return UrlTarget(url, scheme, "", DEFAULT_PORTS.get(lower, 0), False)
    after = rest[2:]
    delimiters = "/?#\\" if lower in SPECIAL_SCHEMES else "/?#"
    end = next((i for i, c in enumerate(after) if c in delimiters), len(after))
    netloc = after[:end]
    has_credentials = "@" in netloc
    hostport = netloc.rpartition("@")[2]
    if hostport.startswith("["):
        close = hostport.find("]")
        if close < 0:
            raise ValueError(f"{url!r} has an unclosed '[' in its host")
        host, tail = hostport[: close + 1], hostport[close + 1 :]
        if tail and not tail.startswith(":"):
            raise ValueError(f"{url!r} has text after ']' that is not a :port")
        port_text = tail[1:] if tail else ""
    else:
        if hostport.count(":") > 1:
            raise ValueError(f"{url!r}: an IPv6 address in a URL must be in brackets, e.g. http://[2001:db8::1]/")
        host, _, port_text = hostport.partition(":")
    if port_text:
        if not _DIGITS.match(port_text):
            raise ValueError(f"{url!r} has an invalid port {port_text!r}")
        port = int(port_text)
    else:
        port = DEFAULT_PORTS.get(lower, 0)
    if not host and lower in ("http", "https"):
        raise ValueError(f"{url!r} has no host")
    return UrlTarget(url, scheme, host, port, has_credentials)


def resolve_redirect(base_url: str, location: str) -> UrlTarget:
    """Where a `Location` header sends a client that follows it."""
    location = _DROPPED.sub("", location.strip(_EDGES))
    first = location.split("/", 1)[0]
    scheme = first.split(":", 1)[0].lower() if ":" in first else base_url.split(":", 1)[0].lower()
    if scheme in SPECIAL_SCHEMES:
        location = location.replace("\\", "/")
    return split_url(urljoin(base_url, location))
