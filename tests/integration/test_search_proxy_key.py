"""Web search with a key held by the proxy, none in the tool's environment (issue 13).

A mock Brave and Serper of this module's own stand on their real host names
(the fake DNS points api.search.brave.com and google.serper.dev at the
"public" 93.184.215.14:443; TLS with a certificate for both names from this
module's own trustme CA, which the proxy trusts upstream). They answer only
when the key header (Brave `X-Subscription-Token`, Serper `X-API-KEY`)
equals the key file's value, else 422/403 like the real ones. The proxy's
policy intercepts both hosts and holds both keys in `credentials` entries
read from files. The tool (the Python function, and `sluice search --json`
run as a subprocess with a clean environment) has no key variable, only
SLUICE_SEARCH_PROVIDER, SLUICE_PROXY and SLUICE_CA_CERT (the Sluice CA): the
search returns the mock's results, the mock saw the file's key, and the key
is in no audit line, no proxy stderr line and no tool output. The same
policy without its `credentials` gives `search_bad_key` saying neither the
tool nor the proxy supplied a key.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import ssl
import subprocess
import threading
from pathlib import Path
from urllib.parse import parse_qs

import pytest

from harness import default_policy
from harness.sluice import sluice_executable
from sluice.webtools.client import WebToolLimits, WebClient
from sluice.webtools.search import search
from harness.loops import stop_loop_thread

pytestmark = pytest.mark.netns

MOCK_IP = "93.184.215.14"
BRAVE, SERPER = "api.search.brave.com", "google.serper.dev"
HEADER = {"brave": "x-subscription-token", "serper": "x-api-key"}
HOST = {"brave": BRAVE, "serper": SERPER}
KEY_VARS = ("BRAVE_SEARCH_API_KEY", "BRAVE_SEARCH_API_KEY_FILE", "SERPER_API_KEY", "SERPER_API_KEY_FILE")
# Fresh per run: nothing in the code under test can know them.
KEYS = {"brave": "BSA-proxyheld-" + secrets.token_hex(12), "serper": "serper-proxyheld-" + secrets.token_hex(12)}


def found_for(provider: str, query: str) -> list[tuple[str, str, str]]:
    """What the mock "finds": derived from the provider and the query, so a result cannot come from elsewhere."""
    slug = "-".join(query.lower().split())
    return [(f"{provider} hit {i} for {query}", f"https://{provider}-r{i}.example/{slug}", f"snippet {i} of {slug}")
            for i in range(3)]


def jbody(obj) -> bytes:
    return json.dumps(obj).encode()


class Mock:
    """Brave and Serper; `requests` records (host, path, query, headers, body) of each request."""

    def __init__(self, ctx: ssl.SSLContext):
        self.ctx = ctx
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="search-key-mock", daemon=True)
        self.requests: list[dict] = []

    def start(self) -> Mock:
        self.thread.start()

        async def serve():
            self.server = await asyncio.start_server(self._handle, MOCK_IP, 443, ssl=self.ctx)
        asyncio.run_coroutine_threadsafe(serve(), self.loop).result(10)
        return self

    def stop(self) -> None:
        stop_loop_thread(self.loop, self.thread, [self.server])

    async def _handle(self, reader, writer):
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
                body = await reader.readexactly(int((headers.get("content-length") or ["0"])[0] or 0))
                host = (headers.get("host") or [""])[0].rsplit(":", 1)[0].lower()
                path, _, query = target.partition("?")
                req = {"host": host, "method": method, "path": path, "query": parse_qs(query), "headers": headers,
                       "body": body}
                self.requests.append(req)
                status, payload = self.route(req)
                writer.write(f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\n"
                             f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
                await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError, OSError, ssl.SSLError,
                ValueError):
            return
        finally:
            writer.close()

    @staticmethod
    def route(r) -> tuple[int, bytes]:
        h = r["headers"]
        if r["host"] == BRAVE and r["method"] == "GET" and r["path"] == "/res/v1/web/search":
            token = h.get("x-subscription-token")
            if token is None:  # the real API: a validation error naming the missing header
                return 422, jbody(brave_error("VALIDATION", "Unable to validate request parameter(s)",
                                              errors=[{"type": "missing", "loc": ["header", "x-subscription-token"],
                                                       "msg": "Field required"}]))
            if token != [KEYS["brave"]]:
                return 422, jbody(brave_error("SUBSCRIPTION_TOKEN_INVALID",
                                              "The provided subscription token is invalid."))
            q = r["query"]["q"][0]
            count = int(r["query"]["count"][0])
            return 200, jbody({"type": "search", "query": {"original": q}, "web": {"type": "search", "results": [
                {"title": t, "url": u, "description": s} for t, u, s in found_for("brave", q)[:count]]}})
        if r["host"] == SERPER and r["method"] == "POST" and r["path"] == "/search":
            if h.get("x-api-key") != [KEYS["serper"]]:
                return 403, jbody({"message": "Unauthorized.", "statusCode": 403})
            body = json.loads(r["body"])
            return 200, jbody({"searchParameters": {"q": body["q"]}, "organic": [
                {"title": t, "link": u, "snippet": s, "position": i + 1}
                for i, (t, u, s) in enumerate(found_for("serper", body["q"])[:body.get("num", 10)])]})
        return 404, jbody({"message": "not found"})


def brave_error(code, detail, **meta):
    return {"type": "ErrorResponse", "error": {"id": "e1", "status": 0, "code": code, "detail": detail, "meta": meta},
            "time": 1700000000}


def policy_text(brave_file: Path | None, serper_file: Path | None) -> str:
    base = default_policy()
    text = f"""\
version: 1
ports: {json.dumps(base["ports"])}
dns: {json.dumps(base["dns"])}
allow: [{BRAVE}, {SERPER}]
intercept: [{BRAVE}, {SERPER}]
"""
    if brave_file is not None:
        text += f"""\
credentials:
  - hosts: [{BRAVE}]
    set_headers:
      X-Subscription-Token: {{file: {brave_file}}}
  - hosts: [{SERPER}]
    set_headers:
      X-API-KEY: {{file: {serper_file}}}
"""
    return text


def entry_line(proxy, host: str) -> str:
    """`file:line` of the credentials entry for host, as the audit line names it."""
    for n, line in enumerate(proxy.policy_file.read_text().splitlines(), 1):
        if line.strip() == f"- hosts: [{host}]":
            return f"{proxy.policy_file}:{n}"
    raise AssertionError(f"no credentials entry for {host} in {proxy.policy_file}")


# ------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def ca(tmp_path_factory):
    import trustme

    authority = trustme.CA()
    path = tmp_path_factory.mktemp("search-key-ca") / "ca.pem"
    authority.cert_pem.write_to_path(str(path))
    return authority, str(path)


@pytest.fixture(scope="module")
def mock(netns, ca, fake_dns):
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca[0].issue_cert(BRAVE, SERPER).configure_cert(ctx)
    for name in (BRAVE, SERPER):
        fake_dns.set(name, a=[MOCK_IP], ttl=300)
    server = Mock(ctx).start()
    yield server
    server.stop()


@pytest.fixture(autouse=True)
def fresh(mock):
    mock.requests.clear()


@pytest.fixture(scope="module")
def key_files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("search-keys")
    files = {}
    for provider, key in KEYS.items():
        files[provider] = d / provider
        files[provider].write_text(key + "\n")
    return files


@pytest.fixture(scope="module")
def keyed(sluice_factory, mock, ca, key_files):
    return sluice_factory(policy_text(key_files["brave"], key_files["serper"]), name="search-keyed",
                          extra_args=("--set", f"ssl_verify_upstream_trusted_ca={ca[1]}"))


@pytest.fixture(scope="module")
def bare(sluice_factory, mock, ca):
    return sluice_factory(policy_text(None, None), name="search-bare",
                          extra_args=("--set", f"ssl_verify_upstream_trusted_ca={ca[1]}"))


@pytest.fixture(scope="module")
def sluice_ca(keyed, sluice_home) -> str:
    path = Path(sluice_home) / ".sluice" / "ca" / "mitmproxy-ca-cert.pem"
    assert path.is_file(), path
    return str(path)


def tool_env(proxy, sluice_ca, provider: str) -> dict[str, str]:
    return {"SLUICE_PROXY": proxy.proxy_url, "SLUICE_CA_CERT": sluice_ca, "SLUICE_SEARCH_PROVIDER": provider}


def run_function(proxy, sluice_ca, provider, query, extra=None) -> dict:
    env = {**tool_env(proxy, sluice_ca, provider), **(extra or {})}
    with WebClient(env=env, limits=WebToolLimits(timeout=15)) as client:
        return search(query, client=client)


def run_cli(proxy, sluice_ca, provider, query, tmp_path, *, as_json=True) -> subprocess.CompletedProcess:
    # A clean environment: nothing from this process but PATH, so no key and no *_PROXY can leak in.
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path), "LANG": "C.UTF-8",
           **tool_env(proxy, sluice_ca, provider)}
    assert not any(k in env for k in KEY_VARS)
    return subprocess.run([sluice_executable(), "search", *query.split(), *(["--json"] if as_json else [])],
                          env=env, capture_output=True, text=True, timeout=30, cwd=tmp_path)


def assert_no_key_anywhere(proxy, *outputs: str) -> None:
    audit = proxy.audit_file.read_text() if proxy.audit_file.exists() else ""
    stdout = proxy.stdout_file.read_text(errors="replace") if proxy.stdout_file.exists() else ""
    for key in KEYS.values():
        assert key not in audit, "the key is in the audit log"
        assert key not in proxy.stderr_text(), "the key is in the proxy's stderr"
        assert key not in stdout, "the key is in the proxy's stdout"
        for out in outputs:
            assert key not in out, "the key is in the tool's output"


# ------------------------------------------------------------------ the key held by the proxy


@pytest.mark.parametrize("provider", ["brave", "serper"])
def test_the_function_searches_with_the_proxys_key(keyed, mock, sluice_ca, provider):
    assert not any(k in os.environ for k in KEY_VARS)  # nor could the tool fall back on this process's
    query = f"proxy held {provider} key"
    mark = keyed.audit_mark()
    r = run_function(keyed, sluice_ca, provider, query)
    assert "error" not in r, r
    assert r["provider"] == provider and r["query"] == query, r
    assert [x["url"] for x in r["results"]] == [u for _, u, _ in found_for(provider, query)], r
    assert r["results"][0]["title"] == found_for(provider, query)[0][0]
    (seen,) = mock.requests
    assert seen["host"] == HOST[provider] and seen["headers"][HEADER[provider]] == [KEYS[provider]], seen
    line = keyed.wait_audit(lambda e: e["event"] == "request" and e["host"] == HOST[provider], since=mark)
    assert line["decision"] == "allow" and line["credential"] == entry_line(keyed, HOST[provider]), line
    assert_no_key_anywhere(keyed, json.dumps(r))


def test_the_agents_own_value_is_replaced(keyed, mock, sluice_ca):
    # An agent that does send a (wrong, or stolen-and-swapped) key: the proxy's value goes out instead.
    r = run_function(keyed, sluice_ca, "brave", "own value", {"BRAVE_SEARCH_API_KEY": "agent-guess-123"})
    assert r.get("provider") == "brave" and len(r["results"]) == 3, r
    (seen,) = mock.requests
    assert seen["headers"]["x-subscription-token"] == [KEYS["brave"]], seen
    assert_no_key_anywhere(keyed, json.dumps(r))


def test_the_cli_searches_with_the_proxys_key(keyed, mock, sluice_ca, tmp_path):
    query = "tide tables proxy"
    mark = keyed.audit_mark()
    p = run_cli(keyed, sluice_ca, "brave", query, tmp_path)
    assert p.returncode == 0, (p.stdout, p.stderr)
    out = json.loads(p.stdout)
    assert out["provider"] == "brave" and out["query"] == query, out
    assert [x["url"] for x in out["results"]] == [u for _, u, _ in found_for("brave", query)], out
    (seen,) = mock.requests
    assert seen["headers"]["x-subscription-token"] == [KEYS["brave"]], seen
    keyed.wait_audit(lambda e: e["event"] == "request" and e["host"] == BRAVE and e.get("credential"), since=mark)
    # The human-readable form too.
    text = run_cli(keyed, sluice_ca, "brave", query, tmp_path, as_json=False)
    assert text.returncode == 0, text.stderr
    assert f"Search: {query} · brave · 3 results" in text.stdout, text.stdout
    assert_no_key_anywhere(keyed, p.stdout, p.stderr, text.stdout, text.stderr)


# ------------------------------------------------------------------ no credentials entry: told, not hidden


@pytest.mark.parametrize("provider,status", [("brave", 422), ("serper", 403)])
def test_without_a_credentials_entry_neither_supplied_a_key(bare, mock, sluice_ca, tmp_path, provider, status):
    r = run_function(bare, sluice_ca, provider, "no key anywhere")
    e = r.get("error", {})
    assert e.get("code") == "search_bad_key" and e["provider"] == provider and e["status"] == status, r
    assert "neither the tool" in e["message"] and "nor the proxy" in e["message"], e
    p = run_cli(bare, sluice_ca, provider, "no key anywhere", tmp_path)
    assert p.returncode == 1, (p.stdout, p.stderr)
    cli = json.loads(p.stdout)["error"]
    assert cli["code"] == "search_bad_key" and "neither the tool" in cli["message"], cli
    assert [x["host"] for x in mock.requests] == [HOST[provider]] * 2
    assert all(HEADER[provider] not in x["headers"] for x in mock.requests), mock.requests
    assert not any(e.get("credential") for e in bare.audit()), bare.audit()
    assert_no_key_anywhere(bare, json.dumps(r), p.stdout, p.stderr)
