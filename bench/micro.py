"""The decision microbenchmark: policy.decide.check_request followed by
check_answers (the DNS answer already in hand), in µs per decision. With
limits on (the "limits" row), each decision is followed by the quota check a
request gets (policy.quotas.check_request: transfer window, request-rate
bucket and per-host bucket, in memory, reading the monotonic clock), with
limits high enough that every request passes: the per-request cost of the
limiter is that row less the default policy's.

Pure computation, no sockets: runs anywhere (`python -m bench micro`).
"""

from __future__ import annotations

import gc
import statistics
import tempfile
import time
from pathlib import Path

from bench.policies import QUOTA_LIMITS

TARGET_US = 20.0

# (label, host, port, scheme, method, answers)
CASES = [
    ("name", "public.example", 80, "http", "GET", ("8.8.8.8",)),
    ("deep name", "a.b.c.d.e.public.example", 443, None, "CONNECT", ("8.8.8.8",)),
    ("IP literal", "8.8.8.8", 80, "http", "GET", ()),
]


def _decide_once(check_request, check_answers, rules, dest, answers):
    d = check_request(rules, dest)
    if d.needs_dns:
        d = check_answers(rules, d, answers)
    return d


# Quotas for the "limits" row: QUOTA_LIMITS, every one on and none ever
# refusing (the same limits as the bench's sluice-limits contender).


def _quota_check(limits):
    """The per-request quota check as addons/quotas.py makes it."""
    from sluice.policy.quotas import HOUR, MemoryCounters, bytes_key, check_request, client_key

    counters, client = MemoryCounters(), client_key("agents", "alice", "10.0.0.5")
    counters.spend(bytes_key(client), 1000, None, HOUR, time.monotonic())  # a client that has used some

    def check(host: str) -> None:
        # The check is a coroutine (a shared store awaits its answer); the
        # in-memory counters never suspend, so one send() runs it to the end,
        # as the quota addon's await does.
        step = check_request(counters, limits, client, host, time.monotonic())
        try:
            step.send(None)
        except StopIteration as done:
            if done.value is not None:
                raise RuntimeError("the quota check refused") from None
        else:
            raise RuntimeError("the in-memory quota check suspended")

    return check


def time_case(rules, dest, answers, *, iterations: int, rounds: int, quota=None) -> dict:
    from sluice.policy.decide import check_answers, check_request

    d = _decide_once(check_request, check_answers, rules, dest, answers)
    if not d.allowed:
        raise RuntimeError(f"refused: {d.refusal.reason.value}")
    for _ in range(min(iterations, 2000)):  # warm caches (lru_caches in host parsing, if any)
        _decide_once(check_request, check_answers, rules, dest, answers)
    per_round = []
    gc_was = gc.isenabled()
    gc.disable()
    try:
        for _ in range(rounds):
            t0 = time.perf_counter_ns()
            if quota is None:
                for _ in range(iterations):
                    d = check_request(rules, dest)
                    if d.needs_dns:
                        d = check_answers(rules, d, answers)
            else:
                for _ in range(iterations):
                    d = check_request(rules, dest)
                    if d.needs_dns:
                        d = check_answers(rules, d, answers)
                    quota(dest.host)
            per_round.append((time.perf_counter_ns() - t0) / iterations / 1000.0)
    finally:
        if gc_was:
            gc.enable()
    return {"median_us": statistics.median(per_round), "min_us": min(per_round),
            "max_us": max(per_round), "rounds": rounds, "iterations": iterations}


def run(policy_files: dict[str, Path] | None = None, *, quick: bool = False) -> dict:
    """{policy label: {case label: timings}}; policy_files maps label -> path."""
    from sluice.policy.decide import Destination
    from sluice.policy.loader import load_policy_file

    from bench import policies

    iterations, rounds = (3000, 5) if quick else (5000, 15)
    with tempfile.TemporaryDirectory(prefix="sluice-bench-micro-") as tmp:
        if policy_files is None:
            policy_files = policies.write_all(Path(tmp))
        out: dict[str, dict] = {}
        for label, path in policy_files.items():
            t0 = time.perf_counter()
            policy = load_policy_file(path)
            load_s = time.perf_counter() - t0
            rules = policy.rules
            results = {}
            for case, host, port, scheme, method, answers in CASES:
                dest = Destination(host=host, port=port, scheme=scheme, method=method)
                try:
                    results[case] = time_case(rules, dest, answers, iterations=iterations, rounds=rounds)
                except Exception as e:  # reported, not fatal
                    results[case] = {"error": f"{type(e).__name__}: {e}"}
            out[label] = {"cases": results, "load_seconds": round(load_s, 3),
                          "allow_entries": len(rules.allow) if rules.allow is not None else 0,
                          "deny_entries": len(rules.deny)}
            if label == "default":
                out["limits"] = _limits_on(rules, iterations, rounds, load_s)
    out["request_rules"] = _rules_rows(iterations, rounds)
    return out


# Request rules (issue 21): indexed by host, so a policy with 1,000 rules
# over 1,000 hosts decides as fast as one with a few; 100 rules on one host
# are scanned in order (the worst case: the request matches the last).
RULE_HOSTS = 1000
RULES_ON_ONE_HOST = 100


def rules_policy_text(hosts: int, rules_per_host: int) -> str:
    lines = ["version: 1", "intercept: ['**.rules.example']", "rules:"]
    for h in range(hosts):
        for r in range(rules_per_host):
            lines.append(f"  - allow: {{hosts: [h{h}.rules.example], methods: [GET], paths: ['/org{h}/v{r}/*/items/**']}}")
    return "\n".join(lines) + "\n"


# (label, policy (hosts, rules per host), cases: (label, host, target))
RULE_ROWS = [
    ("1,000 rules over 1,000 hosts", (RULE_HOSTS, 1), [
        ("rule matches", f"h{RULE_HOSTS // 2}.rules.example", f"/org{RULE_HOSTS // 2}/v0/repo/items/1/2"),
        ("no rule names the host", "public.example", "/org1/v0/repo/items/1"),
    ]),
    (f"{RULES_ON_ONE_HOST} rules on one host", (1, RULES_ON_ONE_HOST), [
        ("last rule matches", "h0.rules.example", f"/org0/v{RULES_ON_ONE_HOST - 1}/repo/items/1"),
        ("no rule matches", "h0.rules.example", "/org0/other"),
    ]),
]


def _rules_rows(iterations: int, rounds: int) -> dict:
    from sluice.policy.decide import Destination
    from sluice.policy.loader import load_policy_text

    out = {}
    for label, (hosts, per_host), cases in RULE_ROWS:
        t0 = time.perf_counter()
        policy = load_policy_text(rules_policy_text(hosts, per_host), "<bench rules>")
        load_s = time.perf_counter() - t0
        results = {}
        for case, host, target in cases:
            dest = Destination(host=host, port=443, scheme="https", method="GET", target=target)
            try:
                results[case] = time_case(policy.rules, dest, ("8.8.8.8",), iterations=iterations, rounds=rounds)
            except Exception as e:  # reported, not fatal
                results[case] = {"error": f"{type(e).__name__}: {e}"}
        out[label] = {"cases": results, "load_seconds": round(load_s, 3), "rules": hosts * per_host}
    return out


def _limits_on(rules, iterations: int, rounds: int, load_s: float) -> dict:
    """The default policy with every quota on: decision + quota check."""
    from dataclasses import replace

    from sluice.policy.decide import Destination

    limited = replace(rules, limits=replace(rules.limits, **QUOTA_LIMITS))
    results = {}
    for case, host, port, scheme, method, answers in CASES:
        dest = Destination(host=host, port=port, scheme=scheme, method=method)
        try:
            results[case] = time_case(limited, dest, answers, iterations=iterations, rounds=rounds,
                                      quota=_quota_check(limited.limits))
        except Exception as e:  # reported, not fatal
            results[case] = {"error": f"{type(e).__name__}: {e}"}
    return {"cases": results, "load_seconds": round(load_s, 3),
            "allow_entries": len(rules.allow) if rules.allow is not None else 0, "deny_entries": len(rules.deny)}


def table(results: dict) -> list[str]:
    if not results or "error" in results:
        return [f"n/a ({(results or {}).get('error', 'not run')})"]
    labels = {"default": "default policy", "large": "10k patterns + 1k CIDRs",
              "limits": "default policy, limits on (+ quota check)"}
    cases = [c[0] for c in CASES]
    lines = ["| Decision (check_request + check_answers) | " + " | ".join(cases) + " | policy load |",
             "|---|" + "---:|" * len(cases) + "---:|"]
    for label, r in results.items():
        if label == "request_rules":
            continue
        cells = []
        for case in cases:
            t = r["cases"].get(case, {})
            cells.append(f"n/a ({t['error']})" if "error" in t else f"{t['median_us']:.1f} µs (min {t['min_us']:.1f})")
        lines.append(f"| {labels.get(label, label)} | " + " | ".join(cells) + f" | {r['load_seconds']:.2f} s |")
    for label, r in results.get("request_rules", {}).items():
        cells = []
        for case, t in r["cases"].items():
            shown = f"n/a ({t['error']})" if "error" in t else f"{t['median_us']:.1f} µs (min {t['min_us']:.1f})"
            cells.append(f"{case}: {shown}")
        lines.append(f"| request rules: {label} | " + " | ".join(cells) + f" | {r['load_seconds']:.2f} s |")
    return lines


def main(quick: bool = False) -> dict:
    results = run(quick=quick)
    print("\n".join(table(results)))
    return results
