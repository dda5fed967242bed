"""Request-head caps (size, field count, time) and `Expect: 100-continue` on
refused requests, end to end with raw sockets and curl: at the front door and
inside an intercepted TLS tunnel. No canary may see a connection."""

from __future__ import annotations

import select
import ssl
import time

import pytest

from harness import default_policy
from harness.clients import _Reader, connect, curl, open_socket, read_response

pytestmark = pytest.mark.netns

ORIGIN = ("8.8.8.8", 80)  # public.example, example.com
MAX_BYTES = 16 * 1024
MAX_COUNT = 20
HEAD_LIMITS = {"max_header_bytes": "16KiB", "max_header_count": MAX_COUNT, "header_timeout": "1s"}


@pytest.fixture(scope="module")
def proxy(sluice_factory, tls_ca):
    policy = default_policy(limits=HEAD_LIMITS, intercept=["example.com"])
    return sluice_factory(policy, name="heads", extra_args=("--set", f"ssl_verify_upstream_trusted_ca={tls_ca.cafile}"))


def sluice_ca(sluice_home) -> str:
    return str(sluice_home / ".sluice" / "ca" / "mitmproxy-ca-cert.pem")


def origin_requests(net) -> list:
    return net.origin(*ORIGIN).snapshot()[1]


def answered(reader: _Reader, wait: float) -> bool:
    """Whether the proxy sent something (or closed) within `wait` seconds;
    what it sent is kept in the reader. TLS records that carry no data (a
    session ticket) do not count."""
    sock = reader.sock
    pending = isinstance(sock, ssl.SSLSocket) and sock.pending()
    if not pending and not select.select([sock], [], [], wait)[0]:
        return False
    timeout = sock.gettimeout()
    sock.setblocking(False)
    try:
        reader.buf += sock.recv(65536)  # b"": closed
        return True
    except (ssl.SSLWantReadError, BlockingIOError):
        return False
    except ConnectionResetError:
        return True
    finally:
        sock.settimeout(timeout)


def flood(reader: _Reader, prefix: bytes, limit: int = 8 * 1024 * 1024, chunk: bytes = b"a" * 16384) -> int:
    """Send prefix, then chunk after chunk (never a blank line) until the
    proxy answers or closes, or `limit` bytes went out. Returns bytes sent."""
    reader.sock.sendall(prefix)
    sent = len(prefix)
    while sent < limit and not answered(reader, 0):
        try:
            reader.sock.sendall(chunk)
        except OSError:  # the proxy closed (ssl.SSLError is an OSError too)
            break
        sent += len(chunk)
    return sent


def dribble(reader: _Reader, prefix: bytes, step: bytes = b"a", every: float = 0.2, most: int = 150) -> int:
    """A slowloris: the head's start, then `step` every `every` seconds
    until the proxy answers or closes (at most `most` steps). Returns steps sent."""
    reader.sock.sendall(prefix)
    for n in range(most):
        if answered(reader, every):
            return n
        try:
            reader.sock.sendall(step)
        except OSError:  # the proxy closed (ssl.SSLError is an OSError too)
            return n
    return most


def closed_after(reader: _Reader) -> bool:
    """The proxy ended the connection after its answer (a reset counts: it
    closed with the client's unread bytes pending)."""
    try:
        return reader.rest() == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def head_refusal(proxy, mark, reason: str, status: int) -> dict:
    return proxy.wait_audit(lambda e: e["reason"] == reason and e["status"] == status, since=mark,
                            what=f"a {reason} line")


# ---- size ---------------------------------------------------------------------


def test_endless_header_is_cut_with_431(proxy, net):
    mark = proxy.audit_mark()
    sock = open_socket(proxy.address)
    reader = _Reader(sock)
    sent = flood(reader, b"GET http://public.example/ HTTP/1.1\r\nHost: public.example\r\nX-Flood: ")
    response = read_response(reader)
    assert response.status == 431, response
    assert response.sluice_reason == "request_headers_too_large"
    assert "limits.max_header_bytes" in response.text and "16 KiB" in response.text
    assert response.headers.get("connection") == "close" and closed_after(reader)
    assert sent < 8 * 1024 * 1024, "the proxy never cut the head"
    sock.close()
    line = head_refusal(proxy, mark, "request_headers_too_large", 431)
    assert line["decision"] == "refuse" and line["status"] == 431 and line["client"].startswith("127.0.0.1:")
    assert origin_requests(net) == []


def test_whole_head_over_the_cap_in_one_write_is_refused(proxy, net):
    raw = (b"GET http://public.example/ HTTP/1.1\r\nHost: public.example\r\nX-Big: " + b"a" * (MAX_BYTES + 100)
           + b"\r\n\r\n")
    sock = open_socket(proxy.address)
    sock.sendall(raw)
    response = read_response(_Reader(sock))
    sock.close()
    assert response.status == 431 and response.sluice_reason == "request_headers_too_large"
    assert origin_requests(net) == []


def test_head_under_the_cap_passes(proxy, net):
    raw = (b"GET http://public.example/big HTTP/1.1\r\nHost: public.example\r\nX-Big: " + b"a" * (MAX_BYTES - 200)
           + b"\r\n\r\n")
    sock = open_socket(proxy.address)
    sock.sendall(raw)
    response = read_response(_Reader(sock))
    sock.close()
    assert response.status == 200, response
    assert [r.path for r in origin_requests(net)] == ["/big"]


# ---- field count --------------------------------------------------------------


def fields_request(n_extra: int) -> bytes:
    extra = b"".join(b"X-F%d: v\r\n" % i for i in range(n_extra))
    return b"GET http://public.example/fields HTTP/1.1\r\nHost: public.example\r\n" + extra + b"\r\n"


def test_one_field_too_many_is_refused_and_the_cap_passes(proxy, net):
    mark = proxy.audit_mark()
    sock = open_socket(proxy.address)
    sock.sendall(fields_request(MAX_COUNT))  # Host + 20
    reader = _Reader(sock)
    response = read_response(reader)
    assert response.status == 431 and response.sluice_reason == "request_headers_too_large"
    assert "limits.max_header_count" in response.text and closed_after(reader)
    sock.close()
    assert head_refusal(proxy, mark, "request_headers_too_large", 431)["status"] == 431
    assert origin_requests(net) == []

    sock = open_socket(proxy.address)
    sock.sendall(fields_request(MAX_COUNT - 1))  # Host + 19
    response = read_response(_Reader(sock))
    sock.close()
    assert response.status == 200, response
    assert len(origin_requests(net)) == 1


# ---- time ---------------------------------------------------------------------


@pytest.mark.parametrize("step", [b"a", b""], ids=["dribbling", "silent"])
def test_slow_head_gets_408(proxy, net, step):
    mark = proxy.audit_mark()
    sock = open_socket(proxy.address)
    reader = _Reader(sock)
    steps = dribble(reader, b"GET http://public.example/ HTTP/1.1\r\nHost: public.example\r\nX-Slow: ", step=step)
    response = read_response(reader)
    assert response.status == 408, response
    assert response.sluice_reason == "header_timeout" and "limits.header_timeout" in response.text
    assert closed_after(reader)
    sock.close()
    assert 0 < steps < 150
    line = head_refusal(proxy, mark, "header_timeout", 408)
    assert line["status"] == 408 and line["decision"] == "refuse"
    assert origin_requests(net) == []


def test_idle_keep_alive_outlives_the_head_timeout(proxy, net):
    """Between requests the connection is idle, not slow: idle_timeout's job."""
    sock = open_socket(proxy.address)
    reader = _Reader(sock)
    request = b"GET http://public.example/ka HTTP/1.1\r\nHost: public.example\r\n\r\n"
    sock.sendall(request)
    assert read_response(reader).status == 200
    time.sleep(2.5)  # longer than header_timeout (1s), far less than idle_timeout (60s)
    sock.sendall(request)
    assert read_response(reader).status == 200
    sock.close()
    requests = origin_requests(net)
    assert len(requests) == 2 and requests[0].conn == requests[1].conn


# ---- inside an intercepted tunnel ---------------------------------------------


def tls_tunnel(proxy, sluice_home):
    response, tunnel = connect(proxy.address, "example.com:443")
    assert response.status == 200, response
    tunnel.start_tls("example.com", sluice_ca(sluice_home))
    return tunnel


def test_intercepted_tunnel_endless_header_gets_431(proxy, net, sluice_home):
    mark = proxy.audit_mark()
    tunnel = tls_tunnel(proxy, sluice_home)
    flood(tunnel.reader, b"GET / HTTP/1.1\r\nHost: example.com\r\nX-Flood: ")
    response = read_response(tunnel.reader)
    tunnel.close()
    assert response.status == 431 and response.sluice_reason == "request_headers_too_large", response
    head_refusal(proxy, mark, "request_headers_too_large", 431)
    assert net.origin("8.8.8.8", 443).snapshot()[1] == []


def test_intercepted_tunnel_slow_head_gets_408(proxy, net, sluice_home):
    mark = proxy.audit_mark()
    tunnel = tls_tunnel(proxy, sluice_home)
    steps = dribble(tunnel.reader, b"GET / HTTP/1.1\r\nHost: example.com\r\nX-Slow: ")
    response = read_response(tunnel.reader)
    tunnel.close()
    assert response.status == 408 and response.sluice_reason == "header_timeout", response
    assert 0 < steps < 150
    head_refusal(proxy, mark, "header_timeout", 408)
    assert net.origin("8.8.8.8", 443).snapshot()[1] == []


# ---- Expect: 100-continue -----------------------------------------------------


@pytest.mark.parametrize("target, host", [
    ("http://169.254.169.254/latest/meta-data/", "169.254.169.254"),  # absolute-form
    ("/latest/meta-data/", "169.254.169.254"),  # origin-form, destination from Host
])
def test_refused_expect_request_gets_only_the_refusal(proxy, canaries, target, host):
    mark = proxy.audit_mark()
    sock = open_socket(proxy.address)
    sock.sendall(f"POST {target} HTTP/1.1\r\nHost: {host}\r\nExpect: 100-continue\r\n"
                 "Content-Length: 10\r\n\r\n".encode())
    # Like a client that waits for `100 Continue` before sending the body: the
    # first thing back must be the refusal itself.
    reader = _Reader(sock)
    first_line = reader.until(b"\r\n")
    assert first_line is not None and first_line.startswith(b"HTTP/1.1 403 "), first_line
    reader.buf = first_line + reader.buf
    response = read_response(reader)
    assert response.sluice_reason == "address_not_public", response
    assert closed_after(reader)
    sock.close()
    line = proxy.wait_audit(lambda e: e["reason"] == "address_not_public", since=mark)
    assert line["status"] == 403 and line["decision"] == "refuse"
    canaries.assert_untouched()


def test_refused_expect_request_without_body_keeps_the_connection(proxy, canaries):
    sock = open_socket(proxy.address)
    reader = _Reader(sock)
    sock.sendall(b"GET http://169.254.169.254/ HTTP/1.1\r\nHost: 169.254.169.254\r\nExpect: 100-continue\r\n\r\n")
    first = read_response(reader)
    assert first.status == 403 and first.sluice_reason == "address_not_public", first
    sock.sendall(b"GET http://public.example/after HTTP/1.1\r\nHost: public.example\r\n\r\n")
    assert read_response(reader).status == 200
    sock.close()
    canaries.assert_untouched()


def test_allowed_expect_request_still_works_with_curl(proxy, net):
    result = curl("-x", proxy.proxy_url, "-H", "Expect: 100-continue", "--data-binary", "x" * 5000,
                  "http://public.example/upload")
    assert result.returncode == 0 and result.status == 200, result.stderr
    assert b"origin ok" in result.body
    [seen] = origin_requests(net)
    assert seen.method == "POST" and seen.path == "/upload" and seen.headers.get("content-length") == "5000"


def test_refused_expect_request_with_curl(proxy, canaries):
    result = curl("-x", proxy.proxy_url, "-H", "Expect: 100-continue", "--data-binary", "x" * 5000,
                  "http://169.254.169.254/upload")
    assert result.status == 403 and result.sluice_reason == "address_not_public", result.stderr
    canaries.assert_untouched()
