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
from dataclasses import dataclass, replace
from typing import Protocol

import dns.asyncresolver
import dns.exception
import dns.message
import dns.name
import dns.nameserver
import dns.rdatatype
import dns.resolver

from sluice.policy.decide import Decision, Destination, check_answers, check_request
from sluice.policy.hosts import NameHost, internal_name
from sluice.policy.model import DnsSettings, Rules
from sluice.policy.reasons import DNS_NO_NAME_ADVICE, DNS_TRANSIENT_ADVICE, Reason, Refusal

MAX_CNAME_HOPS = 8
CACHE_ENTRIES = 10_000
NEGATIVE_TTL = 5.0  # how long "no such name" is remembered

# Told of each decision's time, each cache hit or miss and each upstream
# lookup (addons/metrics.py ResolverMetrics); None: nothing is measured.
class Observer(Protocol):
    def decision(self, seconds: float) -> None: ...
    def cache(self, hit: bool) -> None: ...
    def lookup(self, seconds: float, ok: bool) -> None: ...


_observer: Observer | None = None


def set_observer(observer: Observer | None) -> None:
    global _observer
    _observer = observer


@dataclass(frozen=True, slots=True)
class Resolution:
    addresses: tuple[str, ...]  # every A and AAAA answer at the end of the chain
    cnames: tuple[str, ...]  # names the chain passed through (without the first)
    ttl: float


class DnsFailure(Exception):
    """The name could not be resolved; `str()` is a phrase for the refusal.

    `transient` failures (a timeout, SERVFAIL, a refused query) may pass, so
    the refusal says retrying later is reasonable; the others (NXDOMAIN, no
    address records) will not, and are remembered briefly (`cacheable`).
    `cnames` are the aliases the lookup passed through before it failed, so a
    chain into an internal name is refused as that, not as a DNS failure."""

    def __init__(self, detail: str, *, cacheable: bool = False, transient: bool = False,
                 cnames: tuple[str, ...] = ()) -> None:
        super().__init__(detail)
        self.cacheable = cacheable
        self.transient = transient
        self.cnames = cnames


class NameResolver(Protocol):
    """What a decision resolves names with: PinnedResolver (the proxy's),
    StaticResolver (a fixed table), or the CLI's live one."""

    async def resolve(self, name: str) -> Resolution: ...


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
                if _observer is not None:
                    _observer.cache(True)
                if isinstance(value, DnsFailure):
                    raise value
                return value
            del self._cache[name]
        if _observer is not None:
            _observer.cache(False)
        pending = self._inflight.get(name)
        if pending is None:
            pending = asyncio.ensure_future(self._lookup(name))
            self._inflight[name] = pending
            pending.add_done_callback(lambda _f: self._inflight.pop(name, None))
        return await asyncio.shield(pending)

    async def _lookup(self, name: str) -> Resolution:
        self.queries += 1
        started = time.perf_counter()
        try:
            result = await self._resolve_uncached(name)
        except DnsFailure as failure:
            if _observer is not None:
                _observer.lookup(time.perf_counter() - started, False)
            if failure.cacheable:
                self._store(name, failure, NEGATIVE_TTL)
            raise
        if _observer is not None:
            _observer.lookup(time.perf_counter() - started, True)
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
                cnames += [c for c in r.cnames if c not in cnames]
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
                # Report what is known best: a chain (it may name an
                # internal alias), then "does not exist" over "timed out".
                failure = max(failures, key=lambda f: (bool(f.cnames), not f.transient))
                if cnames and not failure.cnames:
                    failure.cnames = tuple(cnames)
                raise failure
            raise DnsFailure(f"{name} has no A or AAAA records", cacheable=True)
        ttl = min(max(min(ttls), self.settings.min_ttl), self.settings.max_ttl)
        return Resolution(tuple(dict.fromkeys(addresses)), tuple(cnames), ttl)

    async def _family(self, name: str, rdtype: dns.rdatatype.RdataType) -> tuple[list[str], list[str], float]:
        qname = dns.name.from_text(name)
        chain: list[str] = []
        for _hop in range(MAX_CNAME_HOPS):
            try:
                answer = await self._resolver.resolve(qname, rdtype, search=False, raise_on_no_answer=False)
            except dns.resolver.NXDOMAIN as e:
                for response in e.kwargs.get("responses", {}).values():
                    _add_chain(chain, response)  # the aliases the server followed to the missing name
                missing = (f"{name} is an alias (CNAME) of {chain[-1]}, which does not exist" if chain
                           else f"{name} does not exist")
                raise DnsFailure(f"{missing} (NXDOMAIN: no such name in DNS)", cacheable=True,
                                 cnames=tuple(chain)) from None
            except dns.resolver.LifetimeTimeout:
                raise DnsFailure(f"the DNS lookup of {_via(name, chain)} timed out after {self.settings.timeout:g}s",
                                 transient=True, cnames=tuple(chain)) from None
            except dns.resolver.NoNameservers:
                raise DnsFailure(f"no nameserver could answer for {_via(name, chain)} (SERVFAIL or refused)",
                                 transient=True, cnames=tuple(chain)) from None
            except dns.exception.DNSException as e:
                raise DnsFailure(f"the DNS lookup of {_via(name, chain)} failed ({type(e).__name__})",
                                 transient=True, cnames=tuple(chain)) from None
            chaining = _add_chain(chain, answer.response)
            if answer.rrset is not None:
                if chaining is None:  # an answer whose CNAMEs cannot be followed: fail closed
                    raise DnsFailure(f"the DNS answer for {_via(name, chain)} could not be read",
                                     transient=True, cnames=tuple(chain))
                addrs = [rdata.address for rdata in answer.rrset]
                return addrs, chain, float(chaining.minimum_ttl)
            if answer.canonical_name == qname:
                return [], chain, float(self.settings.min_ttl)  # no records of this type
            qname = answer.canonical_name  # the server stopped mid-chain: follow it ourselves
            if internal_name(qname.to_text(omit_final_dot=True).lower()):
                # Never ask about an internal name: the chain refuses it by name.
                return [], chain, float(self.settings.min_ttl)
        raise DnsFailure(f"{name} has a CNAME chain longer than {MAX_CNAME_HOPS} hops")


def _add_chain(chain: list[str], response: dns.message.Message) -> dns.message.ChainingResult | None:
    """Append the CNAME targets a response's answer passes through to `chain`;
    returns its ChainingResult (None if the response cannot be chained)."""
    if not isinstance(response, dns.message.QueryMessage):
        return None
    try:
        chaining = response.resolve_chaining()
    except dns.exception.DNSException:
        return None
    for rrset in chaining.cnames:
        for rdata in rrset:
            target = rdata.target.to_text(omit_final_dot=True).lower()
            if target not in chain:
                chain.append(target)
    return chaining


def _via(name: str, chain: list[str]) -> str:
    return f"{name} (an alias of {chain[-1]})" if chain else name


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


async def resolve_and_decide(rules: Rules, dest: Destination, resolver: NameResolver) -> Decision:
    """The whole decision for one destination: the pure checks, with the
    lookup in between: every decision the gate, the redirect guard and
    `sluice policy explain`/`test` make goes through it.
    A refusal carries the rules' `refusal_note`."""
    if _observer is None:
        return _noted(await _decide(rules, dest, resolver), rules)
    started = time.perf_counter()
    decision = _noted(await _decide(rules, dest, resolver), rules)
    _observer.decision(time.perf_counter() - started)
    return decision


async def _decide(rules: Rules, dest: Destination, resolver: NameResolver) -> Decision:
    decision = check_request(rules, dest)
    if not decision.needs_dns:
        return decision
    assert isinstance(decision.host, NameHost), "only a name needs DNS"
    try:
        resolution = await resolver.resolve(decision.host.name)
    except DnsFailure as failure:
        # An alias into an internal name is refused as that, whatever became
        # of the lookup after it (the name it points to may well not exist).
        aliased = _internal_alias(decision, failure.cnames)
        if aliased is not None:
            return aliased
        advice = DNS_TRANSIENT_ADVICE if failure.transient else DNS_NO_NAME_ADVICE
        return Decision(False, decision.host, Refusal(Reason.DNS_FAILED, str(failure), advice=advice), port=dest.port)
    aliased = _internal_alias(decision, resolution.cnames)
    if aliased is not None:
        return aliased
    decision = check_answers(rules, decision, resolution.addresses, resolution.cnames)
    if decision.reason is Reason.DNS_FAILED and decision.refusal is not None:
        # No address at the end of the chain: a fact about the name, not a passing failure.
        decision = replace(decision, refusal=replace(decision.refusal, advice=DNS_NO_NAME_ADVICE))
    return decision


def _internal_alias(pending: Decision, cnames: tuple[str, ...]) -> Decision | None:
    """The refusal for a CNAME chain that passes through an internal name,
    naming that name and the chain to it (check_answers refuses the same
    chains; this says which hops led there)."""
    for i, alias in enumerate(cnames):
        why = internal_name(alias)
        if why:
            chain = f" (chain: {' -> '.join((str(pending.host), *cnames[:i + 1]))})" if i else ""
            refusal = Refusal(Reason.DNS_ANSWER_NOT_PUBLIC,
                              f"{pending.host} is an alias (CNAME) of {alias}, which is {why}{chain}")
            return Decision(False, pending.host, refusal, port=pending.port)
    return None


def _noted(decision: Decision, rules: Rules) -> Decision:
    if decision.refusal is None or not rules.refusal_note:
        return decision
    return replace(decision, refusal=decision.refusal.with_note(rules.refusal_note))
