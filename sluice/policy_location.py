"""Which policy file `sluice proxy` and `sluice policy check/explain` read
when no path is given: `$SLUICE_POLICY`, else /etc/sluice/policy.yaml, else
the starter policy packaged with Sluice.

A path the operator named (`--policy FILE` or `$SLUICE_POLICY`) is never
replaced by a fallback: a mistyped mount must not load a permissive policy,
so a missing named file is reported by the loader like any unreadable one.
Only the system path is looked up by existence.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from collections.abc import Mapping

ENV = "SLUICE_POLICY"
SYSTEM_POLICY = "/etc/sluice/policy.yaml"
STARTER_NAME = "starter_policy.yaml"
STARTER_LABEL = "starter policy (any public host)"


@dataclass(frozen=True)
class PolicyLocation:
    path: str
    label: str  # what the ready line calls it


def starter_path() -> str:
    """The packaged starter policy (package data; a plain file in a wheel install)."""
    return str(resources.files("sluice").joinpath(STARTER_NAME))


def locate(explicit: str | None, environ: Mapping[str, str] = os.environ,
           system: str = SYSTEM_POLICY) -> PolicyLocation:
    if explicit is not None:
        return PolicyLocation(explicit, explicit)
    named = environ.get(ENV, "")
    if named:
        return PolicyLocation(named, f"{named} (from ${ENV})")
    if os.path.lexists(system):  # present but unreadable is an error, not a reason to fall back
        return PolicyLocation(system, system)
    return PolicyLocation(starter_path(), STARTER_LABEL)


def write_starter(target: str, *, force: bool = False) -> str | None:
    """`sluice policy init FILE`: the starter policy, commented; None on
    success, else a message. `-` writes to stdout."""
    text = Path(starter_path()).read_text(encoding="utf-8")
    if target == "-":
        print(text, end="")
        return None
    path = Path(target)
    if path.exists() and not force:
        return f"{target} already exists; choose another FILE or pass --force to overwrite it"
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as e:
        return f"cannot write {target}: {e.strerror or e}"
    return None
