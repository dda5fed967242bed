"""The dialer through a parent proxy (sluice/dialer.py), in process, no
network: the CONNECT it sends (the pinned IP, never a name; the parent's
credentials), its bounded read of the parent's reply (a hostile parent's
endless header cannot exhaust memory), what goes through after it, and
that the pin, the peer check and the timeout hold through the parent.
(End to end with a real parent: tests/integration/test_upstream_proxy.py.)"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from mitmproxy import connection

from sluice.dialer import (
    MAX_PARENT_REPLY_BYTES,
    Dialer,
    DialRefused,
    ParentReplyRefused,
    UpstreamProxyFailed,
    connect_through_parent,
)
from sluice.policy.credentials import Secret
from sluice.policy.model import Limits, Rules, UpstreamProxy

PARENT = UpstreamProxy("10.0.0.2", 3128, "http://10.0.0.2:3128", Secret("Basic c2x1aWNlOnB3"), "file parent")


class Audit:
    def __init__(self):
        self.lines = []

    def write(self, **record):
        self.lines.append(record)


class Writer:
    def __init__(self, peername=("10.0.0.2", 3128)):
        self.peername, self.sent, self.aborted = peername, [], False

    def get_extra_info(self, name):
        return self.peername if name == "peername" else None

    def write(self, data):
        self.sent.append(bytes(data))

    async def drain(self):
        pass

    def close(self):
        self.aborted = True


def reader_with(data: bytes, eof: bool = True) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    if eof:
        reader.feed_eof()
    return reader


def handshake(data: bytes, ip="8.8.8.8", port=443, authorization=None, eof=True):
    async def go():
        reader, writer = reader_with(data, eof), Writer()
        await connect_through_parent(reader, writer, ip, port, authorization)
        return reader, writer
    return asyncio.run(go())


def refusal(data: bytes, **kw) -> str:
    with pytest.raises(ParentReplyRefused) as e:
        handshake(data, **kw)
    return str(e.value)


# ---- the CONNECT and the reply -----------------------------------------------------


def test_sends_connect_to_the_pinned_ip_with_the_parents_credentials():
    _, writer = handshake(b"HTTP/1.1 200 Connection established\r\n\r\n", authorization="Basic c2x1aWNlOnB3")
    assert b"".join(writer.sent) == (b"CONNECT 8.8.8.8:443 HTTP/1.1\r\nHost: 8.8.8.8:443\r\n"
                                     b"Proxy-Authorization: Basic c2x1aWNlOnB3\r\n\r\n")


def test_an_ipv6_pin_is_bracketed_and_no_credentials_means_no_header():
    _, writer = handshake(b"HTTP/1.0 200 OK\r\n\r\n", ip="2606:4700:4700::1111", port=80)
    assert b"".join(writer.sent) == (b"CONNECT [2606:4700:4700::1111]:80 HTTP/1.1\r\n"
                                     b"Host: [2606:4700:4700::1111]:80\r\n\r\n")


def test_bytes_after_the_reply_head_stay_for_the_tunnel():
    # A server that speaks first (or a parent that pipelines): not one byte of the tunnel is lost.
    reader, _ = handshake(b"HTTP/1.1 200 OK\r\nProxy-Agent: x\r\nContent-Length: 5\r\n\r\nSSH-2.0-banner\r\n")
    assert asyncio.run(reader.read()) == b"SSH-2.0-banner\r\n"


@pytest.mark.parametrize("reply, expected", [
    (b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\n\r\n", "answered 'HTTP/1.1 403 Forbidden'"),
    (b"HTTP/1.1 502 Bad Gateway\r\n\r\n", "answered 'HTTP/1.1 502 Bad Gateway'"),
    (b"HTTP/1.0 407 Proxy Authentication Required\r\n\r\n",
     "answered 'HTTP/1.0 407 Proxy Authentication Required' (wrong or missing upstream_proxy.credentials)"),
    (b"HTTP/1.1 301 Moved\r\n\r\n", "answered 'HTTP/1.1 301 Moved'"),
    (b"SSH-2.0-OpenSSH\r\n", "answered something that is not an HTTP/1 status line: 'SSH-2.0-OpenSSH'"),
    (b"HTTP/1.1 403 \x1b[31mred\x00\r\n\r\n", "answered 'HTTP/1.1 403 ?[31mred?'"),
    (b"HTTP/1.1 403 Forbidden", "answered 'HTTP/1.1 403 Forbidden' and closed the connection"),
])
def test_a_reply_that_is_not_2xx_is_refused_naming_it_sanitised(reply, expected):
    assert refusal(reply) == expected


def test_a_long_status_line_is_quoted_bounded():
    message = refusal(b"HTTP/1.1 403 " + b"x" * 5000 + b"\r\n\r\n")
    assert len(message) < 200 and message.endswith("…'")


def test_the_parent_closing_before_answering_is_eof():
    with pytest.raises(EOFError):
        handshake(b"")


def test_an_endless_header_is_refused_within_the_bound():
    async def go():
        reader, writer = asyncio.StreamReader(), Writer()
        reader.feed_data(b"HTTP/1.1 200 OK\r\n")
        fed = 0

        async def hostile_parent():
            nonlocal fed
            while True:  # header fields forever, never the blank line
                reader.feed_data(b"X-Filler: " + b"a" * 50 + b"\r\n")
                fed += 62
                await asyncio.sleep(0)

        feeder = asyncio.create_task(hostile_parent())
        try:
            with pytest.raises(ParentReplyRefused, match="reply head over 16384 bytes or 100 lines"):
                await asyncio.wait_for(connect_through_parent(reader, writer, "8.8.8.8", 443, None), 5)
        finally:
            feeder.cancel()
        return fed
    assert asyncio.run(go()) < 4 * MAX_PARENT_REPLY_BYTES


def test_an_endless_line_is_refused_at_the_readers_limit():
    async def go():
        reader = asyncio.StreamReader(limit=64 * 1024)
        fed = 0

        async def hostile_parent():
            nonlocal fed
            while True:  # one status line that never ends
                reader.feed_data(b"HTTP/1.1 200 " + b"a" * 4096)
                fed += 4109
                await asyncio.sleep(0)

        feeder = asyncio.create_task(hostile_parent())
        try:
            with pytest.raises(ParentReplyRefused, match="a line longer than"):
                await asyncio.wait_for(connect_through_parent(reader, Writer(), "8.8.8.8", 443, None), 5)
        finally:
            feeder.cancel()
        return fed
    assert asyncio.run(go()) < 4 * 64 * 1024


# ---- the dial through the parent --------------------------------------------------


def client() -> connection.Client:
    return connection.Client(peername=("127.0.0.1", 40000), sockname=("127.0.0.1", 8080), timestamp_start=0)


def make(parent=PARENT, approved=("8.8.8.8", 443), **limits):
    audit = Audit()
    rule = dataclasses.replace(Rules(), upstream_proxy=parent, limits=dataclasses.replace(Limits(), **limits))
    return Dialer(lambda c, ip, port: rule if (ip, port) == approved else None, audit), audit


def parent_connect(reply=b"HTTP/1.1 200 OK\r\n\r\n", peername=("10.0.0.2", 3128), dialled=None, writers=None):
    async def connect(host, port, **kw):
        if dialled is not None:
            dialled.append((host, port))
        writer = Writer(peername)
        if writers is not None:
            writers.append(writer)
        return reader_with(reply, eof=False), writer
    return connect


def test_the_dial_goes_to_the_parent_and_connects_the_pin_through_it():
    d, audit = make()
    dialled, writers = [], []
    reader, writer = asyncio.run(d.dial(client(), None, "8.8.8.8", 443, parent_connect(dialled=dialled,
                                                                                       writers=writers)))
    assert dialled == [("10.0.0.2", 3128)]  # the parent's private address: accepted for routed dials
    assert writers[0].sent[0].startswith(b"CONNECT 8.8.8.8:443 HTTP/1.1\r\n")
    assert b"Proxy-Authorization: Basic c2x1aWNlOnB3\r\n" in writers[0].sent[0]
    assert audit.lines == []


def test_the_pin_is_checked_before_anything_reaches_the_parent():
    d, audit = make()
    dialled = []
    with pytest.raises(DialRefused, match="^pin_mismatch: "):
        asyncio.run(d.dial(client(), None, "10.0.0.1", 443, parent_connect(dialled=dialled)))
    assert dialled == [] and [line["reason"] for line in audit.lines] == ["pin_mismatch"]


def test_the_peer_check_checks_the_parents_address():
    d, audit = make()
    writers = []
    with pytest.raises(DialRefused, match="^pin_mismatch: "):
        asyncio.run(d.dial(client(), None, "8.8.8.8", 443, parent_connect(peername=("10.9.9.9", 3128),
                                                                          writers=writers)))
    assert writers[0].aborted and writers[0].sent == []  # not one byte (no CONNECT) to that peer
    assert [line["reason"] for line in audit.lines] == ["pin_mismatch"]


def test_a_refusing_parent_is_upstream_proxy_failed_with_its_status():
    d, _ = make()
    writers = []
    with pytest.raises(UpstreamProxyFailed) as e:
        asyncio.run(d.dial(client(), None, "8.8.8.8", 443, parent_connect(b"HTTP/1.1 403 Forbidden\r\n\r\n",
                                                                          writers=writers)))
    assert str(e.value) == ("upstream_proxy_failed: the parent proxy http://10.0.0.2:3128 answered "
                            "'HTTP/1.1 403 Forbidden' to CONNECT 8.8.8.8:443")
    assert writers[0].aborted


def test_a_parent_that_is_down_is_upstream_proxy_failed():
    d, _ = make()

    async def refused(host, port, **kw):
        raise ConnectionRefusedError(111, "Connection refused")
    with pytest.raises(UpstreamProxyFailed, match="^upstream_proxy_failed: the parent proxy http://10.0.0.2:3128 "
                                                  r"is down or unreachable \(Connection refused\)$"):
        asyncio.run(d.dial(client(), None, "8.8.8.8", 443, refused))


def test_a_parent_that_never_answers_is_upstream_proxy_failed_within_the_connect_timeout():
    d, _ = make(connect_timeout=0.2)
    with pytest.raises(UpstreamProxyFailed, match="did not answer CONNECT 8.8.8.8:443 within 0.2s$"):
        asyncio.run(d.dial(client(), None, "8.8.8.8", 443, parent_connect(b"")))

    async def blackhole(host, port, **kw):
        await asyncio.sleep(10)
    with pytest.raises(UpstreamProxyFailed, match="did not accept a connection within 0.2s$"):
        asyncio.run(d.dial(client(), None, "8.8.8.8", 443, blackhole))


def test_a_parent_by_name_is_resolved_and_each_address_tried(monkeypatch):
    d, _ = make(parent=dataclasses.replace(PARENT, host="corp-proxy", url="http://corp-proxy:3128"))
    dialled = []

    async def getaddrinfo(self, host, port, **kw):
        assert (host, port) == ("corp-proxy", 3128)
        return [(2, 1, 6, "", ("10.0.0.9", 3128)), (2, 1, 6, "", ("10.0.0.2", 3128))]
    monkeypatch.setattr(asyncio.BaseEventLoop, "getaddrinfo", getaddrinfo)

    async def connect(host, port, **kw):
        dialled.append(host)
        if host == "10.0.0.9":
            raise ConnectionRefusedError(111, "Connection refused")
        return reader_with(b"HTTP/1.1 200 OK\r\n\r\n", eof=False), Writer(("10.0.0.2", 3128))
    asyncio.run(d.dial(client(), None, "8.8.8.8", 443, connect))
    assert dialled == ["10.0.0.9", "10.0.0.2"]
