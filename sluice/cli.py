"""The `sluice` command. Every user error is a one-line message and exit 2, never a traceback."""

from __future__ import annotations

import argparse
import sys


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sluice", description="Egress-policy forward proxy for AI agents and sandboxes.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    proxy = sub.add_parser("proxy", help="run the proxy in the foreground")
    proxy.add_argument("--policy", default="config/policy.yaml", help="policy YAML (default: %(default)s)")
    proxy.add_argument("--listen", default="127.0.0.1:8080", help="HOST:PORT for the listeners (default: %(default)s)")
    proxy.add_argument("--mode", action="append", default=[], metavar="SPEC",
                       help="mitmproxy mode spec, repeatable: regular (default), socks5@1080, transparent, ...")
    proxy.add_argument("--audit-log", default="-", metavar="FILE", help="JSON audit lines: '-' for stdout (default) or a file")
    proxy.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", dest="sets",
                       help="set any mitmproxy option, repeatable")
    proxy.add_argument("--workers", type=int, default=1, metavar="N",
                       help="run N proxy processes sharing the listening port (SO_REUSEPORT); default 1")
    proxy.add_argument("--ca-dir", default=None, metavar="DIR",
                       help="interception CA directory (default: $SLUICE_CA_DIR or ~/.sluice/ca)")

    ca = sub.add_parser("ca", help="print the interception CA certificate's path and PEM (creating it if missing)")
    ca.add_argument("--ca-dir", default=None, metavar="DIR", help="CA directory (default: $SLUICE_CA_DIR or ~/.sluice/ca)")

    policy = sub.add_parser(
        "policy", help="check, explain and test policies",
        description="Exit codes: 0 OK/allowed/all passed, 1 invalid policy or cases file or a failed case, "
                    "2 usage error, 3 refused (explain).",
    )
    psub = policy.add_subparsers(dest="policy_command", required=True, metavar="SUBCOMMAND")
    check = psub.add_parser("check", help="validate a policy and summarise what it allows",
                            description="Print every problem as FILE:LINE:COL: message (exit 1), or a summary (exit 0).")
    check.add_argument("file")

    explain = psub.add_parser(
        "explain", help="show what the policy decides for one URL, as JSON",
        description="Decide one request the way the proxy would and print the decision as JSON "
                    "(decision, reason, rule, profile, host, port, addresses, address, message). "
                    "Exit 0 allowed, 3 refused, 2 usage error, 1 invalid policy. Names are resolved "
                    "with the policy's DNS settings unless --resolve is given, in which case only the "
                    "--resolve table is used and any other name is unresolvable.",
    )
    explain.add_argument("--policy", required=True, metavar="FILE", help="policy YAML")
    explain.add_argument("--client", metavar="NAME", help="decide as the client profile NAME (default: a client matching no profile)")
    explain.add_argument("--method", metavar="M", help="HTTP method (default: GET)")
    explain.add_argument("--resolve", action="append", default=[], metavar="HOST=IP",
                         help="answer DNS for HOST with IP instead of querying; repeat (or HOST=IP1,IP2) for several answers")
    explain.add_argument("url", metavar="URL")

    test = psub.add_parser(
        "test", help="run a YAML list of expected decisions against a policy",
        description="CASES is a YAML list of {url, client?, method?, resolve?: {host: ip | [ips]}, "
                    "expect: allow|refuse, reason?, name?}. Cases never query DNS: a name a case does not "
                    "list under `resolve` is unresolvable (dns_failed). Prints one line per failure and "
                    "'N passed, M failed'; exit 0 if all pass, 1 otherwise.",
    )
    test.add_argument("file", metavar="FILE", help="policy YAML")
    test.add_argument("cases", metavar="CASES", help="cases YAML")
    test.add_argument("-v", "--verbose", action="store_true", help="also print a line for every passing case")

    psub.add_parser(
        "hash-password", help="print a password_hash verifier for a password read from stdin",
        description="Read a password from stdin (one trailing newline is dropped), or prompt for it twice "
                    "on a terminal, and print the verifier to put under users: NAME: password_hash:.",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "proxy" and args.workers != 1:
        from sluice.listen import parse_listen
        from sluice.workers import supervise

        if not 1 <= args.workers <= 64:
            print("sluice: --workers takes a number from 1 to 64", file=sys.stderr)
            return 2
        try:
            if parse_listen(args.listen)[1] == 0:
                raise ValueError("--workers needs a fixed --listen port (workers share it)")
        except ValueError as e:
            print(f"sluice: {e}", file=sys.stderr)
            return 2
        worker_args = [a for a in (argv if argv is not None else sys.argv[1:])[1:]]
        return supervise(args.workers, _without_workers(worker_args))
    if args.command == "proxy":
        from sluice.proxy import run

        return run(args.policy, args.listen, args.mode, args.audit_log, args.sets, args.ca_dir)
    if args.command == "ca":
        from sluice.ca import show

        return show(args.ca_dir)
    if args.command == "policy":
        from sluice import policy_cli

        return policy_cli.dispatch(args)
    return 2


def _without_workers(args: list[str]) -> list[str]:
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a == "--workers":
            skip = True
        elif not a.startswith("--workers="):
            out.append(a)
    return out


if __name__ == "__main__":
    sys.exit(main())
