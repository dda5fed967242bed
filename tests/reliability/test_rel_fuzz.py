"""Bad input: fuzzed request lines, Host headers and CONNECT authorities sent
raw to the proxy, and fuzzed policies fed to the loader.

The proxy must never crash (still alive, no addon error or traceback on its
stderr, and a normal request is served afterwards), never hang (every
exchange is bounded by a socket timeout, and a complete request head always
gets an answer or a close), and no fuzzed input may ever reach a canary or
be allowed to a non-public address. The loader must return a
Policy or raise PolicyInvalid, nothing else, within a time bound.

Examples: 500 per proxy fuzz test and 400 per loader fuzz test by default;
SLUICE_LONG=1 runs ten times as many. atheris (coverage-guided, libFuzzer)
runs too if it is installed.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings, strategies as st

from harness import default_policy
from harness.clients import _Reader, read_response
from sluice.policy.loader import PolicyInvalid, load_policy_text
from sluice.policy.model import Policy
from relkit import KeepAlive, get, quiet_fds, scaled, settle_fds

pytestmark = pytest.mark.netns

EXCHANGE_TIMEOUT = 10.0  # seconds one fuzzed exchange may take (DNS timeout 2s, request_timeout 3s)
# The loader's bounds are CPU seconds of this process (time.process_time), not
# wall time: the bound is the loader's own work, which a loaded machine's other
# processes only delay (the 50,000-entry allow list below takes ~4 s of CPU,
# and took 17 s of wall time under a load average of 10). A hang is
# pytest-timeout's.
LOADER_TIME_BOUND = 2.0  # CPU seconds one load_policy_text call may take (fuzzed inputs are < 10 KB)
# CPU seconds for the pathological inputs (up to 3 MB, under the loader's 4 MiB
# cap): pure-Python PyYAML composes ~1 MB/s of plain text and ~20,000 list
# entries a second, and validation adds ~30 us an entry, so this bounds a
# linear cost and catches anything super-linear (alias expansion, deep nesting).
PATHOLOGICAL_TIME_BOUND = 15.0

FUZZ_SETTINGS = settings(
    max_examples=scaled(500, 5000),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                           HealthCheck.data_too_large, HealthCheck.filter_too_much],
)

# Hosts that are (or spell) canaries, internal names, and public origins.
HOSTS = [
    "127.0.0.1", "localhost", "LOCALHOST.", "foo.localhost", "0x7f.1", "2130706433", "0177.0.0.1", "127.1",
    "0x7f000001", "127.0.0.1.", "[::1]", "[::ffff:127.0.0.1]", "[::ffff:7f00:1]", "[::127.0.0.1]",
    "[0:0:0:0:0:0:0:1]", "[::1%25lo]", "[64:ff9b::7f00:1]", "[2002:7f00:1::]", "169.254.169.254",
    "0xa9fea9fe", "2852039166", "0251.0376.0251.0376", "[fd00:ec2::254]", "[fd00:ec2::254%25eth0]",
    "10.0.0.1", "10.1", "012.0.0.1", "167772161", "100.100.100.200", "metadata.google.internal",
    "metadata", "instance-data", "kubernetes.default.svc", "ｌｏｃａｌｈｏｓｔ", "127。0。0。1",
    "①②⑦.⓪.⓪.①", "0", "0.0.0.0", "[::]", "255.255.255.255", "public.example", "public.example.",
    "8.8.8.8", "[2606:4700:4700::1111]", "v6.example", "one.example", "",
]
PORTS = ["", ":80", ":443", ":8080", ":0", ":65536", ":-1", ":80:80", ":+80", ":0x50", ":080", ": 80", ":99999999999"]
CHARS = st.characters(min_codepoint=0x20, max_codepoint=0x2FFF, exclude_characters="\r\n")
LATIN1 = st.characters(min_codepoint=0x21, max_codepoint=0xFF)


def with_port(default_ports: list[str]):
    return st.tuples(hosts(), mostly(st.sampled_from(default_ports), st.sampled_from(PORTS), 2)).map("".join)


@st.composite
def hosts(draw) -> str:
    base = draw(mostly(st.sampled_from(HOSTS), st.text(CHARS, max_size=40)))
    how = draw(mostly(st.just("as-is"), st.sampled_from(["insert", "prefix", "suffix", "userinfo", "join", "case"]), 3))
    if how == "insert" and base:
        i = draw(st.integers(0, len(base)))
        base = base[:i] + draw(st.text(CHARS, min_size=1, max_size=4)) + base[i:]
    elif how == "prefix":
        base = draw(st.sampled_from(["@", "user@", "a:b@", "%31", "[", "http://", "//", "\\\\", "\t", " "])) + base
    elif how == "suffix":
        base += draw(st.sampled_from([".", "..", "%00", "#", "?", "/", "\\", "@8.8.8.8", "@127.0.0.1", " ", "\t",
                                      "%2e"]))
    elif how == "userinfo":
        base = draw(st.sampled_from(HOSTS)) + "@" + base
    elif how == "join":
        base = base + draw(st.sampled_from([".", ",", " ", ";"])) + draw(st.sampled_from(HOSTS))
    elif how == "case":
        base = base.swapcase()
    return base


def mostly(valid, odd, odd_in_ten: int = 2):
    """`valid` most of the time, `odd` about odd_in_ten times in ten: a head
    broken everywhere at once only ever earns mitmproxy's own 400."""
    return st.sampled_from(range(10)).flatmap(lambda n: odd if n < odd_in_ten else valid)


METHODS = mostly(st.sampled_from(["GET", "POST", "HEAD", "OPTIONS", "PUT", "DELETE", "PATCH"]),
                 st.one_of(st.sampled_from(["get", "TRACE", "PRI", "CONNECT", "FOO", "G\u00c9T"]),
                           st.text(LATIN1, min_size=1, max_size=8)), 1)
VERSIONS = mostly(st.sampled_from(["HTTP/1.1", "HTTP/1.0"]),
                  st.one_of(st.sampled_from(["HTTP/2.0", "HTTP/0.9", "HTTP/1.1 ", "http/1.1", "HTTP/1.10", ""]),
                            st.text(LATIN1, max_size=10)), 1)
SCHEMES = mostly(st.just("http"), st.sampled_from(["https", "HTTP", "ftp", "ws", "file", "gopher", "http:", ""]), 1)
PATHS = mostly(st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=20).map(lambda t: "/" + t),
               st.one_of(st.sampled_from(["", "*", "/%2e%2e/", "//127.0.0.1/", "?x", "#f", "@127.0.0.1/"]),
                         st.text(CHARS, max_size=20).map(lambda t: "/" + t)), 1)


@st.composite
def request_heads(draw) -> bytes:
    """One complete request head (ends with CRLF CRLF; no CR/LF inside a field)."""
    form = draw(st.sampled_from(["absolute", "absolute", "origin", "connect", "connect-host", "asterisk"]))
    method = draw(METHODS)
    version = draw(VERSIONS)
    connect = form.startswith("connect")
    authority = draw(with_port([":443", ":80"] if connect else ["", "", ":80", ":443"]))
    host_header: str | None = draw(mostly(st.just(authority), st.one_of(st.none(), with_port([""])), 2))
    if form == "absolute":
        line = f"{method} {draw(SCHEMES)}://{authority}{draw(PATHS)} {version}"
    elif form == "origin":
        line = f"{method} {draw(PATHS)} {version}"
    elif connect:
        line = f"CONNECT {authority} {version}"
        if form == "connect-host":
            host_header = authority
    else:
        line = f"{method} * {version}"
    headers = []
    if host_header is not None:
        headers.append(f"Host: {host_header}")
        if draw(st.sampled_from(range(10))) == 0:
            headers.append(f"Host: {draw(with_port(['']))}")  # a second Host header
    headers.append("Connection: close")
    head = "\r\n".join([line, *headers]) + "\r\n\r\n"
    encoding = draw(mostly(st.just("utf-8"), st.just("latin-1"), 1))
    return head.encode(encoding, "replace")


def _answer_or_close(proxy, raw: bytes) -> tuple[object, float]:
    """Send `raw`, read one response (or the close). Bounded by EXCHANGE_TIMEOUT."""
    started = time.monotonic()
    with socket.create_connection(proxy.address, timeout=EXCHANGE_TIMEOUT) as s:
        try:
            s.sendall(raw)
        except OSError:
            return None, time.monotonic() - started
        method = raw.split(b" ", 1)[0].decode("latin-1")
        response = read_response(_Reader(s), method=method, connect=(method == "CONNECT"))
    elapsed = time.monotonic() - started
    if response.status is None and elapsed >= EXCHANGE_TIMEOUT * 0.95:
        # read_response reports a timeout like a close: tell them apart.
        raise TimeoutError(f"no answer within {EXCHANGE_TIMEOUT}s")
    return response, elapsed


@pytest.fixture(scope="module")
def fuzz_proxy(sluice_factory):
    # "No hang" means within the policy's own bounds: a fuzzed https:// URL to
    # a plain-HTTP port leaves a TLS handshake hanging until request_timeout.
    policy = default_policy(limits={"connect_timeout": "3s", "request_timeout": "5s"})
    return sluice_factory(policy, name="fuzz")


_STAMP = re.compile(r"^sluice: ")  # every stderr record starts so (sluice/proxy.py OneVoice)


def _error_blocks(text: str) -> list[str]:
    """stderr split into its log records (`sluice: ` lines and what follows them)."""
    blocks: list[list[str]] = []
    for line in text.splitlines():
        if _STAMP.match(line) or not blocks:
            blocks.append([line])
        else:
            blocks[-1].append(line)
    return ["\n".join(b) for b in blocks]


def _settled_stderr(proxy, mark: int, quiet: float = 0.3, limit: float = 10.0) -> str:
    """The proxy's stderr since `mark` once it has stopped growing: a crash
    record still arriving through the pipe (the client already saw its
    connection close) would otherwise be judged half-written."""
    deadline = time.monotonic() + limit
    text = proxy.stderr_since(mark)
    while time.monotonic() < deadline:
        time.sleep(quiet)
        later = proxy.stderr_since(mark)
        if later == text:
            break
        text = later
    return text


def _is_mitmproxy_connection_crash(block: str) -> bool:
    """mitmproxy's own per-connection crash handler caught an assertion in its
    layer code (see test_pipelined_connect_then_half_close_is_contained):
    the connection is dropped, the proxy lives on. No Sluice frame in it."""
    lines = block.splitlines()
    files = [line for line in lines if line.strip().startswith("File ")]
    return (
        "mitmproxy has crashed!" in lines[0]
        and lines[-1].startswith("AssertionError")
        and bool(files)
        and all("/mitmproxy/" in f for f in files)
    )


def _check_proxy_after(proxy, stderr_mark: int, audit_mark: int, *, connection_crashes_ok: bool = False) -> None:
    assert proxy.alive(), f"the proxy died:\n{proxy.stderr_text(tail=60)}"
    unknown = [b for b in _error_blocks(_settled_stderr(proxy, stderr_mark))
               if any(m in b for m in ("Traceback", "Addon error", "Error in", "Exception", "Unhandled", "crashed"))
               and not (connection_crashes_ok and _is_mitmproxy_connection_crash(b))]
    assert not unknown, "the proxy logged errors:\n" + "\n".join(unknown)[-6000:]
    r = KeepAlive(proxy.address, timeout=10).request(get("http://public.example/after-fuzz", close=True))
    assert r.status == 200 and r.body == b"origin ok public.example /after-fuzz\n", r
    # internal_error means a check raised and the fail-safe refused: a bug.
    internal = [e for e in proxy.audit()[audit_mark:] if e.get("reason") == "internal_error"]
    assert not internal, f"{len(internal)} exchanges hit internal_error, e.g. {internal[:3]}"
    # Anything allowed went to a globally reachable address (by Python's own
    # reading of the IANA registries; Sluice's table is stricter still). A
    # fuzzed public literal outside the namespace is allowed and fails to
    # connect (no route: only lo exists here).
    allowed = {e.get("address") for e in proxy.audit()[audit_mark:] if e.get("decision") == "allow"
               and e.get("address")}
    not_global = {a for a in allowed if not ipaddress.ip_address(a).is_global}
    assert not not_global, f"fuzzed requests were allowed to non-public addresses {not_global}"


@pytest.mark.timeout(scaled(120, 900))
def test_fuzzed_request_heads(fuzz_proxy, canaries):
    proxy = fuzz_proxy
    stderr_mark, audit_mark = proxy.stderr_mark(), proxy.audit_mark()
    hangs: list[bytes] = []
    statuses: dict = {}

    @FUZZ_SETTINGS
    @given(raw=request_heads())
    def exchange(raw: bytes) -> None:
        try:
            response, _elapsed = _answer_or_close(proxy, raw)
        except TimeoutError:
            hangs.append(raw)
            raise AssertionError(f"no answer and no close within {EXCHANGE_TIMEOUT}s for {raw!r}") from None
        except ConnectionError:
            response, _elapsed = None, 0.0
        status = getattr(response, "status", None)
        statuses[status] = statuses.get(status, 0) + 1
        if response is not None and response.status is not None:
            assert b"canary" not in response.body, f"a canary answered {raw!r}: {response}"
            assert response.sluice_reason != "internal_error", f"a check failed on {raw!r}: {response}"
        assert proxy.alive(), f"the proxy died on {raw!r}:\n{proxy.stderr_text(tail=60)}"
        canaries.assert_untouched()

    exchange()
    print("statuses seen:", statuses)
    assert not hangs
    _check_proxy_after(proxy, stderr_mark, audit_mark)


PREFIXES = [
    b"GET http://127.0.0.1/ HTTP/1.1\r\n", b"CONNECT 169.254.169.254:80 HTTP/1.1\r\n", b"GET / HTTP/1.1\r\nHost: ",
    b"CONNECT public.example:80 HTTP/1.1\r\n\r\n", b"GET http://public.example/ HTTP/1.1\r\nHost: public.example\r\n",
    b"POST http://public.example/ HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n", b"", b"\x16\x03\x01",
    b"\x05\x01\x00", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
]


@pytest.mark.timeout(scaled(120, 900))
def test_fuzzed_raw_bytes(fuzz_proxy, canaries):
    """Arbitrary bytes after a request-ish prefix, then our side shuts: any
    answer or none, but bounded, no crash, no canary."""
    proxy = fuzz_proxy
    stderr_mark, audit_mark = proxy.stderr_mark(), proxy.audit_mark()

    @FUZZ_SETTINGS
    @given(prefix=st.sampled_from(PREFIXES), tail=st.binary(max_size=600))
    def exchange(prefix: bytes, tail: bytes) -> None:
        with socket.create_connection(proxy.address, timeout=EXCHANGE_TIMEOUT) as s:
            try:
                s.sendall(prefix + tail)
                s.shutdown(socket.SHUT_WR)
                received = b""
                deadline = time.monotonic() + EXCHANGE_TIMEOUT
                while time.monotonic() < deadline and len(received) < 1 << 20:
                    chunk = s.recv(65536)
                    if not chunk:
                        break
                    received += chunk
            except (ConnectionError, TimeoutError):
                received = b""
        assert b"canary" not in received, f"a canary answered {prefix + tail!r}"
        assert proxy.alive(), f"the proxy died on {prefix + tail!r}:\n{proxy.stderr_text(tail=60)}"
        canaries.assert_untouched()

    exchange()
    # Raw bytes reach mitmproxy's own per-connection assertions (a pipelined
    # CONNECT then a half-close does it): tolerated here, pinned below.
    _check_proxy_after(proxy, stderr_mark, audit_mark, connection_crashes_ok=True)


def test_pipelined_connect_then_half_close_is_contained(fuzz_proxy, net):
    """Found by the raw-bytes fuzz: CONNECT, a second CONNECT pipelined behind
    it, then the client shuts its write side. mitmproxy (stock mitmdump with
    tcp_hosts=.* too) trips an internal assertion and logs "mitmproxy has
    crashed!" for that connection. It must stay contained: the proxy lives,
    serves, and holds no fd for it afterwards."""
    proxy = fuzz_proxy
    pid = proxy.proc.pid
    base = quiet_fds(pid)
    mark = proxy.stderr_mark()
    raw = b"CONNECT public.example:80 HTTP/1.1\r\n\r\n" * 2
    for _ in range(30):
        with socket.create_connection(proxy.address, timeout=EXCHANGE_TIMEOUT) as s:
            s.sendall(raw)
            s.shutdown(socket.SHUT_WR)
            while s.recv(65536):
                pass
    crashes = [b for b in _error_blocks(_settled_stderr(proxy, mark)) if "crashed" in b]
    print(f"{len(crashes)} of 30 connections logged 'mitmproxy has crashed!'")
    assert all(_is_mitmproxy_connection_crash(b) for b in crashes), crashes
    _check_proxy_after(proxy, mark, proxy.audit_mark(), connection_crashes_ok=True)
    end = settle_fds(pid, base + 10, 15.0)
    assert end <= base + 10, f"{end} fds after 30 crashed connections, baseline {base}"


@pytest.fixture(scope="module")
def methods_proxy(sluice_factory):
    return sluice_factory(default_policy(methods=["GET", "HEAD"]), name="methods")


@pytest.mark.parametrize("method", [b"\xd1POST", b"POST\xd1", b"DELETE\xff"])
def test_non_utf8_method_is_refused_not_forwarded(methods_proxy, net, method):
    """Regression (found by the fuzz): mitmproxy decodes a non-UTF-8 method
    byte to a lone surrogate; building the method_not_allowed refusal used to
    raise UnicodeEncodeError in the gate, and mitmproxy then forwarded the
    request the policy refused (fail-open), unaudited."""
    origin = net.origin("8.8.8.8", 80)
    raw = method + b" http://public.example/method-bypass HTTP/1.1\r\nHost: public.example\r\nConnection: close\r\n\r\n"
    response, _ = _answer_or_close(methods_proxy, raw)
    seen = [r for r in origin.snapshot()[1] if r.path == "/method-bypass"]
    assert not seen, f"a {method!r} request the policy refuses reached the origin (client got {response})"
    assert response is not None and (response.status, response.sluice_reason) == (403, "method_not_allowed"), response


def test_refusal_with_non_utf8_method_is_audited(methods_proxy):
    """Regression (found by the fuzz): the audit line of a refusal whose
    method carries a non-UTF-8 byte used to fail to write."""
    mark = methods_proxy.audit_mark()
    raw = b"GET\xd1 http://169.254.169.254/audit HTTP/1.1\r\nHost: 169.254.169.254\r\nConnection: close\r\n\r\n"
    response, _ = _answer_or_close(methods_proxy, raw)
    assert (response.status, response.sluice_reason) == (403, "address_not_public"), response
    methods_proxy.wait_audit(lambda e: e["decision"] == "refuse" and e["host"] == "169.254.169.254", since=mark,
                             timeout=3, what="the refusal's audit line")


# ================================================================== the policy loader

LOADER_SETTINGS = settings(
    max_examples=scaled(400, 4000),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)

TOP_KEYS = ["version", "action", "allow", "deny", "ports", "methods", "private_networks", "limits", "intercept",
            "strip_request_headers", "dns", "clients", "require_client"]
SUB_KEYS = ["connect_timeout", "request_timeout", "idle_timeout", "max_response_bytes", "max_request_bytes",
            "tunnel_max_bytes", "tunnel_max_seconds", "nameservers", "timeout", "min_ttl", "max_ttl", "name",
            "users", "sources", "password_hash", "password_file"]
SCALAR_TEXT = ["1", "0", "-1", "1.5", "1e309", "nan", ".inf", "true", "no", "~", "null", "", "5s", "0ms", "-1s",
               "1e400s", "10MiB", "0B", "9" * 40 + "TiB", "2m", "1h", "enforce", "report", "*", "**.example.com",
               "*.example.com", "example.com", "10.0.0.0/8", "10.0.0.5/32:8080", "[2001:db8::/64]:80", "::/0",
               "127.0.0.1:53", "[::1]:53", "256.0.0.1", "GET", "get", "FOO", "X-Token", "pbkdf2_sha256$1$a$b",
               "sha256:" + "0" * 64, "2001-13-45", "0x50", "0o17", "1_000", "!!python/object:os.system", "a:b@c"]
SCALARS = st.one_of(
    st.sampled_from(SCALAR_TEXT), st.integers(-(2**70), 2**70), st.floats(allow_nan=True), st.booleans(),
    st.none(), st.text(max_size=30),
)
KEYS = st.one_of(st.sampled_from(TOP_KEYS + SUB_KEYS), st.text(max_size=12), st.integers(-5, 5), st.booleans())


STRUCTURED = st.recursive(
    SCALARS,
    lambda children: st.one_of(st.lists(children, max_size=5), st.dictionaries(KEYS, children, max_size=5)),
    max_leaves=40,
)


@st.composite
def policy_like(draw) -> dict:
    """A mapping shaped like a policy: known keys, arbitrary values."""
    doc = {}
    if draw(st.booleans()):
        doc["version"] = draw(st.one_of(st.just(1), SCALARS))
    for key in draw(st.lists(st.sampled_from(TOP_KEYS[1:]), max_size=6, unique=True)):
        if key in ("limits", "dns"):
            doc[key] = draw(st.dictionaries(st.sampled_from(SUB_KEYS), st.one_of(SCALARS, STRUCTURED), max_size=5))
        elif key == "clients":
            doc[key] = draw(st.lists(st.dictionaries(st.sampled_from(TOP_KEYS + SUB_KEYS), STRUCTURED, max_size=5),
                                     max_size=3))
        else:
            doc[key] = draw(st.one_of(st.lists(SCALARS, max_size=6), STRUCTURED))
    return doc


YAML_TOKENS = ["version: 1\n", "&a ", "*a", "*b", "&b [*a, *a, *a]", "!!str ", "!!int ", "!!binary ", "!!set ",
               "!!python/name:os.system ", "!foo ", "<<: ", "? ", ": ", "- ", "[", "]", "{", "}", ", ", "\n",
               "  ", "\t", "'", '"', "|\n  ", ">-\n  ", "%YAML 1.1\n", "%TAG ! tag:x,2000:\n", "---\n", "...\n",
               "# c\n", "allow:", "ports:", "limits:", "dns:", "clients:", "\\u0000", "\x00", "\ufeff", "~",
               "2001-13-45", "0x", "1e999", "\udcff"]
YAML_TEXT = st.lists(st.one_of(st.sampled_from(YAML_TOKENS), st.text(max_size=6)), max_size=60).map("".join)


SAFETY_NET = "the policy could not be read ("


def _load_bounded(text: str, bound: float = LOADER_TIME_BOUND) -> None:
    started = time.process_time()  # the loader's own CPU time (see LOADER_TIME_BOUND)
    try:
        result = load_policy_text(text, "fuzz.yaml")
    except PolicyInvalid as e:
        assert e.problems, "PolicyInvalid without a problem"
        for p in e.problems:
            assert p.file == "fuzz.yaml" and p.line >= 1 and p.col >= 1, p
            # The loader's safety net turns an unexpected exception into this
            # problem: a gap in validation, i.e. a bug, even though it is caught.
            assert not p.message.startswith(SAFETY_NET), f"validation gap on {text[:300]!r}: {p}"
    else:
        assert isinstance(result, Policy), type(result)
    elapsed = time.process_time() - started
    assert elapsed < bound, f"load_policy_text took {elapsed:.2f}s of CPU on {text[:300]!r}"


@pytest.mark.timeout(scaled(120, 900))
@LOADER_SETTINGS
@given(text=st.text(max_size=3000))
def test_loader_random_text(text):
    _load_bounded(text)


@pytest.mark.timeout(scaled(120, 900))
@LOADER_SETTINGS
@given(text=YAML_TEXT)
def test_loader_yaml_fragments(text):
    _load_bounded(text)


@pytest.mark.timeout(scaled(120, 900))
@LOADER_SETTINGS
@given(doc=st.one_of(policy_like(), STRUCTURED), flow=st.booleans())
def test_loader_structured_yaml(doc, flow):
    _load_bounded(yaml.safe_dump(doc, default_flow_style=flow, allow_unicode=True))


UNCONSTRUCTIBLE = ["!!int ", "version: !!int ''", "version: !!float ''", "version: 1\nports: [!!bool '']",
                   "version: 1\nrequire_client: !!timestamp 2001-01-01T", "version: !!int '+'", "version: !!int '_'"]


@pytest.mark.parametrize("text", UNCONSTRUCTIBLE)
def test_loader_unconstructible_tagged_scalars(text):
    """Regression (found by the fuzz): PyYAML raises IndexError, KeyError or
    AttributeError for these; the loader must report them as problems with
    a position (not through its safety net)."""
    with pytest.raises(PolicyInvalid) as e:
        load_policy_text(text, "bug.yaml")
    assert not any(p.message.startswith(SAFETY_NET) for p in e.value.problems), e.value.problems


@pytest.mark.parametrize("text", [
    "[" * 100_000,
    "{a: " * 50_000,
    "- " * 50_000 + "x",
    "a: &a [" + ",".join(["x"] * 50) + "]\n" + "".join(f"{c}: &{c} [" + ",".join([f"*{p}"] * 50) + "]\n"
                                                       for p, c in zip("abcdefg", "bcdefgh")),
    "version: 1\nallow: [" + ", ".join(f"h{i}.example" for i in range(50_000)) + "]\n",
    "version: 1\n" + "#" * 3_000_000,
])
def test_loader_pathological_inputs(text):
    _load_bounded(text, PATHOLOGICAL_TIME_BOUND)


# ================================================================== atheris (coverage-guided), if installed

ATHERIS_TARGET = Path(__file__).with_name("atheris_targets.py")


def _libfuzzer_escape(token: str) -> str:
    out = []
    for b in token.encode("utf-8", "surrogatepass"):
        c = chr(b)
        out.append(f"\\x{b:02X}" if b < 0x20 or b > 0x7E or c in '"\\' else c)
    return "".join(out)


@pytest.mark.timeout(scaled(120, 900))
@pytest.mark.parametrize("target", ["loader", "hosts"])
def test_atheris(target, tmp_path):
    pytest.importorskip("atheris", reason="atheris is not installed (pip install atheris)")
    runs = {"loader": scaled(1000, 30000), "hosts": scaled(3000, 100000)}[target]
    seconds = scaled(30, 300)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    if target == "loader":
        for f in (Path(__file__).resolve().parents[2] / "config").rglob("*.yaml"):
            (corpus / f.name).write_bytes(f.read_bytes())
    args = []
    if target == "loader":
        dictionary = tmp_path / "yaml.dict"
        dictionary.write_text("".join(f'kw{i}="{_libfuzzer_escape(t)}"\n' for i,
                                      t in enumerate(YAML_TOKENS + TOP_KEYS + SUB_KEYS)))
        args.append(f"-dict={dictionary}")
    env = dict(os.environ)
    p = subprocess.run(
        [sys.executable, str(ATHERIS_TARGET), target, str(corpus), *args, f"-runs={runs}",
         f"-max_total_time={seconds}", "-timeout=5", "-rss_limit_mb=2048", "-print_final_stats=1"],
        capture_output=True, text=True, timeout=seconds + 120, cwd=tmp_path, env=env,
    )
    assert p.returncode == 0, f"atheris found a failure (exit {p.returncode}):\n{p.stderr[-6000:]}"
