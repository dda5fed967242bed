"""Reload messages on stderr (issue 10, item 11): each ends in the state the
proxy is actually in (the generation it enforces); SIGHUP on an unchanged
file says "unchanged"; a good file back after a failed reload says
"restored last good policy", whether SIGHUP or the file poller saw it."""

from __future__ import annotations

import os
import signal
import time

import pytest
import yaml

from harness import default_policy

pytestmark = pytest.mark.netns

GOOD = default_policy(deny=["one.example"])
BAD = "version: 1\nports: [80, 'x']\n"


def wait_for_line(proxy, mark: int, needle: str, timeout: float = 8.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in proxy.stderr_since(mark).splitlines():
            if needle in line:
                return line
        time.sleep(0.05)
    raise AssertionError(f"no stderr line with {needle!r}; stderr since the mark:\n{proxy.stderr_since(mark)}")


def write(path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)  # an editor's rename-over save


def hup(proxy, needle: str) -> str:
    mark = proxy.stderr_mark()
    proxy.proc.send_signal(signal.SIGHUP)
    return wait_for_line(proxy, mark, needle)


def test_every_sighup_answers_with_the_state_the_proxy_is_in(sluice_factory):
    proxy = sluice_factory(GOOD, name="hupmessages", extra_args=("--set", "sluice_policy_poll=0"))
    path = proxy.policy_file
    good = path.read_text()

    line = hup(proxy, "unchanged")
    assert line.endswith(f"{path}: unchanged; keeping the current policy (generation 1)"), line
    mark = proxy.audit_mark()
    assert hup(proxy, "unchanged")  # again: every SIGHUP answers
    assert [e for e in proxy.audit()[mark:] if e["event"] == "reload"] == []  # nothing changed: no audit line

    write(path, BAD)
    line = hup(proxy, "reload refused")
    assert line.endswith(f"{path}: reload refused (1 problem(s)); keeping the last good policy (generation 1)"), line

    write(path, good)  # the last good file, byte for byte
    line = hup(proxy, "restored")
    assert line.endswith(f"{path}: restored last good policy (generation 1)"), line
    assert hup(proxy, "unchanged").endswith("(generation 1)")

    write(path, yaml.safe_dump(default_policy(deny=["two.example"]), sort_keys=False))
    line = hup(proxy, "policy reloaded")
    assert line.endswith(f"{path}: policy reloaded (generation 2)"), line
    assert line == f"sluice: {path}: policy reloaded (generation 2)", line  # one voice on stderr (issue 26 item 8)
    assert all(text.startswith("sluice: ") for text in proxy.stderr_text().splitlines() if text.strip())

    os.unlink(path)
    line = hup(proxy, "is gone")
    assert line.endswith(f"{path}: the policy file is gone; keeping the last good policy (generation 2)"), line
    assert hup(proxy, "is gone")  # said again on the next SIGHUP, not only once

    write(path, yaml.safe_dump(default_policy(deny=["two.example"]), sort_keys=False))
    line = hup(proxy, "restored")
    assert line.endswith(f"{path}: restored last good policy (generation 2)"), line
    assert proxy.alive()


def test_the_poller_says_restored_when_the_last_good_file_is_back(sluice_factory):
    proxy = sluice_factory(GOOD, name="pollmessages", extra_args=("--set", "sluice_policy_poll=0.2"))
    path = proxy.policy_file
    good = path.read_text()
    mark = proxy.stderr_mark()
    write(path, BAD)
    wait_for_line(proxy, mark, "reload refused")
    mark = proxy.stderr_mark()
    write(path, good)
    line = wait_for_line(proxy, mark, "restored last good policy")
    assert line.endswith(f"{path}: restored last good policy (generation 1)"), line
    # A touch (same bytes, new mtime) seen by the poller is not news: no line.
    mark = proxy.stderr_mark()
    os.utime(path)
    time.sleep(1.0)
    assert proxy.stderr_since(mark) == ""
