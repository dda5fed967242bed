"""`python -m bench [--quick]`: the comparison (inside the namespace: `make bench`).

    python -m bench            full run (about 5 minutes), inside scripts/in-netns.sh
    python -m bench --quick    shorter runs (about 1.5 minutes)
    python -m bench --only connect
                               only the named phases (comma-separated: micro, idle,
                               http, connect, store, tunnel); `connect` is CONNECT setups/s,
                               `store` the cost of quotas in a shared redis-server
    python -m bench micro      the decision microbenchmark only; no namespace needed
    python -m bench extraction main-content F1 per extractor and MB/s of plain html2text vs
                               Sluice's converter on a 2 MiB page; no namespace needed
    python -m bench deps       install nginx-light, wrk, tinyproxy and redis-server if missing
                               (as root, outside the namespace: `make bench` does it)
    python -m bench profile    Sluice and mitmdump under a CPU-time sampler and under
                               cProfile: 16-connection load, a tunnel download, CONNECT
                               setups; where the time goes (inside the namespace;
                               --only connect for that one)
    python -m bench --only connect,http --baseline-tree DIR|COMMIT
                               also run another checkout's Sluice, or a commit's
                               (exported to the run's temp dir), in the same CONNECT
                               and request-rate rounds: a same-round A/B against older code
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def _phases(text: str) -> tuple[str, ...]:
    from bench.run import PHASES

    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    unknown = [n for n in names if n not in PHASES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown phase(s) {unknown}; choose from {', '.join(PHASES)}")
    return tuple(n for n in PHASES if n in names)  # always in the full run's order


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["extraction"]:  # its own options: python -m bench extraction --help
        from bench import extraction

        return extraction.main(argv[1:])
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", nargs="?", default="run", choices=["run", "micro", "deps", "profile"])
    p.add_argument("--quick", action="store_true", help="shorter runs, rougher numbers")
    p.add_argument("--out", type=Path, default=RESULTS, help="where latest.md and latest.json go (default: %(default)s)")
    p.add_argument("--seconds", type=float, default=10.0, help="profile: seconds of load per proxy")
    p.add_argument("--only", type=_phases, default=None,
                   help="run: only these phases, comma-separated (micro, idle, http, connect, store, tunnel, "
                        "extraction); "
                        "profile: only these scenarios (http, tunnel, connect)")
    p.add_argument("--baseline-tree", default=None, metavar="DIR|COMMIT",
                   help="run: also run the Sluice of this other checkout, or of this commit of this repository, "
                        "in the CONNECT and request-rate rounds, beside the current code (it prints which file each side "
                        "imports)")
    args = p.parse_args(argv)

    if args.command == "deps":
        from bench import deps

        return deps.ensure()
    if args.command == "micro":
        import json

        from bench import micro

        results = micro.main(quick=args.quick)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "micro.json").write_text(json.dumps(results, indent=2) + "\n")
        return 0
    if args.command == "profile":
        from bench import profile

        return profile.main(args.seconds, args.only)

    from bench import report, run
    from bench.baseline import BaselineError

    try:
        results = run.run(run.Settings(quick=args.quick, only=args.only, baseline_tree=args.baseline_tree),
                          log=lambda m: print(m, file=sys.stderr, flush=True))
    except (run.NotInNamespace, BaselineError) as e:
        print(f"bench: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        print(f"bench: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("bench: interrupted; every process it started was stopped", file=sys.stderr)
        return 130
    md, js = report.write(results, args.out)
    print()
    print(report.markdown(results))
    print(f"bench: wrote {md} and {js}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
