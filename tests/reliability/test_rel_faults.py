"""Faults: origins that reset or hang, DNS servers that die, stall or talk
garbage, a policy file deleted or replaced by garbage under load, clients
that vanish mid-request, and a thousand abandoned connections.

In every case the proxy must answer with the documented status and reason
(or close a connection whose response had already started), keep serving
everyone else, leak no file descriptors, and never reach a canary.
"""

from __future__ import annotations

import os
import random
import resource
import signal
import socket
import struct
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import yaml

from harness import default_policy
from harness.clients import _Reader, read_response
from relkit import (
    EVIL_DNS_IP,
    FAULT_IP,
    FAULT_PORT,
    EvilDNS,
    KeepAlive,
    connect_tunnel,
    fd_targets,
    get,
    quiet_fds,
    scaled,
    settle_fds,
    wait_until,
)

pytestmark = pytest.mark.netns

FAULT_NAME = "fault.rel.example"
FD_TOLERANCE = 10  # as in the load test: idle the proxy holds ~8-10 fds
DNS_TIMEOUT = 1.0


def _uniq(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}.rel.example"


def fault_policy(**limits) -> dict:
    policy = default_policy(ports=[80, 443, FAULT_PORT])
    policy["limits"] = {"connect_timeout": "2s", "request_timeout": "2s", **limits}
    return policy


@pytest.fixture(scope="module")
def fault_proxy(sluice_factory, fake_dns, fault_origin):
    fake_dns.set(FAULT_NAME, a=[FAULT_IP], ttl=300)
    return sluice_factory(fault_policy(), name="faults")


@pytest.fixture(scope="module")
def evil_dns(netns):
    server = EvilDNS().start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def evil_proxy(sluice_factory, evil_dns):
    policy = default_policy()
    policy["dns"] = {"nameservers": [f"{EVIL_DNS_IP}:53"], "timeout": f"{DNS_TIMEOUT:g}s", "min_ttl": "0s"}
    return sluice_factory(policy, name="evildns")


def _fault_url(path: str) -> str:
    return f"http://{FAULT_NAME}:{FAULT_PORT}{path}"


def _base_fds(proxy) -> int:
    return quiet_fds(proxy.proc.pid)


def _assert_fds_back(proxy, base: int) -> None:
    pid = proxy.proc.pid
    end = settle_fds(pid, base + FD_TOLERANCE, 15.0)
    assert end <= base + FD_TOLERANCE, f"the proxy holds {end} fds, baseline {base}:\n" + "\n".join(fd_targets(pid))


def _assert_serving(proxy, host: str = "public.example") -> None:
    """Alive, and a normal request still gets the origin's 200."""
    assert proxy.alive(), f"the proxy died:\n{proxy.stderr_text(tail=40)}"
    r = KeepAlive(proxy.address, timeout=10).request(get(f"http://{host}/still-serving", close=True))
    assert r.status == 200 and r.body == f"origin ok {host} /still-serving\n".encode(), r


def _assert_no_tracebacks(proxy, mark: int) -> None:
    text = proxy.stderr_since(mark)
    assert "Traceback" not in text, f"the proxy logged a traceback:\n{text[-4000:]}"


# ================================================================== origins


def test_origin_resets_before_the_response(fault_proxy, fault_origin):
    base = _base_fds(fault_proxy)
    mark = fault_proxy.stderr_mark()
    audit_mark = fault_proxy.audit_mark()
    for _ in range(20):
        conn = KeepAlive(fault_proxy.address, timeout=10)
        r = conn.request(get(_fault_url("/reset-head")))
        conn.close()
        assert r.status == 502, f"a reset before the response must be a 502, got {r}"
    entry = fault_proxy.wait_audit(lambda e: e["event"] == "request" and e["host"] == FAULT_NAME, since=audit_mark)
    assert entry["detail"], f"the audit line does not say what went wrong: {entry}"
    _assert_serving(fault_proxy)
    _assert_no_tracebacks(fault_proxy, mark)
    _assert_fds_back(fault_proxy, base)


def test_audit_records_the_502_sent_for_an_origin_reset(fault_proxy, fault_origin):
    """Regression (found by this suite): when the origin resets before any
    response byte, mitmproxy itself answers 502, and the audit line must say
    502 too (it used to say null)."""
    audit_mark = fault_proxy.audit_mark()
    r = KeepAlive(fault_proxy.address, timeout=10).request(get(_fault_url("/reset-head"), close=True))
    assert r.status == 502, r
    entry = fault_proxy.wait_audit(lambda e: e["event"] == "request" and e["host"] == FAULT_NAME, since=audit_mark)
    assert entry["status"] == 502, f"the client got 502, the audit line says {entry['status']}: {entry}"


@pytest.mark.parametrize("how", ["reset-body", "close-body"])
def test_origin_dies_mid_body(fault_proxy, fault_origin, how):
    """Headers and half the body, then RST (or FIN): the client must get a
    body that is plainly incomplete (short of its Content-Length, connection
    closed), never one that looks complete."""
    base = _base_fds(fault_proxy)
    mark = fault_proxy.stderr_mark()
    n = 200_000
    for _ in range(20):
        with socket.create_connection(fault_proxy.address, timeout=10) as s:
            s.sendall(get(_fault_url(f"/{how}/{n}")))
            r = read_response(_Reader(s))
            assert r.status in (200, 502), r
            if r.status == 200:
                assert int(r.headers["content-length"]) == n
                assert len(r.body) < n, "a cut body was delivered as complete"
                s.settimeout(5)
                try:
                    assert s.recv(1) == b"", "the connection stayed open after a cut body"
                except ConnectionResetError:
                    pass
    _assert_serving(fault_proxy)
    _assert_no_tracebacks(fault_proxy, mark)
    _assert_fds_back(fault_proxy, base)


def test_origin_accepts_then_never_answers(fault_proxy, fault_origin):
    """request_timeout 2s: every one of 20 concurrent hanging requests gets
    504 request_timeout in time, and the proxy hangs up on the origin."""
    base = _base_fds(fault_proxy)
    mark = fault_proxy.stderr_mark()

    def one(_):
        started = time.monotonic()
        r = KeepAlive(fault_proxy.address, timeout=15).request(get(_fault_url("/hang")))
        return r, time.monotonic() - started

    with ThreadPoolExecutor(20) as pool:
        results = list(pool.map(one, range(20)))
    for r, elapsed in results:
        assert (r.status, r.sluice_reason) == (504, "request_timeout"), r
        assert 1.8 <= elapsed < 6, f"504 after {elapsed:.2f}s with a 2s request_timeout"
    assert wait_until(lambda: fault_origin.open_connections == 0, 10), (
        f"{fault_origin.open_connections} upstream connections to the hanging origin are still open"
    )
    _assert_serving(fault_proxy)
    _assert_no_tracebacks(fault_proxy, mark)
    _assert_fds_back(fault_proxy, base)


# ================================================================== DNS


def _timed_get(proxy, host: str, path: str = "/") -> tuple:
    started = time.monotonic()
    r = KeepAlive(proxy.address, timeout=20).request(get(f"http://{host}{path}", close=True))
    return r, time.monotonic() - started


def test_dns_server_down_fails_closed(sluice_factory):
    """Nothing listens on 127.0.0.55:53 (port unreachable): 502 dns_failed, quickly."""
    policy = default_policy()
    policy["dns"] = {"nameservers": ["127.0.0.55:53"], "timeout": f"{DNS_TIMEOUT:g}s"}
    proxy = sluice_factory(policy, name="deaddns")
    for _ in range(3):
        r, elapsed = _timed_get(proxy, _uniq("down"))
        assert (r.status, r.sluice_reason) == (502, "dns_failed"), r
        assert elapsed < DNS_TIMEOUT + 1.5, f"dns_failed after {elapsed:.2f}s with a {DNS_TIMEOUT:g}s DNS timeout"
    # IP literals need no DNS and still work.
    r, _ = _timed_get(proxy, "8.8.8.8", "/literal")
    assert r.status == 200 and r.body == b"origin ok 8.8.8.8 /literal\n", r


def test_dns_server_stops_answering_then_recovers(evil_proxy, evil_dns):
    evil_dns.mode = "silent"
    try:
        def one(_):
            return _timed_get(evil_proxy, _uniq("ok"))

        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(one, range(8)))
        for r, elapsed in results:
            assert (r.status, r.sluice_reason) == (502, "dns_failed"), r
            assert DNS_TIMEOUT * 0.9 <= elapsed < DNS_TIMEOUT + 1.5, f"dns_failed after {elapsed:.2f}s"
    finally:
        evil_dns.mode = "normal"
    # A timeout is not remembered: the same kind of name works again at once.
    r, _ = _timed_get(evil_proxy, _uniq("ok"), "/recovered")
    assert r.status == 200 and r.body.startswith(b"origin ok ok-"), r


def test_dns_server_answers_only_garbage(evil_proxy, evil_dns):
    evil_dns.mode = "garbage"
    try:
        for _ in range(4):
            r, elapsed = _timed_get(evil_proxy, _uniq("ok"))
            assert (r.status, r.sluice_reason) == (502, "dns_failed"), r
            assert elapsed < DNS_TIMEOUT + 1.5
    finally:
        evil_dns.mode = "normal"
    _assert_serving(evil_proxy, _uniq("ok"))


@pytest.mark.parametrize(
    "kind, delay_ok",
    [("slow300", True), ("slow700", True), ("slow1500", False), ("slow5000", False)],
)
def test_slow_dns(evil_proxy, evil_dns, kind, delay_ok):
    """A late answer within the DNS timeout (1s) is used; beyond it, 502 dns_failed at the timeout."""
    r, elapsed = _timed_get(evil_proxy, _uniq(kind), "/slow")
    if delay_ok:
        assert r.status == 200 and r.body.endswith(b" /slow\n"), r
    else:
        assert (r.status, r.sluice_reason) == (502, "dns_failed"), r
        assert DNS_TIMEOUT * 0.9 <= elapsed < DNS_TIMEOUT + 1.5, f"dns_failed after {elapsed:.2f}s"


MALFORMED = {
    # kind: (status, reason)
    "garbage": (502, "dns_failed"),
    "short": (502, "dns_failed"),
    "badid": (502, "dns_failed"),
    "notqr": (502, "dns_failed"),
    "qmismatch": (502, "dns_failed"),
    "loop": (502, "dns_failed"),
    "badrdlen": (502, "dns_failed"),
    "trunc": (502, "dns_failed"),
    "rcode2": (502, "dns_failed"),
    "rcode5": (502, "dns_failed"),
    "rcode15": (502, "dns_failed"),
    "aaaa": (502, "dns_failed"),  # a AAAA record in answer to A: no usable address
    "a127": (403, "dns_answer_not_public"),
    "mixed": (403, "dns_answer_not_public"),
    "cnamelocal": (403, "dns_answer_not_public"),
    "poison": (200, None),  # 127.0.0.1 for *other* names is ignored; 8.8.8.8 is used
}


def test_malformed_dns_answers(evil_proxy, evil_dns):
    """Every kind of malformed or hostile answer fails closed (or, for
    records about other names, is ignored); the proxy keeps serving."""
    mark = evil_proxy.stderr_mark()

    def one(kind):
        host = _uniq(kind if kind != "aaaa" else "aaaa-only")
        r, elapsed = _timed_get(evil_proxy, host, "/dns")
        return kind, r, elapsed

    with ThreadPoolExecutor(len(MALFORMED)) as pool:
        results = list(pool.map(one, MALFORMED))
    problems = []
    for kind, r, elapsed in results:
        want = MALFORMED[kind]
        if (r.status, r.sluice_reason) != want:
            problems.append(f"{kind}: expected {want}, got {r.status} {r.sluice_reason} {r.body[:120]!r}")
        elif r.status == 200 and not r.body.endswith(b" /dns\n"):
            problems.append(f"{kind}: allowed, but the body is {r.body[:120]!r}")
        if elapsed > DNS_TIMEOUT + 1.5:
            problems.append(f"{kind}: answered after {elapsed:.2f}s")
    assert not problems, "\n".join(problems)
    _assert_serving(evil_proxy, _uniq("ok"))
    _assert_no_tracebacks(evil_proxy, mark)


# ================================================================== policy reloads


def _write_atomic(path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


X_NAME = "x.reload.rel.example"
Y_NAME = "y.reload.rel.example"


def test_policy_deleted_or_garbled_under_load_keeps_the_last_good_policy(sluice_factory, fake_dns):
    """Policy A denies X; B denies Y. While 8 clients keep requesting, the
    file is deleted, replaced by random bytes, by broken YAML, by a
    wrong-version policy and by nothing (and SIGHUP is sent with garbage in
    place): each failure is audited, and A keeps deciding. Restoring A
    changes nothing; writing B reloads it, and from then on B decides."""
    for name in (X_NAME, Y_NAME):
        fake_dns.set(name, a=["8.8.8.8"], ttl=300)
    policy_a = default_policy(deny=[X_NAME])
    policy_b = default_policy(deny=[Y_NAME])
    proxy = sluice_factory(policy_a, name="reload", extra_args=("--set", "sluice_policy_poll=0.2"))
    path = proxy.policy_file
    mark = proxy.audit_mark()

    answers = {
        # name: (answer under A, answer under B)
        "public.example": ((200, None), (200, None)),
        "169.254.169.254": ((403, "address_not_public"), (403, "address_not_public")),
        X_NAME: ((403, "host_denied"), (200, None)),
        Y_NAME: ((200, None), (403, "host_denied")),
    }
    stop = threading.Event()
    b_written = [float("inf")]  # monotonic time B was written
    b_loaded = [float("inf")]  # monotonic time the audit showed B's reload
    results: list[tuple] = []
    errors: list[str] = []
    lock = threading.Lock()

    def client(seed: int) -> None:
        rng = random.Random(seed)
        conn = KeepAlive(proxy.address, timeout=10)
        deadline = time.monotonic() + 60
        while not stop.is_set() and time.monotonic() < deadline:
            name = rng.choice(list(answers))
            sent = time.monotonic()
            try:
                r = conn.request(get(f"http://{name}/reload"))
            except Exception as e:  # noqa: BLE001
                conn.close()
                with lock:
                    errors.append(f"{name}: {type(e).__name__}: {e}")
                continue
            with lock:
                results.append((sent, time.monotonic(), name, r.status, r.sluice_reason))
        conn.close()

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(8)]
    for t in threads:
        t.start()
    try:
        time.sleep(0.5)

        def failed_since(m):
            return proxy.wait_audit(
                lambda e: e["event"] == "reload" and e["decision"] == "failed", since=m, timeout=5,
                what="a failed reload line",
            )

        m = proxy.audit_mark()
        path.unlink()
        entry = failed_since(m)
        assert "missing" in entry["detail"], entry
        time.sleep(0.4)

        for garbage in (
            random.Random(3).randbytes(4096),  # not UTF-8
            b"version: 1\nallow: [unclosed\n  - {\n",  # broken YAML
            b"version: 2\nports: [80]\n",  # YAML, but not a policy this Sluice reads
            b"\x00\x01\x02 not yaml at all \xff",
            b"",  # empty
        ):
            m = proxy.audit_mark()
            _write_atomic(path, garbage)
            failed_since(m)
            time.sleep(0.3)

        # SIGHUP with garbage in place: reloads (and fails) at once.
        m = proxy.audit_mark()
        proxy.proc.send_signal(signal.SIGHUP)
        failed_since(m)
        time.sleep(0.3)

        # The last good policy itself, restored byte for byte: nothing to
        # swap (same digest), A stays in force (the clients check that), and
        # the audit says the file is good again ("restored").
        _write_atomic(path, yaml.safe_dump(policy_a, sort_keys=False).encode())
        time.sleep(0.6)
        proxy.proc.send_signal(signal.SIGHUP)
        time.sleep(0.3)

        m = proxy.audit_mark()
        b_written[0] = time.monotonic()
        _write_atomic(path, yaml.safe_dump(policy_b, sort_keys=False).encode())
        proxy.wait_audit(lambda e: e["event"] == "reload" and e["decision"] == "ok", since=m, timeout=5,
                         what="the reload of policy B")
        b_loaded[0] = time.monotonic()
        time.sleep(0.5)
    finally:
        stop.set()
        for t in threads:
            t.join(15)

    assert not errors, f"{len(errors)} client errors during reloads, e.g. {errors[:5]}"
    wrong = []
    for sent, got, name, status, reason in results:
        under_a, under_b = answers[name]
        if got < b_written[0]:
            ok = (status, reason) == under_a
        elif sent > b_loaded[0]:
            ok = (status, reason) == under_b
        else:
            ok = (status, reason) in (under_a, under_b)
        if not ok:
            wrong.append((name, status, reason, round(sent - b_written[0], 3)))
    assert not wrong, f"{len(wrong)} answers from the wrong policy, e.g. {wrong[:10]}"
    assert len(results) > 200, f"only {len(results)} requests went through during the reloads"
    assert sum(1 for r in results if r[0] > b_loaded[0]) > 0, "no request was made under policy B"
    reloads = [e for e in proxy.audit()[mark:] if e["event"] == "reload"]
    oks = [e for e in reloads if e["decision"] == "ok"]
    assert len(oks) == 2 and "restored" in oks[0]["detail"] and "generation 2" in oks[1]["detail"], reloads
    assert proxy.alive()


# ================================================================== clients that vanish


def _rst_close(s: socket.socket) -> None:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()


def test_clients_disconnect_mid_request(fault_proxy, fault_origin):
    """Clients that leave (FIN or RST) in every state of an exchange: mid
    head, mid body, waiting for a hanging origin, mid response, inside a
    tunnel, mid CONNECT. The proxy keeps serving, hangs up on the origin for
    them, and frees every fd."""
    base = _base_fds(fault_proxy)
    mark = fault_proxy.stderr_mark()
    rounds = scaled(10, 50)
    for i in range(rounds):
        close = _rst_close if i % 2 else socket.socket.close
        # 1. half a request head
        s = socket.create_connection(fault_proxy.address, timeout=10)
        s.sendall(b"GET http://public.example/half HTTP/1.1\r\nHost: publ")
        close(s)
        # 2. a head promising a body, and part of it
        s = socket.create_connection(fault_proxy.address, timeout=10)
        s.sendall(b"POST http://public.example/body HTTP/1.1\r\nHost: public.example\r\nContent-Length: "
                  b"1000\r\n\r\n0123456789")
        time.sleep(0.01)
        close(s)
        # 3. a whole request to an origin that does not answer; leave before it does
        s = socket.create_connection(fault_proxy.address, timeout=10)
        s.sendall(get(_fault_url("/hang")))
        time.sleep(0.05)
        close(s)
        # 4. leave in the middle of a large response
        s = socket.create_connection(fault_proxy.address, timeout=10)
        s.sendall(get(f"http://public.example/bytes/{8 * 1024 * 1024}"))
        s.recv(16384)
        close(s)
        # 5. a tunnel with half a request inside it
        r, sock, _ = connect_tunnel(fault_proxy.address, "public.example:80")
        assert r.status == 200, r
        sock.sendall(b"GET /in-tunnel HTTP/1.1\r\nHo")
        close(sock)
        # 6. CONNECT head cut short
        s = socket.create_connection(fault_proxy.address, timeout=10)
        s.sendall(b"CONNECT public.example:44")
        close(s)
    _assert_serving(fault_proxy)
    assert wait_until(lambda: fault_origin.open_connections == 0, 10), (
        f"{fault_origin.open_connections} upstream connections outlived their clients"
    )
    _assert_no_tracebacks(fault_proxy, mark)
    _assert_fds_back(fault_proxy, base)


def test_abandoned_connections(sluice_factory, fake_dns):
    """1,000 connections opened and left (nothing sent, half a head, half a
    head then our write side shut, half a CONNECT, an open idle tunnel): the
    proxy keeps serving others promptly, and frees every fd once they close."""
    n = scaled(1_000, 3_000)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = 2 * n + 500
    if soft < need:
        # This process holds the client ends; the proxy (started after this) inherits the limit.
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(need, hard), hard))
    assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] >= need, "raise the open-files limit to run this test"
    proxy = sluice_factory(default_policy(), name="abandoned")
    pid = proxy.proc.pid
    _assert_serving(proxy)
    base = quiet_fds(pid)
    mark = proxy.stderr_mark()

    socks: list[socket.socket] = []
    try:
        for i in range(n):
            s = socket.create_connection(proxy.address, timeout=10)
            socks.append(s)
            way = i % 5
            if way == 1:
                s.sendall(b"GET http://public.example/abandoned HTTP/1.1\r\nHost: pub")
            elif way == 2:
                s.sendall(b"GET http://public.example/abandoned HTTP/1.1\r\nHo")
                s.shutdown(socket.SHUT_WR)
            elif way == 3:
                s.sendall(b"CONNECT public.example:443 HTTP/1.1\r\n")
            elif way == 4:
                s.sendall(b"CONNECT public.example:80 HTTP/1.1\r\nHost: public.example:80\r\n\r\n")
        # The proxy really holds them (so the rest of the test means something).
        assert wait_until(lambda: len(os.listdir(f"/proc/{pid}/fd")) >= base + 0.7 * n, 20), (
            f"the proxy holds only {len(os.listdir(f'/proc/{pid}/fd'))} fds with {n} connections open"
        )
        # Everyone else is still served promptly.
        conn = KeepAlive(proxy.address, timeout=10)
        for j in range(20):
            started = time.monotonic()
            r = conn.request(get(f"http://public.example/meanwhile/{j}"))
            assert r.status == 200 and r.body == f"origin ok public.example /meanwhile/{j}\n".encode(), r
            assert time.monotonic() - started < 3, "a normal request took over 3s beside abandoned connections"
        r = conn.request(get("http://169.254.169.254/meanwhile"))
        assert (r.status, r.sluice_reason) == (403, "address_not_public"), r
        conn.close()
        # The idle tunnels are real tunnels: their CONNECT was answered 200.
        tunnel = socks[4]
        tunnel.settimeout(5)
        assert tunnel.recv(12).startswith(b"HTTP/1.1 200"), "an abandoned CONNECT was not answered"
    finally:
        for i, s in enumerate(socks):
            try:
                _rst_close(s) if i % 2 else s.close()
            except OSError:
                pass
    end = settle_fds(pid, base + FD_TOLERANCE, 20.0)
    assert end <= base + FD_TOLERANCE, (f"the proxy holds {end} fds after the abandoned connections closed, baseline "
                                        f"{base}")
    _assert_serving(proxy)
    _assert_no_tracebacks(proxy, mark)


# A policy whose one flaw is a tagged scalar PyYAML cannot construct (see
# test_rel_fuzz.py::test_loader_unconstructible_tagged_scalars).
UNCONSTRUCTIBLE_POLICY = b"version: !!int ''\nports: [80, 443]\n"


@pytest.fixture(scope="module")
def tag_reload_proxy(sluice_factory, fake_dns):
    fake_dns.set(X_NAME, a=["8.8.8.8"], ttl=300)
    return sluice_factory(default_policy(deny=[X_NAME]), name="tagreload",
                          extra_args=("--set", "sluice_policy_poll=0.2"))


def test_unconstructible_policy_keeps_the_last_good_policy(tag_reload_proxy):
    proxy = tag_reload_proxy
    _write_atomic(proxy.policy_file, UNCONSTRUCTIBLE_POLICY)
    proxy.proc.send_signal(signal.SIGHUP)
    time.sleep(1.0)  # several polls
    assert proxy.alive()
    conn = KeepAlive(proxy.address, timeout=10)
    r = conn.request(get(f"http://{X_NAME}/after-bad-reload"))
    assert (r.status, r.sluice_reason) == (403, "host_denied"), r
    r = conn.request(get("http://public.example/after-bad-reload", close=True))
    assert r.status == 200, r


def test_unconstructible_policy_reload_is_audited_as_failed(tag_reload_proxy):
    """Regression (found by this suite): the loader used to raise IndexError
    here, which the reload path did not catch: no audit line, a traceback
    from the poller, and an exception raised into the loop on SIGHUP."""
    proxy = tag_reload_proxy
    mark, stderr_mark = proxy.audit_mark(), proxy.stderr_mark()
    _write_atomic(proxy.policy_file, UNCONSTRUCTIBLE_POLICY + b"# changed\n")
    proxy.wait_audit(lambda e: e["event"] == "reload" and e["decision"] == "failed", since=mark, timeout=5,
                     what="a failed reload line")
    mark = proxy.audit_mark()
    proxy.proc.send_signal(signal.SIGHUP)
    proxy.wait_audit(lambda e: e["event"] == "reload" and e["decision"] == "failed", since=mark, timeout=5,
                     what="a failed reload line after SIGHUP")
    _assert_no_tracebacks(proxy, stderr_mark)
