"""Run a command as the image's unprivileged user, seeing the files it needs.

    argv = as_user(["sluice", "proxy", ...], uid=10001, gid=10001, stash=Path(tempfile.mkdtemp()),
                   readable=[interpreter_paths()...], read_only=[ca_dir])

The image installs Python and Sluice where every user may read them
(/opt/sluice). A test checkout is not laid out like that: the interpreter
may live under a directory closed to other users (pyenv under /root, 0700).
So the command runs in a private mount namespace (`unshare -m`, as root)
where every directory on the way to a `readable` path that the user could
not pass through is covered by an empty tmpfs (mode 0755) holding only the
child on the way, bind-mounted back: the paths stay the same and nothing
else of that directory is visible. No mode on the real filesystem changes.
`read_only` directories are bind-mounted read-only, as `:ro` volumes are.
Then `setpriv` drops to uid:gid with no supplementary groups and no
capabilities (the kernel clears them when root's uids change), and execs
the command: its pid is the command's.

Needs root (CI runs as root) and util-linux (unshare, mount, setpriv).
"""

from __future__ import annotations

import os
import shlex
import shutil
import stat
import sys
from pathlib import Path


def missing() -> str | None:
    """Why as_user cannot work here, or None."""
    if os.geteuid() != 0:
        return "running a command as another uid needs root (CI runs as root)"
    absent = [tool for tool in ("unshare", "mount", "setpriv") if shutil.which(tool) is None]
    if absent:
        return f"needs {', '.join(absent)} (util-linux)"
    return None


def interpreter_paths() -> list[Path]:
    """What this venv's Python needs: the base installation, the venv and
    the checkout its editable install points at."""
    root = Path(__file__).resolve().parents[2]
    return [Path(os.path.realpath(sys.base_prefix)), Path(sys.prefix), root]


def _passable(path: Path, uid: int, gid: int) -> bool:
    info = path.stat()
    if info.st_uid == uid:
        bit = stat.S_IXUSR
    elif info.st_gid == gid:
        bit = stat.S_IXGRP
    else:
        bit = stat.S_IXOTH
    return bool(info.st_mode & bit)


def _openings(readable: list[Path], uid: int, gid: int) -> list[tuple[Path, list[str]]]:
    """(closed directory, the children on the way to readable paths), top down."""
    closed: dict[Path, set[str]] = {}
    for target in readable:
        target = Path(os.path.realpath(target))
        ancestors = list(reversed(target.parents))[1:] + [target]  # without "/"
        for above, below in zip(ancestors, ancestors[1:]):
            if not _passable(above, uid, gid):
                closed.setdefault(above, set()).add(below.name)
    return sorted(((d, sorted(children)) for d, children in closed.items()), key=lambda item: len(item[0].parts))


def as_user(argv: list[str], *, uid: int, gid: int, stash: Path, readable: list[Path] = (),
            read_only: list[Path] = ()) -> list[str]:
    """argv run as uid:gid in a mount namespace where `readable` can be reached
    and `read_only` is mounted read-only. `stash` is an empty directory the
    set-up may use (outside every closed directory: under /tmp itself, say)."""
    stash.mkdir(parents=True, exist_ok=True)
    openings = _openings(list(readable), uid, gid)
    for closed, _ in openings:
        assert closed not in Path(os.path.realpath(stash)).parents, f"the stash {stash} is inside {closed}"
    lines = ["set -e"]
    for i, (closed, children) in enumerate(openings):
        # (the child's path, where it is kept while the tmpfs covers its directory, how to make a mount point)
        moves = [(shlex.quote(str(closed / child)), shlex.quote(str(stash / f"{i}-{j}")),
                  "mkdir -p" if (closed / child).is_dir() else "touch") for j, child in enumerate(children)]
        lines += [f"{make} {kept} && mount --bind {inside} {kept}" for inside, kept, make in moves]
        lines.append(f"mount -t tmpfs -o mode=0755 sluice-test-opening {shlex.quote(str(closed))}")
        lines += [f"{make} {inside} && mount --bind {kept} {inside}" for inside, kept, make in moves]
    for directory in read_only:
        quoted = shlex.quote(str(directory))
        lines.append(f"mount --bind {quoted} {quoted} && mount -o remount,bind,ro {quoted}")
    lines.append('exec "$@"')
    drop = ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups", "--"]
    return ["unshare", "-m", "--propagation", "private", "sh", "-c", "\n".join(lines), "sh", *drop, *argv]
