"""Issue 10 items 4-8b without a network: the mitmproxy patches driven
through real layers (events in, commands out), the pure policy parts, and
the identity addon with an injected verifier."""

from __future__ import annotations

import asyncio
import time

import pytest
from mitmproxy import connection, options
from mitmproxy.proxy import commands, events, mode_specs
from mitmproxy.proxy.context import Context
from mitmproxy.proxy.layers import modes
from mitmproxy.proxy.layers.http._http1 import Http1Server
from mitmproxy.test import tflow

from sluice.addons import mitm_patches
from sluice.addons.conn_release import ConnRelease
from sluice.identity import ClientIdentifier
from sluice.refusals import error_bytes
from sluice.policy.clients import SECRET_PREFIX, match_client, secret_verifier, verify_password
from sluice.policy.loader import PolicyInvalid, hash_password, load_policy_file, load_policy_text
from sluice.policy.reasons import POLICY_SUFFIX, Reason, Refusal


# ---- http1_error_pages -------------------------------------------------------------


class PageListener:
    def __init__(self, answer: bytes
                 | None = b"HTTP/1.1 400 Bad Request\r\nSluice-Reason: bad_request\r\n\r\n") -> None:
        self.answer = answer
        self.asked: list[tuple[int, str, bool]] = []

    def error_page(self, client, status, message, *, in_tunnel):
        self.asked.append((status, message, in_tunnel))
        return self.answer

    def client_refused(self, *args, **kwargs):
        pass


@pytest.fixture
def listener(monkeypatch):
    mitm_patches.install()
    lst = PageListener()
    monkeypatch.setattr(mitm_patches.hooks, "refusal_listener", lst)
    monkeypatch.setattr(mitm_patches.hooks, "head_guard", None)
    return lst


def _server() -> tuple[Http1Server, connection.Client]:
    client = connection.Client(peername=("192.0.2.1", 40000), sockname=("127.0.0.1", 8080), timestamp_start=time.time())
    server = mitm_patches.SluiceHttp1Server(Context(client, options.Options()))
    assert list(server.handle_event(events.Start())) == []
    return server, client


def _sent(cmds) -> bytes:
    return b"".join(c.data for c in cmds if isinstance(c, commands.SendData))


def test_mitmproxys_page_for_an_unparseable_head_is_replaced(listener):
    server, client = _server()
    cmds = list(server.handle_event(events.DataReceived(client, b"GARBAGE\r\n\r\n")))
    assert _sent(cmds) == listener.answer
    assert listener.asked and listener.asked[0][0] == 400 and listener.asked[0][2] is False
    assert any(isinstance(c, commands.CloseConnection) for c in cmds)


def test_without_an_answer_mitmproxys_page_goes_out_as_shipped(listener):
    listener.answer = None
    server, client = _server()
    cmds = list(server.handle_event(events.DataReceived(client, b"GARBAGE\r\n\r\n")))
    assert b"Server: mitmproxy" in _sent(cmds) and listener.asked


def test_a_normal_request_is_untouched(listener):
    server, client = _server()
    cmds = list(server.handle_event(events.DataReceived(client, b"GET http://example.com/ HTTP/1.1\r\nHost: "
                                                                b"example.com\r\n\r\n")))
    assert _sent(cmds) == b"" and listener.asked == []


def test_error_bytes_is_plain_text_without_a_reason():
    raw = error_bytes(502, "Connect call failed ('8.8.8.8', 81)\x00")
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 502 Bad Gateway\r\n") and b"Sluice-Reason" not in head and b"Server" not in head
    assert body == b"Sluice could not complete this request (502 Bad Gateway): Connect call failed ('8.8.8.8', 81)?.\n"


# ---- socks5_login ------------------------------------------------------------------------


def _socks_layer(enabled: bool, monkeypatch):
    mitm_patches.install()
    monkeypatch.setattr(mitm_patches.hooks, "socks5_login", enabled)
    client = connection.Client(peername=("192.0.2.1", 40000), sockname=("127.0.0.1", 1080), timestamp_start=time.time(),
                               proxy_mode=mode_specs.ProxyMode.parse("socks5"))
    layer = modes.Socks5Proxy(Context(client, options.Options()))
    list(layer.handle_event(events.Start()))
    return layer, client


def test_a_greeting_offering_username_password_is_asked_for_it(monkeypatch):
    layer, client = _socks_layer(True, monkeypatch)
    cmds = list(layer.handle_event(events.DataReceived(client, b"\x05\x02\x00\x02")))
    assert _sent(cmds) == b"\x05\x02"  # username/password chosen
    cmds = list(layer.handle_event(events.DataReceived(client, b"\x01\x03bot\x02pw")))
    hooks = [c for c in cmds if isinstance(c, modes.Socks5AuthHook)]
    assert len(hooks) == 1 and (hooks[0].data.username, hooks[0].data.password) == ("bot", "pw")


def test_a_greeting_without_username_password_is_served_as_shipped(monkeypatch):
    layer, client = _socks_layer(True, monkeypatch)
    assert _sent(list(layer.handle_event(events.DataReceived(client, b"\x05\x01\x00")))) == b"\x05\x00"


def test_until_enabled_mitmproxy_greets_as_shipped(monkeypatch):
    layer, client = _socks_layer(False, monkeypatch)
    assert _sent(list(layer.handle_event(events.DataReceived(client, b"\x05\x02\x00\x02")))) == b"\x05\x00"


# ---- the policy: version, hashes, refusal_note -------------------------------------------


def _problems(text: str) -> list[str]:
    with pytest.raises(PolicyInvalid) as info:
        load_policy_text(text, "p.yaml")
    return [p.message for p in info.value.problems]


def test_version_as_a_string_names_the_type():
    assert _problems('version: "1"\n') == ["version is the string '1'; write the number 1 without quotes (`version: "
                                           "1`)"]
    assert _problems("version: 2\n") == ["unsupported policy version 2; this Sluice reads version 1"]


def test_unsalted_sha256_hashes_are_refused():
    (message,) = _problems('version: 1\nclients:\n  - name: a\n    users: {bot: {password_hash: "sha256:' + "0" * 64
                           + '"}}\n')
    assert "unsalted 'sha256:' hashes are not accepted" in message and "hash-password" in message


def test_a_password_file_is_kept_as_a_keyed_hmac_never_writable_in_a_policy(tmp_path):
    (tmp_path / "bot.secret").write_text("s3cret\n")
    path = tmp_path / "p.yaml"
    path.write_text("version: 1\nclients:\n  - name: a\n    users: {bot: {password_file: bot.secret}}\n")
    ((user, verifier),) = load_policy_file(path).clients[0].credentials
    assert verifier.startswith(SECRET_PREFIX) and "s3cret" not in verifier
    assert verify_password(verifier, "s3cret") and not verify_password(verifier, "s3cret\n")
    # The same form written into a policy is not a password_hash.
    assert "expected 'pbkdf2_sha256" in _problems(
        f'version: 1\nclients:\n  - name: a\n    users: {{bot: {{password_hash: "{secret_verifier("x")}"}}}}\n')[0]


def test_refusal_note_is_per_profile_inherited_and_clearable():
    policy = load_policy_text("""\
version: 1
refusal_note: "Ask #egress."
clients:
  - {name: inherits, sources: [10.0.0.0/8]}
  - {name: own, sources: [10.1.0.0/16], refusal_note: "Own: file a ticket."}
  - {name: silent, sources: [10.2.0.0/16], refusal_note: null}
""")
    notes = {p.name: p.rules.refusal_note for p in policy.clients}
    assert policy.rules.refusal_note == "Ask #egress."
    assert notes == {"inherits": "Ask #egress.", "own": "Own: file a ticket.", "silent": None}


@pytest.mark.parametrize("value,expected", [
    ('""', "refusal_note is empty"),
    ('"a\\nb"', "refusal_note must be one line of printable text"),
    ("[a, b]", "refusal_note must be text (one sentence appended to refusals), not a list or mapping"),
    ("5", "refusal_note must be text (one sentence appended to refusals), not the number 5"),
    ('"' + "x" * 301 + '"', "refusal_note is 301 characters; keep it to one sentence of at most 300"),
])
def test_a_bad_refusal_note_is_an_error(value, expected):
    (message,) = _problems(f"version: 1\nrefusal_note: {value}\n")
    assert message.startswith(expected), message


def test_the_note_follows_sluices_sentence():
    refusal = Refusal(Reason.HOST_NOT_ALLOWED, "x.example is not on this policy's allow list").with_note("Ask #egress.")
    assert refusal.message == ("Sluice refused this request: x.example is not on this policy's allow list. "
                               f"{POLICY_SUFFIX} Ask #egress.")
    assert refusal.with_note("another") is refusal  # the first note stays
    throttled = Refusal(Reason.AUTH_THROTTLED, "too many", retry_after=3, note="Ask #egress.")
    assert throttled.message == "Sluice refused this request: too many. Retry after 3 s. Ask #egress."


# ---- identity: how a client is told to authenticate; SOCKS5 logins ------------------------


REQUIRE = load_policy_text(f"""\
version: 1
require_client: true
refusal_note: "Ask #egress."
clients:
  - name: agents
    users: {{bot: {{password_hash: "{hash_password('bot-pw', iterations=10_000, salt=b'0' * 16)}"}}}}
""")


@pytest.mark.parametrize("via,says,never", [
    ("http", "(Proxy-Authorization)", "SOCKS5"),
    ("socks5", "SOCKS5 username/password", "Proxy-Authorization"),
    ("source", "source address matches no client profile", "Proxy-Authorization"),
])
def test_a_require_client_refusal_names_the_way_this_client_can_authenticate(via, says, never):
    refusal = match_client(REQUIRE, "192.0.2.1", via=via).refusal
    assert refusal.reason is Reason.CLIENT_UNKNOWN and says in refusal.detail and never not in refusal.detail
    assert refusal.message.endswith("Ask #egress.")


def _client(mode: str, cid: str = "c1"):
    client = tflow.tclient_conn()
    client.id, client.peername, client.proxy_mode = cid, ("192.0.2.1", 5000), mode_specs.ProxyMode.parse(mode)
    return client


def test_a_socks5_login_is_checked_like_proxy_authorization_and_kept_per_connection():
    identity = ClientIdentifier(verify=lambda verifier, password: password == "bot-pw")

    async def run():
        socks = _client("socks5")
        assert (await identity.socks5_login(REQUIRE, socks, "bot", "bot-pw")).profile == "agents"
        later = await identity.match(REQUIRE, socks, None)  # the gate's server_connect
        assert (later.profile, later.refusal) == ("agents", None) and identity.socks5_user(socks) == "bot"
        ConnRelease(audit=None).client_disconnected(socks)  # the connection ended: its login goes with it
        unknown = await identity.match(REQUIRE, socks, None)
        assert unknown.refusal is not None and "SOCKS5 username/password" in unknown.refusal.detail
        other = _client("socks5", "c2")
        wrong = await identity.socks5_login(REQUIRE, other, "bot", "nope")
        assert wrong.refusal.reason is Reason.CLIENT_UNKNOWN
        assert (await identity.match(REQUIRE, other, None)).refusal is not None  # nothing kept for it

    asyncio.run(run())


def test_a_socks5_login_does_not_count_when_the_policy_has_no_users():
    plain = load_policy_text("version: 1\nclients:\n  - {name: lab, sources: [192.0.2.0/24]}\n")
    identity = ClientIdentifier(verify=lambda verifier, password: pytest.fail("nothing to verify"))

    async def run():
        client = _client("socks5")
        assert await identity.socks5_login(plain, client, "anyone", "anything") is None
        assert (await identity.match(plain, client, None)).profile == "lab"  # by source

    asyncio.run(run())
