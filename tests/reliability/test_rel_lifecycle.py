"""Issue 18, items 7-9: what a long-lived connection can keep across the
proxy's own lifecycle (a drain, a reload) and a dial back into the proxy's
own host.

- Drain: a WebSocket pipe is drained like a raw tunnel: it keeps carrying
  bytes for `--drain-timeout`, then is cut with a `shutdown` line (it used
  to be closed at once and logged as allowed).
- The proxy's own host: with `--listen 0.0.0.0:P --admin 0.0.0.0:A`, every
  address of the host (here the namespace's 8.8.8.8 and 1.1.1.1, on its
  `lo`) is `proxy_loop` on every port, as a 403 with its refuse line (the
  admin's /metrics answered 200 through the proxy before), unless
  `private_networks` names that address and port; a proxy bound to
  loopback refuses the operator's `proxy_addresses` and still reaches the
  other origins.
- Reload re-identifies open tunnels: a user moved out of the profile that
  holds a credential (or a source CIDR moved to another profile) no longer
  gets the secret on its next request inside its already-open intercepted
  tunnel; a user removed altogether (`require_client`) has the tunnel
  closed `tunnel_revoked`.

The origin (tests/harness/vhosts.py) serves a.example on 1.1.1.1 (TLS 8443,
plain 8081) and echoes WebSocket pipes.
"""

from __future__ import annotations

import base64
import signal
import socket
import time
from pathlib import Path

import pytest
import yaml

from harness import SluiceProcess, absolute_form, connect, default_policy, free_port
from harness.clients import Tunnel, _Reader, read_response, socks5_connect
from harness.vhosts import A, PLAIN_PORT, TLS_PORT, start_vhost_origin
from sluice.policy.loader import hash_password
from relkit import wait_until

pytestmark = pytest.mark.netns


@pytest.fixture(scope="module")
def origin(net, tls_ca, fake_dns):
    server = start_vhost_origin(tls_ca, fake_dns)
    yield server
    server.stop()


def vhost_policy(**overrides) -> dict:
    policy = default_policy(ports=[80, 443, PLAIN_PORT, TLS_PORT])
    policy.update(overrides)
    return policy


WS_HEAD = (f"GET http://{A}:{PLAIN_PORT}/ws HTTP/1.1\r\nHost: {A}:{PLAIN_PORT}\r\n"
           "Connection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Version: 13\r\n"
           "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n").encode()


def reload(proxy, policy: dict) -> None:
    """Write the new policy and SIGHUP the proxy (the poller may see it first)."""
    proxy.policy_file.write_text(yaml.safe_dump(policy, sort_keys=False))
    proxy.proc.send_signal(signal.SIGHUP)


def open_ws_pipe(proxy, timeout: float = 10.0) -> socket.socket:
    """A ws:// pipe through the proxy to the echoing origin, 101 read."""
    s = socket.create_connection(proxy.address, timeout=timeout)
    s.sendall(WS_HEAD)
    head = _read_head(s)
    assert head.startswith(b"HTTP/1.1 101"), head
    return s


def _read_head(s: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(4096)
        if not chunk:
            break
        data += chunk
    return data


def echo(s: socket.socket, payload: bytes) -> bytes:
    """Send payload and read its echo (b"" short: the pipe was closed)."""
    s.sendall(payload)
    got = b""
    try:
        while len(got) < len(payload):
            chunk = s.recv(65536)
            if not chunk:
                break
            got += chunk
    except (ConnectionResetError, TimeoutError):
        pass
    return got


# ---- item 9: drain treats pipes like tunnels ------------------------------------------


def test_a_drain_gives_websocket_pipes_the_drain_timeout_and_a_shutdown_line(sluice_factory, origin):
    drain = 3.0
    proxy = sluice_factory(vhost_policy(), name="drainpipe", extra_args=("--drain-timeout", f"{drain:g}"))
    pipe = open_ws_pipe(proxy)
    try:
        assert echo(pipe, b"before") == b"before"
        started = time.monotonic()
        proxy.proc.send_signal(signal.SIGTERM)
        assert wait_until(lambda: "sluice: stopping:" in proxy.stderr_text(), 10), proxy.stderr_text()
        # Well inside the drain timeout: the pipe still carries bytes, the proxy waits for it.
        time.sleep(0.5)
        assert echo(pipe, b"during") == b"during", "the drain closed the WebSocket pipe at once"
        assert proxy.alive()
        assert proxy.proc.wait(30) == 0
        assert time.monotonic() - started >= drain - 0.5, "the proxy did not wait for the pipe"
        pipe.settimeout(5)
        assert echo(pipe, b"after") == b"", "the pipe outlived the drain"
    finally:
        pipe.close()
    line = proxy.wait_audit(lambda e: e["event"] == "tunnel" and e["port"] == PLAIN_PORT)
    assert (line["decision"], line["reason"]) == ("refuse", "shutdown"), line
    assert line["bytes_out"] == len(b"before") + len(b"during"), line
    err = proxy.stderr_text()
    assert "Traceback" not in err and "(1 cut by shutdown)" in err, err


# ---- item 8: the proxy's own host is never a destination -------------------------------


class WildcardSluice(SluiceProcess):
    """`sluice proxy --listen 0.0.0.0:P --admin 0.0.0.0:A`, reached on 127.0.0.1."""

    def __init__(self, *args, port: int, admin_port: int, **kwargs):
        super().__init__(*args, extra_args=("--admin", f"0.0.0.0:{admin_port}"), **kwargs)
        self._wildcard_port, self._admin = port, admin_port

    def command(self) -> list[str]:
        cmd = super().command()
        cmd[cmd.index("--listen") + 1] = f"0.0.0.0:{self._wildcard_port}"
        return cmd

    @property
    def address(self) -> tuple[str, int]:
        return ("127.0.0.1", self._wildcard_port)


def _loop_refused(proxy, response, mark) -> None:
    assert (response.status, response.sluice_reason) == (403, "proxy_loop"), response
    assert "sluice_" not in response.text and "Sluice refused this request" in response.text, response.text
    line = proxy.wait_audit(lambda e: e.get("reason") == "proxy_loop", since=mark, what="the proxy_loop line")
    assert line["decision"] == "refuse" and line.get("status") in (403, None), line


def test_the_hosts_own_addresses_are_proxy_loop_on_every_port(net, fake_dns, sluice_home, tmp_path):
    port, admin = free_port("0.0.0.0"), free_port("0.0.0.0")
    while admin == port:
        admin = free_port("0.0.0.0")
    policy = default_policy(ports=[80, 443, port, admin], private_networks=["8.8.8.8/32:80"])
    proxy = WildcardSluice(tmp_path, policy, name="ownhost", home=sluice_home, port=port, admin_port=admin, socks=True)
    proxy.port = port
    proxy.start()
    try:
        # The admin endpoint through the host's "public" address: it answered 200 with the metrics.
        for url in (f"http://8.8.8.8:{admin}/metrics", f"http://8.8.8.8:{port}/loop", "http://1.1.1.1/",
                    "http://8.8.8.8:443/", f"http://[2606:4700:4700::1111]:{admin}/metrics"):
            mark = proxy.audit_mark()
            _loop_refused(proxy, absolute_form(proxy.address, url), mark)
        # A name resolving to the host's address, and a CONNECT to it.
        fake_dns.set("points-home.example", a=["1.1.1.1"])
        mark = proxy.audit_mark()
        _loop_refused(proxy, absolute_form(proxy.address, "http://points-home.example/"), mark)
        mark = proxy.audit_mark()
        response, tunnel = connect(proxy.address, f"8.8.8.8:{admin}")
        assert tunnel is None and (response.status, response.sluice_reason) == (403, "proxy_loop"), response
        assert proxy.wait_audit(lambda e: e.get("reason") == "proxy_loop", since=mark)["event"] == "connect"
        # SOCKS5: refused in its handshake ("not allowed by ruleset"), with its line.
        mark = proxy.audit_mark()
        assert socks5_connect(proxy.socks_address, "1.1.1.1", 80, atyp="ip").reply == 2
        line = proxy.wait_audit(lambda e: e.get("reason") == "proxy_loop", since=mark)
        assert (line["decision"], line["host"], line["port"]) == ("refuse", "1.1.1.1", 80), line
        assert net.origin("1.1.1.1", 80).connections == 0 and net.origin("8.8.8.8", 443).connections == 0
        # private_networks naming the address with this very port opens it (and only it).
        ok = absolute_form(proxy.address, "http://8.8.8.8/opened")
        assert ok.status == 200 and net.origin("8.8.8.8", 80).connections >= 1, ok
        # Nothing the proxy dialled came back to it as a client.
        assert not [e for e in proxy.audit() if (e.get("client") or "").split(":")[0] in ("8.8.8.8", "1.1.1.1")]
    finally:
        proxy.stop()


def test_proxy_addresses_are_the_host_and_other_origins_still_work(sluice_factory, net, fake_dns, tmp_path):
    """Bound to loopback (as the harness is), the host's interface addresses
    are not the proxy; the operator's `proxy_addresses` (a NAT'd address) are,
    on every port, and a reload that drops one opens it again."""
    policy = default_policy(proxy_addresses=["1.1.1.1"])
    proxy = sluice_factory(policy, name="natted")
    mark = proxy.audit_mark()
    _loop_refused(proxy, absolute_form(proxy.address, "http://1.1.1.1/"), mark)
    mark = proxy.audit_mark()
    _loop_refused(proxy, absolute_form(proxy.address, "http://1.1.1.1:443/"), mark)
    assert net.origin("1.1.1.1", 80).connections == 0
    assert absolute_form(proxy.address, "http://8.8.8.8/other").status == 200
    mark = proxy.audit_mark()
    reload(proxy, default_policy())
    proxy.wait_audit(lambda e: e["event"] == "reload" and e["decision"] == "ok", since=mark, what="the reload")
    assert absolute_form(proxy.address, "http://1.1.1.1/").status == 200


# ---- item 7: a reload re-identifies the clients of open tunnels ----------------------

SECRET = "sk-reload-held-5e81c2"
PASSWORDS = {"alice": "alice-pw-19d4", "bob": "bob-pw-7c20", "carol": "carol-pw-a3f0"}
LAB = "127.0.0.2"  # a client known by its source address
HASHES = {user: hash_password(pw, iterations=10_000) for user, pw in PASSWORDS.items()}


def identity_policy(secret_file: Path, holders: tuple[str, ...], plain: tuple[str, ...]) -> dict:
    """Profile `holders` gets the credential for a.example, `plain` does not;
    each lists the users (and the LAB source) given. require_client: a
    client in neither is refused."""
    def members(names):
        users = {n: {"password_hash": HASHES[n]} for n in names if n in HASHES}
        entry = {"users": users} if users else {}
        if LAB in names:
            entry["sources"] = [f"{LAB}/32"]
        return entry

    policy = vhost_policy(require_client=True)
    policy["clients"] = [
        {"name": "holders", **members(holders), "allow": [A], "intercept": [A],
         "credentials": [{"hosts": [A], "set_headers": {"X-Api-Key": {"file": str(secret_file)}}}]},
        {"name": "plain", **members(plain), "allow": [A], "intercept": [A]},
    ]
    return policy


@pytest.fixture(scope="module")
def reidentify(sluice_factory, origin, tls_ca, sluice_home, tmp_path_factory):
    secret_file = tmp_path_factory.mktemp("reload-secret") / "api.key"
    secret_file.write_text(SECRET + "\n")
    proxy = sluice_factory(identity_policy(secret_file, ("alice", "carol", LAB), ("bob",)), name="reidentify",
                           extra_args=("--set", f"ssl_verify_upstream_trusted_ca={tls_ca.cafile}",
                                       "--set", "sluice_policy_poll=0"))
    ca = str(Path(sluice_home) / ".sluice" / "ca" / "mitmproxy-ca-cert.pem")
    return proxy, secret_file, ca


def reload_to(proxy, policy: dict) -> None:
    if proxy.policy_file.read_text() == yaml.safe_dump(policy, sort_keys=False):
        return  # already in force
    mark = proxy.audit_mark()
    reload(proxy, policy)
    proxy.wait_audit(lambda e: e["event"] == "reload" and e["decision"] == "ok", since=mark, timeout=10,
                     what="the reload")


def intercepted_tunnel(proxy, ca: str, user: str | None = None, source: str | None = None) -> Tunnel:
    """CONNECT a.example:TLS_PORT (as `user`, or from `source`), then TLS with Sluice's CA."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(10)
    if source:
        s.bind((source, 0))
    s.connect(proxy.address)
    auth = ""
    if user:
        token = base64.b64encode(f"{user}:{PASSWORDS[user]}".encode()).decode()
        auth = f"Proxy-Authorization: Basic {token}\r\n"
    s.sendall(f"CONNECT {A}:{TLS_PORT} HTTP/1.1\r\nHost: {A}:{TLS_PORT}\r\n{auth}\r\n".encode())
    reader = _Reader(s)
    response = read_response(reader, method="CONNECT", connect=True)
    assert response.status == 200, response
    tunnel = Tunnel(s, reader)
    tunnel.start_tls(A, ca)
    return tunnel


def key_seen(tunnel: Tunnel, origin, path: str):
    """One request inside the tunnel: (status, the X-Api-Key the origin got, or None)."""
    origin.reset()
    tunnel.sock.sendall(f"GET {path} HTTP/1.1\r\nHost: {A}:{TLS_PORT}\r\n\r\n".encode())
    response = read_response(tunnel.reader)
    seen = [s for s in origin.seen(A) if s.target == path]
    return response.status, (seen[0].headers.get("x-api-key") if seen else None)


@pytest.mark.parametrize("who", ["user", "source"])
def test_a_reload_moves_an_open_tunnels_client_to_the_profile_it_matches_now(reidentify, origin, who):
    proxy, secret_file, ca = reidentify
    reload_to(proxy, identity_policy(secret_file, ("alice", "carol", LAB), ("bob",)))
    tunnel = intercepted_tunnel(proxy, ca, user="alice" if who == "user" else None,
                                source=LAB if who == "source" else None)
    try:
        assert key_seen(tunnel, origin, f"/{who}/before") == (200, SECRET)
        # The operator moves alice (or the LAB source) to the profile without the credential.
        moved = ("alice",) if who == "user" else (LAB,)
        reload_to(proxy, identity_policy(secret_file, tuple(n for n in ("alice", "carol", LAB) if n not in moved),
                                         ("bob", *moved)))
        mark = proxy.audit_mark()
        status, key = key_seen(tunnel, origin, f"/{who}/after")
        assert key is None, "the open tunnel still received the credential after the reload"
        assert status == 200
        line = proxy.wait_audit(lambda e: e["event"] == "request" and e.get("host") == A, since=mark)
        assert line["profile"] == "plain" and line.get("credential") is None, line
    finally:
        tunnel.close()


def test_a_reload_that_removes_an_open_tunnels_user_closes_it_revoked(reidentify, origin):
    proxy, secret_file, ca = reidentify
    reload_to(proxy, identity_policy(secret_file, ("alice", "carol", LAB), ("bob",)))
    tunnel = intercepted_tunnel(proxy, ca, user="alice")
    other = intercepted_tunnel(proxy, ca, user="carol")
    try:
        assert key_seen(tunnel, origin, "/removed/before") == (200, SECRET)
        mark = proxy.audit_mark()
        reload_to(proxy, identity_policy(secret_file, ("carol", LAB), ("bob",)))  # alice is in no profile now
        line = proxy.wait_audit(lambda e: e["event"] == "tunnel" and e.get("reason") == "tunnel_revoked", since=mark,
                                what="alice's tunnel closed tunnel_revoked")
        assert line["profile"] == "holders" and "matches no client profile" in line["detail"], line
        origin.reset()
        try:
            tunnel.sock.sendall(f"GET /removed/after HTTP/1.1\r\nHost: {A}:{TLS_PORT}\r\n\r\n".encode())
            got = tunnel.sock.recv(65536)
        except (OSError, ConnectionError):
            got = b""
        assert got == b"" and not origin.seen(A), "a request passed in a revoked tunnel"
        # carol, still in the profile, keeps her tunnel and the credential.
        assert key_seen(other, origin, "/carol/after") == (200, SECRET)
    finally:
        for t in (tunnel, other):
            t.sock.close()


def test_a_reload_that_removes_a_websocket_pipes_user_closes_the_pipe(reidentify, origin):
    """Pipes are re-identified like tunnels (addons/upgrades.py)."""
    proxy, secret_file, _ca = reidentify
    reload_to(proxy, identity_policy(secret_file, ("alice", "carol", LAB), ("bob",)))
    # bob (profile plain: no credential, so plain ws:// may pass) opens a pipe.
    token = base64.b64encode(f"bob:{PASSWORDS['bob']}".encode())
    s = socket.create_connection(proxy.address, timeout=10)
    try:
        s.sendall(WS_HEAD.replace(b"\r\n\r\n", b"\r\nProxy-Authorization: Basic " + token + b"\r\n\r\n"))
        assert _read_head(s).startswith(b"HTTP/1.1 101")
        assert echo(s, b"ping") == b"ping"
        mark = proxy.audit_mark()
        reload_to(proxy, identity_policy(secret_file, ("alice", LAB), ("carol",)))  # bob is in no profile now
        line = proxy.wait_audit(lambda e: e["event"] == "tunnel" and e.get("reason") == "tunnel_revoked"
                                and e.get("port") == PLAIN_PORT, since=mark, what="the pipe closed tunnel_revoked")
        assert line["user"] == "bob" and line["bytes_out"] == 4, line
        s.settimeout(5)
        assert echo(s, b"more") == b"", "the pipe outlived the reload"
    finally:
        s.close()
