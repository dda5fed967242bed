"""The watchdog of webtools.deadline on local socket pairs (no network):
a read blocked on a silent peer returns when the deadline passes, and a
guard released in time never touches its socket (nor a later one that got
the same descriptor number)."""

from __future__ import annotations

import socket
import time
from types import SimpleNamespace

from sluice.webtools.deadline import WATCHDOG, StreamGuard


def connected(guard: StreamGuard, sock: socket.socket) -> None:
    """What httpcore's trace extension reports when a connection is made."""
    stream = SimpleNamespace(get_extra_info=lambda name: sock if name == "socket" else None)
    guard.trace("connection.connect_tcp.complete", {"return_value": stream})


def test_a_blocked_read_returns_at_the_deadline():
    ours, peer = socket.socketpair()
    with ours, peer:
        ours.settimeout(30)  # a per-read timeout far past the deadline: only the watchdog can end the read
        guard = StreamGuard(time.monotonic() + 0.5)
        connected(guard, ours)
        WATCHDOG.watch(guard)
        started = time.monotonic()
        assert ours.recv(1) == b""  # EOF: shut down under the read
        took = time.monotonic() - started
        guard.release()
    assert guard.expired and 0.3 < took < 5.0, took


def test_a_connection_made_after_the_deadline_is_cut_at_once():
    ours, peer = socket.socketpair()
    with ours, peer:
        ours.settimeout(30)
        guard = StreamGuard(time.monotonic() - 1)
        guard.expire()
        connected(guard, ours)
        assert ours.recv(1) == b""
        guard.release()


def test_a_released_guard_leaves_its_socket_and_descriptor_alone():
    first, first_peer = socket.socketpair()
    guard = StreamGuard(time.monotonic() + 0.3)
    connected(guard, first)
    WATCHDOG.watch(guard)
    guard.release()
    fd = first.fileno()
    first.close()
    first_peer.close()
    # A new socket likely gets the freed number; the watchdog must not reach it.
    second, second_peer = socket.socketpair()
    with second, second_peer:
        time.sleep(0.8)
        second_peer.sendall(b"x")
        second.settimeout(5)
        assert second.recv(1) == b"x"
        second.sendall(b"y")
        assert second_peer.recv(1) == b"y"
    assert not guard.expired and fd >= 0


def test_ignores_other_trace_events():
    guard = StreamGuard(time.monotonic() + 10)
    guard.trace("http11.send_request_headers.started", {"request": None})
    guard.trace("connection.connect_tcp.complete", {"return_value": None})
    guard.release()
    assert not guard.expired
