"""The request head: its caps, and `Expect: 100-continue` on refused requests.

- Caps. mitmproxy runs no hook before a request head is complete, so
  addons/mitm_patches.py reads the head and asks this addon (its head guard)
  for the limits and for the refusal: 431 `request_headers_too_large` past
  `limits.max_header_bytes` or `limits.max_header_count`, 408
  `header_timeout` when a head takes longer than `limits.header_timeout` from
  its first byte (however the client dribbles it), and 408 (or, on the
  SOCKS5 port, a close) when a new connection's first head or SOCKS5
  handshake is not complete within `limits.header_timeout` of its accept (an
  idle connection holds a slot no longer than that). The connection is closed
  (here too, not only by mitmproxy: see `refuse_head`) and one audit line
  written. The limits are the policy's top level (read
  live, so a reload applies to the next read): the client's identity is in
  the very head being read.
- Expect. mitmproxy sends `100 Continue` after the `requestheaders` hook
  whenever the request still says `Expect: 100-continue`, even when an
  addon refused it there. This addon runs after every deciding addon: on a
  refused request it drops the header, and on a plain HTTP/1 connection with
  a body still to come it sends the refusal at once and closes (the client
  never sends the body). In an intercepted (TLS) tunnel the refusal follows
  once the client sends the body, as for any refused request.
"""

from __future__ import annotations

import asyncio

from mitmproxy import connection, http
from mitmproxy.net.http import http1
from mitmproxy.proxy import mode_specs

from sluice import connstate
from sluice.addons import connections, mitm_patches
from sluice.addons.audit import AuditLog, peer
from sluice.addons.policy_source import PolicySource
from sluice.refusals import refusal_bytes
from sluice.policy.model import Limits
from sluice.policy.reasons import Reason, Refusal
from sluice.policy.units import size_text


def head_refusal(problem: str, limits: Limits) -> Refusal:
    if problem == mitm_patches.HEAD_TIMEOUT:
        return Refusal(Reason.HEADER_TIMEOUT,
                       f"the request head did not arrive whole within this proxy's {limits.header_timeout:g}s "
                                              "(limits.header_timeout); send the request line and headers at once")
    if problem == mitm_patches.TOO_MANY_FIELDS:
        return Refusal(Reason.HEADERS_TOO_LARGE,
                       f"the request has more than this proxy's {limits.max_header_count} header fields "
                                                 "(limits.max_header_count); send fewer headers")
    if problem == mitm_patches.PIPELINED_TOO_MUCH:
        return Refusal(Reason.HEADERS_TOO_LARGE,
                       f"the client sent more than {size_text(limits.max_header_bytes)} of further requests "
                                                 "while a response was pending (limits.max_header_bytes); wait for "
                                                 "each response")
    return Refusal(Reason.HEADERS_TOO_LARGE,
                   f"the request head is over this proxy's {size_text(limits.max_header_bytes)} cap "
                                             "(limits.max_header_bytes); send fewer or smaller headers")


class HeadLimits:
    def __init__(self, source: PolicySource, audit: AuditLog) -> None:
        self.source = source
        self.audit = audit
        # The deadline for each client connection's first request head or
        # SOCKS5 handshake is its ConnState's `head_deadline` (sluice/connstate.py).

    def load(self, loader) -> None:
        mitm_patches.set_head_guard(self)

    def done(self) -> None:
        if mitm_patches.head_guard() is self:
            mitm_patches.set_head_guard(None)

    # ---- the head guard (called by mitm_patches, inside mitmproxy's layers) --

    def head_limits(self) -> Limits:
        live = self.source.current
        return live.policy.rules.limits if live is not None else Limits()

    def refuse_head(self, client: connection.Client, problem: str, limits: Limits) -> bytes:
        refusal = head_refusal(problem, limits)
        answered = problem != mitm_patches.PIPELINED_TOO_MUCH  # mid-response: nothing can be sent
        self.audit.write(
            event="request", client=peer(client), decision="refuse", reason=refusal.reason.value,
            status=refusal.status if answered else None, detail=refusal.detail,
        )
        # mitmproxy closes the connection on our CloseConnection only once its
        # reader waits for data; a client still streaming bytes can make that
        # cancellation land elsewhere and leave the socket open. Close it here,
        # after the answer (written in this same event) is on its way.
        asyncio.get_running_loop().call_soon(connections.close_client, client)
        if not answered:
            return b""
        return refusal_bytes(refusal)

    def head_complete(self, client: connection.Client) -> None:
        state = connstate.peek(client)
        if state is not None:
            state.cancel_head_deadline()

    # ---- the first request head or SOCKS5 handshake, from accept --------------

    def client_connected(self, client: connection.Client) -> None:
        if client.error or not isinstance(client.proxy_mode, (mode_specs.RegularMode, mode_specs.Socks5Mode)):
            return  # refused at accept, or transparent (its destination is known already)
        limits = self.head_limits()
        connstate.state_of(client).head_deadline = asyncio.get_running_loop().call_later(
            limits.header_timeout, self._first_deadline_expired, client, limits.header_timeout)

    def _first_deadline_expired(self, client: connection.Client, seconds: float) -> None:
        state = connstate.peek(client)
        if state is not None:
            state.head_deadline = None
        socks = isinstance(client.proxy_mode, mode_specs.Socks5Mode)
        if socks and connections.destination_named(client):
            return  # the handshake named a destination: done
        if socks:
            detail = (f"the SOCKS5 handshake did not complete within this proxy's {seconds:g}s of connecting "
                      "(limits.header_timeout); send the greeting and the CONNECT request at once")
        else:
            detail = (f"no request head arrived whole within this proxy's {seconds:g}s of connecting "
                      "(limits.header_timeout); send the request as soon as the connection opens")
        refusal = Refusal(Reason.HEADER_TIMEOUT, detail)
        answered = not socks and connections.write_to_client(client, refusal_bytes(refusal))
        self.audit.write(event="connection", client=peer(client), decision="refuse", reason=refusal.reason.value,
                         status=refusal.status if answered else None, detail=refusal.detail)
        connections.close_client(client)

    # ---- Expect: 100-continue ------------------------------------------------

    def requestheaders(self, flow: http.HTTPFlow) -> None:
        if flow.response is None or "expect" not in flow.request.headers:
            return
        del flow.request.headers["expect"]  # so mitmproxy sends no `100 Continue`
        plain_http1 = flow.request.http_version.startswith("HTTP/1") and not flow.client_conn.tls
        if plain_http1 and _body_pending(flow.request) and flow.killable:
            flow.response.headers["Connection"] = "close"
            connections.write_to_client(flow.client_conn, http1.assemble_response(flow.response))
            flow.kill()


def _body_pending(request: http.Request) -> bool:
    try:
        return http1.expected_http_body_size(request) != 0
    except ValueError:
        return True
