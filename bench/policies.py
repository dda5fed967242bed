"""The policies the benchmark runs Sluice with.

- default: config/policy.yaml as shipped, with `dns.nameservers` pointed at
  the benchmark's fake DNS server.
- baseline: another checkout's config/policy.yaml, likewise (--baseline-tree).
- limits: the default with every quota on, none ever refusing; limits-store:
  the same counted in the benchmark's redis-server (written once it is up).
- large: the same plus an allow list of 10,000 host patterns (exact, `*.`
  and `**.` forms, one of them `**.example` so the benchmark's host is
  allowed) and 500 CIDRs starting at a public address (plus 8.8.8.0/24, for
  IP-literal requests), and a
  deny list of 500 CIDRs: 1,000 CIDRs in all, IPv4 /12 to /32 and some IPv6,
  none of the deny ones holding 8.8.8.8. Both the name matcher and the
  address matcher (one probe per prefix length) run on every request.
"""

from __future__ import annotations

import ipaddress
import random
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
DEFAULT_POLICY = REPO / "config" / "policy.yaml"
DNS_SERVER = "127.0.0.53"
HOST_PATTERNS = 10_000
CIDRS = 1_000
ORIGIN = ipaddress.ip_address("8.8.8.8")

_WORDS = ["api", "svc", "cdn", "data", "auth", "edge", "img", "pkg", "git", "mail", "docs", "app", "static", "files"]
_TLDS = ["com", "net", "org", "io", "dev", "co.uk", "de", "ai", "cloud", "app"]


def base_policy(dns_server: str = DNS_SERVER, source: Path = DEFAULT_POLICY) -> dict:
    data = yaml.safe_load(source.read_text(encoding="utf-8")) or {}
    dns = dict(data.get("dns") or {})
    dns["nameservers"] = [dns_server]
    data["dns"] = dns
    return data


def host_patterns(n: int = HOST_PATTERNS, seed: int = 1) -> list[str]:
    rng = random.Random(seed)
    out = {"**.example"}
    while len(out) < n:
        name = f"{rng.choice(_WORDS)}{rng.randrange(100000)}.{rng.choice(_WORDS)}{rng.randrange(1000)}.{rng.choice(_TLDS)}"
        form = rng.random()
        out.add(name if form < 0.5 else f"*.{name}" if form < 0.8 else f"**.{name}")
    return sorted(out)


def cidrs(n: int, seed: int, public: bool = False) -> list[str]:
    """n random CIDRs, none holding the origin or loopback. public: each
    starts with a public address (the loader refuses an allow CIDR whose every
    address Sluice would refuse anyway)."""
    from sluice.policy.ranges import classify

    rng = random.Random(seed)
    out: set[str] = set()
    while len(out) < n:
        if rng.random() < 0.15:
            prefix = rng.choice([32, 40, 48, 56, 64, 128])
            net = ipaddress.ip_network((rng.getrandbits(128) & ~((1 << (128 - prefix)) - 1), prefix))
            if net.overlaps(ipaddress.ip_network("2606:4700:4700::1111/128")):
                continue
        else:
            prefix = rng.randrange(12, 33)
            net = ipaddress.ip_network((rng.getrandbits(32) & ~((1 << (32 - prefix)) - 1), prefix))
            if ORIGIN in net or net.overlaps(ipaddress.ip_network("127.0.0.0/8")):
                continue
        if public and classify(str(net.network_address)) is not None:
            continue
        out.add(str(net))
    return sorted(out)


def large_policy(dns_server: str = DNS_SERVER) -> dict:
    data = base_policy(dns_server)
    allow_cidrs = cidrs(CIDRS // 2, seed=2, public=True)
    deny_cidrs = [c for c in cidrs(CIDRS, seed=3) if c not in allow_cidrs][: CIDRS - len(allow_cidrs)]
    # 8.8.8.0/24 lets the microbenchmark's IP-literal case through by address.
    data["allow"] = host_patterns() + allow_cidrs + ["8.8.8.0/24"]
    data["deny"] = deny_cidrs
    return data


def write(path: Path, data: dict, comment: str) -> Path:
    text = f"# {comment}\n" + yaml.safe_dump(data, sort_keys=False, default_flow_style=None, width=120)
    path.write_text(text, encoding="utf-8")
    return path


def write_baseline(directory: Path, tree: Path, dns_server: str = DNS_SERVER) -> Path:
    """The default policy of another checkout (--baseline-tree), with the fake DNS server."""
    return write(directory / "policy-baseline.yaml", base_policy(dns_server, tree / "config" / "policy.yaml"),
                 f"{tree}/config/policy.yaml with the benchmark's fake DNS server")


# Every quota on, none ever refusing: the cost of counting (issue 15's
# "the performance table still meets its targets with limits configured").
QUOTA_LIMITS = {"requests_per_second": 1_000_000_000, "burst": 1_000_000_000, "bytes_per_hour": 2**50,
                "max_requests_per_host_per_minute": 1_000_000_000, "max_connections": 1_000_000, "max_tunnels": 1_000_000}


def limits_policy(dns_server: str = DNS_SERVER) -> dict:
    data = base_policy(dns_server)
    data["limits"] = {**(data.get("limits") or {}), **QUOTA_LIMITS}
    return data


def store_policy(store_url: str, timeout: str, dns_server: str = DNS_SERVER) -> dict:
    """limits_policy() with its counters in a shared store (bench.store)."""
    data = limits_policy(dns_server)
    data["state"] = {"store": {"url": store_url}, "timeout": timeout}
    return data


def write_store(directory: Path, store_url: str, timeout: str) -> Path:
    return write(directory / "policy-limits-store.yaml", store_policy(store_url, timeout),
                 f"the limits policy with its counters in {store_url} (state.store)")


def write_all(directory: Path, dns_server: str = DNS_SERVER) -> dict[str, Path]:
    return {
        "limits": write(directory / "policy-limits.yaml", limits_policy(dns_server),
                        "config/policy.yaml with every quota limit on (none ever refusing)"),
        "default": write(directory / "policy-default.yaml", base_policy(dns_server),
                         "config/policy.yaml with the benchmark's fake DNS server"),
        "large": write(directory / "policy-10k.yaml", large_policy(dns_server),
                       f"{HOST_PATTERNS} host patterns and {CIDRS} CIDRs (generated by bench.policies)"),
    }
