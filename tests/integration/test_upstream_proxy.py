"""A parent proxy that cannot re-resolve (issue 26 item 4), end to end in the
namespace with a real parent: Debian's tinyproxy, started here on 10.0.0.2 (a
private address added to `lo`), logging every request it gets.

Sluice decides and resolves as always, then CONNECTs through the parent to
the pinned IP: the parent sees only IP literals, for tunnels and plain http
alike (one tunnel carries a keep-alive client's requests), for SOCKS5 too;
refused traffic never reaches it; interception and proxy-held credentials
work through it; a parent that is down, refuses the port (403) or wants
credentials (407) is `upstream_proxy_failed` naming what it answered; Basic
credentials from a file log in; a reloaded `upstream_proxy` applies to new
connections.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from harness import default_policy, free_port
from harness.clients import _Reader, curl, open_socket, read_response, socks5_connect
from harness.wait import wait_until

pytestmark = pytest.mark.netns

PARENT_IP = "10.0.0.2"  # private, like a corporate proxy's address: reachable only as the parent
ORIGIN_IP = "8.8.8.8"
TUNNEL, INTERCEPTED, DENIED = "up.example.com", "upx.example.com", "denied.example.com"
PARENT_USER, PARENT_PASSWORD = "sluice", "parent-pw-7c41e9"
API_KEY = "sk-through-parent-5d2e"
TINYPROXY = shutil.which("tinyproxy") or "/usr/bin/tinyproxy"
FAST_POLL = ("--set", "sluice_policy_poll=0.2")


class Tinyproxy:
    """tinyproxy in the foreground on (PARENT_IP, port), CONNECT allowed to
    `connect_ports` only (as Squid's SSL_ports and tinyproxy's ConnectPort do
    by default for 443), optionally with Basic auth; its log is parsed."""

    def __init__(self, workdir: Path, port: int, connect_ports=(80, 443), basic_auth: tuple[str, str] | None = None):
        self.port = port
        self.log = workdir / f"tinyproxy-{port}.log"
        self.conf = workdir / f"tinyproxy-{port}.conf"
        lines = [f"Port {port}", f"Listen {PARENT_IP}", "Timeout 60", f'LogFile "{self.log}"', "LogLevel Info",
                 "MaxClients 50", "Allow 127.0.0.0/8", "Allow 10.0.0.0/8", "DisableViaHeader Yes",
                 *(f"ConnectPort {p}" for p in connect_ports)]
        if basic_auth:
            lines.append(f"BasicAuth {basic_auth[0]} {basic_auth[1]}")
        self.conf.write_text("\n".join(lines) + "\n")
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{PARENT_IP}:{self.port}"

    def start(self) -> Tinyproxy:
        self.proc = subprocess.Popen([TINYPROXY, "-d", "-c", str(self.conf)], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)

        def accepting() -> bool:
            try:
                socket.create_connection((PARENT_IP, self.port), timeout=1).close()
                return True
            except OSError:
                return False
        wait_until(accepting, timeout=10, what=f"tinyproxy listening on {PARENT_IP}:{self.port}")
        wait_until(lambda: self.connections() >= 1, what="tinyproxy logging the probe connection")
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)

    def _lines(self) -> list[str]:
        return self.log.read_text(errors="replace").splitlines() if self.log.exists() else []

    def connections(self) -> int:
        return sum(1 for line in self._lines() if re.search(r"\bConnect \(file descriptor \d+\)", line))

    def requests(self) -> list[str]:
        """Every request line the parent received ("CONNECT 8.8.8.8:443 HTTP/1.1")."""
        return [m.group(1) for line in self._lines() if (m := re.search(r"Request \(file descriptor \d+\): (.*)$",
                                                                         line))]


@pytest.fixture(scope="module")
def parent_address(netns):
    """10.0.0.2 on `lo` for this module (10.0.0.1 is a canary)."""
    subprocess.run(["ip", "addr", "add", f"{PARENT_IP}/32", "dev", "lo"], check=True, capture_output=True)
    yield
    subprocess.run(["ip", "addr", "del", f"{PARENT_IP}/32", "dev", "lo"], check=False, capture_output=True)


@pytest.fixture(scope="module")
def names(fake_dns):
    for name in (TUNNEL, INTERCEPTED, DENIED):
        fake_dns.set(name, a=[ORIGIN_IP], ttl=300)


@pytest.fixture(scope="module")
def parents(parent_address, tmp_path_factory):
    """The open parent (CONNECT to 80 and 443 only) and one asking for Basic credentials."""
    workdir = tmp_path_factory.mktemp("parents")
    started = [Tinyproxy(workdir, free_port()).start(),
               Tinyproxy(workdir, free_port(), basic_auth=(PARENT_USER, PARENT_PASSWORD)).start()]
    yield started
    for parent in started:
        parent.stop()


@pytest.fixture(scope="module")
def open_parent(parents) -> Tinyproxy:
    return parents[0]


@pytest.fixture(scope="module")
def auth_parent(parents) -> Tinyproxy:
    return parents[1]


@pytest.fixture(scope="module")
def secrets(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("secrets")
    (d / "api-key").write_text(API_KEY + "\n")
    (d / "parent").write_text(f"{PARENT_USER}:{PARENT_PASSWORD}\n")
    return d


def policy_text(secrets: Path, upstream: str) -> str:
    base = default_policy(ports=[80, 443, 8080])
    return f"""\
version: 1
ports: {json.dumps(base["ports"])}
dns: {json.dumps(base["dns"])}
deny: [{DENIED}]
intercept: [{INTERCEPTED}]
credentials:
  - hosts: [{INTERCEPTED}]
    set_headers:
      X-Api-Key: {{file: {secrets / "api-key"}}}
upstream_proxy: {upstream}
"""


def start_proxy(sluice_factory, tls_ca, secrets, upstream: str, name: str, **kw):
    return sluice_factory(policy_text(secrets, upstream), name=name, extra_args=(
        *FAST_POLL, "--set", f"ssl_verify_upstream_trusted_ca={tls_ca.cafile}"), **kw)


@pytest.fixture(scope="module")
def proxy(sluice_factory, tls_ca, names, secrets, open_parent):
    return start_proxy(sluice_factory, tls_ca, secrets, f'{{url: "{open_parent.url}"}}', "via-parent", socks=True)


def sluice_ca(proxy) -> str:
    return str(Path(proxy.home) / ".sluice" / "ca" / "mitmproxy-ca-cert.pem")


def only_ip_literals(requests: list[str]) -> None:
    for line in requests:
        assert re.fullmatch(r"CONNECT (\d+\.\d+\.\d+\.\d+|\[[0-9a-f:]+\]):\d+ HTTP/1\.1", line), line
        assert "example" not in line, line


# ---- allowed traffic flows, and the parent sees only IP literals ---------------------


def test_an_https_tunnel_goes_through_the_parent_as_connect_to_the_pinned_ip(proxy, open_parent, net, tls_ca):
    before = len(open_parent.requests())
    origin = net.origin(ORIGIN_IP, 443)
    origin.reset()
    result = curl("-x", proxy.proxy_url, "--cacert", tls_ca.cafile, f"https://{TUNNEL}/tunnel")
    assert result.status == 200 and result.text.strip() == f"origin ok {TUNNEL} /tunnel", result
    seen = open_parent.requests()[before:]
    assert seen == [f"CONNECT {ORIGIN_IP}:443 HTTP/1.1"], seen
    assert [r.sni for r in origin.requests] == [TUNNEL]  # TLS end to end: the origin got the name, the parent never


def test_plain_http_keep_alive_uses_one_tunnel_through_the_parent(proxy, open_parent, net):
    before = len(open_parent.requests())
    origin = net.origin(ORIGIN_IP, 80)
    origin.reset()
    with open_socket(proxy.address) as s:
        reader = _Reader(s)
        bodies = []
        for path in ("/first", "/second"):
            s.sendall(f"GET http://{TUNNEL}{path} HTTP/1.1\r\nHost: {TUNNEL}\r\n\r\n".encode())
            response = read_response(reader)
            assert response.status == 200, response
            bodies.append(response.text.strip())
    assert bodies == [f"origin ok {TUNNEL} /first", f"origin ok {TUNNEL} /second"]
    # Inside the tunnel: origin-form requests with their Host; one origin connection for both.
    assert [(r.path, r.host) for r in origin.requests] == [("/first", TUNNEL), ("/second", TUNNEL)]
    assert len({r.conn for r in origin.requests}) == 1
    assert open_parent.requests()[before:] == [f"CONNECT {ORIGIN_IP}:80 HTTP/1.1"]


def test_socks5_goes_through_the_parent_too(proxy, open_parent, net):
    before = len(open_parent.requests())
    result = socks5_connect(proxy.socks_address, TUNNEL, 80)
    assert result.ok, result
    try:
        response = result.tunnel.request(TUNNEL, "/socks", close=True)
    finally:
        result.tunnel.close()
    assert response.status == 200 and response.text.strip() == f"origin ok {TUNNEL} /socks"
    assert open_parent.requests()[before:] == [f"CONNECT {ORIGIN_IP}:80 HTTP/1.1"]


def test_interception_and_credentials_work_through_the_parent(proxy, open_parent, net):
    before = len(open_parent.requests())
    origin = net.origin(ORIGIN_IP, 443)
    origin.reset()
    result = curl("-x", proxy.proxy_url, "--cacert", sluice_ca(proxy), "-H", "X-Api-Key: agent-guess",
                  f"https://{INTERCEPTED}/api")
    assert result.status == 200 and result.text.strip() == f"origin ok {INTERCEPTED} /api", result
    assert [r.headers.get("x-api-key") for r in origin.requests] == [API_KEY]
    assert [r.sni for r in origin.requests] == [INTERCEPTED]
    assert open_parent.requests()[before:] == [f"CONNECT {ORIGIN_IP}:443 HTTP/1.1"]
    only_ip_literals(open_parent.requests())


# ---- refused traffic never reaches the parent ----------------------------------------


@pytest.mark.parametrize("how, target, reason", [
    ("http", "http://169.254.169.254/latest/meta-data/", "address_not_public"),
    ("https", "https://10.0.0.1/", "address_not_public"),
    ("http", f"http://{DENIED}/", "host_denied"),
    ("https", f"https://{TUNNEL}:8443/", "port_not_allowed"),
    ("http", "http://localhost/", "internal_hostname"),
])
def test_refused_traffic_never_reaches_the_parent(proxy, open_parent, how, target, reason):
    connections = open_parent.connections()
    result = curl("-x", proxy.proxy_url, target)
    code = result.connect_status if how == "https" else result.status
    assert code == 403, result
    if how == "http":
        assert result.sluice_reason == reason, result
    assert open_parent.connections() == connections


# ---- a parent that fails is upstream_proxy_failed -------------------------------------

# RFC 9209: the next hop is unavailable (not proxy_internal_error: Sluice itself did not fail).
PARENT_FAILED_STATUS = 'sluice; error=destination_unavailable; details="upstream_proxy_failed"'


def test_a_parent_refusing_the_port_is_upstream_proxy_failed_naming_its_403(proxy, open_parent):
    # tinyproxy's ConnectPort (like Squid's SSL_ports) allows 80 and 443 here, not 8080.
    result = curl("-x", proxy.proxy_url, f"http://{TUNNEL}:8080/")
    assert result.status == 502 and result.sluice_reason == "upstream_proxy_failed", result
    assert re.search(rf"the parent proxy {re.escape(open_parent.url)} answered 'HTTP/1\.[01] 403 Access violation' "
                     rf"to CONNECT {re.escape(ORIGIN_IP)}:8080\.", result.text), result.text
    assert "retrying later may help" in result.text
    assert result.headers.get("proxy-status") == PARENT_FAILED_STATUS
    assert open_parent.requests()[-1] == f"CONNECT {ORIGIN_IP}:8080 HTTP/1.1"
    entry = proxy.wait_audit(lambda e: e.get("reason") == "upstream_proxy_failed" and e.get("port") == 8080)
    assert "403" in entry["detail"]


def test_a_parent_that_is_down_is_upstream_proxy_failed(sluice_factory, tls_ca, names, secrets, parent_address):
    down = f"http://{PARENT_IP}:{free_port(PARENT_IP)}"  # nothing listens there
    proxy = start_proxy(sluice_factory, tls_ca, secrets, f'{{url: "{down}"}}', "parent-down")
    result = curl("-x", proxy.proxy_url, f"http://{TUNNEL}/")
    assert result.status == 502 and result.sluice_reason == "upstream_proxy_failed", result
    assert result.headers.get("proxy-status") == PARENT_FAILED_STATUS
    assert f"the parent proxy {down} is down or unreachable (Connect call failed" in result.text or \
           f"the parent proxy {down} is down or unreachable (Connection refused" in result.text, result.text
    tunnel = curl("-x", proxy.proxy_url, "--cacert", tls_ca.cafile, f"https://{TUNNEL}/")
    assert tunnel.connect_status == 502, tunnel
    entry = proxy.wait_audit(lambda e: e.get("reason") == "upstream_proxy_failed" and e.get("event") == "connect")
    assert "is down or unreachable" in entry["detail"]


# ---- credentials for the parent, and reload ------------------------------------------


def test_basic_credentials_from_a_file_log_in_to_the_parent(sluice_factory, tls_ca, names, secrets, auth_parent):
    upstream = f'{{url: "{auth_parent.url}", credentials: {{file: {secrets / "parent"}}}}}'
    proxy = start_proxy(sluice_factory, tls_ca, secrets, upstream, "parent-auth")
    before = len(auth_parent.requests())
    result = curl("-x", proxy.proxy_url, "--cacert", tls_ca.cafile, f"https://{TUNNEL}/auth")
    assert result.status == 200 and result.text.strip() == f"origin ok {TUNNEL} /auth", result
    assert auth_parent.requests()[before:] == [f"CONNECT {ORIGIN_IP}:443 HTTP/1.1"]
    stderr = proxy.stderr_text() + "\n".join(json.dumps(e) for e in proxy.audit())
    assert PARENT_PASSWORD not in stderr


def test_a_parent_wanting_credentials_is_upstream_proxy_failed_naming_its_407(sluice_factory, tls_ca, names, secrets,
                                                                              auth_parent):
    proxy = start_proxy(sluice_factory, tls_ca, secrets, f'{{url: "{auth_parent.url}"}}', "parent-noauth")
    result = curl("-x", proxy.proxy_url, f"http://{TUNNEL}/")
    assert result.status == 502 and result.sluice_reason == "upstream_proxy_failed", result
    assert "answered 'HTTP/1.0 407 Proxy Authentication Required' (wrong or missing upstream_proxy.credentials)" \
        in result.text, result.text


def test_a_reloaded_upstream_proxy_applies_to_new_connections(sluice_factory, tls_ca, names, secrets, open_parent,
                                                              auth_parent):
    proxy = start_proxy(sluice_factory, tls_ca, secrets, f'{{url: "{open_parent.url}"}}', "parent-reload")
    open_before, auth_before = len(open_parent.requests()), len(auth_parent.requests())
    assert curl("-x", proxy.proxy_url, f"http://{TUNNEL}/one").status == 200
    assert len(open_parent.requests()) == open_before + 1
    mark = proxy.stderr_mark()
    proxy.policy_file.write_text(policy_text(
        secrets, f'{{url: "{auth_parent.url}", credentials: {{file: {secrets / "parent"}}}}}'))
    wait_until(lambda: "policy reloaded" in proxy.stderr_since(mark), timeout=15, what="the policy reloaded")
    result = curl("-x", proxy.proxy_url, f"http://{TUNNEL}/two")
    assert result.status == 200 and result.text.strip() == f"origin ok {TUNNEL} /two", result
    assert auth_parent.requests()[auth_before:] == [f"CONNECT {ORIGIN_IP}:80 HTTP/1.1"]
    assert len(open_parent.requests()) == open_before + 1
