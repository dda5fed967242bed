"""The origin on 8.8.8.8:80 (inside the namespace): nginx with a config
written into the run's temp dir, serving /1k (1 KiB) and /large (for
tunnels). Without nginx, a small asyncio origin stands in (much slower, which
the report says)."""

from __future__ import annotations

import shutil
import sys
import textwrap
from pathlib import Path

from bench.procs import Proc

HOST = "8.8.8.8"
PORT = 80
SMALL = "/1k"
LARGE = "/large"
SMALL_BYTES = 1024


def _files(root: Path, large_bytes: int) -> Path:
    www = root / "www"
    www.mkdir(mode=0o755, exist_ok=True)
    (www / "1k").write_bytes(b"x" * (SMALL_BYTES - 1) + b"\n")
    with open(www / "large", "wb") as f:  # sparse: no disk, served from the page cache
        f.truncate(large_bytes)
    for p in (root, www, www / "1k", www / "large"):
        p.chmod(0o755 if p.is_dir() else 0o644)  # nginx workers may run as nobody
    return www


def accepted_connections() -> int | None:
    """Connections nginx has accepted so far (its stub_status), or None."""
    import http.client

    conn = http.client.HTTPConnection(HOST, PORT, timeout=5)
    try:
        conn.request("GET", "/nginx_status")
        resp = conn.getresponse()
        body = resp.read().decode("latin-1")
        if resp.status != 200:
            return None
        # "Active connections: N\nserver accepts handled requests\n A H R\n..."
        return int(body.splitlines()[2].split()[0])
    except (OSError, ValueError, IndexError):
        return None
    finally:
        conn.close()


def start(root: Path, large_bytes: int) -> tuple[Proc, str]:
    """Start the origin; returns (process, description). Raises StartError."""
    www = _files(root, large_bytes)
    nginx = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
    if nginx:
        conf = root / "nginx.conf"
        tmp = root / "nginx-tmp"
        tmp.mkdir(exist_ok=True)
        conf.write_text(textwrap.dedent(f"""\
            worker_processes 1;
            daemon off;
            pid {root}/nginx.pid;
            error_log {root}/nginx-error.log warn;
            worker_rlimit_nofile 16384;
            events {{ worker_connections 8192; }}
            http {{
                access_log off;
                client_body_temp_path {tmp}/body;
                proxy_temp_path {tmp}/proxy;
                fastcgi_temp_path {tmp}/fastcgi;
                uwsgi_temp_path {tmp}/uwsgi;
                scgi_temp_path {tmp}/scgi;
                default_type application/octet-stream;
                sendfile on;
                tcp_nopush on;
                keepalive_timeout 120s;
                keepalive_requests 1000000;
                server {{
                    listen {HOST}:{PORT} backlog=4096;
                    server_name _;
                    root {www};
                    location / {{ }}
                    location = /nginx_status {{ stub_status; }}
                }}
            }}
        """))
        proc = Proc("nginx", [nginx, "-p", str(root), "-c", str(conf), "-e", str(root / "nginx-error.log")],
                    root / "nginx.log").start()
        proc.wait_port(HOST, PORT, timeout=10)
        return proc, "nginx (1 worker)"
    proc = Proc("origin-py", [sys.executable, "-m", "bench.origin", str(www)], root / "origin-py.log").start()
    proc.wait_port(HOST, PORT, timeout=10)
    return proc, "asyncio fallback origin (nginx not installed; direct numbers are not nginx's)"


# ---- the fallback origin ---------------------------------------------------

def _serve(www: str) -> None:
    import asyncio

    small = Path(www, "1k").read_bytes()
    large_size = Path(www, "large").stat().st_size
    chunk = b"\0" * (1 << 20)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                target = head.split(b" ", 2)[1].decode("latin-1")
                path = "/" + target.split("://", 1)[1].split("/", 1)[1] if "://" in target else target
                if path == LARGE:
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % large_size)
                    left = large_size
                    while left:
                        n = min(left, len(chunk))
                        writer.write(chunk[:n])
                        await writer.drain()
                        left -= n
                elif path == SMALL:
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(small) + small)
                else:
                    writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, IndexError):
            pass
        finally:
            writer.close()

    async def main() -> None:
        server = await asyncio.start_server(handle, HOST, PORT, backlog=4096)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


if __name__ == "__main__":
    _serve(sys.argv[1])
