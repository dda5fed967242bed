"""The `sluice` command. Every user error is a one-line message and exit 2, never a traceback.

Every subcommand that reads a policy takes it as `--policy FILE` (`policy
check` and `policy test` also take it as their first argument, as before).
Output cut short by its reader (`sluice ca | head`) ends the command quietly
with status 141, as a command killed by SIGPIPE would, never a traceback.
"""

from __future__ import annotations

import argparse
import errno
import importlib.util
import os
import platform
import socket
import sys

from sluice.policy_location import locate

EXIT_USAGE = 2
EXIT_BROKEN_PIPE = 128 + 13  # what a shell reports for a command killed by SIGPIPE


def version_text() -> str:
    from importlib import metadata

    def of(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "unknown"

    return f"sluice {of('sluice')} (mitmproxy {of('mitmproxy')}, Python {platform.python_version()})"


class _Version(argparse.Action):
    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="print the version (and mitmproxy's and Python's) and exit")

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_text())
        parser.exit()


def listen_problem(host: str, port: int, protocol: str = "tcp", reuse_port: bool = False,
                   hint: str = "choose another address with --listen HOST:PORT") -> str | None:
    """Why the proxy could not listen on host:port (a sentence ending in `hint`), or None.

    Binds (and closes) a socket the way asyncio's start_server does, so a
    port already in use is reported before mitmproxy tries it."""
    shown = f"[{host}]:{port}" if ":" in host else f"{host or '*'}:{port}"
    kind = socket.SOCK_STREAM if protocol == "tcp" else socket.SOCK_DGRAM
    sockets = []
    try:
        try:
            infos = socket.getaddrinfo(host or None, port, socket.AF_UNSPEC, kind, 0, socket.AI_PASSIVE)
        except socket.gaierror as e:
            return f"cannot listen on {shown}: {e.strerror}; {hint}"
        for family, type_, proto, _, address in infos:
            s = socket.socket(family, type_, proto)
            sockets.append(s)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port and hasattr(socket, "SO_REUSEPORT"):
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            s.bind(address)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            return f"{shown} is already in use ({protocol.upper()}: another process is listening there); {hint}"
        if e.errno == errno.EACCES:
            return f"cannot listen on {shown}: permission denied (ports below 1024 need privileges); {hint}"
        if e.errno == errno.EADDRNOTAVAIL:
            return f"cannot listen on {shown}: {e.strerror} (not an address of this machine); {hint}"
        return f"cannot listen on {shown}: {e.strerror or e}; {hint}"
    finally:
        for s in sockets:
            s.close()
    return None


# What `pip install sluice` (the agent side) cannot run: they need mitmproxy.
PROXY_COMMANDS = ("proxy", "ca")
POLICY_DEFAULT = ("default: $SLUICE_POLICY, else /etc/sluice/policy.yaml, else the packaged starter policy "
                  "(any public host); a named file that is missing is an error, never a fallback")
POLICY_HELP = "policy YAML (" + POLICY_DEFAULT + ")"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sluice", description="Egress-policy forward proxy for AI agents and sandboxes.")
    p.add_argument("--version", action=_Version)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    proxy = sub.add_parser("proxy", help="run the proxy in the foreground")
    proxy.add_argument("--policy", default=None, metavar="FILE", help=POLICY_HELP)
    proxy.add_argument("--listen", default="127.0.0.1:8080", help="HOST:PORT for the listeners (default: %(default)s)")
    proxy.add_argument("--mode", action="append", default=[], metavar="SPEC",
                       help="mitmproxy mode spec, repeatable: regular (default), socks5@1080, transparent, ...")
    proxy.add_argument("--audit-log", default="-", metavar="FILE",
                       help="JSON audit lines: '-' for stdout (default) or a file")
    proxy.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", dest="sets",
                       help="set any mitmproxy option, repeatable")
    proxy.add_argument("--workers", type=int, default=1, metavar="N",
                       help="run N proxy processes sharing the listening port (SO_REUSEPORT); default 1")
    proxy.add_argument("--ca-dir", default=None, metavar="DIR",
                       help="interception CA directory (default: $SLUICE_CA_DIR or ~/.sluice/ca)")
    proxy.add_argument("--admin", default="127.0.0.1:9090", metavar="HOST:PORT",
                       help="admin listener for /healthz, /readyz, /metrics and /policy, never a proxy port; "
                            "'off' disables it (default: %(default)s)")
    proxy.add_argument("--drain-timeout", type=float, default=30.0, metavar="SECONDS",
                       help="on SIGTERM, how long in-flight exchanges and tunnels may take to finish before they "
                            "are cut (default: %(default)g)")
    proxy.add_argument("--state-dir", default=None, metavar="DIR",
                       help="keep approvals (pending asks, grants, denials) in DIR/approvals.sqlite3, across restarts "
                            "and shared by --workers (default: in memory)")
    proxy.add_argument("--admin-token-file", default=None, metavar="FILE",
                       help="bearer tokens (one a line: TOKEN or NAME TOKEN) the admin endpoint requires for the "
                            "approvals verbs that change state (approve, deny, revoke)")
    proxy.add_argument("--otlp-endpoint", default="", metavar="URL",
                       help="also export every audit record as an OTLP log (HTTP/protobuf) to this collector, "
                            "e.g. http://otel-collector:4318 (default: $OTEL_EXPORTER_OTLP_LOGS_ENDPOINT or "
                            "$OTEL_EXPORTER_OTLP_ENDPOINT if set; 'off': never)")

    from sluice.approvals_cli import add_parser as add_approvals_parser

    add_approvals_parser(sub)

    ca = sub.add_parser("ca", help="print the interception CA certificate's path and PEM (creating it if missing)")
    ca.add_argument("--ca-dir", default=None, metavar="DIR",
                    help="CA directory (default: $SLUICE_CA_DIR or ~/.sluice/ca)")
    ca.add_argument("--owner", default=None, metavar="UID[:GID]",
                    help="give the directory and its files to this numeric user (as root), for a proxy that runs "
                         "as another user: 10001 for the image; modes stay 0700 and 0600")

    policy = sub.add_parser(
        "policy", help="check, explain and test policies",
        description="Exit codes: 0 OK/allowed/all passed, 1 invalid policy or cases file or a failed case, "
                    "2 usage error, 3 refused (explain).",
    )
    psub = policy.add_subparsers(dest="policy_command", required=True, metavar="SUBCOMMAND")
    check = psub.add_parser("check", help="validate a policy and summarise what it allows",
                            description="Print every problem as FILE:LINE:COL: message (exit 1), or a summary (exit "
                                        "0). Warnings (FILE:LINE:COL: warning: ...) name rules the proxy cannot "
                                        "enforce "
                                        "as written, e.g. methods for HTTPS hosts that are not intercepted.")
    check.add_argument("--strict", action="store_true", help="fail (exit 1) on warnings too")
    check.add_argument("--policy", metavar="FILE", help="policy YAML (or give it as FILE); " + POLICY_DEFAULT)
    check.add_argument("file", nargs="?", metavar="FILE", help="policy YAML, the same as --policy FILE")
    check.set_defaults(subparser=check)

    explain = psub.add_parser(
        "explain", help="show what the policy decides for one URL, as JSON",
        description="Decide one request the way the proxy would and print the decision as JSON "
                    "(decision, reason, rule, profile, host, port, addresses, address, message). "
                    "Exit 0 allowed, 3 refused, 2 usage error, 1 invalid policy. Names are resolved "
                    "with the policy's DNS settings unless --resolve is given, in which case only the "
                    "--resolve table is used and any other name is unresolvable.",
    )
    explain.add_argument("--policy", metavar="FILE", help=POLICY_HELP)
    explain.add_argument("--client", metavar="NAME",
                         help="decide as the client profile NAME (default: a client matching no profile)")
    explain.add_argument("--method", metavar="M", help="HTTP method (default: GET)")
    explain.add_argument("--resolve", action="append", default=[], metavar="HOST=IP",
                         help="answer DNS for HOST with IP instead of querying; repeat (or HOST=IP1,IP2) for several "
                              "answers")
    explain.add_argument("url", metavar="URL")

    test = psub.add_parser(
        "test", help="run a YAML list of expected decisions against a policy",
        description="CASES is a YAML list of {url, client?, method?, resolve?: {host: ip | [ips]}, "
                    "expect: allow|refuse, reason?, name?}. Cases never query DNS: a name a case does not "
                    "list under `resolve` is unresolvable (dns_failed). Prints one line per failure and "
                    "'N passed, M failed'; exit 0 if all pass, 1 otherwise.",
    )
    test.usage = "sluice policy test [-h] [-v] --policy FILE CASES\n       sluice policy test [-h] [-v] FILE CASES"
    test.add_argument("--policy", metavar="FILE", help="policy YAML (or give it as the first argument)")
    test.add_argument("paths", nargs="+", metavar="PATH", help="CASES after --policy FILE, or FILE CASES")
    test.set_defaults(subparser=test)
    test.add_argument("-v", "--verbose", action="store_true", help="also print a line for every passing case")

    suggest = psub.add_parser(
        "suggest", help="print a diff to the policy that would allow what an audit log shows refused",
        description="Read refusals and report-mode would_refuse lines from AUDIT (a JSON-lines audit log) and print "
                    "a unified diff against the policy that would allow them: allow entries for hosts, and for "
                    "intercepted hosts request rules with methods and generalised paths, ended by a deny for the "
                    "rest of the host. Non-public addresses and internal names are never suggested. Comments and "
                    "order are kept. Exit 0 (a diff, or nothing to suggest), 1 invalid policy or audit log, 2 usage.",
    )
    suggest.add_argument("--policy", metavar="FILE", required=True, help="the policy YAML to edit")
    suggest.add_argument("--audit", metavar="AUDIT.jsonl", required=True, help="the proxy's audit log (--audit-log)")
    suggest.add_argument("--profile", metavar="NAME", help="only this client profile's lines (and its rules)")
    suggest.add_argument("--since", metavar="DURATION", help="only lines from the last DURATION (e.g. 30m, 24h)")
    suggest.add_argument("--apply", action="store_true", help="write the result to FILE, then run `policy check` on it")

    init = psub.add_parser("init", help="write the commented starter policy to FILE, to edit",
                           description="Write the starter policy (any public host on ports 80 and 443; every "
                                       "key commented) to FILE, default policy.yaml; '-' prints it. An existing "
                                       "FILE is kept unless --force.")
    init.add_argument("file", nargs="?", default="policy.yaml", metavar="FILE")
    init.add_argument("--force", action="store_true", help="overwrite FILE if it exists")

    psub.add_parser(
        "hash-password", help="print a password_hash verifier for a password read from stdin",
        description="Read a password from stdin (one trailing newline is dropped), or prompt for it twice "
                    "on a terminal, and print the verifier to put under users: NAME: password_hash:.",
    )

    from sluice.webtools.cli import add_agent_parsers, add_parsers as add_web_parsers

    add_web_parsers(sub)  # fetch, source-read, read, request, sitemap
    add_agent_parsers(sub)  # mcp, tools schema
    return p


def _policy_paths(args) -> None:
    """`--policy FILE` or the positional FILE (given once) into args.file,
    and the cases file into args.cases; usage errors exit 2."""
    command = getattr(args, "policy_command", None)
    if command == "check":
        given = [path for path in (args.policy, args.file) if path is not None]
        if len(given) > 1:
            args.subparser.error("give the policy once: --policy FILE (or FILE)")
        args.file = args.policy = locate(given[0] if given else None).path
    elif command == "explain":
        args.policy = locate(args.policy).path
    elif command == "test":
        if args.policy is not None:
            if len(args.paths) != 1:
                args.subparser.error("with --policy FILE give only the cases file: sluice policy test --policy FILE "
                                     "CASES")
            args.file, args.cases = args.policy, args.paths[0]
        else:
            if len(args.paths) != 2:
                args.subparser.error("expected a policy and a cases file: sluice policy test --policy FILE CASES")
            args.file, args.cases = args.paths
            args.policy = args.file


def _quiet_stdio() -> None:
    """After a broken pipe: point stdout and stderr at /dev/null, so what is
    still buffered (and the interpreter's final flush) goes nowhere quietly."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    for stream in (sys.stdout, sys.stderr):
        try:
            os.dup2(devnull, stream.fileno())
        except (OSError, ValueError, AttributeError):
            pass
    os.close(devnull)


def main(argv: list[str] | None = None) -> int:
    try:
        try:
            return _main(argv)  # SystemExit too: argparse's --help, --version and usage errors
        finally:
            sys.stdout.flush()  # inside the try: a reader gone by now is a broken pipe too
    except BrokenPipeError:
        _quiet_stdio()
        return EXIT_BROKEN_PIPE


def _main(argv: list[str] | None) -> int:
    args = _parser().parse_args(argv)
    _policy_paths(args)
    if args.command in PROXY_COMMANDS and importlib.util.find_spec("mitmproxy") is None:
        print(f"sluice: `sluice {args.command}` needs the proxy extra, which is not installed: "
              "pip install 'sluice[proxy]'", file=sys.stderr)
        return EXIT_USAGE
    if args.command == "proxy":
        where = locate(args.policy)
        args.policy, args.policy_label = where.path, where.label
    if args.command == "proxy" and args.workers != 1:
        from sluice.listen import parse_listen
        from sluice.workers import supervise

        if not 1 <= args.workers <= 64:
            print("sluice: --workers takes a number from 1 to 64", file=sys.stderr)
            return 2
        try:
            host, port = parse_listen(args.listen)
            if port == 0:
                raise ValueError("--workers needs a fixed --listen port (workers share it)")
        except ValueError as e:
            print(f"sluice: {e}", file=sys.stderr)
            return 2
        problem = listen_problem(host, port, reuse_port=True)
        if problem is not None:
            print(f"sluice: {problem}", file=sys.stderr)
            return EXIT_USAGE
        worker_args = [a for a in (argv if argv is not None else sys.argv[1:])[1:]]
        return supervise(args.workers, _without_workers(worker_args), admin=args.admin,
                         drain_timeout=args.drain_timeout, listen=(host, port), modes=args.mode,
                         state_dir=args.state_dir, admin_token_file=args.admin_token_file, policy=args.policy)
    if args.command == "proxy":
        from sluice.proxy import run

        return run(args.policy, args.listen, args.mode, args.audit_log, args.sets, args.ca_dir,
                   policy_label=args.policy_label,
                   admin=args.admin, drain_timeout=args.drain_timeout, otlp_endpoint=args.otlp_endpoint,
                   state_dir=args.state_dir, admin_token_file=args.admin_token_file)
    if args.command == "ca":
        from sluice.ca import show

        return show(args.ca_dir, args.owner)
    if args.command == "approvals":
        from sluice import approvals_cli

        return approvals_cli.dispatch(args)
    if args.command == "policy":
        from sluice import policy_cli

        return policy_cli.dispatch(args)
    from sluice.webtools.cli import COMMANDS as WEB_COMMANDS

    if args.command in WEB_COMMANDS:
        from sluice.webtools.cli import dispatch as web_dispatch

        return web_dispatch(args)
    from sluice.webtools.cli import AGENT_COMMANDS

    if args.command in AGENT_COMMANDS:
        from sluice.webtools.cli import dispatch_agent

        return dispatch_agent(args)
    return 2


def _without_workers(args: list[str]) -> list[str]:
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a in ("--workers", "--admin"):  # the supervisor serves the one admin endpoint
            skip = True
        elif not a.startswith(("--workers=", "--admin=")):
            out.append(a)
    return [*out, "--admin", "off"]


if __name__ == "__main__":
    sys.exit(main())
