"""The web tools' HTTP client: every request through the Sluice proxy, with
caps that hold while reading.

Routing. The proxy is `SLUICE_PROXY`, else `HTTPS_PROXY` (https URLs) or
`HTTP_PROXY` (http URLs), else `ALL_PROXY` (lower-case spellings too). With
none, every request is refused as `web_no_proxy`: nothing ever goes direct,
and `NO_PROXY` is ignored for the same reason. `user:pass@` in the proxy URL
is sent to the proxy (Proxy-Authorization) for a client profile, never to an
origin. TLS is verified against the public CAs (certifi) plus
`SLUICE_CA_CERT` (the CA of an intercepting Sluice); `SSL_CERT_FILE`, when
set and `SLUICE_CA_CERT` is not, replaces the bundle as it does elsewhere.

First-line checks. URLs a model gives (and every redirect target) are
checked before any request with the proxy's own code (`sluice.policy`):
http/https only, no `user:pass@`, a valid host, no internal names, no
literal non-public address. A failure is `web_blocked` with the same reason
code the proxy would send and `by: "client"`. The proxy remains the
authority: everything that passes is decided again there (DNS answers,
allow/deny lists, ports, caps), and its refusals come back as `web_blocked`
with `by: "proxy"`: from the `Sluice-Reason` header, or, for a refused
CONNECT (whose headers and body httpx never shows), from the status line's
reason phrase, `403 Sluice address_not_public`. A 407 is `web_proxy_auth`.

Redirects are followed here, at most 5, each a new request through the proxy
after the first-line check; credentials given for an origin (Authorization,
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
import ssl
import time
import zlib
from dataclasses import dataclass, field
from http.cookiejar import DefaultCookiePolicy
from typing import Callable, Iterator

import httpx

from sluice.policy.hosts import HostError, IPHost, NameHost, internal_name, parse_host
from sluice.policy.ranges import classify
from sluice.policy.reasons import REASONS, POLICY_SUFFIX, Reason, Refusal
from sluice.policy.urls import resolve_redirect, split_url
from sluice.webtools.deadline import WATCHDOG, StreamGuard
from sluice.webtools.errors import WebError

MIB = 1024 * 1024
MAX_REDIRECTS = 5
REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
BOMB_RATIO = 100
USER_AGENT = "sluice-webtools/0.1 (an AI agent's web tool; no JavaScript, no cookies)"

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
class Limits:
    """Transport caps (bytes, decoded). Override with SLUICE_WEB_* variables."""

    timeout: float = 20.0
    text_bytes: int = 2 * MIB
    image_bytes: int = 5 * MIB
    pdf_bytes: int = 10 * MIB
    sitemap_bytes: int = 50 * MIB
    max_redirects: int = MAX_REDIRECTS

    @classmethod
    def from_env(cls, env: dict | None = None) -> "Limits":
        env = os.environ if env is None else env
        values = {}
        for name, kind in (("timeout", float), ("text_bytes", int), ("image_bytes", int),
                           ("pdf_bytes", int), ("sitemap_bytes", int)):
            raw = env.get(f"SLUICE_WEB_{name.upper()}")
            if raw:
                try:
                    values[name] = kind(raw)
                except ValueError:
                    raise WebError("web_bad_argument", f"SLUICE_WEB_{name.upper()}={raw!r} is not a number") from None
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
    """The first-line check on a URL a model gave: the URL, or WebError."""
    if not isinstance(url, str) or not url.strip():
        raise WebError("web_bad_url", "url must be an absolute http or https URL, e.g. https://example.com/page")
    try:
        target = split_url(url.strip())
    except ValueError as e:
        raise WebError("web_bad_url", f"{e}") from None
    refusal = first_line_refusal(target.scheme, target.host, target.has_credentials)
    if refusal is not None:
        raise blocked(refusal, by="client", url=target.url)
    return target.url


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
            return Refusal(Reason.ADDRESS_NOT_PUBLIC, f"{host.address} is {row.name} ({row.cidr}); only public internet addresses are reachable")
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
        raise WebError("web_no_proxy", NO_PROXY_MESSAGE)
    if "://" not in proxy:
        proxy = "http://" + proxy
    if proxy.split("://", 1)[0].lower() not in ("http", "https"):
        raise WebError("web_no_proxy", f"the proxy {_redact(proxy)} is not an http:// proxy URL; "
                       "the web tools speak HTTP to the proxy: set SLUICE_PROXY=http://HOST:PORT")
    return proxy


def _redact(proxy: str) -> str:
    scheme, _, rest = proxy.partition("://")
    if "@" in rest.split("/", 1)[0]:
        rest = "***@" + rest.split("@", 1)[1]
    return f"{scheme}://{rest}"


_SSL_CACHE: dict[tuple, ssl.SSLContext] = {}


def ssl_context(env: dict | None = None) -> ssl.SSLContext:
    env = os.environ if env is None else env
    extra = env.get("SLUICE_CA_CERT") or None
    replace = None if extra else (env.get("SSL_CERT_FILE") or None)
    key = (extra, replace)
    ctx = _SSL_CACHE.get(key)
    if ctx is None:
        try:
            if replace:
                ctx = ssl.create_default_context(cafile=replace)
            else:
                import certifi

                ctx = ssl.create_default_context(cafile=certifi.where())
                if extra:
                    ctx.load_verify_locations(cafile=extra)
        except (OSError, ssl.SSLError) as e:
            name = "SLUICE_CA_CERT" if extra else "SSL_CERT_FILE"
            raise WebError("web_tls_error", f"the CA file in {name} ({extra or replace}) cannot be loaded: {e}") from None
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
    """One tool call's client. `env` defaults to os.environ."""

    env: dict | None = None
    limits: Limits = field(default_factory=Limits)
    _clients: dict = field(default_factory=dict, repr=False)

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
        self._clients.clear()

    def __enter__(self) -> "WebClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


    def _client(self, proxy: str) -> httpx.Client:
        client = self._clients.get(proxy)
        if client is None:
            client = httpx.Client(
                proxy=proxy, verify=ssl_context(self.env), trust_env=False, follow_redirects=False,
                timeout=httpx.Timeout(self.limits.timeout), http2=False,
                # No connection is reused, so every exchange's socket is a new one the watchdog sees.
                limits=httpx.Limits(max_keepalive_connections=0),
                headers={"User-Agent": USER_AGENT, "Accept-Encoding": ACCEPT_ENCODING},
            )
            client.cookies.jar.set_policy(DefaultCookiePolicy(allowed_domains=[]))  # keep no cookies
            self._clients[proxy] = client
        return client

    def get(self, url: str, *, classify: Classifier, headers: dict[str, str] | None = None,
            credentials: dict[str, str] | None = None, check: bool = True, method: str = "GET",
            content: bytes | None = None) -> Fetched:
        """GET `url` through the proxy, following redirects (each checked),
        and read the body as `classify` plans it. `credentials` go only to
        the URL's own origin; `check=False` skips the first-line check (URLs
        the operator configured). `method`/`content` send another method
        with a body (search providers' POST APIs): a 307/308 repeats it, any
        other redirect becomes a GET without the body."""
        deadline = time.monotonic() + self.limits.timeout
        proxy_for("https" if isinstance(url, str) and url.strip().lower().startswith("https:") else "http", self.env)
        current = check_url(url) if check else url
        start_origin = origin_of(current)
        hops = 0
        while True:
            send = dict(headers or {})
            if credentials and origin_of(current) == start_origin:
                send.update(credentials)
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
                raise WebError("web_bad_url", f"{current} redirects to an unusable Location ({e})",
                               status=None, location=location) from None
            if hops > self.limits.max_redirects:
                raise WebError("web_too_many_redirects", f"{url} redirected more than {self.limits.max_redirects} "
                               f"times (the last hop pointed to {target.url}); not followed further",
                               location=target.url, redirects=hops - 1)
            if check:
                refusal = first_line_refusal(target.scheme, target.host, target.has_credentials)
                if refusal is not None:
                    raise blocked(refusal, by="client", url=target.url)
            current = target.url

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
            request = client.build_request(method, current, headers=headers, content=content,
                                           timeout=httpx.Timeout(remaining))
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
        reason = response.headers.get("sluice-reason")
        if status == 407:
            raise _proxy_auth(current)
        if reason and status >= 400:
            message = _short_body(response, deadline) or _reason_sentence(reason, current)
            raise WebError("web_blocked", message, reason=reason, by="proxy", url=current, status=status)
        if status in (502, 504) and response.headers.get("proxy-status", "").lower().startswith("sluice"):
            message = _short_body(response, deadline) or f"the proxy could not complete the request for {current}"
            raise WebError("web_unreachable", message, status=status, url=current)
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
                           f"arrived ({e}); the origin, or a size or time cap of the proxy, cut it", url=current) from None
        fetched.body = bytes(body)
        return fetched


@contextlib.contextmanager
def call_client(client: "WebClient | None") -> Iterator["WebClient"]:
    """A tool call's client: the caller's as it is (the caller closes it), or
    one made from the environment for this call and closed after it."""
    if client is not None:
        yield client
        return
    with WebClient(limits=Limits.from_env()) as own:
        yield own


def _short_body(response: httpx.Response, deadline: float) -> str:
    """A refusal's one-sentence body (at most 4 KiB of it)."""
    data = b""
    try:
        for chunk in response.iter_bytes(4096):
            data += chunk
            if len(data) >= 4096 or time.monotonic() > deadline:
                break
    except httpx.HTTPError:
        pass
    return data[:4096].decode("utf-8", "replace").strip()


def _reason_sentence(reason: str, url: str) -> str:
    try:
        meaning = REASONS[Reason(reason)].meaning
    except ValueError:
        meaning = "the proxy's egress policy refused it"
    return f"Sluice refused the request for {url} ({reason}: {meaning}). {POLICY_SUFFIX}"


def _proxy_error(message: str, url: str) -> WebError:
    """A refused CONNECT: httpcore's message is the status line's `CODE PHRASE`."""
    code, _, phrase = message.partition(" ")
    host = httpx.URL(url).host
    if code == "407":
        return _proxy_auth(url)
    if phrase.startswith("Sluice "):
        reason = phrase.split(" ", 1)[1].strip()
        return WebError("web_blocked", _reason_sentence(reason, url), reason=reason, by="proxy", url=url,
                        status=int(code) if code.isdigit() else None)
    return WebError("web_unreachable", f"the proxy could not open a tunnel to {host} ({message})", url=url,
                    status=int(code) if code.isdigit() else None)


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
