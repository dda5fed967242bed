"""Issue 18, items 7-9: what a long-lived connection can keep across the
proxy's own lifecycle (a drain, a reload) and a dial back into the proxy's
own host.

- Drain: a WebSocket pipe is drained like a raw tunnel: it keeps carrying
  bytes for `--drain-timeout`, then is cut with a `shutdown` line (it used
  to be closed at once and logged as allowed).

The origin (tests/harness/vhosts.py) serves a.example on 1.1.1.1 (TLS 8443,
plain 8081) and echoes WebSocket pipes.
"""

from __future__ import annotations

import signal
import socket
import time

import pytest

from harness import default_policy
from harness.vhosts import A, PLAIN_PORT, TLS_PORT, start_vhost_origin
from relkit import wait_until

pytestmark = pytest.mark.netns


@pytest.fixture(scope="module")
def origin(net, tls_ca, fake_dns):
    server = start_vhost_origin(tls_ca, fake_dns)
    yield server
    server.stop()


def vhost_policy(**overrides) -> dict:
    policy = default_policy(ports=[80, 443, PLAIN_PORT, TLS_PORT])
    policy.update(overrides)
    return policy


WS_HEAD = (f"GET http://{A}:{PLAIN_PORT}/ws HTTP/1.1\r\nHost: {A}:{PLAIN_PORT}\r\n"
           "Connection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\n"
           "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n").encode()


def open_ws_pipe(proxy, timeout: float = 10.0) -> socket.socket:
    """A ws:// pipe through the proxy to the echoing origin, 101 read."""
    s = socket.create_connection(proxy.address, timeout=timeout)
    s.sendall(WS_HEAD)
    head = _read_head(s)
    assert head.startswith(b"HTTP/1.1 101"), head
    return s


def _read_head(s: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(4096)
        if not chunk:
            break
        data += chunk
    return data


def echo(s: socket.socket, payload: bytes) -> bytes:
    """Send payload and read its echo (b"" short: the pipe was closed)."""
    s.sendall(payload)
    got = b""
    try:
        while len(got) < len(payload):
            chunk = s.recv(65536)
            if not chunk:
                break
            got += chunk
    except (ConnectionResetError, TimeoutError, socket.timeout):
        pass
    return got


# ---- item 9: drain treats pipes like tunnels ------------------------------------------


def test_a_drain_gives_websocket_pipes_the_drain_timeout_and_a_shutdown_line(sluice_factory, origin):
    drain = 3.0
    proxy = sluice_factory(vhost_policy(), name="drainpipe", extra_args=("--drain-timeout", f"{drain:g}"))
    pipe = open_ws_pipe(proxy)
    try:
        assert echo(pipe, b"before") == b"before"
        started = time.monotonic()
        proxy.proc.send_signal(signal.SIGTERM)
        assert wait_until(lambda: "sluice: stopping:" in proxy.stderr_text(), 10), proxy.stderr_text()
        # Well inside the drain timeout: the pipe still carries bytes, the proxy waits for it.
        time.sleep(0.5)
        assert echo(pipe, b"during") == b"during", "the drain closed the WebSocket pipe at once"
        assert proxy.alive()
        assert proxy.proc.wait(30) == 0
        assert time.monotonic() - started >= drain - 0.5, "the proxy did not wait for the pipe"
        pipe.settimeout(5)
        assert echo(pipe, b"after") == b"", "the pipe outlived the drain"
    finally:
        pipe.close()
    line = proxy.wait_audit(lambda e: e["event"] == "tunnel" and e["port"] == PLAIN_PORT)
    assert (line["decision"], line["reason"]) == ("refuse", "shutdown"), line
    assert line["bytes_out"] == len(b"before") + len(b"during"), line
    err = proxy.stderr_text()
    assert "Traceback" not in err and "(1 cut by shutdown)" in err, err
