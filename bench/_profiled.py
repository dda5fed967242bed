"""Runs a Python entry point with cProfile switched on and off by signals, so
a profile covers only the load, not start-up:

    python -m bench._profiled OUT (module NAME | script PATH) ARGS...

START (SIGRTMIN+2) starts profiling the main thread (where mitmproxy's event
loop runs); STOP (SIGRTMIN+3) stops it and writes the stats to OUT. (mitmdump
takes SIGUSR1 and SIGUSR2 for its own debug dumps.)
"""

import cProfile
import runpy
import signal
import sys

START = signal.SIGRTMIN + 2
STOP = signal.SIGRTMIN + 3


def _main() -> None:
    out, kind, target = sys.argv[1:4]
    sys.argv = [target] + sys.argv[4:]
    profile = cProfile.Profile()

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
