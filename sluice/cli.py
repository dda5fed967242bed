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

    policy = sub.add_parser("policy", help="check, explain and test policies")
    psub = policy.add_subparsers(dest="policy_command", required=True, metavar="SUBCOMMAND")
    check = psub.add_parser("check", help="validate a policy and summarise what it allows")
    check.add_argument("file")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "proxy":
        from sluice.proxy import run

        return run(args.policy, args.listen, args.mode, args.audit_log, args.sets)
    if args.command == "policy":
        from sluice import policy_cli

        return policy_cli.dispatch(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
