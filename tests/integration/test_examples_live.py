"""Every case of every example policy, through a live proxy (issue 10).

`sluice policy test` decides the cases of config/examples/ with the proxy's
own decision functions; this module checks that the running proxy really
does what the cases say. Each example policy runs in a `sluice proxy`, and
each case is sent to it the way a client would:

- an http:// (or other non-https) URL as an absolute-form request with the
  case's method, exactly as written in the URL;
- an https:// URL as `CONNECT host:port`, then TLS through the tunnel and
  the case's method inside it (a `method: CONNECT` case sends GET inside).

A case passes when the proxy's answer equals its expectation: `allow` means an
origin answered (it logged that very request, and the client got its 200);
`refuse` means the proxy answered with `Sluice-Reason: <reason>` and no origin
saw the request. One exception, spelled out: request lines that mitmproxy's
HTTP/1 parser cannot read (userinfo, a non-http scheme, non-ASCII or
percent-encoded hosts) are refused by it with a 400 before Sluice's gate runs
(`bad_request`, in the audit log too); those cases still have to be refused.

Faithful stand-ins, because everything stays inside the test namespace:

- DNS: each case's `resolve` table is served by the fake DNS, with public
  answers mapped to harness origins (IPv4 -> 1.1.1.1, IPv6 ->
  2606:4700:4700::1111) and non-public answers kept as they are (the proxy
  decides on names and on whether each answer is public, so that is the same
  decision). Names a case does not list are NXDOMAIN. The policy's `dns` is
  pointed at the fake DNS with `min_ttl: 0`, so each case sees its own table.
- Origins: plain HTTP on 1.1.1.1:80 (the harness's), TLS on 1.1.1.1:443
  with a certificate for every https:// host in the cases (from the test CA
  the proxy verifies upstream with), and the SearXNG sidecar on
  10.0.0.5:8080 (added to `lo` for this module).
- Clients: a profile matched by `sources` is reached from an address in its
  first IPv4 source network (added to `lo`); one matched by `users` with its
  first username and a known password (the example's verifier, which is for
  a password nobody knows, is replaced by a hash of that password).
"""

from __future__ import annotations

import base64
import ipaddress
import socket
import ssl
import subprocess
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from sluice.resolver import NEGATIVE_TTL
from harness.clients import Response, _Reader, read_response
from harness.sluice import DNS_SERVER
from sluice.policy.hosts import HostError, parse_host
from sluice.policy.loader import hash_password, load_policy_file
from sluice.policy.ranges import classify

pytestmark = pytest.mark.netns

EXAMPLES = Path(__file__).resolve().parents[2] / "config" / "examples"
NAMES = ["research-agent", "coding-agent", "searxng-sidecar"]
PASSWORD = "live-example-password"
ORIGIN_V4 = "1.1.1.1"
ORIGIN_V6 = "2606:4700:4700::1111"
SIDECAR = ("10.0.0.5", 8080)
STANDARD_PORTS = {"http": 80, "https": 443}


def load_cases(name: str) -> list[dict]:
    return yaml.safe_load((EXAMPLES / f"{name}.cases.yaml").read_text(encoding="utf-8"))


CASES = [(name, i, case) for name in NAMES for i, case in enumerate(load_cases(name))]


def case_id(item) -> str:
    name, i, case = item
    return f"{name}:{i + 1}:{case.get('name') or (case.get('method', 'GET') + ' ' + case['url'])}"


# ---- origins ---------------------------------------------------------------------------


class Origin:
    """A threaded HTTP/1.1 origin (optionally TLS) that answers every method
    with `origin ok <Host> <path>` and records what it saw."""

    def __init__(self, address: tuple[str, int], tls: ssl.SSLContext | None = None) -> None:
        self.seen: list[tuple[str, str]] = []
        lock = threading.Lock()
        seen = self.seen

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    self.rfile.read(length)
                with lock:
                    seen.append((self.command, self.path))
                body = f"origin ok {self.headers.get('Host')} {self.path}\n".encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            do_GET = do_HEAD = do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_TRACE = answer

        family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET

        class Server(ThreadingHTTPServer):
            address_family = family
            daemon_threads = True

            def get_request(self):
                sock, peer = super().get_request()
                if tls is not None:
                    sock = tls.wrap_socket(sock, server_side=True)
                return sock, peer

        self.server = Server(address, Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def start(self) -> Origin:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def https_hosts() -> set[str]:
    hosts = set()
    for _, _, case in CASES:
        parts = urlsplit(case["url"])
        if parts.scheme == "https" and parts.hostname and not _is_ip(parts.hostname):
            hosts.add(parts.hostname)
    return hosts


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text.strip("[]"))
        return True
    except ValueError:
        return False


@pytest.fixture(scope="module")
def local_addresses(netns):
    """Addresses this module needs on `lo` (the namespace's only interface):
    the sidecar's, and one inside each profile's first IPv4 source network."""
    wanted = {SIDECAR[0]} | {source for name in NAMES for source in profile_sources(name).values()}
    added = []
    for address in sorted(wanted):
        if _bindable(address):
            continue
        subprocess.run(["ip", "addr", "add", f"{address}/32", "dev", "lo"], check=True, capture_output=True)
        added.append(address)
    yield
    for address in added:
        subprocess.run(["ip", "addr", "del", f"{address}/32", "dev", "lo"], check=False, capture_output=True)


def _bindable(address: str) -> bool:
    with socket.socket() as s:
        try:
            s.bind((address, 0))
            return True
        except OSError:
            return False


@pytest.fixture(scope="module")
def origins(net, tls_ca, local_addresses):
    """The https origin on 1.1.1.1:443 (every https host in the cases) and the sidecar."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls_ca.ca.issue_cert(*sorted(https_hosts())).configure_cert(context)
    started = [Origin((ORIGIN_V4, 443), context).start(), Origin(SIDECAR).start()]
    yield {"https": started[0], "sidecar": started[1]}
    for origin in started:
        origin.stop()


# ---- the proxy, one per example ------------------------------------------------------------


def profile_sources(name: str) -> dict[str, str]:
    """Profile name -> a client address inside its first IPv4 source network."""
    out = {}
    for profile in load_policy_file(EXAMPLES / f"{name}.yaml").clients:
        for entry in profile.sources.entries:
            if entry.version == 4:
                net = ipaddress.ip_network(entry.rule.text.split(":")[0])
                out[profile.name] = str(net.network_address + 2)
                break
    return out


def live_policy(name: str) -> dict:
    """The example as it is, but for its DNS (the fake DNS, answers not cached)
    and its verifiers (a hash of a password this test knows)."""
    data = yaml.safe_load((EXAMPLES / f"{name}.yaml").read_text(encoding="utf-8"))
    data["dns"] = {"nameservers": [DNS_SERVER], "timeout": "2s", "min_ttl": 0}
    verifier = hash_password(PASSWORD, iterations=10_000)
    for profile in data.get("clients") or []:
        for spec in (profile.get("users") or {}).values():
            spec.clear()
            spec["password_hash"] = verifier
    return data


@pytest.fixture(scope="module")
def proxies(sluice_factory, tls_ca, origins):
    started: dict[str, object] = {}

    def get(name: str):
        if name not in started:
            started[name] = sluice_factory(
                live_policy(name), name=f"example-{name}",
                extra_args=("--set", f"ssl_verify_upstream_trusted_ca={tls_ca.cafile}"))
        return started[name]

    return get


# ---- DNS for one case -------------------------------------------------------------------


class CaseDNS:
    """Programs the fake DNS for one case, and puts the session's records back."""

    def __init__(self, fake_dns, base_records: dict) -> None:
        self.dns = fake_dns
        self.base = base_records
        self.touched: set[str] = set()
        self.missing_since: dict[str, float] = {}  # name -> when the proxy last got NXDOMAIN for it

    def program(self, case: dict, host: str | None) -> list[str]:
        table = {_norm(k): v for k, v in (case.get("resolve") or {}).items()}
        for name, answers in table.items():
            answers = [answers] if isinstance(answers, str) else list(answers)
            a = sorted({_stand_in(ip) for ip in answers if ":" not in ip})
            aaaa = sorted({_stand_in(ip) for ip in answers if ":" in ip})
            self._wait_out_negative_cache(name)
            self.dns.set(name, a=a, aaaa=aaaa, ttl=0)
            self.touched.add(name)
        unlisted = [h for h in (host,) if h and h not in table]
        for name in unlisted:
            self.dns.remove(name)  # a name the case does not list is unresolvable
            self.touched.add(name)
        return unlisted

    def looked_up(self, name: str, before: int) -> None:
        if self.dns.queries(name) > before:
            self.missing_since[name] = time.monotonic()

    def _wait_out_negative_cache(self, name: str) -> None:
        since = self.missing_since.pop(name, None)
        if since is not None:
            time.sleep(max(0.0, since + NEGATIVE_TTL + 0.2 - time.monotonic()))

    def restore(self) -> None:
        for name in self.touched:
            record = self.base.get(name)
            if record is None:
                self.dns.remove(name)
            else:
                self.dns.set(name, a=record.get("a", ()), aaaa=record.get("aaaa", ()), ttl=300)


def _norm(name: str) -> str:
    try:
        host = parse_host(name)
    except HostError:
        return name.lower().rstrip(".")
    return str(host)


def _stand_in(ip: str) -> str:
    """A public answer becomes the harness origin of its family; a non-public
    one stays (the proxy must refuse it without dialling)."""
    if classify(str(ipaddress.ip_address(ip))) is not None:
        return ip
    return ORIGIN_V6 if ":" in ip else ORIGIN_V4


@pytest.fixture(scope="module")
def case_dns(fake_dns, request):
    # The session's own records (tests/conftest.py), to put back afterwards.
    root_conftest = request.config.pluginmanager.get_plugin(str(Path(__file__).resolve().parents[1] / "conftest.py"))
    programmer = CaseDNS(fake_dns, root_conftest.BASE_RECORDS)
    yield programmer
    programmer.restore()


# ---- sending a case ----------------------------------------------------------------------


@dataclass
class Outcome:
    response: Response
    origin_saw: bool
    tunnel_opened: bool
    client: str  # the connection's address as the audit lines name it ("ip:port")


def _parser_refuses(url: str) -> bool:
    """Request lines mitmproxy's HTTP/1 parser answers with 400 before any
    addon runs: userinfo, a scheme other than http(s), a non-ASCII or
    percent-encoded authority."""
    scheme, _, rest = url.partition("://")
    authority = rest.split("/", 1)[0].split("?", 1)[0]
    return (scheme.lower() not in ("http", "https") or "@" in authority or "%" in authority
            or not authority.isascii())


def _authority(url: str) -> tuple[str, str, int, str]:
    """(Host header text, host, port, path) of a URL, as a client sends them."""
    parts = urlsplit(url)
    netloc = parts.netloc.rsplit("@", 1)[-1]
    host = parts.hostname or netloc
    port = parts.port or STANDARD_PORTS.get(parts.scheme.lower(), 80)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return netloc, host, port, path


def _auth_header(name: str, case: dict) -> str:
    client = case.get("client")
    if client is None:
        return ""
    for profile in load_policy_file(EXAMPLES / f"{name}.yaml").clients:
        if profile.name == client and profile.usernames:
            token = base64.b64encode(f"{sorted(profile.usernames)[0]}:{PASSWORD}".encode()).decode()
            return f"Proxy-Authorization: Basic {token}\r\n"
    return ""


def _source(name: str, case: dict) -> str:
    client = case.get("client")
    if client is None:
        return "127.0.0.1"
    return profile_sources(name).get(client, "127.0.0.1")


def send(proxy, name: str, case: dict, origins: dict, net) -> Outcome:
    url, method = case["url"], case.get("method", "GET").upper()
    netloc, host, port, path = _authority(url)
    auth, source = _auth_header(name, case), _source(name, case)
    seen_before = _origin_requests(origins, net)
    sock = socket.create_connection(proxy.address, timeout=20, source_address=(source, 0))
    local_ip, local_port = sock.getsockname()[:2]
    client = f"[{local_ip}]:{local_port}" if ":" in local_ip else f"{local_ip}:{local_port}"
    try:
        if not url.lower().startswith("https://"):
            body = "Content-Length: 0\r\n" if method in ("POST", "PUT", "PATCH", "DELETE") else ""
            sock.sendall(f"{method} {url} HTTP/1.1\r\nHost: {netloc}\r\n{auth}{body}Connection: close\r\n\r\n".encode())
            response = read_response(_Reader(sock), method=method)
            return Outcome(response, _origin_requests(origins, net) > seen_before, False, client)
        target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        sock.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n{auth}\r\n".encode())
        reader = _Reader(sock)
        answer = read_response(reader, method="CONNECT", connect=True)
        if answer.status != 200:
            return Outcome(answer, _origin_requests(origins, net) > seen_before, False, client)
        context = ssl.create_default_context(cafile=origins["cafile"])
        context.load_verify_locations(cafile=origins["sluice_ca"])  # intercepted: Sluice's certificate
        tls = context.wrap_socket(sock, server_hostname=None if _is_ip(host) else host)
        sock = tls
        inner = "GET" if method == "CONNECT" else method
        body = "Content-Length: 0\r\n" if inner in ("POST", "PUT", "PATCH", "DELETE") else ""
        tls.sendall(f"{inner} {path} HTTP/1.1\r\nHost: {netloc}\r\n{body}Connection: close\r\n\r\n".encode())
        response = read_response(_Reader(tls), method=inner)
        return Outcome(response, _origin_requests(origins, net) > seen_before, True, client)
    finally:
        sock.close()


def _origin_requests(origins: dict, net) -> int:
    harness = sum(len(listener.snapshot()[1]) for listener in net.origins.values())
    return harness + len(origins["https"].seen) + len(origins["sidecar"].seen)


@pytest.fixture(scope="module")
def origin_set(origins, tls_ca, sluice_home):
    return {**origins, "cafile": tls_ca.cafile,
            "sluice_ca": str(sluice_home / ".sluice" / "ca" / "mitmproxy-ca-cert.pem")}


# ---- the test ------------------------------------------------------------------------------


@pytest.mark.parametrize("item", CASES, ids=[case_id(c) for c in CASES])
def test_the_live_proxy_does_what_the_case_says(item, proxies, origin_set, case_dns, net):
    name, _, case = item
    proxy = proxies(name)
    _, host, _, _ = _authority(case["url"])
    unlisted = case_dns.program(case, _norm(host) if host and not _is_ip(host) else None)
    queries = {n: case_dns.dns.queries(n) for n in unlisted}
    mark = proxy.audit_mark()
    outcome = send(proxy, name, case, origin_set, net)
    for n, before in queries.items():
        case_dns.looked_up(n, before)
    response = outcome.response
    shown = f"{case['url']} ({case.get('method', 'GET')}, client {case.get('client')}): {response!r}"

    if case["expect"] == "allow":
        assert case.get("reason") is None, "report-mode expectations need the audit line, which this test does not read"
        assert response.status == 200 and response.sluice_reason is None, f"expected the origin's answer; got {shown}"
        assert response.body.startswith(b"origin ok") or case.get("method", "GET").upper() == "HEAD", shown
        assert outcome.origin_saw, f"the client got a 200 but no origin saw the request: {shown}"
        return

    assert not outcome.origin_saw, f"expected a refusal, but an origin saw the request: {shown}"
    if response.status == 400 and response.sluice_reason in (None, "bad_request") and _parser_refuses(case["url"]):
        # mitmproxy's HTTP/1 parser refused the request line before the gate ran. Its line is written
        # after the 400 has gone out, so the previous case's line may come after `mark`: take this
        # connection's own.
        line = proxy.wait_audit(lambda e: e["decision"] == "refuse" and e.get("client") == outcome.client,
                                since=mark, what="the refusal's audit line")
        assert line["reason"] == "bad_request" and line["status"] == 400, line
        return
    assert response.sluice_reason is not None, f"expected a Sluice refusal; got {shown}"
    if case.get("reason"):
        assert response.sluice_reason == case["reason"], f"expected {case['reason']}; got {shown}"
    # The refusal's own audit line, waited for here so that it cannot land after
    # the next case's mark (a loaded machine wrote the ftp case's line late and
    # the next case read it as its own).
    proxy.wait_audit(lambda e: e["reason"] == response.sluice_reason, since=mark, what="the refusal's audit line")
