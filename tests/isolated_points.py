"""Child-process targets of tests/test_benchmarks.py's ``harness.run_isolated`` tests, in a module that
imports only numpy: a child that imported test_benchmarks (every benchmark script, MindSpore) took
~4 s of CPU to start and 420 MiB before its point ran."""
import time

import numpy as np


def allocate(gib, hold_s=0.0):
    """Holds ``gib`` GiB resident for ``hold_s`` seconds (time for the watchdog's polls to see it)."""
    block = np.ones(int(gib * 2**30) // 8)
    time.sleep(hold_s)
    return {"sum": float(block[:10].sum())}


def shout_and_fail():
    """A point that logs (as a peer's framework does) and then fails."""
    print("a framework log line")
    raise RuntimeError("the point failed")
