"""The deadline of a tool call, enforced by a watchdog.

A timeout per socket read does not bound a call: an origin that drips one
byte every few seconds satisfies every read and keeps the call alive for as
long as it likes (head, body or chunked alike). So every exchange registers
its sockets here, and one shared watchdog thread shuts them down when the
call's deadline passes. The blocked read then returns at once (EOF), the
client sees `expired` and answers `web_timeout`. The watchdog fires at the
deadline (a loaded machine may make it a little late, never early).

Sockets are registered as duplicates of their file descriptors (taken the
moment they connect): a shutdown through a duplicate can only ever reach the
connection it was taken from, even if the original descriptor has been
closed and its number reused by another call. `release()` closes the
duplicates; it is called when the exchange ends, so the connection closes
then as it would without us.
"""

from __future__ import annotations

import heapq
import itertools
import os
import socket
import threading
import time
from typing import Any

TICK = 1.0  # the watchdog's longest sleep (a new earlier deadline wakes it anyway)


class StreamGuard:
    """The sockets of one exchange, shut down together when its deadline passes."""

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self.expired = False
        self.released = False
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()

    def trace(self, event: str, info: dict[str, Any]) -> None:
        """httpcore's `trace` request extension: catch each new connection."""
        if not event.endswith("connect_tcp.complete"):
            return
        stream = info.get("return_value")
        sock = stream.get_extra_info("socket") if stream is not None else None
        if sock is None:
            return
        try:
            dup = socket.socket(fileno=os.dup(sock.fileno()))
        except OSError:
            return
        with self._lock:
            if self.released:
                dup.close()
                return
            self._socks.append(dup)
            if self.expired:  # connected after the deadline passed: cut it now
                _shut(dup)

    def expire(self) -> None:
        with self._lock:
            if self.released:
                return
            self.expired = True
            for sock in self._socks:
                _shut(sock)

    def release(self) -> None:
        with self._lock:
            self.released = True
            socks, self._socks = self._socks, []
        for sock in socks:
            sock.close()


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class Watchdog:
    """One daemon thread that calls `expire()` on guards whose deadline passed."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, StreamGuard]] = []
        self._count = itertools.count()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def watch(self, guard: StreamGuard) -> None:
        with self._cond:
            heapq.heappush(self._heap, (guard.deadline, next(self._count), guard))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="sluice-web-watchdog", daemon=True)
                self._thread.start()
            self._cond.notify()

    def _run(self) -> None:
        with self._cond:
            while True:
                now = time.monotonic()
                while self._heap and (self._heap[0][0] <= now or self._heap[0][2].released):
                    heapq.heappop(self._heap)[2].expire()
                if self._heap:
                    self._cond.wait(min(TICK, self._heap[0][0] - now))
                elif not self._cond.wait(5.0) and not self._heap:
                    self._thread = None  # idle: the thread ends; the next watch() starts another
                    return


WATCHDOG = Watchdog()
