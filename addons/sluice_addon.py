"""Entry point for `mitmdump -s addons/sluice_addon.py --set sluice_policy=FILE`.

`sluice proxy` loads the same list in-process. Order matters: the gate
decides first, the redirect guard and caps act on its verdict, and the audit
log writes last, once every cap has had its say.
"""

from sluice.addons.audit import AuditLog
from sluice.addons.caps import Caps
from sluice.addons.connection_audit import ConnectionAudit
from sluice.addons.gate import EgressGate
from sluice.addons.guardrails import Guardrails
from sluice.addons.head_limits import HeadLimits
from sluice.addons import mitm_patches
from sluice.addons.policy_source import PolicySource
from sluice.addons.quotas import Quotas
from sluice.addons.redirects import RedirectGuard
from sluice.addons.upgrades import UpgradeGuard


def make_addons() -> list:
    mitm_patches.install()
    audit = AuditLog()
    source = PolicySource(audit)
    caps = Caps(source, audit)
    gate = EgressGate(source, audit, caps)
    return [Guardrails(), source, ConnectionAudit(audit), gate, Quotas(source, audit, caps, gate), RedirectGuard(source), UpgradeGuard(caps, source), caps, HeadLimits(source, audit), audit]


addons = make_addons()
