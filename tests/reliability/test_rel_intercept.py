"""Fuzzed attacks inside intercepted tunnels (issue 9): random first bytes
and random splits before a request that names another virtual host or a
refused method.

The origin (tests/harness/vhosts.py) serves a.example (allowed, intercepted)
and b.example (refused, and the origin's default virtual host) on 1.1.1.1,
TLS on 8443 and plain HTTP on 8081. Each example opens a tunnel to a.example
(CONNECT or SOCKS5, TLS or plain), sends a prefix (empty lines, whitespace,
TLS-ish or random bytes) and then a request that must be refused: its Host
or its absolute-form target names b.example (or the shared IP, or b.example
spelled otherwise), or its method is not in the policy's `methods`. The
bytes go out in up to four writes with random pauses, then a few empty lines
(a request head behind leading empty lines waits for the client's next read:
see the xfail in tests/integration/test_interception_holds.py).

Invariants: the origin never receives a request for any host but a.example,
nor a refused method, nor the Cookie or Proxy-Authorization the attacks
carry, nor a TLS handshake naming b.example; the client never gets the
origin's answer (only a refusal, a close, or nothing); no allow line in the
audit log names the IP as its host; the proxy lives, logs no error, and a
normal request through a fresh tunnel passes afterwards.

Examples: 80 by default, 800 with SLUICE_LONG=1.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from harness import default_policy
from harness.vhosts import (
    A, B, C, MODES, ORIGIN_IP, PLAIN_PORT, TLS_PORT, VhostOrigin, exchange, mode_port, mode_scheme, open_tunnel,
    start_vhost_origin,
)
from relkit import scaled

pytestmark = pytest.mark.netns

COOKIE = "session=fuzz-secret"
PROXY_AUTH = "Basic ZnV6ejpwcm94eS1zZWNyZXQ="
REFUSED_METHODS = ["DELETE", "POST", "PUT", "PATCH", "OPTIONS", "TRACE", "delete", "GETX", "PROPFIND"]
PREFIXES = [b"", b"\r\n", b"\n", b"\r\n\r\n", b"\r\n\n", b"\r", b" ", b"\t", b"\x00", b"\x16\x03\x01\x00",
            b"GET", b"HTTP/1.1\r\n", b"\xff\xfe", b"PRI * HTTP/2.0\r\n"]
READ_TIMEOUT = 1.5

FUZZ_SETTINGS = settings(
    max_examples=scaled(80, 800),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
)


def other_names(port: int) -> list[str]:
    """Ways to name something other than a.example on the same server."""
    return [B, "B.Example", B + ".", f"{B}:{port}", ORIGIN_IP, f"{ORIGIN_IP}:{port}", C, "[::ffff:1.1.1.1]",
            f"{A}.{B}", f"{B}#{A}"]


@st.composite
def attacks(draw) -> tuple[str, list[bytes], float]:
    mode = draw(st.sampled_from(MODES))
    port, scheme = mode_port(mode), mode_scheme(mode)
    kind = draw(st.sampled_from(["host", "target", "method"]))
    if kind == "method":
        method = draw(st.sampled_from(REFUSED_METHODS))
        target = draw(st.sampled_from(["/admin", f"{scheme}://{A}/admin", f"{scheme}://{A}:{port}/admin"]))
        host = draw(st.sampled_from([A, f"{A}:{port}", "A.EXAMPLE."]))
    elif kind == "host":
        method = draw(st.sampled_from(["GET", "HEAD"]))
        target = "/x"
        host = draw(st.sampled_from(other_names(port)))
    else:
        method = draw(st.sampled_from(["GET", "HEAD"]))
        target = f"{scheme}://{draw(st.sampled_from(other_names(port)))}/x"
        host = draw(st.sampled_from([A, f"{A}:{port}", B]))
    head = (f"{method} {target} HTTP/1.1\r\nHost: {host}\r\nCookie: {COOKIE}\r\n"
            f"Proxy-Authorization: {PROXY_AUTH}\r\n\r\n").encode()
    prefix = draw(st.one_of(st.sampled_from(PREFIXES), st.binary(max_size=8)))
    data = prefix + head
    cuts = sorted(draw(st.sets(st.integers(1, len(data) - 1), max_size=3)))
    chunks = [data[i:j] for i, j in zip([0, *cuts], [*cuts, len(data)])]
    pause = draw(st.sampled_from([0.0, 0.02, 0.1]))
    return mode, chunks, pause


@pytest.fixture(scope="module")
def origin(net, tls_ca, fake_dns):
    server = start_vhost_origin(tls_ca, fake_dns)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def proxy(sluice_factory, origin, tls_ca):
    policy = default_policy(ports=[80, 443, PLAIN_PORT, TLS_PORT])
    policy.update({"allow": [A], "intercept": [A], "methods": ["GET", "HEAD"], "strip_request_headers": ["Cookie"],
                   "limits": {"request_timeout": "5s"}})
    return sluice_factory(policy, socks=True, name="relintercept",
                          extra_args=("--set", f"ssl_verify_upstream_trusted_ca={tls_ca.cafile}"))


_STAMP = re.compile(r"^sluice: ")  # every stderr record starts so (sluice/proxy.py OneVoice)
ERROR_MARKS = ("Traceback", "Addon error", "Error in", "Exception", "Unhandled", "crashed")


def assert_origin_clean(origin: VhostOrigin) -> None:
    for seen in origin.seen():
        assert seen.vhost == A and seen.method in ("GET", "HEAD"), f"the origin received {seen}"
        assert "cookie" not in seen.headers and "proxy-authorization" not in seen.headers, seen
    assert B not in origin.tls_server_names, origin.tls_server_names


@pytest.mark.timeout(scaled(240, 2400))
def test_fuzzed_first_bytes_inside_intercepted_tunnels(proxy, origin, sluice_home, canaries):
    sluice_ca = str(Path(sluice_home) / ".sluice" / "ca" / "mitmproxy-ca-cert.pem")
    origin.reset()
    stderr_mark, audit_mark = proxy.stderr_mark(), proxy.audit_mark()
    kinds: dict[str, int] = {}

    @FUZZ_SETTINGS
    @given(attack=attacks())
    def one(attack) -> None:
        mode, chunks, pause = attack
        sock = open_tunnel(proxy, mode, sluice_ca, timeout=READ_TIMEOUT)
        outcome = exchange(sock, [*chunks, b"\r\n", b"\r\n", b"\r\n"], pause=max(pause, 0.02))
        kinds[outcome.kind] = kinds.get(outcome.kind, 0) + 1
        sent = b"".join(chunks)
        assert not outcome.from_origin, f"the origin answered {mode} {sent!r}: {outcome}"
        assert outcome.kind != "tls_error", f"{mode} {sent!r}: {outcome}"
        if outcome.kind == "response":
            assert outcome.status in (400, 403, 408, 413, 431), f"{mode} {sent!r}: {outcome}"
        assert_origin_clean(origin)
        assert proxy.alive(), f"the proxy died on {mode} {sent!r}:\n{proxy.stderr_text(tail=60)}"
        canaries.assert_untouched()

    one()
    print("outcomes:", kinds)
    assert_origin_clean(origin)
    entries = proxy.audit()[audit_mark:]
    ip_allows = [e for e in entries if e["decision"] == "allow" and e["host"] == ORIGIN_IP]
    assert not ip_allows, f"allow lines naming the IP (a raw fallback): {ip_allows[:3]}"
    internal = [e for e in entries if e.get("reason") == "internal_error"]
    assert not internal, f"{len(internal)} exchanges hit internal_error, e.g. {internal[:3]}"
    errors = [line for line in proxy.stderr_since(stderr_mark).splitlines() if any(m in line for m in ERROR_MARKS)]
    assert not errors, "the proxy logged errors:\n" + "\n".join(errors[:40])
    # Still serving: an allowed request through a fresh tunnel passes, stripped.
    origin.reset()
    ok = exchange(open_tunnel(proxy, "connect-tls", sluice_ca),
                  [f"GET /after HTTP/1.1\r\nHost: {A}\r\nCookie: {COOKIE}\r\n\r\n".encode()])
    assert ok.status == 200 and ok.from_origin and json.loads(ok.response.body)["vhost"] == A, ok
    assert [s.target for s in origin.seen()] == ["/after"]
    assert_origin_clean(origin)
