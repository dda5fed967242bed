"""fetch(render=true) without a browser: the clear errors, the caps' settings, the flags, the result's parts."""

from __future__ import annotations

import sys

import pytest

from sluice.webtools import render as render_mod
from sluice.webtools.client import WebClient
from sluice.webtools.fetch import fetch, render_note
from sluice.webtools.render import CHROMIUM_FLAGS, RenderLimits, launch_spec, split_proxy
from sluice.webtools.tools import call

ENV = {"SLUICE_PROXY": "http://127.0.0.1:9"}


def code(result: dict) -> str | None:
    return result.get("error", {}).get("code")


def test_screenshot_needs_render_and_both_are_booleans():
    assert code(fetch("https://example.com/", screenshot=True, client=WebClient(env=ENV))) == "web_bad_argument"
    assert code(call("fetch", {"url": "https://example.com/", "render": "yes"})) == "web_bad_argument"


def test_without_playwright_render_names_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "playwright.async_api", None)  # import fails as if not installed
    r = fetch("https://example.com/", render=True, client=WebClient(env=ENV))
    assert code(r) == "web_render_unavailable"
    assert "pip install 'sluice[render]'" in r["error"]["message"]
    assert "apt-get install chromium" in r["error"]["message"]


def test_without_chromium_render_names_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setattr(render_mod, "CHROMIUM_CANDIDATES", (str(tmp_path / "none"),))
    with pytest.raises(Exception) as e:
        launch_spec({}, "http://127.0.0.1:9")
    assert e.value.code == "web_render_unavailable" and "apt-get install chromium" in e.value.message
    with pytest.raises(Exception) as e:
        launch_spec({"SLUICE_RENDER_CHROMIUM": str(tmp_path / "nope")}, "http://127.0.0.1:9")
    assert e.value.code == "web_render_unavailable" and "SLUICE_RENDER_CHROMIUM" in e.value.message


def test_as_root_the_sandbox_needs_an_unprivileged_user(monkeypatch, tmp_path):
    chromium = tmp_path / "chromium"
    chromium.write_text("#!/bin/sh\n")
    chromium.chmod(0o755)
    monkeypatch.setattr(render_mod.os, "geteuid", lambda: 0)
    env = {"SLUICE_RENDER_CHROMIUM": str(chromium)}
    for extra, words in (({}, "SLUICE_RENDER_USER"), ({"SLUICE_RENDER_USER": "no-such-user-here"}, "not a user"),
                         ({"SLUICE_RENDER_USER": "root"}, "names root")):
        with pytest.raises(Exception) as e:
            launch_spec({**env, **extra}, "http://127.0.0.1:9")
        assert e.value.code == "web_render_unavailable" and words in e.value.message
    spec = launch_spec({**env, "SLUICE_RENDER_NO_SANDBOX": "1"}, "http://127.0.0.1:9")  # the explicit opt-in
    assert spec.sandbox is False and spec.uid is None


def test_render_limits_from_the_environment():
    assert RenderLimits.from_env({}) == RenderLimits()
    limits = RenderLimits.from_env({"SLUICE_WEB_RENDER_REQUESTS": "50", "SLUICE_WEB_RENDER_BYTES": "1MiB",
                                    "SLUICE_WEB_RENDER_CONCURRENCY": "2"})
    assert (limits.requests, limits.bytes, limits.concurrency) == (50, 1024 * 1024, 2)
    for var, raw in (("SLUICE_WEB_RENDER_REQUESTS", "lots"), ("SLUICE_WEB_RENDER_DOM_NODES", "0"),
                     ("SLUICE_WEB_RENDER_MEMORY", "big")):
        with pytest.raises(Exception) as e:
            RenderLimits.from_env({var: raw})
        assert e.value.code == "web_bad_argument" and var in e.value.message


def test_the_flags_leave_no_route_but_the_proxy():
    flags = set(CHROMIUM_FLAGS)
    for flag in ("--proxy-bypass-list=<-loopback>", "--disable-quic", "--dns-prefetch-disable",
                 "--force-webrtc-ip-handling-policy=disable_non_proxied_udp",
                 "--webrtc-ip-handling-policy=disable_non_proxied_udp", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"):
        assert flag in flags, flag
    assert not any(f.startswith(("--no-sandbox", "--proxy-server", "--ignore-certificate")) for f in flags)


def test_proxy_credentials_go_to_the_context_not_the_command_line():
    assert split_proxy("http://agent:s%40cret@127.0.0.1:8080") == ("http://127.0.0.1:8080", "agent", "s@cret")
    assert split_proxy("http://127.0.0.1:8080") == ("http://127.0.0.1:8080", None, None)


def test_render_note_says_what_the_browser_did():
    note = render_note({"requests": 12, "refused": {"address_not_public": 3}, "failed_tunnels": 1,
                        "network_quiet": False, "cut": ["requests"]})
    assert note == ("[rendered in a browser: 12 requests; 3 refused by the proxy (address_not_public x3); 1 tunnels "
                    "refused or failed; the network was still busy at the deadline; stopped at its request cap]")


def test_a_screenshot_is_an_image_part_and_never_structured_content():
    from sluice.webtools.mcp_server import metadata, to_call_result
    from sluice.webtools.tools import TOOLS

    result = {"kind": "page", "url": "https://e.example/", "final_url": "https://e.example/", "status": 200,
              "text": "page text", "content": "c", "rendered": True,
              "screenshot": {"content_type": "image/png", "bytes": 3, "sha256": "ab"}, "screenshot_data": "iVBO"}
    answer = to_call_result(TOOLS["fetch"], result)
    assert [c.type for c in answer.content] == ["text", "image"]
    assert answer.content[1].data == "iVBO" and "screenshot_data" not in metadata(result)
    assert "Screenshot image/png, 3 bytes" in answer.content[0].text
