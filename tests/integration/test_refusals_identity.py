"""Issue 10, items 4-8b, against the real proxy with real clients (curl,
httpx, requests over PySocks, raw sockets):

- every refusal is Sluice's: what mitmproxy rejects before the gate runs
  (`GET ftp://...`, a malformed request line, no Host, smuggling-prone
  framing) gets `Sluice-Reason`, Sluice's sentence and its audit line, never
  mitmproxy's HTML page or `Server: mitmproxy`; an origin that cannot be
  reached gets plain text, not that page;
- `dns_failed` says whether retrying may help (timeout, SERVFAIL) or not
  (NXDOMAIN), and a CNAME into an internal name is refused as that, naming
  the chain, even when the internal name does not exist;
- SOCKS5 username/password (RFC 1929) identifies a client profile exactly
  as Proxy-Authorization does, and a SOCKS client is never told to send an
  HTTP header;
- a password_file secret still works (sha256: hashes are gone from policies);
- the policy's `refusal_note` (top level, per profile) ends every refusal body.

Every refusal test also checks that no origin or canary saw a connection.
"""

from __future__ import annotations

import socket
import struct

import httpx
import pytest
import requests

from harness import absolute_form, curl, default_policy, socks5_connect
from harness.clients import _Reader, read_response
from sluice.policy.loader import hash_password
from sluice.policy.reasons import BAD_REQUEST_ADVICE, DNS_NO_NAME_ADVICE, DNS_TRANSIENT_ADVICE, POLICY_SUFFIX

pytestmark = pytest.mark.netns

TOP_NOTE = "Need access? Ask in #egress-help."
AGENTS_NOTE = "Agents: open an EGRESS ticket naming the host."
BOT, BOT_PW = "bot", "bot-pw-3f9a"
FILER, FILER_PW = "filer", "filer-secret-7c1e"
LAB_SOURCE = "127.0.0.2"  # profile `lab`, by source address


@pytest.fixture(scope="module")
def proxy(sluice_factory, tmp_path_factory):
    secret = tmp_path_factory.mktemp("secrets") / "filer.secret"
    secret.write_text(FILER_PW + "\n")
    policy = default_policy(ports=[80, 443, 8081])
    policy["refusal_note"] = TOP_NOTE
    policy["require_client"] = True
    policy["clients"] = [
        {"name": "agents", "users": {BOT: {"password_hash": hash_password(BOT_PW, iterations=10_000)}},
         "allow": ["public.example", "alias-ok.example"], "refusal_note": AGENTS_NOTE},
        {"name": "lab", "sources": [f"{LAB_SOURCE}/32"]},
        {"name": "filed", "users": {FILER: {"password_file": str(secret)}}},
    ]
    return sluice_factory(policy, socks=True, name="refid")


def _no_origin_touched(net) -> None:
    touched = {name: o.connections for name, o in net.origins.items() if o.connections}
    assert not touched, f"an origin was connected to: {touched}"


def _is_sluice_refusal(r, reason: str, status: int) -> None:
    headers = {k.lower(): v for k, v in r.headers.items()}
    assert (r.status if hasattr(r, "status") else r.status_code) == status, r
    assert headers.get("sluice-reason") == reason, r
    assert "mitmproxy" not in headers.get("server", "") and "server" not in headers, r
    assert headers.get("content-type", "").startswith("text/plain"), r
    body = r.text
    assert body.startswith("Sluice refused this request: ") and "<html" not in body.lower(), body


def _raw(proxy, data: bytes, source: str | None = None):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(10)
    if source:
        s.bind((source, 0))
    s.connect(proxy.address)
    try:
        s.sendall(data)
        return read_response(_Reader(s))
    finally:
        s.close()


# ---- item 4: mitmproxy's own rejections are Sluice's refusals ------------------------


def test_ftp_url_gets_sluices_scheme_refusal_not_mitmproxys_400(proxy, net):
    mark = proxy.audit_mark()
    r = _raw(proxy, b"GET ftp://public.example:80/file.txt HTTP/1.1\r\nHost: public.example:80\r\n"
                    b"Proxy-Authorization: Basic " + _basic(BOT, BOT_PW) + b"\r\n\r\n")
    _is_sluice_refusal(r, "scheme_not_allowed", 403)
    assert "Invalid request scheme" not in r.text and r.text.rstrip().endswith(AGENTS_NOTE), r.text
    entry = proxy.wait_audit(lambda e: e.get("decision") == "refuse", since=mark)
    assert (entry["reason"], entry["status"], entry["profile"]) == ("scheme_not_allowed", 403, "agents"), entry
    _no_origin_touched(net)


def test_curl_ftp_through_the_proxy_gets_a_sluice_refusal(proxy, net):
    r = curl("-x", proxy.proxy_url, "--proxy-user", f"{BOT}:{BOT_PW}", "ftp://public.example/file.txt")
    # The request line has no port (mitmproxy's parser has no default for
    # ftp and cannot parse it): still the scheme's refusal, not bad_request.
    assert (r.status, r.sluice_reason) == (403, "scheme_not_allowed"), r
    assert "server" not in r.headers and "<html" not in r.text.lower(), r
    assert r.text.startswith("Sluice refused this request: "), r.text
    _no_origin_touched(net)


@pytest.mark.parametrize("line", [b"GET ftp://public.example/file.txt HTTP/1.1",
                                  b"GET ftp://public.example:80/file.txt HTTP/1.1",
                                  b"GET gopher://public.example/ HTTP/1.1"])
def test_an_other_scheme_says_what_sluice_carries(proxy, net, line):
    mark = proxy.audit_mark()
    r = _raw(proxy, line + b"\r\nHost: public.example\r\n\r\n", source=LAB_SOURCE)
    _is_sluice_refusal(r, "scheme_not_allowed", 403)
    scheme = line.split(b" ")[1].split(b":")[0].decode()
    assert f"Sluice carries http and https (https through CONNECT); {scheme} is not proxied" in r.text, r.text
    assert "mitmproxy" not in r.text and POLICY_SUFFIX not in r.text, r.text
    assert r.headers["proxy-status"].startswith("sluice; error=http_request_error;"), r.headers
    entry = proxy.wait_audit(lambda e: e.get("decision") == "refuse" and (e.get("client") or "").startswith(LAB_SOURCE),
                             since=mark)
    assert (entry["reason"], entry["status"]) == ("scheme_not_allowed", 403), entry
    _no_origin_touched(net)


@pytest.mark.parametrize("raw,what", [
    (b"GARBAGE\r\n\r\n", "bad request line"),
    (b"GET http://public.example/ HTTP/1.1\r\nHost public.example\r\n\r\n", "header without a colon"),
    (b"GET / HTTP/1.1\r\n\r\n", "no Host"),
    (b"GET http://user:pass@public.example/ HTTP/1.1\r\nHost: public.example\r\n\r\n", "userinfo"),
    (b"POST http://public.example/ HTTP/1.1\r\nHost: public.example\r\nContent-Length: 3\r\n"
     b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n", "smuggling framing"),
    (b"POST http://public.example/ HTTP/1.1\r\nHost: public.example\r\nContent-Length: abc\r\n\r\n", "bad length"),
])
def test_malformed_requests_get_sluices_400_and_one_audit_line(proxy, net, raw, what):
    source = LAB_SOURCE  # a known client: the refusal is mitmproxy's parse, not identity
    mark = proxy.audit_mark()
    r = _raw(proxy, raw, source=source)
    _is_sluice_refusal(r, "bad_request", 400)
    assert r.text.rstrip().endswith(TOP_NOTE), r.text
    # About the request, not the policy; Sluice's own words, not mitmproxy's name.
    assert BAD_REQUEST_ADVICE in r.text and POLICY_SUFFIX not in r.text and "mitmproxy" not in r.text, r.text
    assert r.headers["proxy-status"].startswith("sluice; error=http_request_error;"), r.headers
    _no_origin_touched(net)
    # One line for this client connection, and it says what the client got.
    _barrier(proxy)
    lines = [e for e in proxy.audit()[mark:] if (e.get("client") or "").startswith(f"{source}:")
             and e.get("decision") == "refuse"]
    assert len(lines) == 1 and lines[0]["reason"] == "bad_request" and lines[0]["status"] == 400, (what, lines)


def test_an_unreachable_origin_gets_plain_text_not_mitmproxys_page(proxy, net, fake_dns):
    fake_dns.set("closed-port.example", a=["8.8.8.8"])
    with httpx.Client(proxy=f"http://{BOT}:{BOT_PW}@{proxy.host}:{proxy.port}", timeout=10) as client:
        r = client.get("http://public.example:8081/")  # nothing listens on 8.8.8.8:8081
    assert r.status_code == 502, r
    assert "server" not in r.headers and "sluice-reason" not in r.headers, r.headers
    assert r.headers["content-type"].startswith("text/plain") and "<html" not in r.text.lower(), r.text
    assert r.text.startswith("Sluice could not complete this request (502 Bad Gateway)"), r.text


def test_connect_to_an_unreachable_origin_gets_no_mitmproxy_advice(proxy, net):
    r = _raw(proxy, b"CONNECT public.example:8081 HTTP/1.1\r\nHost: public.example:8081\r\n\r\n", source=LAB_SOURCE)
    assert r.status == 502 and "sluice-reason" not in r.headers and "server" not in r.headers, r
    assert "connection_strategy" not in r.text and r.text.startswith("Sluice could not complete this request"), r


# ---- item 5: dns_failed says what happened and what to do ------------------------------


def _as_bot(proxy, url: str) -> httpx.Response:
    with httpx.Client(proxy=f"http://{BOT}:{BOT_PW}@{proxy.host}:{proxy.port}", timeout=15) as client:
        return client.get(url)


@pytest.mark.parametrize("kind", ["NXDOMAIN", "no-answer"])
def test_a_name_that_does_not_resolve_says_retrying_will_not_help(proxy, net, fake_dns, kind):
    name = f"gone-{kind.lower()}.example"
    fake_dns.set_empty(name) if kind == "no-answer" else fake_dns.set_rcode(name, kind)
    r = _raw(proxy, f"GET http://{name}/ HTTP/1.1\r\nHost: {name}\r\n\r\n".encode(), source=LAB_SOURCE)
    _is_sluice_refusal(r, "dns_failed", 502)
    assert DNS_NO_NAME_ADVICE in r.text and DNS_TRANSIENT_ADVICE not in r.text, r.text
    assert POLICY_SUFFIX not in r.text, r.text
    if kind == "NXDOMAIN":
        assert f"{name} does not exist" in r.text, r.text
    _no_origin_touched(net)


def test_servfail_says_retrying_later_is_reasonable(proxy, net, fake_dns):
    fake_dns.set_rcode("flaky-servfail.example", "SERVFAIL")
    r = curl("-x", proxy.proxy_url, "--interface", LAB_SOURCE, "http://flaky-servfail.example/")
    assert (r.status, r.sluice_reason) == (502, "dns_failed"), r
    assert DNS_TRANSIENT_ADVICE in r.text and "does not exist" not in r.text, r.text
    assert r.text.rstrip().endswith(TOP_NOTE), r.text
    _no_origin_touched(net)


def test_a_dns_timeout_says_retrying_later_is_reasonable(proxy, net, fake_dns):
    fake_dns.set("slow-dns.example", a=["8.8.8.8"])
    fake_dns.set_delay("slow-dns.example", 6.0)  # dns.timeout is 2s
    r = _raw(proxy, b"CONNECT slow-dns.example:443 HTTP/1.1\r\nHost: slow-dns.example:443\r\n\r\n", source=LAB_SOURCE)
    _is_sluice_refusal(r, "dns_failed", 502)
    assert "timed out" in r.text and DNS_TRANSIENT_ADVICE in r.text, r.text
    _no_origin_touched(net)


@pytest.mark.parametrize("way", ["absolute", "connect", "socks5"])
def test_a_cname_to_an_internal_name_that_does_not_exist_is_refused_as_internal(proxy, net, fake_dns, canaries, way):
    fake_dns.set_cname("alias-gone.example", "db.internal")  # db.internal: NXDOMAIN
    fake_dns.set_cname("hop1.example", "hop2.example")
    fake_dns.set_cname("hop2.example", "vault.corp")  # vault.corp: NXDOMAIN
    for name, internal in (("alias-gone.example", "db.internal"), ("hop1.example", "vault.corp")):
        mark = proxy.audit_mark()
        if way == "socks5":
            res = _socks(proxy, name, 80, source=LAB_SOURCE)
            assert res[0] == 2, res
        elif way == "connect":
            r = _raw(proxy, f"CONNECT {name}:443 HTTP/1.1\r\nHost: {name}:443\r\n\r\n".encode(), source=LAB_SOURCE)
            _is_sluice_refusal(r, "dns_answer_not_public", 403)
            assert internal in r.text and "does not exist" not in r.text, r.text
        else:
            r = _raw(proxy, f"GET http://{name}/ HTTP/1.1\r\nHost: {name}\r\n\r\n".encode(), source=LAB_SOURCE)
            _is_sluice_refusal(r, "dns_answer_not_public", 403)
            assert internal in r.text and "does not exist" not in r.text, r.text
        entry = proxy.wait_audit(lambda e: e.get("decision") == "refuse", since=mark)
        assert entry["reason"] == "dns_answer_not_public" and internal in entry["detail"], entry
        if name == "hop1.example":
            assert "hop2.example" in entry["detail"], entry  # the chain is named
    _no_origin_touched(net)
    canaries.assert_untouched()


# ---- item 7: SOCKS5 username/password identifies a profile ----------------------------


def _socks(proxy, host: str, port: int, *, user: str | None = None, password: str | None = None,
           methods: bytes | None = None, source: str | None = None) -> tuple[int | None, bytes]:
    """A raw SOCKS5 CONNECT (optionally RFC 1929 login): (REP or None, auth status bytes)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(10)
    if source:
        s.bind((source, 0))
    s.connect(proxy.socks_address)
    reader = _Reader(s)
    try:
        offered = methods if methods is not None else (b"\x00\x02" if user is not None else b"\x00")
        s.sendall(b"\x05" + bytes([len(offered)]) + offered)
        chosen = reader.exactly(2)
        auth = b""
        if chosen == b"\x05\x02":
            u, p = (user or "").encode(), (password or "").encode()
            s.sendall(b"\x01" + bytes([len(u)]) + u + bytes([len(p)]) + p)
            auth = reader.exactly(2)
            if auth != b"\x01\x00":
                return None, auth
        elif chosen != b"\x05\x00":
            return None, chosen
        name = host.encode()
        s.sendall(b"\x05\x01\x00\x03" + bytes([len(name)]) + name + struct.pack("!H", port))
        head = reader.exactly(10)
        if len(head) < 2:
            return None, auth
        if head[1] == 0:
            s.sendall(f"GET / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
            response = read_response(reader)
            assert response.status == 200, response
        return head[1], auth
    finally:
        s.close()


def test_curl_socks5_with_proxy_user_gets_its_profile(proxy, net):
    mark = proxy.audit_mark()
    r = curl("--socks5-hostname", f"{proxy.host}:{proxy.socks_port}", "--proxy-user", f"{BOT}:{BOT_PW}",
             "http://public.example/")
    assert r.status == 200, r
    entry = proxy.wait_audit(lambda e: e.get("event") == "tunnel", since=mark)
    assert (entry["profile"], entry["user"], entry["decision"]) == ("agents", BOT, "allow"), entry


def test_requests_over_pysocks_with_credentials(proxy, net):
    url = f"socks5h://{BOT}:{BOT_PW}@{proxy.host}:{proxy.socks_port}"
    r = requests.get("http://public.example/", proxies={"http": url}, timeout=10)
    assert r.status_code == 200, r


def test_the_socks_login_profile_rules_apply(proxy, net, fake_dns):
    fake_dns.set("elsewhere.example", a=["1.1.1.1"])
    mark = proxy.audit_mark()
    reply, _ = _socks(proxy, "elsewhere.example", 80, user=BOT, password=BOT_PW)
    assert reply == 2
    entry = proxy.wait_audit(lambda e: e.get("decision") == "refuse", since=mark)
    assert (entry["reason"], entry["profile"]) == ("host_not_allowed", "agents"), entry
    _no_origin_touched(net)


def test_a_wrong_socks_password_is_rejected_in_the_handshake(proxy, net):
    mark = proxy.audit_mark()
    reply, auth = _socks(proxy, "public.example", 80, user=BOT, password="wrong")
    assert reply is None and auth == b"\x01\x01", auth  # RFC 1929: failure, then close
    entry = proxy.wait_audit(lambda e: e.get("decision") == "refuse", since=mark)
    assert (entry["reason"], entry["user"]) == ("client_unknown", BOT), entry
    assert "Proxy-Authorization" not in entry["detail"], entry
    r = curl("--socks5-hostname", f"{proxy.host}:{proxy.socks_port}", "--proxy-user", f"{BOT}:nope",
             "http://public.example/")
    assert r.returncode != 0 and r.status == 0, r
    _no_origin_touched(net)
    _barrier(proxy)  # one line per refused login, no second one from mitmproxy's own refusal
    refused = [e["reason"] for e in proxy.audit()[mark:] if e.get("user") == BOT and e.get("decision") == "refuse"]
    assert refused == ["client_unknown", "client_unknown"], refused


def test_a_socks_client_without_credentials_is_told_to_log_in_the_socks_way(proxy, net):
    mark = proxy.audit_mark()
    res = socks5_connect(proxy.socks_address, "public.example", 80)  # offers "no authentication" only
    assert res.reply == 2, res
    entry = proxy.wait_audit(lambda e: e.get("decision") == "refuse", since=mark)
    assert entry["reason"] == "client_unknown", entry
    assert "SOCKS5 username/password" in entry["detail"] and "Proxy-Authorization" not in entry["detail"], entry
    _no_origin_touched(net)


def test_a_socks_client_offering_only_username_password_is_served(proxy, net):
    reply, auth = _socks(proxy, "public.example", 80, user=FILER, password=FILER_PW, methods=b"\x02")
    assert (reply, auth) == (0, b"\x01\x00")


def test_a_source_profile_socks_client_needs_no_login(proxy, net):
    reply, _ = _socks(proxy, "public.example", 80, source=LAB_SOURCE)
    assert reply == 0


# ---- item 8: password_file without sha256: ---------------------------------------------


def test_a_password_file_user_is_served_over_http_and_wrong_is_refused(proxy, net):
    ok = curl("-x", proxy.proxy_url, "--proxy-user", f"{FILER}:{FILER_PW}", "http://public.example/")
    assert ok.status == 200, ok
    net.reset()
    bad = curl("-x", proxy.proxy_url, "--proxy-user", f"{FILER}:{FILER_PW}x", "http://public.example/")
    assert (bad.status, bad.sluice_reason) == (407, "client_unknown"), bad
    _no_origin_touched(net)


# ---- item 8b: the operator's sentence ends the refusal ---------------------------------


def test_a_profiles_note_ends_its_refusals(proxy, net, fake_dns):
    fake_dns.set("not-listed.example", a=["1.1.1.1"])
    r = _as_bot(proxy, "http://not-listed.example/")
    _is_sluice_refusal(r, "host_not_allowed", 403)
    assert r.text.rstrip().endswith(f"{POLICY_SUFFIX} {AGENTS_NOTE}"), r.text
    assert TOP_NOTE not in r.text
    _no_origin_touched(net)


def test_the_top_level_note_reaches_profiles_that_set_none_and_unknown_clients(proxy, net, canaries):
    r = curl("-x", proxy.proxy_url, "--interface", LAB_SOURCE, "http://169.254.169.254/")
    assert (r.status, r.sluice_reason) == (403, "address_not_public"), r
    assert r.text.rstrip().endswith(f"{POLICY_SUFFIX} {TOP_NOTE}"), r.text
    unknown = absolute_form(proxy.address, "http://public.example/")  # 127.0.0.1, no credentials
    assert (unknown.status, unknown.sluice_reason) == (407, "client_unknown"), unknown
    assert unknown.text.rstrip().endswith(TOP_NOTE), unknown.text
    _no_origin_touched(net)
    canaries.assert_untouched("169.254.169.254")


def test_a_refused_connect_carries_the_note(proxy, net, fake_dns):
    fake_dns.set("not-listed.example", a=["1.1.1.1"])
    r = _raw(proxy, b"CONNECT not-listed.example:443 HTTP/1.1\r\nHost: not-listed.example:443\r\n"
                    b"Proxy-Authorization: Basic " + _basic(BOT, BOT_PW) + b"\r\n\r\n")
    _is_sluice_refusal(r, "host_not_allowed", 403)
    assert r.text.rstrip().endswith(AGENTS_NOTE), r.text
    _no_origin_touched(net)


@pytest.mark.parametrize("extra,reason,status", [
    (b"Content-Length: 5000000\r\n", "request_too_large", 413),  # a cap, answered at once
    (b"Connection: Upgrade\r\nUpgrade: h2c\r\n", "upgrade_refused", 403),  # the upgrade guard
])
def test_caps_and_guards_carry_the_note_too(proxy, net, extra, reason, status):
    r = _raw(proxy, b"POST http://public.example/ HTTP/1.1\r\nHost: public.example\r\n" + extra +
             b"Proxy-Authorization: Basic " + _basic(BOT, BOT_PW) + b"\r\n\r\n")
    _is_sluice_refusal(r, reason, status)
    assert r.text.rstrip().endswith(AGENTS_NOTE), r.text
    _no_origin_touched(net)


# ---- helpers ---------------------------------------------------------------------------


def _basic(user: str, password: str) -> bytes:
    import base64

    return base64.b64encode(f"{user}:{password}".encode())


def _barrier(proxy) -> None:
    """Wait until the proxy has written the lines of connections closed before now."""
    mark = proxy.audit_mark()
    r = curl("-x", proxy.proxy_url, "--interface", LAB_SOURCE, "http://public.example/barrier")
    assert r.status == 200, r
    proxy.wait_audit(lambda e: e.get("decision") == "allow" and e.get("port") == 80, since=mark)
