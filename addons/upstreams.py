"""Upstream connections per client connection (`limits.max_upstreams_per_connection`).

mitmproxy keeps every keep-alive upstream connection a client connection
opened until that client connection ends: one client asking 400 distinct
addresses held 400 upstream sockets. Here each client connection's upstream
connections are kept in least-recently-used order (a connection is used when
it is opened and when an exchange on it ends); before a new one is dialled
past the limit, the least recently used *idle* one (HTTP/1 keep-alive between
exchanges: addons/connections.idle_http1_servers) is closed. So one client
connection costs at most 1 + max_upstreams_per_connection file descriptors.
Tunnels, pipes and exchanges in flight are never closed; if every one is
busy, the dial is refused (429 `too_many_connections`, answered by
addons/caps.py). The gate's approval table for the connection is bounded by
the same limit (addons/gate.py).

It acts at the dial itself (the dialer, sluice/dialer.py, asks it, after
the pin check and after mitmproxy waited for its per-address slot): a dial that waits, or that the gate or the quotas
refused, never costs another connection its socket.
"""

from __future__ import annotations

from mitmproxy import connection, http
from mitmproxy.proxy.server_hooks import ServerConnectionHookData

from sluice import connstate
from sluice.addons import connections
from sluice.addons.audit import AuditLog
from sluice.addons.gate import EgressGate
from sluice.dialer import UPSTREAMS_BUSY


class Upstreams:
    def __init__(self, gate: EgressGate, audit: AuditLog) -> None:
        self.gate = gate
        self.audit = audit
        # The upstream sockets each client connection holds (from their
        # dial) are its ConnState's `upstreams` (sluice/connstate.py):
        # server id -> server, least recently used first.

    def load(self, loader) -> None:
        self.gate.dialer.room = self.before_dial

    def done(self) -> None:
        self.gate.dialer.room = None

    def open_count(self, client: connection.Client) -> int:
        state = connstate.peek(client)
        return len(state.upstreams) if state is not None else 0

    def before_dial(self, client: connection.Client, server: connection.Server) -> str | None:
        """Right before a dial's socket exists (after mitmproxy's own wait for
        a per-address slot): make room under the limit, or say why not."""
        rules = self.gate.rules_for_dial(client, server)
        limit = rules.limits.max_upstreams_per_connection if rules is not None else None
        held = connstate.state_of(client).upstreams
        if limit is not None and len(held) >= limit:
            tunnels = self.gate.tunnel_server_ids(client)
            idle = connections.idle_http1_servers(client)
            for server_id, old in list(held.items()):
                if len(held) < limit:
                    break
                if server_id in idle and server_id not in tunnels:
                    del held[server_id]
                    connections.close_server(client, old)
            if len(held) >= limit:
                return (f"{UPSTREAMS_BUSY}: it holds {len(held)} upstream connections, "
                        "this policy's limits.max_upstreams_per_connection, all in use")
        held[server.id] = server
        return None

    def server_connected(self, data: ServerConnectionHookData) -> None:
        self._used(data.client, data.server)

    def server_connect_error(self, data: ServerConnectionHookData) -> None:
        self._gone(data.client, data.server)

    def server_disconnected(self, data: ServerConnectionHookData) -> None:
        self._gone(data.client, data.server)

    def response(self, flow: http.HTTPFlow) -> None:
        self._used(flow.client_conn, flow.server_conn)

    def error(self, flow: http.HTTPFlow) -> None:
        self._used(flow.client_conn, flow.server_conn)

    def _used(self, client: connection.Client, server: connection.Server | None) -> None:
        state = connstate.peek(client)
        if state is not None and server is not None and server.id in state.upstreams:
            state.upstreams.move_to_end(server.id)

    def _gone(self, client: connection.Client, server: connection.Server) -> None:
        state = connstate.peek(client)
        if state is not None:
            state.upstreams.pop(server.id, None)
