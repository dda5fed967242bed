"""Audit fields (issue 10, item 9): `user` names the proxy user a client
authenticated or was refused as; lines of a CONNECT tunnel (its own line and
every request inside an intercepted one) carry the CONNECT's id as
`connect_id`; `time` is RFC 3339 in UTC with milliseconds."""

from __future__ import annotations

import base64
import datetime
import re
import socket
import ssl
from pathlib import Path

import pytest

from harness import default_policy
from harness.clients import _Reader, read_response
from sluice.policy.loader import hash_password

pytestmark = pytest.mark.netns

RFC3339_MS = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}\.\d{3}Z$")


@pytest.fixture(scope="module")
def proxy(sluice_factory, tls_ca):
    policy = default_policy(intercept=["example.com"], clients=[
        {"name": "agents", "users": {"alice": {"password_hash": hash_password("right", iterations=10_000)}}},
    ])
    return sluice_factory(policy, name="auditfields",
                          extra_args=("--set", f"ssl_verify_upstream_trusted_ca={tls_ca.cafile}"))


@pytest.fixture(scope="module")
def sluice_ca(proxy, sluice_home) -> str:
    return str(Path(sluice_home) / ".sluice" / "ca" / "mitmproxy-ca-cert.pem")


def basic(user: str, password: str) -> str:
    return "Proxy-Authorization: Basic " + base64.b64encode(f"{user}:{password}".encode()).decode() + "\r\n"


class Conn:
    """One client connection; `name` is how the audit log's `client` shows it."""

    def __init__(self, proxy):
        self.sock = socket.create_connection(proxy.address, timeout=15)
        host, port = self.sock.getsockname()[:2]
        self.name = f"{host}:{port}"
        self.reader = _Reader(self.sock)

    def send(self, raw: str, method: str = "GET", connect: bool = False):
        self.sock.sendall(raw.encode())
        return read_response(self.reader, method=method, connect=connect)

    def close(self) -> None:
        self.sock.close()


def request(proxy, auth: str = "") -> tuple[int, str]:
    c = Conn(proxy)
    try:
        r = c.send(f"GET http://public.example/ HTTP/1.1\r\nHost: public.example\r\n{auth}Connection: close\r\n\r\n")
        return r.status, c.name
    finally:
        c.close()


def line_of(proxy, client: str, event: str = "request") -> dict:
    return proxy.wait_audit(lambda e: e["client"] == client and e["event"] == event,
                            what=f"a {event} line for {client}")


def test_user_names_who_authenticated_or_was_refused(proxy):
    status, name = request(proxy, basic("alice", "right"))
    assert status == 200
    e = line_of(proxy, name)
    assert (e["user"], e["profile"], e["decision"]) == ("alice", "agents", "allow"), e

    status, name = request(proxy, basic("alice", "wrong"))
    assert status == 407
    e = line_of(proxy, name)
    assert (e["user"], e["profile"], e["decision"], e["reason"]) == ("alice", None, "refuse", "client_unknown"), e

    status, name = request(proxy, basic("mallory", "guess"))
    assert status == 407
    e = line_of(proxy, name)
    assert (e["user"], e["reason"]) == ("mallory", "client_unknown"), e

    status, name = request(proxy)  # no credentials: the top-level rules, no user
    assert status == 200
    e = line_of(proxy, name)
    assert e["user"] is None and e["profile"] is None and e["decision"] == "allow", e


def test_a_plain_tunnel_line_carries_its_connects_id(proxy):
    ids = []
    for _ in range(2):
        c = Conn(proxy)
        r = c.send("CONNECT public.example:443 HTTP/1.1\r\nHost: public.example:443\r\n" + basic("alice", "right")
                   + "\r\n",
                   method="CONNECT", connect=True)
        assert r.status == 200
        c.close()
        e = line_of(proxy, c.name, "tunnel")
        assert e["id"] and e["connect_id"] == e["id"] and e["user"] == "alice" and e["profile"] == "agents", e
        ids.append(e["id"])
    assert ids[0] != ids[1]

    # A refused CONNECT's own line: the same two fields.
    c = Conn(proxy)
    r = c.send("CONNECT public.example:8443 HTTP/1.1\r\nHost: public.example:8443\r\n\r\n", method="CONNECT",
               connect=True)
    assert r.status == 403
    c.close()
    e = line_of(proxy, c.name, "connect")
    assert e["reason"] == "port_not_allowed" and e["id"] and e["connect_id"] == e["id"], e


def test_requests_inside_an_intercepted_tunnel_carry_the_connect_id_and_user(proxy, sluice_ca):
    c = Conn(proxy)
    r = c.send("CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n" + basic("alice", "right") + "\r\n",
               method="CONNECT", connect=True)
    assert r.status == 200
    tls = ssl.create_default_context(cafile=sluice_ca).wrap_socket(c.sock, server_hostname="example.com")
    reader = _Reader(tls)
    for path in ("/one", "/two"):
        tls.sendall(f"GET {path} HTTP/1.1\r\nHost: example.com\r\n\r\n".encode())
        assert read_response(reader).status == 200
    tls.sendall(b"GET / HTTP/1.1\r\nHost: public.example\r\n\r\n")  # another host: refused inside
    assert read_response(reader).status == 403
    tls.close()
    tunnel = line_of(proxy, c.name, "tunnel")
    requests = [e for e in proxy.audit() if e["client"] == c.name and e["event"] == "request"]
    assert len(requests) == 3, requests
    assert tunnel["id"] and tunnel["connect_id"] == tunnel["id"] and tunnel["user"] == "alice", tunnel
    for e in requests:
        assert e["connect_id"] == tunnel["id"] and e["id"] != tunnel["id"], e
        assert e["user"] == "alice" and e["profile"] == "agents", e
    assert sorted(e["reason"] or "" for e in requests) == ["", "", "host_mismatch"]


def test_time_is_rfc3339_utc_with_milliseconds(proxy):
    before = datetime.datetime.now(datetime.UTC)
    status, name = request(proxy)
    assert status == 200
    e = line_of(proxy, name)
    after = datetime.datetime.now(datetime.UTC)
    assert RFC3339_MS.match(e["time"]), e["time"]
    when = datetime.datetime.fromisoformat(e["time"].replace("Z", "+00:00"))
    slack = datetime.timedelta(seconds=1)
    assert before - slack <= when <= after + slack, (before, when, after)
    for line in proxy.audit():  # every kind of line written so far
        assert RFC3339_MS.match(line["time"]), line
