"""Runs a Python entry point with a profiler switched on and off by signals,
so a profile covers only the load, not start-up:

    python -m bench._profiled [--sample] OUT (module NAME | script PATH) ARGS...

START (SIGRTMIN+2) starts profiling the main thread (where mitmproxy's event
loop runs); STOP (SIGRTMIN+3) stops it and writes the result to OUT.
(mitmdump takes SIGUSR1 and SIGUSR2 for its own debug dumps.)

Two profilers:

- cProfile (the default): every call, exact counts; OUT is a pstats file.
  Its times are wall-clock, so on a shared machine they include the time the
  process was preempted, and its per-call overhead inflates call-heavy code.
- `--sample`: a CPU-time sampler. setitimer(ITIMER_PROF) fires a signal as
  the process consumes CPU (user + system, so never while it waits or is
  preempted: the samples are immune to the other load on a shared machine),
  and the handler records the interrupted Python stack. The kernel checks
  CPU timers on its tick, so a sample comes at most every 1/CONFIG_HZ s of
  CPU (4 ms at 250 Hz), whatever SAMPLE_INTERVAL asks: read shares. Time in C
  (a socket call, say) is charged to the Python line that made the call.
  OUT is JSON: {"interval": s, "samples": [[count, [[file, first line,
  function, current line], ... innermost last]], ...]}.
"""

import cProfile
import json
import runpy
import signal
import sys
from collections import Counter

START = signal.SIGRTMIN + 2
STOP = signal.SIGRTMIN + 3
SAMPLE_INTERVAL = 0.001  # seconds of process CPU time between samples


class Sampler:
    def __init__(self) -> None:
        self.counts: Counter = Counter()

    def _on_prof(self, _signum, frame) -> None:
        stack = []
        top_line = (frame.f_lineno or 0) if frame is not None else 0
        while frame is not None:
            stack.append(frame.f_code)
            frame = frame.f_back
        self.counts[(tuple(stack), top_line)] += 1

    def enable(self) -> None:
        signal.signal(signal.SIGPROF, self._on_prof)
        signal.setitimer(signal.ITIMER_PROF, SAMPLE_INTERVAL, SAMPLE_INTERVAL)

    def disable(self) -> None:
        signal.setitimer(signal.ITIMER_PROF, 0, 0)

    def dump_stats(self, out: str) -> None:
        samples = []
        for (codes, top_line), n in self.counts.items():
            frames = [[c.co_filename, c.co_firstlineno, c.co_name, 0] for c in reversed(codes)]
            if frames:
                frames[-1][3] = top_line
            samples.append([n, frames])
        with open(out, "w", encoding="utf-8") as f:
            json.dump({"interval": SAMPLE_INTERVAL, "samples": samples}, f)


def _main() -> None:
    args = sys.argv[1:]
    sample = args[:1] == ["--sample"]
    if sample:
        args = args[1:]
    out, kind, target = args[:3]
    sys.argv = [target] + args[3:]
    profile = Sampler() if sample else cProfile.Profile()

    def start(*_):
        profile.enable()

    def stop(*_):
        profile.disable()
        profile.dump_stats(out)

    signal.signal(START, start)
    signal.signal(STOP, stop)
    if kind == "module":
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        runpy.run_path(target, run_name="__main__")


if __name__ == "__main__":
    _main()
