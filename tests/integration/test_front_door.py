"""The front door, attacked (issue 8): TLS and HTTP/2 to the proxy, the dial
check, 101 upgrades and HTTP/2 request bodies.

A small origin on 8.8.8.8 (port 9101 plain, 9443 TLS) counts the body bytes
it receives per request and can switch protocols: `Upgrade: websocket` gets a
101 and then an echo of every byte; `/switch` answers 101 unasked. Everything
runs inside the private network namespace; canaries must stay untouched.
"""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from harness import SluiceProcess, default_policy, free_port
from harness.clients import curl
from harness.http import read_request_head
from harness.loops import stop_loop_thread

pytestmark = pytest.mark.netns

ROOT = Path(__file__).resolve().parents[2]
ORIGIN = "8.8.8.8"
PLAIN, TLS, H2 = 9101, 9443, 9444
MIB = 1024 * 1024


class UpgradeOrigin:
    def __init__(self, server_ctx: ssl.SSLContext, h2_ctx: ssl.SSLContext):
        self.server_ctx = server_ctx
        self.h2_ctx = h2_ctx
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.requests: list[dict] = []
        self.piped = 0  # bytes received after a 101

    def start(self) -> UpgradeOrigin:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)
        return self

    async def _start(self):
        self.servers = [
            await asyncio.start_server(self._handle, ORIGIN, PLAIN),
            await asyncio.start_server(self._handle, ORIGIN, TLS, ssl=self.server_ctx),
            await asyncio.start_server(self._handle_h2, ORIGIN, H2, ssl=self.h2_ctx),
        ]

    def stop(self):
        stop_loop_thread(self.loop, self.thread, self.servers)

    def reset(self):
        self.requests.clear()
        self.piped = 0

    async def _handle(self, reader, writer):
        try:
            while True:
                method, target, headers = await read_request_head(reader)
                body = await self._drain(reader, headers)
                self.requests.append({"method": method, "target": target, "headers": headers, "body": body})
                if target == "/endless-head":  # a hostile origin: a response head that never ends
                    writer.write(b"HTTP/1.1 200 OK\r\nX-Endless: ")
                    for _ in range(1024):
                        writer.write(b"a" * 65536)
                        await writer.drain()
                    return
                if headers.get("upgrade", "").lower() == "websocket" or target == "/switch":
                    writer.write(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: " +
                                 (b"websocket" if target != "/switch" else b"foo") +
                                 b"\r\nConnection: Upgrade\r\nSec-WebSocket-Accept: x\r\n\r\n")
                    await writer.drain()
                    while data := await reader.read(65536):
                        self.piped += len(data)
                        writer.write(data)
                        await writer.drain()
                    return
                out = json.dumps({"body": body}).encode()
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                             % len(out) + out)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, OSError, ssl.SSLError, ValueError):
            return
        finally:
            writer.close()

    async def _handle_h2(self, reader, writer):
        """HTTP/2 only (ALPN h2): counts each stream's body bytes as they arrive."""
        import h2.config
        import h2.connection
        import h2.events

        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
        conn.initiate_connection()
        writer.write(conn.data_to_send())
        streams: dict[int, dict] = {}
        try:
            while data := await reader.read(65536):
                for event in conn.receive_data(data):
                    if isinstance(event, h2.events.RequestReceived):
                        headers = {k.decode(): v.decode() for k, v in event.headers}
                        streams[event.stream_id] = {"method": headers[":method"], "target": headers[":path"],
                                                    "headers": headers, "body": 0}
                        self.requests.append(streams[event.stream_id])
                    elif isinstance(event, h2.events.DataReceived):
                        streams[event.stream_id]["body"] += len(event.data)
                        conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                    elif isinstance(event, h2.events.StreamEnded):
                        out = json.dumps({"body": streams[event.stream_id]["body"]}).encode()
                        conn.send_headers(event.stream_id, [(":status", "200"), ("content-length", str(len(out)))])
                        conn.send_data(event.stream_id, out, end_stream=True)
                writer.write(conn.data_to_send())
                await writer.drain()
        except (ConnectionError, OSError, ssl.SSLError, h2.exceptions.H2Error):
            return
        finally:
            writer.close()

    @staticmethod
    async def _drain(reader, headers) -> int:
        total = 0
        if "content-length" in headers:
            n = int(headers["content-length"])
            while total < n:
                chunk = await reader.read(min(65536, n - total))
                if not chunk:
                    break
                total += len(chunk)
        elif "chunked" in headers.get("transfer-encoding", ""):
            while True:
                size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
                if size == 0:
                    await reader.readuntil(b"\r\n")
                    break
                total += len(await reader.readexactly(size))
                await reader.readexactly(2)
        return total


@pytest.fixture(scope="module")
def origin(net, tls_ca, fake_dns):
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls_ca.cert.configure_cert(ctx)
    h2_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls_ca.cert.configure_cert(h2_ctx)
    h2_ctx.set_alpn_protocols(["h2"])
    fake_dns.set("upgrade.example.com", a=[ORIGIN])
    server = UpgradeOrigin(ctx, h2_ctx).start()
    yield server
    server.stop()


@pytest.fixture(autouse=True)
def _clean(origin):
    origin.reset()


def policy(**overrides) -> dict:
    p = default_policy(ports=[80, 443, PLAIN, TLS, H2])
    p["limits"] = {"max_request_bytes": "1MiB", "tunnel_max_bytes": "1MiB", "tunnel_max_seconds": "3s",
                   "request_timeout": "10s"}
    p.update(overrides)
    return p


@pytest.fixture(scope="module")
def proxy(sluice_factory, origin):
    return sluice_factory(policy(), name="frontdoor")


@pytest.fixture(scope="module")
def intercepting(sluice_factory, origin, tls_ca):
    p = policy(intercept=["upgrade.example.com"])
    p["limits"] = {"max_request_bytes": "1MiB", "request_timeout": "10s"}  # no tunnel cap: the request cap must act
    return sluice_factory(p, name="frontdoor-intercept",
                          extra_args=("--set", f"ssl_verify_upstream_trusted_ca={tls_ca.cafile}"))


def sluice_ca(sluice_home: Path) -> str:
    return str(sluice_home / ".sluice" / "ca" / "mitmproxy-ca-cert.pem")


def audit_reasons(proxy, since: int, reason: str, wait: float = 5.0) -> list[dict]:
    deadline = time.time() + wait
    while True:
        found = [e for e in proxy.audit()[since:] if e.get("reason") == reason]
        if found or time.time() > deadline:
            return found
        time.sleep(0.1)


# ------------------------------------------------------------ TLS / HTTP/2 to the proxy


def test_curl_with_an_https_proxy_url_is_refused_and_never_intercepted(proxy, net, sluice_home):
    """With `intercept` empty, TLS to the proxy must not turn on interception:
    the client gets a clear refusal, never a certificate from Sluice's CA."""
    mark = proxy.audit_mark()
    tls_origin = net.origin("8.8.8.8", 443)
    before = tls_origin.connections
    r = curl("--proxy", f"https://127.0.0.1:{proxy.address[1]}", "--proxy-insecure",
             "--cacert", sluice_ca(sluice_home), "https://public.example/", timeout=10)
    assert r.returncode != 0 and r.status == 0, (r.returncode, r.stderr)
    assert tls_origin.connections == before
    lines = audit_reasons(proxy, mark, "client_protocol_refused")
    assert len(lines) == 1 and "plain HTTP" in lines[0]["detail"]


@pytest.mark.parametrize("alpn", [["h2"], ["h2", "http/1.1"], ["http/1.1"], None])
def test_tls_handshake_to_the_proxy_never_completes(proxy, alpn):
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    if alpn:
        ctx.set_alpn_protocols(alpn)
    with socket.create_connection(proxy.address, timeout=10) as raw:
        with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
            with ctx.wrap_socket(raw, server_hostname="proxy") as tls:
                tls.recv(1)  # the handshake itself fails; nothing is ever read


def test_http2_prior_knowledge_on_the_front_door_is_refused(proxy, net):
    preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
    settings = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
    # HEADERS for a CONNECT stream would follow; nothing may get that far.
    before = net.origin("8.8.8.8", 80).connections
    with socket.create_connection(proxy.address, timeout=10) as s:
        s.sendall(preface + settings)
        data = b""
        try:
            while chunk := s.recv(65536):
                data += chunk
        except (ConnectionResetError, TimeoutError):
            pass
    # Never an HTTP/2 SETTINGS frame back (which would mean h2 was spoken).
    assert not (len(data) >= 9 and data[3] == 0x04 and not data.startswith(b"HTTP/")), data[:64]
    assert net.origin("8.8.8.8", 80).connections == before


# ------------------------------------------------------------ the dial check


EVIL_ADDON = '''
from mitmproxy.proxy.server_hooks import ServerConnectionHookData

class RewriteAfterTheGate:
    """Stands for any bug that changes the server address after the gate
    checked it (a shared h2 Server object, a buggy addon, a mitmproxy change)."""
    def server_connect(self, data: ServerConnectionHookData) -> None:
        if data.server.address and data.server.address[1] == 80 and data.server.address[0] == "8.8.8.8":
            data.server.address = (TARGET, 80)

addons = [RewriteAfterTheGate()]
'''


@pytest.mark.parametrize("target", ["169.254.169.254", "10.0.0.1", "canary.internal.test"])
def test_a_dial_the_gate_did_not_approve_is_refused_before_connecting(tmp_path, net, fake_dns, sluice_home,
                                                                      canaries, target):
    """Force a mismatch: an addon running after the gate rewrites the address
    it approved. The dial check refuses it before any SYN (canaries see
    nothing), names never reach the OS resolver, and it is audited."""
    fake_dns.set("canary.internal.test", a=["169.254.169.254"])
    (tmp_path / "policy.yaml").write_text('version: 1\ndns: {nameservers: ["127.0.0.53"], timeout: 2s}\n')
    (tmp_path / "evil.py").write_text(EVIL_ADDON.replace("TARGET", repr(target)))
    audit = tmp_path / "audit.jsonl"
    port = free_port()
    mitmdump = Path(sys.executable).parent / "mitmdump"
    proc = subprocess.Popen(
        [str(mitmdump), "-q", "-s", str(ROOT / "addons" / "sluice_addon.py"), "-s", str(tmp_path / "evil.py"),
         "--listen-host", "127.0.0.1", "-p", str(port), "--set", f"sluice_policy={tmp_path / 'policy.yaml'}",
         "--set", f"sluice_audit_log={audit}", "--set", "onboarding=false",
         "--set", f"confdir={sluice_home / 'mitmdump'}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 20
        with httpx.Client(proxy=f"http://127.0.0.1:{port}", trust_env=False, timeout=10) as c:
            while True:
                try:
                    r = c.get("http://8.8.8.8/")
                    break
                except httpx.ConnectError:
                    assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read()
                    time.sleep(0.2)
            assert r.status_code == 502, r.text
            assert c.get("http://1.1.1.1/").status_code == 200  # untouched dials still work
        lines = [json.loads(line) for line in audit.read_text().splitlines()]
        pins = [e for e in lines if e["reason"] == "pin_mismatch"]
        assert len(pins) == 1 and pins[0]["host"] == target, lines
    finally:
        proc.terminate()
        proc.wait(10)
    canaries.assert_untouched()


# ------------------------------------------------------------ 101 upgrades


def _raw(proxy, request: bytes, timeout: float = 10) -> tuple[socket.socket, bytes]:
    s = socket.create_connection(proxy.address, timeout=timeout)
    s.sendall(request)
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = s.recv(4096)
        if not chunk:
            break
        head += chunk
    return s, head


def _read_until_closed(s: socket.socket) -> None:
    try:
        while s.recv(65536):
            pass
    except OSError:
        pass


def test_an_upgrade_to_anything_but_websocket_is_refused(proxy, origin):
    mark = proxy.audit_mark()
    s, head = _raw(proxy, f"GET http://upgrade.example.com:{PLAIN}/ HTTP/1.1\r\nHost: upgrade.example.com:{PLAIN}\r\n"
                          f"Connection: Upgrade\r\nUpgrade: foo\r\n\r\n".encode())
    s.close()
    assert head.startswith(b"HTTP/1.1 403") and b"upgrade_refused" in head, head
    assert origin.requests == []
    assert len(audit_reasons(proxy, mark, "upgrade_refused")) == 1


def test_an_unasked_101_from_the_origin_is_refused(proxy, origin):
    s, head = _raw(proxy, f"GET http://upgrade.example.com:{PLAIN}/switch HTTP/1.1\r\nHost: "
                          f"upgrade.example.com:{PLAIN}\r\n\r\n".encode())
    try:
        s.sendall(b"x" * 65536)
        time.sleep(0.3)
        rest = b""
        try:
            while chunk := s.recv(65536):
                rest += chunk
        except (ConnectionResetError, TimeoutError):
            pass
    finally:
        s.close()
    assert head.startswith(b"HTTP/1.1 403") and b"upgrade_refused" in head, head
    assert origin.piped == 0 and b"x" not in rest


WS_REQUEST = (f"GET http://upgrade.example.com:{PLAIN}/ws HTTP/1.1\r\nHost: upgrade.example.com:{PLAIN}\r\n"
              "Connection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\n"
              "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n").encode()


def test_a_websocket_pipe_is_capped_and_metered(proxy, origin):
    """300 MiB once crossed a 1 MiB cap through a 101 pipe, audited as 0 bytes."""
    mark = proxy.audit_mark()
    s, head = _raw(proxy, WS_REQUEST)
    assert head.startswith(b"HTTP/1.1 101"), head
    # The origin echoes what it is sent: read it as a client would, so the
    # proxy is never held back writing to us (and our close is not a reset
    # that drops what the proxy has not read yet, as it was on a busy machine).
    echoed = threading.Thread(target=_read_until_closed, args=(s,), daemon=True)
    echoed.start()
    sent = 0
    block = b"w" * 65536
    try:
        while sent < 8 * MIB:
            s.sendall(block)
            sent += len(block)
    except OSError:
        pass  # cut at the cap
    deadline = time.time() + 30
    while time.time() < deadline and not audit_reasons(proxy, mark, "tunnel_too_large", wait=0):
        time.sleep(0.2)
    s.close()
    echoed.join(5)
    assert origin.piped <= MIB
    lines = audit_reasons(proxy, mark, "tunnel_too_large")
    assert len(lines) == 1 and lines[0]["bytes_out"] == MIB, lines


def test_a_websocket_pipe_gets_the_tunnel_time_cap(proxy, origin):
    mark = proxy.audit_mark()
    s, head = _raw(proxy, WS_REQUEST, timeout=15)
    assert head.startswith(b"HTTP/1.1 101"), head
    s.sendall(b"ping")
    echoed = b""
    try:
        while chunk := s.recv(4096):
            echoed += chunk  # the echo, then the close at tunnel_max_seconds
    except (ConnectionResetError, TimeoutError):
        pass
    s.close()
    assert echoed == b"ping"
    lines = audit_reasons(proxy, mark, "tunnel_timeout")
    assert len(lines) == 1 and lines[0]["bytes_out"] == 4 and lines[0]["bytes_in"] == 4


# ------------------------------------------------------------ HTTP/2 bodies


def test_an_http2_upload_without_content_length_is_cut_at_the_cap(intercepting, origin, sluice_home):
    """Inside an intercepted tunnel the client may speak HTTP/2, whose bodies
    need no Content-Length: 5 MiB once reached the origin under a 1 MiB cap."""
    def body():
        for _ in range(80):
            yield b"u" * 65536

    mark = intercepting.audit_mark()
    with httpx.Client(proxy=intercepting.proxy_url, verify=sluice_ca(sluice_home), trust_env=False,
                      timeout=15, http2=True) as c:
        ok = c.get(f"https://upgrade.example.com:{H2}/small")
        assert ok.status_code == 200 and ok.http_version == "HTTP/2"
        try:
            r = c.post(f"https://upgrade.example.com:{H2}/upload", content=body())
            status = r.status_code
        except httpx.HTTPError:
            status = None  # the stream was reset at the cap
    assert status in (None, 413), status
    uploads = [r for r in origin.requests if r["target"] == "/upload"]
    assert uploads and all(r["body"] <= MIB for r in uploads), uploads
    assert len(audit_reasons(intercepting, mark, "request_too_large")) == 1


# ------------------------------------------------------------ naming another host


def test_absolute_form_with_another_host_header_reaches_only_the_url_host(proxy, net):
    """RFC 9112 3.2.2: the proxy replaces the Host header with the URL's host,
    so an origin serving several virtual hosts on one IP sees the one decided on."""
    origin = net.origin("8.8.8.8", 80)
    s, head = _raw(proxy,
                   b"GET http://public.example/fronted HTTP/1.1\r\nHost: other.example\r\nConnection: close\r\n\r\n")
    s.close()
    assert head.startswith(b"HTTP/1.1 200"), head
    seen = [r for r in origin.requests if r.path == "/fronted"]
    assert [r.host for r in seen] == ["public.example"]


def test_a_connect_inside_an_intercepted_tunnel_is_refused(intercepting, origin, sluice_home, net):
    s = socket.create_connection(intercepting.address, timeout=10)
    s.sendall(f"CONNECT upgrade.example.com:{TLS} HTTP/1.1\r\nHost: upgrade.example.com:{TLS}\r\n\r\n".encode())
    assert s.recv(4096).startswith(b"HTTP/1.1 200")
    ctx = ssl.create_default_context(cafile=sluice_ca(sluice_home))
    before = net.origin("1.1.1.1", 80).connections
    with ctx.wrap_socket(s, server_hostname="upgrade.example.com") as tls:
        tls.sendall(b"CONNECT 1.1.1.1:80 HTTP/1.1\r\nHost: 1.1.1.1:80\r\n\r\n")
        head = tls.recv(4096)
    # mitmproxy refuses request forms its transparent HTTP layer does not take
    # (400); the gate refuses any CONNECT that reaches it inside a tunnel (403).
    assert head.startswith((b"HTTP/1.1 400", b"HTTP/1.1 403")), head
    assert net.origin("1.1.1.1", 80).connections == before
    assert origin.requests == []


# ------------------------------------------------------------ refused bodies


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_the_body_of_a_refused_request_is_never_buffered(proxy):
    """A response set before the body (every refusal) is sent once the body
    has arrived: mitmproxy used to hold that whole body in memory first."""
    before = _rss_kib(proxy.proc.pid)
    size = 96 * MIB
    with socket.create_connection(proxy.address, timeout=30) as s:
        s.sendall(b"POST http://169.254.169.254/upload HTTP/1.1\r\nHost: 169.254.169.254\r\n"
                  b"Content-Length: %d\r\n\r\n" % size)
        block = b"\0" * (256 * 1024)
        sent = 0
        try:
            while sent < size:
                s.sendall(block)
                sent += len(block)
        except OSError:
            pass  # answered and closed early is fine too
        head = s.recv(4096)
    assert head.startswith(b"HTTP/1.1 403") and b"address_not_public" in head, head[:200]
    assert _rss_kib(proxy.proc.pid) - before < 24 * 1024


def test_an_origins_endless_response_head_is_cut_with_flat_memory(proxy, origin):
    before = _rss_kib(proxy.proc.pid)
    s, head = _raw(proxy, f"GET http://upgrade.example.com:{PLAIN}/endless-head HTTP/1.1\r\n"
                          f"Host: upgrade.example.com:{PLAIN}\r\n\r\n".encode(), timeout=30)
    s.close()
    assert head.startswith(b"HTTP/1.1 502"), head[:200]
    assert _rss_kib(proxy.proc.pid) - before < 24 * 1024


def test_an_endless_chunk_size_line_is_cut_with_flat_memory(proxy, origin):
    before = _rss_kib(proxy.proc.pid)
    with socket.create_connection(proxy.address, timeout=30) as s:
        s.sendall(f"POST http://upgrade.example.com:{PLAIN}/upload HTTP/1.1\r\nHost: upgrade.example.com:{PLAIN}\r\n"
                  "Transfer-Encoding: chunked\r\n\r\n".encode())
        sent = 0
        try:
            while sent < 64 * MIB:
                s.sendall(b"1" * 65536)  # a chunk-size line that never ends
                sent += 65536
        except OSError:
            pass  # cut
        try:
            s.recv(4096)
        except OSError:
            pass
    assert sent < 64 * MIB  # cut long before the client was done
    assert _rss_kib(proxy.proc.pid) - before < 24 * 1024
    assert not [r for r in origin.requests if r["target"] == "/upload" and r["body"]]


# ------------------------------------------------------------ a dial back to the proxy


class WildcardSluice(SluiceProcess):
    """`sluice proxy --listen 0.0.0.0:PORT`, reached on 127.0.0.1."""

    def __init__(self, *args, port: int, **kwargs):
        super().__init__(*args, **kwargs)
        self._wildcard_port = port

    def command(self) -> list[str]:
        cmd = super().command()
        cmd[cmd.index("--listen") + 1] = f"0.0.0.0:{self._wildcard_port}"
        return cmd

    @property
    def address(self) -> tuple[str, int]:
        return ("127.0.0.1", self._wildcard_port)


def test_a_dial_back_to_a_wildcard_listener_through_the_hosts_own_address_is_refused(
        net, fake_dns, sluice_home, tmp_path):
    """mitmproxy recognises only the exact listen address and loopback as
    itself; listening on 0.0.0.0, the host's other addresses (here 8.8.8.8, a
    'public' address of this namespace) are the proxy too."""
    port = free_port("0.0.0.0")
    proc = WildcardSluice(tmp_path, default_policy(ports=[80, 443, port]), name="wildcard", home=sluice_home, port=port)
    proc.port = port
    proc.start()
    try:
        mark = proc.audit_mark()
        s, head = _raw(proc, f"GET http://8.8.8.8:{port}/loop HTTP/1.1\r\nHost: 8.8.8.8:{port}\r\nConnection: "
                             "close\r\n\r\n".encode())
        s.close()
        # What it is (sluice/own_host.py): a 403 proxy_loop and a refuse line, not a 502.
        assert head.startswith(b"HTTP/1.1 403") and b"Sluice-Reason: proxy_loop" in head, head[:200]
        line = proc.wait_audit(lambda e: e.get("reason") == "proxy_loop", since=mark, what="the proxy_loop line")
        assert line["decision"] == "refuse" and line["status"] == 403, line
        # The proxy never received a connection from itself.
        assert not [e for e in proc.audit()[mark:] if (e.get("client") or "").startswith("8.8.8.8:")]
    finally:
        proc.stop()
