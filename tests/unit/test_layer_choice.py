"""addons/layer_choice.py: the layers Sluice picks for a connection and each
tunnel, made as mitmproxy's NextLayer (subclassed) so nothing is built and
thrown away; and how it replaces mitmproxy's NextLayer under `sluice proxy`
and under `mitmdump -s`. In process: mitmproxy's own NextLayer layer and
hook through the addon chain (tests/harness/inprocess.py), no proxy."""

from __future__ import annotations

import asyncio
import ssl
from types import SimpleNamespace

import pytest
from mitmproxy import options
from mitmproxy.addons import next_layer
from mitmproxy.proxy import events, layer, layers
from mitmproxy.proxy.context import Context
from mitmproxy.proxy.layers import modes
from mitmproxy.proxy.layers.http import HttpConnectHook, HTTPMode
from mitmproxy.test import taddons, tflow, tutils

from harness.inprocess import InProcess
from sluice.addons.audit import AuditLog
from sluice.addons.layer_choice import LayerChoice, TakeOverNextLayer
from sluice.addons.sluice_addon import make_addons, script_addons
from sluice.proxy import mitmproxy_addons
from sluice.splice import SplicedTunnel

POLICY = """version: 1
ports: [443, 22]
methods: [GET, CONNECT]
intercept: [seen.example]
"""
DNS = {"public.example": ["8.8.8.8"], "seen.example": ["8.8.4.4"]}


def client_hello(sni: str) -> bytes:
    """A whole TLS ClientHello naming `sni`, as Python's own TLS client sends it."""
    tls = ssl.create_default_context().wrap_bio(ssl.MemoryBIO(), outgoing := ssl.MemoryBIO(), server_hostname=sni)
    try:
        tls.do_handshake()
    except ssl.SSLWantReadError:
        pass
    return outgoing.read()


def choose_in_tunnel(p: InProcess, host: str, first_bytes: bytes, port: int = 443):
    """CONNECT host through the gate, then the next_layer hook of the tunnel's
    NextLayer (below it: the HTTP proxy mode and its HTTP layer) once the
    client's first bytes arrived. Returns (the NextLayer, its context)."""
    async def run():
        client = await p.connect()
        flow = tflow.tflow(client_conn=client, req=tutils.treq(method=b"CONNECT", host=host, port=port, scheme=b"",
                                                               authority=f"{host}:{port}".encode(), path=b""))
        flow.server_conn.address = (host, port)
        await p.hook(HttpConnectHook(flow))
        assert flow.response is None, "the gate allowed the tunnel"
        context = Context(client, options.Options())
        modes.HttpProxy(context)
        layers.HttpLayer(context, HTTPMode.regular)
        inside = context.fork()
        inside.server = flow.server_conn
        nl = layer.NextLayer(inside)
        nl.events.append(events.DataReceived(client, first_bytes))
        await p.hook(layer.NextLayerHook(nl))
        return nl, inside
    return run


def test_a_tunnel_not_intercepted_is_spliced_and_no_tls_layer_is_built_for_its_tls_bytes():
    """mitmproxy's choice for a ClientHello is its TLS layers, whose
    constructors mark both connections as TLS; Sluice's raw tunnel is chosen
    before any is built, so neither connection says TLS."""
    async def run():
        async with InProcess(POLICY, DNS) as p:
            nl, context = await choose_in_tunnel(p, "public.example", client_hello("public.example"))()
            assert isinstance(nl.layer, SplicedTunnel)
            assert context.layers[2:] == [nl.layer]  # nothing else was pushed
            assert context.client.tls is False and context.server.tls is False
    asyncio.run(run())


def test_an_intercepted_tunnel_gets_mitmproxys_tls_layers_for_tls_bytes():
    async def run():
        async with InProcess(POLICY, DNS) as p:
            nl, context = await choose_in_tunnel(p, "seen.example", client_hello("seen.example"))()
            assert isinstance(nl.layer, layers.ServerTLSLayer)
            assert isinstance(nl.layer.child_layer, layers.ClientTLSLayer)
            assert context.layers[2:] == [nl.layer, nl.layer.child_layer]
    asyncio.run(run())


@pytest.mark.parametrize("mitmproxy_options, first_bytes, port", [
    ({"rawtcp": True}, b"SSH-2.0-OpenSSH_9.6\r\n", 22),
    ({}, b"\x00\x1c\xab\xcd\x01\x00", 53),
    ({"tcp_hosts": [r"8\.8\.4\.4"]}, b"GET / HTTP/1.1\r\nHost: seen.example\r\n\r\n", 443),
    ({"ignore_hosts": ["seen"]}, client_hello("seen.example"), 443),
], ids=["rawtcp", "dns-port", "tcp_hosts", "ignore_hosts"])
def test_bytes_mitmproxy_would_carry_raw_inside_an_intercepted_tunnel_get_the_http_layer(
        mitmproxy_options, first_bytes, port):
    """mitmproxy would build a raw (or DNS) layer for these; inside an
    intercepted tunnel Sluice builds only HTTP, and nothing else."""
    async def run():
        async with InProcess(POLICY.replace("[443, 22]", "[443, 22, 53]"), DNS) as p:
            p.master.options.update(**mitmproxy_options)
            nl, context = await choose_in_tunnel(p, "seen.example", first_bytes, port)()
            assert isinstance(nl.layer, layers.HttpLayer) and nl.layer.mode is HTTPMode.transparent
            assert context.layers[2:] == [nl.layer]
            assert context.client.tls is False and context.server.tls is False
    asyncio.run(run())


def test_sluice_proxy_has_one_layer_chooser_and_it_is_sluices():
    """`sluice proxy`'s master: no addon but LayerChoice has a next_layer hook
    (mitmproxy's NextLayer is not loaded beside it), and it has the name
    mitmproxy's proxyserver looks for."""
    addons = [*mitmproxy_addons(), *make_addons(lifecycle=True, metrics=True)]
    choosers = [a for a in addons if hasattr(a, "next_layer")]
    assert len(choosers) == 1 and isinstance(choosers[0], LayerChoice)
    with taddons.context(*addons, loadcore=False) as tctx:
        assert tctx.master.addons.get("nextlayer") is choosers[0]


def test_mitmdump_script_takes_over_mitmdumps_next_layer_and_gives_it_back():
    """Under `mitmdump -s` the master holds mitmproxy's NextLayer before the
    script loads: the script swaps LayerChoice in (configured with the
    options already set) and, unloaded, puts mitmproxy's back."""
    stock = next_layer.NextLayer()
    with taddons.context(stock) as tctx:
        tctx.options.update(tcp_hosts=["raw.example"])
        manager = tctx.master.addons
        take_over = TakeOverNextLayer(LayerChoice(AuditLog()))
        script = SimpleNamespace(addons=[take_over])
        manager.register(script)
        choice = take_over.choice
        assert manager.get("nextlayer") is choice and stock not in manager.chain and choice in manager.chain
        assert [p.pattern for p in choice.tcp_hosts] == ["raw.example"]
        manager.remove(script)  # what mitmdump does when the script is unloaded or reloaded
        assert manager.get("nextlayer") is stock and stock in manager.chain and choice not in manager.chain
        manager.register(SimpleNamespace(addons=[TakeOverNextLayer(LayerChoice(AuditLog()))]))  # reloaded
        assert isinstance(manager.get("nextlayer"), LayerChoice) and stock not in manager.chain


def test_the_script_list_differs_from_make_addons_only_in_the_take_over():
    script = script_addons()
    assert not any(isinstance(a, LayerChoice) for a in script)
    [take_over] = [a for a in script if isinstance(a, TakeOverNextLayer)]
    assert [type(a) for a in script] == [
        TakeOverNextLayer if isinstance(a, LayerChoice) else type(a) for a in make_addons()]
