"""Prometheus metrics, built from the audit log's decisions.

Every decision passes the audit log exactly once (addons/audit.py), so the
decision counters are an observer of its records (`AuditLog.listeners`):
requests and tunnels by decision, reason and profile, bytes, caps tripped,
policy reloads. What the audit log does not see is measured where it
happens, at no cost when metrics are off:

- decision time and DNS lookups: the resolver's hook (sluice/resolver.py
  `set_observer`): each whole decision, each upstream lookup, cache hits and
  misses;
- upstream connect time: this addon's `server_connected` hook;
- open client connections and open tunnels: sampled once a second from
  mitmproxy's connection table and the gate's tunnel table (nothing on the
  hot path).

Names follow Prometheus conventions with the `sluice_` prefix; `sluice
proxy --admin` serves them at /metrics. With `--workers N` each worker
writes its values to PROMETHEUS_MULTIPROC_DIR (prometheus_client's
multiprocess mode) and the supervisor serves the sum (`workers_registry`).
Label values are bounded: reasons are the fixed codes, profiles the policy's
names, events and decisions a handful of words. Hosts are not labels (top
refused hosts are in the audit log). Counters whose label values are fixed
(reloads and DNS lookups by result, caps by kind) show every value at 0
from the start.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any
from collections.abc import Callable

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, disable_created_metrics,
                               multiprocess)
from prometheus_client.metrics_core import Metric

from sluice import resolver
from sluice.policy.reasons import Reason

logger = logging.getLogger("sluice.metrics")

disable_created_metrics()  # no *_created series: half the scrape, nothing a dashboard uses

MULTIPROCESS = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))

# The reasons that are caps (limits) tripping, as opposed to policy refusals.
CAP_REASONS = frozenset({
    Reason.REQUEST_TOO_LARGE, Reason.RESPONSE_TOO_LARGE, Reason.CONNECT_TIMEOUT, Reason.REQUEST_TIMEOUT,
    Reason.TUNNEL_TOO_LARGE, Reason.TUNNEL_TIMEOUT, Reason.HEADERS_TOO_LARGE, Reason.HEADER_TIMEOUT,
})

FAST_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
NETWORK_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

REQUESTS = Counter("sluice_requests",
                   "Decided requests, CONNECTs and refused connections (audit lines other than tunnel and reload), "
                   "by audit event, decision, reason and client profile", ["event", "decision", "reason", "profile"])
TUNNELS = Counter("sluice_tunnels",
                  "Closed tunnels (CONNECT, SOCKS5, transparent), by decision, reason and client profile",
                  ["decision", "reason", "profile"])
BYTES_IN = Counter("sluice_received_bytes",
                   "Bytes from origins to clients (the audit log's bytes_in), by client profile", ["profile"])
BYTES_OUT = Counter("sluice_sent_bytes", "Bytes from clients to origins (the audit log's bytes_out), by client profile",
                    ["profile"])
CAPS = Counter("sluice_caps_tripped", "Size and time caps that cut an exchange or tunnel, by kind (the reason code)",
               ["kind"])
RELOADS = Counter("sluice_policy_reloads", "Policy reloads, by result (ok, failed)", ["result"])
POLICY = Gauge("sluice_policy_info", "The loaded policy: 1 for the sha256 of its file", ["sha256"],
               multiprocess_mode="livemax")
DECISION = Histogram("sluice_decision_seconds", "Time to decide one request or tunnel (DNS included)",
                     buckets=FAST_BUCKETS)
DNS_LOOKUP = Histogram("sluice_dns_lookup_seconds", "Upstream DNS lookups (cache misses), by result (ok, failed)",
                       ["result"], buckets=NETWORK_BUCKETS)
DNS_HITS = Counter("sluice_dns_cache_hits", "Names answered from Sluice's DNS cache")
DNS_MISSES = Counter("sluice_dns_cache_misses", "Names not in Sluice's DNS cache (a lookup, or one already under way)")
CONNECT = Histogram("sluice_upstream_connect_seconds", "Time to open a TCP connection to an origin",
                    buckets=NETWORK_BUCKETS)
OPEN_CONNECTIONS = Gauge("sluice_open_client_connections", "Client connections open now (sampled each second)",
                         multiprocess_mode="livesum")
OTLP_DROPPED = Counter("sluice_otlp_dropped", "Audit records not exported over OTLP (the queue was full or the "
                       "collector did not take their batch; addons/otlp.py)")
OPEN_TUNNELS = Gauge("sluice_open_tunnels", "Tunnels open now (sampled each second)", multiprocess_mode="livesum")

STATE_STORE_UP = Gauge("sluice_state_store_up", "1 while the policy's state.store answers, 0 while this process "
                       "counts without it (sluice/state_store.py); absent without a store", multiprocess_mode="livemin")
# Approvals (addons/approvals.py): what the shared state holds (every worker
# sees the same file, so the supervisor shows the largest), and each askable
# refusal's outcome: pending (asked or still waiting), granted, denied.
APPROVALS_PENDING = Gauge("sluice_approvals_pending", "Approval requests waiting for an operator's answer",
                          multiprocess_mode="livemax")
GRANTS_ACTIVE = Gauge("sluice_approval_grants_active", "Approval grants in force", multiprocess_mode="livemax")
APPROVAL_ASKS = Counter("sluice_approval_asks", "Askable refusals judged by the approvals, by outcome (pending, "
                        "granted, denied)", ["outcome"])
ASK_OUTCOMES = ("pending", "granted", "denied")

SAMPLE_SECONDS = 1.0

# The label values known before anything happens: each is a series at 0 from
# the first scrape, so rate() and alerts on them (a failed reload, a cap)
# work from the start, not only after the first occurrence. Labels that
# depend on traffic or the policy (profiles, reasons by event) appear when
# first seen.
RESULTS = ("ok", "failed")


def initialise_known_labels() -> None:
    for result in RESULTS:
        RELOADS.labels(result)
        DNS_LOOKUP.labels(result)
    for reason in sorted(CAP_REASONS):
        CAPS.labels(reason.value)
    for outcome in ASK_OUTCOMES:
        APPROVAL_ASKS.labels(outcome)


class ApprovalMetrics:
    """The approvals' observer (addons/approvals.py)."""

    def judged(self, outcome: str) -> None:
        APPROVAL_ASKS.labels(outcome).inc()

    def counts(self, pending: int, grants: int) -> None:
        APPROVALS_PENDING.set(pending)
        GRANTS_ACTIVE.set(grants)


class ResolverMetrics:
    """The resolver's observer (sluice/resolver.py): decision and DNS timings."""

    def decision(self, seconds: float) -> None:
        DECISION.observe(seconds)

    def cache(self, hit: bool) -> None:
        (DNS_HITS if hit else DNS_MISSES).inc()

    def lookup(self, seconds: float, ok: bool) -> None:
        DNS_LOOKUP.labels("ok" if ok else "failed").observe(seconds)


class Metrics:
    """The mitmproxy addon: feeds the metrics above from the audit records and
    a few hooks. `tunnels` returns the open tunnels' outcomes (the gate's)."""

    def __init__(self, audit, source, tunnels: Callable[[], Any]) -> None:
        self.source = source
        self.tunnels = tunnels
        self._children: dict[tuple, Any] = {}
        self._sha256: str | None = None
        self._sampler: asyncio.Task | None = None
        audit.listeners.append(self.observe)
        resolver.set_observer(ResolverMetrics())
        initialise_known_labels()

    # ---- the audit records ------------------------------------------------

    def _child(self, metric, *labels: str):
        key = (metric, labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def observe(self, record: dict) -> None:
        event = record["event"]
        if event == "state_store":
            if record["decision"] in ("up", "down"):
                STATE_STORE_UP.set(1 if record["decision"] == "up" else 0)
            elif record["decision"] == "connect":
                STATE_STORE_UP.set(1)  # until it fails
            return
        if event == "reload":
            self._child(RELOADS, record["decision"] or "").inc()
            self.policy_changed()
            return
        decision, reason, profile = record["decision"] or "", record["reason"] or "", record["profile"] or ""
        if event == "tunnel":
            self._child(TUNNELS, decision, reason, profile).inc()
        else:
            self._child(REQUESTS, event, decision, reason, profile).inc()
        if record["bytes_in"]:
            self._child(BYTES_IN, profile).inc(record["bytes_in"])
        if record["bytes_out"]:
            self._child(BYTES_OUT, profile).inc(record["bytes_out"])
        if decision == "refuse" and reason in CAP_REASONS:
            self._child(CAPS, reason).inc()

    def policy_changed(self) -> None:
        live = self.source.current
        sha256 = live.digest if live is not None else None
        if sha256 == self._sha256:
            return
        if self._sha256 is not None:
            if MULTIPROCESS:
                POLICY.labels(self._sha256).set(0)  # mmap'd values cannot be removed; the supervisor drops zeros
            else:
                POLICY.remove(self._sha256)
        if sha256 is not None:
            POLICY.labels(sha256).set(1)
        self._sha256 = sha256

    # ---- mitmproxy hooks ---------------------------------------------------

    def configure(self, updated) -> None:
        if "sluice_policy" in updated:
            self.policy_changed()

    def server_connected(self, data) -> None:
        server = data.server
        if server.timestamp_tcp_setup is not None and server.timestamp_start is not None:
            CONNECT.observe(max(0.0, server.timestamp_tcp_setup - server.timestamp_start))

    def running(self) -> None:
        self.policy_changed()
        if self._sampler is None:
            self._sampler = asyncio.ensure_future(self._sample())

    def done(self) -> None:
        if self._sampler is not None:
            self._sampler.cancel()
            self._sampler = None

    async def _sample(self) -> None:
        from mitmproxy import ctx

        while True:
            try:
                proxyserver = ctx.master.addons.get("proxyserver")
                OPEN_CONNECTIONS.set(len(proxyserver.connections) if proxyserver is not None else 0)
                OPEN_TUNNELS.set(sum(1 for outcome in self.tunnels() if not outcome.logged))
            except Exception:  # the sampler must never die
                logger.exception("metrics sampler error")
            await asyncio.sleep(SAMPLE_SECONDS)


# ---- the supervisor's view of its workers (`sluice proxy --workers N`) ------


class _LiveInfo:
    """The workers' multiprocess values, without the zeroed sha256 of a
    policy they no longer enforce."""

    def __init__(self, path: str) -> None:
        self.collector = multiprocess.MultiProcessCollector(None, path)

    def collect(self):
        for metric in self.collector.collect():
            if metric.name == "sluice_policy_info":
                metric.samples = [s for s in metric.samples if s.value]
            yield metric


class _WorkersProcess:
    """process_* metrics summed over the supervisor and its live workers
    (CPU seconds, memory, open fds; the earliest start time)."""

    def __init__(self, pids: Callable[[], list[int]]) -> None:
        self.pids = pids

    def collect(self):
        totals: dict[str, Metric] = {}
        for pid in [os.getpid(), *self.pids()]:
            try:
                metrics = list(ProcessCollector(pid=lambda pid=pid: pid, registry=None).collect())
            except Exception:  # a worker that just exited
                continue
            for metric in metrics:
                if not metric.samples:
                    continue
                value = metric.samples[0].value
                total = totals.get(metric.name)
                if total is None:
                    totals[metric.name] = metric
                    continue
                sample = total.samples[0]
                if metric.name.endswith("start_time_seconds"):
                    combined = min(sample.value, value)
                elif metric.name.endswith("max_fds"):
                    combined = max(sample.value, value)
                else:
                    combined = sample.value + value
                total.samples[0] = sample._replace(value=combined)
        yield from totals.values()


def workers_registry(path: str, pids: Callable[[], list[int]]) -> CollectorRegistry:
    """The registry the supervisor serves: every worker's values summed
    (gauges of open connections and tunnels over live workers)."""
    registry = CollectorRegistry()
    registry.register(_LiveInfo(path))
    registry.register(_WorkersProcess(pids))
    return registry
