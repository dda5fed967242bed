"""What Sluice holds for one client connection, in one object.

Every addon that keeps something for a client connection keeps it in that
connection's `ConnState` (`state_of(client)`), never in a table of its own
keyed by `client.id`: who the client proved to be, the addresses the gate
approved and pinned for it, its open tunnels and upgraded pipes, its quota
slots, its deadlines, its upstream connections, its exchanges in flight and
the refusal its next mitmproxy error page becomes. One addon
(addons/conn_release.py) owns `client_disconnected` and releases all of it
in one place (`ConnState.release`), once.

The states are kept in a `weakref.WeakKeyDictionary` keyed by mitmproxy's
`connection.Client`, as mitmproxy's own addons/proxyauth.py keeps its
state: nothing here outlives the client object. The explicit release on
disconnect is what frees it at once, and releases what the state holds
outside itself (quota counters, timers).

Not an addon, and no mitmproxy imports beyond the types it names.
"""

from __future__ import annotations

import asyncio
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sluice.policy import quotas

if TYPE_CHECKING:
    from mitmproxy import connection, http

    from sluice.policy.model import Rules
    from sluice.policy.quotas import Counters
    from sluice.policy.reasons import Refusal


@dataclass(slots=True)
class QuotaSlots:
    """The quota counters one client connection holds (addons/quotas.py takes
    them; `release` gives every one back, once)."""

    counters: Counters | None = None  # where the slots were taken
    source: str | None = None  # its source group, fixed at accept (policy.quotas.source_group)
    total: bool = False  # counted in max_total_connections
    admitted: bool = False  # counted in its source's max_connections
    shared: bool = False  # counted in its source's share of max_total_connections
    identified: bool = False  # its first request checked max_connections
    tunnels: list[tuple] = field(default_factory=list)  # tunnel keys held
    connects: dict[str, tuple] = field(default_factory=dict)  # CONNECT (or WebSocket upgrade) flow id -> its tunnel key

    def release_connect(self, flow_id: str) -> None:
        """A CONNECT (or upgrade) whose tunnel never opened holds no tunnel slot."""
        tunnel = self.connects.pop(flow_id, None)
        if tunnel is not None:
            self.tunnels.remove(tunnel)
            self.counters.release(tunnel)

    def release(self) -> None:
        counters = self.counters
        if counters is None:
            return
        if self.total:
            counters.release(quotas.TOTAL_KEY)
        if self.shared:
            counters.release(quotas.source_slots_key(self.source))
        if self.admitted:
            counters.release(quotas.connection_key(self.source))
        for key in self.tunnels:
            counters.release(key)
        self.total = self.shared = self.admitted = False
        self.tunnels.clear()
        self.connects.clear()
        self.counters = None


@dataclass(slots=True, eq=False)
class ConnState:
    """One client connection's state. Addons change it through these fields
    and methods; each field says whose it is and why it is kept."""

    # identity (sluice/identity.py): the profile its SOCKS5 login matched, and the username
    socks_login: tuple[str | None, str] | None = None
    # the gate (addons/gate.py): (ip, port) -> the rules that approved it; the
    # dialer (sluice/dialer.py) admits nothing else
    approved: dict[tuple[str, int], Rules] = field(default_factory=dict)
    # the gate: tunnel server connection id -> the tunnel's outcome (its real host)
    tunnels: dict[str, Any] = field(default_factory=dict)
    # the upgrade guard (addons/upgrades.py): server id -> the accepted
    # upgrade's outcome until its pipe starts; then the open pipes
    accepted_upgrades: dict[str, Any] = field(default_factory=dict)
    pipes: list[Any] = field(default_factory=list)
    # the quotas (addons/quotas.py): slots held, and server id -> (tunnel
    # outcome, client key, limits) for tunnels metered once connected
    quota: QuotaSlots = field(default_factory=QuotaSlots)
    transfer_meters: dict[str, tuple] = field(default_factory=dict)
    # deadlines: the first request head's (or SOCKS5 handshake's) from accept
    # (addons/head_limits.py), and the tunnels' time caps (addons/caps.py)
    head_deadline: asyncio.TimerHandle | None = None
    tunnel_deadlines: list[asyncio.TimerHandle] = field(default_factory=list)
    # what its refusal will be: the connect-time refusal (timeout, no fd,
    # upstreams busy) its failing exchange is answered with (addons/caps.py)
    connect_refusal: Refusal | None = None
    # addons/connection_audit.py: the refusal its next mitmproxy error page
    # becomes; a bad-head refusal mitmproxy already answered, for the flow
    # that may follow; the proxy-loop refusal of its last dial (refusal, host, port)
    error_page: Refusal | None = None
    answered: Refusal | None = None
    loop: tuple[Refusal, str, int] | None = None
    # addons/upstreams.py: server id -> server, least recently used first
    upstreams: OrderedDict[str, connection.Server] = field(default_factory=OrderedDict)
    # addons/drain.py: flow id -> exchange in flight
    in_flight: dict[str, http.HTTPFlow] = field(default_factory=dict)
    released: bool = False

    def tunnel(self, server: connection.Server | None) -> Any:
        """The outcome of the tunnel this server connection carries, if any."""
        return self.tunnels.get(server.id) if server is not None else None

    def cancel_head_deadline(self) -> None:
        if self.head_deadline is not None:
            self.head_deadline.cancel()
            self.head_deadline = None

    def release(self) -> None:
        """Give back everything held outside this object (quota slots,
        timers) and forget the rest. Idempotent."""
        if self.released:
            return
        self.released = True
        self.cancel_head_deadline()
        for handle in self.tunnel_deadlines:
            handle.cancel()
        self.tunnel_deadlines.clear()
        self.quota.release()
        self.approved.clear()
        self.tunnels.clear()
        self.accepted_upgrades.clear()
        self.pipes.clear()
        self.transfer_meters.clear()
        self.upstreams.clear()
        self.in_flight.clear()
        self.socks_login = self.connect_refusal = self.error_page = self.answered = self.loop = None


_states: weakref.WeakKeyDictionary[connection.Client, ConnState] = weakref.WeakKeyDictionary()


def _dead() -> None:
    return None


# The last (client, state) looked up, the client held weakly: a request's
# hooks ask for the same connection's state about ten times in a row, and a
# WeakKeyDictionary lookup makes a weak reference and hashes the client's id
# each time. Always an entry of _states (pop() forgets it too).
_last: tuple[Callable[[], object], ConnState | None] = (_dead, None)


def state_of(client: connection.Client) -> ConnState:
    """This client connection's state, made on first use."""
    global _last
    state = peek(client)
    if state is None:
        state = _states[client] = ConnState()
        _last = (weakref.ref(client), state)
    return state


def peek(client: object) -> ConnState | None:
    """This client connection's state if it has one (never makes one: for
    readers, and for hooks that may run after the connection ended)."""
    global _last
    last_client, state = _last
    if last_client() is client and state is not None:
        return state
    try:
        state = _states.get(client)  # type: ignore[arg-type]
    except TypeError:  # not a Client (a test's stand-in): it has no state
        return None
    if state is not None:
        _last = (weakref.ref(client), state)
    return state


def pop(client: connection.Client) -> ConnState | None:
    """Remove this client connection's state (the one release on disconnect)."""
    global _last
    if _last[0]() is client:
        _last = (_dead, None)
    return _states.pop(client, None)


def states() -> Iterator[tuple[connection.Client, ConnState]]:
    """Every client connection with state (a snapshot: safe to change while iterating)."""
    return iter(list(_states.items()))


def open_tunnels() -> list[Any]:
    """Every open tunnel's outcome, over all client connections."""
    return [tunnel for _, state in states() for tunnel in state.tunnels.values()]


def open_pipes() -> list[Any]:
    """Every upgraded pipe's outcome, over all client connections."""
    return [pipe for _, state in states() for pipe in state.pipes]


def count() -> int:
    return len(_states)
