"""Proxy core, end to end: real clients -> `sluice proxy` -> origins / canaries.

Runs only inside the private network namespace (`make test`). One proxy (with
a SOCKS5 listener) serves most of the module; `private_proxy` opens
10.0.0.1/32 and `rebind_proxy` caches nothing past its TTL (`dns.min_ttl: 0s`)
so DNS flips really reach it. DNS goes to the fake server on 127.0.0.53:53,
programmed per test with unique names. Every test also has the autouse canary guard (tests/integration/
conftest.py): any connection to a canary the test did not allow fails it.
"""

from __future__ import annotations

import json
import socket
import ssl
import time
from collections import Counter
from dataclasses import dataclass

import httpx
import pytest
import requests

from harness import absolute_form, connect, curl, default_policy, http_request, origin_form, socks5_connect

pytestmark = pytest.mark.netns

AUDIT_FIELDS = {"time", "id", "client", "method", "scheme", "host", "port", "address", "decision", "reason"}
END_FIELDS = {"bytes_in", "bytes_out", "duration"}


# --------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def proxy(sluice_factory):
    return sluice_factory(default_policy(), socks=True, name="core")


@pytest.fixture(scope="module")
def private_proxy(sluice_factory):
    return sluice_factory(default_policy(private_networks=["10.0.0.1/32"]), socks=True, name="private")


@pytest.fixture(scope="module")
def rebind_proxy(sluice_factory):
    """DNS answers are not kept past their TTL (`dns.min_ttl: 0s`), so every
    lookup reaches the fake DNS and a flipping record really flips."""
    policy = default_policy()
    policy["dns"] = {**policy["dns"], "min_ttl": "0s"}
    return sluice_factory(policy, socks=True, name="rebind")


@pytest.fixture
def cafile(tls_ca):
    return tls_ca.cafile


def httpx_client(proxy, **kw) -> httpx.Client:
    return httpx.Client(proxy=proxy.proxy_url, trust_env=False, timeout=15, **kw)


def requests_session(proxy_url: str) -> requests.Session:
    s = requests.Session()
    s.trust_env = False
    s.proxies = {"http": proxy_url, "https": proxy_url}
    return s


# --------------------------------------------------------------------- helpers


@dataclass
class Outcome:
    way: str
    status: int | None = None  # HTTP status of the proxy's answer (absolute/origin/connect)
    reason: str | None = None  # Sluice-Reason header
    body: str = ""
    socks_reply: int | None = None  # SOCKS5 REP (socks5 way); None = closed without reply

    @property
    def allowed(self) -> bool:
        if self.way == "socks5":
            return self.socks_reply == 0
        return self.status == 200


def attempt(proxy, way: str, host: str, port: int | None = None, path: str = "/") -> Outcome:
    """One request to host (as spelled) through the proxy, the given way.

    absolute: `GET http://host[:port]/ HTTP/1.1` with the same Host header
    origin:   `GET / HTTP/1.1` + `Host: host[:port]` sent straight to the proxy
    connect:  `CONNECT host:port` (port defaults to 443)
    socks5:   SOCKS5 CONNECT host:port (default 80); the host goes as a domain
              name (ATYP 3) exactly as spelled, bracketed IPv6 as ATYP 4
    For an allowed tunnel, one plain GET is sent through it (port 80 only).
    """
    if way in ("absolute", "origin"):
        hostport = host if port in (None, 80) else f"{host}:{port}"
        if way == "absolute":
            r = absolute_form(proxy.address, f"http://{hostport}{path}", host_header=hostport)
        else:
            r = origin_form(proxy.address, hostport, path)
        return Outcome(way, r.status, r.sluice_reason, r.text)
    if way == "connect":
        r, tunnel = connect(proxy.address, f"{host}:{port or 443}")
        out = Outcome(way, r.status, r.sluice_reason, r.text)
        if tunnel is not None:
            if (port or 443) == 80:
                out.body = tunnel.request(host.strip("[]"), path, close=True).text
            tunnel.close()
        return out
    if way == "socks5":
        atyp = "ip" if host.startswith("[") else "domain"
        res = socks5_connect(proxy.socks_address, host.strip("[]"), port or 80, atyp=atyp)
        out = Outcome(way, socks_reply=res.reply)
        if res.tunnel is not None:
            if (port or 80) == 80:
                out.body = res.tunnel.request(host.strip("[]"), path, close=True).text
            res.tunnel.close()
        return out
    raise ValueError(way)


def assert_refused(proxy, out: Outcome, reason: str, status: int = 403, mark: int | None = None) -> None:
    """The proxy refused, the way the contract says for this way of asking."""
    if out.way in ("absolute", "origin", "connect"):
        assert (out.status, out.reason) == (status, reason), f"expected {status} {reason}, got {out}"
        assert out.body.strip(), f"a refusal carries a one-sentence body: {out}"
    elif out.way == "socks5":
        assert out.socks_reply not in (None, 0), (
            f"expected a SOCKS5 failure reply, got "
            f"{'a closed connection without a reply' if out.socks_reply is None else 'success (0)'}: {out}"
        )
    if mark is not None and (out.way == "socks5" or out.reason is not None):
        entry = proxy.wait_audit(
            lambda e: e.get("decision") == "refuse", since=mark, what="refusal entry"
        )
        assert entry.get("reason") == reason, f"audit reason {entry.get('reason')!r}, expected {reason!r}: {entry}"


WAYS = ["absolute", "origin", "connect", "socks5"]


# =================================================================== allowed


def test_ready_line_names_the_listeners(proxy):
    assert proxy.ready_line is not None and proxy.ready_line.startswith("sluice: ready")
    assert str(proxy.port) in proxy.ready_line and str(proxy.socks_port) in proxy.ready_line
    ready_lines = [line for line in proxy.stderr_text().splitlines() if line.startswith("sluice: ready")]
    assert len(ready_lines) == 1, ready_lines


def test_sigterm_stops_the_proxy(sluice_factory):
    p = sluice_factory(default_policy(), name="sigterm")
    assert absolute_form(p.address, "http://public.example/").status == 200
    start = time.monotonic()
    rc = p.stop(timeout=10)
    assert time.monotonic() - start < 9, "SIGTERM did not stop the proxy promptly (it was killed)"
    assert rc == 0, f"exit status {rc} after SIGTERM; stderr:\n{p.stderr_text(tail=20)}"
    with pytest.raises(OSError):
        socket.create_connection(p.address, timeout=2).close()


def test_absolute_form_curl(proxy, net):
    r = curl("-x", proxy.proxy_url, "http://public.example/curl")
    assert (r.returncode, r.status) == (0, 200), r
    assert r.text == "origin ok public.example /curl\n"
    assert net.origin("8.8.8.8", 80).hosts_seen() == ["public.example"]


def test_absolute_form_httpx(proxy, net):
    with httpx_client(proxy) as c:
        r = c.get("http://public.example/httpx?q=1")
    assert r.status_code == 200, r.text
    assert r.text == "origin ok public.example /httpx?q=1\n"
    assert net.origin("8.8.8.8", 80).hosts_seen() == ["public.example"]


def test_absolute_form_requests(proxy, net):
    with requests_session(proxy.proxy_url) as s:
        r = s.get("http://public.example/requests", timeout=15)
    assert r.status_code == 200, r.text
    assert r.text == "origin ok public.example /requests\n"
    assert net.origin("8.8.8.8", 80).hosts_seen() == ["public.example"]


def test_origin_form_with_host_header(proxy, net):
    r = origin_form(proxy.address, "public.example", "/origin-form")
    assert r.status == 200, r
    assert r.text == "origin ok public.example /origin-form\n"
    assert net.origin("8.8.8.8", 80).hosts_seen() == ["public.example"]


def test_connect_curl_tls_passthrough(proxy, net, cafile):
    r = curl("-x", proxy.proxy_url, "--cacert", cafile, "https://public.example/tls")
    assert (r.returncode, r.connect_status, r.status) == (0, 200, 200), r
    assert r.text == "origin ok public.example /tls\n"
    seen = net.origin("8.8.8.8", 443).requests
    assert [(q.host, q.sni) for q in seen] == [("public.example", "public.example")]


def test_connect_raw_tls_is_untouched(proxy, net, cafile):
    """Verifying against the trustme CA only proves no interception happened."""
    r, tunnel = connect(proxy.address, "public.example:443")
    assert r.status == 200 and tunnel is not None, r
    try:
        tls = tunnel.start_tls("public.example", cafile)
        issuer = dict(x[0] for x in tls.getpeercert()["issuer"])
        assert issuer.get("organizationName", "").startswith("trustme"), issuer
        resp = tunnel.request("public.example", "/raw-connect", close=True)
    finally:
        tunnel.close()
    assert resp.status == 200 and resp.text == "origin ok public.example /raw-connect\n", resp
    seen = net.origin("8.8.8.8", 443).requests
    assert [(q.host, q.sni) for q in seen] == [("public.example", "public.example")]


def test_connect_raw_plain_http_tunnel(proxy, net):
    r, tunnel = connect(proxy.address, "public.example:80")
    assert r.status == 200 and tunnel is not None, r
    try:
        resp = tunnel.request("public.example", "/tunnel80", close=True)
    finally:
        tunnel.close()
    assert resp.text == "origin ok public.example /tunnel80\n", resp
    assert net.origin("8.8.8.8", 80).hosts_seen() == ["public.example"]


def test_socks5_curl_http(proxy, net):
    r = curl("--socks5-hostname", f"127.0.0.1:{proxy.socks_port}", "http://public.example/socks")
    assert (r.returncode, r.status) == (0, 200), r
    assert r.text == "origin ok public.example /socks\n"
    assert net.origin("8.8.8.8", 80).hosts_seen() == ["public.example"]


def test_socks5_curl_https(proxy, net, cafile):
    r = curl("--socks5-hostname", f"127.0.0.1:{proxy.socks_port}", "--cacert", cafile, "https://public.example/s")
    assert (r.returncode, r.status) == (0, 200), r
    assert r.text == "origin ok public.example /s\n"
    seen = net.origin("8.8.8.8", 443).requests
    assert [(q.host, q.sni) for q in seen] == [("public.example", "public.example")]


def test_socks5_requests_pysocks(proxy, net):
    with requests_session(proxy.socks_url) as s:
        r = s.get("http://one.example/pysocks", timeout=15)
    assert r.status_code == 200 and r.text == "origin ok one.example /pysocks\n", r.text
    assert net.origin("1.1.1.1", 80).hosts_seen() == ["one.example"]


def test_ipv6_only_name(proxy, net, cafile):
    r = curl("-x", proxy.proxy_url, "http://v6.example/six")
    assert (r.returncode, r.status) == (0, 200), r
    assert r.text == "origin ok v6.example /six\n"
    assert net.origin("2606:4700:4700::1111", 80).hosts_seen() == ["v6.example"]
    r = curl("-x", proxy.proxy_url, "--cacert", cafile, "https://v6.example/six-tls")
    assert (r.returncode, r.status) == (0, 200), r
    seen = net.origin("2606:4700:4700::1111", 443).requests
    assert [(q.host, q.sni) for q in seen] == [("v6.example", "v6.example")]


def test_public_ip_literal_allowed(proxy, net):
    out = attempt(proxy, "absolute", "1.1.1.1", path="/literal")
    assert out.status == 200 and out.body == "origin ok 1.1.1.1 /literal\n", out


def test_cname_to_public_name_allowed(proxy, fake_dns, net):
    fake_dns.set_cname("alias-ok.example", "public.example")
    out = attempt(proxy, "absolute", "alias-ok.example", path="/alias")
    assert out.status == 200 and out.body == "origin ok alias-ok.example /alias\n", out


# ========================================================= refused literals

LITERALS = [
    # spelling, reason, canary IPs it names
    ("127.0.0.1", "address_not_public", ("127.0.0.1",)),
    ("2130706433", "address_not_public", ("127.0.0.1",)),
    ("0x7f.1", "address_not_public", ("127.0.0.1",)),
    ("0177.0.0.1", "address_not_public", ("127.0.0.1",)),
    ("127.1", "address_not_public", ("127.0.0.1",)),
    ("[::1]", "address_not_public", ("::1",)),
    ("[::ffff:127.0.0.1]", "address_not_public", ("127.0.0.1", "::1")),
    ("169.254.169.254", "address_not_public", ("169.254.169.254",)),
    ("[fd00:ec2::254]", "address_not_public", ("fd00:ec2::254",)),
    ("10.0.0.1", "address_not_public", ("10.0.0.1",)),
    ("100.100.100.200", "address_not_public", ("100.100.100.200",)),
    ("localhost", "internal_hostname", ("127.0.0.1", "::1")),
    ("LocalHost.", "internal_hostname", ("127.0.0.1", "::1")),
    ("foo.localhost", "internal_hostname", ("127.0.0.1",)),
    ("metadata.google.internal", "internal_hostname", ("169.254.169.254",)),
    ("metadata", "internal_hostname", ("169.254.169.254",)),
    ("kubernetes.default.svc", "internal_hostname", ("10.0.0.1",)),
]


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize(("host", "reason", "canary_ips"), LITERALS, ids=[x[0] for x in LITERALS])
def test_refused_destination(proxy, fake_dns, canaries, way, host, reason, canary_ips):
    mark = proxy.audit_mark()
    queries_before = fake_dns.queries()
    out = attempt(proxy, way, host)
    assert_refused(proxy, out, reason, mark=mark)
    canaries.assert_untouched(*canary_ips)
    if reason == "internal_hostname":
        # Internal names are refused by name, never looked up.
        assert fake_dns.queries() == queries_before, [q for q in fake_dns.query_log()][queries_before:]


@pytest.mark.parametrize(
    ("host", "reason"),
    [
        ("127.0.0.1", "address_not_public"),
        ("169.254.169.254", "address_not_public"),
        ("10.0.0.1", "address_not_public"),
        ("[::1]", "address_not_public"),
        ("[fd00:ec2::254]", "address_not_public"),
    ],
)
def test_refused_socks5_ip_address_types(proxy, canaries, host, reason):
    """SOCKS5 with ATYP 1 / ATYP 4 (binary addresses), to ports 80 and 443."""
    for port in (80, 443):
        mark = proxy.audit_mark()
        res = socks5_connect(proxy.socks_address, host.strip("[]"), port, atyp="ip")
        if res.tunnel:
            res.tunnel.close()
        assert res.reply not in (None, 0), f"{host}:{port}: SOCKS reply {res.reply}"
        entry = proxy.wait_audit(lambda e: e.get("decision") == "refuse", since=mark)
        assert entry.get("reason") == reason, entry
    canaries.assert_untouched()


def test_refused_socks5_curl(proxy, canaries):
    r = curl("--socks5-hostname", f"127.0.0.1:{proxy.socks_port}", "http://169.254.169.254/latest/meta-data/")
    assert r.returncode != 0 and r.status == 0, r
    canaries.assert_untouched("169.254.169.254")


def test_refused_absolute_form_clients(proxy, canaries):
    """curl, httpx and requests all get the 403 and its reason."""
    r = curl("-x", proxy.proxy_url, "http://169.254.169.254/latest/meta-data/")
    assert (r.status, r.sluice_reason) == (403, "address_not_public"), r
    with httpx_client(proxy) as c:
        h = c.get("http://metadata.google.internal/computeMetadata/v1/")
    assert (h.status_code, h.headers.get("sluice-reason")) == (403, "internal_hostname"), h.text
    with requests_session(proxy.proxy_url) as s:
        q = s.get("http://[fd00:ec2::254]/latest/", timeout=15)
    assert (q.status_code, q.headers.get("sluice-reason")) == (403, "address_not_public"), q.text
    canaries.assert_untouched()


def test_refused_connect_curl(proxy, canaries, cafile):
    r = curl("-x", proxy.proxy_url, "--cacert", cafile, "https://10.0.0.1/")
    assert r.returncode != 0 and r.connect_status == 403, r
    canaries.assert_untouched("10.0.0.1")


@pytest.mark.parametrize("host", ["a..b", "exa mple.example", "-bad-.example", "x" * 64 + ".example"])
def test_malformed_host_socks5(proxy, canaries, host):
    """mitmproxy's HTTP parser rejects these itself; SOCKS5 hands them on raw."""
    mark = proxy.audit_mark()
    out = attempt(proxy, "socks5", host)
    assert_refused(proxy, out, "malformed_host", mark=mark)


# ====================================================================== DNS


@pytest.mark.parametrize("way", WAYS)
def test_dns_answer_internal(proxy, fake_dns, canaries, way):
    fake_dns.set("internal-a.example", a=["10.0.0.1"])
    out = attempt(proxy, way, "internal-a.example")
    assert_refused(proxy, out, "dns_answer_not_public", mark=None)
    canaries.assert_untouched("10.0.0.1")


@pytest.mark.parametrize("way", WAYS)
def test_dns_mixed_answer_refused(proxy, fake_dns, net, canaries, way):
    fake_dns.set("mixed.example", a=["8.8.8.8", "10.0.0.1"])
    mark = proxy.audit_mark()
    out = attempt(proxy, way, "mixed.example")
    assert_refused(proxy, out, "dns_answer_not_public", mark=mark)
    canaries.assert_untouched("10.0.0.1")
    assert net.origin("8.8.8.8", 80).connections == 0 and net.origin("8.8.8.8", 443).connections == 0


@pytest.mark.parametrize("way", ["absolute", "connect", "socks5"])
def test_dns_cname_to_metadata_address(proxy, fake_dns, canaries, way):
    fake_dns.set("meta-target.example", a=["169.254.169.254"])
    fake_dns.set_cname("cname-meta.example", "meta-target.example")
    fake_dns.set_cname("chain1.example", "chain2.example")
    fake_dns.set_cname("chain2.example", "cname-meta.example")
    for name in ("cname-meta.example", "chain1.example"):
        out = attempt(proxy, way, name)
        assert_refused(proxy, out, "dns_answer_not_public")
    canaries.assert_untouched("169.254.169.254")


@pytest.mark.parametrize("way", ["absolute", "connect", "socks5"])
def test_dns_cname_to_internal_name(proxy, fake_dns, net, canaries, way):
    """A CNAME into an internal namespace is refused even if it answers public."""
    fake_dns.set("x.internal", a=["8.8.8.8"])
    fake_dns.set_cname("cname-internal.example", "x.internal")
    mark = proxy.audit_mark()
    out = attempt(proxy, way, "cname-internal.example")
    assert not out.allowed, out
    if way != "socks5":
        assert out.status == 403 and out.reason in ("internal_hostname", "dns_answer_not_public"), out
    entry = proxy.wait_audit(lambda e: e.get("decision") == "refuse", since=mark)
    assert entry.get("reason") in ("internal_hostname", "dns_answer_not_public"), entry
    assert net.origin("8.8.8.8", 80).connections == 0 and net.origin("8.8.8.8", 443).connections == 0


@pytest.mark.parametrize("way", ["absolute", "connect", "socks5"])
def test_dns_cname_to_internal_name_answering_internal(proxy, fake_dns, canaries, way):
    fake_dns.set("y.internal", a=["10.0.0.1"])
    fake_dns.set_cname("cname-internal2.example", "y.internal")
    out = attempt(proxy, way, "cname-internal2.example")
    assert not out.allowed, out
    if way != "socks5":
        assert out.status == 403 and out.reason in ("internal_hostname", "dns_answer_not_public"), out
    canaries.assert_untouched("10.0.0.1")


@pytest.mark.parametrize("way", ["absolute", "connect", "socks5"])
def test_dns_aaaa_only_internal(proxy, fake_dns, canaries, way):
    fake_dns.set("v6-internal.example", aaaa=["fd00:ec2::254"])
    mark = proxy.audit_mark()
    out = attempt(proxy, way, "v6-internal.example")
    assert_refused(proxy, out, "dns_answer_not_public", mark=mark)
    canaries.assert_untouched("fd00:ec2::254")


@pytest.mark.parametrize("way", ["absolute", "connect", "socks5"])
@pytest.mark.parametrize("kind", ["NXDOMAIN", "SERVFAIL", "no-answer"])
def test_dns_failure_is_502(proxy, fake_dns, net, canaries, way, kind):
    name = f"fail-{kind.lower()}.example"
    if kind == "no-answer":
        fake_dns.set_empty(name)
    else:
        fake_dns.set_rcode(name, kind)
    mark = proxy.audit_mark()
    out = attempt(proxy, way, name)
    assert_refused(proxy, out, "dns_failed", status=502, mark=mark)
    assert all(o.connections == 0 for o in net.origins.values())


@pytest.mark.parametrize("way", ["absolute", "connect"])
def test_dns_timeout_is_502(proxy, fake_dns, way):
    name = f"slow-{way}.example"
    fake_dns.set(name, a=["8.8.8.8"])
    fake_dns.set_delay(name, 6.0)  # the policy's dns.timeout is 2s
    start = time.monotonic()
    out = attempt(proxy, way, name)
    elapsed = time.monotonic() - start
    assert_refused(proxy, out, "dns_failed", status=502)
    assert 1.5 <= elapsed < 5.5, f"the 2s DNS timeout took {elapsed:.2f}s"


def test_dns_timeout_socks5(proxy, fake_dns):
    fake_dns.set("slow-socks.example", a=["8.8.8.8"])
    fake_dns.set_delay("slow-socks.example", 6.0)
    mark = proxy.audit_mark()
    start = time.monotonic()
    out = attempt(proxy, "socks5", "slow-socks.example")
    elapsed = time.monotonic() - start
    assert_refused(proxy, out, "dns_failed", status=502, mark=mark)
    assert elapsed < 5.5, f"the 2s DNS timeout took {elapsed:.2f}s"


def _rebinding_run(proxy, name: str, seconds: float) -> Counter:
    """Hammer `name` every way for a while; every answer is origin-ok or a refusal."""
    outcomes: Counter = Counter()
    bad: list = []
    deadline = time.monotonic() + seconds
    with httpx_client(proxy) as keep:
        i = 0
        while time.monotonic() < deadline:
            i += 1
            results = [attempt(proxy, way, name, path=f"/r{i}") for way in ("absolute", "origin", "socks5")]
            results.append(attempt(proxy, "connect", name, port=80, path=f"/r{i}"))
            r = keep.get(f"http://{name}/k{i}")
            results.append(
                Outcome("keepalive", r.status_code, r.headers.get("sluice-reason"), r.text)
            )
            for out in results:
                if out.allowed:
                    ok = out.body.startswith(f"origin ok {name} ")
                    outcomes["ok" if ok else "BAD-allowed"] += 1
                    if not ok:
                        bad.append(out)
                else:
                    refused = out.way == "socks5" or (out.status == 403 and out.reason == "dns_answer_not_public")
                    outcomes["refused" if refused else "BAD-refusal"] += 1
                    if not refused:
                        bad.append(out)
            time.sleep(0.05)
    assert not bad, f"unexpected outcomes {outcomes}: {bad[:5]}"
    return outcomes


def test_rebinding_public_then_loopback(proxy, fake_dns, canaries):
    fake_dns.set_flipping(
        "rebind-seq.example", [{"a": ["8.8.8.8"]}, {"a": ["127.0.0.1"], "aaaa": ["::1"]}], mode="sequence", ttl=1
    )
    outcomes = _rebinding_run(proxy, "rebind-seq.example", 3.0)
    canaries.assert_untouched("127.0.0.1", "::1")
    assert outcomes["ok"] + outcomes["refused"] > 0


def test_rebinding_alternating_ttl0(proxy, fake_dns, canaries):
    fake_dns.set_flipping(
        "rebind-alt.example", [{"a": ["8.8.8.8"]}, {"a": ["127.0.0.1"], "aaaa": ["::1"]}], mode="cycle", ttl=0
    )
    outcomes = _rebinding_run(proxy, "rebind-alt.example", 3.0)
    canaries.assert_untouched("127.0.0.1", "::1")
    assert outcomes["ok"] + outcomes["refused"] > 0


def test_rebinding_alternating_every_lookup(rebind_proxy, fake_dns, canaries):
    """Every lookup flips public <-> loopback: refusals must happen, leaks must not."""
    name = "rebind-flip.example"
    fake_dns.set_flipping(name, [{"a": ["8.8.8.8"]}, {"a": ["127.0.0.1"], "aaaa": ["::1"]}], mode="cycle", ttl=0)
    outcomes = _rebinding_run(rebind_proxy, name, 3.0)
    canaries.assert_untouched("127.0.0.1", "::1")
    lookups = fake_dns.queries(name, "A")
    assert lookups >= 3, f"only {lookups} lookups: the flip was not exercised ({outcomes})"
    assert outcomes["ok"] > 0 and outcomes["refused"] > 0, outcomes


def test_rebinding_public_then_loopback_min_ttl0(rebind_proxy, fake_dns, canaries):
    name = "rebind-once.example"
    fake_dns.set_flipping(name, [{"a": ["8.8.8.8"]}, {"a": ["127.0.0.1"], "aaaa": ["::1"]}], mode="sequence", ttl=1)
    outcomes = _rebinding_run(rebind_proxy, name, 3.0)
    canaries.assert_untouched("127.0.0.1", "::1")
    assert outcomes["ok"] > 0 and outcomes["refused"] > 0, outcomes


def test_dns_cache_within_ttl(proxy, fake_dns, net):
    fake_dns.set("cache.example", a=["8.8.8.8"], ttl=300)
    for i in range(5):  # a new client connection each time
        out = attempt(proxy, "absolute", "cache.example", path=f"/c{i}")
        assert out.status == 200, out
    out = attempt(proxy, "connect", "cache.example", port=80, path="/cc")
    assert out.status == 200 and out.body.startswith("origin ok cache.example"), out
    out = attempt(proxy, "socks5", "cache.example", path="/cs")
    assert out.allowed and out.body.startswith("origin ok cache.example"), out
    a, aaaa = fake_dns.queries("cache.example", "A"), fake_dns.queries("cache.example", "AAAA")
    assert a == 1 and aaaa <= 1, f"cache.example looked up A x{a}, AAAA x{aaaa} for 7 requests within its TTL"


# =================================================================== policy


@pytest.mark.parametrize("way", WAYS)
def test_port_not_allowed(proxy, net, way):
    mark = proxy.audit_mark()
    out = attempt(proxy, way, "public.example", port=8080)
    assert_refused(proxy, out, "port_not_allowed", mark=mark)
    assert net.origin("8.8.8.8", 8080).connections == 0


def test_port_not_allowed_ip_literal(proxy, net):
    out = attempt(proxy, "absolute", "8.8.8.8", port=8080)
    assert_refused(proxy, out, "port_not_allowed")
    assert net.origin("8.8.8.8", 8080).connections == 0


def test_scheme_not_allowed_raw(proxy, net):
    # mitmproxy 12's validate_request() answers any scheme but http/https with
    # its own 400 "Invalid request scheme" before an addon can answer; accept
    # that, or Sluice's own 403.
    mark = proxy.audit_mark()
    r = absolute_form(proxy.address, "ftp://public.example:80/file.txt", host_header="public.example:80")
    if r.status == 400:
        assert "Invalid request scheme" in r.text, r
    else:
        assert (r.status, r.sluice_reason) == (403, "scheme_not_allowed"), r
    assert all(o.connections == 0 for o in net.origins.values())
    # mitmproxy still runs the requestheaders hook, so Sluice records it.
    entry = proxy.wait_audit(lambda e: e.get("decision") == "refuse", since=mark)
    assert entry.get("reason") == "scheme_not_allowed", entry


def test_scheme_not_allowed_curl_ftp(proxy, net):
    r = curl("-x", proxy.proxy_url, "ftp://public.example/file.txt")
    # mitmproxy's request-line parser has no default port for ftp:// and may
    # answer 400 itself before Sluice sees the request; either way it is refused.
    assert r.status in (400, 403), r
    if r.status == 403:
        assert r.sluice_reason == "scheme_not_allowed", r
    assert all(o.connections == 0 for o in net.origins.values())


def test_url_credentials(proxy, net):
    r = absolute_form(proxy.address, "http://user:pass@public.example/creds", host_header="public.example")
    # mitmproxy's request-line parser rejects userinfo in the authority with a
    # 400 before any addon runs; if Sluice sees it, it must say url_credentials.
    assert r.status in (400, 403), r
    if r.status == 403:
        assert r.sluice_reason == "url_credentials", r
    assert net.origin("8.8.8.8", 80).connections == 0


def test_private_networks_opens_only_the_listed_cidr(private_proxy, fake_dns, canaries):
    canaries.allow("10.0.0.1", 80)
    canaries.allow("10.0.0.1", 443)
    r = curl("-x", private_proxy.proxy_url, "http://10.0.0.1/inside")
    assert (r.status, r.text) == (200, "canary 10.0.0.1 80\n"), r
    fake_dns.set("intranet-app.example", a=["10.0.0.1"])
    out = attempt(private_proxy, "absolute", "intranet-app.example", path="/by-name")
    assert (out.status, out.body) == (200, "canary 10.0.0.1 80\n"), out
    out = attempt(private_proxy, "socks5", "10.0.0.1", path="/socks")
    assert out.allowed and out.body == "canary 10.0.0.1 80\n", out
    out = attempt(private_proxy, "connect", "10.0.0.1", port=443)
    assert out.status == 200, out
    # The rest of the non-public space stays closed.
    for host in ("169.254.169.254", "100.100.100.200", "127.0.0.1", "[fd00:ec2::254]"):
        assert_refused(private_proxy, attempt(private_proxy, "absolute", host), "address_not_public")
    assert_refused(private_proxy, attempt(private_proxy, "absolute", "10.0.0.1", port=8080), "port_not_allowed")
    assert_refused(private_proxy, attempt(private_proxy, "absolute", "metadata.google.internal"), "internal_hostname")
    assert canaries.net.canary("10.0.0.1", 8080).connections == 0


# =============================================================== keep-alive


def test_keepalive_httpx_100(proxy, net):
    with httpx_client(proxy) as c:
        for i in range(100):
            r = c.get(f"http://public.example/ka/{i}")
            assert (r.status_code, r.text) == (200, f"origin ok public.example /ka/{i}\n"), (i, r.text)
    conns, reqs = net.origin("8.8.8.8", 80).snapshot()
    assert len(reqs) == 100
    assert conns <= 2, f"100 keep-alive requests opened {conns} upstream connections"


def test_keepalive_requests_100(proxy, net):
    with requests_session(proxy.proxy_url) as s:
        for i in range(100):
            r = s.get(f"http://public.example/rq/{i}", timeout=15)
            assert (r.status_code, r.text) == (200, f"origin ok public.example /rq/{i}\n"), (i, r.text)
    conns, reqs = net.origin("8.8.8.8", 80).snapshot()
    assert len(reqs) == 100
    assert conns <= 2, f"100 keep-alive requests opened {conns} upstream connections"


def test_keepalive_two_hosts_interleaved(proxy, net):
    with httpx_client(proxy) as c:
        for i in range(60):
            host = "public.example" if i % 2 == 0 else "one.example"
            r = c.get(f"http://{host}/mix/{i}")
            assert (r.status_code, r.text) == (200, f"origin ok {host} /mix/{i}\n"), (i, r.text)
    for ip in ("8.8.8.8", "1.1.1.1"):
        conns, reqs = net.origin(ip, 80).snapshot()
        assert len(reqs) == 30 and conns <= 2, f"{ip}: {len(reqs)} requests over {conns} connections"


def test_keepalive_connect_tunnel_httpx_100(proxy, net, tls_ca):
    ctx = ssl.create_default_context(cafile=tls_ca.cafile)
    with httpx_client(proxy, verify=ctx) as c:
        for i in range(100):
            r = c.get(f"https://public.example/tka/{i}")
            assert (r.status_code, r.text) == (200, f"origin ok public.example /tka/{i}\n"), (i, r.text)
    conns, reqs = net.origin("8.8.8.8", 443).snapshot()
    assert len(reqs) == 100 and {q.sni for q in reqs} == {"public.example"}
    assert conns <= 2, f"100 requests through a keep-alive tunnel opened {conns} upstream connections"


def test_keepalive_raw_tunnel_100(proxy, net, cafile):
    r, tunnel = connect(proxy.address, "public.example:443")
    assert r.status == 200 and tunnel is not None, r
    try:
        tunnel.start_tls("public.example", cafile)
        for i in range(100):
            resp = tunnel.request("public.example", f"/raw/{i}")
            assert resp.text == f"origin ok public.example /raw/{i}\n", (i, resp)
    finally:
        tunnel.close()
    conns, reqs = net.origin("8.8.8.8", 443).snapshot()
    assert (conns, len(reqs)) == (1, 100)


def test_keepalive_socks5_100(proxy, net):
    with requests_session(proxy.socks_url) as s:
        for i in range(100):
            r = s.get(f"http://public.example/sk/{i}", timeout=15)
            assert (r.status_code, r.text) == (200, f"origin ok public.example /sk/{i}\n"), (i, r.text)
    conns, reqs = net.origin("8.8.8.8", 80).snapshot()
    assert len(reqs) == 100 and conns <= 2, f"{len(reqs)} requests over {conns} connections"


def test_keepalive_survives_a_refusal(proxy, net, canaries):
    """A refusal on a keep-alive connection does not break the next requests."""
    with httpx_client(proxy) as c:
        assert c.get("http://public.example/before").status_code == 200
        r = c.get("http://10.0.0.1/")
        assert (r.status_code, r.headers.get("sluice-reason")) == (403, "address_not_public")
        for i in range(10):
            r = c.get(f"http://public.example/after/{i}")
            assert (r.status_code, r.text) == (200, f"origin ok public.example /after/{i}\n")
    canaries.assert_untouched("10.0.0.1")


# ==================================================================== audit


def _check_fields(entry: dict) -> None:
    missing = AUDIT_FIELDS - entry.keys()
    assert not missing, f"audit entry lacks {missing}: {entry}"


def test_audit_allowed_http(proxy):
    mark = proxy.audit_mark()
    r = absolute_form(proxy.address, "http://public.example/audit-allowed")
    assert r.status == 200, r
    e = proxy.wait_audit(
        lambda e: e.get("host") == "public.example" and e.get("decision") == "allow" and e.get("bytes_in") is not None,
        since=mark,
        what="allow entry with bytes",
    )
    _check_fields(e)
    missing = END_FIELDS - e.keys()
    assert not missing, e
    assert (e["method"], e["scheme"], e["port"], e["address"], e["reason"]) == ("GET", "http", 80, "8.8.8.8", None), e
    assert isinstance(e["bytes_in"], int) and isinstance(e["bytes_out"], int), e
    assert e["bytes_in"] + e["bytes_out"] > 0, e
    assert isinstance(e["duration"], (int, float)) and e["duration"] >= 0, e
    assert e["client"] and "127.0.0.1" in str(e["client"]), e
    assert e["id"], e


def test_audit_allowed_connect(proxy, cafile):
    mark = proxy.audit_mark()
    r, tunnel = connect(proxy.address, "public.example:443")
    assert r.status == 200 and tunnel is not None
    tunnel.start_tls("public.example", cafile)
    tunnel.request("public.example", "/audit-tls", close=True)
    tunnel.close()
    e = proxy.wait_audit(
        lambda e: e.get("host") == "public.example" and e.get("port") == 443 and e.get("decision") == "allow"
        and e.get("bytes_in") is not None,
        since=mark,
        what="allow entry for the tunnel with bytes",
    )
    _check_fields(e)
    assert e["address"] == "8.8.8.8", e
    assert e["bytes_in"] > 0 and e["bytes_out"] > 0, e


def test_audit_refused(proxy):
    mark = proxy.audit_mark()
    attempt(proxy, "absolute", "169.254.169.254", path="/latest/meta-data/")
    e = proxy.wait_audit(lambda e: e.get("decision") == "refuse", since=mark)
    _check_fields(e)
    assert (e["host"], e["port"], e["method"], e["reason"]) == ("169.254.169.254", 80, "GET", "address_not_public"), e

    mark = proxy.audit_mark()
    attempt(proxy, "connect", "metadata.google.internal", port=443)
    e = proxy.wait_audit(lambda e: e.get("decision") == "refuse", since=mark)
    _check_fields(e)
    assert (e["host"], e["port"], e["reason"], e["address"]) == \
        ("metadata.google.internal", 443, "internal_hostname", None), e

    mark = proxy.audit_mark()
    attempt(proxy, "socks5", "kubernetes.default.svc", port=443)
    e = proxy.wait_audit(lambda e: e.get("decision") == "refuse", since=mark)
    _check_fields(e)
    assert (e["port"], e["reason"]) == (443, "internal_hostname"), e


@pytest.mark.parametrize(
    "request_line",
    [
        "GET http://169.254.169.254/ HTTP/1.1",  # Sluice's 403
        "GET http://fail-nxdomain.example/ HTTP/1.1",  # Sluice's 502
        "GET ftp://public.example:80/ HTTP/1.1",  # mitmproxy answers 400 itself
    ],
    ids=["403", "502", "ftp"],
)
def test_audit_status_matches_the_wire(proxy, fake_dns, request_line):
    """If an audit entry records a status, it is the status the client got."""
    fake_dns.set_rcode("fail-nxdomain.example", "NXDOMAIN")
    mark = proxy.audit_mark()
    host = request_line.split("//", 1)[1].split("/", 1)[0]
    r = http_request(proxy.address, f"{request_line}\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
    entry = proxy.wait_audit(lambda e: e.get("decision") == "refuse", since=mark)
    if entry.get("status") is not None:
        assert entry["status"] == r.status, (
            f"the audit log says status {entry['status']} but the client received {r.status}: {entry}"
        )


def test_audit_log_is_json_lines(proxy):
    lines = [line for line in proxy.audit_file.read_text().splitlines() if line.strip()]
    assert lines, "the audit log is empty"
    for line in lines:
        entry = json.loads(line)
        assert isinstance(entry, dict) and entry.get("decision") in ("allow", "refuse", None), line
