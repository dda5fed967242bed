"""The approvals store (sluice/approvals_store.py): asks deduplicated by their
unique key, answers, revokes, expiry and queued admin events each taken by
one process (two stores on one file stand for two workers), a corrupt or
missing file, memory without --state-dir."""

from __future__ import annotations

import sqlite3

import pytest

from sluice.approvals_store import FILE_NAME, ApprovalError, ApprovalStore
from sluice.policy.approvals import ASKABLE, ApprovalSettings, Requester, judge
from sluice.policy.reasons import Reason, Refusal

NOW = 1_000_000.0
SETTINGS = ApprovalSettings(ask=frozenset(ASKABLE))


def ask_for(host="api.example", *, reason=Reason.HOST_NOT_ALLOWED, method="GET", target="/a", user="alice", now=NOW):
    judged = judge(SETTINGS, Refusal(reason, "x"), Requester("ci", user, host, method, target), [], now)
    assert judged is not None
    return judged.ask


@pytest.fixture
def stores(tmp_path):
    first, second = ApprovalStore(str(tmp_path)), ApprovalStore(str(tmp_path))
    yield first, second
    first.close()
    second.close()


def test_an_ask_is_recorded_once_by_its_key_across_processes(stores):
    a, b = stores
    assert a.record_ask(ask_for(target="/a"), 3600) is True
    assert b.record_ask(ask_for(target="/b"), 3600) is False  # the same host-level key
    assert b.record_ask(ask_for(user="bob"), 3600) is True
    snapshot, _ = a.snapshot(NOW)
    assert snapshot.pending == {ask_for().id, ask_for(user="bob").id}
    assert [p["path"] for p in b.listing(NOW)["pending"]] == ["/a", "/a"]


def test_approve_uses_the_asks_grant_for_and_level_and_queues_one_event(stores):
    a, b = stores
    ask = ask_for(reason=Reason.RULE_DENIED, method="DELETE", target="/x/y?z")
    a.record_ask(ask, 600)
    grant = b.answer(ask.id, denied=False, seconds=None, scope=None, who="ops", now=NOW)
    assert (grant.method, grant.path, grant.expires, grant.who, grant.denied) == ("DELETE", "/x/y", NOW + 600, "ops",
                                                                                  False)
    snapshot, _ = a.snapshot(NOW + 1)
    assert snapshot.grants == (grant,) and snapshot.pending == frozenset()
    events = a.claim_events(NOW + 1)
    assert [(e["event"], e["id"]) for e in events] == [("approval_granted", ask.id)] and "by ops" in events[0]["detail"]
    assert b.claim_events(NOW + 1) == []  # claimed once
    with pytest.raises(ApprovalError, match="no pending approval request"):
        b.answer(ask.id, denied=False, seconds=None, scope=None, who="ops", now=NOW)
    assert a.record_ask(ask, 600) is False  # granted meanwhile: not asked again


def test_deny_defaults_to_a_day_and_a_path_scope_needs_a_path(stores):
    a, _ = stores
    connect = ask_for(method="CONNECT", target=None)
    a.record_ask(connect, 3600)
    with pytest.raises(ApprovalError, match="--scope host"):
        a.answer(connect.id, denied=True, seconds=None, scope="path", who="ops", now=NOW)
    denial = a.answer(connect.id, denied=True, seconds=None, scope=None, who="ops", now=NOW)
    assert denial.denied and denial.expires == NOW + 86400 and denial.path is None
    assert [d["id"] for d in a.listing(NOW)["denials"]] == [connect.id] and a.listing(NOW)["grants"] == []


def test_expired_grants_are_deleted_and_reported_by_one_process_only(stores):
    a, b = stores
    ask = ask_for()
    a.record_ask(ask, 3600)
    a.answer(ask.id, denied=False, seconds=5, scope=None, who="ops", now=NOW)
    assert a.snapshot(NOW + 4)[1] == []
    snapshot, expired = b.snapshot(NOW + 5)
    assert [g.id for g in expired] == [ask.id] and snapshot.grants == ()
    assert a.snapshot(NOW + 6)[1] == []


def test_revoke_ends_a_grant_and_an_unknown_id_is_an_error(stores):
    a, b = stores
    ask = ask_for()
    a.record_ask(ask, 3600)
    a.answer(ask.id, denied=False, seconds=None, scope="host", who="ops", now=NOW)
    a.claim_events(NOW)
    revoked = b.revoke(ask.id, "ops", NOW + 1)
    assert revoked.id == ask.id and a.snapshot(NOW + 1)[0].grants == ()
    assert [e["event"] for e in a.claim_events(NOW + 1)] == ["grant_revoked"]
    with pytest.raises(ApprovalError, match="no grant or denial"):
        b.revoke(ask.id, "ops", NOW + 2)


def test_unanswered_asks_are_forgotten_after_a_day(stores):
    a, _ = stores
    a.record_ask(ask_for(), 3600)
    assert a.snapshot(NOW + 86399)[0].pending
    assert not a.snapshot(NOW + 86401)[0].pending


def test_the_file_is_wal_and_survives_reopening(tmp_path):
    store = ApprovalStore(str(tmp_path))
    ask = ask_for()
    store.record_ask(ask, 3600)
    store.answer(ask.id, denied=False, seconds=None, scope=None, who="ops", now=NOW)
    store.close()
    db = sqlite3.connect(tmp_path / FILE_NAME)
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    db.close()
    again = ApprovalStore(str(tmp_path))
    assert [g.id for g in again.snapshot(NOW)[0].grants] == [ask.id]


def test_missing_and_corrupt_files_start_empty_with_one_line(tmp_path, capsys):
    ApprovalStore(str(tmp_path)).close()
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "no approvals state at" in err[0] and "starting with no approvals" in err[0]
    (tmp_path / FILE_NAME).write_bytes(b"garbage" * 1000)
    for suffix in ("-wal", "-shm"):
        (tmp_path / (FILE_NAME + suffix)).unlink(missing_ok=True)
    store = ApprovalStore(str(tmp_path))
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "is unreadable" in err[0] and "moved it to" in err[0], err
    assert store.snapshot(NOW)[0].grants == () and list(tmp_path.glob(FILE_NAME + ".corrupt-*"))
    assert store.record_ask(ask_for(), 3600) is True


def test_a_database_of_another_schema_version_is_moved_aside(tmp_path, capsys):
    db = sqlite3.connect(tmp_path / FILE_NAME)
    db.execute("PRAGMA user_version=99")
    db.close()
    ApprovalStore(str(tmp_path)).close()
    assert "schema version 99" in capsys.readouterr().err


def test_without_a_state_dir_it_is_in_memory(capsys):
    store = ApprovalStore(None)
    assert not store.persistent and "memory" in store.where and capsys.readouterr().err == ""
    assert store.record_ask(ask_for(), 3600) is True and store.snapshot(NOW)[0].pending


def test_admin_token_files(tmp_path):
    from sluice.admin import AdminTokens

    good = tmp_path / "tokens"
    good.write_text("# comment\n\nops 0123456789abcdef0123\nfedcba9876543210fedc\n")
    tokens = AdminTokens.load(str(good))
    assert tokens.who("Bearer 0123456789abcdef0123") == (200, "ops")
    assert tokens.who("bearer fedcba9876543210fedc") == (200, "admin")
    assert tokens.who(None)[0] == 401 and tokens.who("Basic abc")[0] == 401
    assert tokens.who("Bearer wrong-token-wrong-token")[0] == 403
    assert AdminTokens.load(None).who("Bearer 0123456789abcdef0123")[0] == 403
    for text, message in [("short\n", "at least 16 characters"), ("a b c\n", "expected TOKEN or NAME TOKEN"),
                          ("# nothing\n", "holds no token")]:
        bad = tmp_path / "bad"
        bad.write_text(text)
        with pytest.raises(ValueError, match=message):
            AdminTokens.load(str(bad))
    with pytest.raises(ValueError, match="cannot read it"):
        AdminTokens.load(str(tmp_path / "missing"))


def test_approvals_move_only_when_the_store_itself_changes():
    from sluice.approvals_store import same_place
    from sluice.policy.credentials import Secret
    from sluice.policy.state import StateSettings

    store = StateSettings("redis://valkey:6379/0", Secret("pw"), "file pw", timeout=0.05, on_error="local")
    assert same_place(None, None) and not same_place(store, None) and not same_place(None, store)
    assert same_place(store, StateSettings("redis://valkey:6379/0", Secret("pw"), "file pw", timeout=1.0,
                                           on_error="closed"))
    assert not same_place(store, StateSettings("redis://valkey:6379/1", Secret("pw"), "file pw"))
    assert not same_place(store, StateSettings("redis://valkey:6379/0", Secret("other"), "file pw"))
