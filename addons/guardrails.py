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


# mitmproxy defaults Sluice changes at start-up, and why; changing them back
# while running is refused.
SAFE_DEFAULTS = {
    # mitmproxy's WebSocket layer buffers each whole message before any hook
    # could count it; Sluice carries an accepted WebSocket as a capped,
    # metered TCP pipe instead (addons/upgrades.py).
    "websocket": False,
}


class Guardrails:
    def __init__(self) -> None:
        self._running = False

    def running(self) -> None:
        changes = {k: v for k, v in SAFE_DEFAULTS.items() if getattr(ctx.options, k) != v}
        if changes:
            ctx.options.update(**changes)
        self._running = True

    def configure(self, updated) -> None:
        if self._running:
            for name, safe in SAFE_DEFAULTS.items():
                if name in updated and getattr(ctx.options, name) != safe:
                    raise exceptions.OptionsError(f"Sluice keeps {name}={safe}: {name} would carry bytes its caps "
                                                  "cannot count.")
        for name, (bad, why) in UNSAFE.items():
            if name in updated and name in ctx.options and getattr(ctx.options, name) == bad:
                raise exceptions.OptionsError(f"Sluice refuses {name}={bad}: it {why}.")
        if "mode" in updated:
            for spec in ctx.options.mode:
                kind = spec.split(":", 1)[0].split("@", 1)[0].strip().lower()
                if kind in UNSAFE_MODES:
                    raise exceptions.OptionsError(f"Sluice refuses mode {spec!r}: {UNSAFE_MODES[kind]}.")
