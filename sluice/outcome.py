"""What Sluice decided about one flow, carried in `flow.metadata` from the gate
to the caps, the redirect guard and the audit log.

Which refusal wins is decided here, in one place: addons change the outcome
only through `refuse`, `cut`, `fail`, `answered` and `sent`, and read it
through `refusal`, `answer` and `status` (tests/unit/test_outcome.py checks
every order of them, and that no addon assigns the fields itself).

Precedence, strongest first:

1. mitmproxy's own answer (`answered(refusal, status)`): mitmproxy, or the
   dial, answered the client itself (a head it could not frame, a request
   it found invalid, a dial back to the proxy's own listener). The decision
   becomes that refusal, no cap or `would_refuse` stands (nothing after
   changes it either), and `status` is what the client got. `sent(status)` records a status mitmproxy sent
   without a refusal of ours (its 400 for an invalid request, its 502 when
   the origin failed); it is the audit line's status whatever else holds.
2. The fail-safe (`fail(refusal)`): Sluice failed while handling the flow;
   its refusal replaces any cap, since it is what the client is answered.
3. The decision: the gate's `Decision`; a later check that refuses an
   allowed request (the quotas) makes it a refusal with `refuse(refusal)`;
   the first refusal stands. In report mode (`report=True`) nothing is refused: the first such
   refusal is recorded as `would_refuse`.
4. A cap or guard after the decision (`cut(refusal)`): the first cut
   stands, later ones are ignored (it returns False), and nothing cuts a
   flow whose line is already written.

What each side sees:

- the audit line's reason (`refusal`): the decision's refusal, else the cap
  (a tunnel's line, decided allowed, names its cap only);
- the client's answer (`answer`: its `Sluice-Reason`): the cap, else the
  decision's refusal (they differ only when the fail-safe answered a
  request the decision had refused already);
- the audit line's status (`status(response_status)`): what mitmproxy sent
  (`sent`/`answered`), else the cap's status if it was answered before the
  response started, else the response's status.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from mitmproxy import flow as mflow

from sluice.policy.decide import Decision
from sluice.policy.model import Limits, Rules
from sluice.policy.reasons import Refusal

META = "sluice"
# The gate's sluice.admission.Admission for the flow: what it decided to do
# with the request (pin, header strips, credential), read by the addons that do it.
ADMISSION_META = "sluice.admission"


@dataclass(slots=True)
class Outcome:
    host: str  # the host as the client named it
    port: int
    decision: Decision
    profile: str | None
    rules: Rules | None  # the profile's rules (None when the client itself was refused)
    intercept: bool = False  # a tunnel whose TLS the proxy terminates
    method: str | None = None  # the method it was decided with (CONNECT for a tunnel; None for SOCKS5)
    started: float = field(default_factory=time.time)
    cap: Refusal | None = None  # a cap or guard that cut the exchange after the decision
    bytes_from_client: int = 0
    bytes_from_server: int = 0
    response_started: bool = False  # headers went to the client
    wire_status: int | None = None  # a status mitmproxy itself sent instead of ours
    mitmproxy_answered: bool = False  # mitmproxy answered the client itself: nothing else changes the outcome
    logged: bool = False
    requests: int = 0  # requests seen inside an intercepted tunnel
    client: object = None  # a tunnel's client connection, for cutting it on reload
    user: str | None = None  # the proxy username the client authenticated (or was refused) as
    connect_id: str | None = None  # the id of the CONNECT that opened the tunnel this belongs to
    # Who the client proved to be (policy.clients.ClientIdentity): a reload
    # matches an open tunnel's or pipe's client again with it.
    identity: object = None
    # Its client's bytes_per_hour, charged per chunk as bodies (or a pipe's
    # bytes) pass: addons/quotas.TransferCharge, set by the quotas addon.
    transfer: object = None

    @property
    def limits(self) -> Limits:
        return self.rules.limits if self.rules is not None else Limits()

    # ---- changing the outcome (the precedence above, and only here) --------

    def refuse(self, refusal: Refusal, *, report: bool = False) -> bool:
        """A check after the gate refuses this allowed flow (3): the first
        refusal stands. In report mode the first such refusal is recorded as
        `would_refuse` and the flow goes on. Returns whether it is refused."""
        if self.mitmproxy_answered:
            return False
        if report:
            if self.decision.would_refuse is None:
                self.decision = replace(self.decision, would_refuse=refusal)
            return False
        if not self.decision.allowed:
            return False
        self.decision = replace(self.decision, allowed=False, refusal=refusal)
        return True

    def cut(self, refusal: Refusal) -> bool:
        """A cap or guard ends the exchange or tunnel (4): the first cut
        stands. Returns whether this one did."""
        if self.cap is not None or self.mitmproxy_answered:
            return False
        self.cap = refusal
        return True

    def fail(self, refusal: Refusal) -> None:
        """Sluice failed while handling the flow (2): its refusal is the
        client's answer, in place of any cap."""
        if not self.mitmproxy_answered:
            self.cap = refusal

    def answered(self, refusal: Refusal, status: int | None) -> None:
        """mitmproxy (or the dial) answered the client itself (1): this is
        the decision, nothing else stands, before or after; `status` is what
        was sent (None: the flow's response, sent after this hook). The
        first such answer stands."""
        if self.mitmproxy_answered:
            return
        self.decision = replace(self.decision, allowed=False, refusal=refusal, would_refuse=None)
        self.cap = None
        self.wire_status = status
        self.mitmproxy_answered = True

    def sent(self, status: int) -> None:
        """mitmproxy sent the client this status itself (1); after
        `answered`, the status it recorded stands."""
        if not self.mitmproxy_answered:
            self.wire_status = status

    # ---- reading it ----------------------------------------------------------

    @property
    def refusal(self) -> Refusal | None:
        """The audit line's refusal: the decision's, else the cap."""
        return self.decision.refusal or self.cap

    @property
    def answer(self) -> Refusal | None:
        """The refusal the client is answered with: the cap, else the decision's."""
        return self.cap or self.decision.refusal

    def status(self, response_status: int | None) -> int | None:
        """The audit line's status, given the status of the flow's response."""
        if self.wire_status:
            return self.wire_status
        if self.cap is not None and not self.response_started:
            return self.refusal.status
        return response_status


def outcome_of(f: mflow.Flow) -> Outcome | None:
    return f.metadata.get(META)
