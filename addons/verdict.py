"""What Sluice decided about one flow, carried in `flow.metadata` from the gate
to the caps, the redirect guard and the audit log."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from mitmproxy import flow as mflow

from sluice.policy.decide import Decision
from sluice.policy.model import Limits, Rules
from sluice.policy.reasons import Refusal

META = "sluice"


@dataclass(slots=True)
class Verdict:
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


def verdict_of(f: mflow.Flow) -> Verdict | None:
    return f.metadata.get(META)
