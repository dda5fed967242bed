"""What the test origins share: reading one HTTP/1 request head."""

from __future__ import annotations

import asyncio


async def read_request_head(reader: asyncio.StreamReader) -> tuple[str, str, dict[str, str]]:
    """(method, target, headers with lower-case names) of the next request.

    Raises asyncio.IncompleteReadError at EOF and ValueError on a request line
    that is not three fields, as the origins' own parsing did."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    method, target, _ = lines[0].split(" ")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    return method, target, headers
