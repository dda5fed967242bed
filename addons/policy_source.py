"""Holds the live policy and its resolver; loads it, and reloads it safely.

Every decision reads `PolicySource.current` once and uses that one snapshot
throughout, so a reload swapping it in never mixes two policies in one
decision, and live connections are untouched by a swap.

Reload triggers: the file changing (polled: survives editors' write-to-temp
then rename and Kubernetes ConfigMap symlink swaps, since the path is re-read
through its symlinks each time) and SIGHUP. A new policy is validated in full
before the swap; a bad edit or a deleted file keeps the last good policy and
is reported (stderr in FILE:LINE:COL form, and a `reload` audit line).

A reload reads, parses and validates in a worker thread, never on the event
loop (a 4 MiB policy takes a while to parse), and only the swap runs on the
loop. The read itself (`policy.loader.read_regular_file`) opens non-blocking
and refuses anything but a regular file, so a path turned into a FIFO or a
device cannot wedge the worker. Reloads are serialized: a trigger during a
reload runs one more reload after it.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import signal
from dataclasses import dataclass
from collections.abc import Callable

from mitmproxy import ctx, exceptions

from sluice.addons.audit import AuditLog
from sluice.own_host import parent_loop_problems, proxy_listeners
from sluice.resolver import PinnedResolver
from sluice.policy.loader import PolicyInvalid, read_policy_file
from sluice.policy.model import Policy

logger = logging.getLogger("sluice.policy")
DEFAULT_POLICY = "config/policy.yaml"


@dataclass(frozen=True, slots=True)
class LivePolicy:
    policy: Policy
    resolver: PinnedResolver
    generation: int
    digest: str  # sha256 of the file's bytes


class PolicySource:
    def __init__(self, audit: AuditLog) -> None:
        self.audit = audit
        self.current: LivePolicy | None = None
        self._poller: asyncio.Task | None = None
        self._last_seen: tuple | None = None  # what the file looked like at the last check
        self._missing_reported = False
        self.poll_seconds = 1.0
        self._reload_failed = False  # the last reload attempt failed
        self._listeners: list[Callable[[LivePolicy], None]] = []
        self._reloading: asyncio.Task | None = None
        self._again = False  # a trigger arrived during the running reload
        self._explicit = False  # a SIGHUP asked for the next reload: it always answers on stderr

    def on_reload(self, callback: Callable[[LivePolicy], None]) -> None:
        """Call `callback(live)` on the event loop after each reload that swapped
        in a changed policy (not the first load, not an unchanged file)."""
        self._listeners.append(callback)

    def _notify(self, live: LivePolicy) -> None:
        for callback in list(self._listeners):
            try:
                callback(live)
            except Exception:  # a listener's bug must never break reloading
                logger.exception(f"policy reload listener {callback!r} failed")

    def load(self, loader) -> None:
        loader.add_option(
            "sluice_policy", str, "",
            f"Path of Sluice's YAML egress policy (unset: {DEFAULT_POLICY}).",
        )
        loader.add_option(
            # mitmproxy options have no float type: seconds as text, e.g. "0.5".
            "sluice_policy_poll", str, "1",
            "Seconds between checks of the policy file for changes (0 disables; SIGHUP always reloads).",
        )

    def configure(self, updated) -> None:
        if "sluice_policy_poll" in updated:
            try:
                self.poll_seconds = float(ctx.options.sluice_policy_poll)
                if self.poll_seconds < 0:
                    raise ValueError
            except ValueError:
                raise exceptions.OptionsError(
                    "sluice_policy_poll must be a number of seconds (0 disables), not "
                    f"{ctx.options.sluice_policy_poll!r}"
                ) from None
        if "sluice_policy" in updated and ctx.options.sluice_policy:
            path = ctx.options.sluice_policy
            try:
                policy, digest = self._read(path)
            except PolicyInvalid as e:
                raise exceptions.OptionsError(f"invalid policy:\n{e}") from None
            # Only the running proxy knows its listeners (`sluice policy check` cannot).
            loops = parent_loop_problems(policy, proxy_listeners())
            if loops:
                raise exceptions.OptionsError("invalid policy:\n" + "\n".join(loops))
            self.install(policy, digest)
            self._last_seen = _signature(path)

    def running(self) -> None:
        if self.current is None:
            # Never run without a policy: fall back to the default file, or stop.
            try:
                ctx.options.update(sluice_policy=DEFAULT_POLICY)
            except exceptions.OptionsError as e:
                logger.error(f"sluice: no usable policy ({e}); stopping")
                ctx.master.shutdown()
                return
        try:
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self.sighup)
        except (NotImplementedError, RuntimeError, ValueError):
            pass  # not the main thread (embedded use): polling still works
        if self.poll_seconds > 0 and self._poller is None:
            self._poller = asyncio.ensure_future(self._poll())

    def done(self) -> None:
        for task in (self._poller, self._reloading):
            if task is not None:
                task.cancel()
        self._poller = self._reloading = None

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.poll_seconds)
            try:
                signature = _signature(ctx.options.sluice_policy)
                if signature != self._last_seen:
                    self._last_seen = signature
                    await asyncio.shield(self.request_reload())
            except asyncio.CancelledError:
                raise
            except Exception:  # the watcher must never die
                logger.exception("policy watcher error")

    def sighup(self) -> None:
        """SIGHUP: reopen the audit file (log rotation) and reload, saying on
        stderr what came of it even when nothing changed. Never raises."""
        try:
            self.audit.reopen()
        except Exception:
            logger.exception("audit log reopen failed")
        self.request_reload(explicit=True)

    def request_reload(self, explicit: bool = False) -> asyncio.Task:
        """Start a reload; during one, ask for one more after it (any number of
        requests meanwhile make one). The task's result is the last reload's.
        `explicit` (SIGHUP): the reload reports its outcome even if the file
        is unchanged or still missing. Never raises."""
        self._explicit = self._explicit or explicit
        if self._reloading is None or self._reloading.done():
            self._again = False
            self._reloading = asyncio.ensure_future(self._reload_serially())
        else:
            self._again = True
        return self._reloading

    async def reload(self) -> bool:
        """Validate the file and swap it in; keep the last good policy on any failure."""
        return await self.request_reload()

    async def _reload_serially(self) -> bool:
        while True:
            self._again = False
            explicit, self._explicit = self._explicit, False
            try:
                ok = await self._reload_once(explicit)
            except asyncio.CancelledError:
                raise
            except Exception:  # one failed attempt must not end reloading
                logger.exception("policy reload failed")
                ok = False
            if not self._again:
                return ok

    async def _reload_once(self, explicit: bool = False) -> bool:
        """One reload. Every stderr line it prints ends in the state the proxy
        is then in: the generation it enforces."""
        path = ctx.options.sluice_policy
        if not path:
            return False
        outcome = await asyncio.to_thread(_read_off_loop, path)
        if ctx.options.sluice_policy != path:
            return False  # the option changed meanwhile and configure() loaded the new path
        if outcome is None:
            if not self._missing_reported or explicit:
                logger.warning(f"{path}: the policy file is gone; keeping the last good policy ({self._generation()})")
            if not self._missing_reported:
                self.audit.write(event="reload", decision="failed", detail=f"{path} is missing; last good policy kept")
                self._missing_reported = True
                self._reload_failed = True
            return False
        self._missing_reported = False
        if isinstance(outcome, PolicyInvalid):
            return self._refuse(path, [str(problem) for problem in outcome.problems])
        policy, digest = outcome
        if self.current is not None and digest == self.current.digest:
            if self._reload_failed:  # the last good file is back: say so
                self._reload_failed = False
                logger.warning(f"{path}: restored last good policy ({self._generation()})")
                self.audit.write(event="reload", decision="ok",
                                 detail=f"{path} restored (generation {self.current.generation})")
            elif explicit:
                logger.warning(f"{path}: unchanged; keeping the current policy ({self._generation()})")
            return True  # touched, not changed
        loops = parent_loop_problems(policy, proxy_listeners())
        if loops:
            return self._refuse(path, loops)
        self._reload_failed = False
        live = self.install(policy, digest)
        logger.warning(f"{path}: policy reloaded ({self._generation()})")
        self.audit.write(event="reload", decision="ok", detail=f"{path} generation {live.generation}")
        self._notify(live)
        return True

    def _refuse(self, path: str, problems: list[str]) -> bool:
        """A reload whose policy cannot be used: say why, keep the last good one."""
        for problem in problems:
            logger.error(problem)
        logger.error(f"{path}: reload refused ({len(problems)} problem(s)); keeping the last good policy "
                     f"({self._generation()})")
        self.audit.write(event="reload", decision="failed", detail="; ".join(problems[:20]))
        self._reload_failed = True
        return False

    def _generation(self) -> str:
        return f"generation {self.current.generation}" if self.current is not None else "no policy loaded"

    @staticmethod
    def _read(path: str) -> tuple[Policy, str]:
        policy, raw = read_policy_file(path)
        return policy, hashlib.sha256(raw).hexdigest()

    def install(self, policy: Policy, digest: str = "") -> LivePolicy:
        old = self.current
        resolver = old.resolver if old and old.policy.dns == policy.dns else PinnedResolver(policy.dns)
        self.current = LivePolicy(policy, resolver, (old.generation + 1) if old else 1, digest)
        # mitmproxy's per-connection idle watchdog reads tcp_timeout when a
        # connection opens; keep it equal to the policy's idle_timeout.
        idle = max(1, round(policy.rules.limits.idle_timeout))
        if ctx.options.tcp_timeout != idle:
            ctx.options.update(tcp_timeout=idle)
        return self.current


def _read_off_loop(path: str) -> tuple[Policy, str] | PolicyInvalid | None:
    """In a worker thread: None if the file is missing, else the policy and
    its digest, or the problems (returned, so the loop reports them)."""
    if not os.path.exists(path):
        return None
    try:
        return PolicySource._read(path)
    except PolicyInvalid as e:
        return e


def _signature(path: str) -> tuple | None:
    """Changes whenever the content the path leads to may have changed,
    including a symlink retargeted (ConfigMap ..data swaps) or a rename over it."""
    try:
        st = os.stat(path)  # follows symlinks
        return (os.path.realpath(path), st.st_ino, st.st_size, st.st_mtime_ns)
    except OSError:
        return None
