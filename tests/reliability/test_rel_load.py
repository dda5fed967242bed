"""Load: many mixed allowed/refused requests from 64 concurrent clients.

Every response must be exactly what the policy says (status, Sluice-Reason,
and for allowed requests the origin's own body), nothing may error, every
decision must have its audit line, and afterwards the proxy's open file
descriptors and memory must be back near where they started.

Default: 20,000 requests after a 1,000-request warm-up; SLUICE_LONG=1: 60,000.
"""

from __future__ import annotations

import itertools
import json
import random
import ssl
import threading
import time
from collections import Counter
from dataclasses import dataclass

import pytest

from harness import default_policy
from harness.clients import _Reader, read_response
from relkit import (KeepAlive, connect_tunnel, cpu_seconds, fd_targets, get, quiet_fds, rss_kib, scaled, settle_fds,
                    wait_until)

pytestmark = pytest.mark.netns

CLIENTS = 64
TOTAL = scaled(20_000, 60_000)
WARMUP = 1_000
# Seconds one phase may take at most (the run fails, not hangs, past it).
PHASE_DEADLINE = scaled(240, 600)

# After the clients close, the proxy's fd count must come back to within this
# of the baseline (taken after the warm-up, idle) within FD_SETTLE seconds.
# Idle, the proxy holds ~8-10 fds (listener, epoll, pipes, the audit file);
# every client and upstream connection is one more, so +10 catches any
# leak of more than a handful of sockets out of thousands of connections.
FD_TOLERANCE = 10
FD_SETTLE = 15.0
# Memory, measured on 2 cores: RSS ~90 MiB idle; after the warm-up it grows
# by 0.7-2.8 MiB over 20,000 requests (3.7 MiB over 60,000), and by 0-1.4
# MiB over the second half. Python's allocator keeps what it once used, so a
# bound on the second half is the leak detector: 12 MiB over 10,000 requests
# catches anything that keeps more than ~1.2 KiB per request (a retained flow
# is several KiB); the total bound leaves room for arenas and caches.
RSS_GROWTH_TOTAL_KIB = 32 * 1024  # baseline (after warm-up) -> end
RSS_GROWTH_PHASE_KIB = 12 * 1024  # first half -> second half (steady growth = a leak)

PRIVATE_ANSWER = "private-answer.load.rel.example"
METADATA_ANSWER = "metadata-answer.load.rel.example"
CNAME_INTERNAL = "cname-internal.load.rel.example"
NX_NAME = "nx.load.rel.example"


@dataclass(frozen=True)
class Kind:
    name: str
    weight: int
    way: str  # "http" (keep-alive connection), "origin" (origin-form, keep-alive), "connect", "tls"
    target: str  # URL (with {i}) or CONNECT authority
    status: int
    reason: str | None = None
    origin: tuple[str, int] | None = None  # the listener an allowed request reaches
    host: str | None = None  # Host header the origin must see


KINDS = [
    # allowed
    Kind("name", 24, "http", "http://public.example/load/{i}", 200, origin=("8.8.8.8", 80), host="public.example"),
    Kind("name-one", 6, "http", "http://one.example/load/{i}", 200, origin=("1.1.1.1", 80), host="one.example"),
    Kind("ip-literal", 5, "http", "http://8.8.8.8/load/{i}", 200, origin=("8.8.8.8", 80), host="8.8.8.8"),
    Kind("v6", 3, "http", "http://v6.example/load/{i}", 200, origin=("2606:4700:4700::1111", 80), host="v6.example"),
    Kind("origin-form", 5, "origin", "public.example", 200, origin=("8.8.8.8", 80), host="public.example"),
    Kind("connect", 6, "connect", "public.example:80", 200, origin=("8.8.8.8", 80), host="public.example"),
    Kind("connect-tls", 1, "tls", "public.example:443", 200, origin=("8.8.8.8", 443), host="public.example"),
    # refused literals
    Kind("metadata-ip", 8, "http", "http://169.254.169.254/latest/meta-data/{i}", 403, "address_not_public"),
    Kind("private-ip", 8, "http", "http://10.0.0.1/{i}", 403, "address_not_public"),
    Kind("loopback-spelled", 3, "http", "http://0x7f.1/{i}", 403, "address_not_public"),
    Kind("alibaba-metadata", 2, "http", "http://100.100.100.200/{i}", 403, "address_not_public"),
    Kind("v6-metadata", 2, "http", "http://[fd00:ec2::254]/{i}", 403, "address_not_public"),
    # internal names
    Kind("internal-name", 5, "http", "http://metadata.google.internal/{i}", 403, "internal_hostname"),
    Kind("localhost", 2, "http", "http://localhost/{i}", 403, "internal_hostname"),
    Kind("k8s", 2, "http", "http://kubernetes.default.svc/{i}", 403, "internal_hostname"),
    # names whose DNS answer is private
    Kind("private-answer", 5, "http", f"http://{PRIVATE_ANSWER}/{{i}}", 403, "dns_answer_not_public"),
    Kind("metadata-answer", 2, "http", f"http://{METADATA_ANSWER}/{{i}}", 403, "dns_answer_not_public"),
    Kind("cname-internal", 2, "http", f"http://{CNAME_INTERNAL}/{{i}}", 403, "dns_answer_not_public"),
    # other refusals
    Kind("port", 2, "http", "http://public.example:8080/{i}", 403, "port_not_allowed"),
    Kind("nxdomain", 2, "http", f"http://{NX_NAME}/{{i}}", 502, "dns_failed"),
    # refused CONNECTs
    Kind("connect-metadata", 3, "connect", "169.254.169.254:443", 403, "address_not_public"),
    Kind("connect-private", 2, "connect", "10.0.0.1:443", 403, "address_not_public"),
    Kind("connect-internal", 2, "connect", "metadata.google.internal:443", 403, "internal_hostname"),
    Kind("connect-answer", 2, "connect", f"{PRIVATE_ANSWER}:443", 403, "dns_answer_not_public"),
    Kind("connect-port", 1, "connect", "public.example:8080", 403, "port_not_allowed"),
]


@pytest.fixture(scope="module")
def load_proxy(sluice_factory, fake_dns):
    fake_dns.set(PRIVATE_ANSWER, a=["10.0.0.1"], ttl=300)
    fake_dns.set(METADATA_ANSWER, a=["169.254.169.254"], aaaa=["fd00:ec2::254"], ttl=300)
    fake_dns.set_cname(CNAME_INTERNAL, "foo.localhost", ttl=300)
    return sluice_factory(default_policy(), name="load")


@dataclass
class Tally:
    done: int = 0
    by_kind: Counter = None
    wrong: list = None
    errors: list = None
    wrong_count: int = 0
    error_count: int = 0

    def __post_init__(self):
        self.by_kind = Counter()
        self.wrong, self.errors = [], []


class Load:
    """Runs `total` requests of the mix on `clients` threads, bounded in time."""

    def __init__(self, proxy, cafile: str, total: int, seed: int):
        self.proxy = proxy
        self.address = proxy.address
        self.total = total
        rng = random.Random(seed)
        self.plan = rng.choices(KINDS, weights=[k.weight for k in KINDS], k=total)
        self.next = itertools.count()
        self.lock = threading.Lock()
        self.tally = Tally()
        self.tls_ctx = ssl.create_default_context(cafile=cafile)
        self.reconnects = 0

    def run(self, clients: int, deadline_s: float) -> float:
        deadline = time.monotonic() + deadline_s
        threads = [threading.Thread(target=self._client, args=(deadline,), daemon=True) for _ in range(clients)]
        started = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join(max(0.1, deadline - time.monotonic() + 20))
        assert not any(t.is_alive() for t in threads), "load clients still running past the deadline"
        return time.monotonic() - started

    def _client(self, deadline: float) -> None:
        conn = KeepAlive(self.address)
        try:
            while time.monotonic() < deadline:
                i = next(self.next)
                if i >= self.total:
                    return
                kind = self.plan[i]
                try:
                    problem = self._one(conn, i, kind)
                except Exception as e:  # noqa: BLE001 - every error is a finding
                    conn.close()
                    self._record(kind, None, f"error: {type(e).__name__}: {e}")
                    continue
                self._record(kind, problem, None)
        finally:
            with self.lock:
                self.reconnects += max(0, conn.opened - 1)
            conn.close()

    def _record(self, kind: Kind, wrong: str | None, error: str | None) -> None:
        with self.lock:
            self.tally.done += 1
            self.tally.by_kind[kind.name] += 1
            if wrong:
                self.tally.wrong_count += 1
                if len(self.tally.wrong) < 30:
                    self.tally.wrong.append((kind.name, wrong))
            if error:
                self.tally.error_count += 1
                if len(self.tally.errors) < 30:
                    self.tally.errors.append((kind.name, error))

    @staticmethod
    def _check(kind: Kind, status, reason, body: bytes, path: str | None) -> str | None:
        if (status, reason) != (kind.status, kind.reason):
            return f"expected {kind.status} {kind.reason}, got {status} {reason}: {body[:160]!r}"
        if status == 200 and path is not None:
            want = f"origin ok {kind.host} {path}\n".encode()
            if body != want:
                return f"allowed, but the body is {body[:160]!r}, not {want!r}"
        elif status != 200 and not body.strip():
            return "a refusal without its one-sentence body"
        return None

    def _one(self, conn: KeepAlive, i: int, kind: Kind) -> str | None:
        if kind.way == "http":
            url = kind.target.format(i=i)
            r = conn.request(get(url))
            if r.status is None:
                raise ConnectionError("the proxy closed a keep-alive connection without answering")
            path = "/" + url.split("://", 1)[1].split("/", 1)[1]
            return self._check(kind, r.status, r.sluice_reason, r.body, path)
        if kind.way == "origin":
            path = f"/load/origin/{i}"
            r = conn.request(f"GET {path} HTTP/1.1\r\nHost: {kind.target}\r\n\r\n".encode())
            if r.status is None:
                raise ConnectionError("the proxy closed a keep-alive connection without answering")
            return self._check(kind, r.status, r.sluice_reason, r.body, path)
        if kind.way == "connect":
            r, sock, reader = connect_tunnel(self.address, kind.target)
            if sock is None:
                return self._check(kind, r.status, r.sluice_reason, r.body, None)
            with sock:
                path = f"/load/tunnel/{i}"
                sock.sendall(f"GET {path} HTTP/1.1\r\nHost: {kind.host}\r\nConnection: close\r\n\r\n".encode())
                inner = read_response(reader)
            if kind.status != 200:
                return f"expected {kind.status} {kind.reason}, but the tunnel opened (inner {inner.status})"
            return self._check(kind, inner.status, inner.sluice_reason, inner.body, path)
        if kind.way == "tls":
            r, sock, reader = connect_tunnel(self.address, kind.target)
            if sock is None:
                return self._check(kind, r.status, r.sluice_reason, r.body, None)
            with self.tls_ctx.wrap_socket(sock, server_hostname=kind.host) as tls:
                path = f"/load/tls/{i}"
                tls.sendall(f"GET {path} HTTP/1.1\r\nHost: {kind.host}\r\nConnection: close\r\n\r\n".encode())
                inner = read_response(_Reader(tls))
            return self._check(kind, inner.status, inner.sluice_reason, inner.body, path)
        raise ValueError(kind.way)


def _origin_counts(net) -> dict[tuple[str, int], int]:
    return {key: len(listener.snapshot()[1]) for key, listener in net.origins.items()}


def _expected_refusals(plan, n) -> Counter:
    return Counter(k.reason for k in plan[:n] if k.status != 200)


def _audit_lines(proxy) -> list[dict]:
    return proxy.audit()


@pytest.mark.timeout(scaled(540, 1300))
def test_mixed_load(load_proxy, net, tls_ca, capsys):
    proxy = load_proxy
    pid = proxy.proc.pid
    report: dict = {"total": TOTAL, "clients": CLIENTS}

    # Warm-up: the whole mix at full concurrency, so caches, pools and the
    # allocator's arenas reach their working size before the baseline.
    warm = Load(proxy, tls_ca.cafile, WARMUP, seed=7)
    report["warmup_s"] = round(warm.run(CLIENTS, PHASE_DEADLINE), 2)
    assert warm.tally.done == WARMUP and not warm.tally.errors and not warm.tally.wrong, warm.tally
    base_fds = quiet_fds(pid)  # the warm-up's connections have closed
    base_rss = rss_kib(pid)
    report.update(base_fds=base_fds, base_rss_kib=base_rss)

    origin_before = _origin_counts(net)
    audit_before = len(_audit_lines(proxy))
    load = Load(proxy, tls_ca.cafile, TOTAL, seed=20260612)
    half = TOTAL // 2

    # Phase 1: the first half. (One Load object: the second phase continues
    # the same plan, so counts add up.)
    load.total = half
    cpu0 = cpu_seconds(pid)
    report["phase1_s"] = round(load.run(CLIENTS, PHASE_DEADLINE), 2)
    assert load.tally.done == half, f"phase 1 finished {load.tally.done} of {half} within {PHASE_DEADLINE}s"
    report["phase1_fds"] = settle_fds(pid, base_fds + FD_TOLERANCE, FD_SETTLE)
    rss_mid = rss_kib(pid)
    report["phase1_rss_kib"] = rss_mid

    # Phase 2: the second half.
    load.total = TOTAL
    load.next = itertools.count(half)
    report["phase2_s"] = round(load.run(CLIENTS, PHASE_DEADLINE), 2)
    t = load.tally
    report["proxy_cpu_s"] = round(cpu_seconds(pid) - cpu0, 2)
    report.update(done=t.done, wrong=t.wrong_count, errors=t.error_count, reconnects=load.reconnects)
    report["rps"] = round(TOTAL / (report["phase1_s"] + report["phase2_s"]))

    end_fds = settle_fds(pid, base_fds + FD_TOLERANCE, FD_SETTLE)
    end_rss = rss_kib(pid)
    report.update(end_fds=end_fds, end_rss_kib=end_rss,
                  rss_growth_kib=end_rss - base_rss, rss_phase2_growth_kib=end_rss - rss_mid)
    with capsys.disabled():
        print(f"\nreliability load: {json.dumps(report)}")

    assert t.done == TOTAL, f"finished {t.done} of {TOTAL} requests within the deadline"
    assert t.wrong_count == 0, f"{t.wrong_count} wrong decisions, e.g. {t.wrong}"
    assert t.error_count == 0, f"{t.error_count} unexpected errors, e.g. {t.errors}"
    assert load.reconnects == 0, f"the proxy closed {load.reconnects} keep-alive client connections"
    assert proxy.alive()

    # The origins saw exactly the allowed requests, no more and no fewer.
    after = _origin_counts(net)
    want = Counter(k.origin for k in load.plan if k.status == 200)
    for key in net.origins:
        assert after[key] - origin_before[key] == want.get(key, 0), (
            f"origin {key} got {after[key] - origin_before[key]} requests, expected {want.get(key, 0)}"
        )

    # Every refusal has its audit line with the right reason (tunnel and
    # request lines for allowed exchanges too).
    expected_refusals = _expected_refusals(load.plan, TOTAL)

    def audited() -> Counter:
        return Counter(e.get("reason") for e in _audit_lines(proxy)[audit_before:] if e.get("decision") == "refuse")

    wait_until(lambda: audited() == expected_refusals, 10.0, 0.25)
    assert audited() == expected_refusals
    allowed_lines = [e for e in _audit_lines(proxy)[audit_before:] if e.get("decision") == "allow"]
    allowed = sum(1 for k in load.plan if k.status == 200)
    assert len(allowed_lines) >= allowed, f"{len(allowed_lines)} allow lines for {allowed} allowed exchanges"

    assert end_fds <= base_fds + FD_TOLERANCE, (
        f"the proxy holds {end_fds} fds {FD_SETTLE}s after the load, baseline {base_fds}:\n"
        + "\n".join(fd_targets(pid))
    )
    assert end_rss - base_rss <= RSS_GROWTH_TOTAL_KIB, f"RSS grew {end_rss - base_rss} KiB over the run: {report}"
    assert end_rss - rss_mid <= RSS_GROWTH_PHASE_KIB, f"RSS grew {end_rss - rss_mid} KiB in the second half: {report}"
