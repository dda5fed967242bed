"""Proxy-held credentials (issue 13), end to end in the namespace.

An origin of this module's own on 1.1.1.1 (TLS on 9443 with a trustme
certificate for its names, plain HTTP on 9080) records the headers of every
request. Four names under example.com point at it: api (a credential from a
file, HTTPS only), plain (the same file, allow_plain_http), env (a credential
from an environment variable, with a format) and other (no credential). All
four are intercepted. The checks: the header arrives at the right host with
the file's value, replacing the client's; no other host ever receives it (a
redirect, a second host on one client connection, a CONNECT to another host,
domain fronting); plain HTTP is refused unless allowed; a changed file is
used without a restart, and a missing one is a reload failure that keeps the
last good value and policy; the secret is in no audit line, no stderr line
and no CLI output.
"""

from __future__ import annotations

import asyncio
import json
import os
import ssl
import subprocess
import threading
from pathlib import Path

import httpx
import pytest

from harness import default_policy
from harness.clients import clean_env, connect, read_response, open_socket, _Reader
from harness.sluice import sluice_executable
from harness.wait import wait_until
from harness.loops import stop_loop_thread

pytestmark = pytest.mark.netns

ORIGIN_IP = "1.1.1.1"
TLS_PORT, PLAIN_PORT = 9443, 9080
API, PLAIN, ENVHOST, OTHER = "api.example.com", "plain.example.com", "env.example.com", "other.example.com"
NAMES = (API, PLAIN, ENVHOST, OTHER)
SECRET = "sk-file-4f1d9c2be07a61"
NEW_SECRET = "sk-file-rotated-88e2a5"
ENV_SECRET = "sk-env-93b7c1d4e5"
ENV_NAME = "SLUICE_TEST_CREDENTIAL_TOKEN"
AGENT_GUESS = "agent-own-value"
FAST_POLL = ("--set", "sluice_policy_poll=0.2")


def policy_text(secret_file: Path) -> str:
    base = default_policy(ports=[80, 443, TLS_PORT, PLAIN_PORT])
    return f"""\
version: 1
ports: {json.dumps(base["ports"])}
dns: {json.dumps(base["dns"])}
allow: {json.dumps(list(NAMES))}
intercept: {json.dumps(list(NAMES))}
credentials:
  - hosts: [{API}]
    set_headers:
      X-Api-Key: {{file: {secret_file}}}
  - hosts: [{PLAIN}]
    set_headers:
      X-Api-Key: {{file: {secret_file}}}
    allow_plain_http: true
  - hosts: [{ENVHOST}]
    set_headers:
      Authorization: {{env: {ENV_NAME}, format: "Bearer {{}}"}}
"""


API_ENTRY_LINE, PLAIN_ENTRY_LINE, ENV_ENTRY_LINE = 7, 10, 14


# ------------------------------------------------------------------ the origin


class RecordingOrigin:
    """Answers every request with 200 JSON, or `/redirect?to=URL` with a 302;
    records (sni, port, target, headers) of each request."""

    def __init__(self, server_ctx: ssl.SSLContext):
        self.server_ctx = server_ctx
        server_ctx.sni_callback = self._on_sni
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="cred-origin", daemon=True)
        self._seen: list[dict] = []
        self._lock = threading.Lock()

    @staticmethod
    def _on_sni(sslobj, server_name, _ctx):
        sslobj.sluice_sni = server_name

    def start(self) -> RecordingOrigin:
        self.thread.start()

        async def serve():
            self.servers = [
                await asyncio.start_server(lambda r, w: self._handle(r, w, TLS_PORT), ORIGIN_IP, TLS_PORT,
                                           ssl=self.server_ctx),
                await asyncio.start_server(lambda r, w: self._handle(r, w, PLAIN_PORT), ORIGIN_IP, PLAIN_PORT),
            ]
        asyncio.run_coroutine_threadsafe(serve(), self.loop).result(10)
        return self

    def stop(self) -> None:
        stop_loop_thread(self.loop, self.thread, self.servers)

    def seen(self, host: str | None = None) -> list[dict]:
        with self._lock:
            return [s for s in self._seen if host is None or s["host"] == host]

    def reset(self) -> None:
        with self._lock:
            self._seen.clear()

    async def _handle(self, reader, writer, port):
        sslobj = writer.get_extra_info("ssl_object")
        sni = getattr(sslobj, "sluice_sni", None) if sslobj is not None else None
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, target, _ = lines[0].split(" ", 2)
                headers: dict[str, list[str]] = {}
                for line in lines[1:]:
                    if line:
                        k, _, v = line.partition(":")
                        headers.setdefault(k.strip().lower(), []).append(v.strip())
                host = (headers.get("host") or [""])[0].rsplit(":", 1)[0].lower()
                with self._lock:
                    self._seen.append({"sni": sni, "port": port, "host": host, "target": target, "headers": headers})
                if target.startswith("/redirect?to="):
                    location = target.split("=", 1)[1]
                    writer.write(f"HTTP/1.1 302 Found\r\nLocation: {location}\r\nContent-Length: 0\r\n\r\n".encode())
                else:
                    body = json.dumps({"host": host, "target": target}).encode()
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Origin: yes\r\n"
                                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
                await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, OSError, ssl.SSLError,
                ValueError):
            return
        finally:
            writer.close()


def api_keys(seen: dict) -> list[str]:
    return seen["headers"].get("x-api-key", [])


# ------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def origin(net, tls_ca, fake_dns):
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls_ca.ca.issue_cert(*NAMES).configure_cert(ctx)
    for name in NAMES:
        fake_dns.set(name, a=[ORIGIN_IP], ttl=300)
    server = RecordingOrigin(ctx).start()
    yield server
    server.stop()


@pytest.fixture(autouse=True)
def fresh(origin):
    origin.reset()


@pytest.fixture(scope="module")
def env_secret():
    os.environ[ENV_NAME] = ENV_SECRET  # the proxy subprocess inherits it (harness clean_env)
    yield
    os.environ.pop(ENV_NAME, None)


@pytest.fixture(scope="module")
def secret_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("creds") / "api-key"
    path.write_text(SECRET + "\n")
    return path


@pytest.fixture(scope="module")
def proxy(sluice_factory, origin, tls_ca, env_secret, secret_file):
    return sluice_factory(policy_text(secret_file), name="creds",
                          extra_args=("--set", f"ssl_verify_upstream_trusted_ca={tls_ca.cafile}"))


@pytest.fixture(scope="module")
def sluice_ca(proxy, sluice_home) -> str:
    return str(Path(sluice_home) / ".sluice" / "ca" / "mitmproxy-ca-cert.pem")


def client(proxy, sluice_ca, **kw) -> httpx.Client:
    return httpx.Client(proxy=proxy.proxy_url, verify=ssl.create_default_context(cafile=sluice_ca), trust_env=False,
                        timeout=10, **kw)


def tls_tunnel(proxy, sluice_ca, connect_to: str, sni: str | None = None):
    response, tunnel = connect(proxy.address, f"{connect_to}:{TLS_PORT}", timeout=10)
    assert response.status == 200 and tunnel is not None, response
    tunnel.start_tls(sni or connect_to, sluice_ca)
    return tunnel


def send(tunnel_or_reader, sock, raw: str):
    sock.sendall(raw.encode())
    return read_response(tunnel_or_reader)


# ------------------------------------------------------------------ the header arrives, replacing the client's


def test_the_header_arrives_with_the_files_value_replacing_the_clients(proxy, origin, sluice_ca):
    mark = proxy.audit_mark()
    with client(proxy, sluice_ca) as c:
        r = c.get(f"https://{API}:{TLS_PORT}/search?q=x", headers={"X-Api-Key": AGENT_GUESS})
    assert r.status_code == 200 and r.headers.get("x-origin") == "yes", r.text
    [seen] = origin.seen(API)
    assert api_keys(seen) == [SECRET], seen  # one field, the proxy's value: the client's is gone
    line = proxy.wait_audit(lambda e: e["event"] == "request" and e["host"] == API, since=mark)
    assert line["decision"] == "allow" and line["credential"] == f"{proxy.policy_file}:{API_ENTRY_LINE}", line


def test_the_header_is_replaced_whatever_its_case_or_count(proxy, origin, sluice_ca):
    tunnel = tls_tunnel(proxy, sluice_ca, API)
    r = send(tunnel.reader, tunnel.sock,
             f"GET /x HTTP/1.1\r\nHost: {API}:{TLS_PORT}\r\nx-api-key: a\r\nX-API-KEY: b\r\n\r\n")
    tunnel.close()
    assert r.status == 200
    [seen] = origin.seen(API)
    assert api_keys(seen) == [SECRET], seen


def test_an_environment_value_with_its_format(proxy, origin, sluice_ca):
    mark = proxy.audit_mark()
    with client(proxy, sluice_ca) as c:
        r = c.get(f"https://{ENVHOST}:{TLS_PORT}/", headers={"Authorization": "Bearer " + AGENT_GUESS})
    assert r.status_code == 200
    [seen] = origin.seen(ENVHOST)
    assert seen["headers"]["authorization"] == ["Bearer " + ENV_SECRET] and not api_keys(seen), seen
    line = proxy.wait_audit(lambda e: e["event"] == "request" and e["host"] == ENVHOST, since=mark)
    assert line["credential"] == f"{proxy.policy_file}:{ENV_ENTRY_LINE}", line


def test_a_host_without_an_entry_gets_nothing_and_keeps_the_clients_header(proxy, origin, sluice_ca):
    mark = proxy.audit_mark()
    with client(proxy, sluice_ca) as c:
        r = c.get(f"https://{OTHER}:{TLS_PORT}/", headers={"X-Api-Key": AGENT_GUESS})
    assert r.status_code == 200
    [seen] = origin.seen(OTHER)
    assert api_keys(seen) == [AGENT_GUESS] and "authorization" not in seen["headers"], seen
    line = proxy.wait_audit(lambda e: e["event"] == "request" and e["host"] == OTHER, since=mark)
    assert line["credential"] is None, line


# ------------------------------------------------------------------ never to another host


def test_a_redirect_to_another_host_does_not_carry_it(proxy, origin, sluice_ca):
    with client(proxy, sluice_ca, follow_redirects=True) as c:
        r = c.get(f"https://{API}:{TLS_PORT}/redirect?to=https://{OTHER}:{TLS_PORT}/landed")
    assert r.status_code == 200 and r.json()["host"] == OTHER, r.text
    [first] = origin.seen(API)
    [landed] = origin.seen(OTHER)
    assert api_keys(first) == [SECRET]
    assert landed["target"] == "/landed" and not api_keys(landed), landed


def test_a_second_host_on_the_same_client_connection_does_not_get_it(proxy, origin):
    """Plain HTTP keep-alive on the front door: plain.example.com (allowed in
    clear) gets the header, then other.example.com on the same connection
    does not; then plain.example.com again does."""
    with open_socket(proxy.address, 10) as s:
        reader = _Reader(s)
        for host in (PLAIN, OTHER, PLAIN):
            r = send(reader, s, f"GET http://{host}:{PLAIN_PORT}/k HTTP/1.1\r\nHost: {host}:{PLAIN_PORT}\r\n\r\n")
            assert r.status == 200, r
    seen = origin.seen()
    assert [s["host"] for s in seen] == [PLAIN, OTHER, PLAIN]
    assert [api_keys(s) for s in seen] == [[SECRET], [], [SECRET]], seen


def test_another_host_inside_the_credentials_hosts_tunnel_is_refused(proxy, origin, sluice_ca):
    """Inside api.example.com's tunnel a request naming other.example.com (Host,
    or absolute-form) is host_mismatch: it never reaches any origin."""
    tunnel = tls_tunnel(proxy, sluice_ca, API)
    first = send(tunnel.reader, tunnel.sock, f"GET /one HTTP/1.1\r\nHost: {API}:{TLS_PORT}\r\n\r\n")
    assert first.status == 200
    second = send(tunnel.reader, tunnel.sock, f"GET /two HTTP/1.1\r\nHost: {OTHER}:{TLS_PORT}\r\n\r\n")
    assert second.status == 403 and second.sluice_reason == "host_mismatch", second
    tunnel.close()
    assert [s["target"] for s in origin.seen()] == ["/one"]


def test_a_connect_to_another_host_never_carries_it(proxy, origin, sluice_ca):
    tunnel = tls_tunnel(proxy, sluice_ca, OTHER)
    r = send(tunnel.reader, tunnel.sock, f"GET /o HTTP/1.1\r\nHost: {OTHER}:{TLS_PORT}\r\n\r\n")
    assert r.status == 200
    # Fronting: the Host names the credentials host inside other.example.com's tunnel.
    fronted = send(tunnel.reader, tunnel.sock, f"GET /f HTTP/1.1\r\nHost: {API}:{TLS_PORT}\r\n\r\n")
    assert fronted.status == 403 and fronted.sluice_reason == "host_mismatch", fronted
    tunnel.close()
    seen = origin.seen()
    assert [s["target"] for s in seen] == ["/o"] and not api_keys(seen[0]), seen


def test_domain_fronting_by_sni_or_absolute_form_never_carries_it(proxy, origin, sluice_ca):
    # The TLS server name names the credentials host inside other.example.com's tunnel.
    response, tunnel = connect(proxy.address, f"{OTHER}:{TLS_PORT}", timeout=10)
    assert response.status == 200
    try:
        tunnel.start_tls(API, sluice_ca)
        r = send(tunnel.reader, tunnel.sock, f"GET /sni HTTP/1.1\r\nHost: {API}:{TLS_PORT}\r\n\r\n")
        assert r.status == 403 and r.sluice_reason == "host_mismatch", r
    except (ssl.SSLError, ConnectionError, OSError):
        pass  # refused during the handshake: nothing was sent either
    finally:
        tunnel.close()
    # An absolute-form target naming the credentials host inside other's tunnel.
    tunnel = tls_tunnel(proxy, sluice_ca, OTHER)
    r = send(tunnel.reader, tunnel.sock,
             f"GET https://{API}:{TLS_PORT}/abs HTTP/1.1\r\nHost: {OTHER}:{TLS_PORT}\r\n\r\n")
    tunnel.close()
    assert r.status == 403 and r.sluice_reason == "host_mismatch", r
    assert origin.seen() == []


# ------------------------------------------------------------------ plain HTTP


def test_plain_http_to_a_credentials_host_is_refused_unless_allowed(proxy, origin):
    mark = proxy.audit_mark()
    with httpx.Client(proxy=proxy.proxy_url, trust_env=False, timeout=10) as c:
        refused = c.get(f"http://{API}:{PLAIN_PORT}/clear", headers={"X-Api-Key": AGENT_GUESS})
        allowed = c.get(f"http://{PLAIN}:{PLAIN_PORT}/clear")
    assert refused.status_code == 403 and refused.headers["sluice-reason"] == "credential_plain_http", refused.text
    assert "HTTPS" in refused.text and SECRET not in refused.text
    assert allowed.status_code == 200
    seen = origin.seen()
    assert [s["host"] for s in seen] == [PLAIN] and api_keys(seen[0]) == [SECRET], seen
    line = proxy.wait_audit(lambda e: e.get("reason") == "credential_plain_http", since=mark)
    assert line["decision"] == "refuse" and line["host"] == API and line["credential"] is None, line
    assert line["rule"] == f"{proxy.policy_file}:{API_ENTRY_LINE}", line
    ok = proxy.wait_audit(lambda e: e["event"] == "request" and e["host"] == PLAIN, since=mark)
    assert ok["credential"] == f"{proxy.policy_file}:{PLAIN_ENTRY_LINE}", ok


def test_plain_http_inside_an_intercepted_tunnel_is_refused_too(proxy, origin):
    response, tunnel = connect(proxy.address, f"{API}:{PLAIN_PORT}", timeout=10)
    assert response.status == 200
    r = send(tunnel.reader, tunnel.sock, f"GET /in-clear HTTP/1.1\r\nHost: {API}:{PLAIN_PORT}\r\n\r\n")
    tunnel.close()
    assert r.status == 403 and r.sluice_reason == "credential_plain_http", r
    assert origin.seen() == []


# ------------------------------------------------------------------ reloads


def write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)



@pytest.fixture
def reloading(sluice_factory, origin, tls_ca, env_secret, tmp_path):
    secret = tmp_path / "rotating-key"
    secret.write_text(SECRET + "\n")
    proxy = sluice_factory(policy_text(secret), name="creds-reload",
                           extra_args=(*FAST_POLL, "--set", f"ssl_verify_upstream_trusted_ca={tls_ca.cafile}"))
    yield proxy, secret
    proxy.stop()


def sent_key(proxy, sluice_ca, origin) -> list[str]:
    origin.reset()
    with client(proxy, sluice_ca) as c:
        assert c.get(f"https://{API}:{TLS_PORT}/k").status_code == 200
    return api_keys(origin.seen(API)[-1])


def test_a_changed_secret_file_is_used_without_a_restart(reloading, origin, sluice_home):
    proxy, secret = reloading
    ca = str(Path(sluice_home) / ".sluice" / "ca" / "mitmproxy-ca-cert.pem")
    assert sent_key(proxy, ca, origin) == [SECRET]
    mark = proxy.audit_mark()
    write_atomically(secret, NEW_SECRET + "\n")
    assert wait_until(lambda: sent_key(proxy, ca, origin) == [NEW_SECRET])
    proxy.wait_audit(lambda e: e["event"] == "reload" and e["decision"] == "ok" and str(secret) in e["detail"],
                     since=mark)
    # In place, not by rename (an editor that truncates and writes).
    secret.write_text(SECRET + "\n")
    assert wait_until(lambda: sent_key(proxy, ca, origin) == [SECRET])


def test_a_missing_secret_file_is_a_reload_failure_keeping_the_last_good_policy(reloading, origin, sluice_home):
    proxy, secret = reloading
    ca = str(Path(sluice_home) / ".sluice" / "ca" / "mitmproxy-ca-cert.pem")
    mark, err_mark = proxy.audit_mark(), proxy.stderr_mark()
    secret.unlink()
    failed = proxy.wait_audit(lambda e: e["event"] == "reload" and e["decision"] == "failed", since=mark)
    assert str(secret) in failed["detail"] and "missing" in failed["detail"], failed
    assert sent_key(proxy, ca, origin) == [SECRET]  # the last good value
    # A policy edit while the file is missing: the whole reload is refused.
    mark = proxy.audit_mark()
    edited = policy_text(secret).replace(f"allow: {json.dumps(list(NAMES))}", f"allow: {json.dumps(list(NAMES[:3]))}")
    write_atomically(proxy.policy_file, edited)
    failed = proxy.wait_audit(lambda e: e["event"] == "reload" and e["decision"] == "failed"
                              and "cannot read" in (e["detail"] or ""), since=mark)
    assert "'X-Api-Key': cannot read" in failed["detail"] and "No such file" in failed["detail"], failed
    assert wait_until(lambda: "reload refused" in proxy.stderr_since(err_mark))
    with client(proxy, ca) as c:  # other.example.com is still allowed: the last good policy holds
        assert c.get(f"https://{OTHER}:{TLS_PORT}/still").status_code == 200
    assert sent_key(proxy, ca, origin) == [SECRET]
    # The file comes back with a new value: the edited policy loads with it.
    mark = proxy.audit_mark()
    write_atomically(secret, NEW_SECRET + "\n")
    proxy.wait_audit(lambda e: e["event"] == "reload" and e["decision"] == "ok", since=mark)
    assert wait_until(lambda: sent_key(proxy, ca, origin) == [NEW_SECRET])

    def other_refused() -> bool:
        try:
            with client(proxy, ca) as c:
                c.get(f"https://{OTHER}:{TLS_PORT}/now-refused")
        except httpx.ProxyError as e:  # the CONNECT is refused
            return "host_not_allowed" in str(e)
        return False
    assert wait_until(other_refused)  # the policy edit refused earlier loads now that its file is back
    assert all(SECRET not in line and NEW_SECRET not in line for line in proxy.stderr_text().splitlines())


# ------------------------------------------------------------------ the secret is nowhere else


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = clean_env()
    env[ENV_NAME] = ENV_SECRET
    return subprocess.run([sluice_executable(), *args], capture_output=True, text=True, env=env, timeout=60)


def test_the_secret_is_in_no_audit_line_stderr_line_or_cli_output(proxy, origin, secret_file, tmp_path):
    with client(proxy, Path(proxy.home) / ".sluice" / "ca" / "mitmproxy-ca-cert.pem") as c:
        c.get(f"https://{API}:{TLS_PORT}/last")
        c.get(f"https://{ENVHOST}:{TLS_PORT}/last")
    with httpx.Client(proxy=proxy.proxy_url, trust_env=False, timeout=10) as c:
        c.get(f"http://{API}:{PLAIN_PORT}/refused")
    assert any(api_keys(s) == [SECRET] for s in origin.seen())  # the secret did travel, to the origin only
    texts = {
        "audit": proxy.audit_file.read_text(),
        "stderr": proxy.stderr_text(),
        "stdout": proxy.stdout_file.read_text(),
    }
    outputs = [
        run_cli("policy", "check", "--strict", str(proxy.policy_file)),
        run_cli("policy", "explain", "--policy", str(proxy.policy_file), "--resolve", f"{API}={ORIGIN_IP}",
                f"https://{API}:{TLS_PORT}/"),
        run_cli("policy", "explain", "--policy", str(proxy.policy_file), "--resolve", f"{API}={ORIGIN_IP}",
                f"http://{API}:{PLAIN_PORT}/"),
        run_cli("policy", "explain", "--policy", str(proxy.policy_file), "--resolve", f"{ENVHOST}={ORIGIN_IP}",
                f"https://{ENVHOST}:{TLS_PORT}/"),
    ]
    cases = tmp_path / "cases.yaml"
    cases.write_text(f"- url: https://{API}:{TLS_PORT}/\n  resolve: {{{API}: {ORIGIN_IP}}}\n  expect: allow\n"
                     f"- url: http://{API}:{PLAIN_PORT}/\n  resolve: {{{API}: {ORIGIN_IP}}}\n  expect: refuse\n"
                     f"  reason: credential_plain_http\n")
    outputs.append(run_cli("policy", "test", "-v", str(proxy.policy_file), str(cases)))
    assert [o.returncode for o in outputs] == [0, 0, 3, 0, 0], [(o.returncode, o.stdout, o.stderr) for o in outputs]
    explained = json.loads(outputs[1].stdout)
    assert explained["credential"] == {"entry": f"{proxy.policy_file}:{API_ENTRY_LINE}", "headers": ["X-Api-Key"],
                                       "allow_plain_http": False}, explained
    assert json.loads(outputs[2].stdout)["reason"] == "credential_plain_http"
    for i, o in enumerate(outputs):
        texts[f"cli {i} stdout"], texts[f"cli {i} stderr"] = o.stdout, o.stderr
    for where, text in texts.items():
        for secret in (SECRET, ENV_SECRET):
            assert secret not in text, f"the secret is in the {where}"
    assert '"credential":' in texts["audit"]
