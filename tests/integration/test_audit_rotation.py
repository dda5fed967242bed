"""The audit file survives log rotation (issue 10, item 10): moved away (as
logrotate does), the next line goes to a new file at the path; SIGHUP reopens
it at once (logrotate's `postrotate kill -HUP`); truncated in place
(`copytruncate`), lines keep coming from the start. Nothing is lost or goes
to the moved file after the move is seen."""

from __future__ import annotations

import os
import signal

import httpx
import pytest

from harness import default_policy
from harness.wait import wait_until

pytestmark = pytest.mark.netns



@pytest.fixture
def proxy(sluice_factory, request):
    # One proxy per test: each moves the audit file under its own proxy.
    return sluice_factory(default_policy(), name=f"rotation-{request.node.name[5:30]}",
                          extra_args=("--set", "sluice_policy_poll=0"))


def get(proxy, path: str) -> int:
    with httpx.Client(proxy=proxy.proxy_url, trust_env=False, timeout=10) as c:
        return c.get(f"http://public.example{path}").status_code


def lines(path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def test_a_moved_audit_file_is_replaced_at_its_path(proxy):
    assert get(proxy, "/before") == 200
    proxy.wait_audit(lambda e: e["event"] == "request")
    rotated = proxy.audit_file.with_name(proxy.audit_file.name + ".1")
    os.rename(proxy.audit_file, rotated)
    before = lines(rotated)
    assert len(before) == 1

    for i in range(3):
        assert get(proxy, f"/after{i}") == 200
    assert wait_until(lambda: len(lines(proxy.audit_file)) == 3), lines(proxy.audit_file)
    assert lines(rotated) == before  # nothing more went to the moved file

    # Moved again, and this time deleted: the path comes back again.
    os.rename(proxy.audit_file, rotated)
    os.unlink(rotated)
    assert get(proxy, "/again") == 200
    assert wait_until(lambda: len(lines(proxy.audit_file)) == 1)
    assert proxy.alive()


def test_sighup_reopens_the_audit_file_at_once(proxy):
    assert get(proxy, "/before") == 200
    proxy.wait_audit(lambda e: e["event"] == "request")
    rotated = proxy.audit_file.with_name(proxy.audit_file.name + ".1")
    os.rename(proxy.audit_file, rotated)
    proxy.proc.send_signal(signal.SIGHUP)
    # Reopened by the signal itself, before any line is written.
    assert wait_until(lambda: proxy.audit_file.exists()), "SIGHUP did not reopen the audit file"
    assert lines(proxy.audit_file) == []
    assert get(proxy, "/after") == 200
    assert wait_until(lambda: len(lines(proxy.audit_file)) == 1)
    assert len(lines(rotated)) == 1


def test_a_truncated_audit_file_is_written_from_its_start(proxy):
    for i in range(3):
        assert get(proxy, f"/before{i}") == 200
    assert wait_until(lambda: len(lines(proxy.audit_file)) == 3)
    with open(proxy.audit_file, "r+") as f:  # logrotate's copytruncate
        f.truncate(0)
    assert get(proxy, "/after") == 200
    assert wait_until(lambda: len(lines(proxy.audit_file)) == 1)
    assert proxy.audit_file.read_bytes().startswith(b'{"time":')  # no hole of NULs before it


def test_an_audit_file_that_cannot_be_reopened_keeps_the_proxy_serving(proxy, tmp_path):
    # The path now names something no one can append to (a directory): lines
    # go on to the file already open, stderr says so once, the proxy serves.
    moved = tmp_path / "kept.jsonl"
    assert get(proxy, "/before") == 200
    proxy.wait_audit(lambda e: e["event"] == "request")
    mark = proxy.stderr_mark()
    os.rename(proxy.audit_file, moved)
    proxy.audit_file.mkdir()
    try:
        for i in range(2):
            assert get(proxy, f"/after{i}") == 200
        proxy.proc.send_signal(signal.SIGHUP)
        assert get(proxy, "/after-hup") == 200
        assert wait_until(lambda: len(lines(moved)) == 4), lines(moved)
        assert wait_until(lambda: "cannot reopen the audit log" in proxy.stderr_since(mark))
        assert proxy.stderr_since(mark).count("cannot reopen the audit log") == 1
        assert proxy.alive()
    finally:
        proxy.audit_file.rmdir()
    assert get(proxy, "/back") == 200  # the path is free again: a new file there
    assert wait_until(lambda: len(lines(proxy.audit_file)) == 1)
