"""HTTP/2 with a zero receive window inside an intercepted tunnel (issue 18,
item 1), and the slow readers it is compared with.

The origin (`BigOrigin`, 93.184.215.14 on free ports) answers `/big/N` with N
bytes: over TLS it speaks HTTP/2 or HTTP/1.1 as ALPN says (h2 as fast as the
proxy's window lets it, which mitmproxy opens to 2 GiB), and HTTP/1.1 on a
plain port. It counts the body bytes it has handed to its sockets.

- The attack: 2 connections, each an intercepted CONNECT tunnel speaking h2
  to the proxy, announce SETTINGS_INITIAL_WINDOW_SIZE 0, open 20 streams for
  4 MiB each and read nothing. Without `h2_stream_buffer_cap`
  (addons/mitm_patches.py) the proxy reads all 160 MiB from the origin and
  holds it (RSS +160 MiB and more); with it, a stream that holds half of
  `limits.h2_stream_buffer_bytes` is no longer acknowledged to the origin
  (which then stops at the end of its stream window, half the cap), so RSS
  stays under the documented bound, connections x streams x (buffer cap +
  one read), and the origin is held back. One stream whose window the client opens
  arrives whole while its siblings stay held (no head-of-line blocking on
  the shared origin connection). The client then opens every window and
  every stream arrives whole: nothing was dropped, the held origin resumes.
  The proxy announces the policy's `h2_max_concurrent_streams`.
- For comparison, slow readers that are bounded by TCP backpressure alone:
  plain HTTP/1 through the proxy, HTTP/1 inside an intercepted tunnel, and
  a raw (not intercepted) tunnel, each reading nothing of a 32 MiB body:
  RSS stays flat and the origin is held back once the socket buffers are full.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import threading
import time
from pathlib import Path

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
import pytest

from harness import default_policy
from harness.clients import connect
from relkit import RssPeak, rss_kib, wait_until
from harness.loops import stop_loop_thread

pytestmark = pytest.mark.netns

ORIGIN_IP = "93.184.215.14"
H2_HOST = "h2window.example"  # intercepted
RAW_HOST = "rawbig.example"  # allowed, not intercepted
KIB, MIB = 1024, 1024 * 1024
CHUNK = 64 * KIB

CONNECTIONS, STREAMS, BODY = 2, 20, 4 * MIB
BUFFER_CAP = 1 * MIB  # limits.h2_stream_buffer_bytes, the default
MAX_STREAMS = 32  # limits.h2_max_concurrent_streams in the test policy
ONE_READ = 64 * KIB  # what a stream may pass its cap by: one read of the origin socket
# The documented bound for the connections the attack opens, and what the
# process needs on top of it for TLS state and the like (measured: a few MiB).
BOUND = CONNECTIONS * STREAMS * (BUFFER_CAP + ONE_READ)
SLACK = 24 * MIB

SLOW_BODY = 32 * MIB  # more than the sockets' buffers hold (max_response_bytes is raised for it)
SLOW_CONNECTIONS = 4  # of each kind


class BigOrigin:
    """See the module docstring. Runs its own event loop in a thread."""

    def __init__(self, server_ctx: ssl.SSLContext) -> None:
        self.server_ctx = server_ctx
        self.sent = 0  # body bytes handed to the sockets
        self.tls_port = self.plain_port = 0
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.servers: list[asyncio.Server] = []
        self._payload = b"x" * CHUNK

    def start(self) -> BigOrigin:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)
        return self

    async def _start(self) -> None:
        tls = await asyncio.start_server(self._handle_tls, ORIGIN_IP, 0, ssl=self.server_ctx)
        plain = await asyncio.start_server(self._serve_http1, ORIGIN_IP, 0)
        self.servers = [tls, plain]
        self.tls_port = tls.sockets[0].getsockname()[1]
        self.plain_port = plain.sockets[0].getsockname()[1]

    def stop(self) -> None:
        stop_loop_thread(self.loop, self.thread, self.servers)

    def sent_settled(self, steady: float = 1.0, timeout: float = 20.0) -> int:
        """Wait (bounded) until `sent` has not grown for `steady` seconds."""
        deadline = time.monotonic() + timeout
        last, since = self.sent, time.monotonic()
        while time.monotonic() < deadline:
            time.sleep(0.1)
            if self.sent != last:
                last, since = self.sent, time.monotonic()
            elif time.monotonic() - since >= steady:
                break
        return self.sent

    async def _handle_tls(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        ssl_object = writer.get_extra_info("ssl_object")
        if ssl_object.selected_alpn_protocol() == "h2":
            await self._serve_h2(reader, writer)
        else:
            await self._serve_http1(reader, writer)

    async def _serve_http1(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                size = int(head.split(b" ", 2)[1].rsplit(b"/", 1)[1])
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size)
                while size:
                    piece = self._payload[:min(size, CHUNK)]
                    writer.write(piece)
                    self.sent += len(piece)
                    size -= len(piece)
                    await writer.drain()
        except (OSError, asyncio.IncompleteReadError, ValueError, IndexError):
            pass
        finally:
            writer.close()

    async def _serve_h2(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding="utf-8"))
        conn.initiate_connection()
        writer.write(conn.data_to_send())
        window = {"opened": asyncio.Event()}  # replaced each time a window opens: every waiter wakes
        senders: dict[int, asyncio.Task] = {}

        async def send_body(stream_id: int, size: int) -> None:
            while size:
                room = min(conn.local_flow_control_window(stream_id), conn.max_outbound_frame_size, CHUNK, size)
                if room <= 0:
                    await window["opened"].wait()
                    continue
                conn.send_data(stream_id, self._payload[:room])
                self.sent += room
                size -= room
                writer.write(conn.data_to_send())
                await writer.drain()
            conn.end_stream(stream_id)
            writer.write(conn.data_to_send())

        try:
            while data := await reader.read(65536):
                for event in conn.receive_data(data):
                    if isinstance(event, h2.events.RequestReceived):
                        size = int(dict(event.headers)[":path"].rsplit("/", 1)[1])
                        conn.send_headers(event.stream_id, [(":status", "200"), ("content-length", str(size))])
                        senders[event.stream_id] = asyncio.ensure_future(send_body(event.stream_id, size))
                    elif isinstance(event, (h2.events.WindowUpdated, h2.events.RemoteSettingsChanged)):
                        window["opened"].set()
                        window["opened"] = asyncio.Event()
                    elif isinstance(event, h2.events.StreamReset) and event.stream_id in senders:
                        senders.pop(event.stream_id).cancel()
                writer.write(conn.data_to_send())
        except (OSError, h2.exceptions.ProtocolError):
            pass
        finally:
            for task in senders.values():
                task.cancel()
            writer.close()


@pytest.fixture(scope="module")
def origin(net, tls_ca, fake_dns):
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls_ca.ca.issue_cert(H2_HOST, RAW_HOST).configure_cert(ctx)
    ctx.set_alpn_protocols(["h2", "http/1.1"])
    for name in (H2_HOST, RAW_HOST):
        fake_dns.set(name, a=[ORIGIN_IP], ttl=300)
    server = BigOrigin(ctx).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def proxy(sluice_factory, origin, tls_ca):
    policy = default_policy(ports=[origin.tls_port, origin.plain_port])
    policy.update({"allow": [H2_HOST, RAW_HOST], "intercept": [H2_HOST],
                   "limits": {"h2_max_concurrent_streams": MAX_STREAMS, "max_response_bytes": "64MiB"}})
    return sluice_factory(policy, name="relh2window",
                          extra_args=("--set", f"ssl_verify_upstream_trusted_ca={tls_ca.cafile}"))


@pytest.fixture(scope="module")
def sluice_ca(proxy, sluice_home) -> str:
    return str(Path(sluice_home) / ".sluice" / "ca" / "mitmproxy-ca-cert.pem")


def tunnel(proxy, host: str, port: int, cafile: str, alpn: list[str], timeout: float = 15.0) -> ssl.SSLSocket:
    response, opened = connect(proxy.address, f"{host}:{port}", timeout=timeout)
    assert response.status == 200 and opened is not None, f"CONNECT {host}:{port} -> {response}"
    ctx = ssl.create_default_context(cafile=cafile)
    ctx.set_alpn_protocols(alpn)
    sock = ctx.wrap_socket(opened.sock, server_hostname=host)
    sock.settimeout(timeout)
    return sock


class ZeroWindowClient:
    """An h2 client that announces a zero stream window and reads nothing
    until `read_all`."""

    def __init__(self, sock: ssl.SSLSocket, authority: str) -> None:
        assert sock.selected_alpn_protocol() == "h2", sock.selected_alpn_protocol()
        self.sock, self.authority = sock, authority
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        self.conn.local_settings = h2.settings.Settings(client=True, initial_values={
            h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0, h2.settings.SettingCodes.ENABLE_PUSH: 0})
        self.conn.initiate_connection()
        self.received: dict[int, int] = {}
        self.ended: set[int] = set()
        self.settings_seen = False
        self.sock.sendall(self.conn.data_to_send())

    def request(self, count: int, size: int) -> None:
        for _ in range(count):
            stream_id = self.conn.get_next_available_stream_id()
            self.conn.send_headers(stream_id, [(":method", "GET"), (":scheme", "https"), (":authority", self.authority),
                                               (":path", f"/big/{size}")], end_stream=True)
            self.received[stream_id] = 0
        self.sock.sendall(self.conn.data_to_send())

    def _pump(self) -> None:
        data = self.sock.recv(65536)
        assert data, "the proxy closed the connection"
        for event in self.conn.receive_data(data):
            if isinstance(event, h2.events.DataReceived):
                self.received[event.stream_id] += len(event.data)
                self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            elif isinstance(event, h2.events.StreamEnded):
                self.ended.add(event.stream_id)
            elif isinstance(event, h2.events.RemoteSettingsChanged):
                self.settings_seen = True
            elif isinstance(event, h2.events.StreamReset):
                raise AssertionError(f"stream {event.stream_id} was reset ({event.error_code})")
        out = self.conn.data_to_send()
        if out:
            self.sock.sendall(out)

    def proxy_settings(self, timeout: float = 5.0) -> h2.settings.Settings:
        """Read until the proxy's SETTINGS arrived (no stream data can: the window is 0)."""
        deadline = time.monotonic() + timeout
        while not self.settings_seen and time.monotonic() < deadline:
            self._pump()
        assert self.settings_seen, "the proxy sent no SETTINGS"
        return self.conn.remote_settings

    def read_one(self, stream_id: int, timeout: float = 30.0) -> int:
        """Open the window of one stream only (and the connection's) and read
        until that stream ends (bounded); the others stay at window 0."""
        self.conn.increment_flow_control_window(2**30)
        self.conn.increment_flow_control_window(2**30, stream_id=stream_id)
        self.sock.sendall(self.conn.data_to_send())
        deadline = time.monotonic() + timeout
        while stream_id not in self.ended and time.monotonic() < deadline:
            try:
                self._pump()
            except TimeoutError:
                break
        return self.received[stream_id]

    def read_all(self, timeout: float = 60.0) -> dict[int, int]:
        """Open the windows and read every stream to its end (bounded)."""
        self.conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 4 * MIB})
        self.conn.increment_flow_control_window(2**30)
        self.sock.sendall(self.conn.data_to_send())
        deadline = time.monotonic() + timeout
        while len(self.ended) < len(self.received) and time.monotonic() < deadline:
            self._pump()
        return self.received

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def test_zero_window_h2_streams_are_bounded(proxy, origin, sluice_ca):
    """The attack of issue 18 item 1, scaled down: fails without h2_stream_buffer_cap."""
    pid = proxy.proc.pid
    authority = f"{H2_HOST}:{origin.tls_port}"
    warm = ZeroWindowClient(tunnel(proxy, H2_HOST, origin.tls_port, sluice_ca, ["h2"]), authority)
    assert warm.proxy_settings().max_concurrent_streams == MAX_STREAMS  # the policy's, not h2's 100
    warm.request(1, 64 * KIB)
    assert warm.read_all(timeout=20) == {1: 64 * KIB}
    warm.close()
    origin.sent_settled(steady=0.5)

    baseline, sent_before = rss_kib(pid) * KIB, origin.sent
    clients = [ZeroWindowClient(tunnel(proxy, H2_HOST, origin.tls_port, sluice_ca, ["h2"]), authority)
               for _ in range(CONNECTIONS)]
    try:
        with RssPeak(pid) as peak:
            for client in clients:
                client.request(STREAMS, BODY)
            sent = origin.sent_settled() - sent_before
        growth = peak.peak * KIB - baseline
        total = CONNECTIONS * STREAMS * BODY
        print(f"\nzero-window h2: {CONNECTIONS}x{STREAMS} streams of {BODY // MIB} MiB; origin sent "
              f"{sent / MIB:.1f} of {total / MIB:.0f} MiB; proxy RSS {baseline / MIB:.0f} MiB, peak "
              f"+{growth / MIB:.1f} MiB (bound {BOUND / MIB:.1f} MiB + {SLACK // MIB} MiB slack)")
        assert growth < BOUND + SLACK, f"proxy RSS grew {growth / MIB:.1f} MiB with the client reading nothing"
        assert sent < total // 2, f"the origin sent {sent / MIB:.1f} MiB: the proxy kept reading it"

        # A stream the client reads is not held back by those it does not
        # read (they share one connection to the origin).
        last = max(clients[1].received)
        with RssPeak(pid) as peak:
            got = clients[1].read_one(last)
        assert got == BODY, f"stream {last} got {got} of {BODY} bytes while its siblings were held"
        assert peak.peak * KIB - baseline < BOUND + SLACK

        # Nothing was lost: opened windows get every stream whole.
        received = clients[0].read_all()
        assert received == {sid: BODY for sid in received}, received
        assert len(clients[0].ended) == STREAMS
    finally:
        for client in clients:
            client.close()
    assert proxy.alive()
    assert "Traceback" not in proxy.stderr_text(), proxy.stderr_text(tail=40)


def _slow_http1(proxy, origin, kind: str, cafile: str, tls_cafile: str) -> socket.socket:
    """One request for SLOW_BODY bytes whose answer is never read."""
    if kind == "plain":
        sock = socket.create_connection(proxy.address, timeout=15)
        sock.sendall(f"GET http://{RAW_HOST}:{origin.plain_port}/big/{SLOW_BODY} HTTP/1.1\r\n"
                     f"Host: {RAW_HOST}:{origin.plain_port}\r\n\r\n".encode())
        return sock
    if kind == "intercepted":
        sock = tunnel(proxy, H2_HOST, origin.tls_port, cafile, ["http/1.1"])
        host = H2_HOST
    else:  # raw: the proxy passes TLS through to the origin, whose CA the client trusts
        sock = tunnel(proxy, RAW_HOST, origin.tls_port, tls_cafile, ["http/1.1"])
        host = RAW_HOST
    sock.sendall(f"GET /big/{SLOW_BODY} HTTP/1.1\r\nHost: {host}:{origin.tls_port}\r\n\r\n".encode())
    return sock


@pytest.mark.parametrize("kind", ["plain", "intercepted", "raw"])
def test_slow_http1_and_raw_readers_are_bounded(proxy, origin, sluice_ca, tls_ca, kind):
    """For comparison: TCP backpressure alone bounds readers that are not h2."""
    pid = proxy.proc.pid
    origin.sent_settled(steady=0.5)
    baseline, sent_before = rss_kib(pid) * KIB, origin.sent
    socks = []
    try:
        with RssPeak(pid) as peak:
            socks = [_slow_http1(proxy, origin, kind, sluice_ca, tls_ca.cafile) for _ in range(SLOW_CONNECTIONS)]
            assert wait_until(lambda: origin.sent > sent_before, 10), "the origin was never asked"
            sent = origin.sent_settled() - sent_before
        growth = peak.peak * KIB - baseline
        total = SLOW_CONNECTIONS * SLOW_BODY
        print(f"\nslow {kind} HTTP/1 reader: {SLOW_CONNECTIONS} x {SLOW_BODY // MIB} MiB; origin sent "
              f"{sent / MIB:.1f} MiB; proxy RSS peak +{growth / MIB:.1f} MiB")
        assert growth < SLOW_CONNECTIONS * 2 * MIB + SLACK, f"proxy RSS grew {growth / MIB:.1f} MiB"
        assert sent < total, f"the origin sent everything ({sent / MIB:.1f} MiB) to a client reading nothing"
    finally:
        for sock in socks:
            sock.close()
    assert proxy.alive()
