"""Inputs that used to raise out of the web tools (issue 19 item 11): each is
now a clear tool error, and an argument is bounded before it is used (never
echoed back in full). No test here sends a packet: every case is refused
before a connection, and the proxy named is a closed loopback port or none."""

from __future__ import annotations

import json
import os
import subprocess

import httpx
import pytest

from harness.sluice import sluice_executable
from sluice.webtools.client import MAX_URL_CHARS, Fetched, WebToolLimits, WebClient, proxy_for
from sluice.webtools.errors import ERRORS, WebError
from sluice.webtools.fetch import fetch
from sluice.webtools.request import request
from sluice.webtools.search import search
from sluice.webtools.tools import TOOLS, call

CLOSED_PROXY = {"SLUICE_PROXY": "http://127.0.0.1:9"}  # loopback discard port: nothing listens


def code(result: dict) -> str | None:
    return result.get("error", {}).get("code")


# ------------------------------------------------------------------ headers, URLs, the proxy URL

@pytest.mark.parametrize("value", ["té", "text/plain\u2028x", "a\x7fb", "\u00a0", "x" * 1001])
def test_a_header_value_that_is_not_printable_ascii_is_refused(value):
    with WebClient(env=CLOSED_PROXY) as client:
        result = request("http://1.1.1.1/", headers={"accept": value}, client=client)
    assert code(result) == "web_bad_argument" and result["error"]["argument"] == "headers", result
    assert value not in result["error"]["message"]


def test_a_refused_header_name_is_not_echoed_in_full():
    with WebClient(env=CLOSED_PROXY) as client:
        result = request("http://1.1.1.1/", headers={"x" * 1_000_000: "1"}, client=client)
    assert code(result) == "web_header_not_allowed" and len(json.dumps(result)) < 1000


@pytest.mark.parametrize("url", ["http://1.1.1.1/" + "a" * 70_000, "https://1.1.1.1/?" + "q" * (MAX_URL_CHARS + 1)])
def test_a_url_over_the_bound_is_web_bad_url(url):
    with WebClient(env=CLOSED_PROXY) as client:
        result = fetch(url, client=client, owner="t")
    assert code(result) == "web_bad_url" and result["error"]["limit"] == MAX_URL_CHARS, result
    assert len(json.dumps(result)) < 1000


@pytest.mark.parametrize("proxy",
                         ["http://127.0.0.1:abc", "http://127.0.0.1:99999", "http://127.0.0.1:", "127.0.0.1:-1",
                                   "http://[::1", "http://[::1]x", "http://:8080", "http://u:secret@127.0.0.1:8o8o"])
def test_a_malformed_proxy_url_is_web_no_proxy(proxy):
    with pytest.raises(WebError) as caught:
        proxy_for("https", {"SLUICE_PROXY": proxy})
    assert caught.value.code == "web_no_proxy" and "SLUICE_PROXY" in caught.value.message
    assert "secret" not in caught.value.message
    with WebClient(env={"SLUICE_PROXY": proxy}) as client:
        assert code(fetch("http://1.1.1.1/", client=client, owner="t")) == "web_no_proxy"


@pytest.mark.parametrize("proxy", ["http://127.0.0.1:8080", "127.0.0.1:8080", "http://[::1]:8080",
                                   "http://user:p%40ss@proxy.internal:3128", "http://proxy.internal"])
def test_well_formed_proxy_urls_still_pass(proxy):
    assert proxy_for("https", {"SLUICE_PROXY": proxy}).endswith(proxy.split("://")[-1])


# ------------------------------------------------------------------ SearXNG answers of the wrong shape

class OneAnswer:
    """A client that answers every request with one JSON body (no network)."""

    def __init__(self, body):
        self.env, self.limits = {"SEARXNG_URL": "http://searxng:8080"}, WebToolLimits()
        self.body = json.dumps(body).encode()

    def request(self, url, *, classify, **kwargs):
        f = Fetched(url, url, 200, "application/json", "application/json", None, httpx.Headers({}))
        classify(f)
        f.body = self.body
        return f


@pytest.mark.parametrize("engines", [{"google": 1}, 7, [], [{"name": "google"}], None, "google"])
def test_searxng_results_whose_engines_are_not_a_list_of_names(engines):
    body = {"query": "q", "results": [{"url": "https://tides.example/", "title": "Tides", "content": "c",
                                       "engines": engines}], "unresponsive_engines": []}
    result = search("tides", provider="searxng", client=OneAnswer(body))
    assert "error" not in result, result
    assert [r["source"] for r in result["results"]] == ["searxng"]


@pytest.mark.parametrize("unresponsive", [{"google": "timeout"}, 3, "google", [["google", "timeout"], 5]])
def test_searxng_unresponsive_engines_of_any_shape(unresponsive):
    result = search("tides", provider="searxng",
                    client=OneAnswer({"results": [], "unresponsive_engines": unresponsive}))
    if isinstance(unresponsive, list):
        assert code(result) == "search_provider_error" and "google" in result["error"]["message"]
    else:  # not SearXNG's shape: no engines to name, an empty answer
        assert "error" not in result and result["results"] == [], result


# ------------------------------------------------------------------ bounded arguments

def test_every_string_argument_is_bounded_and_never_echoed():
    huge = "s" * 5_000_000
    for tool in TOOLS.values():
        for param in tool.params:
            if param.type != "string" or param.name == "query":
                continue
            args = {p.name: "https://example.com/" for p in tool.params if p.required}
            args[param.name] = huge
            result = call(tool.name, args)
            assert code(result) == "web_bad_argument" and result["error"]["argument"] == param.name, (tool.name, result)
            assert len(json.dumps(result)) < 500
    result = call("source_read", {"source_id": huge})
    assert "5,000,000" in result["error"]["message"]
    # An unknown argument's name is not echoed in full either.
    assert len(json.dumps(call("fetch", {"url": "https://example.com/", huge: 1}))) < 500
    # The query keeps search's own bound and code.
    assert code(call("search", {"query": huge})) == "search_bad_query"


def test_web_busy_and_web_type_mismatch_are_codes():
    assert {"web_busy", "web_type_mismatch", "web_internal_error"} <= set(ERRORS)


def test_a_bug_in_a_tool_is_a_tool_error(monkeypatch):
    def broken(**kwargs):
        raise KeyError("secret-bytes-from-the-web")

    monkeypatch.setitem(TOOLS, "read", TOOLS["read"].__class__(**{**TOOLS["read"].__dict__, "function": broken}))
    result = call("read", {"url": "https://example.com/"})
    assert code(result) == "web_internal_error" and result["error"]["exception"] == "KeyError"
    assert "secret-bytes" not in json.dumps(result)


# ------------------------------------------------------------------ the CLI prints no traceback

@pytest.mark.parametrize("argv, proxy, want", [
    (["request", "http://1.1.1.1/", "--header", "accept: té"], "http://127.0.0.1:9", "web_bad_argument"),
    (["fetch", "http://1.1.1.1/" + "a" * 70_000], "http://127.0.0.1:9", "web_bad_argument"),
    (["source-read", "s" * 100_000], "http://127.0.0.1:9", "web_bad_argument"),
    (["fetch", "http://1.1.1.1/"], "http://127.0.0.1:abc", "web_no_proxy"),
    (["request", "http://1.1.1.1/"], "http://[::1", "web_no_proxy"),
])
def test_cli_errors_are_one_line_without_a_traceback(argv, proxy, want, tmp_path):
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "SLUICE_PROXY": proxy, "HOME": str(tmp_path),
           "SLUICE_SOURCES": str(tmp_path / "s.sqlite3"), "SLUICE_OWNER": "t"}
    out = subprocess.run([sluice_executable(), *argv], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 1 and out.stderr.startswith(f"Error {want}: "), out.stderr[:2000]
    assert "Traceback" not in out.stderr and len(out.stderr) < 1000
