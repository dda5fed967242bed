"""Load generators, each bounded in count and time: wrk for request rate and
latency, curl for a tunnelled download, plain sockets for idle tunnels,
bench.connects for CONNECT setups per second, and one-request probes. Targets are only the origin and proxies inside the
benchmark's network namespace."""

from __future__ import annotations

import http.client
import json
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from bench import procs

WRK_SCRIPT = """\
-- Absolute-form requests, as a client configured with an HTTP proxy sends them.
wrk.method = "GET"
wrk.path = "{url}"
wrk.headers["Host"] = "{host}"

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'BENCHJSON {{"requests":%.0f,"duration_us":%.0f,"bytes":%.0f,"connect":%.0f,"read":%.0f,' ..
    '"write":%.0f,"status":%.0f,"timeout":%.0f,"p50_us":%.0f,"p90_us":%.0f,"p99_us":%.0f,' ..
    '"mean_us":%.1f,"max_us":%.0f}}\\n',
    summary.requests, summary.duration, summary.bytes, e.connect, e.read, e.write, e.status,
    e.timeout, latency:percentile(50), latency:percentile(90), latency:percentile(99),
    latency.mean, latency.max))
end
"""


def wrk_script(directory: Path, host: str, url_host: str, path: str) -> Path:
    """A Lua script for wrk that sends `GET http://url_host/path` with Host: host."""
    script = directory / f"wrk-{url_host}.lua"
    script.write_text(WRK_SCRIPT.format(url=f"http://{url_host}{path}", host=host))
    return script


def wrk(target: str, script: Path, *, connections: int, duration: float, threads: int = 1,
        cpus: set[int] | None = None) -> dict:
    """One wrk run against `target` (http://IP:PORT of a proxy or the origin),
    on cpus if given (else where the benchmark runs). Returns wrk's numbers,
    or {"error": ...}."""
    exe = shutil.which("wrk")
    if exe is None:
        return {"error": "wrk not installed"}
    taskset = shutil.which("taskset")
    prefix = [taskset, "-c", ",".join(map(str, sorted(cpus)))] if cpus and taskset else []
    argv = prefix + [exe, "-t", str(threads), "-c", str(connections), "-d", f"{max(1, round(duration))}s",
            "--timeout", "10s", "-s", str(script), target]
    try:
        done = procs.run(argv, timeout=duration + 30)
    except subprocess.TimeoutExpired:
        return {"error": "wrk did not finish in time"}
    for line in done.stdout.splitlines():
        if line.startswith("BENCHJSON "):
            r = json.loads(line[len("BENCHJSON "):])
            secs = r["duration_us"] / 1e6
            r["rps"] = r["requests"] / secs if secs else 0.0
            r["errors"] = r["connect"] + r["read"] + r["write"] + r["status"] + r["timeout"]
            if r["requests"] == 0:
                r["error"] = "no request completed"
            elif r["status"] > 0.01 * r["requests"]:
                r["error"] = f"{r['status']} of {r['requests']} responses were not 2xx/3xx"
            return r
    return {"error": f"wrk exit {done.returncode}: {(done.stderr or done.stdout).strip()[-300:]}"}


def probe(target: tuple[str, int], url_host: str, host: str, path: str, timeout: float = 10.0) -> tuple[int, str]:
    """One absolute-form request to target (a proxy, or the origin); (status, detail)."""
    conn = http.client.HTTPConnection(target[0], target[1], timeout=timeout)
    try:
        conn.request("GET", f"http://{url_host}{path}", headers={"Host": host})
        resp = conn.getresponse()
        body = resp.read()
        detail = resp.getheader("Sluice-Reason") or body[:120].decode("latin-1", "replace").strip()
        return resp.status, detail
    finally:
        conn.close()


def curl_download(proxy: tuple[str, int] | None, connect_host: str, host: str, path: str,
                  expect_bytes: int, timeout: float = 120.0) -> dict:
    """GET http://host/path through a CONNECT tunnel (or directly); MB/s."""
    exe = shutil.which("curl")
    if exe is None:
        return {"error": "curl not installed"}
    argv = [exe, "-sS", "-o", "/dev/null", "--max-time", str(int(timeout)),
            "-w", "%{http_code} %{size_download} %{time_total} %{time_starttransfer}"]
    if proxy is None:
        argv += ["--noproxy", "*", "--resolve", f"{host}:80:{connect_host}"]
        url = f"http://{host}{path}"
    else:
        argv += ["--proxy", f"http://{proxy[0]}:{proxy[1]}", "--proxytunnel"]
        url = f"http://{connect_host}{path}"
        if connect_host != host:
            argv += ["-H", f"Host: {host}"]
    argv.append(url)
    try:
        done = procs.run(argv, timeout=timeout + 10)
    except subprocess.TimeoutExpired:
        return {"error": "curl did not finish in time"}
    try:
        code, size, total, first = done.stdout.split()
        size_i, total_f = int(size), float(total)
    except ValueError:
        return {"error": f"curl exit {done.returncode}: {(done.stderr or done.stdout).strip()[-200:]}"}
    if done.returncode != 0 or code != "200" or size_i != expect_bytes:
        return {"error": f"curl exit {done.returncode}, HTTP {code}, {size_i} of {expect_bytes} bytes: {done.stderr.strip()[-200:]}"}
    return {"bytes": size_i, "seconds": total_f, "ttfb": float(first), "mbps": size_i / total_f / 1e6}


def open_idle_tunnels(proxy: tuple[str, int], connect_to: str, n: int, deadline: float,
                      timeout: float = 10.0) -> tuple[list[socket.socket], str | None]:
    """Open up to n CONNECT tunnels and leave them idle. Returns the sockets
    of the tunnels that opened (the caller closes them) and the first
    failure, if any (which stops the opening)."""
    socks: list[socket.socket] = []
    request = f"CONNECT {connect_to} HTTP/1.1\r\nHost: {connect_to}\r\n\r\n".encode()
    for _ in range(n):
        if time.monotonic() > deadline:
            return socks, f"only {len(socks)} tunnels opened before the time limit"
        s = None
        try:
            s = socket.create_connection(proxy, timeout=timeout)
            s.sendall(request)
            head = b""
            while b"\r\n\r\n" not in head and len(head) < 8192:
                chunk = s.recv(4096)
                if not chunk:
                    break
                head += chunk
        except OSError as e:
            if s is not None:
                s.close()
            return socks, f"tunnel {len(socks) + 1}: {e}"
        status = head.split(b"\r\n", 1)[0]
        if b" 200" not in status:
            s.close()
            return socks, f"tunnel {len(socks) + 1} refused: {status.decode('latin-1', 'replace')!r}"
        socks.append(s)
    return socks, None


def close_all(socks: list[socket.socket]) -> None:
    for s in socks:
        try:
            s.close()
        except OSError:
            pass


def connect_setups(proxy: tuple[str, int], target: str | None, *, clients: int, seconds: float,
                   max_setups: int | None = None) -> dict:
    """One run of bench.connects' load in its own process (on the CPUs this
    process runs on): fresh connection, CONNECT target, echo, close, from
    `clients` concurrent loops for `seconds`. target None: straight to the
    origin at `proxy`, no CONNECT. Returns its numbers, or {"error": ...}."""
    argv = [sys.executable, "-m", "bench.connects", "load", "--proxy", f"{proxy[0]}:{proxy[1]}",
            "--clients", str(clients), "--seconds", str(seconds)]
    argv += ["--direct"] if target is None else ["--target", target]
    if max_setups is not None:
        argv += ["--max-setups", str(max_setups)]
    try:
        done = procs.run(argv, timeout=seconds + 40)
    except subprocess.TimeoutExpired:
        return {"error": "the CONNECT load did not finish in time"}
    for line in done.stdout.splitlines():
        if line.startswith("BENCHJSON "):
            r = json.loads(line[len("BENCHJSON "):])
            if r["setups"] == 0:
                r["error"] = "no setup completed" + (f": {r['error_samples'][0]}" if r["error_samples"] else "")
            elif r["errors"] > 0.01 * (r["setups"] + r["errors"]):
                r["error"] = f"{r['errors']} failed setups against {r['setups']}: {r['error_samples'][:2]}"
            return r
    return {"error": f"CONNECT load exit {done.returncode}: {(done.stderr or done.stdout).strip()[-300:]}"}
