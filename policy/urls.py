"""URL text -> (scheme, host text, port, credentials?) without trusting it.

Used for redirect targets: `Location` is resolved against the request URL the
way browsers do it (WHATWG: tabs and newlines dropped, backslashes are
slashes in http(s) URLs, protocol-relative `//host` takes the base scheme),
and the host text is handed to policy.hosts untouched so odd spellings are
judged by the same rules as any request.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import urljoin, urlsplit

_DROPPED = re.compile(r"[\t\n\r]")
_EDGES = "".join(chr(c) for c in range(0x21))  # C0 controls and space
DEFAULT_PORTS = {"http": 80, "https": 443}


@dataclass(frozen=True, slots=True)
class UrlTarget:
    url: str
    scheme: str
    host: str  # raw host text (brackets kept for IPv6)
    port: int
    has_credentials: bool


def parse_url(text: str) -> UrlTarget:
    """Split an absolute URL; raise ValueError if it has no usable authority."""
    parts = urlsplit(text)
    scheme = parts.scheme.lower()
    netloc = parts.netloc
    if not scheme or not netloc:
        raise ValueError(f"{text!r} is not an absolute URL")
    userinfo, at, hostport = netloc.rpartition("@")
    host, port_text = hostport, ""
    if hostport.startswith("["):
        close = hostport.find("]")
        if close < 0:
            raise ValueError(f"{text!r} has an unclosed IPv6 bracket")
        host, rest = hostport[: close + 1], hostport[close + 1 :]
        if rest and not rest.startswith(":"):
            raise ValueError(f"{text!r} has junk after the IPv6 address")
        port_text = rest[1:]
    elif ":" in hostport:
        host, _, port_text = hostport.rpartition(":")
    if port_text:
        if not port_text.isdigit():
            raise ValueError(f"{text!r} has an invalid port {port_text!r}")
        port = int(port_text)
    else:
        port = DEFAULT_PORTS.get(scheme, 0)
    if not host:
        raise ValueError(f"{text!r} has no host")
    return UrlTarget(text, scheme, host, port, bool(at))


def resolve_redirect(base_url: str, location: str) -> UrlTarget:
    """Where a `Location` header sends a client that follows it."""
    location = _DROPPED.sub("", location.strip(_EDGES))
    base_scheme = base_url.split(":", 1)[0].lower()
    scheme_of_location = location.split(":", 1)[0].lower() if ":" in location.split("/", 1)[0] else base_scheme
    if scheme_of_location in DEFAULT_PORTS:
        location = location.replace("\\", "/")
    return parse_url(urljoin(base_url, location))
