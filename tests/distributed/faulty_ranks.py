"""Run by tests/test_launch.py under msrun: ``faulty_ranks.py MODE DIR``. Every process the script
starts in (msrun's scheduler and each worker) first writes its pid to DIR/<pid>, before MindSpore is
imported, so the test can check by pid that none survives the launch. After init() every rank prints
the MS_NODE_TIMEOUT and MS_CPU_COMM_OP_TIMEOUT it runs with. Then, by MODE:

- ok: the ranks run 3 small AllReduces and exit 0;
- late: as ok, rank 0 reaching its first AllReduce 15 s after rank 1 (a slow compile on a busy machine);
- exit-early: rank 1 raises before its first collective while rank 0 waits in one;
- die-mid-run: the ranks loop the AllReduce and rank 1 SIGKILLs itself after 3 iterations;
- hang: every rank prints ``RESULT sleeping`` and sleeps, alive; a SIGINT, SIGTERM, SIGHUP or SIGQUIT is
  written to DIR/signals (``<rank> <signal>``) and otherwise ignored, so only a kill ends the rank. It does so before
  MindSpore is imported (the rank is msrun's RANK_ID; the scheduler just sleeps): what is tested is the
  launcher's timeout, and a cluster that takes longer than the timeout to form on a loaded machine would
  leave nothing asleep to stop.
"""
import os
import signal
import sys
import time
from pathlib import Path

mode, out = sys.argv[1], Path(sys.argv[2])
(out / str(os.getpid())).write_text(os.environ.get("MS_ROLE", ""))
if mode == "hang":
    if os.environ.get("MS_ROLE") != "MS_SCHED":
        def record(signum, frame):
            with open(out / "signals", "a") as f:
                f.write(f"{os.environ['RANK_ID']} {signal.Signals(signum).name}\n")

        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
            signal.signal(signum, record)
        print("RESULT sleeping", flush=True)
    while True:
        time.sleep(60)

import mindspore as ms  # noqa: E402
import numpy as np  # noqa: E402
from mindspore.communication import get_rank, init  # noqa: E402

ms.set_device("CPU")
init()
rank = get_rank()
print(f"rank {rank} MS_NODE_TIMEOUT={os.environ.get('MS_NODE_TIMEOUT')} "
      f"MS_CPU_COMM_OP_TIMEOUT={os.environ.get('MS_CPU_COMM_OP_TIMEOUT')}", flush=True)
if mode == "late" and rank == 0:
    time.sleep(15)
if mode == "exit-early" and rank == 1:
    raise RuntimeError("rank 1 fails on purpose")
all_reduce = ms.ops.AllReduce()
for iteration in range(3 if mode in ("ok", "late") else 1000):
    if mode == "die-mid-run" and rank == 1 and iteration == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    all_reduce(ms.Tensor(np.ones(4, np.float32)))
    print(f"rank {rank} iteration {iteration}", flush=True)
