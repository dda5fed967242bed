"""WebClient against httpx.MockTransport: redirects (each hop checked),
credential scoping, size caps and decompression bombs, without a proxy or a
socket. The transport stands in for the proxy connection; the checks and caps
are the client's own."""

from __future__ import annotations

import gzip
import zlib

import httpx
import pytest

from sluice.webtools.client import ReadPlan, WebClient, WebToolLimits
from sluice.webtools.errors import WebError

# Never dialled: the injected transport replaces the connection to it.
ENV = {"SLUICE_PROXY": "http://127.0.0.1:9"}
KIB, MIB = 1024, 1024 * 1024


class Origins:
    """A MockTransport handler that records each request it answers."""

    def __init__(self, routes: dict[str, httpx.Response]) -> None:
        self.routes = routes
        self.seen: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.seen.append(request)
        return self.routes.get(str(request.url), httpx.Response(404, text="no such page"))

    @property
    def urls(self) -> list[str]:
        return [str(r.url) for r in self.seen]


def client(origins: Origins, **limits) -> WebClient:
    return WebClient(env=ENV, limits=WebToolLimits(**limits), transport=httpx.MockTransport(origins))


def read(cap: int = MIB, truncate: bool = False):
    return lambda fetched: ReadPlan(cap, truncate)


def page(body: bytes, status: int = 200, **headers: str) -> httpx.Response:
    """A response whose body streams, as from a socket (httpx reads a bytes
    `content` eagerly, which a streaming client cannot read again)."""
    return httpx.Response(status, headers={k.replace("_", "-"): v for k, v in headers.items()},
                          content=iter([body[i:i + 16 * KIB] for i in range(0, len(body), 16 * KIB)]))


def redirect(to: str, status: int = 302) -> httpx.Response:
    return httpx.Response(status, headers={"Location": to})


def test_a_redirect_is_followed_and_the_body_read():
    origins = Origins({"https://www.example.com/old": redirect("/new"),
                       "https://www.example.com/new": page(b"hello", Content_Type="text/plain")})
    with client(origins) as c:
        fetched = c.request("https://www.example.com/old", classify=read())
    assert (fetched.status, fetched.body, fetched.final_url) == (200, b"hello", "https://www.example.com/new")
    assert origins.urls == ["https://www.example.com/old", "https://www.example.com/new"]


@pytest.mark.parametrize("location", ["http://169.254.169.254/latest/meta-data/", "http://localhost/admin",
                                      "http://10.0.0.1/", "http://user:pw@www.example.org/", "ftp://www.example.org/"])
def test_every_hop_is_checked_and_a_refused_one_is_never_requested(location):
    origins = Origins({"https://www.example.com/r": redirect(location)})
    with client(origins) as c, pytest.raises(WebError) as e:
        c.request("https://www.example.com/r", classify=read())
    assert e.value.code in ("web_blocked", "web_bad_url"), e.value.as_dict()
    assert origins.urls == ["https://www.example.com/r"]  # the refused target never reached the transport


def test_redirects_stop_at_the_cap():
    origins = Origins({f"https://www.example.com/{i}": redirect(f"/{i + 1}") for i in range(10)})
    with client(origins, max_redirects=3) as c, pytest.raises(WebError) as e:
        c.request("https://www.example.com/0", classify=read())
    assert e.value.code == "web_too_many_redirects" and e.value.fields["redirects"] == 3
    assert len(origins.seen) == 4


def test_credentials_go_to_the_first_origin_only():
    origins = Origins({"https://api.example.com/a": redirect("https://other.example.org/b"),
                       "https://other.example.org/b": redirect("https://api.example.com/c"),
                       "https://api.example.com/c": page(b"ok")})
    with client(origins) as c:
        c.request("https://api.example.com/a", classify=read(), credentials={"Authorization": "Bearer s3cret"})
    sent = {str(r.url): r.headers.get("authorization") for r in origins.seen}
    assert sent == {"https://api.example.com/a": "Bearer s3cret", "https://other.example.org/b": None,
                    "https://api.example.com/c": "Bearer s3cret"}


def test_a_307_repeats_the_post_and_a_302_turns_it_into_a_get():
    origins = Origins({"https://api.example.com/search": redirect("/v2", 307),
                       "https://api.example.com/v2": redirect("/done", 302),
                       "https://api.example.com/done": page(b"ok")})
    with client(origins) as c:
        c.request("https://api.example.com/search", classify=read(), method="POST", content=b'{"q": 1}')
    assert [(r.method, r.content) for r in origins.seen] == [("POST", b'{"q": 1}'), ("POST", b'{"q": 1}'),
                                                              ("GET", b"")]


def test_a_body_over_the_cap_is_refused_not_truncated():
    origins = Origins({"https://www.example.com/big": page(b"x" * (64 * KIB))})
    with client(origins) as c, pytest.raises(WebError) as e:
        c.request("https://www.example.com/big", classify=read(cap=16 * KIB))
    assert e.value.code == "web_too_large" and e.value.fields["limit"] == 16 * KIB
    assert e.value.fields["decoded"] is False


def test_a_body_over_the_cap_is_cut_when_the_plan_truncates():
    origins = Origins({"https://www.example.com/big": page(b"x" * (64 * KIB))})
    with client(origins) as c:
        fetched = c.request("https://www.example.com/big", classify=read(cap=16 * KIB, truncate=True))
    assert fetched.truncated and len(fetched.body) == 16 * KIB


def test_a_declared_length_over_the_cap_is_refused_before_the_body_is_read():
    reads = []

    def body():
        reads.append(1)
        yield b"x" * KIB

    origins = Origins({"https://www.example.com/huge": httpx.Response(
        200, headers={"Content-Length": str(10 * MIB)}, content=body())})
    with client(origins) as c, pytest.raises(WebError) as e:
        c.request("https://www.example.com/huge", classify=read(cap=MIB))
    assert e.value.code == "web_too_large" and e.value.fields["content_length"] == 10 * MIB
    assert reads == []


@pytest.mark.parametrize("coding,compress", [("gzip", gzip.compress), ("deflate", zlib.compress)])
def test_a_decompression_bomb_stops_at_the_decoded_cap(coding, compress):
    bomb = compress(b"\0" * (64 * MIB))  # tens of KiB on the wire
    assert len(bomb) < MIB
    origins = Origins({"https://www.example.com/bomb": page(bomb, Content_Encoding=coding)})
    with client(origins) as c, pytest.raises(WebError) as e:
        c.request("https://www.example.com/bomb", classify=read(cap=MIB))
    assert e.value.code == "web_too_large" and e.value.fields["decoded"] is True


def test_a_compressed_body_under_the_cap_is_inflated():
    origins = Origins({"https://www.example.com/z": page(gzip.compress(b"small page"), Content_Encoding="gzip")})
    with client(origins) as c:
        fetched = c.request("https://www.example.com/z", classify=read())
    assert fetched.body == b"small page" and fetched.encoding == "gzip"


def test_without_a_proxy_nothing_is_sent_even_with_a_transport():
    origins = Origins({})
    with WebClient(env={}, transport=httpx.MockTransport(origins)) as c, pytest.raises(WebError) as e:
        c.request("https://www.example.com/", classify=read())
    assert e.value.code == "web_no_proxy" and origins.seen == []
