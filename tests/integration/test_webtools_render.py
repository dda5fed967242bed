"""fetch(render=true): headless Chromium whose only way out is the Sluice proxy (issue 27).

An origin on the "public" 1.1.1.1 (plain :8095, TLS :8445 as spa.example.com
with the trustme CA, which the browser trusts through SLUICE_CA_CERT) serves
an SPA, a page whose scripts try every route to the canaries, a page that
never finishes, one that opens a thousand requests, and one that reads and
writes cookies and storage. Each escape is also tried in a control run (the
same page in a browser started without Sluice's flags, with direct routes),
which must reach the canaries: so the refusal is the flags' and the proxy's
doing, not the page's failure.

Chromium runs with its sandbox, as an unprivileged user this module creates
(SLUICE_RENDER_USER) when the tests run as root. The module is skipped, with
the reason, only when Playwright or Chromium is not installed; `make venv`
and .ci/run install both.
"""

from __future__ import annotations

import asyncio
import json
import os
import pwd
import subprocess
import sys
import threading
import time

import pytest

from harness import default_policy
from harness.http import read_request_head
from harness.loops import stop_loop_thread
from sluice.webtools import render as render_mod
from sluice.webtools.client import WebToolLimits, WebClient
from sluice.webtools.fetch import fetch
from sluice.webtools.store import SourceStore

pytestmark = pytest.mark.netns

try:
    import playwright.async_api  # noqa: F401
    _PLAYWRIGHT = True
except ImportError:
    _PLAYWRIGHT = False
_CHROMIUM = next((p for p in render_mod.CHROMIUM_CANDIDATES if os.access(p, os.X_OK)), None)
if not _PLAYWRIGHT or _CHROMIUM is None:
    pytest.skip("render tests need Playwright (pip install 'sluice[render]') and Chromium (apt-get install "
                f"chromium libnss3-tools): {'Playwright' if not _PLAYWRIGHT else 'Chromium'} is not installed",
                allow_module_level=True)

ORIGIN = "1.1.1.1"
PLAIN, TLS = 8095, 8445
BASE = f"http://{ORIGIN}:{PLAIN}"
RENDER_USER = "sluice-render-test"

SPA = """<!doctype html><html><head><title>Loading…</title></head><body><div id="root"></div>
<script>
fetch('/data.json').then(r => r.json()).then(d => {
  document.title = d.title;
  const main = document.createElement('main');
  const h = document.createElement('h1'); h.textContent = d.title; main.appendChild(h);
  for (const t of d.paragraphs) { const p = document.createElement('p'); p.textContent = t; main.appendChild(p); }
  document.getElementById('root').appendChild(main);
});
</script></body></html>"""
DATA = {"title": "Harbour tides", "paragraphs": [
    "The harbour fills twice a day, and this sentence exists only once the script has run and built the page.",
    "Spring tides come with the new and the full moon; neap tides between them, when sun and moon pull apart."]}

# Every route a page has to a canary: fetch and XHR to private literals and
# loopback, a WebSocket, images, a prefetch, an https fetch (a CONNECT the
# proxy refuses), and allowed subresources on public origins beside them.
ESCAPE = """<!doctype html><html><head><title>escape</title>
<link rel="prefetch" href="http://10.0.0.1:8080/prefetched">
<link rel="dns-prefetch" href="//dns-prefetch-leak.example">
<link rel="preconnect" href="http://100.100.100.200/">
</head><body><main><h1>Escape attempts</h1>
<p id="status">The scripts on this page try to reach private addresses; this text is the page's own.</p>
<img src="http://10.0.0.1/pixel.png"><img src="http://169.254.169.254:8080/latest/meta-data.png">
<img src="/allowed.png"><img src="http://8.8.8.8/public-image.png">
</main><script>
const tries = [
  fetch('http://169.254.169.254/latest/meta-data/', {mode: 'no-cors'}),
  fetch('http://10.0.0.1/', {mode: 'no-cors'}),
  fetch('http://127.0.0.1/', {mode: 'no-cors'}),
  fetch('https://10.0.0.1/', {mode: 'no-cors'}),
  new Promise(done => { const x = new XMLHttpRequest(); x.onloadend = done; x.open('GET', 'http://10.0.0.1:8080/xhr'); x.send(); }),
  new Promise(done => { try { const ws = new WebSocket('ws://10.0.0.1:8080/ws'); ws.onerror = ws.onclose = done; ws.onopen = done; } catch (e) { done(); } }),
];
Promise.allSettled(tries).then(() => {
  const p = document.createElement('p'); p.textContent = 'All the attempts have ended, and the page carried on.';
  document.querySelector('main').appendChild(p);
});
</script></body></html>"""
CANARY_TARGETS = ("10.0.0.1", "169.254.169.254", "127.0.0.1")

FLOOD = """<!doctype html><html><body><main><h1>Flood</h1><p>This page asks for a thousand images at once, which
is far more than one render may request.</p></main><script>
for (let i = 0; i < 1000; i++) { const img = new Image(); img.src = '/flood/' + i + '.png'; document.body.appendChild(img); }
</script></body></html>"""

STORAGE = """<!doctype html><html><body><main><h1>Storage</h1><p id="seen"></p></main><script>
const before = 'cookie=' + (document.cookie || 'none') + ' local=' + (localStorage.getItem('k') || 'none');
document.cookie = 'k=' + Math.random() + '; max-age=3600';
localStorage.setItem('k', 'set-by-a-render');
setTimeout(() => { document.getElementById('seen').textContent = 'Before this render: ' + before +
  '. This sentence makes the paragraph long enough for the extractor to keep it.'; }, 300);
</script></body></html>"""

# WebRTC: a STUN request to a canary's UDP port (ICE gathering starts at setLocalDescription);
# /slow keeps the page open while it gathers.
STUN = """<!doctype html><html><body><main><h1>STUN</h1><p id="s">This page asks a STUN server on a private
address for its public address, which would be a UDP datagram past any HTTP proxy.</p></main><script>
const pc = new RTCPeerConnection({iceServers: [{urls: 'stun:10.0.0.1:3478'}]});
pc.createDataChannel('x');
pc.createOffer().then(o => pc.setLocalDescription(o));
fetch('/slow');
</script></body></html>"""
STUN_PORT = 3478

BUSY = """<!doctype html><html><body><main><h1>Busy</h1><p>This page polls its origin for as long as it is open,
so the network never goes quiet; the render must still end and read it.</p></main><script>
setInterval(() => fetch('/poll?' + Math.random()), 100);
</script></body></html>"""


class RenderOrigin:
    """HTTP/1.1 origin for the render pages (plain and TLS), recording paths."""

    def __init__(self, server_ctx):
        self.server_ctx = server_ctx
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.paths: list[str] = []

    def start(self) -> RenderOrigin:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)
        return self

    async def _start(self):
        self.servers = [await asyncio.start_server(self._handle, ORIGIN, PLAIN),
                        await asyncio.start_server(self._handle, ORIGIN, TLS, ssl=self.server_ctx)]

    def stop(self):
        stop_loop_thread(self.loop, self.thread, self.servers)

    def seen(self, prefix: str) -> list[str]:
        return [p for p in list(self.paths) if p.startswith(prefix)]

    async def _handle(self, reader, writer):
        try:
            while True:
                _, target, _ = await read_request_head(reader)
                path = "/" + target.split("://", 1)[1].split("/", 1)[1] if "://" in target else target
                self.paths.append(path)
                if not await self._route(path, writer):
                    return
        except (asyncio.IncompleteReadError, ConnectionError, OSError, ValueError):
            return
        finally:
            writer.close()

    async def _send(self, writer, ctype: str, body: str | bytes, status: int = 200) -> bool:
        body = body.encode() if isinstance(body, str) else body
        writer.write((f"HTTP/1.1 {status} X\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n\r\n").encode()
                     + body)
        await writer.drain()
        return True

    async def _route(self, path: str, writer) -> bool:
        pages = {"/spa": SPA, "/escape": ESCAPE, "/flood": FLOOD, "/storage": STORAGE, "/busy": BUSY, "/stun": STUN}
        if path in pages:
            return await self._send(writer, "text/html; charset=utf-8", pages[path])
        if path == "/data.json":
            return await self._send(writer, "application/json", json.dumps(DATA))
        if path == "/slow":
            await asyncio.sleep(3)
            return await self._send(writer, "text/plain", "slow")
        if path == "/plain.txt":
            return await self._send(writer, "text/plain", "just text, no page to render")
        if path == "/never":  # a document that never finishes arriving
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nContent-Length: 100000\r\n\r\n<html><body>")
            await writer.drain()
            await asyncio.sleep(3600)
            return False
        return await self._send(writer, "image/png", b"\x89PNG\r\n\x1a\n")


@pytest.fixture(scope="module")
def origin(netns, tls_ca):
    import ssl

    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls_ca.ca.issue_cert("spa.example.com").configure_cert(ctx)
    server = RenderOrigin(ctx).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def proxy(sluice_factory, fake_dns, origin):
    fake_dns.set("spa.example.com", a=[ORIGIN])
    return sluice_factory(default_policy(ports=[80, 443, 8080, PLAIN, TLS]), name="render")


@pytest.fixture(scope="module")
def render_user():
    """An unprivileged user for Chromium's sandbox, when the tests run as root."""
    if os.geteuid() != 0:
        return None
    try:
        pwd.getpwnam(RENDER_USER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", RENDER_USER],
                       check=True, capture_output=True, timeout=30)
    return RENDER_USER


@pytest.fixture
def env(proxy, tls_ca, render_user):
    env = {"SLUICE_PROXY": proxy.proxy_url, "SLUICE_CA_CERT": tls_ca.cafile}
    if render_user:
        env["SLUICE_RENDER_USER"] = render_user
    return env


@pytest.fixture
def render(env, tmp_path):
    store = SourceStore(tmp_path / "sources.db")

    def call(url, *, timeout=20.0, extra_env=None, **kwargs):
        client = WebClient(env={**env, **(extra_env or {})}, limits=WebToolLimits(timeout=timeout))
        try:
            return fetch(url, render=True, client=client, store=store, owner="t", **kwargs)
        finally:
            client.close()

    return call


def control_page(url: str, *, seconds: float = 4.0) -> None:
    """The control run: the page in a browser without Sluice's flags or proxy, with direct routes
    (and without the browser's own local-network checks, which are not what keeps a render in)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=_CHROMIUM, args=[
            "--disable-features=LocalNetworkAccessChecks,PrivateNetworkAccessSendPreflights,"
            "PrivateNetworkAccessRespectPreflightResults,BlockInsecurePrivateNetworkRequests"])
        try:
            page = browser.new_page()
            page.goto(url, wait_until="domcontentloaded", timeout=10_000)
            page.wait_for_timeout(seconds * 1000)
        finally:
            browser.close()


def code(result: dict) -> str | None:
    return result.get("error", {}).get("code")


def test_an_spa_renders_to_markdown_over_https(render, origin):
    r = render(f"https://spa.example.com:{TLS}/spa")
    assert "error" not in r, r
    assert r["rendered"] is True and r["needs_javascript"] is False
    assert r["title"] == "Harbour tides"
    assert "# Harbour tides" in r["content"] and "exists only once the script has run" in r["content"]
    assert r["render"]["requests"] >= 2 and r["render"]["network_quiet"] is True
    assert "rendered in a browser: " in r["text"]
    assert origin.seen("/data.json")


def test_a_static_fetch_of_the_shell_points_at_render(env, origin, tmp_path):
    client = WebClient(env=env)
    r = fetch(f"{BASE}/spa", client=client, store=SourceStore(tmp_path / "s.db"), owner="t")
    client.close()
    assert r["rendered"] is False
    assert "Harbour tides" not in r["content"]


def test_every_escape_is_refused_by_the_proxy_and_the_control_run_gets_out(render, origin, canaries, proxy):
    mark = proxy.audit_mark()
    r = render(f"{BASE}/escape")
    assert "error" not in r, r
    assert "the page carried on" in r["content"]
    stats = r["render"]
    # The canaries saw nothing: every attempt went to the proxy, which refused it.
    assert not canaries.hits(), canaries.hits()
    assert stats["refused"].get("address_not_public", 0) >= 5, stats
    assert stats["failed_tunnels"] >= 1, stats  # https://10.0.0.1: a refused CONNECT, all Chromium says of it
    assert stats["websockets"] == 1, stats
    denied = [(e.get("host"), e.get("port")) for e in proxy.audit()[mark:] if e.get("decision") == "refuse"]
    assert {"10.0.0.1", "169.254.169.254", "127.0.0.1"} <= {h for h, _ in denied}, denied
    assert ("10.0.0.1", 443) in denied and ("10.0.0.1", 8080) in denied, denied  # the https fetch, the WebSocket
    # The allowed subresources on public origins did load, through the proxy.
    assert origin.seen("/allowed.png")
    assert "address_not_public" in r["text"]

    # Control: the same page, a browser without the flags and with direct routes, reaches them.
    control_page(f"{BASE}/escape")
    hits = canaries.hits(*CANARY_TARGETS)
    assert any(name.startswith("canary 10.0.0.1") for name in hits), hits
    assert any(name.startswith("canary 169.254.169.254") for name in hits), hits
    for ip in CANARY_TARGETS:
        for port in (80, 443, 8080):
            canaries.allow(ip, port)
    canaries.allow("100.100.100.200", 80)


def test_a_page_that_never_finishes_ends_at_the_deadline_with_its_browser_gone(render):
    started = time.monotonic()
    r = render(f"{BASE}/never", timeout=4)
    elapsed = time.monotonic() - started
    assert code(r) == "web_timeout", r
    assert elapsed < 12, elapsed
    pid, home = render_mod.RENDERER.last_pid, render_mod.RENDERER.last_home
    assert pid is not None
    deadline = time.monotonic() + 3  # SIGKILLed already: give the kernel a moment to take them
    while render_mod.tree_alive(pid, home) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not render_mod.tree_alive(pid, home), "the browser's process tree outlived the call"


def test_a_busy_page_is_read_at_the_deadline(render):
    r = render(f"{BASE}/busy", timeout=6)
    assert "error" not in r, r
    assert r["render"]["network_quiet"] is False
    assert "polls its origin" in r["content"]
    assert "still busy" in r["text"]


def test_a_thousand_requests_hit_the_request_cap(render, origin):
    # A thousand aborted requests are a thousand DevTools round trips: on a loaded
    # 2-CPU machine that took up to 19 s, so this render gets more than the default deadline.
    r = render(f"{BASE}/flood", timeout=45)
    assert "error" not in r, r
    assert r["truncated"] is True and "requests" in r["render"]["cut"], r["render"]
    assert r["render"]["requests"] == 200
    assert len(origin.seen("/flood/")) <= 200
    assert "request cap" in r["text"]


def test_renders_share_no_cookies_or_storage(render):
    extra = {"SLUICE_WEB_RENDER_CONCURRENCY": "2"}
    results: list[dict] = []
    threads = [threading.Thread(target=lambda: results.append(render(f"{BASE}/storage", extra_env=extra)))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    results.append(render(f"{BASE}/storage"))  # and one after them, in the same browser process
    assert len(results) == 3
    for r in results:
        assert "error" not in r, r
        assert "Before this render: cookie=none local=none" in r["content"], r["content"]


def test_a_screenshot_comes_as_an_image(render):
    r = render(f"{BASE}/spa", screenshot=True)
    assert "error" not in r, r
    shot = r["screenshot"]
    assert shot["content_type"] == "image/png" and shot["bytes"] > 100
    import base64

    assert base64.b64decode(r["screenshot_data"]).startswith(b"\x89PNG")


def test_a_non_html_document_is_read_as_a_static_fetch(render):
    r = render(f"{BASE}/plain.txt")
    assert "error" not in r, r
    assert r["rendered"] is False and "just text" in r["content"]


def test_root_without_a_render_user_is_a_clear_error(render):
    if os.geteuid() != 0:
        pytest.skip("only root needs SLUICE_RENDER_USER")
    r = render(f"{BASE}/spa", extra_env={"SLUICE_RENDER_USER": ""})
    assert code(r) == "web_render_unavailable" and "SLUICE_RENDER_USER" in r["error"]["message"]


def test_the_cli_renders_and_leaves_no_browser_behind(env, tmp_path):
    from harness.sluice import sluice_executable

    run_env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **env, "SLUICE_SOURCES": str(tmp_path / "s.sqlite3"),
               "SLUICE_OWNER": "cli"}
    # The CLI under a subreaper (CLI_LEFT_BEHIND): what it leaves is counted there, not another run's browsers.
    ran = subprocess.run([sys.executable, "-c", CLI_LEFT_BEHIND, sluice_executable(), "fetch", "--render",
                          f"{BASE}/spa"], capture_output=True, text=True, env=run_env, timeout=120)
    assert ran.returncode == 0, ran.stderr
    out = json.loads(ran.stdout)
    assert out["returncode"] == 0, out["stderr"]
    assert "exists only once the script has run" in out["stdout"] and "[rendered in a browser: " in out["stdout"]
    assert not out["browsers_left"], f"the CLI's browser outlived it: {out['left']}"


# Runs argv[1:] (the CLI) as its child, as a subreaper: whatever the CLI
# started and left running is re-parented here (not to init; the crashpad
# handlers are orphaned at once), so its descendants once it has exited are
# what it left behind, and nothing of another test run is. Prints the CLI's
# returncode and output, what it left, and which of those are a render's
# Chromium (its private sluice-render- directory in their command line or
# environment); then kills all it left, so nothing outlives the test.
CLI_LEFT_BEHIND = r"""
import ctypes, json, os, signal, subprocess, sys, tempfile, time

PR_SET_CHILD_SUBREAPER = 36
if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
    sys.exit(f"prctl(PR_SET_CHILD_SUBREAPER): errno {ctypes.get_errno()}")


def reap():
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                return
        except ChildProcessError:
            return


def descendants():
    children = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[-1].split()  # state ppid ...
        except OSError:
            continue  # gone
        if fields and fields[0] not in ("Z", "X"):  # a dead one, waiting to be reaped, is not left running
            children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], [os.getpid()]
    while todo:
        for pid in children.get(todo.pop(), []):
            found.append(pid)
            todo.append(pid)
    return found


# Its output in files, not pipes: what it left may hold them open, and only the CLI is waited for.
with tempfile.TemporaryFile("w+") as stdout, tempfile.TemporaryFile("w+") as stderr:
    try:
        returncode = subprocess.run(sys.argv[1:], stdout=stdout, stderr=stderr, timeout=90).returncode
    except subprocess.TimeoutExpired:
        returncode = None  # killed: what it left is still counted, and killed below
    stdout.seek(0), stderr.seek(0)
    cli = {"returncode": returncode, "stdout": stdout.read(), "stderr": stderr.read()}
reap()
left, browsers = {}, []
for pid in descendants():
    try:
        cmdline, environ = (open(f"/proc/{pid}/{name}", "rb").read() for name in ("cmdline", "environ"))
    except OSError:
        continue
    left[pid] = cmdline.replace(b"\0", b" ").decode(errors="replace")[:300]
    if b"sluice-render-" in cmdline + environ:  # its launcher, its private HOME or its crash database
        browsers.append(pid)
print(json.dumps({**cli, "left": left, "browsers_left": browsers}))
deadline = time.monotonic() + 10
while time.monotonic() < deadline:
    left = descendants()
    if not left:
        break
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    time.sleep(0.05)
    reap()
"""


class UdpCanary:
    """Counts datagrams to a canary's UDP port."""

    def __init__(self, ip: str, port: int):
        import socket

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind((ip, port))
        self.sock.settimeout(0.2)
        self.datagrams = 0
        self.running = True
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while self.running:
            try:
                self.sock.recvfrom(4096)
                self.datagrams += 1
            except OSError:
                continue

    def close(self):
        self.running = False
        self.thread.join(2)
        self.sock.close()


RENDER_IN_AGENT = """
import json, sys
from sluice.webtools.client import WebClient
from sluice.webtools.fetch import fetch
from sluice.webtools.store import SourceStore
r = fetch(sys.argv[1], render=True, client=WebClient(env=json.loads(sys.argv[2])), store=SourceStore(sys.argv[3]), owner="t")
print(json.dumps({k: r.get(k) for k in ("error", "render", "rendered")}))
"""

CONTROL_IN_AGENT = """
import sys
from playwright.sync_api import sync_playwright
with sync_playwright() as p:
    b = p.chromium.launch(executable_path=sys.argv[2], args=["--no-sandbox"])
    page = b.new_page()
    page.goto(sys.argv[1], wait_until="domcontentloaded", timeout=10000)
    page.wait_for_timeout(3000)
    b.close()
"""


def test_webrtc_sends_no_udp_from_a_host_with_an_interface(origin, env, tmp_path):
    """In a namespace with a real (veth) interface, so that WebRTC gathers candidates at all."""
    import sys

    from harness.agentns import AgentNamespace, missing_tools
    from harness.sluice import SluiceProcess

    if missing_tools():
        pytest.skip(f"needs {', '.join(missing_tools())}")
    canary = UdpCanary("10.0.0.1", STUN_PORT)
    try:
        with AgentNamespace("rtc", "10.199.7") as agent:
            proxy = SluiceProcess(tmp_path / "p", default_policy(ports=[80, 443, PLAIN]), name="rtc")
            proxy.host = agent.outer_ip
            proxy.start()
            try:
                agent_env = {**env, "SLUICE_PROXY": proxy.proxy_url}
                out = agent.run([sys.executable, "-c", RENDER_IN_AGENT, f"{BASE}/stun", json.dumps(agent_env),
                                 str(tmp_path / "s.db")], timeout=90)
            finally:
                proxy.stop()
            assert out.returncode == 0, out.stderr[-2000:]
            result = json.loads(out.stdout.strip().splitlines()[-1])
            assert result["error"] is None and result["rendered"] is True, result
            assert canary.datagrams == 0, f"{canary.datagrams} UDP datagrams reached the STUN canary"
            # Control: the same page in a browser without Sluice's flags, direct routes: STUN gets out.
            out = agent.run([sys.executable, "-c", CONTROL_IN_AGENT, f"{BASE}/stun", _CHROMIUM], timeout=90)
            assert out.returncode == 0, out.stderr[-2000:]
            time.sleep(0.5)
            assert canary.datagrams > 0, "the control run sent no STUN datagram: the test proves nothing"
    finally:
        canary.close()
