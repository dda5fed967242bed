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
busy, the dial is refused (`too_many_connections`). The gate's approval
table for the connection is bounded by the same limit (addons/gate.py).

Runs after the gate and the quotas (addons/sluice_addon.py), so a dial they
refused never costs another connection its socket.
"""

from __future__ import annotations

from collections import OrderedDict

from mitmproxy import connection, http
from mitmproxy.proxy.server_hooks import ServerConnectionHookData

from sluice.addons import connections
from sluice.addons.audit import AuditLog, peer
from sluice.addons.failsafe import fail_closed
from sluice.addons.gate import EgressGate
from sluice.policy.reasons import Reason


class Upstreams:
    def __init__(self, gate: EgressGate, audit: AuditLog) -> None:
        self.gate = gate
        self.audit = audit
        # client id -> server id -> server, least recently used first
        self._open: dict[str, OrderedDict[str, connection.Server]] = {}

    def open_count(self, client: connection.Client) -> int:
        return len(self._open.get(client.id, ()))

    @fail_closed()
    def server_connect(self, data: ServerConnectionHookData) -> None:
        server = data.server
        if server.error or server.address is None:
            return
        rules = self.gate.rules_for_dial(data.client, server)
        limit = rules.limits.max_upstreams_per_connection if rules is not None else None
        held = self._open.setdefault(data.client.id, OrderedDict())
        if limit is not None and len(held) >= limit:
            tunnels = self.gate.tunnel_server_ids(data.client)
            idle = connections.idle_http1_servers(data.client)
            for server_id, old in list(held.items()):
                if len(held) < limit:
                    break
                if server_id in idle and server_id not in tunnels:
                    del held[server_id]
                    connections.close_server(data.client, old)
            if len(held) >= limit:
                detail = (f"this client connection already holds {len(held)} upstream connections, all busy, "
                          f"this policy's limits.max_upstreams_per_connection; finish one or open another client connection")
                server.error = f"{Reason.TOO_MANY_CONNECTIONS.value}: {detail}"
                host, port = server.address
                self.audit.write(event="connect", client=peer(data.client), host=str(host), port=port, decision="refuse",
                                 reason=Reason.TOO_MANY_CONNECTIONS.value, detail=detail)
                return
        held[server.id] = server

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

    def client_disconnected(self, client: connection.Client) -> None:
        self._open.pop(client.id, None)

    def _used(self, client: connection.Client, server: connection.Server | None) -> None:
        held = self._open.get(client.id)
        if held is not None and server is not None and server.id in held:
            held.move_to_end(server.id)

    def _gone(self, client: connection.Client, server: connection.Server) -> None:
        held = self._open.get(client.id)
        if held is not None:
            held.pop(server.id, None)
