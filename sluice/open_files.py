"""Running out of file descriptors: one line, never a traceback.

Every client connection costs the proxy a file descriptor, and each of its
upstream connections another (at most 1 + `limits.max_upstreams_per_connection`
per client connection). When the process reaches its open-files limit:

- asyncio's accept loop gets EMFILE, pauses accepting for a second and hands
  the error to the loop's exception handler, which mitmproxy logs as a
  traceback each time (hundreds a second under a flood). `OutOfFiles` wraps
  that handler (sluice/proxy.py) and turns them into one line;
- a dial to an origin fails with EMFILE (addons/mitm_patches.py dial_check):
  the request is refused `too_many_connections` (addons/caps.py) and the
  same line is reported.

The line says what ran out and what to do, at most once every
LINE_EVERY_SECONDS, counting what it did not repeat. `raise_limit` lifts the
soft open-files limit to the hard one at start-up (containers usually allow
far more than the soft default of 1024).
"""

from __future__ import annotations

import errno
import resource
import sys
import time

# Errors that mean the process (or the system) has no descriptor or buffer to spare.
OUT_OF_FILES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
LINE_EVERY_SECONDS = 10.0


def is_out_of_files(error: BaseException | None) -> bool:
    return isinstance(error, OSError) and error.errno in OUT_OF_FILES


def raise_limit() -> tuple[int, int]:
    """Lift the soft RLIMIT_NOFILE to the hard limit; return (soft, hard) after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        try:
            target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            pass
    return resource.getrlimit(resource.RLIMIT_NOFILE)


class Reporter:
    """The rate-limited line."""

    def __init__(self, clock=time.monotonic, out=None) -> None:
        self.clock = clock
        self.out = out
        self.last: float | None = None
        self.suppressed = 0

    def report(self, while_doing: str, error: OSError) -> None:
        now = self.clock()
        if self.last is not None and now - self.last < LINE_EVERY_SECONDS:
            self.suppressed += 1
            return
        more = f" ({self.suppressed} more since the last line)" if self.suppressed else ""
        self.last, self.suppressed = now, 0
        name = errno.errorcode.get(error.errno, str(error.errno))
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        print(f"sluice: out of file descriptors ({name}: {error.strerror}) while {while_doing}{more}; new connections "
              f"wait and dials are refused (too_many_connections) until some close. Raise the open-files limit "
              f"(now {soft}) or lower limits.max_total_connections", file=self.out or sys.stderr, flush=True)


REPORTER = Reporter()


def report(while_doing: str, error: OSError) -> None:
    REPORTER.report(while_doing, error)


class OutOfFiles:
    """An asyncio loop exception handler: out-of-files errors (the accept
    loop's) become the one line; anything else goes to `inner`."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __call__(self, loop, context) -> None:
        error = context.get("exception")
        if is_out_of_files(error):
            report("accepting connections (accepting pauses for a second)", error)
            return
        self.inner(loop, context)
