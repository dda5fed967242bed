"""The admin listener and the graceful drain, with real scrapes.

Every metric the README lists moves when its event happens; `--workers 2`
serves one endpoint summing both workers; /readyz before ready, when ready
and while draining; SIGTERM lets a slow transfer finish within
--drain-timeout and cuts one past it with a `shutdown` audit line; a second
SIGTERM stops at once; `--admin off`; an admin address that clashes is a
start-up error (exit 2).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from harness import absolute_form, connect, default_policy
from harness.sluice import free_port, sluice_executable
from harness.wait import wait_until

pytestmark = pytest.mark.netns

ORIGIN_IP = "8.8.8.8"
BODY_HALF = 1000


# ---- helpers -------------------------------------------------------------------


def get(url: str, timeout: float = 5) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url), timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def scrape(proxy) -> list:
    status, text = get(f"{proxy.admin_url}/metrics")
    assert status == 200
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def value(samples, name: str, **labels) -> float:
    """The sum of every sample of `name` whose labels include `labels`."""
    return sum(s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))



def wait_metric(proxy, name: str, at_least: float, **labels) -> list:
    holder = {}

    def check():
        holder["samples"] = scrape(proxy)
        return value(holder["samples"], name, **labels) >= at_least

    wait_until(check, 10, what=f"{name}{labels} >= {at_least}")
    return holder["samples"]


class HoldingOrigin:
    """An origin on 8.8.8.8 whose /hold response sends half its body, then
    waits for `release` before the rest: a transfer in flight for as long as
    the test wants."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((ORIGIN_IP, 0))
        self.port = self.sock.getsockname()[1]
        self.sock.listen(16)
        self.started = threading.Semaphore(0)
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            try:
                head = b""
                while b"\r\n\r\n" not in head:
                    chunk = conn.recv(4096)
                    if not chunk:
                        return
                    head += chunk
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % (2 * BODY_HALF)
                             + b"a" * BODY_HALF)
                self.started.release()
                self.release.wait(60)
                conn.sendall(b"b" * BODY_HALF)
            except OSError:
                return

    def close(self) -> None:
        self.release.set()
        self.sock.close()


class HeldTransfer:
    """A GET of the holding origin through the proxy, read in a thread."""

    def __init__(self, proxy, origin: HoldingOrigin) -> None:
        self.data = b""
        self.done = threading.Event()
        url = f"http://public.example:{origin.port}/hold"
        self.sock = socket.create_connection(proxy.address, timeout=60)
        self.sock.sendall(f"GET {url} HTTP/1.1\r\nHost: public.example:{origin.port}\r\nConnection: "
                          "close\r\n\r\n".encode())
        threading.Thread(target=self._read, daemon=True).start()
        assert origin.started.acquire(timeout=10), "the origin never got the request"

    def _read(self) -> None:
        try:
            while chunk := self.sock.recv(65536):
                self.data += chunk
        except OSError:
            pass
        finally:
            self.done.set()

    @property
    def body(self) -> bytes:
        return self.data.split(b"\r\n\r\n", 1)[1] if b"\r\n\r\n" in self.data else b""


@pytest.fixture
def origin(net):
    o = HoldingOrigin()
    yield o
    o.close()


def refused(address: tuple[str, int]) -> bool:
    try:
        socket.create_connection(address, timeout=2).close()
    except OSError:
        return True
    return False


# ---- the metrics ---------------------------------------------------------------


@pytest.fixture(scope="module")
def proxy(sluice_factory, fake_dns):
    fake_dns.set("metrics-a.example", a=["8.8.8.8"], ttl=300)
    policy = default_policy(limits={"max_response_bytes": "4KiB"},
                            clients=[{"name": "agents", "sources": ["127.0.0.1/32"]}])
    return sluice_factory(policy, name="admin", extra_args=("--set", "sluice_policy_poll=0"))


def test_health_ready_and_policy(proxy):
    assert get(f"{proxy.admin_url}/healthz") == (200, "ok\n")
    assert get(f"{proxy.admin_url}/readyz") == (200, "ready\n")
    status, text = get(f"{proxy.admin_url}/policy")
    info = json.loads(text)
    assert status == 200
    assert info["path"] == str(proxy.policy_file)
    assert info["sha256"] == hashlib.sha256(proxy.policy_file.read_bytes()).hexdigest()
    assert info["generation"] == 1 and info["loaded_at"].endswith("Z") and info["last_reload"] is None
    assert get(f"{proxy.admin_url}/nothing")[0] == 404
    samples = scrape(proxy)
    assert value(samples, "sluice_policy_info", sha256=info["sha256"]) == 1
    assert value(samples, "process_cpu_seconds_total") > 0
    assert value(samples, "process_resident_memory_bytes") > 0


def test_requests_bytes_dns_latency_and_connects_move(proxy, fake_dns):
    before = scrape(proxy)
    allow = dict(event="request", decision="allow", reason="", profile="agents")
    r = absolute_form(proxy.address, "http://metrics-a.example/first")
    assert r.status == 200
    after = wait_metric(proxy, "sluice_requests_total", value(before, "sluice_requests_total", **allow) + 1, **allow)
    for name, labels in [("sluice_dns_cache_misses_total", {}), ("sluice_dns_lookup_seconds_count", {"result": "ok"}),
                         ("sluice_decision_seconds_count", {}), ("sluice_upstream_connect_seconds_count", {})]:
        assert value(after, name, **labels) >= value(before, name, **labels) + 1, name
    assert value(after, "sluice_received_bytes_total", profile="agents") >= \
        value(before, "sluice_received_bytes_total", profile="agents") + len(r.body)
    # The same name again: from the cache.
    assert absolute_form(proxy.address, "http://metrics-a.example/second").status == 200
    again = wait_metric(proxy, "sluice_requests_total", value(after, "sluice_requests_total", **allow) + 1, **allow)
    assert value(again, "sluice_dns_cache_hits_total") >= value(after, "sluice_dns_cache_hits_total") + 1
    # Bytes from the client: a request body.
    raw = (b"POST http://public.example/upload HTTP/1.1\r\nHost: public.example\r\nContent-Length: 321\r\n"
           b"Connection: close\r\n\r\n" + b"x" * 321)
    with socket.create_connection(proxy.address, timeout=10) as s:
        s.sendall(raw)
        while s.recv(65536):
            pass
    wait_metric(proxy, "sluice_sent_bytes_total", value(again, "sluice_sent_bytes_total", profile="agents") + 321,
                profile="agents")


def test_refusals_and_caps_move(proxy):
    before = scrape(proxy)
    refuse = dict(event="request", decision="refuse", reason="address_not_public", profile="agents")
    assert absolute_form(proxy.address, "http://10.0.0.1/").sluice_reason == "address_not_public"
    wait_metric(proxy, "sluice_requests_total", value(before, "sluice_requests_total", **refuse) + 1, **refuse)
    # The 4 KiB response cap.
    r = absolute_form(proxy.address, "http://public.example/bytes/10000")
    assert r.status == 502 or r.status is None or len(r.body) < 10000
    after = wait_metric(proxy, "sluice_caps_tripped_total",
                        value(before, "sluice_caps_tripped_total", kind="response_too_large") + 1,
                        kind="response_too_large")
    assert value(after, "sluice_requests_total", reason="response_too_large", decision="refuse") >= 1


def test_tunnels_and_open_connections_move(proxy):
    before = scrape(proxy)
    response, tunnel = connect(proxy.address, "public.example:80")
    assert response.status == 200
    try:
        assert tunnel.request("public.example", "/inside").status == 200
        open_now = wait_metric(proxy, "sluice_open_tunnels", 1)
        assert value(open_now, "sluice_open_client_connections") >= 1
    finally:
        tunnel.close()
    closed = dict(decision="allow", reason="", profile="agents")
    after = wait_metric(proxy, "sluice_tunnels_total", value(before, "sluice_tunnels_total", **closed) + 1, **closed)
    assert value(after, "sluice_received_bytes_total") > value(before, "sluice_received_bytes_total")
    wait_until(lambda: value(scrape(proxy), "sluice_open_tunnels") == 0, 10, what="the open tunnel gauge back to 0")


def test_reloads_move_and_policy_says_so(proxy):
    before = scrape(proxy)
    old = hashlib.sha256(proxy.policy_file.read_bytes()).hexdigest()
    policy = yaml.safe_load(proxy.policy_file.read_text())
    policy["deny"] = ["denied.example"]
    proxy.policy_file.write_text(yaml.safe_dump(policy))
    new = hashlib.sha256(proxy.policy_file.read_bytes()).hexdigest()
    proxy.proc.send_signal(signal.SIGHUP)
    after = wait_metric(proxy, "sluice_policy_reloads_total",
                        value(before, "sluice_policy_reloads_total", result="ok") + 1, result="ok")
    assert value(after, "sluice_policy_info", sha256=new) == 1
    assert not [s for s in after if s.name == "sluice_policy_info" and s.labels["sha256"] == old]
    info = json.loads(get(f"{proxy.admin_url}/policy")[1])
    assert info["sha256"] == new and info["generation"] == 2 and info["last_reload"]["result"] == "ok"

    good = proxy.policy_file.read_text()
    proxy.policy_file.write_text("version: 1\nports: [80, 'x']\n")
    proxy.proc.send_signal(signal.SIGHUP)
    wait_metric(proxy, "sluice_policy_reloads_total", value(before, "sluice_policy_reloads_total", result="failed") + 1,
                result="failed")
    info = json.loads(get(f"{proxy.admin_url}/policy")[1])
    assert info["sha256"] == new and info["last_reload"]["result"] == "failed"
    assert "ports" not in json.dumps(info)  # no problem text, no content
    proxy.policy_file.write_text(good)


# ---- readiness and the drain ---------------------------------------------------


def drain_policy(origin) -> dict:
    return default_policy(ports=[80, 443, origin.port])


def test_drain_lets_a_slow_transfer_finish(sluice_factory, origin):
    proxy = sluice_factory(drain_policy(origin), name="drain", extra_args=("--drain-timeout", "60"))
    assert get(f"{proxy.admin_url}/readyz") == (200, "ready\n")
    transfer = HeldTransfer(proxy, origin)
    proxy.proc.send_signal(signal.SIGTERM)
    wait_until(lambda: get(f"{proxy.admin_url}/readyz") == (503, "draining\n"), 10, what="/readyz saying draining")
    wait_until(lambda: refused(proxy.address), 10, what="the proxy port refusing new connections")
    assert proxy.alive()  # still draining: the transfer is in flight
    origin.release.set()
    assert transfer.done.wait(15)
    assert transfer.body == b"a" * BODY_HALF + b"b" * BODY_HALF
    assert proxy.proc.wait(15) == 0
    line = proxy.wait_audit(lambda e: e["event"] == "request" and e["host"] == "public.example")
    assert line["decision"] == "allow" and line["reason"] is None and line["bytes_in"] == 2 * BODY_HALF
    err = proxy.stderr_text()
    assert "Traceback" not in err
    assert err.count("sluice: stopping:") == 1 and err.count("sluice: stopped after") == 1
    assert "(0 cut by shutdown)" in err


def test_drain_cuts_what_outlives_the_timeout(sluice_factory, origin):
    proxy = sluice_factory(drain_policy(origin), name="cut", extra_args=("--drain-timeout", "1"))
    transfer = HeldTransfer(proxy, origin)
    response, tunnel = connect(proxy.address, "public.example:80")
    assert response.status == 200
    try:
        proxy.proc.send_signal(signal.SIGTERM)
        assert proxy.proc.wait(30) == 0
        assert transfer.done.wait(10)
        assert transfer.body == b"a" * BODY_HALF  # cut mid-body
        request = proxy.wait_audit(lambda e: e["event"] == "request" and e["port"] == origin.port)
        assert (request["decision"], request["reason"]) == ("refuse", "shutdown")
        assert "drain timeout 1s" in request["detail"]
        line = proxy.wait_audit(lambda e: e["event"] == "tunnel")
        assert (line["decision"], line["reason"]) == ("refuse", "shutdown")
        err = proxy.stderr_text()
        assert "Traceback" not in err and "(2 cut by shutdown)" in err
    finally:
        tunnel.close()


def test_a_second_sigterm_stops_at_once(sluice_factory, origin):
    proxy = sluice_factory(drain_policy(origin), name="twice", extra_args=("--drain-timeout", "300"))
    transfer = HeldTransfer(proxy, origin)
    proxy.proc.send_signal(signal.SIGTERM)
    wait_until(lambda: get(f"{proxy.admin_url}/readyz")[0] == 503, 10, what="the drain to begin")
    proxy.proc.send_signal(signal.SIGTERM)
    assert proxy.proc.wait(30) == 0  # far less than the 300 s drain
    assert transfer.done.wait(10)
    line = proxy.wait_audit(lambda e: e["event"] == "request" and e["port"] == origin.port)
    assert line["reason"] == "shutdown"
    assert "Traceback" not in proxy.stderr_text()


def test_readyz_turns_ready_once_and_stays(tmp_path, net):
    """The admin port answers from before the listeners are up: /healthz 200
    throughout, /readyz 503 until ready, then 200 (never back to 503 until a
    drain). (Status's unit tests check the 503 before `running` directly.)"""
    admin, listen = free_port(), free_port()
    policy = tmp_path / "p.yaml"
    policy.write_text(yaml.safe_dump(default_policy()))
    proc = subprocess.Popen([sluice_executable(), "proxy", "--policy", str(policy), "--listen", f"127.0.0.1:{listen}",
                             "--admin", f"127.0.0.1:{admin}", "--audit-log", str(tmp_path / "a.jsonl"),
                             "--ca-dir", str(tmp_path / "ca")], stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    seen: list[int] = []
    try:
        ready_line = threading.Event()
        threading.Thread(target=lambda: [ready_line.set() for line in proc.stderr if line.startswith("sluice: ready")],
                         daemon=True).start()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and proc.poll() is None and (not seen or seen[-1] != 200 or len(seen) < 5):
            try:
                seen.append(get(f"http://127.0.0.1:{admin}/readyz", timeout=2)[0])
                assert get(f"http://127.0.0.1:{admin}/healthz", timeout=2) == (200, "ok\n")
            except OSError:
                pass
            time.sleep(0.01)
        assert seen and seen[-1] == 200 and ready_line.wait(10)
        first = seen.index(200)
        assert set(seen[:first]) <= {503} and set(seen[first:]) == {200}
    finally:
        proc.terminate()
        assert proc.wait(20) == 0


# ---- --admin off and clashes -----------------------------------------------------


def test_admin_off(sluice_factory):
    proxy = sluice_factory(default_policy(), name="noadmin", extra_args=("--admin", "off"))
    assert "--admin" in proxy.command() and "off" in proxy.command()
    assert refused(("127.0.0.1", 9090)) and refused(("127.0.0.1", proxy.admin_port))
    assert absolute_form(proxy.address, "http://public.example/").status == 200


def run_proxy(tmp_path, *args: str) -> subprocess.CompletedProcess:
    policy = tmp_path / "p.yaml"
    policy.write_text(yaml.safe_dump(default_policy()))
    return subprocess.run([sluice_executable(), "proxy", "--policy", str(policy), "--audit-log",
                           str(tmp_path / "a.jsonl"),
                           "--ca-dir", str(tmp_path / "ca"), *args],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)


@pytest.mark.parametrize("workers", [(), ("--workers", "2")])
def test_admin_on_a_proxy_port_is_refused(tmp_path, workers):
    port = free_port()
    result = run_proxy(tmp_path, "--listen", f"127.0.0.1:{port}", "--admin", f"0.0.0.0:{port}", *workers)
    assert result.returncode == 2
    assert result.stderr == (f"sluice: --admin 0.0.0.0:{port} is a proxy listening address; the admin endpoint needs "
                             "its own port: choose another with --admin HOST:PORT, or --admin off\n")
    socks = free_port()
    result = run_proxy(tmp_path, "--listen", f"127.0.0.1:{port}", "--mode", "regular", "--mode", f"socks5@{socks}",
                       "--admin", f"127.0.0.1:{socks}", *workers)
    assert result.returncode == 2 and "is a proxy listening address" in result.stderr


@pytest.mark.parametrize("workers", [(), ("--workers", "2")])
def test_admin_port_in_use_is_a_start_up_error(tmp_path, workers):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = run_proxy(tmp_path, "--listen", f"127.0.0.1:{free_port()}", "--admin", f"127.0.0.1:{port}", *workers)
    assert result.returncode == 2
    assert result.stderr == (f"sluice: the admin address 127.0.0.1:{port} is already in use (another process is "
                             "listening there); choose another address with --admin HOST:PORT, or --admin off\n")


def test_bad_admin_and_drain_values(tmp_path):
    result = run_proxy(tmp_path, "--listen", "127.0.0.1:0", "--admin", "nowhere")
    assert result.returncode == 2 and result.stderr.startswith("sluice: --admin 'nowhere': expected HOST:PORT")
    result = run_proxy(tmp_path, "--listen", "127.0.0.1:0", "--drain-timeout", "-1")
    assert result.returncode == 2 and "--drain-timeout" in result.stderr


# ---- --workers 2: one endpoint for both ---------------------------------------------


def socket_inodes(pid: int) -> set[str]:
    out = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out.add(target[8:-1])
    return out


def worker_of(local_port: int, workers: list[int]) -> int | None:
    """Which worker holds the proxy side of the client connection from local_port."""
    with open("/proc/net/tcp") as f:
        rows = [line.split() for line in f.readlines()[1:]]
    inodes = {row[9] for row in rows if int(row[2].split(":")[1], 16) == local_port}
    for pid in workers:
        if inodes & socket_inodes(pid):
            return pid
    return None


def test_workers_serve_one_aggregated_endpoint(sluice_factory, origin):
    from test_workers import children_of

    proxy = sluice_factory(drain_policy(origin), name="w2",
                           extra_args=("--workers", "2", "--set", "sluice_policy_poll=0"))
    workers = children_of(proxy.proc.pid)
    assert len(workers) == 2
    for pid in workers:  # the supervisor alone serves the admin endpoint
        assert open(f"/proc/{pid}/cmdline").read().split("\0")[-3:-1] == ["--admin", "off"]
    assert get(f"{proxy.admin_url}/readyz") == (200, "ready\n")
    info = json.loads(get(f"{proxy.admin_url}/policy")[1])
    assert info["consistent"] and info["sha256"] == hashlib.sha256(proxy.policy_file.read_bytes()).hexdigest()
    assert sorted(w["pid"] for w in info["workers"]) == sorted(workers)

    # Keep-alive connections, each with one request, until both workers hold some.
    held, owners = [], set()
    while len(owners) < 2:
        assert len(held) < 64, "the kernel never gave the second worker a connection"
        s = socket.create_connection(proxy.address, timeout=10)
        s.sendall(b"GET http://public.example/w HTTP/1.1\r\nHost: public.example\r\n\r\n")
        data = b""
        while b"origin ok" not in data:
            data += s.recv(65536)
        held.append(s)
        owners.add(worker_of(s.getsockname()[1], workers))
    try:
        samples = wait_metric(proxy, "sluice_requests_total", len(held), decision="allow", event="request")
        assert value(samples, "sluice_requests_total", decision="allow", event="request") == len(held)
        wait_until(lambda: value(scrape(proxy), "sluice_open_client_connections") == len(held), 10,
                   what="open connections summed")
        assert value(samples, "process_resident_memory_bytes") > 0
        assert value(samples, "sluice_policy_info", sha256=info["sha256"]) == 1
    finally:
        for s in held:
            s.close()

    # The drain reaches every worker; one stopping line, one stopped line, exit 0.
    transfer = HeldTransfer(proxy, origin)
    proxy.proc.send_signal(signal.SIGTERM)
    wait_until(lambda: get(f"{proxy.admin_url}/readyz") == (503, "draining\n"), 10, what="/readyz draining")
    origin.release.set()
    assert transfer.done.wait(15) and transfer.body == b"a" * BODY_HALF + b"b" * BODY_HALF
    assert proxy.proc.wait(30) == 0
    err = proxy.stderr_text()
    assert err.count("sluice: stopping:") == 1 and err.count("sluice: stopped after") == 1 and "Traceback" not in err
