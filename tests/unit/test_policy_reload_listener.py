"""PolicySource.on_reload: listeners hear about swapped-in policies only."""

from __future__ import annotations

import asyncio

import pytest
from mitmproxy.test import taddons

from addons.policy_source import LivePolicy, PolicySource

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
