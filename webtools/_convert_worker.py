"""HTML conversion in a killable worker process, under the call's deadline.

Conversion (libxml2, trafilatura, html2text) is CPU-bound C and Python that a
thread cannot interrupt: a 2 MiB page of 500,000 `<br>` took 8-10 s of CPU
in the caller, past any deadline. So fetch and read hand it to a worker: a
fresh interpreter (`python -m sluice.webtools._convert_worker`; -m does not
re-import the caller's __main__, as multiprocessing's spawn would), fed over
its pipes. A conversion that is still running at the call's deadline is
ended by killing the worker (SIGKILL), and the call answers `web_timeout`;
the next call starts a fresh worker.

The common case stays fast: a worker is reused for call after call (up to
IDLE_WORKERS wait idle between calls; each call holds one, so concurrent
calls each get their own, started on demand). The worker's memory is bound
(RLIMIT_AS of WORKER_MEMORY: a conversion that needs more fails with
MemoryError in the worker or kills it, never the caller). No worker outlives
its parent: it asks the kernel for SIGKILL when the parent dies
(PR_SET_PDEATHSIG, Linux), checks that the parent it was started for is
still its parent, and exits at EOF on its input (the parent's end of the pipe
closes when the parent exits). Workers are spawned by one long-lived thread,
because PR_SET_PDEATHSIG fires when the *thread* that forked the child ends
(the MCP server's worker threads come and go).

Frames, both ways: 4-byte big-endian length of a JSON header, the header,
4-byte length of a payload, the payload (the HTML bytes; nothing back).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import selectors
import signal
import struct
import subprocess
import sys
import threading
import time

WORKER_ARGV = ["-m", "sluice.webtools._convert_worker"]
WORKER_MEMORY = 1024 * 1024 * 1024  # RLIMIT_AS of a worker (a 2 MiB page peaks at a few hundred MB)
IDLE_WORKERS = 2
_LEN = struct.Struct(">I")
_MAX_HEADER = 64 * 1024 * 1024  # a reply's header holds the markdown: at most 2x a 2 MiB page, in JSON


class ConversionTimeout(Exception):
    """The call's deadline passed before the conversion ended (the worker was killed)."""


class ConversionFailed(Exception):
    """The worker died (its memory bound, a crash) or answered garbage; it was discarded."""


# --- the parent's side -------------------------------------------------------------


def _spawn_here() -> subprocess.Popen:
    env = dict(os.environ, SLUICE_CONVERT_PARENT=str(os.getpid()))
    return subprocess.Popen([sys.executable, *WORKER_ARGV], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, env=env, close_fds=True)


class _Spawner:
    """One daemon thread that forks every worker (see the module docstring: PDEATHSIG is per thread)."""

    def __init__(self) -> None:
        self._jobs: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def spawn(self) -> subprocess.Popen:
        done = threading.Event()
        box: list = []
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="sluice-convert-spawner", daemon=True)
                self._thread.start()
        self._jobs.put((box, done))
        done.wait()
        if isinstance(box[0], BaseException):
            raise box[0]
        return box[0]

    def _run(self) -> None:
        while True:
            box, done = self._jobs.get()
            try:
                box.append(_spawn_here())
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                box.append(e)
            done.set()


class Worker:
    """One worker process and its pipes."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.kill()
        for stream in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                stream.close()
        with contextlib.suppress(subprocess.TimeoutExpired, OSError):
            self.proc.wait(timeout=5)

    def call(self, header: dict, payload: bytes, deadline: float | None) -> dict:
        """Send one request and wait for its answer until `deadline` (time.monotonic())."""
        request = _frame(header, payload)
        out_fd, in_fd = self.proc.stdin.fileno(), self.proc.stdout.fileno()
        os.set_blocking(out_fd, False)
        os.set_blocking(in_fd, False)
        sent = 0
        received = bytearray()
        need: int | None = None  # the reply's total length once its header length is known
        with selectors.DefaultSelector() as sel:
            sel.register(out_fd, selectors.EVENT_WRITE)
            sel.register(in_fd, selectors.EVENT_READ)
            while True:
                timeout = None if deadline is None else deadline - time.monotonic()
                if timeout is not None and timeout <= 0:
                    raise ConversionTimeout
                events = sel.select(timeout)
                for key, _mask in events:
                    if key.fd == out_fd:
                        try:
                            sent += os.write(out_fd, request[sent:sent + 1024 * 1024])
                        except BlockingIOError:
                            continue
                        except OSError as e:  # the worker died
                            raise ConversionFailed(f"the worker's input closed: {e}") from None
                        if sent == len(request):
                            sel.unregister(out_fd)
                        continue
                    try:
                        chunk = os.read(in_fd, 1024 * 1024)
                    except BlockingIOError:
                        continue
                    if not chunk:
                        raise ConversionFailed(f"the worker ended (status {self.proc.poll()})")
                    received += chunk
                    if need is None and len(received) >= _LEN.size:
                        (hlen,) = _LEN.unpack_from(received)
                        if hlen > _MAX_HEADER:
                            raise ConversionFailed("the worker's answer is over its bound")
                        need = _LEN.size + hlen + _LEN.size  # and an empty payload
                    if need is not None and len(received) >= need:
                        (hlen,) = _LEN.unpack_from(received)
                        try:
                            return json.loads(received[_LEN.size:_LEN.size + hlen])
                        except ValueError:
                            raise ConversionFailed("the worker answered garbage") from None


class Pool:
    """Workers reused across calls: take one (or start one), use it, give it back."""

    def __init__(self, idle: int = IDLE_WORKERS) -> None:
        self._idle: list[Worker] = []
        self._max_idle = idle
        self._lock = threading.Lock()
        self._spawner = _Spawner()
        self.started = 0  # workers started, for tests and the measurements

    def _take(self) -> Worker:
        with self._lock:
            while self._idle:
                w = self._idle.pop()
                if w.alive():
                    return w
                w.kill()
        self.started += 1
        return Worker(self._spawner.spawn())

    def _give_back(self, w: Worker) -> None:
        with self._lock:
            if w.alive() and len(self._idle) < self._max_idle:
                self._idle.append(w)
                return
        w.kill()

    def run(self, op: str, html: bytes | str, kwargs: dict, deadline: float | None) -> dict:
        """The worker's answer to `op` on `html`, or ConversionTimeout / ConversionFailed."""
        is_text = isinstance(html, str)
        payload = html.encode("utf-8", "surrogatepass") if is_text else bytes(html)
        w = self._take()
        try:
            answer = w.call({"op": op, "text": is_text, "kwargs": kwargs}, payload, deadline)
        except BaseException:
            w.kill()  # mid-conversion or broken: never reused
            self.prewarm()  # its replacement starts now (a start-up takes about a second of imports)
            raise
        if "error" in answer:
            w.kill()
            raise ConversionFailed(answer["error"])
        self._give_back(w)
        return answer

    def prewarm(self) -> None:
        """Start a worker to wait idle, if none is (it imports the converter while it waits)."""
        with self._lock:
            if self._idle:
                return
        try:
            w = Worker(self._spawner.spawn())
        except OSError:
            return
        self.started += 1
        self._give_back(w)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for w in idle:
            w.kill()


POOL = Pool()


def _frame(header: dict, payload: bytes) -> bytes:
    # ASCII JSON: a lone surrogate in the text survives the trip (\\udxxx), never a decode error.
    h = json.dumps(header, separators=(",", ":")).encode("ascii")
    return _LEN.pack(len(h)) + h + _LEN.pack(len(payload)) + payload


# --- the worker's side -------------------------------------------------------------


def _die_with_parent(parent: int) -> None:
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    if parent and os.getppid() != parent:  # the parent died before the request above took effect
        os._exit(0)


def _read_exactly(stream, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        chunk = stream.read(n - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def _handle(header: dict, payload: bytes) -> dict:
    from sluice.webtools import convert

    html: bytes | str = payload.decode("utf-8", "surrogatepass") if header.get("text") else payload
    kwargs = header.get("kwargs") or {}
    if header["op"] == "markdown":
        c = convert.html_to_markdown_here(html, kwargs.get("base_url"), encoding=kwargs.get("encoding"),
                                          max_chars=kwargs.get("max_chars"))
        return {"title": c.title, "markdown": c.markdown, "needs_javascript": c.needs_javascript,
                "cut": c.cut, "hidden_chars": c.hidden_chars}
    if header["op"] == "page_text":
        v = convert.page_text_here(html, encoding=kwargs.get("encoding"))
        return {"title": v.title, "text": v.text, "hidden_chars": v.hidden_chars}
    if header["op"] == "sleep":  # for the tests: a conversion that overruns any deadline
        time.sleep(float(kwargs.get("seconds", 60)))
        return {}
    return {"error": f"unknown operation {header['op']!r}"}


def main() -> int:
    import resource

    _die_with_parent(int(os.environ.get("SLUICE_CONVERT_PARENT") or 0))
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_AS, (WORKER_MEMORY, WORKER_MEMORY))
    from sluice.webtools import convert  # noqa: F401 - imported once, before the first request

    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    while True:
        raw = _read_exactly(stdin, _LEN.size)
        if raw is None:
            return 0  # the parent closed its end (or exited)
        header_bytes = _read_exactly(stdin, _LEN.unpack(raw)[0])
        raw = _read_exactly(stdin, _LEN.size) if header_bytes is not None else None
        payload = _read_exactly(stdin, _LEN.unpack(raw)[0]) if raw is not None else None
        if payload is None:
            return 0
        try:
            answer = _handle(json.loads(header_bytes), payload)
        except MemoryError:
            answer = {"error": "memory"}
        except Exception as e:  # noqa: BLE001 - reported to the parent, which discards this worker
            answer = {"error": f"{type(e).__name__}: {e}"}
        try:
            stdout.write(_frame(answer, b""))
            stdout.flush()
        except (BrokenPipeError, MemoryError):
            return 0


if __name__ == "__main__":
    sys.exit(main())
