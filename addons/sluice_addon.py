"""Entry point for `mitmdump -s addons/sluice_addon.py --set sluice_policy=FILE`.

`sluice proxy` loads the same list in-process (the script's copy differs
in one entry: `script_addons`). mitmproxy calls each hook on
the addons in list order, so order matters: each entry of `make_addons`'s
list says why it sits where it does.
"""

from sluice import connstate
from sluice.addons.approvals import Approvals
from sluice.addons.audit import AuditLog
from sluice.addons.caps import Caps
from sluice.addons.conn_release import ConnRelease
from sluice.addons.connection_audit import ConnectionAudit
from sluice.addons.credentials import CredentialInjector
from sluice.addons.gate import EgressGate
from sluice.addons.guardrails import Guardrails
from sluice.addons.head_limits import HeadLimits
from sluice.addons.layer_choice import LayerChoice, TakeOverNextLayer
from sluice.addons import mitm_patches
from sluice.addons.origin_headers import OriginHeaders
from sluice.addons.otlp import OtlpExport
from sluice.addons.policy_source import PolicySource
from sluice.addons.quotas import Quotas
from sluice.addons.redirects import RedirectGuard
from sluice.addons.upgrades import UpgradeGuard
from sluice.addons.upstreams import Upstreams


def make_addons(*, lifecycle: bool = False, metrics: bool = False) -> list:
    """`lifecycle` (sluice proxy): the readiness state and the graceful drain
    (addons/status.py, addons/drain.py); `metrics`: the Prometheus
    metrics (addons/metrics.py). Both watch the audit log's records."""
    mitm_patches.install()
    audit = AuditLog()
    source = PolicySource(audit)
    caps = Caps(source, audit)
    approvals = Approvals(audit, source)
    gate = EgressGate(source, audit, caps, approvals)
    operations: list = []
    if lifecycle:
        from sluice.addons.status import Status
        from sluice.addons.drain import Drain

        status = Status(audit, source)
        operations += [status, Drain(caps, status.drain)]
    on_drop = None
    if metrics:
        from sluice.addons.metrics import OTLP_DROPPED, ApprovalMetrics, Metrics

        operations.append(Metrics(audit, source, connstate.open_tunnels))
        approvals.observer = ApprovalMetrics()
        on_drop = OTLP_DROPPED.inc
    operations.append(OtlpExport(audit, on_drop))  # off unless an endpoint is given (addons/otlp.py)
    return [
        # Refuses unsafe mitmproxy options before any other addon runs under them.
        Guardrails(),
        # Loads the policy in load/configure, before any later addon reads it.
        source,
        # Sees mitmproxy's own refusals (its 400s, loops to its own listener) before any Sluice hook acts on the flow.
        ConnectionAudit(audit),
        # The one client_disconnected (no other addon has one): writes what a connection owes the log, releases it.
        ConnRelease(audit),
        # Strips Sluice's own signals from an origin's response before any addon reads or sets them.
        OriginHeaders(),
        # The grants snapshot the gate decides with (its running hook reads it before the ready line).
        approvals,
        # Decides (identity, host, pin, intercept): everything after it acts on its decision.
        gate,
        # mitmproxy's NextLayer, subclassed: picks each tunnel's layers from the gate's decision (only next_layer).
        LayerChoice(audit),
        # Counts what the gate allowed, against the client it identified.
        Quotas(source, audit, caps, gate),
        # The per-connection upstream limit, asked at the dial; its hooks only keep the use order.
        Upstreams(gate, audit),
        # Sets credential headers after the gate stripped the client's, only on what gate and quotas let through.
        CredentialInjector(source, audit),
        # Checks a 3xx's Location before the caps meter the response it may replace.
        RedirectGuard(source),
        # Refuses or accepts an upgrade the gate allowed; an accepted WebSocket gets the caps' tunnel meters.
        UpgradeGuard(caps, source),
        # Meters the bodies and tunnels of what the deciders above let through.
        caps,
        # After every decider: drops `Expect: 100-continue` from a refused request before mitmproxy answers 100.
        HeadLimits(source, audit),
        # Writes the line once every addon above has had its say.
        audit,
        # Readiness, drain, metrics, OTLP: observers of the audit records, last.
        *operations,
    ]


def script_addons() -> list:
    """make_addons' list for `mitmdump -s`: mitmdump's master already holds
    mitmproxy's NextLayer under the name LayerChoice takes, so LayerChoice
    goes in through TakeOverNextLayer, which swaps it in at load."""
    return [TakeOverNextLayer(a) if isinstance(a, LayerChoice) else a for a in make_addons()]


addons = script_addons()
