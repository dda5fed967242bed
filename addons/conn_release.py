"""The one `client_disconnected`: a client connection's state (sluice/connstate.py)
is released here, in one place, once.

What the connection still owes the audit log is written first, from that
state: the refused dial back to the proxy's own listener that no flow took
(SOCKS5, transparent), then each tunnel's line (written once: a tunnel cut
earlier already has its line). Then every quota slot and timer it holds
is given back and the state is forgotten.
"""

from __future__ import annotations

from mitmproxy import connection

from sluice import connstate
from sluice.addons.audit import AuditLog
from sluice.policy.decide import Decision


class ConnRelease:
    def __init__(self, audit: AuditLog) -> None:
        self.audit = audit

    def client_disconnected(self, client: connection.Client) -> None:
        state = connstate.pop(client)
        if state is None:
            return
        try:
            if state.loop is not None:
                refusal, host, port = state.loop
                self.audit.refused_connection(client, host, port, Decision(False, None, refusal, port=port), None)
            for tunnel in state.tunnels.values():
                # The tunnel's own decision line (an intercepted one's
                # requests have theirs too); tunnel_line writes it once.
                self.audit.tunnel_line(tunnel, client)
        finally:
            state.release()
