"""DNS-rebinding soak: names whose answer flips between public and internal
on every query, asked for over and over through every way into the proxy.

The proxy caches nothing past its TTL (`dns.min_ttl: 0s`, TTL 0), so every
request re-resolves and sees the flip. Every response must be either the
origin's own 200 or 403 dns_answer_not_public (SOCKS5: success and the
origin's answer, or REP 2 "not allowed by ruleset"), and no connection may ever reach the
internal canaries.

Default 1,000 requests on 8 clients; SLUICE_LONG=1: 10,000.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter

import pytest

from harness import default_policy
from harness.clients import _Reader, read_response
from relkit import KeepAlive, connect_tunnel, get, scaled, socks5

pytestmark = pytest.mark.netns

TOTAL = scaled(1_000, 10_000)
CLIENTS = 8
DEADLINE = scaled(120, 600)

# name -> (its public answer, the internal answer it flips to)
FLIPS = {
    "rebind-a.rel.example": ({"a": ["8.8.8.8"]}, {"a": ["127.0.0.1"]}),
    "rebind-meta.rel.example": ({"a": ["8.8.8.8"]}, {"a": ["169.254.169.254"]}),
    "rebind-v6.rel.example": ({"aaaa": ["2606:4700:4700::1111"]}, {"aaaa": ["::1"]}),
    "rebind-cname.rel.example": ({"a": ["8.8.8.8"]}, {"cname": "metadata.google.internal"}),
    "rebind-private.rel.example": ({"a": ["8.8.8.8"]}, {"a": ["10.0.0.1"]}),
}
WAYS = ["absolute", "absolute", "origin", "connect", "socks5"]
REFUSED = (403, "dns_answer_not_public")


@pytest.fixture(scope="module")
def rebind_proxy(sluice_factory, fake_dns):
    for name, (public, internal) in FLIPS.items():
        fake_dns.set_flipping(name, [public, internal], mode="cycle", ttl=0)
    policy = default_policy()
    policy["dns"] = {**policy["dns"], "min_ttl": "0s"}
    return sluice_factory(policy, socks=True, name="rebind-soak")


def _one(proxy, conn: KeepAlive, way: str, name: str, i: int) -> tuple[str, str | None]:
    """('ok', None), ('refused', None), or ('wrong', why)."""
    path = f"/rebind/{i}"
    want_body = f"origin ok {name} {path}\n".encode()
    if way == "absolute":
        r = conn.request(get(f"http://{name}{path}"))
    elif way == "origin":
        r = conn.request(f"GET {path} HTTP/1.1\r\nHost: {name}\r\n\r\n".encode())
    elif way == "connect":
        r, sock, reader = connect_tunnel(proxy.address, f"{name}:80")
        if sock is not None:
            with sock:
                sock.sendall(get(path, host=name, close=True))
                r = read_response(reader)
    else:
        reply, sock = socks5(proxy.socks_address, name, 80)
        if reply is None:
            return "wrong", "the SOCKS5 listener closed without a reply"
        if reply == 2:  # "connection not allowed by ruleset": Sluice's SOCKS5 refusal
            return "refused", None
        if reply != 0:
            return "wrong", f"SOCKS5 reply {reply}, not 0 (success) or 2 (not allowed by ruleset)"
        with sock:
            sock.sendall(f"GET {path} HTTP/1.1\r\nHost: {name}\r\nConnection: close\r\n\r\n".encode())
            r = read_response(_Reader(sock))
    if r.status == 200:
        return ("ok", None) if r.body == want_body else ("wrong", f"200 with body {r.body[:120]!r}")
    if (r.status, r.sluice_reason) == REFUSED:
        return "refused", None
    return "wrong", f"{r.status} {r.sluice_reason} {r.body[:120]!r}"


@pytest.mark.timeout(DEADLINE + 60)
def test_rebinding_soak(rebind_proxy, net, fake_dns, canaries):
    proxy = rebind_proxy
    audit_mark = proxy.audit_mark()
    queries_before = {name: fake_dns.queries(name) for name in FLIPS}
    plan = random.Random(1000).choices([(way, name) for way in WAYS for name in FLIPS], k=TOTAL)
    counter = iter(range(TOTAL))
    lock = threading.Lock()
    outcomes: Counter = Counter()
    wrong: list = []
    errors: list = []
    deadline = time.monotonic() + DEADLINE

    def client() -> None:
        conn = KeepAlive(proxy.address, timeout=15)
        try:
            while time.monotonic() < deadline:
                with lock:
                    i = next(counter, None)
                if i is None:
                    return
                way, name = plan[i]
                try:
                    result, why = _one(proxy, conn, way, name, i)
                except Exception as e:  # noqa: BLE001
                    conn.close()
                    result, why = "error", f"{type(e).__name__}: {e}"
                with lock:
                    outcomes[(way, result)] += 1
                    if result == "wrong":
                        wrong.append((way, name, why))
                    elif result == "error":
                        errors.append((way, name, why))
        finally:
            conn.close()

    threads = [threading.Thread(target=client, daemon=True) for _ in range(CLIENTS)]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.1, deadline - time.monotonic() + 20))
    elapsed = time.monotonic() - started
    print(f"\nrebinding soak: {TOTAL} requests in {elapsed:.1f}s: {dict(outcomes)}")

    assert not any(t.is_alive() for t in threads), "soak clients still running past the deadline"
    done = sum(outcomes.values())
    assert done == TOTAL, f"finished {done} of {TOTAL} within {DEADLINE}s"
    assert not wrong, f"{len(wrong)} answers were neither the origin's 200 nor {REFUSED}: {wrong[:10]}"
    assert not errors, f"{len(errors)} errors: {errors[:10]}"

    # Not one connection reached an internal address.
    canaries.assert_untouched()

    # The flips really reached the proxy: both outcomes, many times, and
    # (nearly) every request made its own lookup.
    ok = sum(n for (_, r), n in outcomes.items() if r == "ok")
    refused = sum(n for (_, r), n in outcomes.items() if r == "refused")
    assert ok >= TOTAL // 5 and refused >= TOTAL // 5, f"{ok} allowed, {refused} refused: the flip did not take"
    lookups = sum(fake_dns.queries(name) - queries_before[name] for name in FLIPS)
    assert lookups >= TOTAL, f"only {lookups} DNS queries for {TOTAL} requests: answers were cached"

    # Every refusal was audited as dns_answer_not_public, and everything the
    # proxy allowed went to a public origin.
    entries = [e for e in proxy.audit()[audit_mark:] if e.get("host") in FLIPS]
    reasons = Counter(e["reason"] for e in entries if e["decision"] == "refuse")
    assert set(reasons) <= {"dns_answer_not_public"}, reasons
    addresses = {e["address"] for e in entries if e["decision"] == "allow" and e.get("address")}
    assert addresses <= {"8.8.8.8", "2606:4700:4700::1111"}, addresses
    # The origins saw exactly the allowed requests.
    seen = sum(
        1 for listener in (net.origin("8.8.8.8", 80), net.origin("2606:4700:4700::1111", 80))
        for req in listener.snapshot()[1] if req.path.startswith("/rebind/")
    )
    assert seen == ok, f"origins saw {seen} soak requests, the clients got {ok} answers from them"
