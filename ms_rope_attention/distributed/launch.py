"""One way to launch: MindSpore's ``msrun`` with the settings a job on one machine wants.

    python -m ms_rope_attention.distributed.launch --workers 2 script.py [script args]
    python -m ms_rope_attention.distributed.launch --workers 2 -m models.llama.train --data-parallel ...

runs ``msrun --worker_num=N --local_worker_num=N --master_addr=127.0.0.1 --master_port=<free>
--join=True --log_dir=DIR --tail_worker_log=N script.py ...`` with MindSpore's cluster timeouts
shortened (a rank that fails takes the others down within seconds; msrun waits 30 s by default),
then prints each worker's log and exits with msrun's status. ``--join=True`` matters: without it
msrun returns at once, status 0, whatever the workers do. The script calls
``mindspore.communication.init()`` before anything else (msrun's scheduler process runs it up to
there).

The launcher owns every process of the job, because msrun does not: it starts each worker in a
session of its own (``os.setsid``) and kills them only from its SIGINT handler (at once, SIGKILL) or
when one of them fails, so killing msrun orphans the workers and the scheduler. A watchdog process
stands in for the launcher if the launcher is killed. See ``launch``.
"""
from __future__ import annotations

import argparse
import os
import re
import secrets
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

# Cluster building polls every 1 s instead of 3-5 s, and a node lost for 10 s ends the job; defaults
# only: a value set in the environment is kept.
FAST_CLUSTER = {"MS_RETRY_INTERVAL_LOWER": "1", "MS_RETRY_INTERVAL_UPPER": "1", "MS_NODE_TIMEOUT": "10"}
# A CPU collective waits up to 300 s for its peers (a default too): ranks reach their first collective
# after compiling their graphs, at different speeds on a busy machine, and with MindSpore's own wait a
# rank 15 s late failed its peer's AllReduce (5 s late passed). A rank that dies still ends the job at
# once: msrun sees its exit.
PATIENT_COLLECTIVES = {"MS_CPU_COMM_OP_TIMEOUT": "300"}
# Set to a fresh random value in the environment of each launch's msrun: every process of the job inherits it.
JOB_VARIABLE = "MS_ROPE_ATTENTION_LAUNCH"
TIMEOUT_STATUS = 124  # as coreutils' timeout; a job stopped by a signal ends with 128 + its number
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
WATCHDOG = "--watchdog"  # this file's first argument when it runs as the watchdog (``_watchdog``)
TAIL_LINES = 40


@dataclass
class Launch:
    returncode: int
    logs: list[str]  # each worker's output, in rank order
    log_dir: Path | None = None  # where the logs stay; None when a successful launch removed its temporary folder

    def results(self) -> list[list[str]]:
        """Each worker's ``RESULT ...`` lines (the convention of the project's msrun checks)."""
        return [[line for line in log.splitlines() if line.startswith("RESULT ")] for log in self.logs]


def reserve_port() -> socket.socket:
    """A socket bound to a free port of 127.0.0.1 for msrun's scheduler, to be held until the job ends.

    A port found free and closed again could be taken by anything before the scheduler binds it, seconds
    later, and the ranks would then wait for a scheduler that never comes, until the timeout. While this
    socket holds it, the kernel gives the port to no ``bind`` to port 0 (another launcher's pick), no outgoing
    connection and no plain ``bind``. It does not listen and sets SO_REUSEADDR, so the scheduler, which binds
    with SO_REUSEADDR too (MindSpore 2.10), can still bind and listen. Left open: a program that binds this
    very port number on purpose with SO_REUSEADDR and listens first."""
    reserved = socket.socket()
    reserved.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    reserved.bind(("127.0.0.1", 0))
    return reserved


def processes_with(variable: str, value: str) -> dict[int, dict[str, str]]:
    """The live processes (Linux ``/proc``) whose environment at start-up sets ``variable=value``:
    pid -> that environment. Exited ones (zombies included) no longer show theirs, so they are not listed."""
    mark = f"{variable}={value}".encode()
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                assignments = f.read().split(b"\0")
        except OSError:  # gone, or not ours
            continue
        if mark in assignments:
            found[int(entry)] = dict(a.decode(errors="replace").partition("=")[::2] for a in assignments if a)
    return found


def _kill_job(token: str, msrun: subprocess.Popen | None = None) -> None:
    """SIGKILL to every process whose environment carries ``token`` (``_Job``), and to ``msrun`` while it
    runs, to the process group of each (bar this process's own) and to the process itself, until none is
    left (5 s at most). msrun's process group holds msrun, the scheduler and msrun's tails."""
    own_group = os.getpgrp()
    for _ in range(50):
        left = list(processes_with(JOB_VARIABLE, token))
        if msrun is not None and msrun.poll() is None:
            left.append(msrun.pid)
        if not left:
            return
        for pid in left:
            try:
                group = os.getpgid(pid)
                if group != own_group:
                    os.killpg(group, signal.SIGKILL)
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)
    raise RuntimeError(f"launch: processes {left} of the job survived SIGKILL for 5 s")


def _watchdog(launcher: str, token: str, folder: str) -> None:
    """The watchdog's loop: a process of its own session (no terminal signal and no kill of the launcher's
    group reaches it) that waits for the launcher. A byte on stdin is the launcher's word that it cleaned up
    itself: the watchdog exits. The launcher gone without it (SIGKILL, a signal it did not handle, in a thread
    other than the main one): every process of the job is killed (``_kill_job``), once more 1 s later for an
    msrun the launcher was forking as it died (such a child has not yet exec'd into the job's environment), and
    ``folder`` (the launcher's temporary log folder, or "") is removed."""
    stdin = sys.stdin.fileno()
    while os.getppid() == int(launcher):  # a dead parent's children are given to another process
        if select.select([stdin], [], [], 0.5)[0]:
            if os.read(stdin, 1):
                return
            break  # end of file: the launcher is gone
    _kill_job(token)
    time.sleep(1)
    _kill_job(token)
    if folder:
        shutil.rmtree(folder, ignore_errors=True)


class _Job:
    """One msrun and every process it starts, found by a token in their environment.

    The token (``MS_ROPE_ATTENTION_LAUNCH=<random>``, set only in msrun's environment) is inherited by the
    scheduler, each worker, msrun's ``tail`` processes and whatever a worker starts, across ``setsid`` and
    before any of them runs a line of Python; a process cannot lose it short of exec'ing with a new
    environment. So a scan of ``/proc`` finds the whole job at any moment, also a worker that hangs or dies
    before it could have reported its pid (a pid file written by the job would miss those), and also
    processes msrun started after the scan began: ``kill`` scans until none is left. The workers are the
    job's session leaders other than msrun (msrun's ``setsid``); msrun itself starts in a new session so
    that a terminal's Ctrl-C reaches only the launcher, which decides what each process gets.

    The watchdog (``_watchdog``, started before msrun and released by ``release``) does the same if the
    launcher dies. It is this file run by path with ``-I``: no import of the package (and so of MindSpore),
    and no token in its own environment."""

    def __init__(self, temporary_folder: Path | None):
        """The watchdog, which removes ``temporary_folder`` if the launcher dies."""
        self.token = secrets.token_hex(16)
        self.ranks: dict[int, int] = {}  # worker pid -> rank, for the failure report
        self.watchdog = subprocess.Popen([sys.executable, "-I", __file__, WATCHDOG, str(os.getpid()), self.token,
                                          str(temporary_folder or "")], stdin=subprocess.PIPE, start_new_session=True)

    def start(self, command: list[str], env: dict[str, str], log_dir: Path) -> None:
        with open(log_dir / "msrun.log", "wb") as out:
            self.msrun = subprocess.Popen(command, env={**env, JOB_VARIABLE: self.token}, stdout=out,
                                          stderr=subprocess.STDOUT, start_new_session=True)

    def workers(self) -> dict[int, dict[str, str]]:
        found = processes_with(JOB_VARIABLE, self.token)
        workers = {}
        for pid, environment in found.items():
            try:
                if pid != self.msrun.pid and os.getsid(pid) == pid:
                    workers[pid] = environment
            except ProcessLookupError:
                pass
        for pid, environment in workers.items():
            if "MS_NODE_ID" in environment:
                self.ranks[pid] = int(environment["MS_NODE_ID"])
        return workers

    def signal_workers(self, signum: int) -> None:
        """``signum`` to each worker's process group, as a terminal would send it; not to msrun, whose SIGINT
        handler SIGKILLs the workers at once, nor to the scheduler, whose loss would end the workers."""
        for pid in self.workers():
            try:
                os.killpg(pid, signum)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        """No process of the job left (``_kill_job``)."""
        _kill_job(self.token, self.msrun)

    def release(self) -> None:
        """The watchdog told that the launcher cleaned up, and reaped."""
        self.watchdog.communicate(b"x")


def _tail(path: Path, lines: int = TAIL_LINES) -> str:
    if not path.exists():
        return f"({path} was not written)\n"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) + "\n"


def _report(job: _Job, log_dir: Path, workers: int, status: int, stopped: str | None) -> None:
    """What failed, on stderr: msrun's and the scheduler's log tails, and the failed workers' (every
    worker's when the job was stopped, or when msrun named none)."""
    failed = {}  # rank -> exit code, from msrun's line for the worker that exited non-zero
    if not stopped:
        msrun_log = (log_dir / "msrun.log").read_text(errors="replace")
        for pid, code in re.findall(r"Worker process (\d+) exit with exception\. Error code: (-?\d+)", msrun_log):
            if int(pid) in job.ranks:
                failed[job.ranks[int(pid)]] = int(code)
    why = stopped or "; ".join(f"rank {rank} exited with status {code}" for rank, code in sorted(failed.items()))
    parts = [f"launch: the job failed, status {status} ({why or 'msrun failed'}); its logs are kept in {log_dir}",
             f"---- msrun ({log_dir / 'msrun.log'}) ----\n" + _tail(log_dir / "msrun.log"),
             f"---- scheduler ({log_dir / 'scheduler.log'}) ----\n" + _tail(log_dir / "scheduler.log")]
    for rank in sorted(failed) or range(workers):
        parts.append(f"---- rank {rank} ({log_dir / f'worker_{rank}.log'}) ----\n" + _tail(log_dir / f"worker_{rank}.log"))
    print("\n".join(parts), file=sys.stderr, flush=True)


def _wait(job: _Job, workers: int, timeout: float, grace: float, received: list[int]) -> str | None:
    """Until msrun ends, the timeout passes or a signal arrives (in ``received``); then the signal to the
    workers and up to ``grace`` seconds for msrun to end. Why the job was stopped, or None if it ended."""
    deadline = time.monotonic() + timeout
    while job.msrun.poll() is None and not received and time.monotonic() < deadline:
        if len(job.ranks) < workers:
            job.workers()
        time.sleep(0.1)
    if job.msrun.returncode is not None:
        return None
    job.signal_workers(received[0] if received else signal.SIGTERM)
    seen, deadline = len(received), time.monotonic() + grace
    while job.msrun.poll() is None and len(received) == seen and time.monotonic() < deadline:  # a 2nd signal: no grace
        time.sleep(0.1)
    return f"stopped on {signal.Signals(received[0]).name}" if received else f"stopped after the {timeout:g} s timeout"


RUN_MODULE = Path(__file__).resolve().parent / "run_module.py"


def launch(script, args=(), *, workers: int = 2, log_dir=None, timeout: float = 900, grace: float = 30,
           env=None, module=None) -> Launch:
    """Runs ``script`` (or, with ``module``, ``python -m module``) on ``workers`` local ranks under
    msrun; their logs come back in rank order.

    After ``timeout`` seconds, or on SIGINT, SIGTERM, SIGHUP or SIGQUIT to this process, the job is stopped:
    each worker's process group gets the signal (SIGTERM on a timeout), so ranks that handle it can save; after
    at most ``grace`` seconds every process of the job still alive is SIGKILLed (see ``_Job``). Signals are
    caught only in the main thread, and not those the caller ignores (``nohup`` keeps the job running); the
    previous handlers are restored and then given the signal, so Ctrl-C still raises KeyboardInterrupt here. A
    stopped job's status is ``TIMEOUT_STATUS`` or 128 + the signal's number. Whatever the end, no process of
    the job outlives the call: if this process dies first (SIGKILL, the OOM killer, a signal not caught), the
    watchdog kills the job within a second and removes a temporary log folder. The limit: a watchdog killed
    before the launcher (it is in a session of its own, so only a kill aimed at it, or at every process of the
    user, reaches it).

    On failure the report (``_report``) goes to stderr and the logs stay in their folder (``Launch.log_dir``),
    except after a SIGHUP: a hang-up leaves no one to read a report, so none is written. The temporary folder the
    launcher made when ``log_dir`` is None is removed after a success or a SIGHUP."""
    if module is not None:
        script, args = RUN_MODULE, [module, *args]
    if workers < 1:
        raise ValueError(f"workers: expected a positive int, got {workers!r}")
    if not timeout > 0:
        raise ValueError(f"timeout: expected a positive number of seconds, got {timeout!r}")
    if not grace >= 0:
        raise ValueError(f"grace: expected a number of seconds >= 0, got {grace!r}")
    temporary = log_dir is None
    log_dir = Path(tempfile.mkdtemp(prefix="msrun-") if temporary else log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    # msrun starts its workers with the `python` of PATH: this interpreter's comes first.
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    run_env = {**FAST_CLUSTER, **PATIENT_COLLECTIVES, **os.environ, "PATH": path, **(env or {})}

    job = _Job(log_dir if temporary else None)
    try:
        received: list[int] = []
        previous = {}
        if threading.current_thread() is threading.main_thread():
            # A blocked signal mask survives exec: a parent that had a stop signal blocked (seen in the test
            # suite's workers for SIGQUIT) would leave the launcher deaf to it, its job running on. Ignored
            # signals stay ignored (nohup's SIGHUP).
            signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
            for signum in STOP_SIGNALS:
                if signal.getsignal(signum) not in (signal.SIG_IGN, None):
                    previous[signum] = signal.signal(signum, lambda signum, frame: received.append(signum))
        try:
            with reserve_port() as reserved:
                # --tail_worker_log names no rank, so msrun starts no `tail -f` per worker to copy its log to its
                # console (msrun.log here): the launcher reads the log files.
                command = [sys.executable, "-m", "mindspore.parallel.cluster.run", f"--worker_num={workers}",
                           f"--local_worker_num={workers}", "--master_addr=127.0.0.1",
                           f"--master_port={reserved.getsockname()[1]}", "--join=True", f"--log_dir={log_dir}",
                           f"--tail_worker_log={workers}", str(script), *map(str, args)]
                job.start(command, run_env, log_dir)
                try:
                    stopped = _wait(job, workers, timeout, grace, received)
                finally:
                    job.kill()
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        status = job.msrun.wait()
        if stopped:
            status = 128 + received[0] if received else TIMEOUT_STATUS
        logs = [(log_dir / f"worker_{rank}.log").read_text(errors="replace")
                if (log_dir / f"worker_{rank}.log").exists() else "" for rank in range(workers)]
        reported = status != 0 and received[:1] != [signal.SIGHUP]
        if reported:
            _report(job, log_dir, workers, status, stopped)
        elif temporary:
            shutil.rmtree(log_dir)
    finally:
        job.release()
    if received:
        signal.raise_signal(received[0])
    return Launch(status, logs, log_dir if reported or not temporary else None)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     prog="python -m ms_rope_attention.distributed.launch",
                                     usage="%(prog)s [--workers N] [--log-dir DIR] [--timeout S] [--grace S] "
                                           "(script.py | -m module) [args ...]")
    parser.add_argument("--workers", type=int, default=2, help="ranks on this machine")
    parser.add_argument("--log-dir", help="where msrun writes worker_<rank>.log (default: a new temporary folder, "
                                          "removed after a success or a hang-up)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds before the job is stopped")
    parser.add_argument("--grace", type=float, default=30,
                        help="seconds the ranks get, after a timeout or a signal, before they are killed")
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
    try:
        result = launch(script, args, workers=options.workers, log_dir=options.log_dir, timeout=options.timeout,
                        grace=options.grace, module=module)
    except KeyboardInterrupt:  # the job is stopped and reported; no traceback of the launcher's
        return 128 + signal.SIGINT
    for rank, log in enumerate(result.logs):
        print(f"==== rank {rank} ====\n{log}")
    return result.returncode


if __name__ == "__main__":
    sys.exit(_watchdog(*sys.argv[2:]) if sys.argv[1:2] == [WATCHDOG] else main())
