"""Entry point for `mitmdump -s addons/sluice_addon.py --set sluice_policy=FILE`.

`sluice proxy` loads the same list in-process.
"""

from addons.audit import AuditLog
from addons.gate import EgressGate
from addons.policy_source import PolicySource


def make_addons() -> list:
    audit = AuditLog()
    source = PolicySource(audit)
    return [source, audit, EgressGate(source, audit)]


addons = make_addons()
