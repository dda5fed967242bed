"""Sizes as Sluice's messages say them ("64 KiB", "2 MiB", "1500 bytes"): the
one place every refusal and problem text formats a byte count."""

from __future__ import annotations


def size_text(n: int) -> str:
    """`n` bytes in the largest binary unit that divides it exactly."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} bytes"
