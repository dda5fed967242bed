"""Start-up checks on mitmproxy options that would undo Sluice's guarantees."""

from __future__ import annotations

from mitmproxy import ctx, exceptions

# Options whose unsafe value Sluice refuses to run with, and why.
UNSAFE = {
    "emudhra": (True, "signs interception certificates with a publicly known compromised key"),
    "emudhra_old": (True, "signs interception certificates with a publicly known compromised key"),
    "ssl_insecure": (True, "would accept any upstream certificate when intercepting"),
    "validate_inbound_headers": (False, "turns off mitmproxy's request-smuggling protections"),
}


# Proxy modes that would let traffic around the gate, and why.
UNSAFE_MODES = {
    "upstream": "an upstream proxy resolves names again, undoing Sluice's pinned, validated addresses",
    "dns": "a DNS server mode would resolve any name for clients: a channel out that no policy checks",
}


class Guardrails:
    def configure(self, updated) -> None:
        for name, (bad, why) in UNSAFE.items():
            if name in updated and name in ctx.options and getattr(ctx.options, name) == bad:
                raise exceptions.OptionsError(f"Sluice refuses {name}={bad}: it {why}.")
        if "mode" in updated:
            for spec in ctx.options.mode:
                kind = spec.split(":", 1)[0].split("@", 1)[0].strip().lower()
                if kind in UNSAFE_MODES:
                    raise exceptions.OptionsError(f"Sluice refuses mode {spec!r}: {UNSAFE_MODES[kind]}.")
