"""Request rules through the real proxy (issue 21): every rule form, in every
mode where the proxy sees requests (plain http, CONNECT and SOCKS5 tunnels
intercepted over TLS and plaintext, HTTP/2 inside interception), path
spellings that origins disagree about, case and trailing-slash variants,
what the origin receives (exactly the normalised path), the audit `path`
field, metrics by reason, and host-only rules deciding raw tunnels.

The origin is the two-virtual-host origin of tests/harness/vhosts.py
(a.example intercepted and governed by the rules; c.example allowed, not
intercepted, denied by a host-only rule), which records every request's
target; an HTTP/2-only origin of this module records `:path`.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import threading
import urllib.request
from pathlib import Path

import h2.config
import h2.connection
import h2.events
import pytest
import yaml

from harness import default_policy
from harness.clients import connect, read_response, _Reader, socks5_connect
from harness.vhosts import A, C, MODES, PLAIN_PORT, TLS_PORT, exchange, open_tunnel, start_vhost_origin
from harness.loops import stop_loop_thread

pytestmark = pytest.mark.netns

H2_HOST, H2_IP, H2_PORT = "h2.example", "93.184.215.14", 8943

RULES = f"""\
rules:
  - deny:  {{hosts: [{A}, {H2_HOST}], methods: [DELETE]}}
  - allow: {{hosts: [{A}, {H2_HOST}], methods: [GET, HEAD], paths: ["/repos/acme/**", "/user", "/files/*.txt"]}}
  - allow: {{hosts: [{A}], methods: [POST], paths: ["/repos/acme/*/issues"]}}
  - allow: {{hosts: [{A}], methods: [GET], paths: ["/search"], query: {{q: "*", page: "1"}}}}
  - deny:  {{hosts: [{A}, {H2_HOST}]}}
  - deny:  {{hosts: [{C}]}}
"""
DELETE_LINE, GET_LINE, POST_LINE, QUERY_LINE, REST_LINE, C_LINE = range(2, 8)  # lines within RULES


def policy_text() -> str:
    base = default_policy(ports=[80, 443, PLAIN_PORT, TLS_PORT, H2_PORT])
    base.update({"allow": [A, C, H2_HOST], "intercept": [A, H2_HOST]})
    return yaml.safe_dump(base, sort_keys=False) + RULES


def rule_origin(proxy, line_in_rules: int) -> str:
    offset = policy_text().count("\n") - RULES.count("\n")
    return f"{proxy.policy_file}:{offset + line_in_rules}"


# ------------------------------------------------------------------ an h2 origin


class H2Origin:
    """HTTP/2 only (ALPN h2): answers 200 to every request, recording `:path`."""

    def __init__(self, ctx: ssl.SSLContext) -> None:
        self.ctx, self.paths = ctx, []
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def start(self) -> H2Origin:
        self.thread.start()
        self.server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._serve, H2_IP, H2_PORT, ssl=self.ctx), self.loop).result(10)
        return self

    def stop(self) -> None:
        stop_loop_thread(self.loop, self.thread, [self.server])

    async def _serve(self, reader, writer) -> None:
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding="utf-8"))
        conn.initiate_connection()
        writer.write(conn.data_to_send())
        try:
            while data := await reader.read(65536):
                for event in conn.receive_data(data):
                    if isinstance(event, h2.events.RequestReceived):
                        self.paths.append(dict(event.headers)[":path"])
                        conn.send_headers(event.stream_id, [(":status", "200"), ("content-length", "2")])
                        conn.send_data(event.stream_id, b"ok", end_stream=True)
                writer.write(conn.data_to_send())
        except Exception:
            pass
        finally:
            writer.close()


def h2_request(proxy, sluice_ca: str, method: str, path: str) -> tuple[str, dict]:
    """One HTTP/2 request inside an intercepted CONNECT tunnel: (:status, headers)."""
    response, tunnel = connect(proxy.address, f"{H2_HOST}:{H2_PORT}")
    assert response.status == 200, response
    ctx = ssl.create_default_context(cafile=sluice_ca)
    ctx.set_alpn_protocols(["h2"])
    sock = ctx.wrap_socket(tunnel.sock, server_hostname=H2_HOST)
    sock.settimeout(10)
    try:
        assert sock.selected_alpn_protocol() == "h2"
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        conn.initiate_connection()
        sid = conn.get_next_available_stream_id()
        conn.send_headers(sid, [(":method", method), (":scheme", "https"), (":authority", H2_HOST), (":path", path)],
                          end_stream=True)
        sock.sendall(conn.data_to_send())
        headers: dict = {}
        while True:
            data = sock.recv(65536)
            if not data:
                raise AssertionError("the proxy closed the h2 connection")
            for event in conn.receive_data(data):
                if isinstance(event, h2.events.ResponseReceived):
                    headers = dict(event.headers)
                elif isinstance(event, h2.events.DataReceived):
                    conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                elif isinstance(event, (h2.events.StreamEnded, h2.events.StreamReset)):
                    return headers.get(":status"), headers
            sock.sendall(conn.data_to_send())
    finally:
        sock.close()


# ------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def origin(net, tls_ca, fake_dns):
    server = start_vhost_origin(tls_ca, fake_dns)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def h2_origin(net, tls_ca, fake_dns):
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls_ca.ca.issue_cert(H2_HOST).configure_cert(ctx)
    ctx.set_alpn_protocols(["h2"])
    fake_dns.set(H2_HOST, a=[H2_IP], ttl=300)
    server = H2Origin(ctx).start()
    yield server
    server.stop()


@pytest.fixture(autouse=True)
def fresh(origin):
    origin.reset()
    yield


@pytest.fixture(scope="module")
def proxy(sluice_factory, origin, h2_origin, tls_ca):
    return sluice_factory(policy_text(), socks=True, name="rules",
                          extra_args=("--set", f"ssl_verify_upstream_trusted_ca={tls_ca.cafile}"))


@pytest.fixture(scope="module")
def sluice_ca(proxy, sluice_home) -> str:
    return str(Path(sluice_home) / ".sluice" / "ca" / "mitmproxy-ca-cert.pem")


def raw_request(method: str, target: str, host: str = A) -> bytes:
    return f"{method} {target} HTTP/1.1\r\nHost: {host}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".encode()


def send(proxy, sluice_ca: str, mode: str, method: str, target: str):
    """One request to a.example as `mode` meets it: 'http' is a plain http
    request to the proxy (absolute-form), the others go inside a tunnel."""
    if mode == "http":
        sock = socket.create_connection(proxy.address, timeout=10)
        absolute = f"http://{A}:{PLAIN_PORT}{target}"
        sock.sendall(raw_request(method, absolute).replace(f"Host: {A}".encode(), f"Host: {A}:{PLAIN_PORT}".encode()))
        reader = _Reader(sock)
        try:
            return read_response(reader, method=method)
        finally:
            sock.close()
    outcome = exchange(open_tunnel(proxy, mode, sluice_ca), [raw_request(method, target)], method=method)
    assert outcome.kind == "response", outcome
    return outcome.response


ALL_MODES = ("http",) + MODES

# (method, target as sent, what the origin receives (None: refused), deciding rule line)
CASES = [
    ("GET", "/repos/acme/widget", "/repos/acme/widget", GET_LINE),
    ("HEAD", "/user", "/user", GET_LINE),
    ("GET", "/repos//acme/./widget/../gadget", "/repos/acme/gadget", GET_LINE),
    ("GET", "/%72epos/acme/%7Euser", "/repos/acme/~user", GET_LINE),
    ("GET", "/repos/acme/widget?per_page=100&q=a%2Fb", "/repos/acme/widget?per_page=100&q=a%2Fb", GET_LINE),
    ("GET", "/files/notes.txt", "/files/notes.txt", GET_LINE),
    ("POST", "/repos/acme/widget/issues", "/repos/acme/widget/issues", POST_LINE),
    ("GET", "/search?q=sluice&page=1", "/search?q=sluice&page=1", QUERY_LINE),
    ("GET", "/search?q=sluice&page=2", None, REST_LINE),
    ("GET", "/search?page=1", None, REST_LINE),
    ("GET", "/user/", None, REST_LINE),  # trailing slash
    ("GET", "/User", None, REST_LINE),  # case
    ("GET", "/repos/ACME/widget", None, REST_LINE),
    ("GET", "/files/a/notes.txt", None, REST_LINE),
    ("DELETE", "/repos/acme/widget", None, DELETE_LINE),
    ("POST", "/repos/acme/widget/pulls", None, REST_LINE),
    ("GET", "/repos/acme/../../admin", None, REST_LINE),  # normalised to /admin
]


@pytest.mark.parametrize("mode", ALL_MODES)
@pytest.mark.parametrize("method, target, received, line", CASES, ids=[f"{c[0]} {c[1]}" for c in CASES])
def test_every_rule_form_in_every_mode(proxy, origin, sluice_ca, mode, method, target, received, line):
    mark = proxy.audit_mark()
    response = send(proxy, sluice_ca, mode, method, target)
    e = proxy.wait_audit(lambda e: e["event"] == "request" and e["host"] == A, since=mark, what="the request line")
    assert e["rule"] == rule_origin(proxy, line), e
    if received is None:
        assert response.status == 403 and response.headers.get("sluice-reason") == "rule_denied", response
        assert rule_origin(proxy, line) in response.text
        assert origin.seen() == []
        assert (e["decision"], e["reason"]) == ("refuse", "rule_denied")
    else:
        assert response.status == 200 and "x-vhost" in response.headers, response
        assert [s.target for s in origin.seen()] == [received]
        assert e["decision"] == "allow" and e["path"] == received.split("?")[0]


HOSTILE = ["/repos/acme%2Fwidget", "/repos/acme%2fwidget", "/repos/acme/%2E%2E/x", "/repos/acme/%2e%2e/x",
           "/repos\\acme\\widget", "/repos/acme%5Cwidget", "/repos/acme;jsessionid=1/widget", "/repos/acme/w;x"]


@pytest.mark.parametrize("mode", ALL_MODES)
@pytest.mark.parametrize("target", HOSTILE)
def test_hostile_path_spellings_never_reach_the_origin(proxy, origin, sluice_ca, mode, target):
    mark = proxy.audit_mark()
    response = send(proxy, sluice_ca, mode, "GET", target)
    assert response.status == 403 and response.headers.get("sluice-reason") == "rule_denied", response
    assert "send it again" in response.text
    assert origin.seen() == []
    e = proxy.wait_audit(lambda e: e["event"] == "request" and e["host"] == A, since=mark, what="the refusal line")
    assert e["path"] == target and e["reason"] == "rule_denied"


def test_http2_path_is_judged_and_forwarded_normalised(proxy, h2_origin, sluice_ca):
    h2_origin.paths.clear()
    status, _ = h2_request(proxy, sluice_ca, "GET", "/repos//acme/./x/../widget?x=1")
    assert status == "200"
    assert h2_origin.paths == ["/repos/acme/widget?x=1"]
    status, headers = h2_request(proxy, sluice_ca, "GET", "/repos/acme%2Fwidget")
    assert status == "403" and headers.get("sluice-reason") == "rule_denied"
    status, headers = h2_request(proxy, sluice_ca, "DELETE", "/repos/acme/widget")
    assert status == "403" and headers.get("sluice-reason") == "rule_denied"
    status, headers = h2_request(proxy, sluice_ca, "GET", "/Repos/acme/widget")
    assert status == "403"
    assert h2_origin.paths == ["/repos/acme/widget?x=1"]


def test_a_host_only_rule_decides_raw_tunnels(proxy, origin):
    mark = proxy.audit_mark()
    response, tunnel = connect(proxy.address, f"{C}:{TLS_PORT}")
    assert tunnel is None and response.status == 403 and response.headers.get("sluice-reason") == "rule_denied"
    e = proxy.wait_audit(lambda e: e["event"] == "connect" and e["host"] == C, since=mark, what="the CONNECT line")
    assert e["rule"] == rule_origin(proxy, C_LINE) and e["path"] is None
    result = socks5_connect(proxy.socks_address, C, PLAIN_PORT)
    assert not result.ok and result.reply == 2
    assert origin.seen() == []


def test_audit_path_is_capped_and_refusals_are_counted(proxy, origin, sluice_ca):
    long = "/repos/acme/" + "a" * 700
    mark = proxy.audit_mark()
    assert send(proxy, sluice_ca, "connect-plain", "GET", long + "?q=1").status == 200
    e = proxy.wait_audit(lambda e: e["event"] == "request" and e["host"] == A, since=mark, what="the request line")
    assert e["path"] == long[:512]
    metrics = urllib.request.urlopen(proxy.admin_url + "/metrics", timeout=5).read().decode()
    counted = [line for line in metrics.splitlines()
               if line.startswith("sluice_requests_total{") and 'reason="rule_denied"' in line]
    assert counted and sum(float(line.rsplit(" ", 1)[1]) for line in counted) > 0, counted


# ------------------------------------------------------------------ learn mode, end to end


SESSION = [  # (method, target): a recorded agent session against a.example
    ("GET", "/user"),
    *[("GET", f"/repos/acme/widget/issues/{n}") for n in (1, 2, 3)],
    ("POST", "/repos/acme/widget/issues"),
    *[("GET", f"/repos/acme/{name}/readme") for name in ("alpha", "beta", "gamma", "delta", "epsilon", "zeta")],
    ("GET", "/orgs/acme/members?page=2"),
]
OUTSIDE = [("DELETE", "/repos/acme/widget"), ("GET", "/admin"), ("POST", "/repos/acme/widget/pulls")]


def learning_policy(action: str) -> str:
    base = default_policy(ports=[80, 443, PLAIN_PORT, TLS_PORT])
    base.update({"action": action, "allow": [C], "intercept": [A]})
    return "# learned from a session\n" + yaml.safe_dump(base, sort_keys=False)


def play(proxy, sluice_ca: str, session) -> list[int]:
    return [send(proxy, sluice_ca, "connect-tls", method, target).status for method, target in session]


def test_suggest_end_to_end(sluice_factory, origin, tls_ca, sluice_ca, tmp_path):
    import subprocess

    from harness.sluice import sluice_executable

    trust = ("--set", f"ssl_verify_upstream_trusted_ca={tls_ca.cafile}")
    learner = sluice_factory(learning_policy("report"), name="learner", extra_args=trust)
    assert play(learner, sluice_ca, SESSION) == [200] * len(SESSION)  # report mode: everything passes
    learner.wait_audit(lambda e: e["event"] == "tunnel", since=len(learner.audit()) - 1, what="the last tunnel line")
    assert any(e.get("would_refuse") for e in learner.audit())
    learner.stop()

    policy = tmp_path / "policy.yaml"
    policy.write_text(learning_policy("report"))
    done = subprocess.run([sluice_executable(), "policy", "suggest", "--policy", str(policy), "--audit",
                           str(learner.audit_file), "--apply"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    text = policy.read_text()
    assert text.startswith("# learned from a session\n")
    assert f"- deny: {{hosts: [{A}]}}" in text and '"/repos/acme/**"' in text and '"/repos/acme/widget/issues"' in text

    enforced = sluice_factory(text.replace("action: report", "action: enforce"), name="enforced", extra_args=trust)
    mark = enforced.audit_mark()
    assert play(enforced, sluice_ca, SESSION) == [200] * len(SESSION)
    assert play(enforced, sluice_ca, OUTSIDE) == [403] * len(OUTSIDE)
    lines = [e for e in enforced.audit()[mark:] if e["event"] == "request"]
    refused = [(e["method"], e["path"], e["reason"]) for e in lines if e["decision"] == "refuse"]
    assert refused == [(m, t, "rule_denied") for m, t in OUTSIDE], refused
    enforced.stop()
