"""`sluice policy check|explain|test|hash-password`."""

from __future__ import annotations

import sys

from policy.loader import PolicyInvalid, load_policy_file
from policy.model import Policy, Rules


def dispatch(args) -> int:
    if args.policy_command == "check":
        return check(args.file)
    return 2


def summarise(policy: Policy) -> list[str]:
    lines = [f"{policy.source}: OK ({'report' if policy.rules.action == 'report' else 'enforce'} mode)"]
    lines += _rules_lines(policy.rules, "  ")
    dns = ", ".join(f"{h}:{p}" for h, p in policy.dns.nameservers) or "the system resolver (resolv.conf)"
    lines.append(f"  DNS: {dns}, timeout {policy.dns.timeout:g}s")
    for profile in policy.clients:
        who = []
        if profile.usernames:
            who.append("users " + ", ".join(sorted(profile.usernames)))
        if profile.sources:
            who.append("sources " + ", ".join(e.rule.text for e in profile.sources.entries))
        lines.append(f"  client {profile.name!r} ({'; '.join(who)}):")
        lines += _rules_lines(profile.rules, "    ")
    if policy.require_client:
        lines.append("  clients matching no profile are refused (407)")
    return lines


def _rules_lines(rules: Rules, indent: str) -> list[str]:
    hosts = "any public host" if rules.allow is None else f"{len(rules.allow)} allowed host pattern(s)"
    if rules.deny:
        hosts += f", except {len(rules.deny)} denied pattern(s)"
    out = [f"{indent}reaches {hosts} on ports {', '.join(map(str, sorted(rules.ports)))}"]
    out.append(f"{indent}methods: {', '.join(sorted(rules.methods))}")
    if rules.private_networks:
        out.append(f"{indent}private networks opened: {', '.join(e.rule.text for e in rules.private_networks.entries)}")
    else:
        out.append(f"{indent}no private networks opened (public internet only)")
    return out


def check(path: str) -> int:
    try:
        policy = load_policy_file(path)
    except PolicyInvalid as e:
        for problem in e.problems:
            print(problem, file=sys.stderr)
        print(f"{path}: {len(e.problems)} problem(s)", file=sys.stderr)
        return 1
    print("\n".join(summarise(policy)))
    return 0
