"""fetch(url, render=true): the page loaded in headless Chromium, whose only way out is the Sluice proxy.

Driven by Playwright for Python (the optional extra `sluice[render]`,
pinned exactly) against Debian's Chromium (`apt-get install chromium`;
another binary with SLUICE_RENDER_CHROMIUM). Without either, a render is
the tool error `web_render_unavailable`, naming what to install.

No way out but the proxy. Every request of the page (documents, scripts,
XHR/fetch, WebSocket, images, prefetch) is sent to the one proxy the
tools use (SLUICE_PROXY, else the one for the URL's scheme), with no
bypass, not even loopback (`--proxy-bypass-list=<-loopback>`); the flags
in CHROMIUM_FLAGS turn off the routes that would not go through it (QUIC,
WebRTC's non-proxied UDP, DNS prefetch, background and component
networking), and the context blocks service workers and downloads and
grants no permission. The proxy decides every request as it decides any
other (DNS, policy, pins, caps); the browser gets no address it could use
directly. Chromium is started from its own binary (not Debian's
/usr/bin/chromium script, which adds flags and API keys from
/etc/chromium.d), with an environment of our own (a private HOME, no
proxy variables).

The sandbox stays on. Chromium's sandbox does not run as root, so a root
process drops Chromium to SLUICE_RENDER_USER (an unprivileged user that
must exist); `SLUICE_RENDER_NO_SANDBOX=1` runs it without its sandbox
instead, only when asked. SLUICE_CA_CERT (an intercepting Sluice's CA) is
trusted through an NSS database in the browser's private HOME (`certutil`,
Debian's libnss3-tools).

One browser process serves many calls (measured: starting one costs far
more than a page; see the README), each call in a fresh browser context
(in memory: no cookies, storage or cache shared with another call), at
most SLUICE_WEB_RENDER_CONCURRENCY at once (1 by default; one more is
web_busy). The process is replaced after REUSE_CALLS calls, and killed,
with its whole process tree, whenever a call ends abnormally (deadline,
memory, a crash), so nothing a page left running survives it.

Caps per call (RenderLimits, SLUICE_WEB_RENDER_*): the tools' deadline
for everything; 200 requests; 20 MiB of response data; 50,000 DOM
elements; the browser's memory (resident, whole process tree); the
screenshot's bytes. A page over the request or byte cap is stopped and
read as it is, over the DOM cap cut to its first elements: the result is
`truncated`, with `render.cut` saying why. A page whose document does not
arrive in time is web_timeout; over the memory cap web_render_failed.
"""

from __future__ import annotations

import asyncio
import atexit
import base64
import hashlib
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlsplit

from sluice.policy.loader import parse_size
from sluice.webtools.errors import WebError
from sluice.webtools.sanitize import URL_CHARS, clean

MIB = 1024 * 1024
INSTALL_HINT = ("install the render extra (pip install 'sluice[render]') and Debian's Chromium "
                "(apt-get install chromium libnss3-tools)")
CHROMIUM_CANDIDATES = ("/usr/lib/chromium/chromium", "/usr/bin/chromium", "/usr/bin/chromium-browser")
REUSE_CALLS = 50  # a browser process serves at most this many calls, then a fresh one starts
VIEWPORT = {"width": 1280, "height": 800}
QUIET_RESERVE = 2.0  # seconds of the deadline kept for reading the DOM and converting it
MAX_LISTED = 10  # refused and failed URLs listed in a result

# Every flag, and why. The proxy itself is added per launch (--proxy-server).
CHROMIUM_FLAGS = (
    "--proxy-bypass-list=<-loopback>",  # no direct route, not even to loopback (Chromium bypasses it by default)
    "--disable-quic",  # QUIC is UDP, which an HTTP proxy does not carry
    # WebRTC may use only proxied TCP: no host candidates, no STUN, no mDNS.
    # Both spellings: with the first alone, Chromium still sent STUN and mDNS.
    "--force-webrtc-ip-handling-policy=disable_non_proxied_udp",
    "--webrtc-ip-handling-policy=disable_non_proxied_udp",
    "--dns-prefetch-disable",  # no DNS lookups of the page's links from the browser itself
    "--disable-background-networking",  # no safe-browsing, variations, promos
    "--disable-component-update",
    "--disable-sync",
    "--disable-domain-reliability",
    "--no-pings",  # no <a ping>
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-breakpad",  # no crash uploads (Debian's build still starts a crashpad handler: killed with the tree)
    # Media router / DIAL discovery send SSDP multicast; translation and
    # optimisation hints call Google services.
    "--disable-features=MediaRouter,DialMediaRouteProvider,OptimizationHints,Translate,"
    "AutofillServerCommunication,InterestFeedContentSuggestions",
    "--deny-permission-prompts",  # notifications, geolocation, camera, local network: denied
    "--disable-notifications",
    "--block-new-web-contents",  # no pop-ups
    "--mute-audio",
    "--js-flags=--max-old-space-size=512",  # one page's JavaScript heap
)


@dataclass(frozen=True)
class RenderLimits:
    requests: int = 200
    bytes: int = 20 * MIB
    dom_nodes: int = 50_000
    memory: int = 2048 * MIB  # resident memory of the browser's whole process tree
    screenshot_bytes: int = 5 * MIB
    concurrency: int = 1

    @classmethod
    def from_env(cls, env: dict | None = None) -> RenderLimits:
        env = os.environ if env is None else env
        values: dict = {}
        for name, parse in (("requests", int), ("bytes", parse_size), ("dom_nodes", int), ("memory", parse_size),
                            ("screenshot_bytes", parse_size), ("concurrency", int)):
            var = f"SLUICE_WEB_RENDER_{name.upper()}"
            raw = (env.get(var) or "").strip()
            if not raw:
                continue
            try:
                value = parse(raw)
            except ValueError:
                value = None
            if not isinstance(value, int) or value < 1:
                raise WebError("web_bad_argument", f"{var}={clean(raw, 40)!r} is not a positive whole number"
                               + (" or size (e.g. 20MiB)" if parse is parse_size else ""))
            values[name] = value
        return cls(**values)


@dataclass
class Rendered:
    url: str
    final_url: str
    status: int
    content_type: str
    html: bytes = b""
    is_html: bool = True
    stats: dict = field(default_factory=dict)
    truncated: bool = False
    screenshot: bytes | None = None
    screenshot_type: str = "image/png"


def unavailable(why: str) -> WebError:
    return WebError("web_render_unavailable", f"render=true is not available here: {why}; fetch without render "
                    "still works")


def chromium_path(env: dict) -> str:
    configured = (env.get("SLUICE_RENDER_CHROMIUM") or "").strip()
    if configured:
        if not os.access(configured, os.X_OK):
            raise unavailable(f"SLUICE_RENDER_CHROMIUM={clean(configured, 200)} is not an executable file")
        return configured
    for path in CHROMIUM_CANDIDATES:
        if os.access(path, os.X_OK):
            return path
    raise unavailable(f"Chromium is not installed; {INSTALL_HINT}")


def check_playwright() -> None:
    try:
        import playwright.async_api  # noqa: F401
    except ImportError:
        raise unavailable(f"Playwright is not installed; {INSTALL_HINT}") from None


@dataclass(frozen=True)
class LaunchSpec:
    """What a browser process is started with; a call that needs another one restarts it."""

    chromium: str
    proxy: str  # scheme://host:port, no credentials (they go to the context)
    ca_pem: bytes  # SLUICE_CA_CERT's contents, trusted through NSS
    uid: int | None  # drop to this user (root only)
    gid: int | None
    sandbox: bool


def launch_spec(env: dict, proxy: str) -> LaunchSpec:
    chromium = chromium_path(env)
    no_sandbox = (env.get("SLUICE_RENDER_NO_SANDBOX") or "").strip() == "1"
    uid = gid = None
    user = (env.get("SLUICE_RENDER_USER") or "").strip()
    if os.geteuid() == 0 and not no_sandbox:
        if not user:
            raise unavailable("Chromium's sandbox does not run as root: set SLUICE_RENDER_USER to an unprivileged "
                              "user for the browser (e.g. one made with `useradd --system sluice-render`), run the "
                              "tools as such a user, or, knowingly giving up the sandbox, SLUICE_RENDER_NO_SANDBOX=1")
        try:
            entry = pwd.getpwnam(user)
        except KeyError:
            raise unavailable(f"SLUICE_RENDER_USER={clean(user, 64)!r} is not a user on this machine") from None
        if entry.pw_uid == 0:
            raise unavailable("SLUICE_RENDER_USER names root; Chromium's sandbox needs an unprivileged user")
        uid, gid = entry.pw_uid, entry.pw_gid
    ca_pem = b""
    ca_file = env.get("SLUICE_CA_CERT")
    if ca_file:
        try:
            ca_pem = Path(ca_file).read_bytes()
        except OSError as e:
            raise WebError("web_tls_error", f"the CA file in SLUICE_CA_CERT ({clean(ca_file, 200)}) cannot be read: "
                           f"{clean(e, 200)}") from None
        if shutil.which("certutil") is None:
            raise unavailable("SLUICE_CA_CERT is set, and the browser trusts it through an NSS database, but "
                              "certutil is not installed (apt-get install libnss3-tools)")
    return LaunchSpec(chromium, proxy, ca_pem, uid, gid, not no_sandbox)


def split_proxy(proxy_url: str) -> tuple[str, str | None, str | None]:
    """http://user:pass@host:port -> ("http://host:port", user, pass)."""
    parts = urlsplit(proxy_url)
    host = parts.hostname or ""
    shown = f"[{host}]" if ":" in host else host
    server = f"{parts.scheme}://{shown}" + (f":{parts.port}" if parts.port else "")
    user = unquote(parts.username) if parts.username else None
    password = unquote(parts.password) if parts.password is not None else None
    return server, user, password


# ---------------------------------------------------------------- the process tree

def _members(sid: int, home: str | None = None) -> list[int]:
    """The processes of a browser: its session, and (with `home`) anything
    started with its private HOME, such as the crashpad handler, which
    leaves the session."""
    members = []
    marker = f"HOME={home}\0".encode() if home else None
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            fields = stat.rsplit(")", 1)[-1].split()
            if not fields or fields[0] in ("Z", "X"):
                continue  # dead, waiting to be reaped
            if len(fields) > 3 and int(fields[3]) == sid:  # state ppid pgrp session
                members.append(int(entry))
            elif marker is not None and marker in Path(f"/proc/{entry}/environ").read_bytes():
                members.append(int(entry))
        except (OSError, ValueError):
            continue
    return members


def tree_rss(sid: int) -> int:
    """Resident bytes of every process in the browser's session."""
    page = os.sysconf("SC_PAGE_SIZE")
    total = 0
    for pid in _members(sid):
        try:
            total += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * page
        except (OSError, IndexError, ValueError):
            pass
    return total


def kill_tree(sid: int, home: str | None = None) -> None:
    """SIGKILL the browser's process group and every other process of it."""
    try:
        os.killpg(sid, signal.SIGKILL)
    except OSError:
        pass
    for pid in _members(sid, home):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def tree_alive(sid: int, home: str | None = None) -> bool:
    return bool(_members(sid, home))


# ---------------------------------------------------------------- the browser

class _Browser:
    """One Chromium process (through a launcher script that records its pid,
    hands the profile to the render user and drops to it)."""

    def __init__(self, spec: LaunchSpec):
        self.spec = spec
        self.dir = Path(tempfile.mkdtemp(prefix="sluice-render-"))
        self.home = self.dir / "home"
        self.home.mkdir()
        self.pidfile = self.dir / "pid"
        self.calls = 0
        self.browser = None
        self.pid: int | None = None

    def _launcher(self) -> Path:
        spec = self.spec
        lines = ["#!/bin/sh", f"echo $$ > '{self.pidfile}'"]
        drop = ""
        if spec.uid is not None:
            # Playwright made the profile directory as root: hand it over first.
            lines.append('for a; do case "$a" in --user-data-dir=*) chown -R '
                         f'{spec.uid}:{spec.gid} -- "${{a#--user-data-dir=}}";; esac; done')
            drop = f"setpriv --reuid={spec.uid} --regid={spec.gid} --clear-groups -- "
        lines.append(f"exec {drop}'{spec.chromium}' \"$@\"")
        path = self.dir / "chromium"
        path.write_text("\n".join(lines) + "\n")
        path.chmod(0o700)
        return path

    def _trust(self) -> None:
        if not self.spec.ca_pem:
            return
        db = self.home / ".pki" / "nssdb"
        db.mkdir(parents=True)
        run = lambda *args: subprocess.run(["certutil", "-d", f"sql:{db}", *args], capture_output=True,  # noqa: E731
                                           text=True, timeout=20)
        out = run("-N", "--empty-password")
        text = self.spec.ca_pem.decode("ascii", "replace")
        blocks = [b.split("-----END CERTIFICATE-----")[0] for b in text.split("-----BEGIN CERTIFICATE-----")[1:]]
        for n, block in enumerate(blocks):
            pem = self.dir / f"ca{n}.pem"
            pem.write_text(f"-----BEGIN CERTIFICATE-----{block}-----END CERTIFICATE-----\n")
            out = run("-A", "-t", "C,,", "-n", f"sluice-ca-{n}", "-i", str(pem))
            if out.returncode != 0:
                break
        if not blocks or out.returncode != 0:
            raise WebError("web_tls_error", "the CA in SLUICE_CA_CERT could not be given to the browser "
                           f"({clean(out.stderr or 'no PEM certificate in the file', 200)})")

    async def start(self, playwright, proxy_server: str) -> None:
        self._trust()
        if self.spec.uid is not None:
            for path in [self.dir, *self.dir.rglob("*")]:
                os.chown(path, self.spec.uid, self.spec.gid)
            self.dir.chmod(0o711)
        env = {"HOME": str(self.home), "TMPDIR": str(self.home), "PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
        self.browser = await playwright.chromium.launch(
            executable_path=str(self._launcher()), args=[f"--proxy-server={proxy_server}", *CHROMIUM_FLAGS],
            chromium_sandbox=self.spec.sandbox, env=env, headless=True, timeout=15_000, handle_sigint=False,
            handle_sigterm=False, handle_sighup=False)
        try:
            self.pid = int(self.pidfile.read_text().strip())
        except (OSError, ValueError):
            self.pid = None

    def alive(self) -> bool:
        return self.browser is not None and self.browser.is_connected() and (
            self.pid is None or tree_alive(self.pid))

    async def close(self, *, kill: bool = False) -> None:
        if self.browser is not None and not kill:
            try:
                await asyncio.wait_for(self.browser.close(), 5)
            except Exception:  # noqa: BLE001 - killed below whatever happened
                pass
        if self.pid is not None:
            kill_tree(self.pid, str(self.home))
        if self.browser is not None and kill:
            try:
                await asyncio.wait_for(self.browser.close(), 3)
            except Exception:  # noqa: BLE001
                pass
        self.browser = None
        shutil.rmtree(self.dir, ignore_errors=True)


class _Busy(Exception):
    pass


class Renderer:
    """The process's one renderer: an asyncio loop in its own thread running
    Playwright, and the browser it reuses."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._playwright = None
        self._browser: _Browser | None = None
        self._launching: asyncio.Lock | None = None
        self.running = 0
        # The last browser's session id and HOME (tests check that its processes are gone).
        self.last_pid: int | None = None
        self.last_home: str | None = None

    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="sluice-render", daemon=True).start()
                self._loop = loop
                atexit.register(self.shutdown)
            return self._loop

    def render(self, url: str, *, proxy_url: str, env: dict, timeout: float, limits: RenderLimits,
               screenshot: bool) -> Rendered:
        """Blocking: render `url` (first-line checked already) within `timeout` seconds."""
        check_playwright()
        server, user, password = split_proxy(proxy_url)
        spec = launch_spec(env, server)
        with self._lock:
            if self.running >= limits.concurrency:
                raise WebError("web_busy", f"this process is already rendering {self.running} page(s) at once (its "
                               "limit, SLUICE_WEB_RENDER_CONCURRENCY); try again when that call has answered, or "
                               "fetch without render", limit=limits.concurrency)
            self.running += 1
        try:
            loop = self._ensure_loop()
            job = asyncio.run_coroutine_threadsafe(
                self._render(url, spec, user, password, timeout, limits, screenshot), loop)
            try:
                return job.result(timeout + 10)  # the coroutine keeps its own deadline; this is a backstop
            except TimeoutError:
                job.cancel()
                asyncio.run_coroutine_threadsafe(self._discard(), loop)
                raise _deadline(url, timeout) from None
        finally:
            with self._lock:
                self.running -= 1

    async def _get_browser(self, spec: LaunchSpec) -> _Browser:
        if self._launching is None:
            self._launching = asyncio.Lock()
        async with self._launching:
            b = self._browser
            if b is not None and (b.spec != spec or b.calls >= REUSE_CALLS or not b.alive()):
                self._browser = None
                await b.close(kill=not b.alive())
                b = None
            if b is None:
                if self._playwright is None:
                    from playwright.async_api import async_playwright

                    self._playwright = await async_playwright().start()
                b = _Browser(spec)
                try:
                    await b.start(self._playwright, spec.proxy)
                except WebError:
                    await b.close(kill=True)
                    raise
                except Exception as e:  # noqa: BLE001 - a browser that cannot start is a clear tool error
                    await b.close(kill=True)
                    raise unavailable(f"Chromium ({clean(spec.chromium, 200)}) did not start: "
                                      f"{clean(str(e).splitlines()[0] if str(e) else type(e).__name__, 300)}") from None
                self._browser = b
                self.last_pid, self.last_home = b.pid, str(b.home)
            b.calls += 1
            return b

    async def _discard(self) -> None:
        b, self._browser = self._browser, None
        if b is not None:
            await b.close(kill=True)

    async def _render(self, url, spec, user, password, timeout, limits, screenshot) -> Rendered:
        start = time.monotonic()
        deadline = start + timeout
        browser = await self._get_browser(spec)
        page_run = _PageRun(url, browser, limits, deadline)
        try:
            proxy = {"server": spec.proxy, **({"username": user, "password": password or ""} if user else {})}
            result = await asyncio.wait_for(page_run.run(proxy, screenshot), max(deadline - time.monotonic(), 0.1))
        except TimeoutError:
            await self._kill(browser)
            raise _deadline(url, timeout) from None
        except WebError:
            await self._kill(browser)
            raise
        except Exception as e:  # noqa: BLE001 - a crashed page or browser is a tool error, not a traceback
            await self._kill(browser)
            if page_run.over_memory:
                raise page_run.memory_error() from None
            raise WebError("web_render_failed", f"the browser failed rendering {clean(url, URL_CHARS)} "
                           f"({clean(str(e).splitlines()[0] if str(e) else type(e).__name__, 300)}); fetch without "
                           "render may still read it", url=clean(url, URL_CHARS)) from None
        if page_run.over_memory:
            await self._kill(browser)
            raise page_run.memory_error()
        result.stats["seconds"] = round(time.monotonic() - start, 3)
        return result

    async def _kill(self, browser: _Browser) -> None:
        if self._browser is browser:
            self._browser = None
        await browser.close(kill=True)

    def shutdown(self) -> None:
        loop = self._loop
        if loop is None:
            return

        async def stop():
            await self._discard()
            if self._playwright is not None:
                try:
                    await asyncio.wait_for(self._playwright.stop(), 5)
                except Exception:  # noqa: BLE001
                    pass
                self._playwright = None

        try:
            asyncio.run_coroutine_threadsafe(stop(), loop).result(10)
        except Exception:  # noqa: BLE001 - at exit: the process tree was killed in _discard
            pass


def _deadline(url: str, timeout: float) -> WebError:
    return WebError("web_timeout", f"{clean(url, URL_CHARS)} did not render within {timeout:g} s (its document did "
                    "not arrive, or the page kept the browser busy); the browser was stopped: try fetch without "
                    "render, or another source")


_DOM_CAP_JS = """(cap) => {
  const all = document.getElementsByTagName('*');
  const total = all.length;
  for (let i = all.length - 1; i >= cap; i--) { if (all[i]) all[i].remove(); }
  return total;
}"""


class _PageRun:
    """One call: a fresh context and page, its counters and caps."""

    def __init__(self, url: str, browser: _Browser, limits: RenderLimits, deadline: float):
        self.url = url
        self.browser = browser
        self.limits = limits
        self.deadline = deadline
        self.requests = 0
        self.bytes = 0
        self.cut: list[str] = []
        self.refused: dict[str, int] = {}
        self.refused_urls: list[dict] = []
        self.failed_tunnels = 0
        self.failed: list[dict] = []
        self.websockets = 0
        self.over_memory = False
        self.page = None
        self.stopped = asyncio.Event()  # a cap tripped: read the page now, without waiting for quiet

    def memory_error(self) -> WebError:
        return WebError("web_render_failed", f"rendering {clean(self.url, URL_CHARS)} took more than the browser's "
                        f"memory cap ({self.limits.memory // MIB:,} MiB, SLUICE_WEB_RENDER_MEMORY); the browser was "
                        "stopped: fetch without render, or another source", limit=self.limits.memory,
                        url=clean(self.url, URL_CHARS))

    def _cut(self, why: str) -> None:
        if why not in self.cut:
            self.cut.append(why)
            if why in ("requests", "bytes"):
                self.stopped.set()
                if self.page is not None:
                    asyncio.ensure_future(self._stop_loading())

    async def _stop_loading(self) -> None:
        try:
            await self.page.evaluate("window.stop()")
        except Exception:  # noqa: BLE001 - the page may be gone
            pass

    async def _route(self, route) -> None:
        request = route.request
        scheme = request.url.split(":", 1)[0].lower()
        if scheme not in ("http", "https"):
            await route.abort("blockedbyclient")
            return
        if self.requests >= self.limits.requests:
            self._cut("requests")
            await route.abort("blockedbyclient")
            return
        if self.bytes >= self.limits.bytes:
            self._cut("bytes")
            await route.abort("blockedbyclient")
            return
        self.requests += 1
        try:
            await route.continue_()
        except Exception:  # noqa: BLE001 - the page went away meanwhile
            pass

    def _on_response(self, response) -> None:
        # Over plain http the proxy strips Sluice-Reason from origin responses: one here is its own refusal.
        if response.url.startswith("http:"):
            reason = response.headers.get("sluice-reason")
            if reason and response.status >= 400:
                reason = clean(reason, 64)
                self.refused[reason] = self.refused.get(reason, 0) + 1
                if len(self.refused_urls) < MAX_LISTED:
                    self.refused_urls.append({"url": clean(response.url, URL_CHARS), "reason": reason})

    def _on_failed(self, request) -> None:
        failure = request.failure or ""
        if "ERR_BLOCKED_BY_CLIENT" in failure:
            return  # ours: a cap or a scheme
        if "ERR_TUNNEL_CONNECTION_FAILED" in failure:
            self.failed_tunnels += 1  # Chromium's only word for a CONNECT the proxy refused
        if len(self.failed) < MAX_LISTED:
            self.failed.append({"url": clean(request.url, URL_CHARS), "error": clean(failure, 80)})

    def _on_data(self, params: dict) -> None:
        self.bytes += int(params.get("dataLength") or 0)
        if self.bytes > self.limits.bytes:
            self._cut("bytes")

    def _on_websocket(self, ws) -> None:
        self.websockets += 1

    async def _watch_memory(self) -> None:
        if self.browser.pid is None:
            return
        while True:
            await asyncio.sleep(0.25)
            if tree_rss(self.browser.pid) > self.limits.memory:
                self.over_memory = True
                kill_tree(self.browser.pid, str(self.browser.home))
                return

    def left(self, reserve: float = 0.0) -> float:
        return self.deadline - time.monotonic() - reserve

    async def run(self, proxy: dict, screenshot: bool) -> Rendered:
        context = await self.browser.browser.new_context(
            proxy=proxy, service_workers="block", accept_downloads=False, viewport=VIEWPORT,
            java_script_enabled=True, ignore_https_errors=False)
        watcher = asyncio.ensure_future(self._watch_memory())
        try:
            await context.route("**/*", self._route)
            context.on("response", self._on_response)
            context.on("requestfailed", self._on_failed)
            self.page = page = await context.new_page()
            page.on("websocket", self._on_websocket)
            try:
                cdp = await context.new_cdp_session(page)
                cdp.on("Network.dataReceived", self._on_data)
                await cdp.send("Network.enable")
            except Exception:  # noqa: BLE001 - counting bytes is best effort beyond the proxy's own caps
                pass
            return await self._load(page, screenshot)
        finally:
            watcher.cancel()
            try:
                await asyncio.wait_for(context.close(), 5)
            except Exception:  # noqa: BLE001 - a stuck context: the caller kills the browser on error paths
                pass

    async def _load(self, page, screenshot: bool) -> Rendered:
        from playwright.async_api import Error as PlaywrightError

        try:
            response = await page.goto(self.url, wait_until="domcontentloaded",
                                       timeout=max(self.left(QUIET_RESERVE), 0.5) * 1000)
        except PlaywrightError as e:
            text = str(e)
            if "Timeout" in type(e).__name__ or "Timeout" in text.split("\n", 1)[0]:
                raise TimeoutError from None
            first = clean(text.splitlines()[0] if text else type(e).__name__, 300)
            if "ERR_TUNNEL_CONNECTION_FAILED" in text:
                raise WebError("web_blocked", f"the proxy refused (or could not open) the tunnel to "
                               f"{clean(self.url, URL_CHARS)}; the browser is not told why: fetch without render "
                               "gives the proxy's reason", by="proxy", reason="unknown",
                               url=clean(self.url, URL_CHARS)) from None
            raise WebError("web_unreachable", f"the browser could not load {clean(self.url, URL_CHARS)} ({first})",
                           url=clean(self.url, URL_CHARS)) from None
        if response is None:
            raise WebError("web_unreachable", f"the browser got no response for {clean(self.url, URL_CHARS)}")
        headers = await response.all_headers()
        content_type = headers.get("content-type", "")
        mime = content_type.split(";", 1)[0].strip().lower()
        rendered = Rendered(self.url, page.url, response.status, content_type)
        if response.url.startswith("http:") and headers.get("sluice-reason") and response.status >= 400:
            from sluice.webtools.client import refused_by_proxy

            body = ""
            try:
                body = (await response.body())[:4096].decode("utf-8", "replace")
            except Exception:  # noqa: BLE001
                pass
            raise refused_by_proxy(headers["sluice-reason"], body, self.url, response.status)
        if mime not in ("text/html", "application/xhtml+xml") or not 200 <= response.status < 300:
            rendered.is_html = False  # the caller reads it as a static fetch does
            rendered.stats = self.stats(quiet=True)
            return rendered
        quiet = await self._quiet(page)
        total = await page.evaluate(_DOM_CAP_JS, self.limits.dom_nodes)
        if total > self.limits.dom_nodes:
            self._cut("dom_nodes")
        html = (await page.content()).encode("utf-8")
        rendered.final_url = page.url
        rendered.html = html
        if screenshot:
            rendered.screenshot, rendered.screenshot_type = await self._screenshot(page)
        rendered.stats = self.stats(quiet=quiet, dom_nodes=total)
        rendered.truncated = bool(self.cut)
        return rendered

    async def _quiet(self, page) -> bool:
        """Wait for the network to go quiet (True), the deadline, or a cap (False: read it as it is)."""
        from playwright.async_api import Error as PlaywrightError

        idle = asyncio.ensure_future(page.wait_for_load_state(
            "networkidle", timeout=max(self.left(QUIET_RESERVE), 0.1) * 1000))
        stop = asyncio.ensure_future(self.stopped.wait())
        try:
            await asyncio.wait({idle, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        if not idle.done():
            idle.cancel()
            return False
        try:
            idle.result()
        except (PlaywrightError, asyncio.CancelledError):
            return False
        return True

    async def _screenshot(self, page) -> tuple[bytes | None, str]:
        timeout = max(self.left(0.5), 0.5) * 1000
        shot = await page.screenshot(type="png", timeout=timeout)
        if len(shot) <= self.limits.screenshot_bytes:
            return shot, "image/png"
        shot = await page.screenshot(type="jpeg", quality=60, timeout=max(self.left(0.5), 0.5) * 1000)
        if len(shot) <= self.limits.screenshot_bytes:
            return shot, "image/jpeg"
        self._cut("screenshot_bytes")
        return None, "image/png"

    def stats(self, *, quiet: bool, dom_nodes: int | None = None) -> dict:
        stats = {"requests": self.requests, "bytes": self.bytes, "refused": dict(self.refused),
                 "refused_urls": list(self.refused_urls), "failed_tunnels": self.failed_tunnels,
                 "failed": list(self.failed), "websockets": self.websockets, "network_quiet": quiet,
                 "cut": list(self.cut)}
        if dom_nodes is not None:
            stats["dom_nodes"] = dom_nodes
        return stats


RENDERER = Renderer()


def render_page(url: str, *, proxy_url: str, env: dict, timeout: float, screenshot: bool = False,
                limits: RenderLimits | None = None) -> Rendered:
    return RENDERER.render(url, proxy_url=proxy_url, env=env, timeout=timeout,
                           limits=limits or RenderLimits.from_env(env), screenshot=screenshot)


def screenshot_part(rendered: Rendered) -> dict | None:
    if rendered.screenshot is None:
        return None
    return {"content_type": rendered.screenshot_type, "bytes": len(rendered.screenshot),
            "sha256": hashlib.sha256(rendered.screenshot).hexdigest(),
            "data": base64.b64encode(rendered.screenshot).decode("ascii")}
