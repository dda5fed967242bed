"""Entry point for `mitmdump -s addons/sluice_addon.py --set sluice_policy=FILE`.

`sluice proxy` loads the same list in-process. Order matters: the gate
decides first, the redirect guard and caps act on its verdict, and the audit
log writes last, once every cap has had its say.
"""

from addons.audit import AuditLog
from addons.caps import Caps
from addons.gate import EgressGate
from addons.guardrails import Guardrails
from addons.policy_source import PolicySource
from addons.redirects import RedirectGuard
from addons.upgrades import UpgradeGuard


def make_addons() -> list:
    audit = AuditLog()
    source = PolicySource(audit)
    caps = Caps(source, audit)
    return [Guardrails(), source, EgressGate(source, audit, caps), RedirectGuard(source), UpgradeGuard(caps), caps, audit]


addons = make_addons()
