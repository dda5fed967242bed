"""The web tools' HTTP client: every request through the Sluice proxy, with
caps that hold while reading.

Routing. The proxy is `SLUICE_PROXY`, else `HTTPS_PROXY` (https URLs) or
`HTTP_PROXY` (http URLs), else `ALL_PROXY` (lower-case spellings too). With
none, every request is refused as `web_no_proxy`: nothing ever goes direct,
and `NO_PROXY` is ignored for the same reason. `user:pass@` in the proxy URL
is sent to the proxy (Proxy-Authorization) for a client profile, never to an
origin. TLS is verified against the public CAs (certifi) plus
`SLUICE_CA_CERT` (the CA of an intercepting Sluice); `SSL_CERT_FILE`, when
set, replaces the public bundle as it does elsewhere (SLUICE_CA_CERT is still
added).

First-line checks. URLs a model gives (and every redirect target, and
search results' links) are checked before any request with the proxy's own
code (`sluice.policy`): http/https only, no `user:pass@`, a valid host, no
internal names, no literal non-public address. A failure is `web_blocked`
with the same reason code the proxy would send and `by: "client"`. What is
checked is what is requested: a backslash in the host part, or a host, port
or user name that policy/urls.py and httpx read differently, is
`web_bad_url`, and the request is built from the checked components
(`request_url`).

Only the proxy speaks for the proxy. It remains the authority: everything
that passes is decided again there (DNS answers, allow/deny lists, ports,
caps), and its refusals come back as `web_blocked` with `by: "proxy"` only
when the proxy made the response (`proxy_made`): over plain http (the proxy
strips Sluice's header fields from every origin response), and over https
only inside a tunnel Sluice intercepts (the leaf certificate is issued by the
CA in SLUICE_CA_CERT); in any other tunnel every response is the origin's.
A refused CONNECT (whose headers and body httpx never shows) is read from
the status line's reason phrase, `403 Sluice address_not_public`. A
proxy-made 407 is `web_proxy_auth`. The message is Sluice's sentence for the
reason code plus the proxy's own sentence, cleaned and bounded; never the
origin's text.

Redirects are followed here, at most 5, each a new request through the proxy
after the first-line check (a refused hop is `redirect_refused`, by the
client or by the proxy, "the redirect from A to B ..."); credentials given for an origin (Authorization,
provider keys) are sent only to that origin (scheme, host and port). No
cookies are kept (the jar refuses every cookie), no scripts run, nothing else
is loaded.

Caps. A deadline for the whole exchange (20 s, SLUICE_WEB_TIMEOUT): connect,
head and body, every redirect hop included, whatever the origin does. A
watchdog (webtools.deadline) shuts the exchange's sockets down at the
deadline, so an origin dripping a byte at a time (head, body or chunks) is
cut there and the call is `web_timeout`. And per kind a byte cap that
applies to the body as decoded, checked while it streams: identity bodies are
never read past the cap; compressed ones (gzip, deflate, br, zstd) are
inflated in bounded steps, never past the cap, so a bomb costs at most the
cap. A plan either truncates at the cap (fetch's text: the page is marked
`truncated`) or refuses (`web_too_large`, with `decoded: true` when it was
the inflation that went over). A compressed body that reaches a truncating
cap inflated more than 100-fold is a bomb, refused the same way. The content
type is judged from the headers before a byte of the body is read, so a
refused type costs one response head (the connection is closed).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import ssl
import time
import zlib
from dataclasses import dataclass, field
from http.cookiejar import DefaultCookiePolicy
from collections.abc import Callable, Iterator

import httpx

from sluice.policy.hosts import HostError, IPHost, NameHost, internal_name, parse_host
from sluice.policy.ranges import classify
from sluice.policy.reasons import REASONS, POLICY_SUFFIX, Reason, Refusal
from sluice.policy.loader import parse_duration, parse_size
from sluice.policy.urls import resolve_redirect, split_url
from sluice.webtools.sanitize import URL_CHARS, clean
from sluice.webtools.deadline import WATCHDOG, StreamGuard
from sluice.webtools.errors import WebError

MIB = 1024 * 1024
MAX_REDIRECTS = 5
MAX_URL_CHARS = 8192  # a URL argument or redirect target; longer ones are web_bad_url (httpx stops at 64 KiB)
REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
BOMB_RATIO = 100
# Names Sluice (the robots.txt product token, webtools.robots) and where to read about it.
AGENT_URL = "https://pypi.org/project/sluice/"
USER_AGENT = f"Sluice/0.1 (+{AGENT_URL}; an AI agent's web tool; no JavaScript, no cookies)"

try:  # Python 3.14 has compression.zstd; 3.12/3.13 the backport (optional)
    from compression import zstd as _zstd  # type: ignore[import-not-found]
except ImportError:
    try:
        from backports import zstd as _zstd  # type: ignore[import-not-found,no-redef]
    except ImportError:
        _zstd = None
try:
    import brotli as _brotli
except ImportError:
    _brotli = None

ENCODINGS = ("gzip", "deflate") + (("br",) if _brotli else ()) + (("zstd",) if _zstd else ())
ACCEPT_ENCODING = ", ".join(ENCODINGS)


@dataclass(frozen=True)
class WebToolLimits:
    """The web tools' own transport caps (bytes, decoded), apart from the policy's `limits`.
    Override with SLUICE_WEB_* variables."""

    timeout: float = 20.0
    text_bytes: int = 2 * MIB
    image_bytes: int = 5 * MIB
    pdf_bytes: int = 10 * MIB
    sitemap_bytes: int = 50 * MIB
    max_redirects: int = MAX_REDIRECTS

    @classmethod
    def from_env(cls, env: dict | None = None) -> WebToolLimits:
        """Durations and sizes in the policy language's units (`2s`, `500ms`,
        `1MiB`; a bare number is seconds or bytes), read by its own parsers."""
        env = os.environ if env is None else env
        values = {}
        for name, parse in (("timeout", parse_duration), ("text_bytes", parse_size), ("image_bytes", parse_size),
                            ("pdf_bytes", parse_size), ("sitemap_bytes", parse_size)):
            var = f"SLUICE_WEB_{name.upper()}"
            raw = env.get(var)
            if raw:
                try:
                    values[name] = parse(raw)
                except ValueError as e:
                    raise WebError("web_bad_argument", f"{var}: {clean(e, 200)}") from None
        return cls(**values)


@dataclass(frozen=True)
class ReadPlan:
    """How to read a body: at most `cap` decoded bytes; over it, truncate or refuse."""

    cap: int
    truncate: bool = False


@dataclass
class Fetched:
    url: str
    final_url: str
    status: int
    content_type: str  # the header as sent ("" when none)
    mime: str  # lower-case type/subtype, no parameters
    charset: str | None
    headers: httpx.Headers
    body: bytes = b""
    truncated: bool = False
    encoding: str = "identity"

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.body).hexdigest()


def media_type(content_type: str) -> tuple[str, str | None]:
    """'Text/HTML; charset="UTF-8"' -> ('text/html', 'UTF-8')."""
    mime, *params = content_type.split(";")
    charset = None
    for param in params:
        key, _, value = param.partition("=")
        if key.strip().lower() == "charset":
            charset = value.strip().strip('"').strip("'") or None
    return mime.strip().lower(), charset


# ---------------------------------------------------------------- URL checks

def check_url(url) -> str:
    """The first-line check on a URL a model gave: the URL that will be
    requested (see request_url), or WebError."""
    if not isinstance(url, str) or not url.strip():
        raise WebError("web_bad_url", "url must be an absolute http or https URL, e.g. https://example.com/page")
    return str(request_url(url.strip()))


_HTTPX_AUTHORITY_END = re.compile(r"[/?#]")


def request_url(url: str, *, first_line: bool = True) -> httpx.URL:
    """The URL to request, built from the components the checks read.

    Two parsers read every URL: policy/urls.py's split (the WHATWG reading
    the proxy and browsers use: a backslash ends the authority) and httpx's
    (RFC 3986: it does not). Where they disagree the check and the dial
    would be about different hosts (`http://a.example\\@10.0.0.5/` is
    a.example to one and 10.0.0.5, with userinfo, to the other), so a
    backslash in the authority, or any host, port or userinfo the two read
    differently, is `web_bad_url`. What is requested is then rebuilt from
    the checked host (canonical: `8.8.2056` is requested as 8.8.8.8), port
    and httpx's path, and its host is compared again. `first_line=False`
    (URLs the operator configured) skips only the policy refusals."""
    shown = clean(url, URL_CHARS)
    try:
        target = split_url(url)
    except ValueError as e:
        raise WebError("web_bad_url", clean(e, URL_CHARS + 200)) from None
    scheme = target.scheme.lower()
    if first_line:
        refusal = first_line_refusal(scheme, target.host, target.has_credentials)
        if refusal is not None:
            raise blocked(refusal, by="client", url=shown)
    elif scheme not in ("http", "https"):
        raise WebError("web_bad_url", f"{shown} is not an http(s) URL")
    authority = _HTTPX_AUTHORITY_END.split(url[len(target.scheme) + 3:], maxsplit=1)[0]
    if "\\" in authority:
        raise WebError("web_bad_url", f"{shown} has a backslash in its host part, which URL parsers read differently "
                       "(as the end of the host, or as part of a user name); write the URL with / instead")
    differs = WebError("web_bad_url", f"{shown} is read as a different host, port or user name by different URL "
                       "parsers (an odd character in its host part); write the plain URL, e.g. "
                       "https://example.com/path")
    try:
        parsed = httpx.URL(url)
        checked = parse_host(target.host)
        theirs = parse_host(parsed.raw_host.decode("ascii"))
    except HostError as e:
        if first_line:  # the first-line check accepted the host: httpx's reading is the odd one
            raise differs from None
        raise WebError("web_bad_url", f"{shown}: {clean(e, 300)}") from None
    except (httpx.InvalidURL, UnicodeError, ValueError) as e:
        raise WebError("web_bad_url", f"{shown} cannot be requested ({clean(e, 300)})") from None
    default = 443 if scheme == "https" else 80
    if theirs != checked or (parsed.port or default) != target.port or bool(parsed.userinfo) != target.has_credentials:
        raise differs
    host = checked.address if isinstance(checked, IPHost) else checked.name
    if scheme == "http" and ":" in host:
        # httpcore writes the absolute-form request line to the proxy without
        # the brackets (`GET http://2606:4700::1:8080/`): another address, or
        # none, to whoever reads it. Over https the CONNECT target is fine.
        raise WebError("web_bad_url", f"{shown}: plain http to an IPv6 address cannot be sent through the proxy "
                       "unambiguously; use https://, or a host name")
    built = httpx.URL(scheme=scheme, host=host, port=None if target.port == default else target.port,
                      raw_path=parsed.raw_path, fragment=parsed.fragment or None)
    if parse_host(built.raw_host.decode("ascii")) != checked or (built.port or default) != target.port:
        raise differs  # never expected: the rebuilt URL must name exactly the checked host and port
    return built


def first_line_refusal(scheme: str, host_text: str, has_credentials: bool) -> Refusal | None:
    """The proxy's own pre-DNS refusals that need no policy: scheme,
    credentials, malformed host, internal name, literal non-public address."""
    if scheme.lower() not in ("http", "https"):
        return Refusal(Reason.SCHEME_NOT_ALLOWED, f"the scheme {scheme!r} is not allowed; only http and https are")
    if has_credentials:
        return Refusal(Reason.URL_CREDENTIALS, "URLs with user:password@ credentials are not allowed")
    try:
        host = parse_host(host_text)
    except HostError as e:
        return Refusal(Reason.MALFORMED_HOST, f"{e}")
    if isinstance(host, NameHost):
        why = internal_name(host.name)
        if why:
            return Refusal(Reason.INTERNAL_HOSTNAME, f"{host.name} is {why}")
    elif isinstance(host, IPHost):
        row = classify(host.address)
        if row is not None:
            return Refusal(Reason.ADDRESS_NOT_PUBLIC,
                           f"{host.address} is {row.name} ({row.cidr}); only public internet addresses are reachable")
    return None


def blocked(refusal: Refusal, *, by: str, url: str) -> WebError:
    return WebError("web_blocked", refusal.message, reason=refusal.reason.value, by=by, url=url)


def origin_of(url: str) -> tuple[str, str, int]:
    u = httpx.URL(url)
    return (u.scheme, (u.host or "").lower(), u.port or (443 if u.scheme == "https" else 80))


# ---------------------------------------------------------------- proxy

NO_PROXY_MESSAGE = (
    "no proxy is configured, and the web tools never connect directly: start Sluice "
    "(`sluice proxy --policy config/policy.yaml`, listening on 127.0.0.1:8080 by default) and set "
    "SLUICE_PROXY=http://127.0.0.1:8080 (or HTTPS_PROXY/HTTP_PROXY)"
)


def proxy_for(scheme: str, env: dict | None = None) -> str:
    env = os.environ if env is None else env

    def get(name: str) -> str | None:
        return env.get(name) or env.get(name.lower()) or None

    by_scheme = "HTTPS_PROXY" if scheme == "https" else "HTTP_PROXY"
    proxy = env.get("SLUICE_PROXY") or get(by_scheme) or get("ALL_PROXY")
    if not proxy:
        other = "HTTP_PROXY" if scheme == "https" else "HTTPS_PROXY"
        if get(other):  # name the variable this URL wanted, not just "none"
            raise WebError("web_no_proxy", f"no proxy is configured for {scheme}:// URLs: {other} is set, but it is "
                           f"used for {'http' if scheme == 'https' else 'https'}:// URLs only; set SLUICE_PROXY "
                           f"(used for both) or {by_scheme} to the Sluice proxy, e.g. "
                           "SLUICE_PROXY=http://127.0.0.1:8080",
                           wanted=by_scheme)
        raise WebError("web_no_proxy", NO_PROXY_MESSAGE)
    if "://" not in proxy:
        proxy = "http://" + proxy
    if proxy.split("://", 1)[0].lower() not in ("http", "https"):
        raise WebError("web_no_proxy", f"the proxy {_redact(proxy)} is not an http:// proxy URL; "
                       "the web tools speak HTTP to the proxy: set SLUICE_PROXY=http://HOST:PORT")
    problem = _proxy_url_problem(proxy)
    if problem:
        name = next(n for n in ("SLUICE_PROXY", by_scheme, "ALL_PROXY")
                    if (env.get(n) if n == "SLUICE_PROXY" else get(n)))
        raise WebError("web_no_proxy", f"{name} is not a usable proxy URL ({problem}): set it to http://HOST:PORT, "
                       "e.g. SLUICE_PROXY=http://127.0.0.1:8080", variable=name)
    return proxy


def _proxy_url_problem(proxy: str) -> str | None:
    """What is wrong with a proxy URL's host and port, or None (the
    values are never echoed: the URL may hold a password)."""
    authority = proxy.split("://", 1)[1].split("/", 1)[0].rsplit("@", 1)[-1]
    if authority.startswith("["):
        host, closed, rest = authority[1:].partition("]")
        if not closed:
            return "an unclosed [ in the address"
        if rest and not rest.startswith(":"):
            return "text after the bracketed address"
        has_port, port = bool(rest), rest[1:]
    else:
        host, colon, port = authority.partition(":")
        has_port = bool(colon)
    if not host:
        return "no host"
    if has_port and not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
        return "the port is not a number from 1 to 65535"
    try:
        httpx.URL(proxy)
    except (httpx.InvalidURL, ValueError) as e:
        return str(e)[:100]
    return None


def _redact(proxy: str) -> str:
    scheme, _, rest = proxy.partition("://")
    if "@" in rest.split("/", 1)[0]:
        rest = "***@" + rest.split("@", 1)[1]
    return f"{scheme}://{rest}"


_SSL_CACHE: dict[tuple, ssl.SSLContext] = {}


def ssl_context(env: dict | None = None) -> ssl.SSLContext:
    env = os.environ if env is None else env
    extra = env.get("SLUICE_CA_CERT") or None
    replace = env.get("SSL_CERT_FILE") or None  # in place of certifi's public CAs; SLUICE_CA_CERT is added to either
    key = (extra, replace)
    ctx = _SSL_CACHE.get(key)
    if ctx is None:
        try:
            name, path = "SSL_CERT_FILE", replace
            if replace:
                ctx = ssl.create_default_context(cafile=replace)
            else:
                import certifi

                ctx = ssl.create_default_context(cafile=certifi.where())
            if extra:
                name, path = "SLUICE_CA_CERT", extra
                ctx.load_verify_locations(cafile=extra)
        except (OSError, ssl.SSLError) as e:
            raise WebError("web_tls_error", f"the CA file in {name} ({path}) cannot be loaded: {e}") from None
        _SSL_CACHE[key] = ctx
    return ctx


# ---------------------------------------------------------------- decoding

class _Over(Exception):
    """Decoding would produce more than the room left; `partial` is the
    output that fits (from the last stage of a chain)."""

    def __init__(self, partial: bytes = b"") -> None:
        super().__init__()
        self.partial = partial


class _Decoder:
    """Content-Encoding decoder (a chain, for `gzip, br`), bounded per call:
    feed(data, room) returns at most `room` bytes or raises _Over."""

    def __init__(self, codings: list[str]) -> None:
        self.stages = [_stage(c) for c in reversed(codings)]

    def feed(self, data: bytes, room: int) -> bytes:
        for n, stage in enumerate(self.stages):
            try:
                data = stage(data, room)
            except _Over as e:
                raise _Over(e.partial if n == len(self.stages) - 1 else b"") from None
        if len(data) > room:
            raise _Over(data[:room])
        return data

    def flush(self, room: int) -> bytes:
        return self.feed(b"", room) if self.stages else b""


def _stage(coding: str) -> Callable[[bytes, int], bytes]:
    if coding in ("gzip", "x-gzip"):
        return _ZlibStage(31)
    if coding == "deflate":
        return _ZlibStage(zlib.MAX_WBITS | 32, fallback=-zlib.MAX_WBITS)
    if coding == "br" and _brotli is not None:
        return _BrotliStage()
    if coding == "zstd" and _zstd is not None:
        return _ZstdStage()
    raise WebError("web_unsupported_encoding", f"the response's Content-Encoding {coding!r} cannot be decoded "
                   f"(supported: {', '.join(ENCODINGS)})", encoding=coding)


class _ZlibStage:
    def __init__(self, wbits: int, fallback: int | None = None) -> None:
        self.d = zlib.decompressobj(wbits)
        self.fallback = fallback
        self.started = False

    def __call__(self, data: bytes, room: int) -> bytes:
        try:
            out = self.d.decompress(data, room + 1)
        except zlib.error:
            if self.fallback is None or self.started:
                raise
            self.d, self.fallback = zlib.decompressobj(self.fallback), None  # raw deflate
            out = self.d.decompress(data, room + 1)
        self.started = self.started or bool(data)
        while self.d.unconsumed_tail and len(out) <= room:
            out += self.d.decompress(self.d.unconsumed_tail, room + 1 - len(out))
        if len(out) > room or self.d.unconsumed_tail:
            raise _Over(out[:room])
        return out


class _BrotliStage:
    def __init__(self) -> None:
        self.d = _brotli.Decompressor()

    def __call__(self, data: bytes, room: int) -> bytes:
        out = self.d.process(data, output_buffer_limit=room + 1)
        while len(out) <= room and not self.d.can_accept_more_data():
            more = self.d.process(b"", output_buffer_limit=room + 1 - len(out))
            if not more:
                break
            out += more
        if len(out) > room:
            raise _Over(out[:room])
        return out


class _ZstdStage:
    def __init__(self) -> None:
        self.d = _zstd.ZstdDecompressor()

    def __call__(self, data: bytes, room: int) -> bytes:
        if self.d.eof:
            return b""
        out = self.d.decompress(data, room + 1)
        while len(out) <= room and not self.d.eof and not self.d.needs_input:
            out += self.d.decompress(b"", room + 1 - len(out))
        if len(out) > room:
            raise _Over(out[:room])
        return out


_DECODE_ERRORS: tuple[type[BaseException], ...] = (zlib.error,) + ((_brotli.error,) if _brotli else ()) + (
    (_zstd.ZstdError,) if _zstd else ())


# ---------------------------------------------------------------- the client

Classifier = Callable[[Fetched], ReadPlan | None]  # None: do not read the body


@dataclass
class WebClient:
    """One tool call's client. `env` defaults to os.environ. `transport`
    stands in for the proxy connection (tests: httpx.MockTransport); every
    check and cap still runs, a proxy must still be configured."""

    env: dict | None = None
    limits: WebToolLimits = field(default_factory=WebToolLimits)
    transport: httpx.BaseTransport | None = None
    _clients: dict = field(default_factory=dict, repr=False)

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
        self._clients.clear()

    def __enter__(self) -> WebClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


    def _client(self, proxy: str) -> httpx.Client:
        client = self._clients.get(proxy)
        if client is None:
            client = httpx.Client(
                # An injected transport replaces the proxy's (httpx would route every URL to the proxy's instead).
                proxy=proxy if self.transport is None else None, transport=self.transport,
                verify=ssl_context(self.env), trust_env=False, follow_redirects=False,
                timeout=httpx.Timeout(self.limits.timeout), http2=False,
                # No connection is reused, so every exchange's socket is a new one the watchdog sees.
                limits=httpx.Limits(max_keepalive_connections=0),
                headers={"User-Agent": USER_AGENT, "Accept-Encoding": ACCEPT_ENCODING},
            )
            client.cookies.jar.set_policy(DefaultCookiePolicy(allowed_domains=[]))  # keep no cookies
            self._clients[proxy] = client
        return client

    def request(self, url: str, *, classify: Classifier, headers: dict[str, str] | None = None,
                credentials: dict[str, str] | None = None, check: bool = True, method: str = "GET",
                content: bytes | None = None, robots: bool = False, deadline: float | None = None) -> Fetched:
        """`method` (GET unless told) `url` through the proxy, following redirects (each checked),
        and read the body as `classify` plans it. `credentials` go only to
        the URL's own origin; `check=False` skips the first-line check (URLs
        the operator configured). `method`/`content` send another method
        with a body (search providers' POST APIs): a 307/308 repeats it, any
        other redirect becomes a GET without the body. `robots=True` (the
        model's own requests) asks each hop's origin's robots.txt first
        (webtools.robots; off with SLUICE_WEB_ROBOTS=ignore)."""
        if deadline is None:
            deadline = time.monotonic() + self.limits.timeout
        from sluice.webtools import robots as robots_txt

        obey = robots and robots_txt.mode(self.env) == "obey"
        if isinstance(url, str) and len(url) > MAX_URL_CHARS:
            raise WebError("web_bad_url", f"the URL is {len(url):,} characters long; at most {MAX_URL_CHARS:,} are "
                           "accepted", limit=MAX_URL_CHARS)
        proxy_for("https" if isinstance(url, str) and url.strip().lower().startswith("https:") else "http", self.env)
        current = check_url(url) if check else str(request_url(str(url).strip(), first_line=False))
        start_origin = origin_of(current)
        hops = 0
        while True:
            send = dict(headers or {})
            if credentials and origin_of(current) == start_origin:
                send.update(credentials)
            if obey:
                refusal = robots_txt.verdict(self.robots_rules(current, deadline), current)
                if refusal is not None:
                    raise refusal
            result = self._one(url, current, send, classify, deadline, method, content)
            if isinstance(result, Fetched):
                return result
            location, status = result
            if status not in (307, 308):
                method, content = "GET", None
            hops += 1
            try:
                target = resolve_redirect(current, location)
            except ValueError as e:
                raise WebError("web_bad_url", f"{current} redirects to an unusable Location ({clean(e, URL_CHARS)})",
                               status=None, location=clean(location, URL_CHARS)) from None
            if len(target.url) > MAX_URL_CHARS:
                raise WebError("web_bad_url", f"{current} redirects to a URL of {len(target.url):,} characters; at "
                               f"most {MAX_URL_CHARS:,} are followed", limit=MAX_URL_CHARS)
            if hops > self.limits.max_redirects:
                raise WebError("web_too_many_redirects", f"{clean(url, URL_CHARS)} redirected more than "
                               f"{self.limits.max_redirects} times (the last hop pointed to "
                               f"{clean(target.url, URL_CHARS)}); "
                               "not followed further", location=clean(target.url, URL_CHARS), redirects=hops - 1)
            current = redirect_target(current, target, check=check)

    def check_robots(self, url: str) -> None:
        """Raise web_robots_disallowed if `url`'s robots.txt disallows it
        (the page a render loads; get(robots=True) checks its own hops)."""
        from sluice.webtools import robots as robots_txt

        if robots_txt.mode(self.env) != "obey":
            return
        current = check_url(url)
        refusal = robots_txt.verdict(self.robots_rules(current, time.monotonic() + self.limits.timeout), current)
        if refusal is not None:
            raise refusal

    def robots_rules(self, url: str, deadline: float):
        """The robots.txt rules of `url`'s origin (webtools.robots), read
        through the proxy unless cached, within ROBOTS_SECONDS of `deadline`."""
        from sluice.webtools import robots as robots_txt

        origin = origin_of(url)
        rules = robots_txt.CACHE.get(origin)
        if rules is not None:
            return rules
        robots_url = str(httpx.URL(url).copy_with(raw_path=b"/robots.txt", fragment=None))

        def classify(f: Fetched) -> ReadPlan | None:
            return ReadPlan(robots_txt.MAX_BYTES, truncate=True) if 200 <= f.status < 300 else None

        now = time.monotonic()
        try:
            fetched = self.request(robots_url, classify=classify,
                                   deadline=min(deadline, now + robots_txt.ROBOTS_SECONDS))
        except WebError:  # unreachable, refused by the proxy, too large, a redirect loop: no rules
            fetched = None
        if fetched is not None and 200 <= fetched.status < 300:
            rules = robots_txt.Rules(robots_txt.parse(fetched.body), now + robots_txt.freshness(fetched.headers),
                                     robots_url)
        elif fetched is not None and 500 <= fetched.status < 600:
            rules = robots_txt.Rules(None, now + robots_txt.SERVER_ERROR_SECONDS, robots_url,
                                     server_error=fetched.status)
        elif fetched is not None and 400 <= fetched.status < 500:  # unavailable: no rules, for its freshness
            rules = robots_txt.Rules(None, now + robots_txt.freshness(fetched.headers), robots_url)
        else:
            rules = robots_txt.Rules(None, now + robots_txt.UNREACHABLE_SECONDS, robots_url)
        robots_txt.CACHE.put(origin, rules)
        return rules

    def _one(self, url: str, current: str, headers: dict, classify: Classifier, deadline: float,
             method: str = "GET", content: bytes | None = None) -> Fetched | tuple[str, int]:
        """One exchange, under the watchdog: at the deadline its sockets are
        shut down, whatever read is waiting, and the call is web_timeout."""
        guard = StreamGuard(deadline)
        WATCHDOG.watch(guard)
        try:
            return self._exchange(url, current, headers, classify, deadline, method, content, guard)
        except (WebError, httpx.HTTPError) as e:
            if guard.expired and getattr(e, "code", None) != "web_timeout":
                raise _timeout(url, self.limits.timeout) from None  # whatever the cut made the read raise
            raise
        finally:
            guard.release()

    def _exchange(self, url: str, current: str, headers: dict, classify: Classifier, deadline: float,
                  method: str, content: bytes | None, guard: StreamGuard) -> Fetched | tuple[str, int]:
        scheme = current.split(":", 1)[0].lower()
        client = self._client(proxy_for(scheme, self.env))
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise _timeout(url, self.limits.timeout)
        try:
            target = request_url(current, first_line=False)  # `current` is request_url's own: the checked components
            request = client.build_request(method, target, headers=headers, content=content,
                                           timeout=httpx.Timeout(remaining))
            if request.url.raw_host != target.raw_host or request.url.port != target.port:
                raise WebError("web_bad_url", f"{current} would not be requested from its checked host; not sent")
            request.extensions["trace"] = guard.trace  # hands each new socket to the watchdog
            response = client.send(request, stream=True)
        except WebError:
            raise
        except httpx.ProxyError as e:
            raise _proxy_error(str(e), current) from None
        except httpx.TimeoutException:
            raise _timeout(url, self.limits.timeout) from None
        except httpx.ConnectError as e:
            raise _connect_error(e, current, client) from None
        except httpx.UnsupportedProtocol as e:
            raise WebError("web_bad_url", f"{current}: {e}") from None
        except (httpx.HTTPError, httpx.InvalidURL) as e:
            raise WebError("web_unreachable", f"the request for {current} failed: {e or type(e).__name__}") from None
        try:
            return self._answer(url, current, response, classify, deadline)
        finally:
            response.close()

    def _answer(self, url, current, response: httpx.Response, classify, deadline) -> Fetched | tuple[str, int]:
        status = response.status_code
        if proxy_made(current, response, self.env):
            refusal = proxy_refusal(response, current, deadline)
            if refusal is not None:
                raise refusal
        if status in REDIRECT_STATUSES and response.headers.get("location"):
            return response.headers["location"], status
        content_type = response.headers.get("content-type", "")
        mime, charset = media_type(content_type)
        fetched = Fetched(url, current, status, content_type, mime, charset, response.headers)
        plan = classify(fetched)
        if plan is None:
            return fetched
        codings = [c.strip().lower() for c in response.headers.get("content-encoding", "").split(",")]
        codings = [c for c in codings if c and c != "identity"]
        decoder = _Decoder(codings)  # raises web_unsupported_encoding before any body is read
        fetched.encoding = ", ".join(codings) or "identity"
        length = response.headers.get("content-length", "")
        if not codings and not plan.truncate and length.isdigit() and int(length) > plan.cap:
            raise _too_large(current, plan.cap, decoded=False, content_length=int(length))
        body = bytearray()
        wire = 0
        try:
            for chunk in response.iter_raw():  # each read as it comes: a drip still reaches the check below
                if time.monotonic() > deadline:
                    raise _timeout(url, self.limits.timeout)
                try:
                    if codings:
                        # In 4 KiB steps, so `wire` is what was inflated (the bomb ratio is honest).
                        for i in range(0, len(chunk), 4096):
                            piece = chunk[i:i + 4096]
                            wire += len(piece)
                            body += decoder.feed(piece, plan.cap - len(body))
                        if wire > plan.cap + 65536:  # compressed data larger than its cap: not worth more
                            raise _Over
                        continue
                    wire += len(chunk)
                    room = plan.cap - len(body)
                    if len(chunk) > room:
                        body += chunk[:room]
                        raise _Over
                    else:
                        body += chunk
                except _Over as over:
                    # Past the cap. A compressed body that got there inflating more than
                    # BOMB_RATIO-fold is a bomb, never a page to truncate.
                    if plan.truncate and not (codings and plan.cap > BOMB_RATIO * max(wire, 1)):
                        body += over.partial
                        fetched.truncated = True
                        break
                    raise _too_large(current, plan.cap, decoded=bool(codings)) from None
            else:
                try:
                    body += decoder.flush(plan.cap - len(body))
                except _Over as over:
                    if not plan.truncate:
                        raise _too_large(current, plan.cap, decoded=True) from None
                    body += over.partial
                    fetched.truncated = True
        except _DECODE_ERRORS as e:
            raise WebError("web_unreachable", f"the {fetched.encoding} body of {current} is corrupt ({e})") from None
        except httpx.TimeoutException:
            raise _timeout(url, self.limits.timeout) from None
        except (httpx.RemoteProtocolError, httpx.ReadError) as e:
            raise WebError("web_response_incomplete", f"the connection closed before the whole response of {current} "
                           f"arrived ({e}); the origin, or a size or time cap of the proxy, cut it",
                           url=current) from None
        fetched.body = bytes(body)
        return fetched


@contextlib.contextmanager
def call_client(client: WebClient | None) -> Iterator[WebClient]:
    """A tool call's client: the caller's as it is (the caller closes it), or
    one made from the environment for this call and closed after it."""
    if client is not None:
        yield client
        return
    with WebClient(limits=WebToolLimits.from_env()) as own:
        yield own


# ---------------------------------------------------------------- who speaks

# The most of a proxy-made refusal's own sentence a message quotes (its
# detail, advice and the operator's refusal_note).
PROXY_DETAIL_CHARS = 1500
_REASON_TOKEN = re.compile(r"[a-z][a-z0-9_]{0,63}")
_CA_SUBJECTS: dict[str, frozenset] = {}


def proxy_made(url: str, response: httpx.Response, env: dict | None) -> bool:
    """Can this response be the proxy's own (a refusal, its 407, its 502)?

    - http:// URLs: yes. The proxy carries the exchange and strips the
      Sluice-Reason, `Proxy-Status: sluice` and Proxy-Authenticate of every
      origin response (an origin's 407 becomes a 502), so these are its own.
    - https:// URLs: only when the TLS session is with an intercepting Sluice,
      i.e. the verified leaf certificate was issued by a CA in SLUICE_CA_CERT.
      In a tunnel Sluice does not intercept, everything after the tunnel is
      up is the origin's (a refused CONNECT is answered before it, and is
      read from its status line: _proxy_error)."""
    if url.split(":", 1)[0].lower() == "http":
        return True
    ca_file = (os.environ if env is None else env).get("SLUICE_CA_CERT")
    stream = response.extensions.get("network_stream")
    if not ca_file or stream is None:
        return False
    ssl_object = stream.get_extra_info("ssl_object")
    cert = ssl_object.getpeercert() if ssl_object is not None else None
    return bool(cert) and cert.get("issuer") in sluice_ca_subjects(ca_file)


def sluice_ca_subjects(ca_file: str) -> frozenset:
    """The subject names of the CA certificates in SLUICE_CA_CERT (in the
    form of getpeercert()'s issuer)."""
    subjects = _CA_SUBJECTS.get(ca_file)
    if subjects is None:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        try:
            ctx.load_verify_locations(cafile=ca_file)
        except (OSError, ssl.SSLError):
            return frozenset()  # ssl_context() says why, for every request
        subjects = _CA_SUBJECTS[ca_file] = frozenset(c["subject"] for c in ctx.get_ca_certs())
    return subjects


def proxy_refusal(response: httpx.Response, url: str, deadline: float) -> WebError | None:
    """The tool error for a proxy-made refusal or failure (None: not one).
    Its message is Sluice's sentence for the reason code (policy/reasons.py)
    with the proxy's own sentence, cleaned and bounded."""
    status = response.status_code
    if status == 407:
        return _proxy_auth(url)
    reason = response.headers.get("sluice-reason")
    if reason and status >= 400:
        return refused_by_proxy(reason, _short_body(response, deadline), url, status)
    if status in (502, 504) and response.headers.get("proxy-status", "").lower().startswith("sluice"):
        said = clean(_short_body(response, deadline), PROXY_DETAIL_CHARS)
        return WebError("web_unreachable", f"the proxy could not complete the request for {clean(url, URL_CHARS)}"
                        + (f". The proxy said: {said}" if said else ""), status=status, url=clean(url, URL_CHARS))
    return None


def refused_by_proxy(reason_text: str, body: str, url: str, status: int | None) -> WebError:
    reason = reason_text.strip().lower()
    try:
        meaning = REASONS[Reason(reason)].meaning
    except ValueError:  # a code newer than these tools
        reason = reason if _REASON_TOKEN.fullmatch(reason) else "unknown"
        meaning = "the proxy's egress policy refused it"
    said = clean(body, PROXY_DETAIL_CHARS).removeprefix("Sluice refused this request: ")
    shown = clean(url, URL_CHARS)
    what = f"the redirect from {shown}" if reason == Reason.REDIRECT_REFUSED.value else f"the request for {shown}"
    message = f"Sluice refused {what} ({reason}: {meaning}). " + (f"The proxy said: {said}" if said else POLICY_SUFFIX)
    # An origin's 407 the proxy replaced is the origin failing, not the policy refusing.
    code = "web_unreachable" if reason == Reason.ORIGIN_PROXY_AUTH.value else "web_blocked"
    return WebError(code, message, reason=reason, by="proxy", url=shown, status=status)


def redirect_target(current: str, target, *, check: bool) -> str:
    """The next hop's URL (request_url's), or WebError: a hop the first-line
    checks refuse is `redirect_refused`, as the proxy's refusal of it is."""
    shown = clean(target.url, URL_CHARS)
    refusal = first_line_refusal(target.scheme, target.host, target.has_credentials) if check else None
    if refusal is not None:
        raise WebError("web_blocked", f"Sluice refused the redirect from {current} to {shown} "
                       f"({Reason.REDIRECT_REFUSED.value}: {REASONS[Reason.REDIRECT_REFUSED].meaning}): "
                       f"{clean(refusal.detail, 600)} ({refusal.reason.value}). {POLICY_SUFFIX}",
                       reason=Reason.REDIRECT_REFUSED.value, by="client", url=current, location=shown,
                       target_reason=refusal.reason.value)
    try:
        return str(request_url(target.url, first_line=check))
    except WebError as e:
        raise WebError(e.code, f"{current} redirects to {shown}, which is not followed: {e.message}",
                       **{**e.fields, "url": current, "location": shown}) from None


def _short_body(response: httpx.Response, deadline: float) -> str:
    """A proxy refusal's one-sentence body (at most 4 KiB of it)."""
    data = b""
    try:
        for chunk in response.iter_bytes(4096):
            data += chunk
            if len(data) >= 4096 or time.monotonic() > deadline:
                break
    except httpx.HTTPError:
        pass
    return data[:4096].decode("utf-8", "replace").strip()


def _proxy_error(message: str, url: str) -> WebError:
    """A refused CONNECT: httpcore's message is the status line's `CODE PHRASE`
    (the proxy's own: no tunnel, so no origin, exists yet)."""
    code, _, phrase = message.partition(" ")
    host = httpx.URL(url).host
    status = int(code) if code.isdigit() else None
    if code == "407":
        return _proxy_auth(url)
    if phrase.startswith("Sluice "):
        return refused_by_proxy(phrase.split(" ", 1)[1], "", url, status)
    return WebError("web_unreachable", f"the proxy could not open a tunnel to {host} ({clean(message, 300)})",
                    url=url, status=status)


def _proxy_auth(url: str) -> WebError:
    return WebError("web_proxy_auth", "the proxy wants client credentials (407): put them in the proxy URL, "
                    "SLUICE_PROXY=http://USER:PASSWORD@HOST:PORT, or check the ones given", url=url)


def _timeout(url: str, seconds: float) -> WebError:
    return WebError("web_timeout", f"{url} did not answer completely within {seconds:g} s; "
                    "the site may be slow or down: try again later or another source")


def _too_large(url: str, cap: int, *, decoded: bool, **fields) -> WebError:
    what = "inflates to more than" if decoded else "is larger than"
    return WebError("web_too_large", f"the body of {url} {what} the {cap:,}-byte cap for its kind; "
                    "it was not read (nothing was truncated)", limit=cap, decoded=decoded, url=url, **fields)


def _connect_error(e: httpx.ConnectError, url: str, client: httpx.Client) -> WebError:
    text = str(e)
    cause = e.__cause__ or e.__context__
    while cause is not None and not isinstance(cause, ssl.SSLError):
        cause = cause.__cause__ or cause.__context__
    if cause is not None or "SSL" in text or "CERTIFICATE" in text.upper():
        return WebError("web_tls_error", f"TLS with {httpx.URL(url).host} failed ({text}); if Sluice intercepts this "
                        "host, trust its CA with SLUICE_CA_CERT=/path/to/sluice-ca.pem", url=url)
    return WebError("web_proxy_unreachable", f"the proxy did not accept the connection ({text}); "
                    "check that Sluice is running and that SLUICE_PROXY names it", url=url)
