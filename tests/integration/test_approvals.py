"""Approvals through the real proxy (issue 22): an askable refusal becomes
`approval_pending` with a request id; identical asks share it; an operator
answers with `sluice approvals` (another process) against the admin
listener: approve (host and path scope), deny (remembered), a short grant
that expires, revoke; the token missing or wrong; the state surviving a
restart with the same --state-dir; `wait` released by an approval; `--workers
2`; the webhook's body and signature (a recording origin at a public test
address), and a webhook that is down; CONNECT and SOCKS5 asks.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from harness import absolute_form, connect, default_policy, socks5_connect
from harness.clients import clean_env
from harness.sluice import sluice_executable
from harness.wait import wait_until

pytestmark = pytest.mark.netns

ORIGIN_IP = "8.8.8.8"  # the harness origin on :80
HOOK_IP, HOOK_PORT, DOWN_PORT = "1.1.1.1", 8181, 8182
SECRET = "webhook-secret-for-tests"
TOKEN = "ops-token-0123456789abcdef"
HOSTS = [f"ask{i}.example" for i in range(1, 20)] + ["allowed.example", "rules.example", "hooks.example",
                                                    "down.example", "ask-s.example"]


class HookRecorder:
    """A webhook receiver at a public test address: records each POST."""

    def __init__(self) -> None:
        self.posts: list[tuple[dict[str, str], bytes]] = []
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                recorder.posts.append(({k.lower(): v for k, v in self.headers.items()}, body))
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer((HOOK_IP, HOOK_PORT), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def hook(netns, fake_dns):
    for host in HOSTS:
        fake_dns.set(host, a=[ORIGIN_IP])
    fake_dns.set("hooks.example", a=[HOOK_IP])
    fake_dns.set("down.example", a=[HOOK_IP])
    recorder = HookRecorder()
    yield recorder
    recorder.close()


def policy(*, wait: str = "0s", webhook: str = f"http://hooks.example:{HOOK_PORT}/sluice",
           secret_file: str = "hook-secret") -> str:
    base = default_policy(ports=[80, 443, HOOK_PORT, DOWN_PORT])
    base.update({"allow": ["allowed.example", "rules.example", "hooks.example", "down.example"],
                 "intercept": ["rules.example"]})
    text = yaml.safe_dump(base, sort_keys=False)
    return text + f"""\
rules:
  - deny: {{hosts: [rules.example], methods: [DELETE], paths: ["/x/**"]}}
approvals:
  ask: [host_not_allowed, rule_denied]
  grant_for: 1h
  wait: {wait}
  notify: {{webhook: "{webhook}", secret: {{file: {secret_file}}}}}
"""


def start(sluice_factory, tmp_path_factory, *, name: str, wait: str = "0s", webhook: str | None = None,
          state_dir: Path | None = None, tokens: bool = True, extra=(), socks: bool = False):
    work = tmp_path_factory.mktemp(f"{name}-files")
    (work / "hook-secret").write_text(SECRET + "\n")
    (work / "tokens").write_text(f"# name token\nops {TOKEN}\n")
    state = state_dir or (work / "state")
    state.mkdir(exist_ok=True)
    args = ["--state-dir", str(state), *extra]
    if tokens:
        args += ["--admin-token-file", str(work / "tokens")]
    text = policy(wait=wait, secret_file=str(work / "hook-secret"),
                  **({"webhook": webhook} if webhook else {}))
    proxy = sluice_factory(text, name=name, extra_args=args, socks=socks)
    proxy.state_dir = state
    return proxy


@pytest.fixture(scope="module")
def proxy(sluice_factory, tmp_path_factory, hook):
    return start(sluice_factory, tmp_path_factory, name="approvals")


def cli(proxy, *args: str, token: str | None = TOKEN, admin: str | None = None) -> subprocess.CompletedProcess:
    env = clean_env()
    env.pop("SLUICE_ADMIN_TOKEN", None)
    if token is not None:
        env["SLUICE_ADMIN_TOKEN"] = token
    admin = admin or proxy.admin_url.removeprefix("http://")
    return subprocess.run([sluice_executable(), "approvals", "--admin", admin, *args], env=env,
                          capture_output=True, text=True, timeout=30)


def pending_id(response) -> str:
    assert response.status == 403 and response.sluice_reason == "approval_pending", response
    text = response.text
    marker = "approval request "
    assert marker in text, text
    return text.split(marker, 1)[1][:12]


def listing(proxy) -> dict:
    result = cli(proxy, "list", "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def eventually_allowed(proxy, url: str, method: str = "GET") -> None:
    """A grant applies within the snapshot's refresh (at most a second)."""
    seen = []

    def ok() -> bool:
        seen.append(absolute_form(proxy.address, url, method=method))
        return seen[-1].status == 200

    wait_until(ok, timeout=5, what=f"{method} {url} allowed")


# ---- ask, identical asks, approve ------------------------------------------------------


def test_an_askable_refusal_is_approval_pending_with_an_id_and_retry_after(proxy, net):
    origin = net.origin(ORIGIN_IP, 80)
    mark = proxy.audit_mark()
    response = absolute_form(proxy.address, "http://ask1.example/a")
    ask = pending_id(response)
    assert response.headers.get("retry-after") == "30"
    assert "wait for the answer and send the request again" in response.text and "Retry after 30 s" in response.text
    assert "ask1.example" not in origin.hosts_seen()
    line = proxy.wait_audit(lambda e: e["event"] == "approval_requested", since=mark)
    assert (line["id"], line["host"], line["reason"], line["path"]) == (ask, "ask1.example", "host_not_allowed", "/a")
    refused = proxy.wait_audit(lambda e: e["event"] == "request" and e["host"] == "ask1.example", since=mark)
    assert refused["reason"] == "approval_pending" and ask in refused["detail"]


def test_identical_asks_share_one_id_and_one_audit_line(proxy):
    mark = proxy.audit_mark()
    ids = {pending_id(absolute_form(proxy.address, f"http://ask2.example/{p}", method=m))
           for p, m in [("a", "GET"), ("b", "POST"), ("c?q=1", "GET")]}
    assert len(ids) == 1
    wait_until(lambda: len([e for e in proxy.audit()[mark:] if e["event"] == "request"]) >= 3, timeout=5,
               what="three request lines")
    asked = [e for e in proxy.audit()[mark:] if e["event"] == "approval_requested"]
    assert [e["id"] for e in asked] == list(ids)
    assert [a["id"] for a in listing(proxy)["pending"] if a["host"] == "ask2.example"] == list(ids)


def test_approve_host_scope_lets_every_path_through_and_is_audited_with_who(proxy, net):
    ask = pending_id(absolute_form(proxy.address, "http://ask3.example/first"))
    mark = proxy.audit_mark()
    result = cli(proxy, "approve", ask)
    assert result.returncode == 0, result.stderr
    assert f"approved {ask}" in result.stdout and "host scope" in result.stdout
    eventually_allowed(proxy, "http://ask3.example/first")
    eventually_allowed(proxy, "http://ask3.example/other", method="POST")
    granted = proxy.wait_audit(lambda e: e["event"] == "approval_granted", since=mark)
    assert (granted["id"], granted["host"]) == (ask, "ask3.example") and "by ops" in granted["detail"]
    assert any(r.host == "ask3.example" for r in net.origin(ORIGIN_IP, 80).requests)
    entry = next(g for g in listing(proxy)["grants"] if g["id"] == ask)
    assert entry["who"] == "ops" and entry["scope"] == "host"
    assert 3500 < entry["expires"] - time.time() <= 3600  # the policy's grant_for


def test_approve_path_scope_covers_that_method_and_path_only(proxy):
    ask = pending_id(absolute_form(proxy.address, "http://rules.example/x/a", method="DELETE"))
    assert absolute_form(proxy.address, "http://rules.example/ok").status == 200  # the rule refuses DELETE /x/** only
    result = cli(proxy, "approve", ask)  # a path-level ask: path scope by default
    assert result.returncode == 0 and "path scope" in result.stdout, result
    eventually_allowed(proxy, "http://rules.example/x/a", method="DELETE")
    other = pending_id(absolute_form(proxy.address, "http://rules.example/x/b", method="DELETE"))
    assert other != ask


def test_approve_a_host_level_ask_with_path_scope(proxy):
    ask = pending_id(absolute_form(proxy.address, "http://ask4.example/only/this"))
    assert cli(proxy, "approve", ask, "--scope", "path").returncode == 0
    eventually_allowed(proxy, "http://ask4.example/only/this")
    assert absolute_form(proxy.address, "http://ask4.example/not/that").sluice_reason == "approval_pending"


# ---- deny, expiry, revoke ---------------------------------------------------------------


def test_a_denial_is_remembered_and_refuses_as_before_without_asking_again(proxy):
    ask = pending_id(absolute_form(proxy.address, "http://ask5.example/"))
    mark = proxy.audit_mark()
    result = cli(proxy, "deny", ask, "--for", "1h")
    assert result.returncode == 0 and f"denied {ask}" in result.stdout, result
    denied = proxy.wait_audit(lambda e: e["event"] == "approval_denied", since=mark)
    assert denied["id"] == ask and "by ops" in denied["detail"]

    def refused_as_before() -> bool:
        return absolute_form(proxy.address, "http://ask5.example/again").sluice_reason == "host_not_allowed"

    wait_until(refused_as_before, timeout=5, what="the denial applied")
    response = absolute_form(proxy.address, "http://ask5.example/again")
    assert "an operator denied access" in response.text and ask in response.text
    assert not [e for e in proxy.audit()[mark:] if e["event"] == "approval_requested"]
    assert [d["id"] for d in listing(proxy)["denials"]] == [ask]


def test_a_short_grant_expires_and_is_audited(proxy):
    ask = pending_id(absolute_form(proxy.address, "http://ask6.example/"))
    mark = proxy.audit_mark()
    assert cli(proxy, "approve", ask, "--for", "2s").returncode == 0
    eventually_allowed(proxy, "http://ask6.example/")
    expired = proxy.wait_audit(lambda e: e["event"] == "grant_expired" and e["id"] == ask, since=mark, timeout=10)
    assert expired["host"] == "ask6.example"
    assert pending_id(absolute_form(proxy.address, "http://ask6.example/")) == ask  # asks again


def test_revoke_ends_a_grant_at_once(proxy):
    ask = pending_id(absolute_form(proxy.address, "http://ask7.example/"))
    assert cli(proxy, "approve", ask).returncode == 0
    eventually_allowed(proxy, "http://ask7.example/")
    mark = proxy.audit_mark()
    result = cli(proxy, "revoke", ask)
    assert result.returncode == 0 and f"revoked {ask}" in result.stdout, result
    wait_until(lambda: absolute_form(proxy.address, "http://ask7.example/").sluice_reason == "approval_pending",
               timeout=5, what="the revocation applied")
    revoked = proxy.wait_audit(lambda e: e["event"] == "grant_revoked", since=mark)
    assert revoked["id"] == ask and "by ops" in revoked["detail"]
    assert cli(proxy, "revoke", ask).returncode == 1  # nothing in force any more


def test_an_unknown_id_is_a_clear_error(proxy):
    result = cli(proxy, "approve", "000000000000")
    assert result.returncode == 1 and "no pending approval request '000000000000'" in result.stderr, result
    assert "Traceback" not in result.stderr


# ---- the token ----------------------------------------------------------------------------


def test_the_token_missing_or_wrong(proxy):
    ask = pending_id(absolute_form(proxy.address, "http://ask8.example/"))
    missing = cli(proxy, "approve", ask, token=None)
    assert missing.returncode == 2 and "need the admin token" in missing.stderr, missing
    wrong = cli(proxy, "approve", ask, token="not-the-token-at-all-000")
    assert wrong.returncode == 1 and "refused the token" in wrong.stderr and "is wrong" in wrong.stderr, wrong
    import urllib.error
    import urllib.request
    request = urllib.request.Request(f"{proxy.admin_url}/approvals/{ask}/approve", data=b"{}", method="POST")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.build_opener(urllib.request.ProxyHandler({})).open(request, timeout=5)
    assert e.value.code == 401 and e.value.headers["WWW-Authenticate"].startswith("Bearer")
    assert ask in [a["id"] for a in listing(proxy)["pending"]]  # still pending; list needs no token
    for endpoint in ("/healthz", "/policy"):  # read-only endpoints as before
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(proxy.admin_url + endpoint) as r:
            assert r.status == 200


def test_a_proxy_without_a_token_file_answers_no_verb(sluice_factory, tmp_path_factory, hook):
    proxy = start(sluice_factory, tmp_path_factory, name="no-tokens", tokens=False)
    ask = pending_id(absolute_form(proxy.address, "http://ask9.example/"))
    result = cli(proxy, "approve", ask)
    assert result.returncode == 1 and "--admin-token-file" in result.stderr, result


# ---- CONNECT and SOCKS5 -----------------------------------------------------------------


def test_a_connect_ask_keeps_the_status_phrase_and_the_id_is_in_the_audit_line(sluice_factory, tmp_path_factory,
                                                                                 hook):
    proxy = start(sluice_factory, tmp_path_factory, name="connect-socks", socks=True)
    mark = proxy.audit_mark()
    response, tunnel = connect(proxy.address, "ask10.example:443")
    assert tunnel is None and response.status == 403 and response.reason == "Sluice approval_pending", response
    line = proxy.wait_audit(lambda e: e["event"] == "connect" and e["host"] == "ask10.example", since=mark)
    asked = proxy.wait_audit(lambda e: e["event"] == "approval_requested", since=mark)
    assert line["reason"] == "approval_pending" and asked["id"] in line["detail"]
    # SOCKS5: the usual refusal (REP 2), the ask recorded.
    result = socks5_connect(proxy.socks_address, "ask-s.example", 80)
    assert result.reply == 2 and result.tunnel is None
    socks_ask = proxy.wait_audit(lambda e: e["event"] == "approval_requested" and e["host"] == "ask-s.example",
                                 since=mark)
    assert socks_ask["id"] in [a["id"] for a in listing(proxy)["pending"]]
    assert cli(proxy, "approve", socks_ask["id"]).returncode == 0

    def socks_ok() -> bool:
        r = socks5_connect(proxy.socks_address, "ask-s.example", 80)
        if r.tunnel is not None:
            r.tunnel.close()
        return r.reply == 0

    wait_until(socks_ok, timeout=5, what="the SOCKS5 grant applied")


# ---- restart, wait, workers -------------------------------------------------------------


def test_grants_and_asks_survive_a_restart_with_the_same_state_dir(sluice_factory, tmp_path_factory, hook):
    first = start(sluice_factory, tmp_path_factory, name="before-restart")
    granted = pending_id(absolute_form(first.address, "http://ask11.example/"))
    waiting = pending_id(absolute_form(first.address, "http://ask12.example/"))
    assert cli(first, "approve", granted).returncode == 0
    eventually_allowed(first, "http://ask11.example/")
    first.stop()
    second = start(sluice_factory, tmp_path_factory, name="after-restart", state_dir=first.state_dir)
    assert absolute_form(second.address, "http://ask11.example/").status == 200
    assert waiting in [a["id"] for a in listing(second)["pending"]]
    assert "approvals " + str(first.state_dir / "approvals.sqlite3") in second.ready_line


def test_a_corrupt_state_file_starts_empty_with_one_line(sluice_factory, tmp_path_factory, hook):
    state = tmp_path_factory.mktemp("corrupt-state")
    (state / "approvals.sqlite3").write_bytes(b"this is not a database" * 100)
    proxy = start(sluice_factory, tmp_path_factory, name="corrupt", state_dir=state)
    lines = [line for line in proxy.stderr_text().splitlines() if "approvals state" in line]
    assert len(lines) == 1 and "unreadable" in lines[0] and "starting with no approvals" in lines[0], lines
    assert listing(proxy)["pending"] == []
    assert pending_id(absolute_form(proxy.address, "http://ask1.example/"))


def test_wait_holds_the_request_until_another_process_approves(sluice_factory, tmp_path_factory, hook):
    proxy = start(sluice_factory, tmp_path_factory, name="waiting", wait="20s")
    results = []
    started = time.monotonic()
    thread = threading.Thread(target=lambda: results.append(absolute_form(proxy.address, "http://ask13.example/w")))
    thread.start()
    wait_until(lambda: any(a["host"] == "ask13.example" for a in listing(proxy)["pending"]), timeout=10,
               what="the held request's ask")
    ask = next(a["id"] for a in listing(proxy)["pending"] if a["host"] == "ask13.example")
    assert thread.is_alive()  # held
    assert cli(proxy, "approve", ask).returncode == 0
    thread.join(20)
    assert results and results[0].status == 200, results
    assert time.monotonic() - started < 15


def test_wait_ends_with_approval_pending_when_nobody_answers(sluice_factory, tmp_path_factory, hook):
    proxy = start(sluice_factory, tmp_path_factory, name="wait-out", wait="2s")
    started = time.monotonic()
    response = absolute_form(proxy.address, "http://ask14.example/")
    assert pending_id(response) and 1.5 < time.monotonic() - started < 10


def test_workers_share_the_state_and_the_supervisor_serves_the_verbs(sluice_factory, tmp_path_factory, hook):
    proxy = start(sluice_factory, tmp_path_factory, name="workers", extra=("--workers", "2"))
    ids = {pending_id(absolute_form(proxy.address, f"http://ask15.example/{i}")) for i in range(6)}
    assert len(ids) == 1  # one ask, whichever worker took each connection
    asked = [e for e in proxy.audit() if e["event"] == "approval_requested"]
    assert len(asked) == 1, asked
    assert cli(proxy, "approve", ids.pop()).returncode == 0
    eventually_allowed(proxy, "http://ask15.example/")
    # Every worker sees it within its next refresh (at most a second).
    wait_until(lambda: all(absolute_form(proxy.address, f"http://ask15.example/{i}").status == 200
                           for i in range(6)), timeout=5, what="the grant in every worker")
    granted = wait_until(lambda: [e for e in proxy.audit() if e["event"] == "approval_granted"], timeout=5,
                         what="approval_granted")
    assert len(granted) == 1


# ---- the webhook --------------------------------------------------------------------------


def test_the_webhook_gets_a_signed_body_through_the_gate(proxy, hook):
    ask = pending_id(absolute_form(proxy.address, "http://ask16.example/hooked?q=1", method="POST"))

    def posted():
        return next(((h, b) for h, b in list(hook.posts) if json.loads(b)["id"] == ask), None)

    headers, body = wait_until(posted, timeout=10, what="the webhook POST")
    data = json.loads(body)
    assert set(data) == {"id", "profile", "user", "host", "method", "path", "reason", "time"}
    assert (data["host"], data["method"], data["path"], data["reason"]) == ("ask16.example", "POST", "/hooked",
                                                                             "host_not_allowed")
    expected = "sha256=" + hmac.new(SECRET.encode(), body, hashlib.sha256).hexdigest()
    assert headers["sluice-signature"] == expected
    assert "sluice-webhook" not in headers  # the proxy header is never forwarded
    # It went through the gate: its own audit line, allowed, to hooks.example.
    wait_until(lambda: any(e["host"] == "hooks.example" and e["decision"] == "allow" for e in proxy.audit()),
               timeout=5, what="the webhook's own audit line")


def test_a_webhook_that_is_down_is_retried_logged_and_never_blocks(sluice_factory, tmp_path_factory, hook):
    proxy = start(sluice_factory, tmp_path_factory, name="hook-down",
                  webhook=f"http://down.example:{DOWN_PORT}/sluice")
    started = time.monotonic()
    pending_id(absolute_form(proxy.address, "http://ask2.example/"))
    assert time.monotonic() - started < 3  # answered at once, the webhook in the background
    assert absolute_form(proxy.address, "http://allowed.example/").status == 200
    wait_until(lambda: "failed after 4 attempts" in proxy.stderr_text(), timeout=30, what="the failure logged")
    attempts = [e for e in proxy.audit() if e["host"] == "down.example"]
    assert len(attempts) == 4, attempts


def test_metrics_count_pending_grants_and_asks_by_outcome(proxy):
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    pending_id(absolute_form(proxy.address, "http://ask18.example/"))  # left pending
    ask = pending_id(absolute_form(proxy.address, "http://ask17.example/"))
    assert cli(proxy, "approve", ask).returncode == 0
    eventually_allowed(proxy, "http://ask17.example/")

    def samples():
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(f"{proxy.admin_url}/metrics") as r:
            text = r.read().decode()
        return {(s.name, s.labels.get("outcome")): s.value
                for f in text_string_to_metric_families(text) for s in f.samples}

    def counted():
        s = samples()
        return s if s.get(("sluice_approval_grants_active", None), 0) >= 1 and s.get(
            ("sluice_approvals_pending", None), 0) >= 1 else None

    s = wait_until(counted, timeout=5, what="the grant counted")
    assert s[("sluice_approvals_pending", None)] >= 1
    assert s[("sluice_approval_asks_total", "pending")] >= 1 and s[("sluice_approval_asks_total", "granted")] >= 1
    assert ("sluice_approval_asks_total", "denied") in s
