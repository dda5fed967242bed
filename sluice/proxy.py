"""`sluice proxy`: mitmproxy with the Sluice addons, in the foreground."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sqlite3
import sys

from mitmproxy import ctx, exceptions, options
from mitmproxy.addons import block, core, disable_h2c, errorcheck, proxyserver, tlsconfig
from mitmproxy.addons.termlog import TermLog
from mitmproxy.master import Master
from mitmproxy.utils import human
from mitmproxy.proxy import mode_specs

from sluice.addons import mitm_patches
from sluice import open_files
from sluice.admin import (
    WORKER_DIR_ENV, AdminServer, AdminTokens, ApprovalDesk, Endpoints, admin_problem, parse_admin, same_listener,
)
from sluice.own_host import ADMIN_ENV, OWN_HOST, configured_listeners
from sluice.addons.sluice_addon import make_addons
from sluice.ca import ca_dir, ensure_ca, given_ca_dir
from sluice.cli import EXIT_USAGE, listen_problem
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
        # No next_layer.NextLayer(): Sluice's subclass of it, LayerChoice, is
        # in make_addons' list (addons/layer_choice.py).
        tlsconfig.TlsConfig(),
        StartupErrors(),
    ]


class StartupErrors(errorcheck.ErrorCheck):
    """mitmproxy's start-up error check, exiting 2 like every other Sluice
    start-up error (mitmproxy exits 1)."""

    name = "errorcheck"  # mitmproxy's Master looks it up by this name

    async def shutdown_if_errored(self):
        try:
            await super().shutdown_if_errored()
        except SystemExit as e:
            raise SystemExit(EXIT_USAGE if e.code == 1 else e.code) from None


def listen_problems(opts: options.Options) -> list[str]:
    """Each listener that could not be opened, as a sentence (checked before
    mitmproxy opens them, so the message names the address and the flag)."""
    problems = []
    reuse_port = os.environ.get(REUSE_PORT_ENV) == "1"
    for spec in opts.mode:
        mode = mode_specs.ProxyMode.parse(spec)
        host = mode.listen_host(opts.listen_host)
        port = mode.listen_port(opts.listen_port)
        if not port:  # no fixed port (0: any free one)
            continue
        protocols = ("tcp", "udp") if mode.transport_protocol == "both" else (mode.transport_protocol,)
        hint = ("choose another address with --listen HOST:PORT" if mode.custom_listen_port is None else
                f"choose another port in --mode {mode.type_name}@PORT")
        for protocol in protocols:
            problem = listen_problem(host, port, protocol, reuse_port, hint)
            if problem is not None:
                problems.append(problem)
    return problems


class OneVoice(logging.Formatter):
    """Every line Sluice writes on stderr reads `sluice: ...`, mitmproxy's
    log records included (its own format is `[hh:mm:ss.mmm] ...`); an
    error says so after the prefix (warnings carry operator news such as a
    reload, so they are not labelled), and a client's address, when
    mitmproxy names one, follows it."""

    def format(self, record: logging.LogRecord) -> str:
        level = "error: " if record.levelno >= logging.ERROR else ""
        client = getattr(record, "client", None)
        peer = f"{human.format_address(client)}: " if client else ""
        text = f"sluice: {level}{peer}{record.getMessage()}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


class ReadyLine:
    """Prints one line on stderr once every listener is up."""

    def __init__(self, policy_label: str, admin: tuple[str, int] | None, approvals: str = "") -> None:
        self.policy_label = policy_label
        self.approvals = approvals  # where approvals are kept
        # A worker of `--workers N` runs without its own admin listener: the
        # supervisor's, which it is told through the environment, is the one.
        shown = None if admin is None else _host_port(*admin)
        self.admin = shown or os.environ.get(ADMIN_ENV) or "off"

    def running(self) -> None:
        addrs = ctx.master.addons.get("proxyserver").listen_addrs()
        shown = " ".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p, *_ in addrs)
        modes = ",".join(ctx.options.mode)
        print(f"sluice: ready on {shown} (mode {modes}; policy {self.policy_label}; admin {self.admin}; approvals "
              f"{self.approvals})",
              file=sys.stderr, flush=True)


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def _serve(policy: str, listen: tuple[str, int], modes: list[str], audit_log: str, sets: list[str], ca: str,
                 admin: tuple[str, int] | None = None, drain_timeout: float = 30.0, otlp_endpoint: str = "",
                 policy_label: str | None = None, state_dir: str | None = None,
                 admin_token_file: str | None = None) -> int:
    try:
        tokens = AdminTokens.load(admin_token_file)
    except ValueError as e:
        print(f"sluice: {e}", file=sys.stderr)
        return EXIT_USAGE
    opts = options.Options(listen_host=listen[0], listen_port=listen[1], confdir=ca)
    mitm_patches.install()
    master = Master(opts, with_termlog=False)
    # Out of file descriptors: one rate-limited line, not a traceback per accept.
    master._asyncio_exception_handler = open_files.OutOfFiles(master._asyncio_exception_handler)
    termlog = TermLog(out=sys.stderr)
    termlog.logger.setFormatter(OneVoice())  # stderr speaks one line format, the ready line's
    master.addons.add(termlog, *mitmproxy_addons())
    # A worker's supervisor serves its metrics: they are kept even without --admin.
    metrics = admin is not None or bool(os.environ.get(WORKER_DIR_ENV))
    ready_line = ReadyLine(policy_label or policy, admin)
    master.addons.add(*make_addons(lifecycle=True, metrics=metrics), ready_line)
    drain, status, approvals = master.addons.get("drain"), master.addons.get("status"), master.addons.get("approvals")
    drain.timeout = drain_timeout
    mitm_patches.fast_dispatch(master.addons)  # a fixed addon list: resolve each event's hooks once
    try:
        opts.update(**SLUICE_DEFAULTS)
        # Always set, so the OTEL_EXPORTER_OTLP_* variables are read (and a bad one reported) here.
        opts.update(mode=modes or ["regular"], sluice_audit_log=audit_log, sluice_otlp_endpoint=otlp_endpoint)
        if sets:
            if any(item.split("=", 1)[0].strip() == "scripts" for item in sets):
                raise ValueError("`sluice proxy` loads no mitmproxy scripts (--set scripts=...); to add your own "
                                 "addons, run Sluice's under mitmdump: mitmdump -s addons/sluice_addon.py -s YOURS.py "
                                 "--set sluice_policy=FILE (README: mitmdump)")
            opts.set(*sets)
        opts.update(sluice_policy=policy)
    except (exceptions.OptionsError, KeyError, ValueError, NotImplementedError) as e:
        message = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"sluice: {message}", file=sys.stderr)
        return 2
    try:
        # Where approvals live follows the policy just loaded: its state store, else --state-dir.
        live = approvals.source.current
        approvals.open(live.policy.state if live is not None else None, state_dir)
    except (OSError, sqlite3.Error) as e:
        print(f"sluice: --state-dir {state_dir}: cannot keep the approvals state there ({e}); give a directory "
              "this user may write", file=sys.stderr)
        return EXIT_USAGE
    ready_line.approvals = approvals.store.where
    problems = listen_problems(opts)
    if admin is not None:
        problems += [f"--admin {admin[0]}:{admin[1]} is a proxy listening address; the admin endpoint needs its own "
                     "port: choose another with --admin HOST:PORT, or --admin off"
                     for address in configured_listeners(opts) if same_listener(admin, address)][:1]
    if problems:
        for problem in problems:
            print(f"sluice: {problem}", file=sys.stderr)
        return EXIT_USAGE
    server = None
    if admin is not None:
        OWN_HOST.add_listener(*admin)  # the admin endpoint is the proxy's host too: never a destination
        try:
            desk = ApprovalDesk(lambda: approvals.store, tokens, approvals.poke)
            server = AdminServer(*admin, Endpoints(status, desk)).start()
            ready_line.admin = _host_port(*server.address)  # the bound port, for --admin HOST:0
        except OSError as e:
            print(f"sluice: {admin_problem(*admin, e)}", file=sys.stderr)
            return EXIT_USAGE
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, drain.signal)
    if hasattr(signal, "SIGPIPE"):
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    try:
        await master.run()
    finally:
        if server is not None:
            server.close()
    return 0


def run(policy: str, listen: str, modes: list[str], audit_log: str, sets: list[str], ca: str | None = None,
        admin: str = "127.0.0.1:9090", drain_timeout: float = 30.0, otlp_endpoint: str = "",
        policy_label: str | None = None, state_dir: str | None = None, admin_token_file: str | None = None) -> int:
    try:
        address = parse_listen(listen)
        if state_dir is not None and not os.path.isdir(state_dir):
            raise ValueError(f"--state-dir {state_dir}: not a directory (create it first; approvals are kept there)")
        admin_address = parse_admin(admin)
        if not 0 <= drain_timeout <= 86400:
            raise ValueError("--drain-timeout takes a number of seconds from 0 to 86400")
        directory = ca_dir(ca)
        ensure_ca(directory)
    except ValueError as e:
        print(f"sluice: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"sluice: cannot prepare the CA directory {given_ca_dir(ca)}: {e.strerror or e}", file=sys.stderr)
        return 2
    logging.getLogger("asyncio").setLevel(logging.WARNING)
    open_files.raise_limit()  # soft open-files limit up to the hard one (see docs/deploy.md)
    if os.environ.get(REUSE_PORT_ENV) == "1":
        enable_reuse_port()
    return asyncio.run(_serve(policy, address, modes, audit_log, sets, str(directory), admin_address, drain_timeout,
                              otlp_endpoint, policy_label, state_dir, admin_token_file))
