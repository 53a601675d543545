"""The launcher owns its processes: msrun runs each worker in a session of its own, so whatever ends
a job (a rank that fails before or after its first collective, the timeout, SIGTERM, Ctrl-C, SIGQUIT, a
hang-up or SIGKILL to the launcher) must leave no process behind. tests/distributed/faulty_ranks.py makes
each fault on 2 CPU ranks; every process it starts in writes its pid, and each test checks by pid that all
are gone within a few seconds of the end, within a stated bound on the job's time."""
import errno
import os
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from ms_rope_attention.distributed.launch import STOP_SIGNALS, TIMEOUT_STATUS, launch, processes_with, reserve_port

pytestmark = pytest.mark.integration  # make test-all only (docs/testing.md)

ROOT = Path(__file__).resolve().parents[1]
FAULTY = ROOT / "tests" / "distributed" / "faulty_ranks.py"
# The scheduler gives up on a lost rank after 3 s instead of the launcher's 10 (its wait ends a failed job).
QUICK_LOSS = {"MS_NODE_TIMEOUT": "3"}
GRACE = 2
STOP_SLACK = 10  # how long past the grace a stopped launcher may take to be gone


@pytest.fixture
def job(tmp_path, monkeypatch):
    """The pid folder the faulty ranks write to, and a temporary folder of its own for the launcher's logs.
    Its full path is also the job's environment mark (``_mark``)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    (tmp_path / "pids").mkdir()
    return tmp_path


def _mark(job):
    """The value of FAULTY_RANKS every process of the job carries: the folder's full path, since its
    name alone repeats on each xdist worker (both parametrised signal tests get ``..._launcher_0``)
    and would match the other worker's live job."""
    return str(job)


def _pids(job):
    """{pid: role} of every process the script started in (the scheduler and each worker)."""
    return {int(p.name): p.read_text() for p in (job / "pids").iterdir() if p.name.isdigit()}


def _running(pid):
    """Alive and not a zombie (an exited child its new parent has yet to reap runs nothing)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _children(pid):
    """The pids whose parent is ``pid``."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rpartition(")")[2].split()[1]) == pid:
                children.append(int(stat.parent.name))
        except (FileNotFoundError, ProcessLookupError):
            pass
    return children


def _assert_none_left(job, also=()):
    """Within 5 s: the scheduler and both workers wrote their pids, none of them runs, nor any pid of
    ``also``, and no process carries the job's environment mark (msrun included)."""
    pids = _pids(job)
    assert sorted(pids.values()) == ["MS_SCHED", "MS_WORKER", "MS_WORKER"], pids
    deadline = time.monotonic() + 5
    while (left := [p for p in [*pids, *also] if _running(p)] + list(processes_with("FAULTY_RANKS", _mark(job)))) \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"still running: {left} of {pids} and {list(also)}"


def _launch(job, mode, **options):
    start = time.monotonic()
    run = launch(FAULTY, [mode, job / "pids"], workers=2, env={"FAULTY_RANKS": _mark(job), **options.pop("env", {})},
                 **options)
    return run, time.monotonic() - start


def test_a_job_that_succeeds_removes_its_log_folder(job, monkeypatch):
    """The control: no fault, status 0, no process left, and the launcher's temporary log folder is gone."""
    monkeypatch.delenv("MS_NODE_TIMEOUT", raising=False)  # so the launcher's defaults apply
    monkeypatch.delenv("MS_CPU_COMM_OP_TIMEOUT", raising=False)
    run, _ = _launch(job, "ok")
    assert run.returncode == 0, run.logs
    assert "rank 1 iteration 2" in run.logs[1] and run.log_dir is None
    assert "rank 1 MS_NODE_TIMEOUT=10 MS_CPU_COMM_OP_TIMEOUT=300" in run.logs[1]  # the launcher's defaults
    assert not list(job.glob("msrun-*"))
    _assert_none_left(job)


def test_a_rank_late_to_its_first_collective_is_waited_for(job, monkeypatch):
    """Rank 0 reaches its first AllReduce 15 s after rank 1 (a slower compile on a busy machine): with
    MindSpore's own wait rank 1's AllReduce failed; with the launcher's the job succeeds."""
    monkeypatch.delenv("MS_CPU_COMM_OP_TIMEOUT", raising=False)
    run, _ = _launch(job, "late")
    assert run.returncode == 0, run.logs
    assert "rank 1 iteration 2" in run.logs[1] and "rank 0 iteration 2" in run.logs[0]
    _assert_none_left(job)


def test_the_environments_cluster_settings_win_over_the_launchers(job, monkeypatch):
    """The launcher's shortened timeouts are defaults: a value the user's environment sets is kept."""
    monkeypatch.setenv("MS_NODE_TIMEOUT", "45")
    run, _ = _launch(job, "ok")
    assert run.returncode == 0, run.logs
    assert "rank 0 MS_NODE_TIMEOUT=45" in run.logs[0] and "rank 1 MS_NODE_TIMEOUT=45" in run.logs[1]
    _assert_none_left(job)


def test_a_rank_that_fails_before_its_first_collective_ends_the_job(job, capsys):
    """Rank 1 raises after init() while rank 0 waits in an AllReduce: non-zero within 60 s, nothing left;
    stderr names the rank, shows its traceback and the scheduler's log, and the logs stay where it says."""
    run, took = _launch(job, "exit-early", env=QUICK_LOSS, timeout=60)
    assert run.returncode != 0 and took < 60
    _assert_none_left(job)
    err = capsys.readouterr().err
    assert "rank 1 exited with status 1" in err and "RuntimeError: rank 1 fails on purpose" in err, err
    assert f"---- scheduler ({run.log_dir / 'scheduler.log'})" in err and f"kept in {run.log_dir}" in err
    assert (run.log_dir / "worker_1.log").exists() and run.log_dir.parent == job


def test_a_rank_killed_after_several_collectives_ends_the_job(job, capsys):
    """The ranks loop an AllReduce; rank 1 SIGKILLs itself after 3: non-zero within 60 s, nothing left."""
    run, took = _launch(job, "die-mid-run", env=QUICK_LOSS, timeout=60)
    assert run.returncode != 0 and took < 60
    assert "rank 1 iteration 2" in run.logs[1] and "rank 1 iteration 3" not in run.logs[1]
    _assert_none_left(job)
    assert "rank 1 exited with status -9" in capsys.readouterr().err


def test_a_job_that_hangs_is_stopped_at_its_timeout(job, capsys):
    """Every rank alive and asleep: at the 20 s timeout each gets SIGTERM, ignores it, and is killed
    after the 2 s grace; status TIMEOUT_STATUS within 20 + 2 + 10 s, nothing left."""
    run, took = _launch(job, "hang", timeout=20, grace=GRACE)
    assert run.returncode == TIMEOUT_STATUS and 20 + GRACE <= took < 20 + GRACE + 10, (run.returncode, took)
    assert run.results() == [["RESULT sleeping"]] * 2, run.logs
    assert sorted((job / "pids" / "signals").read_text().splitlines()) == ["0 SIGTERM", "1 SIGTERM"]
    _assert_none_left(job)
    assert "stopped after the 20 s timeout" in capsys.readouterr().err


def _cli(job, *options, blocked=()):
    """The launcher's CLI on ranks that sleep, started as a terminal starts it (a session of its own), with no
    core dump (SIGQUIT's default action), its temporary folder in ``job``; returned once the scheduler and
    both ranks wrote their pids and the ranks handle signals."""
    launcher = subprocess.Popen([sys.executable, "-m", "ms_rope_attention.distributed.launch", "--grace", str(GRACE),
                                 *options, str(FAULTY), "hang", str(job / "pids")],
                                env={**os.environ, "FAULTY_RANKS": _mark(job), "TMPDIR": str(job)}, cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
                                preexec_fn=lambda: (resource.setrlimit(resource.RLIMIT_CORE, (0, 0)),
                                                    # a terminal's foreground job: the stop signals at their default
                                                    # action (the suite's worker may have one ignored, and the launcher
                                                    # leaves an ignored signal ignored, as nohup and shells expect)
                                                    [signal.signal(s, signal.SIG_DFL) for s in STOP_SIGNALS],
                                                    signal.pthread_sigmask(signal.SIG_BLOCK, blocked)))
    deadline = time.monotonic() + 60
    while len(_pids(job)) < 3 or [_text(log).count("RESULT sleeping") for log in job.glob("*/worker_*.log")] != [1, 1]:
        if launcher.poll() is not None or time.monotonic() > deadline:
            launcher.kill()  # its watchdog then ends the job
            pytest.fail(f"the job did not start within 60 s: {launcher.stderr.read().decode()}")
        time.sleep(0.2)
    return launcher


@pytest.mark.parametrize("signum,status", [(signal.SIGTERM, -signal.SIGTERM), (signal.SIGINT, 128 + signal.SIGINT),
                                           (signal.SIGQUIT, -signal.SIGQUIT)])
def test_a_signal_to_the_launcher_stops_the_job(job, signum, status):
    """The launcher's CLI, its ranks asleep: the signal reaches each rank, which ignores it; the launcher ends
    within the 2 s grace + STOP_SLACK (SIGTERM and SIGQUIT kill it, as they would have without the job; Ctrl-C exits
    130) and leaves nothing: its children (msrun and the watchdog) are gone too."""
    launcher = _cli(job, "--log-dir", str(job / "logs"))
    children = _children(launcher.pid)
    launcher.send_signal(signum)
    start = time.monotonic()
    assert launcher.wait(timeout=GRACE + STOP_SLACK) == status
    assert time.monotonic() - start >= GRACE
    assert sorted((job / "pids" / "signals").read_text().splitlines()) == [f"{r} {signum.name}" for r in (0, 1)]
    _assert_none_left(job, children)
    assert f"stopped on {signum.name}" in launcher.stderr.read().decode()


def test_a_stop_signal_the_parent_had_blocked_still_stops_the_job(job):
    """A blocked signal mask survives exec (the suite's xdist workers once had SIGQUIT blocked): the launcher
    unblocks its stop signals, so SIGQUIT still stops the job and kills the launcher."""
    launcher = _cli(job, "--log-dir", str(job / "logs"), blocked=(signal.SIGQUIT,))
    children = _children(launcher.pid)
    launcher.send_signal(signal.SIGQUIT)
    assert launcher.wait(timeout=GRACE + STOP_SLACK) == -signal.SIGQUIT
    _assert_none_left(job, children)


def test_a_hang_up_stops_the_job_and_removes_its_log_folder(job):
    """A closed terminal or a dropped ssh: SIGHUP to the launcher (msrun and the ranks, in sessions of
    their own, get no hang-up) reaches each rank as a terminal would send it, then after the grace every
    process of the job is gone, and so is the temporary log folder (no one is left to read a report naming
    it); the launcher then dies of the SIGHUP."""
    launcher = _cli(job)
    children = _children(launcher.pid)
    launcher.send_signal(signal.SIGHUP)
    start = time.monotonic()
    assert launcher.wait(timeout=GRACE + STOP_SLACK) == -signal.SIGHUP
    assert time.monotonic() - start >= GRACE
    assert sorted((job / "pids" / "signals").read_text().splitlines()) == [f"{r} SIGHUP" for r in (0, 1)]
    _assert_none_left(job, children)
    assert not list(job.glob("msrun-*"))


def test_a_killed_launcher_leaves_nothing(job):
    """SIGKILL (kill -9, the OOM killer) cannot be caught: the launcher's watchdog sees it gone and kills
    every process of the job, removes the temporary log folder and exits, all within 5 s."""
    launcher = _cli(job)
    children = _children(launcher.pid)
    launcher.kill()
    assert launcher.wait(timeout=5) == -signal.SIGKILL
    _assert_none_left(job, children)
    deadline = time.monotonic() + 5
    while list(job.glob("msrun-*")) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not list(job.glob("msrun-*"))


def test_the_master_port_stays_reserved_for_the_scheduler():
    """The port the launcher gives msrun stays bound until the job ends, so no other launcher's pick, outgoing
    connection or plain bind takes it before the scheduler does (a port found free and closed could be, and a
    scheduler that cannot bind leaves the ranks waiting until the timeout); the scheduler, which binds with
    SO_REUSEADDR, still can, as a held socket that does not listen allows."""
    with reserve_port() as held:
        port = held.getsockname()[1]
        with socket.socket() as other, pytest.raises(OSError) as refused:
            other.bind(("127.0.0.1", port))
        assert refused.value.errno == errno.EADDRINUSE
        with socket.socket() as scheduler:
            scheduler.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            scheduler.bind(("127.0.0.1", port))
            scheduler.listen()


def test_without_init_the_error_says_what_to_do():
    """A collective built where init() was not called (MindSpore would answer rank 0 of 1, and the first
    collective would fail) says what to call and how to launch; an impossible explicit rank is refused."""
    from ms_rope_attention.distributed import ContextParallelRotaryAttention, GatherChunks

    for build in (GatherChunks, lambda: ContextParallelRotaryAttention(4)):
        with pytest.raises(RuntimeError, match=r"call mindspore.communication.init\(\) first, in a job launched with "
                                               r"msrun \(e.g. `python -m ms_rope_attention.distributed.launch"):
            build()
    with pytest.raises(ValueError, match="rank, size: expected 0 <= rank < size, got rank 2, size 2"):
        GatherChunks(rank=2, size=2)


def _text(path):
    return path.read_text(errors="replace") if path.exists() else ""
