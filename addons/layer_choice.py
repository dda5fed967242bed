"""What runs on each client connection and inside each tunnel: mitmproxy's
NextLayer addon, subclassed, so Sluice's choice is made before any layer is
built. A layer adds itself to the stack when constructed, and a TLS layer
marks its connection as TLS (`Client.tls`, `Server.tls`) as it is
constructed: building mitmproxy's choice and swapping it afterwards would
leave that mark on a raw tunnel.

- the front door (nothing below but the HTTP proxy mode) is plain HTTP/1;
  TLS to the proxy itself is refused (`client_protocol_refused`);
- a tunnel the policy does not intercept is raw TCP, never decrypted: a
  tunnel the gate decided is spliced (sluice/splice.py), anything else is
  mitmproxy's TCP layer without a flow or per-chunk hooks;
- an intercepted tunnel is TLS (mitmproxy's own TLS layers) and then HTTP,
  never raw, whatever its first bytes look like.
Everything else (UDP, the front door's plain HTTP, SOCKS5's and transparent
mode's first layer) is mitmproxy's own choice.

`sluice proxy` installs LayerChoice in place of mitmproxy's NextLayer (it is
in make_addons' list, and sluice/proxy.py leaves mitmproxy's out). Under
`mitmdump -s addons/sluice_addon.py` mitmdump's master already holds
mitmproxy's, under the same addon name, so `TakeOverNextLayer` swaps it in
when the script loads (docs/mitmproxy-patches.md, Layer choice).
"""

from __future__ import annotations

from mitmproxy import ctx, hooks
from mitmproxy.addons import next_layer
from mitmproxy.net.tls import starts_like_tls_record
from mitmproxy.proxy import commands, events, layer, layers
from mitmproxy.proxy.context import Context
from mitmproxy.proxy.layers import modes
from mitmproxy.proxy.layers.http import HTTPMode

from sluice.addons.audit import AuditLog, peer
from sluice.addons.gate import tunnel_of
from sluice.policy.reasons import Reason
from sluice.splice import SplicedTunnel

# The mode layers a client connection starts with when its first bytes are
# HTTP to the proxy itself.
FRONT_DOORS = (modes.HttpProxy, modes.HttpUpstreamProxy, modes.ReverseProxy)

TLS_TO_THE_PROXY = ("the client spoke TLS to the proxy itself; Sluice's proxy port is plain HTTP "
                    "(set HTTP_PROXY/HTTPS_PROXY to http://host:port; HTTPS still goes through CONNECT)")


class LayerChoice(next_layer.NextLayer):
    # mitmproxy's own name for this addon: its proxyserver warns when no
    # addon of that name is loaded, and this one stands in for mitmproxy's.
    name = "nextlayer"

    def __init__(self, audit: AuditLog) -> None:
        self.audit = audit

    def _next_layer(self, context: Context, data_client: bytes, data_server: bytes) -> layer.Layer | None:
        # NextLayer has taken itself off the stack: context.layers are the
        # layers below the one chosen here, and nothing is built yet.
        below = context.layers
        if context.client.transport_protocol != "tcp" or not below:
            return super()._next_layer(context, data_client, data_server)
        if len(below) == 1 and isinstance(below[0], FRONT_DOORS):
            if data_client[:1] == b"\x16" or starts_like_tls_record(data_client):
                self.audit.write(event="connection", client=peer(context.client), decision="refuse",
                                 reason=Reason.CLIENT_PROTOCOL_REFUSED.value, detail=TLS_TO_THE_PROXY)
                return _RefuseClient(context)
            return super()._next_layer(context, data_client, data_server)  # plain HTTP/1
        tunnel = tunnel_of(context.client, context.server)
        if tunnel is None or not tunnel.intercept:
            # No TCP flow and no per-chunk hooks (mitmproxy's tunnel speed);
            # the dialer's meters count the bytes at the server socket. A
            # tunnel the gate decided is spliced socket to socket once
            # connected (sluice/splice.py).
            return SplicedTunnel(context) if tunnel is not None else layers.TCPLayer(context, ignore=True)
        # Intercepted. mitmproxy's first question is ignore_hosts/allow_hosts
        # (it may ask for more bytes); bytes it does not ignore that start
        # like TLS get its TLS layers, its next question. Whatever else it
        # would choose carries bytes raw (rawtcp, tcp_hosts, a DNS port,
        # ignore_hosts...): inside an intercepted tunnel only HTTP may pass,
        # so the HTTP parser judges them and refuses what is not HTTP.
        ignored = self._ignore_connection(context, data_client, data_server)
        if not ignored and starts_like_tls_record(data_client):
            return super()._next_layer(context, data_client, data_server)
        return layers.HttpLayer(context, HTTPMode.transparent)


class _RefuseClient(layer.Layer):
    """Closes the client connection at once: the front door refused what the
    client speaks (there is no HTTP to answer in)."""

    def _handle_event(self, event: events.Event) -> layer.CommandGenerator[None]:
        if isinstance(event, events.Start):
            yield commands.CloseConnection(self.context.client)


class TakeOverNextLayer:
    """LayerChoice for a master that already holds an addon named
    "nextlayer" (mitmdump's own NextLayer: a `-s` script is loaded after
    mitmdump's addons, and two addons may not share a name). When the script
    loads, the addon it finds goes out of the chain and LayerChoice comes in;
    when the script is unloaded (or reloaded, which unloads it first), the
    one it replaced comes back."""

    def __init__(self, choice: LayerChoice) -> None:
        self.choice = choice
        self.replaced: object | None = None

    def load(self, loader: object) -> None:
        manager = ctx.master.addons
        self.replaced = manager.get(LayerChoice.name)
        if self.replaced is not None:
            manager.remove(self.replaced)
        self._add(self.choice)

    def done(self) -> None:
        manager = ctx.master.addons
        if manager.get(LayerChoice.name) is self.choice:
            manager.remove(self.choice)
            if self.replaced is not None:
                self._add(self.replaced)
        self.replaced = None

    @staticmethod
    def _add(addon: object) -> None:
        # Added at run time: its configure (NextLayer reads its host options
        # there) is not called by the chain, so it is called here.
        ctx.master.addons.add(addon)
        ctx.master.addons.invoke_addon_sync(addon, hooks.ConfigureHook(ctx.options.keys()))
