"""Holds the live policy and its resolver; loads it at start-up.

Every decision reads `PolicySource.current` once and uses that one snapshot
throughout, so a reload swapping it in never mixes two policies in one decision.
"""

from __future__ import annotations

from dataclasses import dataclass

from mitmproxy import ctx, exceptions

from addons.resolver import PinnedResolver
from policy.loader import PolicyInvalid, load_policy_file
from policy.model import Policy


@dataclass(frozen=True, slots=True)
class LivePolicy:
    policy: Policy
    resolver: PinnedResolver
    generation: int


class PolicySource:
    def __init__(self) -> None:
        self.current: LivePolicy | None = None

    def load(self, loader) -> None:
        loader.add_option(
            "sluice_policy", str, "config/policy.yaml",
            "Path of Sluice's YAML egress policy.",
        )

    def configure(self, updated) -> None:
        if "sluice_policy" in updated:
            try:
                policy = load_policy_file(ctx.options.sluice_policy)
            except PolicyInvalid as e:
                raise exceptions.OptionsError(f"invalid policy:\n{e}") from None
            self.install(policy)

    def install(self, policy: Policy) -> LivePolicy:
        old = self.current
        resolver = old.resolver if old and old.policy.dns == policy.dns else PinnedResolver(policy.dns)
        self.current = LivePolicy(policy, resolver, (old.generation + 1) if old else 1)
        return self.current
