"""PolicySource reloads: off the event loop, serialized, and heard by on_reload listeners."""

from __future__ import annotations

import asyncio
import threading

import pytest
from mitmproxy.test import taddons

from sluice.addons.policy_source import LivePolicy, PolicySource

GOOD = "version: 1\nallow: ['example.com']\n"
OTHER = "version: 1\nallow: ['example.org']\n"


class FakeAudit:
    def __init__(self) -> None:
        self.records: list[dict] = []

    def write(self, **record) -> None:
        self.records.append(record)


@pytest.fixture
def source_in(tmp_path):
    def make(text: str):
        path = tmp_path / "policy.yaml"
        path.write_text(text)
        audit = FakeAudit()
        source = PolicySource(audit)
        return path, audit, source
    return make


def test_listener_called_after_each_changed_reload_only(source_in):
    asyncio.run(_listener_called_after_each_changed_reload_only(*source_in(GOOD)))


async def _listener_called_after_each_changed_reload_only(path, audit, source):
    heard: list[LivePolicy] = []
    source.on_reload(heard.append)
    with taddons.context(source) as tctx:
        tctx.configure(source, sluice_policy=str(path), sluice_policy_poll="0")
        assert source.current.generation == 1
        assert heard == []  # not on the first load

        assert await _reload(source)
        assert heard == []  # unchanged file: no swap, no call

        path.write_text(OTHER)
        assert await _reload(source)
        assert [live.generation for live in heard] == [2]
        assert heard[0] is source.current
        assert heard[0].policy.rules.allow.match_name("example.org")

        path.write_text("version: 1\nallow: [\n")  # broken: last good kept, no call
        assert not await _reload(source)
        assert len(heard) == 1 and source.current.generation == 2


def test_a_failing_listener_is_logged_and_never_breaks_reloading(source_in, caplog):
    asyncio.run(_a_failing_listener_is_logged(*source_in(GOOD)))
    assert "listener bug" in caplog.text


async def _a_failing_listener_is_logged(path, audit, source):
    heard: list[int] = []

    def broken(live: LivePolicy) -> None:
        raise RuntimeError("listener bug")

    source.on_reload(broken)
    source.on_reload(lambda live: heard.append(live.generation))
    with taddons.context(source) as tctx:
        tctx.configure(source, sluice_policy=str(path), sluice_policy_poll="0")
        path.write_text(OTHER)
        assert await _reload(source)
        assert source.current.generation == 2
        assert heard == [2]  # the next listener still ran
        assert [r["decision"] for r in audit.records if r["event"] == "reload"] == ["ok"]


async def _reload(source: PolicySource) -> bool:
    result = source.reload()
    if hasattr(result, "__await__"):
        result = await result
    return result


def test_a_reload_reads_and_parses_off_the_event_loop(source_in, monkeypatch):
    path, audit, source = source_in(GOOD)
    threads: list[int] = []
    real_read = PolicySource._read

    def recording_read(p):
        threads.append(threading.get_ident())
        return real_read(p)

    async def body() -> None:
        with taddons.context(source) as tctx:
            tctx.configure(source, sluice_policy=str(path), sluice_policy_poll="0")
            monkeypatch.setattr(PolicySource, "_read", staticmethod(recording_read))
            path.write_text(OTHER)
            assert await source.reload()
            assert source.current.generation == 2

    asyncio.run(body())
    assert threads and threading.main_thread().ident not in threads


def test_reloads_never_overlap_and_a_trigger_during_one_runs_one_more(source_in, monkeypatch):
    path, audit, source = source_in(GOOD)
    real_read = PolicySource._read
    entered, release = threading.Event(), threading.Event()
    running, overlaps, reads = [0], [], []

    def slow_read(p):
        running[0] += 1
        overlaps.append(running[0])
        try:
            result = real_read(p)
            reads.append(result[1])
            if len(reads) == 1:  # hold the first reload after it read the old file
                entered.set()
                release.wait()
            return result
        finally:
            running[0] -= 1

    async def body() -> None:
        with taddons.context(source) as tctx:
            tctx.configure(source, sluice_policy=str(path), sluice_policy_poll="0")
            monkeypatch.setattr(PolicySource, "_read", staticmethod(slow_read))
            first = source.request_reload()
            await asyncio.to_thread(entered.wait)
            path.write_text(OTHER)  # changed while the first reload is running
            assert source.request_reload() is first  # SIGHUP calls exactly this
            assert source.request_reload() is first
            release.set()
            assert await first
            assert source.current.generation == 2
            assert source.current.policy.rules.allow.match_name("example.org")

    asyncio.run(body())
    assert len(reads) == 2  # three triggers: the running reload and one more after it
    assert reads[0] != reads[1]
    assert max(overlaps) == 1
