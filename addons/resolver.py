"""Sluice's own resolver (dnspython): the only place names become addresses.

The proxy never lets mitmproxy or the OS resolve a name: it resolves here,
checks every answer, and hands mitmproxy the one validated IP to dial. Answers
are cached for their TTL (clamped to the policy's window) so repeated requests
reuse the same pinned address; concurrent lookups of one name share one query.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from dataclasses import dataclass

import dns.asyncresolver
import dns.exception
import dns.name
import dns.nameserver
import dns.rdatatype
import dns.resolver

from policy.decide import Decision, Destination, check_answers, check_request
from policy.model import DnsSettings, Rules
from policy.reasons import Reason, Refusal

MAX_CNAME_HOPS = 8
CACHE_ENTRIES = 10_000
NEGATIVE_TTL = 5.0  # how long "no such name" is remembered


@dataclass(frozen=True, slots=True)
class Resolution:
    addresses: tuple[str, ...]  # every A and AAAA answer at the end of the chain
    cnames: tuple[str, ...]  # names the chain passed through (without the first)
    ttl: float


class DnsFailure(Exception):
    """The name could not be resolved; `str()` is a phrase for the refusal.
    `cacheable` failures (the name does not exist) are remembered briefly;
    timeouts and server failures are not."""

    def __init__(self, detail: str, *, cacheable: bool = False) -> None:
        super().__init__(detail)
        self.cacheable = cacheable


class PinnedResolver:
    def __init__(self, settings: DnsSettings) -> None:
        self.settings = settings
        self._resolver = dns.asyncresolver.Resolver(configure=not settings.nameservers)
        if settings.nameservers:
            self._resolver.nameservers = [dns.nameserver.Do53Nameserver(h, p) for h, p in settings.nameservers]
        self._resolver.lifetime = settings.timeout
        self._resolver.timeout = settings.timeout
        self._resolver.search = []
        self._cache: OrderedDict[str, tuple[float, Resolution | DnsFailure]] = OrderedDict()
        self._inflight: dict[str, asyncio.Future[Resolution]] = {}
        self.queries = 0  # upstream lookups made (for tests and metrics)

    def cached(self, name: str) -> Resolution | None:
        entry = self._cache.get(name)
        if entry and entry[0] > time.monotonic() and isinstance(entry[1], Resolution):
            return entry[1]
        return None

    async def resolve(self, name: str) -> Resolution:
        """All addresses for `name` (a normalised DNS name); raises DnsFailure."""
        entry = self._cache.get(name)
        if entry is not None:
            expires, value = entry
            if expires > time.monotonic():
                self._cache.move_to_end(name)
                if isinstance(value, DnsFailure):
                    raise value
                return value
            del self._cache[name]
        pending = self._inflight.get(name)
        if pending is None:
            pending = asyncio.ensure_future(self._lookup(name))
            self._inflight[name] = pending
            pending.add_done_callback(lambda _f: self._inflight.pop(name, None))
        return await asyncio.shield(pending)

    async def _lookup(self, name: str) -> Resolution:
        self.queries += 1
        try:
            result = await self._resolve_uncached(name)
        except DnsFailure as failure:
            if failure.cacheable:
                self._store(name, failure, NEGATIVE_TTL)
            raise
        self._store(name, result, result.ttl)
        return result

    def _store(self, name: str, value: Resolution | DnsFailure, ttl: float) -> None:
        self._cache[name] = (time.monotonic() + ttl, value)
        self._cache.move_to_end(name)
        while len(self._cache) > CACHE_ENTRIES:
            self._cache.popitem(last=False)

    async def _resolve_uncached(self, name: str) -> Resolution:
        results = await asyncio.gather(
            self._family(name, dns.rdatatype.A), self._family(name, dns.rdatatype.AAAA),
            return_exceptions=True,
        )
        addresses: list[str] = []
        cnames: list[str] = []
        ttls: list[float] = []
        failures: list[DnsFailure] = []
        for r in results:
            if isinstance(r, DnsFailure):
                failures.append(r)
            elif isinstance(r, BaseException):
                raise r
            else:
                addrs, chain, ttl = r
                addresses += addrs
                cnames += [c for c in chain if c not in cnames]
                if addrs:
                    ttls.append(ttl)
        if cnames and not addresses and not failures:
            # The chain led somewhere with no address: report the chain so the
            # decision can still refuse an internal target by name.
            return Resolution((), tuple(cnames), self.settings.min_ttl)
        if not addresses:
            if failures:
                # One family's answer is enough; both failing fails closed.
                raise failures[0]
            raise DnsFailure(f"{name} has no A or AAAA records", cacheable=True)
        ttl = min(max(min(ttls), self.settings.min_ttl), self.settings.max_ttl)
        return Resolution(tuple(dict.fromkeys(addresses)), tuple(cnames), ttl)

    async def _family(self, name: str, rdtype: dns.rdatatype.RdataType) -> tuple[list[str], list[str], float]:
        qname = dns.name.from_text(name)
        chain: list[str] = []
        for _hop in range(MAX_CNAME_HOPS):
            try:
                answer = await self._resolver.resolve(qname, rdtype, search=False, raise_on_no_answer=False)
            except dns.resolver.NXDOMAIN:
                raise DnsFailure(f"{name} does not exist (NXDOMAIN)", cacheable=True) from None
            except dns.resolver.LifetimeTimeout:
                raise DnsFailure(f"the DNS lookup of {name} timed out after {self.settings.timeout:g}s") from None
            except dns.resolver.NoNameservers:
                raise DnsFailure(f"no nameserver could answer for {name} (SERVFAIL or refused)") from None
            except dns.exception.DNSException as e:
                raise DnsFailure(f"the DNS lookup of {name} failed ({type(e).__name__})") from None
            chaining = answer.response.resolve_chaining()
            for rrset in chaining.cnames:
                for rdata in rrset:
                    target = rdata.target.to_text(omit_final_dot=True).lower()
                    if target not in chain:
                        chain.append(target)
            if answer.rrset is not None:
                addrs = [rdata.address for rdata in answer.rrset]
                return addrs, chain, float(chaining.minimum_ttl)
            if answer.canonical_name == qname:
                return [], chain, float(self.settings.min_ttl)  # no records of this type
            qname = answer.canonical_name  # the server stopped mid-chain: follow it ourselves
        raise DnsFailure(f"{name} has a CNAME chain longer than {MAX_CNAME_HOPS} hops")


class StaticResolver:
    """Answers from a fixed table (`sluice policy explain --resolve HOST=IP`,
    policy test cases); a name not in the table fails like NXDOMAIN."""

    def __init__(self, table: dict[str, list[str]]) -> None:
        self.table = table

    async def resolve(self, name: str) -> Resolution:
        addresses = self.table.get(name)
        if not addresses:
            raise DnsFailure(f"{name} has no address in the given --resolve table", cacheable=True)
        return Resolution(tuple(addresses), (), 0.0)


async def decide(rules: Rules, dest: Destination, resolver: PinnedResolver | StaticResolver) -> Decision:
    """The whole decision for one destination: the pure checks, with the
    lookup in between. The gate and `sluice policy explain` both use this."""
    decision = check_request(rules, dest)
    if not decision.needs_dns:
        return decision
    try:
        resolution = await resolver.resolve(decision.host.name)
    except DnsFailure as failure:
        return Decision(False, decision.host, Refusal(Reason.DNS_FAILED, str(failure)), port=dest.port)
    return check_answers(rules, decision, resolution.addresses, resolution.cnames)
