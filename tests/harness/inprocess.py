"""Sluice's addons in process, for hook tests: no proxy, no sockets.

`InProcess` wires the addons the way addons/sluice_addon.py's make_addons
does (the ones these tests drive, in the same order) under mitmproxy's own
test master (`mitmproxy.test.taddons`), and `hook(...)` runs one mitmproxy
hook through all of them with mitmproxy's own dispatch, as the proxy would.
An addon that raises fails the test (mitmproxy would only log it).

What stands in for the rest of the proxy:
- the policy source: a fixed policy and a static DNS table (`reload()`
  swaps the policy and tells the addons, as a SIGHUP does);
- the audit log: the real AuditLog, its lines kept in `lines`;
- mitmproxy's proxyserver: `connect()` gives each client connection a fake
  connection handler whose client socket records what is written to it and
  whether it was closed (addons/connections.py reaches them by client id);
  `dial()` runs mitmproxy's own (Sluice-patched) open_connection on it;
- the network: the event loop's `create_connection` is a `FakeNetwork`
  (`network`), so a dial reaches Sluice's dialer and stops there: nothing
  leaves the process, and each address can accept, hang or refuse;
- time: quotas take `clock` (a `Clock`); the event loop's timers (request
  and tunnel deadlines, the drain's wait) are advanced with
  `advance_loop(loop, seconds)`, never slept for.
"""

from __future__ import annotations

import asyncio
import errno
import logging
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterable
from types import SimpleNamespace
from typing import Any

from mitmproxy import connection, hooks, http
from mitmproxy.proxy import commands, events, mode_specs
from mitmproxy.proxy import server as server_layer
from mitmproxy.proxy.server_hooks import ClientConnectedHook, ClientDisconnectedHook, ServerConnectHook
from mitmproxy.test import taddons, tflow, tutils

from sluice import connstate
from sluice.addons import mitm_patches
from sluice.addons.audit import AuditLog
from sluice.addons.caps import Caps
from sluice.addons.conn_release import ConnRelease
from sluice.addons.connection_audit import ConnectionAudit
from sluice.addons.drain import Drain
from sluice.addons.gate import EgressGate
from sluice.addons.head_limits import HeadLimits
from sluice.addons.layer_choice import LayerChoice
from sluice.addons.quotas import Quotas
from sluice.addons.upgrades import UpgradeGuard
from sluice.addons.upstreams import Upstreams
from sluice.policy.loader import load_policy_text
from sluice.policy.model import Policy
from sluice.policy.quotas import MemoryCounters
from sluice.resolver import StaticResolver


class Clock:
    """A clock the test moves: quotas' `clock`, and the event loop's time (`advance_loop`)."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


async def advance_loop(seconds: float) -> None:
    """Move the running event loop's clock on by `seconds` and run what falls
    due (call_later timers), without waiting that long."""
    loop = asyncio.get_running_loop()
    offset = getattr(loop, "_sluice_offset", 0.0) + seconds
    if not hasattr(loop, "_sluice_offset"):
        real = loop.time
        loop.time = lambda: real() + loop._sluice_offset  # type: ignore[method-assign]
    loop._sluice_offset = offset  # type: ignore[attr-defined]
    for _ in range(3):  # timers that fall due, and what they schedule with call_soon
        await asyncio.sleep(0)


class ClientSocket:
    """The client side of a fake connection handler: what was written, and whether it was closed."""

    def __init__(self) -> None:
        self.sent = bytearray()
        self.closed = False
        self.transport = SimpleNamespace(abort=self.close)

    def write(self, data: bytes) -> None:
        assert not self.closed, "wrote to a closed client socket"
        self.sent += data

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed


class FakeHandler:
    """What addons/connections.py reaches for one client connection: its
    transports, its close, its watchdog; and, for `dial`, what mitmproxy's
    own `ConnectionHandler.open_connection` uses of its handler."""

    layer = None  # no layer stack: addons/connections.idle_http1_servers finds no idle upstream

    def __init__(self, client: connection.Client, hook: Callable[[hooks.Hook], Awaitable[None]] | None = None) -> None:
        self.client = client
        self.socket = ClientSocket()
        self.transports: dict[Any, Any] = {client: SimpleNamespace(writer=self.socket, handler=object())}
        self.closed: list[Any] = []
        self.timeout_watchdog = SimpleNamespace(timeout=None)
        self._hook = hook
        # What open_connection reads and writes on its handler:
        self.max_conns: defaultdict[Any, asyncio.Semaphore] = defaultdict(lambda: asyncio.Semaphore(5))
        self.logs: list[str] = []
        self.completed: dict[Any, str | None] = {}  # server -> its OpenConnectionCompleted error (None: connected)
        self.between: Callable[[Any], Awaitable[None]] | None = None
        self._done: dict[Any, asyncio.Event] = {}
        self._hung_up: dict[Any, asyncio.Event] = {}
        self._tasks: list[asyncio.Task[None]] = []

    def close_connection(self, conn: Any) -> None:
        self.closed.append(conn)
        io = self.transports.get(conn)
        if io is not None and io.writer is not None:
            io.writer.close()
        if conn in self._hung_up:
            self._hung_up[conn].set()

    # ---- mitmproxy's dial, with this handler as its `self` -------------------

    async def dial(self, server: connection.Server) -> str | None:
        """Open `server` the way mitmproxy does: its own (Sluice-patched)
        `ConnectionHandler.open_connection`, so the server_connect hooks run
        through the addons, then the dial goes through Sluice's dialer to
        the loop's `FakeNetwork`. Returns its error once the open completed
        (None: connected); a connected server stays open, its handler task
        running, until `close_connection(server)` or the test ends.
        `between`, if set, runs after the server_connect hooks and before
        the connect (what mitmproxy or an addon may do in between)."""
        self._done[server] = asyncio.Event()
        self._hung_up[server] = asyncio.Event()
        task = asyncio.ensure_future(server_layer.ConnectionHandler.open_connection(
            self, commands.OpenConnection(server)))  # type: ignore[arg-type]
        self._tasks.append(task)
        done = asyncio.ensure_future(self._done[server].wait())
        await asyncio.wait([task, done], return_when=asyncio.FIRST_COMPLETED)
        done.cancel()
        if task.done() and not self._done[server].is_set():
            task.result()  # it raised: an addon failed (the test fails with it)
        return self.completed[server]

    async def handle_hook(self, hook: hooks.Hook) -> None:
        if self._hook is not None:
            await self._hook(hook)
        if isinstance(hook, ServerConnectHook) and self.between is not None:
            await self.between(hook.data.server)

    def log(self, message: str, level: int = logging.INFO) -> None:
        self.logs.append(message)

    async def server_event(self, event: events.Event) -> None:
        if isinstance(event, events.OpenConnectionCompleted):
            server = event.command.connection
            self.completed[server] = event.reply
            self._done[server].set()

    async def handle_connection(self, conn: Any) -> None:
        await self._hung_up[conn].wait()  # until closed: then open_connection's finally runs server_disconnected

    async def finish(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


class FakeTransport(asyncio.Transport):
    """One accepted connection of the FakeNetwork: what was written to it,
    whether it was aborted; `reply`, if any, answers the first write."""

    def __init__(self, protocol: asyncio.BaseProtocol, peername: tuple[str, int], reply: bytes | None) -> None:
        super().__init__()
        self.protocol = protocol
        self.peername = peername
        self.reply = reply
        self.sent = bytearray()
        self.closing = self.aborted = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": self.peername, "sockname": ("192.0.2.1", 50000)}.get(name, default)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        assert not self.closing, "wrote to a closed upstream connection"
        self.sent += data
        if self.reply is not None:
            reply, self.reply = self.reply, None
            asyncio.get_running_loop().call_soon(self.protocol.data_received, reply)  # type: ignore[attr-defined]

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        if not self.closing:
            self.closing = True
            asyncio.get_running_loop().call_soon(self.protocol.connection_lost, None)

    def abort(self) -> None:
        self.aborted = True
        self.close()

    def can_write_eof(self) -> bool:
        return False

    def get_write_buffer_size(self) -> int:
        return 0

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


class Accept:
    """The FakeNetwork's answer for an address: the connection is accepted,
    its peer `peer` (default: the address dialled), its first write answered
    with `reply`."""

    def __init__(self, peer: tuple[str, int] | None = None, reply: bytes | None = None) -> None:
        self.peer, self.reply = peer, reply


BLACKHOLE = "blackhole"  # never answers: the connect waits until it is given up
REFUSE = "refuse"  # ECONNREFUSED


class FakeNetwork:
    """Every connection an in-process test opens, instead of a socket: the
    running loop's `create_connection` (what asyncio.open_connection calls)
    is this, so nothing reaches a network, loopback included. `answers`
    says what each (host, port) does (default: Accept()); `dialled` and
    `transports` record, in order, what was dialled and what it got."""

    def __init__(self) -> None:
        self.answers: dict[tuple[str, int], Accept | str] = {}
        self.dialled: list[tuple[str, int]] = []
        self.transports: list[FakeTransport] = []
        self._dialling: asyncio.Future[None] | None = None

    async def reached(self, count: int = 1) -> None:
        """Until `count` connects have begun (a dial got past its checks)."""
        while len(self.dialled) < count:
            self._dialling = asyncio.get_running_loop().create_future()
            await self._dialling

    async def create_connection(self, protocol_factory: Callable[[], asyncio.BaseProtocol], host: str, port: int,
                                **kwargs: Any) -> tuple[FakeTransport, asyncio.BaseProtocol]:
        self.dialled.append((host, port))
        if self._dialling is not None and not self._dialling.done():
            self._dialling.set_result(None)
        answer = self.answers.get((host, port), Accept())
        if answer == BLACKHOLE:
            await asyncio.Future()  # cancelled by the dial's timeout
        if answer == REFUSE:
            raise ConnectionRefusedError(errno.ECONNREFUSED, f"Connect call failed ('{host}', {port})")
        assert isinstance(answer, Accept)
        protocol = protocol_factory()
        transport = FakeTransport(protocol, answer.peer or (host, port), answer.reply)
        self.transports.append(transport)
        protocol.connection_made(transport)
        return transport, protocol


class FakeProxyserver:
    """mitmproxy's proxyserver addon as addons/connections.py and addons/drain.py see it."""

    name = "proxyserver"

    def __init__(self) -> None:
        self.connections: dict[str, FakeHandler] = {}
        self.servers: list[Any] = []


class PolicySourceStandIn:
    """The live policy and its resolver; `reload` tells the addons, as PolicySource does."""

    def __init__(self, policy: Policy, dns: dict[str, list[str]]) -> None:
        self.resolver = StaticResolver(dns)
        self.current = SimpleNamespace(policy=policy, resolver=self.resolver, generation=1)
        self.callbacks: list[Any] = []
        self.poll_seconds = 0

    def on_reload(self, callback: Any) -> None:
        self.callbacks.append(callback)

    def reload(self, policy: Policy) -> None:
        self.current = SimpleNamespace(policy=policy, resolver=self.resolver, generation=self.current.generation + 1)
        for callback in self.callbacks:
            callback(self.current)


def policy(text: str) -> Policy:
    return load_policy_text(text, "hooks.yaml")


class _AddonErrors(logging.Handler):
    """mitmproxy logs an addon's exception ("Addon error") and goes on; here it fails the test."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


class InProcess:
    def __init__(self, policy_text: str = "version: 1\n", dns: dict[str, list[str]] | None = None,
                 clock: Clock | None = None) -> None:
        self.lines: list[dict] = []
        self.audit = AuditLog()
        self.audit.write = lambda **record: self.lines.append(record)  # type: ignore[method-assign]
        self.source = PolicySourceStandIn(policy(policy_text), dns or {})
        self.clock = clock or Clock()
        self.counters = MemoryCounters()
        self.drained: list[bool] = []
        self.proxyserver = FakeProxyserver()
        self.connection_audit = ConnectionAudit(self.audit)
        self.release = ConnRelease(self.audit)
        self.caps = Caps(self.source, self.audit)
        self.gate = EgressGate(self.source, self.audit, self.caps)
        self.layer_choice = LayerChoice(self.audit)
        self.quotas = Quotas(self.source, self.audit, self.caps, self.gate, self.counters, clock=self.clock)
        self.upstreams = Upstreams(self.gate, self.audit)
        self.upgrades = UpgradeGuard(self.caps, self.source)
        self.head_limits = HeadLimits(self.source, self.audit)
        self.drain = Drain(self.caps, lambda: self.drained.append(True))
        self._clients: list[connection.Client] = []

    def addons(self) -> list[Any]:
        """make_addons' order (addons/sluice_addon.py), for the addons these tests drive."""
        return [self.proxyserver, self.connection_audit, self.release, self.gate, self.layer_choice, self.quotas,
                self.upstreams, self.upgrades, self.caps, self.head_limits, self.audit, self.drain]

    async def __aenter__(self) -> InProcess:
        self._saved = {name: getattr(mitm_patches.hooks, name) for name in mitm_patches.Hooks.__slots__}
        self._errors = _AddonErrors()
        logging.getLogger("mitmproxy.addonmanager").addHandler(self._errors)
        self._context = taddons.context(*self.addons())
        self._context.__enter__()
        self.master = self._context.master
        self.network = FakeNetwork()
        self._loop = asyncio.get_running_loop()
        self._loop.create_connection = self.network.create_connection  # type: ignore[method-assign,assignment]
        return self

    async def __aexit__(self, *exc: object) -> None:
        try:
            for handler in list(self.proxyserver.connections.values()):
                await handler.finish()
            for client in self._clients:
                connstate.pop(client)  # nothing a test left reaches the next one
        finally:
            del self._loop.create_connection  # the loop's own again
            self._context.__exit__(None, None, None)
            logging.getLogger("mitmproxy.addonmanager").removeHandler(self._errors)
            for name, value in self._saved.items():
                setattr(mitm_patches.hooks, name, value)

    async def hook(self, event: hooks.Hook) -> None:
        """One mitmproxy hook through every addon, in order, as the proxy dispatches it."""
        await self.master.addons.handle_lifecycle(event)
        if self._errors.records:
            record = self._errors.records[0]
            raise AssertionError(f"an addon failed in {event.name}: {record.getMessage()}") from (
                record.exc_info[1] if record.exc_info else None)

    async def connect(self, source: str = "192.0.2.10", port: int = 40000, mode: str = "regular",
                      head: bool = True) -> connection.Client:
        """A client connection accepted from `source`, with its (fake) handler.
        `head`: its first request head (or SOCKS5 handshake) arrives at once,
        as the HTTP/1 layer tells the head guard (tests/unit/test_layers_playbook.py
        drives that layer); else its header_timeout from accept runs."""
        client = tflow.tclient_conn()
        client.peername = (source, port)
        client.sockname = ("127.0.0.1", 8080)
        client.proxy_mode = mode_specs.ProxyMode.parse(mode)
        client.sni = None
        client.tls = False
        client.alpn = None
        self.proxyserver.connections[client.id] = FakeHandler(client, self.hook)
        self._clients.append(client)
        await self.hook(ClientConnectedHook(client))
        if head:
            self.head_limits.head_complete(client)
        return client

    async def disconnect(self, client: connection.Client) -> None:
        await self.hook(ClientDisconnectedHook(client))
        self.proxyserver.connections.pop(client.id, None)

    def handler(self, client: connection.Client) -> FakeHandler:
        return self.proxyserver.connections[client.id]

    async def dial(self, client: connection.Client, server: connection.Server) -> str | None:
        """`client`'s handler opens `server` as mitmproxy would (FakeHandler.dial)."""
        return await self.handler(client).dial(server)

    def reasons(self, event: str | None = None) -> list[str | None]:
        return [line.get("reason") for line in self.lines if event is None or line.get("event") == event]

    def held(self) -> list[Any]:
        """Every quota counter still held."""
        return [key for key, count in self.counters._counts.items() if count]


def lines_of(lines: Iterable[dict], event: str) -> list[dict]:
    return [line for line in lines if line.get("event") == event]


# ---- what the hook tests share ---------------------------------------------------------------


def in_process(policy_text: str, dns: dict[str, list[str]] | None = None, *, client: bool = True,
               **connect_args: Any) -> Callable[[Callable[..., Awaitable[None]]], Callable[[], None]]:
    """A hook test's set-up: the decorated `async def test_...(p, client)` runs
    under asyncio.run in a fresh InProcess(policy_text, dns) with one client
    connected (`connect_args` go to `InProcess.connect`); `client=False`:
    the body takes `p` alone and connects what it needs itself."""

    def decorate(body: Callable[..., Awaitable[None]]) -> Callable[[], None]:
        def test() -> None:
            async def run() -> None:
                async with InProcess(policy_text, dns) as p:
                    if client:
                        await body(p, await p.connect(**connect_args))
                    else:
                        await body(p)
            asyncio.run(run())

        # Not functools.wraps: pytest would follow __wrapped__ and take `p`
        # and `client` for fixtures.
        test.__name__, test.__qualname__ = body.__name__, body.__qualname__
        test.__module__, test.__doc__ = body.__module__, body.__doc__
        return test

    return decorate


def request_flow(client: connection.Client, host: str = "public.example", port: int = 80, method: bytes = b"GET",
                 path: bytes = b"/", content: bytes = b"", **headers: str) -> http.HTTPFlow:
    """An absolute-form request from `client` whose head has arrived: Host is
    `host`, then (with a `content`) its Content-Length, then `headers`
    (underscores for dashes), and nothing else."""
    req = tutils.treq(method=method, host=host, port=port, scheme=b"http", authority=f"{host}:{port}".encode(),
                      path=path, content=content)
    req.headers.clear()
    req.headers["Host"] = host
    if content:
        req.headers["Content-Length"] = str(len(content))
    for name, value in headers.items():
        req.headers[name.replace("_", "-")] = value
    return tflow.tflow(client_conn=client, req=req)


def connect_flow(client: connection.Client, host: str = "public.example", port: int = 443) -> http.HTTPFlow:
    """`CONNECT host:port` from `client`, its server connection naming that address."""
    flow = tflow.tflow(client_conn=client, req=tutils.treq(method=b"CONNECT", host=host, port=port, scheme=b"",
                                                           authority=f"{host}:{port}".encode(), path=b""))
    flow.server_conn.address = (host, port)
    return flow


def respond(flow: http.HTTPFlow, status: int = 200, **headers: str) -> None:
    """The origin's response head (its body is still to come): `headers` and nothing else."""
    flow.response = http.Response.make(status)
    flow.response.headers.clear()
    for name, value in headers.items():
        flow.response.headers[name.replace("_", "-")] = value


def answered(p: InProcess, client: connection.Client, status: int, reason: str) -> bool:
    """The client got Sluice's raw refusal on its socket (and nothing else)."""
    head = bytes(p.handler(client).socket.sent).split(b"\r\n\r\n", 1)[0]
    assert head.startswith(f"HTTP/1.1 {status} ".encode()), head
    assert f"\r\nSluice-Reason: {reason}\r\n".encode() in head and b"\r\nConnection: close" in head, head
    return True
