"""Graceful drain: SIGTERM (or SIGINT) stops the proxy without cutting live work.

On the first signal the proxy stops accepting (its listeners close; with
`--workers` the kernel stops handing this process connections), /readyz
says 503 `draining`, and the exchanges and tunnels in flight get up to
`--drain-timeout` seconds to finish. Whatever is still open then is cut:
an HTTP exchange whose response has not started is answered 503 with
`Sluice-Reason: shutdown`, anything else is closed, and each gets its audit
line with the reason `shutdown` (through the caps' own cut, so the line is
written once, as for any cap). Idle keep-alive connections and intercepted
tunnels with no request in flight are simply closed. Then the proxy exits 0.
A second signal during the drain cuts everything at once.

"In flight" is an HTTP exchange whose request head arrived and whose
response has not ended (inside an intercepted tunnel too), a tunnel
carried as raw bytes (CONNECT not intercepted, SOCKS5, transparent), or an
upgraded WebSocket pipe (ws:// or wss:// inside an intercepted tunnel),
which is drained exactly like a raw tunnel.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Callable

from mitmproxy import ctx, http

from sluice import connstate
from sluice.addons import connections
from sluice.outcome import outcome_of
from sluice.policy.reasons import SHUTDOWN_ADVICE, Reason, Refusal

logger = logging.getLogger("sluice.drain")
POLL_SECONDS = 0.05


class Drain:
    def __init__(self, caps, on_drain: Callable[[], None] | None = None) -> None:
        self.caps = caps
        self.on_drain = on_drain  # told when the drain starts (Status: /readyz turns 503)
        self.timeout = 30.0
        # The exchanges in flight are in each client connection's ConnState
        # (`in_flight`, sluice/connstate.py), its tunnels and pipes too.
        self._task: asyncio.Task | None = None
        self._now = asyncio.Event()

    # ---- what is in flight ---------------------------------------------------

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        if flow.request.method != "CONNECT":
            connstate.state_of(flow.client_conn).in_flight[flow.id] = flow

    def response(self, flow: http.HTTPFlow) -> None:
        self._done(flow)

    def error(self, flow: http.HTTPFlow) -> None:
        self._done(flow)

    def _done(self, flow: http.HTTPFlow) -> None:
        state = connstate.peek(flow.client_conn)
        if state is not None:
            state.in_flight.pop(flow.id, None)

    def _open_tunnels(self) -> list:
        """Raw tunnels and upgraded (WebSocket) pipes: both carry bytes no
        request hook sees, so both get the drain timeout and, if still open
        then, a `shutdown` line (a pipe is not an exchange in flight once
        its 101 has gone out)."""
        return [v for v in [*connstate.open_tunnels(), *connstate.open_pipes()]
                if not v.logged and v.cap is None and v.client is not None and not v.intercept]

    def in_flight(self) -> int:
        return sum(len(state.in_flight) for _, state in connstate.states()) + len(self._open_tunnels())

    # ---- the signal ------------------------------------------------------------

    def signal(self) -> None:
        """SIGTERM/SIGINT: start draining; during a drain, cut everything now."""
        if self._task is None:
            self._task = asyncio.ensure_future(self._drain())
        else:
            self._now.set()

    async def _drain(self) -> None:
        # The event loop's clock, which its waits run on too (monotonic; a
        # test moves it on instead of sleeping through the drain timeout).
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            if self.on_drain is not None:
                self.on_drain()
            proxyserver = ctx.master.addons.get("proxyserver")
            for instance in list(proxyserver.servers):
                try:
                    await instance.stop()
                except Exception as e:  # a listener that will not close must not stop the drain
                    logger.warning(f"sluice: closing the {instance.mode.description} failed: {e}")
            waiting = self.in_flight()
            print(f"sluice: stopping: no new connections; waiting up to {self.timeout:g}s for {waiting} "
                  f"exchange(s) and tunnel(s) in flight (signal again to stop at once)", file=sys.stderr, flush=True)
            deadline = started + self.timeout
            while self.in_flight() and loop.time() < deadline and not self._now.is_set():
                try:
                    await asyncio.wait_for(self._now.wait(), timeout=POLL_SECONDS)
                except TimeoutError:
                    pass
            cut = self.cut_all()
            for handler in list(proxyserver.connections.values()):
                connections.close_client(handler.client)
            await asyncio.sleep(0)  # let the closed connections' hooks run
            print(f"sluice: stopped after {loop.time() - started:.1f}s ({cut} cut by shutdown)",
                  file=sys.stderr, flush=True)
        except Exception:
            logger.exception("sluice: the drain failed; stopping")
        finally:
            ctx.master.shutdown()

    def cut_all(self) -> int:
        """Cut what is still in flight, each with its `shutdown` audit line."""
        refusal = Refusal(Reason.SHUTDOWN,
                          f"the proxy shut down before this finished (drain timeout {self.timeout:g}s)",
                          advice=SHUTDOWN_ADVICE)
        cut = 0
        flows = [f for _, state in connstate.states() for f in list(state.in_flight.values())]
        for _, state in connstate.states():
            state.in_flight.clear()
        for flow in flows:
            outcome = outcome_of(flow)
            if outcome is not None and outcome.cap is None and not outcome.logged:
                self.caps.cut(flow, refusal)
                cut += 1
            else:
                connections.close_client(flow.client_conn)
        for outcome in self._open_tunnels():
            self.caps.cut_tunnel(outcome.client, outcome, refusal)
            cut += 1
        return cut
