"""`--listen HOST:PORT` parsing (no mitmproxy import: the workers' supervisor uses it too)."""

from __future__ import annotations


def parse_listen(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"--listen {text!r}: expected HOST:PORT, e.g. 127.0.0.1:8080 or [::1]:8080")
    host = host.strip("[]") or "127.0.0.1"
    return host, int(port)
