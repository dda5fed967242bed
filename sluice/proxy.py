"""`sluice proxy`: mitmproxy with the Sluice addons, in the foreground."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys

from mitmproxy import ctx, exceptions, options
from mitmproxy.addons import block, core, disable_h2c, errorcheck, next_layer, proxyserver, tlsconfig
from mitmproxy.addons.termlog import TermLog
from mitmproxy.master import Master

from addons import mitm_patches
from addons.sluice_addon import make_addons
from sluice.ca import ca_dir, ensure_ca
from sluice.listen import parse_listen
from sluice.workers import REUSE_PORT_ENV, enable_reuse_port

# mitmproxy defaults Sluice changes: quiet connection chatter (the audit log
# is the record).
SLUICE_DEFAULTS = {
    "termlog_verbosity": "warn",
    "websocket": False,  # see addons/guardrails.py SAFE_DEFAULTS
}


def mitmproxy_addons() -> list:
    """The mitmproxy addons a Sluice proxy needs, and no others.

    mitmdump loads ~30 (playback, map-local/-remote, header and body
    rewriting, saving, the onboarding app at mitm.it, its own proxy auth...).
    Sluice needs none of them, several could rewrite a request after the gate
    pinned it, and mitmproxy offers every event to every addon: fewer addons
    is measurably faster (see README, Performance)."""
    return [
        core.Core(),
        block.Block(),  # block_global: refuse clients from public addresses
        disable_h2c.DisableH2C(),
        proxyserver.Proxyserver(),
        next_layer.NextLayer(),
        tlsconfig.TlsConfig(),
        errorcheck.ErrorCheck(),
    ]


class ReadyLine:
    """Prints one line on stderr once every listener is up."""

    def __init__(self, policy_path: str) -> None:
        self.policy_path = policy_path

    def running(self) -> None:
        addrs = ctx.master.addons.get("proxyserver").listen_addrs()
        shown = " ".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p, *_ in addrs)
        modes = ",".join(ctx.options.mode)
        print(f"sluice: ready on {shown} (mode {modes}; policy {self.policy_path})", file=sys.stderr, flush=True)


async def _serve(policy: str, listen: tuple[str, int], modes: list[str], audit_log: str, sets: list[str], ca: str) -> int:
    opts = options.Options(listen_host=listen[0], listen_port=listen[1], confdir=ca)
    mitm_patches.install()
    master = Master(opts, with_termlog=False)
    master.addons.add(TermLog(out=sys.stderr), *mitmproxy_addons())
    master.addons.add(*make_addons(), ReadyLine(policy))
    try:
        opts.update(**SLUICE_DEFAULTS)
        opts.update(mode=modes or ["regular"], sluice_audit_log=audit_log)
        if sets:
            opts.set(*sets)
        opts.update(sluice_policy=policy)
    except (exceptions.OptionsError, KeyError, ValueError, NotImplementedError) as e:
        message = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"sluice: {message}", file=sys.stderr)
        return 2
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, master.shutdown)
    if hasattr(signal, "SIGPIPE"):
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    await master.run()
    return 0


def run(policy: str, listen: str, modes: list[str], audit_log: str, sets: list[str], ca: str | None = None) -> int:
    try:
        address = parse_listen(listen)
        directory = ca_dir(ca)
        ensure_ca(directory)
    except ValueError as e:
        print(f"sluice: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"sluice: cannot prepare the CA directory {directory}: {e.strerror or e}", file=sys.stderr)
        return 2
    logging.getLogger("asyncio").setLevel(logging.WARNING)
    if os.environ.get(REUSE_PORT_ENV) == "1":
        enable_reuse_port()
    return asyncio.run(_serve(policy, address, modes, audit_log, sets, str(directory)))
