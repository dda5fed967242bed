"""CONNECT setups per second: the echo origin and the load generator.

An agent's HTTPS traffic is mostly fresh tunnels, so tunnel setup is a
proxy's hot path. Each of `clients` concurrent loops does, until its time or
count runs out: a new TCP connection to the proxy, `CONNECT host:443`, read
the 200, send a TLS ClientHello (517 bytes, server name = the CONNECT host:
what an HTTPS client sends first, so a proxy that peeks at it sees the real
thing), read the same bytes back from the echo origin, close. With no proxy
(`--direct`), the same without the CONNECT: the load side's own ceiling.

    python -m bench.connects origin HOST PORT
    python -m bench.connects load --proxy IP:PORT --target HOST:PORT [--clients 16]
                                  [--seconds 4] [--max-setups 50000]

`load` prints one JSON line: setups completed within the time, errors (with
a few samples), and latency percentiles of the whole loop (connect to echo
read) and of its first part (connect to the 200). Every socket operation has
a timeout, so a run ends by itself. Targets are only addresses inside the
benchmark's network namespace (the caller checks it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import ssl
import sys
import time

HOST = "8.8.8.8"  # the origin's "public" address inside the namespace (nginx holds :80)
PORT = 443
OP_TIMEOUT = 10.0  # seconds for one whole setup
MAX_SETUPS = 50_000  # per run, whatever the time


def client_hello(server_name: str) -> bytes:
    """The first flight of a real TLS client for server_name."""
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = ssl.create_default_context().wrap_bio(incoming, outgoing, server_hostname=server_name)
    try:
        tls.do_handshake()
    except ssl.SSLWantReadError:
        pass
    hello = outgoing.read()
    if not hello.startswith(b"\x16\x03"):
        raise RuntimeError("could not build a TLS ClientHello")
    return hello


# ---- the origin -------------------------------------------------------------

class _Echo(asyncio.Protocol):
    """Sends back whatever arrives; closes when the peer does."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.transport.write(data)

    def eof_received(self) -> bool:
        self.transport.close()
        return False


def serve(host: str, port: int) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(_Echo, host, port, backlog=4096, reuse_address=True)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


# ---- the load ---------------------------------------------------------------

def _pct(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


async def _recv_until(loop: asyncio.AbstractEventLoop, sock: socket.socket, done, limit: int) -> bytes:
    data = b""
    while not done(data):
        chunk = await loop.sock_recv(sock, 65536)
        if not chunk:
            raise ConnectionError(f"closed after {len(data)} bytes: {data[:80]!r}")
        data += chunk
        if len(data) > limit:
            raise ConnectionError(f"more than {limit} bytes: {data[:80]!r}")
    return data


async def _load(proxy: tuple[str, int], target: str, clients: int, seconds: float, max_setups: int,
                direct: bool) -> dict:
    loop = asyncio.get_running_loop()
    host = target.rsplit(":", 1)[0].strip("[]")
    hello = client_hello(host if not host.replace(".", "").isdigit() else "public.example")
    request = f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode()
    totals: list[float] = []
    to_200: list[float] = []
    errors: list[str] = []
    started = time.perf_counter()
    deadline = started + seconds
    counted = 0

    async def one() -> None:
        nonlocal counted
        t0 = time.perf_counter()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            async with asyncio.timeout(OP_TIMEOUT):
                await loop.sock_connect(sock, proxy)
                if not direct:
                    await loop.sock_sendall(sock, request)
                    head = await _recv_until(loop, sock, lambda d: b"\r\n\r\n" in d, 16384)
                    status = head.split(b"\r\n", 1)[0]
                    if status.split(b" ")[1:2] != [b"200"]:
                        raise ConnectionError(f"CONNECT answered {status.decode('latin-1', 'replace')!r}")
                    if head.index(b"\r\n\r\n") + 4 != len(head):
                        raise ConnectionError("bytes after the CONNECT response")
                t1 = time.perf_counter()
                await loop.sock_sendall(sock, hello)
                echo = await _recv_until(loop, sock, lambda d: len(d) >= len(hello), len(hello))
                if echo != hello:
                    raise ConnectionError("the echo differs from what was sent")
        finally:
            sock.close()
        t2 = time.perf_counter()
        if t2 <= deadline:
            counted += 1
            totals.append(t2 - t0)
            to_200.append(t1 - t0)

    async def worker() -> None:
        while time.perf_counter() < deadline and counted < max_setups:
            try:
                await one()
            except (OSError, TimeoutError, ValueError, IndexError) as e:
                errors.append(f"{type(e).__name__}: {e}"[:200])
                await asyncio.sleep(0.01)  # a refusing proxy must not turn this into a busy loop

    await asyncio.gather(*(worker() for _ in range(clients)))
    elapsed = min(time.perf_counter(), deadline) - started
    totals.sort()
    to_200.sort()
    ms = lambda x: None if x is None else round(x * 1000, 3)  # noqa: E731
    return {
        "setups": counted, "seconds": round(elapsed, 3), "rate": counted / elapsed if elapsed > 0 else 0.0,
        "errors": len(errors), "error_samples": sorted(set(errors))[:5], "clients": clients,
        "payload_bytes": len(hello),
        "p50_ms": ms(_pct(totals, 0.50)), "p99_ms": ms(_pct(totals, 0.99)),
        "to_200_p50_ms": ms(_pct(to_200, 0.50)), "to_200_p99_ms": ms(_pct(to_200, 0.99)),
    }


def _addr(text: str) -> tuple[str, int]:
    host, port = text.rsplit(":", 1)
    return host.strip("[]"), int(port)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.connects")
    sub = p.add_subparsers(dest="command", required=True)
    o = sub.add_parser("origin")
    o.add_argument("host")
    o.add_argument("port", type=int)
    ld = sub.add_parser("load")
    ld.add_argument("--proxy", type=_addr, required=True, help="the proxy (or, with --direct, the origin)")
    ld.add_argument("--target", default=f"public.example:{PORT}", help="what goes into the CONNECT")
    ld.add_argument("--direct", action="store_true", help="no proxy and no CONNECT: the load side's ceiling")
    ld.add_argument("--clients", type=int, default=16)
    ld.add_argument("--seconds", type=float, default=4.0)
    ld.add_argument("--max-setups", type=int, default=MAX_SETUPS)
    args = p.parse_args(argv)
    if args.command == "origin":
        serve(args.host, args.port)
        return 0
    result = asyncio.run(_load(args.proxy, args.target, args.clients, args.seconds, args.max_setups, args.direct))
    print("BENCHJSON " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
