"""Approvals in the state store (sluice/approvals_redis.py) against a real
redis-server on loopback: two stores on one server stand for two Sluice
processes. An ask is recorded once whoever sees it; an answer is decided
once; expiry runs on the store's clock and is reported to one process;
revoke ends a grant for both; records and keys that are not Sluice's are
one line, not a traceback; a store that is down is ApprovalsUnavailable;
with `state`, open_approvals makes no SQLite file."""

from __future__ import annotations

import shutil
import threading
import time

import pytest

from harness.redis_server import RedisServer
from sluice.approvals_redis import ASKS, GRANTS, PREFIX, RedisApprovalStore
from sluice.approvals_store import FILE_NAME, ApprovalError, ApprovalsUnavailable, open_approvals
from sluice.policy.approvals import ASKABLE, ApprovalSettings, Requester, judge
from sluice.policy.reasons import Reason, Refusal
from sluice.policy.state import StateSettings

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")

SETTINGS = ApprovalSettings(ask=frozenset(ASKABLE))


def ask_for(host="api.example", *, reason=Reason.HOST_NOT_ALLOWED, method="GET", target="/a", user="alice"):
    judged = judge(SETTINGS, Refusal(reason, "x"), Requester("ci", user, host, method, target), [], time.time())
    assert judged is not None
    return judged.ask


@pytest.fixture
def redis():
    with RedisServer() as server:
        yield server


@pytest.fixture
def stores(redis):
    settings = StateSettings(redis.url, timeout=0.5)
    first, second = RedisApprovalStore(settings), RedisApprovalStore(settings)
    yield first, second
    first.close()
    second.close()


def raw(redis):
    import redis as redis_py

    return redis_py.Redis(host=redis.host, port=redis.port, decode_responses=True)


def test_an_ask_is_recorded_once_whichever_process_sees_it(stores):
    a, b = stores
    results: list[bool] = []
    threads = [threading.Thread(target=lambda i=i: results.append((a if i % 2 else b).record_ask(
        ask_for(target=f"/{i}"), 600))) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [False] * 15 + [True]  # one record (one approval_requested line, one webhook)
    assert a.snapshot(time.time())[0].pending == b.snapshot(time.time())[0].pending == {ask_for().id}
    pending = b.listing(time.time())["pending"]
    assert [(p["id"], p["host"], p["user"]) for p in pending] == [(ask_for().id, "api.example", "alice")]


def test_an_answer_is_decided_once_and_queues_one_event(stores):
    a, b = stores
    ask = ask_for(reason=Reason.RULE_DENIED, method="DELETE", target="/x/y?z")
    assert a.record_ask(ask, 600)
    outcomes: list[object] = []

    def answer(store, denied):
        try:
            outcomes.append(store.answer(ask.id, denied=denied, seconds=None, scope=None, who="ops", now=time.time()))
        except ApprovalError as e:
            outcomes.append(e)

    threads = [threading.Thread(target=answer, args=(a if i % 2 else b, i % 3 == 0)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    grants = [o for o in outcomes if not isinstance(o, ApprovalError)]
    assert len(grants) == 1 and len(outcomes) == 12
    grant = grants[0]
    assert (grant.method, grant.path, grant.who) == ("DELETE", "/x/y", "ops")
    lifetime = 86400 if grant.denied else 600  # a denial's default, or the ask's grant_for
    assert lifetime - 10 < grant.expires - time.time() <= lifetime
    snapshot, _ = b.snapshot(time.time())
    assert [g.id for g in snapshot.grants] == [ask.id] and snapshot.pending == frozenset()
    events = a.claim_events(time.time()) + b.claim_events(time.time())
    assert [e["event"] for e in events] == ["approval_denied" if grant.denied else "approval_granted"]
    assert "by ops" in events[0]["detail"]
    assert a.record_ask(ask, 600) is False  # answered and in force: not asked again


def test_expiry_runs_on_the_stores_clock_and_is_reported_to_one_process(stores, redis):
    a, b = stores
    ask = ask_for(host="short.example")
    a.record_ask(ask, 600)
    b.answer(ask.id, denied=False, seconds=1.5, scope=None, who="ops", now=time.time())
    # Two processes whose clocks disagree by 1000 s: each sees the same time left, in its own clock.
    for store, skew in ((a, 0.0), (b, 1000.0)):
        now = time.time() + skew
        (grant,) = store.snapshot(now)[0].grants
        assert 0.5 < grant.expires - now <= 1.5
    time.sleep(1.7)
    first, expired_a = a.snapshot(time.time())
    second, expired_b = b.snapshot(time.time())
    assert first.grants == second.grants == ()
    assert [g.id for g in expired_a + expired_b] == [ask.id]  # one grant_expired line in all
    assert not raw(redis).exists(PREFIX + "grant:" + ask.id)


def test_revoke_through_one_ends_the_grant_for_the_other(stores):
    a, b = stores
    ask = ask_for(host="revoke.example")
    a.record_ask(ask, 600)
    a.answer(ask.id, denied=False, seconds=None, scope="host", who="ops", now=time.time())
    assert [g.id for g in b.snapshot(time.time())[0].grants] == [ask.id]
    a.claim_events(time.time())
    revoked = b.revoke(ask.id, "ops", time.time())
    assert revoked.id == ask.id and revoked.path is None
    assert a.snapshot(time.time())[0].grants == ()
    with pytest.raises(ApprovalError, match="no grant or denial"):
        a.revoke(ask.id, "ops", time.time())
    assert [e["event"] for e in a.claim_events(time.time())] == ["grant_revoked"]
    assert b.claim_events(time.time()) == []


def test_a_record_that_is_not_sluices_is_skipped_with_one_line(stores, redis, capsys):
    a, b = stores
    good = ask_for(host="good.example")
    a.record_ask(good, 600)
    a.answer(good.id, denied=False, seconds=None, scope=None, who="ops", now=time.time())
    r = raw(redis)
    r.zadd(GRANTS, {"0123456789ab": time.time() + 600, "0123456789cd": time.time() + 600})
    r.set(PREFIX + "grant:0123456789ab", "not json {")
    r.hset(PREFIX + "grant:0123456789cd", "x", "1")  # a hash where a string belongs
    for _ in range(3):
        snapshot, _ = b.snapshot(time.time())
        assert [g.id for g in snapshot.grants] == [good.id]
    assert [g["id"] for g in b.listing(time.time())["grants"]] == [good.id]
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2, lines  # one line a record, not one a refresh
    assert all("not a Sluice record" in line and "Traceback" not in line for line in lines)
    assert any("grant:0123456789ab in the state store" in line and "(not JSON)" in line for line in lines)
    assert any("grant:0123456789cd in the state store" in line and "(not a string value)" in line for line in lines)


def test_a_key_of_another_kind_is_one_sentence_naming_it(stores, redis):
    a, _ = stores
    raw(redis).set(ASKS, "someone else's")
    with pytest.raises(ApprovalsUnavailable) as caught:
        a.snapshot(time.time())
    message = str(caught.value)
    assert f"holds a string at {ASKS}" in message and f"redis-cli DEL {ASKS}" in message and "\n" not in message
    with pytest.raises(ApprovalsUnavailable):
        a.record_ask(ask_for(), 600)


def test_a_store_that_is_down_is_unavailable_with_a_sentence(redis):
    store = RedisApprovalStore(StateSettings(redis.url, timeout=0.05))
    store.snapshot(time.time())
    redis.stop()
    started = time.monotonic()
    with pytest.raises(ApprovalsUnavailable, match=f"the state store redis://127.0.0.1:{redis.port}/0 is unavailable"):
        store.snapshot(time.time())
    with pytest.raises(ApprovalsUnavailable):
        store.answer("0123456789ab", denied=False, seconds=None, scope=None, who="ops", now=time.time())
    assert time.monotonic() - started < 5
    redis.start()
    assert store.snapshot(time.time())[0].grants == ()  # found again


def test_with_a_store_no_sqlite_file_is_made_and_grants_outlive_the_process(redis, tmp_path):
    settings = StateSettings(redis.url)
    first = open_approvals(settings, str(tmp_path))
    assert isinstance(first, RedisApprovalStore) and first.where == f"in the state store {settings.where}"
    ask = ask_for(host="kept.example")
    first.record_ask(ask, 600)
    first.answer(ask.id, denied=False, seconds=None, scope=None, who="ops", now=time.time())
    first.close()
    again = open_approvals(settings, str(tmp_path))  # a restarted process
    assert [g.id for g in again.snapshot(time.time())[0].grants] == [ask.id]
    assert list(tmp_path.iterdir()) == []
    assert not (tmp_path / FILE_NAME).exists()
    without = open_approvals(None, str(tmp_path))
    assert (tmp_path / FILE_NAME).exists()  # without `state`: the SQLite file, as before
    without.close()


def test_a_refresh_reads_grants_only_when_they_changed_and_sees_every_change(stores, redis):
    a, b = stores
    replies = []
    run = a._run
    a._run = lambda name, keys, args: replies.append(run(name, keys, args)) or replies[-1]
    assert a.snapshot(time.time())[0].grants == ()
    ask = ask_for(host="version.example")
    b.record_ask(ask, 600)
    assert a.snapshot(time.time())[0].pending == {ask.id}
    b.answer(ask.id, denied=False, seconds=None, scope=None, who="ops", now=time.time())
    assert [g.id for g in a.snapshot(time.time())[0].grants] == [ask.id]
    idle = a.snapshot(time.time())[0]
    assert [g.id for g in idle.grants] == [ask.id] and replies[-1][2] is None  # unchanged: nothing read
    b.revoke(ask.id, "ops", time.time())
    assert a.snapshot(time.time())[0].grants == ()
    b.record_ask(ask, 600)
    assert a.snapshot(time.time())[0].pending == {ask.id}
    redis.restart()  # empty (nothing saved): a new version, never taken for the old one
    assert a.snapshot(time.time())[0].pending == frozenset()
