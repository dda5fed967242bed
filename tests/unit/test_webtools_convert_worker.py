"""HTML conversion in a killable worker under the call's deadline (issue 19 item 5's leftover)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from sluice.webtools import convert
from sluice.webtools._convert_worker import WORKER_MEMORY, ConversionFailed, ConversionTimeout, Pool

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository's bench/ package
from bench import extraction, structure_pages  # noqa: E402
from bench.extraction_pages import boilerplate_heavy  # noqa: E402

BRS = b"<!doctype html><html><body>" + b"<br>" * 500_000 + b"</body></html>"


@pytest.fixture
def pool():
    p = Pool()
    yield p
    p.close()


def far() -> float:
    return time.monotonic() + 60


def test_output_is_identical_through_the_worker(pool, monkeypatch):
    from sluice.webtools import _convert_worker

    monkeypatch.setattr(_convert_worker, "POOL", pool)
    pages = [(html, "https://news.example/a") for html, _ in structure_pages.PAGES.values()]
    pages += [(html, url) for _k, html, _t, url in extraction.load(extraction.HELD_OUT)[:5]]
    pages += [(boilerplate_heavy(300_000), "https://news.example/"), ("<p>a lone surrogate \udc80 here</p>", None)]
    for html, url in pages:
        assert convert.html_to_markdown(html, url, max_chars=50_000, deadline=far()) == \
            convert.html_to_markdown_here(html, url, max_chars=50_000)
        assert convert.page_text(html, deadline=far()) == convert.page_text_here(html)
    assert pool.started == 1  # one worker, reused for every call


def test_a_conversion_past_the_deadline_is_stopped_there(pool):
    t = time.monotonic()
    with pytest.raises(ConversionTimeout):
        pool.run("markdown", BRS, {}, time.monotonic() + 1.5)
    assert time.monotonic() - t < 3.0
    # the next call is answered (by a fresh worker, started at the kill)
    assert pool.run("page_text", b"<p>after</p>", {}, far())["text"] == "after"


def test_killing_the_worker_mid_call_recovers(pool):
    pool.run("page_text", b"<p>warm</p>", {}, far())
    (worker,) = pool._idle
    killer = threading.Timer(0.5, os.kill, (worker.proc.pid, signal.SIGKILL))
    killer.start()
    try:
        with pytest.raises(ConversionFailed):
            pool.run("sleep", b"", {"seconds": 30}, far())
    finally:
        killer.cancel()
    assert pool.run("page_text", b"<p>again</p>", {}, far())["text"] == "again"


def test_the_worker_memory_is_bounded(pool):
    pool.run("page_text", b"<p>x</p>", {}, far())
    (worker,) = pool._idle
    limits = Path(f"/proc/{worker.proc.pid}/limits").read_text()
    line = next(x for x in limits.splitlines() if x.startswith("Max address space"))
    assert line.split()[3] == str(WORKER_MEMORY)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie awaiting its reaper is gone for our purposes
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("busy", [False, True], ids=["idle", "busy"])
def test_no_worker_outlives_its_parent(busy):
    script = textwrap.dedent(f"""
        import sys, threading, time
        from sluice.webtools._convert_worker import Pool
        pool = Pool()
        pool.run("page_text", b"<p>x</p>", {{}}, None)
        print(pool._idle[0].proc.pid, flush=True)
        if {busy}:
            threading.Thread(target=pool.run, args=("sleep", b"", {{"seconds": 60}}, None), daemon=True).start()
        time.sleep(60)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(parent.stdout.readline())
        time.sleep(0.5)
        assert _alive(pid)
    finally:
        parent.kill()
        parent.wait()
    end = time.monotonic() + 5
    while _alive(pid) and time.monotonic() < end:
        time.sleep(0.05)
    assert not _alive(pid)
