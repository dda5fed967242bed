"""Quotas: one runaway agent cannot starve the others (policy `limits`:
max_connections, max_total_connections, max_tunnels, requests_per_second
and burst, bytes_per_hour, max_requests_per_host_per_minute).

Runs right after the gate (addons/sluice_addon.py), on what the gate decided
and whom it identified: a request the gate allowed is counted against its
client (the proxy user once known, else the source address: policy.quotas)
and refused here when a limit says so. Every mode is covered:

- plain HTTP requests (`requestheaders`) and requests inside intercepted
  tunnels: transfer quota, request rate, per-host rate; a connection's first
  request is refused if its source is over `max_connections` (counted from
  accept with the top level's or source profile's value; a user profile's
  own value applies from that first request);
- CONNECT (`http_connect`): the same, plus `max_tunnels`; the CONNECT gets
  the 429 itself;
- SOCKS5 and transparent connections (`server_connect`, where the gate
  decided them): the same checks; a SOCKS5 client gets the refusal reply
  (REP 2), a transparent connection is closed;
- `max_total_connections` (unset: derived from the open-files limit,
  policy.quotas.default_total_connections) and each source's share of it
  (all but a reserve kept for other sources) are counted as connections are
  accepted (`client_connected`): over either the connection is closed
  before a byte is read, with an audit line.

- a WebSocket upgrade (`Upgrade: websocket`) on a plain HTTP connection
  takes a tunnel slot of its own (`max_tunnels`) before it goes upstream,
  held while its pipe is open; over the limit it gets the 429 and no 101.
  One inside an intercepted tunnel uses that tunnel's slot.

A refused request's own audit line names the limit (its outcome becomes the
refusal, so every addon after this one sees a refused request); a SOCKS5 or
transparent refusal and a connection closed at accept get a `connect` or
`connection` line written here.

Transfer (`bytes_per_hour`) is charged as bytes pass, never afterwards:
every body chunk of an HTTP exchange as it streams (the caps' body counter
calls the exchange's `TransferCharge`; a request body mitmproxy buffered
whole is charged before it goes upstream), every chunk of a WebSocket pipe
(addons/upgrades.py), and every byte of a raw tunnel at its server socket.
An intercepted tunnel is charged once, through its exchanges' bodies and
pipes, not also at its socket. When the quota runs out mid-way the exchange,
pipe or tunnel is cut there (`quota_exceeded` on its audit line), however
many are in flight at once: the overrun is at most the bytes of chunks
already passed, never streams x `max_response_bytes`. In report mode
(`action: report`) a limit that would refuse is recorded as `would_refuse`
and nothing is refused or cut (transfer is still counted).

Clients known by their address are counted by its `source_group` (an IPv6
address by its /64, `limits.ipv6_client_prefix`), fixed when the
connection is accepted; a per-host rate counts the host as the gate
canonicalised it (`Example.com.` and `example.com` are one host).

Without the policy's `state` the counters are per process
(policy.quotas.MemoryCounters): with `--workers N` or several replicas each
process enforces its own share, as docs/policy.md says. With `state.store`
they are shared (sluice/state_store.py); while that store is down, a limit
that needs it is counted here (`on_error: local`) or refused with
`state_store_unavailable` (`closed`, by the checks in policy.quotas).
"""

from __future__ import annotations

import asyncio
import contextvars
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import replace

from mitmproxy import connection, http
from mitmproxy.proxy import mode_specs
from mitmproxy.proxy.server_hooks import ServerConnectionHookData

from sluice import connstate
from sluice.addons import connections
from sluice.addons.audit import AuditLog, peer
from sluice.addons.caps import Caps
from sluice.failsafe import fail_closed
from sluice.addons.gate import SOCKS5_NOT_ALLOWED, EgressGate, tunnel_of
from sluice.addons.policy_source import PolicySource
from sluice.refusals import noted, refusal_response
from sluice.outcome import Outcome, outcome_of
from sluice.policy import quotas
from sluice.policy.clients import VIA_SOURCE, identify
from sluice.policy.model import Limits
from sluice.connstate import QuotaSlots
from sluice.policy.quotas import Counters, CountersUnavailable, MemoryCounters, source_group
from sluice.policy.state import StateSettings
from sluice.policy.reasons import Reason, Refusal



class TransferCharge:
    """One exchange's (or pipe's) bytes against its client's bytes_per_hour,
    charged chunk by chunk by whatever carries them: `charge(n)` says how
    many of `n` bytes may pass; fewer means the quota ran out, and the
    carrier cuts with `refusal()`. Not enforced (report mode): every byte is
    counted and passes."""

    __slots__ = ("counters", "key", "limits", "clock", "enforce")

    def __init__(self, counters: Counters, key: tuple, limits: Limits, clock: Callable[[], float], enforce: bool) -> None:
        self.counters, self.key, self.limits, self.clock, self.enforce = counters, key, limits, clock, enforce

    def __call__(self, n: int) -> int:
        limit = self.limits.bytes_per_hour if self.enforce else None
        granted = self.counters.spend(quotas.bytes_key(self.key), n, limit, quotas.HOUR, self.clock())
        return granted if self.enforce else n

    def refusal(self) -> Refusal:
        _, resets_in = self.counters.spent(quotas.bytes_key(self.key), quotas.HOUR, self.clock())
        return quotas.transfer_refusal(self.limits, resets_in, cut=True)

    async def whole(self, n: int) -> Refusal | None:
        """A body of `n` bytes that goes whole or not at all (one mitmproxy
        read whole): charged if it fits, else its refusal, charging nothing."""
        if self.enforce:
            try:
                used, resets_in = await self.counters.window(quotas.bytes_key(self.key), quotas.HOUR, self.clock())
            except CountersUnavailable:  # the store went down since its head was admitted (on_error: closed)
                return quotas.store_down_refusal("bytes_per_hour")
            if used + n > self.limits.bytes_per_hour:
                return quotas.upload_refusal(self.limits, n, used, resets_in)
        self(n)
        return None


class Quotas:
    def __init__(self, source: PolicySource, audit: AuditLog, caps: Caps, gate: EgressGate,
                 counters: Counters | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.source = source
        self.audit = audit
        self.caps = caps
        self.gate = gate
        self.counters: Counters = counters if counters is not None else MemoryCounters()
        self.clock = clock
        # Per client connection, in its ConnState (sluice/connstate.py): the
        # slots it holds (`quota`, released with the state on disconnect by
        # addons/conn_release.py), and `transfer_meters`, server id ->
        # (tunnel outcome, client key, limits) for tunnels whose bytes count
        # against a transfer quota, metered by the dialer (sluice/dialer.py) once
        # connected, outside the caps' meter.
        gate.dialer.meter_sources.append(self._tunnel_meter)
        # The policy's `state` (policy/state.py): None counts in this process.
        self.state: StateSettings | None = None
        source.on_reload(lambda live: self.use_state(live.policy.state))

    # ---- where counting happens ------------------------------------------------

    def running(self) -> None:
        live = self.source.current
        self.use_state(live.policy.state if live is not None else None)

    def done(self) -> None:
        self.use_state(None)

    def use_state(self, settings: StateSettings | None) -> None:
        """Count through the store `settings` names (None: in this process).
        A change reconnects: counters start empty in the new store, and each
        slot already held goes back to the counters it was taken from."""
        if settings == self.state:
            return
        from sluice.state_store import StoreCounters

        if (settings is not None and self.state is not None and isinstance(self.counters, StoreCounters)
                and replace(settings, on_error=self.state.on_error) == self.state):
            # Only on_error changed: the same store, its counts kept.
            self.state = self.counters.settings = settings
            return

        old, self.state = self.counters, settings
        if settings is None:
            self.counters = MemoryCounters()
            self.gate.identity.store = None
        else:
            store = StoreCounters(settings, self._store_status)
            self.counters = store
            self.gate.identity.store = store  # login throttles are shared on it too
            _spawn(store.start())
            self.audit.write(event="state_store", decision="connect", detail=f"counting through {settings.where}")
        if isinstance(old, StoreCounters):
            _spawn(old.close())

    def _store_status(self, up: bool, line: str) -> None:
        """The store went down or came back: one stderr line, one audit line
        (the metrics addon sets sluice_state_store_up from it)."""
        print(line, file=sys.stderr, flush=True)
        self.audit.write(event="state_store", decision="up" if up else "down", detail=line.removeprefix("sluice: "))

    # ---- connections ---------------------------------------------------------

    async def client_connected(self, client: connection.Client) -> None:
        live = self.source.current
        state = connstate.state_of(client).quota
        state.counters, state.source = self.counters, _source_group(client, live)
        limit, derived = _total_limit(live)
        why = await quotas.admit_total(self.counters, limit)
        if why is None:
            state.total = True
            why = await self._accept(client, state, live, limit)
            if why is None:
                return
        elif derived:
            why += f" (max_total_connections is not set: {limit} is derived from the proxy's open-files limit)"
        self.audit.write(event="connection", client=peer(client), decision="refuse",
                         reason=Reason.TOO_MANY_CONNECTIONS.value, detail=why)
        client.error = f"{Reason.TOO_MANY_CONNECTIONS.value}: {why}"  # mitmproxy closes it before reading

    async def _accept(self, client: connection.Client, state: QuotaSlots, live, total: int) -> str | None:
        """A connection admitted under max_total_connections: it takes a slot
        of its source's share (closed now if the share is full), and counts
        against its source's max_connections from now on, with the value of
        the top level or of the profile its source address matches (a user
        profile's own value is checked at its first request). One over
        max_connections stays open only to have its first request refused."""
        why = await quotas.admit_source_share(self.counters, total, state.source)
        if why is not None:
            return why
        state.shared = True
        # Refused here (over max_connections, or its shared store down with
        # on_error: closed), it is not counted: its first request is checked.
        admitted = live is not None and await quotas.admit_connection(
            self.counters, _accept_limits(live, client), state.source) is None
        if admitted:
            if state.counters is None:  # the client left while the store answered
                self.counters.release(quotas.connection_key(state.source))
            else:
                state.admitted = True
        return None

    async def _admit_connection(self, client: connection.Client, limits: Limits) -> Refusal | None:
        state = _slots(client)
        if state is None or state.identified:
            return None
        state.identified = True  # its first request (or dial): checked once
        counters = state.counters  # where this connection's slots are (a reload may have changed the store)
        if state.admitted:  # counted at accept; a user profile may set a lower max_connections
            return await quotas.over_connections(counters, limits, state.source)
        refusal = await quotas.admit_connection(counters, limits, state.source)
        if refusal is None:
            if state.counters is None:  # the client left while the store answered
                counters.release(quotas.connection_key(state.source))
            else:
                state.admitted = True
        return refusal

    async def _admit_tunnel(self, client: connection.Client, key: tuple, limits: Limits,
                            connect_id: str | None = None) -> Refusal | None:
        held = _slots(client)
        counters = held.counters if held is not None else self.counters
        refusal = await quotas.admit_tunnel(counters, limits, key)
        if refusal is None:
            tunnel = quotas.tunnel_key(key)
            state = _slots(client)  # again: the client may have left while the store answered
            if state is None:  # not seen connecting, or gone: hold nothing
                counters.release(tunnel)
            else:
                state.tunnels.append(tunnel)
                if connect_id is not None:
                    state.connects[connect_id] = tunnel
        return refusal

    # ---- HTTP requests and CONNECT ---------------------------------------------

    @fail_closed()
    async def requestheaders(self, flow: http.HTTPFlow) -> None:
        if flow.response is not None or flow.request.method == "CONNECT":
            return
        outcome = outcome_of(flow)
        if outcome is None or outcome.rules is None or not outcome.decision.allowed:
            return
        limits = outcome.rules.limits
        inside = tunnel_of(flow.client_conn, flow.server_conn) is not None  # its tunnel's connection was counted
        refusal = None if inside else await self._admit_connection(flow.client_conn, limits)
        key = self._client(outcome, flow.client_conn)
        if refusal is None:
            refusal = await quotas.check_request(self.counters, limits, key, _host(outcome), self.clock())
        if (refusal is None and not inside and outcome.rules.action != "report"
                and _upgrade_tokens(flow.request.headers.get("upgrade", "")) == {"websocket"}):
            # Its pipe is a tunnel of its own, counted before the upgrade goes
            # upstream (so over the limit no 101 is ever sent).
            refusal = await self._admit_tunnel(flow.client_conn, key, limits, flow.id)
        if refusal is not None:
            self._refuse_flow(flow, outcome, refusal)
        elif limits.bytes_per_hour is not None:
            outcome.transfer = TransferCharge(self.counters, key, limits, self.clock, outcome.rules.action != "report")

    @fail_closed()
    async def http_connect(self, flow: http.HTTPFlow) -> None:
        if flow.response is not None:
            return
        outcome = outcome_of(flow)
        if outcome is None or outcome.rules is None or not outcome.decision.allowed:
            return
        limits = outcome.rules.limits
        key = self._client(outcome, flow.client_conn)
        refusal = await self._admit_connection(flow.client_conn, limits)
        if refusal is None:
            refusal = await quotas.check_request(self.counters, limits, key, _host(outcome), self.clock())
        if refusal is None and outcome.rules.action != "report":
            refusal = await self._admit_tunnel(flow.client_conn, key, limits, flow.id)
        if refusal is not None:
            self._refuse_flow(flow, outcome, refusal)
        elif limits.bytes_per_hour is not None and not outcome.intercept:
            self._meter_later(flow.client_conn, flow.server_conn, outcome, key, limits)

    def http_connect_error(self, flow: http.HTTPFlow) -> None:
        """A CONNECT that failed (or was refused after this addon): its
        tunnel never opened, so it holds no tunnel slot."""
        self._release_slot(flow)

    def _release_slot(self, flow: http.HTTPFlow) -> None:
        state = _slots(flow.client_conn)
        if state is not None:
            state.release_connect(flow.id)

    def _refuse_flow(self, flow: http.HTTPFlow, outcome: Outcome, refusal: Refusal) -> None:
        if not outcome.refuse(refusal, report=outcome.rules is not None and outcome.rules.action == "report"):
            return
        response = refusal_response(noted(flow, refusal))
        if refusal.reason is Reason.TOO_MANY_CONNECTIONS and not (flow.request.is_http2 or flow.request.is_http3):
            response.headers["Connection"] = "close"  # the extra connection itself is refused
        flow.response = response

    # ---- HTTP transfer ---------------------------------------------------------

    @fail_closed()
    async def request(self, flow: http.HTTPFlow) -> None:
        """A request body mitmproxy read whole (it had a Content-Length) is
        charged before it goes upstream; one that does not fit is refused,
        never sent, and not charged (no byte of it passed). (Streamed bodies
        were charged chunk by chunk.)"""
        outcome = outcome_of(flow)
        charge = outcome.transfer if outcome is not None else None
        if charge is None or flow.response is not None or flow.request.stream or not outcome.decision.allowed:
            return
        n = len(flow.request.raw_content or b"")
        refusal = await charge.whole(n) if n else None
        if refusal is not None:
            outcome.transfer = None
            self._refuse_flow(flow, outcome, refusal)

    def response(self, flow: http.HTTPFlow) -> None:
        if flow.request.method != "CONNECT" and flow.response.status_code != 101:
            self._release_slot(flow)  # an upgrade refused (or not answered with a pipe) holds no tunnel

    def error(self, flow: http.HTTPFlow) -> None:
        if flow.request.method != "CONNECT" and (flow.response is None or flow.response.status_code != 101):
            self._release_slot(flow)

    # ---- SOCKS5 and transparent: decided at the dial ------------------------------

    @fail_closed()
    async def server_connect(self, data: ServerConnectionHookData) -> None:
        server = data.server
        if server.error or server.address is None:
            return
        tunnel = tunnel_of(data.client, server)
        if tunnel is None or tunnel.connect_id is not None or tunnel.rules is None or tunnel.logged:
            return  # not a SOCKS5 or transparent tunnel the gate just allowed
        limits = tunnel.rules.limits
        key = self._client(tunnel, data.client)
        refusal = await self._admit_connection(data.client, limits)
        if refusal is None:
            refusal = await quotas.check_request(self.counters, limits, key, _host(tunnel), self.clock())
        if refusal is None and tunnel.rules.action != "report":
            refusal = await self._admit_tunnel(data.client, key, limits)
        if refusal is None:
            if limits.bytes_per_hour is not None and not tunnel.intercept:
                self._meter_later(data.client, server, tunnel, key, limits)
            return
        refusal = refusal.with_note(tunnel.rules.refusal_note) if tunnel.rules.action != "report" else refusal
        if not tunnel.refuse(refusal, report=tunnel.rules.action == "report"):
            return
        tunnel.logged = True  # this line is the tunnel's only one
        server.error = f"{refusal.reason.value}: {refusal.message}"
        host, port = server.address
        self.audit.write(event="connect", client=peer(data.client), user=tunnel.user, profile=tunnel.profile,
                         host=tunnel.host, port=port, address=str(host), decision="refuse",
                         reason=refusal.reason.value, detail=refusal.detail)
        if isinstance(data.client.proxy_mode, mode_specs.Socks5Mode):
            # "Connection not allowed by ruleset", as the gate answers its own refusals.
            connections.write_to_client(data.client, SOCKS5_NOT_ALLOWED)
            connections.shut_client_writer(data.client)

    # ---- tunnels' transfer -------------------------------------------------------

    def _meter_later(self, client: connection.Client, server: connection.Server, outcome: Outcome, key: tuple, limits: Limits) -> None:
        connstate.state_of(client).transfer_meters[server.id] = (outcome, key, limits)

    def _tunnel_meter(self, client: connection.Client, server: connection.Server):
        """The dialer's meter for a tunnel under a transfer quota (None: not one)."""
        state = connstate.peek(client)
        entry = state.transfer_meters.pop(server.id, None) if state is not None else None
        if entry is None:
            return None
        outcome, key, limits = entry
        meter = quotas.TransferMeter(self.counters, key, limits.bytes_per_hour)
        clock, loop = self.clock, asyncio.get_running_loop()

        def count(from_client: bool, n: int) -> int:
            if outcome.cap is not None:
                return 0
            granted = meter(n, clock())
            if granted < n:
                if not from_client:
                    # The caps' meter beneath this one counted the whole chunk
                    # read from the origin; only `granted` reaches the client.
                    outcome.bytes_from_server -= n - granted
                _, resets_in = self.counters.spent(quotas.bytes_key(key), quotas.HOUR, clock())
                loop.call_soon(self.caps.cut_tunnel, client, outcome, quotas.transfer_refusal(limits, resets_in, cut=True))
            return granted

        return count

    def server_connect_error(self, data: ServerConnectionHookData) -> None:
        state = connstate.peek(data.client)
        if state is not None:
            state.transfer_meters.pop(data.server.id, None)

    # ---- who -----------------------------------------------------------------

    def _client(self, outcome: Outcome, client: connection.Client) -> tuple:
        state = _slots(client)
        source = state.source if state is not None else _source_group(client, self.source.current)
        return quotas.client_key(outcome.profile, outcome.user, source)


def _slots(client: connection.Client) -> QuotaSlots | None:
    """The slots this client connection holds, if it was seen connecting."""
    state = connstate.peek(client)
    return state.quota if state is not None and state.quota.counters is not None else None


_background: set[asyncio.Task] = set()


def _spawn(step) -> None:
    try:
        # An empty context: the store is dialled directly, never through the dialer
        task = asyncio.get_running_loop().create_task(step, context=contextvars.Context())
    except RuntimeError:  # no loop (a unit test's synchronous setup): nothing to connect with yet
        step.close()
        return
    _background.add(task)
    task.add_done_callback(_background.discard)


def _host(outcome: Outcome) -> str:
    """The host a per-host rate counts: as the gate canonicalised it
    (lowercase, no trailing dot, IP literals in canonical text)."""
    host = outcome.decision.host
    return str(host) if host is not None else outcome.host


def _upgrade_tokens(value: str) -> set[str]:
    return {t.strip().lower() for t in value.split(",") if t.strip()}


def _total_limit(live) -> tuple[int, bool]:
    """max_total_connections, or (unset) the one the open-files limit holds; and whether derived."""
    configured = live.policy.rules.limits.max_total_connections if live is not None else None
    if configured is not None:
        return configured, False
    return quotas.default_total_connections(resource.getrlimit(resource.RLIMIT_NOFILE)[0]), True


def _accept_limits(live, client: connection.Client) -> Limits:
    """The limits known at accept: the profile the source address matches, else the top level."""
    return identify(live.policy, _source(client), via=VIA_SOURCE).rules.limits


def _source_group(client: connection.Client, live) -> str | None:
    prefix = live.policy.rules.limits.ipv6_client_prefix if live is not None else Limits().ipv6_client_prefix
    return source_group(_source(client), prefix)


def _source(client: connection.Client) -> str | None:
    source = client.peername[0] if client.peername else None
    if source and source.startswith("::ffff:"):
        source = source[7:]  # dual-stack sockets report IPv4 clients as mapped
    return source
