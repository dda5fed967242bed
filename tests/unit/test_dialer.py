"""The one dialer (sluice/dialer.py), in process, no proxy: each of its steps
refuses before the next runs, the connect timeout is the approving rules',
counted from the start of the handler's dial, and a tunnel's meters wrap its
streams once, in their order. (The pin and peer checks through the gate:
tests/unit/test_gate_pins.py; end to end: tests/integration/test_front_door.py.)"""

from __future__ import annotations

import asyncio
import dataclasses
import errno

import pytest
from mitmproxy import connection

from sluice import dialer
from sluice.dialer import ConnectTimedOut, Dialer, DialRefused, MeteredReader, MeteredWriter, OutOfFilesDial
from sluice.policy.model import Limits, Rules


class Audit:
    def __init__(self):
        self.lines = []

    def write(self, **record):
        self.lines.append(record)


def client() -> connection.Client:
    return connection.Client(peername=("127.0.0.1", 40000), sockname=("127.0.0.1", 8080), timestamp_start=0)


def rules(**limits) -> Rules:
    return dataclasses.replace(Rules(), limits=dataclasses.replace(Limits(), **limits))


class Writer:
    def __init__(self, peername=("8.8.8.8", 443)):
        self.peername, self.sent = peername, []

    def get_extra_info(self, name):
        return self.peername if name == "peername" else None

    def write(self, data):
        self.sent.append(data)


class Reader:
    def __init__(self, *chunks):
        self.chunks = list(chunks)

    async def read(self, n=-1):
        return self.chunks.pop(0) if self.chunks else b""


def make(approved=("8.8.8.8", 443), limits=None, own=frozenset()):
    audit = Audit()
    rule = rules(**(limits or {}))
    d = Dialer(lambda c, ip, port: rule if (ip, port) == approved else None, audit, lambda: own)
    return d, audit


def run(coro):
    return asyncio.run(coro)


def test_an_unapproved_address_is_never_connected():
    d, audit = make()
    dialled = []

    async def connect(host, port, **kw):
        dialled.append(host)
        return Reader(), Writer()

    for host, port in (("8.8.4.4", 443), ("8.8.8.8", 80), ("dns.google", 443)):
        with pytest.raises(DialRefused, match="^pin_mismatch: "):
            run(d.dial(client(), None, host, port, connect))
    assert dialled == [] and [line["reason"] for line in audit.lines] == ["pin_mismatch"] * 3


def test_the_proxys_own_address_is_a_loop_even_when_approved():
    d, audit = make(own=frozenset({"8.8.8.8"}))

    async def connect(host, port, **kw):
        pytest.fail("dialled the proxy's own host")

    with pytest.raises(DialRefused):
        run(d.dial(client(), None, "8.8.8.8", 443, connect))
    assert audit.lines[-1]["reason"] == "proxy_loop" and "refused before connecting" in audit.lines[-1]["detail"]


def test_no_room_refuses_with_its_reason_before_connecting():
    d, _ = make()
    d.room = lambda c, s: f"{dialer.UPSTREAMS_BUSY}: all in use"

    async def connect(host, port, **kw):
        pytest.fail("dialled without room")

    with pytest.raises(DialRefused, match=dialer.UPSTREAMS_BUSY):
        run(d.dial(client(), object(), "8.8.8.8", 443, connect))


def test_the_connect_timeout_is_the_approving_rules_and_counts_from_the_dials_start():
    d, _ = make(limits={"connect_timeout": 0.3})

    async def blackholed(host, port, **kw):
        await asyncio.sleep(60)

    async def timed(started_ago):
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(ConnectTimedOut) as refused:
            await d.dial(client(), None, "8.8.8.8", 443, blackholed, started=t0 - started_ago)
        return loop.time() - t0, str(refused.value)

    took, text = run(timed(0))
    assert 0.25 < took < 2 and text == "connect_timeout: 8.8.8.8 did not accept a connection within 0.3s"
    took, _ = run(timed(0.2))  # the hooks and the slot wait already took 0.2 s of it
    assert took < 0.25
    took, _ = run(timed(5))  # none left: not even tried
    assert took < 0.05


def test_out_of_files_is_its_own_refusal():
    d, _ = make()

    async def no_fds(host, port, **kw):
        raise OSError(errno.EMFILE, "Too many open files")

    with pytest.raises(OutOfFilesDial, match=dialer.OUT_OF_FILES_DIAL):
        run(d.dial(client(), None, "8.8.8.8", 443, no_fds))


def test_a_connect_error_passes_through_as_mitmproxys_failed_connect():
    d, _ = make()

    async def refused(host, port, **kw):
        raise ConnectionRefusedError(errno.ECONNREFUSED, "Connect call failed")

    with pytest.raises(ConnectionRefusedError):
        run(d.dial(client(), None, "8.8.8.8", 443, refused))


def test_a_tunnels_meters_wrap_its_streams_once_reads_inner_first_writes_outer_first():
    d, _ = make()
    seen = []

    def caps(from_client, n):  # inner: passes at most 5 bytes a chunk
        seen.append(("caps", from_client, n))
        return min(n, 5)

    def quota(from_client, n):  # outer: passes at most 3 bytes a chunk
        seen.append(("quota", from_client, n))
        return min(n, 3)

    d.meter_sources += [lambda c, s: caps, lambda c, s: None, lambda c, s: quota]
    upstream = Writer()

    async def connect(host, port, **kw):
        return Reader(b"0123456789"), upstream

    async def scenario():
        reader, writer = await d.dial(client(), object(), "8.8.8.8", 443, connect)
        assert isinstance(reader, MeteredReader) and isinstance(writer, MeteredWriter)
        got = await reader.read(65536)
        writer.write(b"abcdefghij")
        return got, writer

    got, writer = run(scenario())
    assert got == b"012" and upstream.sent == [b"abc"]
    assert seen == [("caps", False, 10), ("quota", False, 5), ("quota", True, 10), ("caps", True, 3)]
    assert writer.get_extra_info("peername") == ("8.8.8.8", 443)  # everything else is the socket's


def test_no_meter_no_wrapper():
    d, _ = make()
    plain = Reader(), Writer()

    async def connect(host, port, **kw):
        return plain

    assert run(d.dial(client(), object(), "8.8.8.8", 443, connect)) == plain
