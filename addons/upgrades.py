"""Protocol upgrades: WebSocket only, and then carried as a capped tunnel.

mitmproxy turns a `101 Switching Protocols` into a WebSocket layer or a raw
TCP layer straight from its HTTP stream, never through `next_layer`, so the
tunnel caps and meters attached there never see it. Here:

- a request asking to upgrade to anything but `websocket` is refused
  (`upgrade_refused`), and so is any 101 that is not a WebSocket answer to a
  WebSocket request (an origin may not switch protocols unasked);
- an accepted WebSocket is carried as a TCP flow (Sluice runs mitmproxy with
  `websocket=false`: its WebSocket layer buffers whole messages before any
  hook could count them). Every chunk is counted against
  `tunnel_max_bytes` and charged to its client's `bytes_per_hour` (the
  upgrade request's `TransferCharge`, addons/quotas.py) as it passes; the
  pipe is cut where either runs out (`tunnel_too_large`, `quota_exceeded`).
  The pipe gets `tunnel_max_seconds`, chunks are never kept, and the pipe
  gets its own audit line with its bytes. (Its `max_tunnels` slot is taken
  by the quotas addon when the upgrade request arrives.)
"""

from __future__ import annotations

from mitmproxy import http, tcp

from sluice import connstate
from sluice.addons.caps import Caps
from sluice.failsafe import fail_closed
from sluice.addons.gate import redecide
from sluice.addons.policy_source import LivePolicy, PolicySource
from sluice.refusals import noted, refusal_response
from sluice.outcome import META, Outcome, outcome_of
from sluice.policy.reasons import Reason, Refusal
from sluice.policy.units import size_text


def _tokens(value: str) -> set[str]:
    return {t.strip().lower() for t in value.split(",") if t.strip()}


class UpgradeGuard:
    def __init__(self, caps: Caps, source: PolicySource) -> None:
        self.caps = caps
        self.source = source
        # Per client connection, in its ConnState (sluice/connstate.py):
        # `accepted_upgrades`, server connection id -> the accepted upgrade's
        # request outcome until its TCP pipe starts; then `pipes`, its open
        # upgraded pipes, which a reload re-decides.

    def load(self, loader) -> None:
        self.source.on_reload(self.revoke_refused_pipes)

    @fail_closed()
    def requestheaders(self, flow: http.HTTPFlow) -> None:
        outcome = outcome_of(flow)
        if outcome is None or not outcome.decision.allowed or flow.response is not None:
            return
        asked = _tokens(flow.request.headers.get("upgrade", ""))
        if asked and asked != {"websocket"}:
            outcome.cut(noted(flow,
                              Refusal(Reason.UPGRADE_REFUSED,
                                      f"the request asks to upgrade to {', '.join(sorted(asked))[:80]}; only WebSocket "
                                      "upgrades may pass")))
            flow.response = refusal_response(outcome.cap)

    @fail_closed(response_phase=True)
    def responseheaders(self, flow: http.HTTPFlow) -> None:
        outcome = outcome_of(flow)
        if outcome is None or flow.response.status_code != 101 or outcome.cap is not None:
            return
        websocket = (
            _tokens(flow.request.headers.get("upgrade", "")) == {"websocket"}
            and _tokens(flow.response.headers.get("upgrade", "")) == {"websocket"}
        )
        if not websocket or not outcome.decision.allowed:
            # Answer the client and close both sides before a byte of the
            # other protocol crosses.
            self.caps.cut(flow, Refusal(Reason.UPGRADE_REFUSED,
                                        "the origin switched protocols to something other than a requested WebSocket"))
            return
        connstate.state_of(flow.client_conn).accepted_upgrades[flow.server_conn.id] = outcome

    def tcp_start(self, flow: tcp.TCPFlow) -> None:
        state = connstate.peek(flow.client_conn)
        upgraded = state.accepted_upgrades.pop(flow.server_conn.id, None) if state is not None else None
        if upgraded is None:
            return
        pipe = Outcome(upgraded.host, upgraded.port, upgraded.decision, upgraded.profile, upgraded.rules,
                       method=upgraded.method)
        pipe.client = flow.client_conn
        pipe.user, pipe.connect_id, pipe.identity = upgraded.user, upgraded.connect_id, upgraded.identity
        pipe.transfer = upgraded.transfer
        flow.metadata[META] = pipe
        state.pipes.append(pipe)
        self.caps.watch_tunnel(flow.client_conn, pipe)

    def tcp_message(self, flow: tcp.TCPFlow) -> None:
        pipe = outcome_of(flow)
        message = flow.messages[-1]
        # Never keep what passed: memory stays flat however long the pipe runs.
        flow.messages.clear()
        if pipe is None:
            message.content = b""  # a pipe the gate never approved carries nothing
            return
        if pipe.cap is not None:
            message.content = b""
            return
        n = len(message.content)
        before = pipe.bytes_from_client if message.from_client else pipe.bytes_from_server
        cap = pipe.limits.tunnel_max_bytes
        allowed = n if cap is None else max(0, min(n, cap - before))
        refusal = None
        if allowed < n:
            refusal = Refusal(Reason.TUNNEL_TOO_LARGE,
                              f"the upgraded connection carried more than this policy's {size_text(cap)} cap in one "
                              "direction")
        if pipe.transfer is not None and allowed > 0:
            granted = pipe.transfer(allowed)
            if granted < allowed:
                allowed, refusal = granted, pipe.transfer.refusal()
        if message.from_client:
            pipe.bytes_from_client += allowed
        else:
            pipe.bytes_from_server += allowed
        if refusal is not None:
            message.content = message.content[:allowed]
            self.caps.cut_tunnel(flow.client_conn, pipe, refusal)

    def open_pipes(self) -> list[Outcome]:
        """The pipes still open (the drain waits for them as for tunnels)."""
        return [pipe for pipe in connstate.open_pipes() if not pipe.logged and pipe.cap is None]

    def revoke_refused_pipes(self, live: LivePolicy) -> None:
        """After a reload, like the gate's tunnels: the pipe's client is
        matched again, and a pipe the new policy refuses (or whose client
        matches no profile any more) is closed."""
        for pipe in connstate.open_pipes():
            if pipe.logged or pipe.cap is not None:
                continue
            refusal = redecide(live.policy, pipe)
            if refusal is not None:
                self.caps.cut_tunnel(pipe.client, pipe, Refusal(
                    Reason.TUNNEL_REVOKED,
                    f"the reloaded policy refuses this upgraded connection ({refusal.reason.value}: {refusal.detail})"))
