"""One way to launch: MindSpore's ``msrun`` with the settings a job on one machine wants.

    python -m ms_rope_attention.distributed.launch --workers 2 script.py [script args]
    python -m ms_rope_attention.distributed.launch --workers 2 -m models.llama.train --data-parallel ...

runs ``msrun --worker_num=N --local_worker_num=N --master_addr=127.0.0.1 --master_port=<free>
--join=True --log_dir=DIR script.py ...`` with MindSpore's cluster timeouts shortened (a rank that
fails takes the others down within seconds; msrun waits 30 s by default), then prints each worker's
log and exits with msrun's status. ``--join=True`` matters: without it msrun returns at once, status
0, whatever the workers do. The script calls ``mindspore.communication.init()`` before anything else
(msrun's scheduler process runs it up to there).
"""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

# Cluster building polls every 1 s instead of 3-5 s, and a node lost for 10 s ends the job.
FAST_CLUSTER = {"MS_RETRY_INTERVAL_LOWER": "1", "MS_RETRY_INTERVAL_UPPER": "1", "MS_NODE_TIMEOUT": "10"}


@dataclass
class Launch:
    returncode: int
    logs: list[str]  # each worker's output, in rank order

    def results(self) -> list[list[str]]:
        """Each worker's ``RESULT ...`` lines (the convention of the project's msrun checks)."""
        return [[line for line in log.splitlines() if line.startswith("RESULT ")] for log in self.logs]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


RUN_MODULE = Path(__file__).resolve().parent / "run_module.py"


def launch(script, args=(), *, workers: int = 2, log_dir=None, timeout: float = 900, env=None, module=None) -> Launch:
    """Runs ``script`` (or, with ``module``, ``python -m module``) on ``workers`` local ranks under
    msrun; their logs come back in rank order."""
    if module is not None:
        script, args = RUN_MODULE, [module, *args]
    if workers < 1:
        raise ValueError(f"workers: expected a positive int, got {workers!r}")
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="msrun-"))
    command = [sys.executable, "-m", "mindspore.parallel.cluster.run", f"--worker_num={workers}",
               f"--local_worker_num={workers}", "--master_addr=127.0.0.1", f"--master_port={free_port()}",
               "--join=True", f"--log_dir={log_dir}", str(script), *map(str, args)]
    # msrun starts its workers with the `python` of PATH: this interpreter's comes first.
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    run_env = {**os.environ, **FAST_CLUSTER, "PATH": path, **(env or {})}
    try:
        code = subprocess.run(command, env=run_env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        code = -1
    logs = [(log_dir / f"worker_{rank}.log").read_text(errors="replace")
            if (log_dir / f"worker_{rank}.log").exists() else "" for rank in range(workers)]
    return Launch(code, logs)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     prog="python -m ms_rope_attention.distributed.launch",
                                     usage="%(prog)s [--workers N] [--log-dir DIR] [--timeout S] "
                                           "(script.py | -m module) [args ...]")
    parser.add_argument("--workers", type=int, default=2, help="ranks on this machine")
    parser.add_argument("--log-dir", help="where msrun writes worker_<rank>.log (default: a new temporary folder)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds before the job is stopped")
    # The launcher's own options come first; everything from the script (or -m) on is the job's.
    split = 0
    while split < len(argv) and argv[split] != "-m" and argv[split].startswith("-"):
        split += 1 if "=" in argv[split] or argv[split] in ("-h", "--help") else 2
    options = parser.parse_args(argv[:split])
    job = argv[split:]
    module = None
    if job[:1] == ["-m"]:
        if len(job) < 2:
            parser.error("-m: expected a module name")
        module, script, args = job[1], None, job[2:]
    elif job:
        script, args = job[0], job[1:]
    else:
        parser.error("give a script, or -m and a module")
    result = launch(script, args, workers=options.workers, log_dir=options.log_dir, timeout=options.timeout,
                    module=module)
    for rank, log in enumerate(result.logs):
        print(f"==== rank {rank} ====\n{log}")
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
