"""Installs the benchmark's outside tools when missing: nginx, wrk,
tinyproxy and redis-server from Debian's packages, proxy.py from PyPI into the venv.

Runs outside the namespace (there is no package registry inside it); `make
bench` calls it first. Never fails the build: a tool still missing makes its
contender n/a in the report (without redis-server the `store` phase is skipped).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

PACKAGES = {"nginx": "nginx-light", "wrk": "wrk", "tinyproxy": "tinyproxy", "redis-server": "redis-server"}
# A contender, not a dependency of Sluice: pinned here, installed into the venv.
PYTHON_PACKAGES = {"proxy": "proxy.py==2.4.10"}
POLICY_RC = Path("/usr/sbin/policy-rc.d")  # tells Debian packages not to start their services


def _have(tool: str) -> bool:
    return shutil.which(tool) is not None or Path("/usr/sbin", tool).exists() or Path("/usr/bin", tool).exists()


def missing() -> list[str]:
    return [pkg for tool, pkg in PACKAGES.items() if not _have(tool)]


def ensure() -> int:
    _ensure_python()
    need = missing()
    if not need:
        return 0
    if os.environ.get("SLUICE_NETNS") == "1":
        print(f"bench: missing {' '.join(need)}; cannot install inside the namespace (run `make bench`)", file=sys.stderr)
        return 0
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        print(f"bench: missing {' '.join(need)}; install them (apt-get install {' '.join(need)}) "
              "or those contenders are reported n/a", file=sys.stderr)
        return 0
    print(f"bench: installing {' '.join(need)}", file=sys.stderr)
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    # The benchmark runs its own nginx and tinyproxy; the packages' system
    # services must not start (and listen on :80 / :8888) on the host.
    made_policy_rc = False
    if not POLICY_RC.exists():
        POLICY_RC.write_text("#!/bin/sh\n# temporary, written by `python -m bench deps`\nexit 101\n")
        POLICY_RC.chmod(0o755)
        made_policy_rc = True
    try:
        install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *need]
        if subprocess.run(install, env=env, timeout=600).returncode != 0:
            subprocess.run(["apt-get", "update", "-q"], env=env, timeout=600)
            subprocess.run(install, env=env, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        print(f"bench: apt-get failed: {e}", file=sys.stderr)
    finally:
        if made_policy_rc:
            POLICY_RC.unlink(missing_ok=True)
    still = missing()
    if still:
        print(f"bench: still missing {' '.join(still)}; those contenders will be n/a", file=sys.stderr)
    return 0


def _ensure_python() -> None:
    bin_dir = Path(sys.executable).parent
    need = [spec for exe, spec in PYTHON_PACKAGES.items() if not (bin_dir / exe).exists()]
    if not need:
        return
    if os.environ.get("SLUICE_NETNS") == "1":
        print(f"bench: missing {' '.join(need)}; cannot install inside the namespace (run `make bench`)", file=sys.stderr)
        return
    print(f"bench: installing {' '.join(need)} into {sys.prefix}", file=sys.stderr)
    try:
        done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", *need], timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        print(f"bench: pip failed: {e}", file=sys.stderr)
        return
    if done.returncode != 0:
        print(f"bench: pip could not install {' '.join(need)}; that contender will be n/a", file=sys.stderr)
