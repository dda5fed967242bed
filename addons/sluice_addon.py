"""Entry point for `mitmdump -s addons/sluice_addon.py --set sluice_policy=FILE`.

`sluice proxy` loads the same list in-process. Order matters: the gate
decides first, the redirect guard and caps act on its outcome, and the audit
log writes last, once every cap has had its say. The origin-headers addon
strips the proxy's own header fields from origin responses before any other
addon reads or replaces them (addons/origin_headers.py). The credential injector
runs right after the gate and its quotas, so after the gate's
`strip_request_headers` and only on requests they let through.
"""

from sluice import connstate
from sluice.addons.audit import AuditLog
from sluice.addons.caps import Caps
from sluice.addons.conn_release import ConnRelease
from sluice.addons.connection_audit import ConnectionAudit
from sluice.addons.credentials import CredentialInjector
from sluice.addons.gate import EgressGate
from sluice.addons.guardrails import Guardrails
from sluice.addons.head_limits import HeadLimits
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
    gate = EgressGate(source, audit, caps)
    operations: list = []
    if lifecycle:
        from sluice.addons.status import Status
        from sluice.addons.drain import Drain

        status = Status(audit, source)
        operations += [status, Drain(caps, status.drain)]
    on_drop = None
    if metrics:
        from sluice.addons.metrics import OTLP_DROPPED, Metrics

        operations.append(Metrics(audit, source, connstate.open_tunnels))
        on_drop = OTLP_DROPPED.inc
    operations.append(OtlpExport(audit, on_drop))  # off unless an endpoint is given (addons/otlp.py)
    return [Guardrails(), source, ConnectionAudit(audit), ConnRelease(audit), OriginHeaders(), gate,
            Quotas(source, audit, caps, gate), Upstreams(gate, audit), CredentialInjector(source, audit),
            RedirectGuard(source), UpgradeGuard(caps, source), caps, HeadLimits(source, audit), audit, *operations]


addons = make_addons()
