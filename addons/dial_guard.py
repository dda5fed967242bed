"""The dial check: the last word on every upstream TCP connect.

mitmproxy's `ConnectionHandler.open_connection` runs the `server_connect`
hook, then waits for a per-address connection slot, then reads the server
address *again* and calls `asyncio.open_connection` with it. Whatever changed
that address in between (a shared `Server` object, another addon, a future
mitmproxy change) would be dialled unchecked, and `server_connected` fires
only after the TCP handshake, when an internal service has already accepted.

So the connect itself is wrapped: while mitmproxy opens a connection for a
client connection, `asyncio.open_connection` first asks the gate whether that
exact (IP, port) was approved for that client connection. A name is never
approved, so mitmproxy and the OS never resolve one. A refused dial raises
OSError before any packet is sent; mitmproxy reports it as a failed connect.

Patches mitmproxy 12.3.1 (pinned in pyproject.toml); tests/unit/test_dial_guard.py
fails loudly if the patched code changes.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
from collections.abc import Callable

from mitmproxy import connection
from mitmproxy.proxy import server

# The client connection whose handler is dialling (set for the dialling task only).
_dialling_for: contextvars.ContextVar[connection.Client | None] = contextvars.ContextVar("sluice_dialling_for", default=None)
_check: Callable[[connection.Client, str, int], bool] | None = None
_installed = False


class DialRefused(OSError):
    pass


def install(check: Callable[[connection.Client, str, int], bool]) -> None:
    """Route every mitmproxy upstream connect through `check(client, host, port)`."""
    global _check, _installed
    _check = check
    if _installed:
        return
    _installed = True

    original_open_connection = server.ConnectionHandler.open_connection

    @functools.wraps(original_open_connection)
    async def open_connection(self, command):
        token = _dialling_for.set(self.client)
        try:
            return await original_open_connection(self, command)
        finally:
            _dialling_for.reset(token)

    server.ConnectionHandler.open_connection = open_connection

    original_connect = asyncio.open_connection

    @functools.wraps(original_connect)
    async def guarded_open_connection(host=None, port=None, *args, **kwargs):
        client = _dialling_for.get()
        if client is not None and (_check is None or not _check(client, host, port)):
            raise DialRefused(f"pin_mismatch: Sluice refused to dial {host}:{port}, which was not approved for this client connection")
        return await original_connect(host, port, *args, **kwargs)

    asyncio.open_connection = guarded_open_connection
