"""models.llama.train when things go wrong: a save killed at each point, SIGINT mid-step and right
after a periodic save, refused reuses of --out and refused resumes; then, on 2 ranks under msrun, a
SIGTERM that reaches one rank only and a rank 0 whose save is slow. Every killed run is resumed and
must end with the weights of one uninterrupted run. The refused reuses and resumes work on copies of
that run, not on training runs of their own (each would compile the training graphs again)."""
import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import mindspore as ms
import numpy as np
import pytest
from mindspore import nn
from safetensors.numpy import load_file

from ms_rope_attention.distributed.launch import launch
from models.llama import train as train_cli
from models.llama.training import run_directory, signals, trainer
from models.llama.weights import CheckpointError, load_checkpoint

STEPS = 4
# One worker for the module: the uninterrupted run (module-scoped) trains once, not once per worker.
pytestmark = pytest.mark.xdist_group("llama_train_faults")
FAULTED = Path(__file__).resolve().parent / "distributed" / "faulted_training.py"


@pytest.fixture(autouse=True)
def terminal_dispositions():
    """SIGINT and SIGHUP as a terminal leaves them, whatever started pytest: under ``nohup`` SIGHUP is
    ignored, and the trainer rightly leaves an ignored signal ignored (so a signal test would see no stop)."""
    previous = {number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGHUP)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    yield
    for number, handler in previous.items():
        signal.signal(number, handler)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """64 short documents: 21 rows of 64 bytes, 10 batches of 2 rows an epoch."""
    animals, verbs = ("cat", "dog", "bird", "fox"), ("sat on", "ran to", "saw", "chased")
    path = tmp_path_factory.mktemp("data") / "animals.txt"
    path.write_text("\n".join(f"the {a} {v} the {b}" for a in animals for v in verbs for b in animals) + "\n")
    return path


def _args(data, out, *extra, steps=STEPS, save_every=1):
    """The tiny model with one layer: a fault hits the saves and resumes whatever the depth, and each
    run compiles its training graphs again (a run of 4 steps: 3.3 s of CPU, 4.8 s with two layers)."""
    return ["--model", "tiny", "--layers", "1", "--data", str(data), "--out", str(out), "--seq-len", "64",
            "--batch-size", "2", "--steps", str(steps), "--save-every", str(save_every), *extra]


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory):
    """The uninterrupted run: a checkpoint after every step."""
    out = tmp_path_factory.mktemp("reference") / "run"
    train_cli.main(_args(data, out))
    return out


@pytest.fixture
def finished(reference, tmp_path):
    """A copy of the uninterrupted run (finished at step STEPS), for a test to reuse or change."""
    return shutil.copytree(reference, tmp_path / "run")


def _assert_same_weights(checkpoint, reference_checkpoint, tolerance=0.0):
    """Every tensor within ``tolerance`` of the reference's largest value (0: bitwise equal)."""
    want, got = load_file(reference_checkpoint / "model.safetensors"), load_file(checkpoint / "model.safetensors")
    assert want.keys() == got.keys()
    for name in want:
        assert np.abs(got[name] - want[name]).max() <= tolerance * np.abs(want[name]).max(), name


def _assert_whole(out):
    """Every step-N directory is a complete checkpoint: weights, optimizer state and trainer.json."""
    for directory in out.glob("step-*"):
        if directory.name.removeprefix("step-").isdigit():
            load_checkpoint(directory)
            assert set(ms.load_checkpoint(str(directory / "optimizer.ckpt"))) > {"global_step"}
            assert json.loads((directory / "trainer.json").read_text())["step"] == int(directory.name[5:])


def _dies_after(real, call, written):
    """``real`` whose ``call``-th call (1-based) is killed halfway through: the file ``written(*args)``
    is left cut to half its size, and OSError raised."""
    calls = []

    def dying(*args, **kwargs):
        calls.append(1)
        result = real(*args, **kwargs)
        if len(calls) == call:
            path = Path(written(*args))
            os.truncate(path, path.stat().st_size // 2)
            raise OSError(f"killed while writing {path.name}")
        return result
    return dying


def _fail_latest_rename(monkeypatch, call):
    """The ``call``-th rename onto ``latest`` fails (a kill before it): the temporary file stays."""
    real, calls = os.replace, []

    def replace(src, dst):
        if Path(dst).name == "latest":
            calls.append(1)
            if len(calls) == call:
                raise OSError("killed before renaming latest")
        return real(src, dst)
    monkeypatch.setattr(os, "replace", replace)


@pytest.mark.parametrize("fault", ["weights", "optimizer", "latest"])
def test_a_save_killed_at_any_point_loses_only_that_save(fault, data, reference, tmp_path, monkeypatch):
    """The save of step 2 dies while writing model.safetensors, optimizer.ckpt, or before `latest`
    names it: every step-N directory left is whole, `latest` still names step-1, and the resumed run
    ends with the uninterrupted run's weights."""
    out = tmp_path / "run"
    if fault == "weights":
        monkeypatch.setattr(trainer, "save_hf_checkpoint", _dies_after(
            trainer.save_hf_checkpoint, 2, lambda state, config, directory: Path(directory) / "model.safetensors"))
    elif fault == "optimizer":
        monkeypatch.setattr(ms, "save_checkpoint", _dies_after(ms.save_checkpoint, 2, lambda state, path: path))
    else:
        _fail_latest_rename(monkeypatch, 2)
    with pytest.raises(OSError, match="killed"):
        train_cli.main(_args(data, out))
    monkeypatch.undo()
    _assert_whole(out)
    assert (out / "latest").read_text() == "step-1"
    train_cli.main(_args(data, out, "--resume"))
    _assert_same_weights(out / f"step-{STEPS}", reference / f"step-{STEPS}")
    assert not list(out.glob("*.tmp-*"))


def _sigint(monkeypatch, owner, name, call, number=signal.SIGINT):
    """``owner.name``'s ``call``-th call sends this process SIGINT (or ``number``) as it returns."""
    real, calls = getattr(owner, name), []

    def signalling(*args, **kwargs):
        result = real(*args, **kwargs)
        calls.append(1)
        if len(calls) == call:
            os.kill(os.getpid(), number)
        return result
    monkeypatch.setattr(owner, name, signalling)


@pytest.mark.parametrize("number", [signal.SIGINT, signal.SIGHUP], ids=["SIGINT", "SIGHUP"])
def test_sigint_between_the_optimizer_and_the_step_counter_saves_that_step(data, reference, tmp_path, monkeypatch,
                                                                           capsys, number):
    """SIGINT (or a hang-up) as the optimizer's second update returns, before the step counter
    counts it: the run stops after step 2 and saves it, weights, optimizer global_step and
    trainer.json alike."""
    out = tmp_path / "run"
    _sigint(monkeypatch, nn.AdamWeightDecay, "__call__", 2, number)
    with pytest.raises(SystemExit, match="interrupted by a signal: step 2 saved to"):
        train_cli.main(_args(data, out, save_every=100))
    monkeypatch.undo()
    assert (out / "latest").read_text() == "step-2"
    _assert_same_weights(out / "step-2", reference / "step-2")
    assert ms.load_checkpoint(str(out / "step-2" / "optimizer.ckpt"))["global_step"].asnumpy().tolist() == [2]
    assert json.loads((out / "step-2" / "trainer.json").read_text())["step"] == 2
    train_cli.main(_args(data, out, "--resume", save_every=100))
    _assert_same_weights(out / f"step-{STEPS}", reference / f"step-{STEPS}")


def test_a_signal_the_caller_ignores_stays_ignored():
    """``nohup`` (SIGHUP ignored) keeps a run going when its terminal closes: StopRequest leaves an
    ignored signal alone, and handles and restores the others."""
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with signals.StopRequest(distributed=False):
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_IGN, signal.SIG_DFL)
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_sigint_right_after_a_periodic_save_does_not_save_again(data, reference, tmp_path, monkeypatch):
    """Ctrl-C as the periodic save of step 2 returns: the checkpoint `latest` names is not written
    again (a save there that died halfway would break the only complete checkpoint)."""
    out = tmp_path / "run"
    _sigint(monkeypatch, trainer.Trainer, "save", 1)
    monkeypatch.setattr(trainer, "save_hf_checkpoint", _dies_after(
        trainer.save_hf_checkpoint, 2, lambda state, config, directory: Path(directory) / "model.safetensors"))
    with pytest.raises(SystemExit, match="step 2 saved"):
        train_cli.main(_args(data, out, save_every=2))
    monkeypatch.undo()
    _assert_whole(out)
    train_cli.main(_args(data, out, "--resume", save_every=2))
    _assert_same_weights(out / f"step-{STEPS}", reference / f"step-{STEPS}")


def _reseal(checkpoint):
    """SHA256SUMS rewritten for ``checkpoint``'s files as they are now, as if it had been saved so:
    a resume then gets past the checksums to the checks this test is about."""
    (checkpoint / "SHA256SUMS").write_text("".join(f"{run_directory.sha256_file(path)}  {path.name}\n"
                                                   for path in sorted(checkpoint.iterdir())
                                                   if path.name != "SHA256SUMS"))


def _refused(argv, capsys) -> str:
    """The argparse-style error (status 2) of ``models.llama.train argv``."""
    with pytest.raises(SystemExit) as exit:
        train_cli.main(argv)
    assert exit.value.code == 2
    return capsys.readouterr().err


def test_a_second_run_into_one_out_is_refused_without_overwrite(data, finished, capsys):
    out = finished
    assert "--out " + str(out) + ": not empty (latest, step-1, step-2, step-3, ...); continue its run with " \
           "--resume, or give --overwrite" in _refused(_args(data, out), capsys)
    train_cli.main(_args(data, out, "--overwrite", steps=1))
    assert sorted(p.name for p in out.iterdir()) == ["latest", "step-1"]
    assert "argument --overwrite: not allowed with argument --resume" in _refused(
        _args(data, out, "--resume", "--overwrite"), capsys)


def test_resume_refuses_changed_replay_arguments_and_a_finished_run(data, finished, tmp_path, capsys):
    out, last = finished, finished / f"step-{STEPS}"
    error = _refused(_args(data, out, "--resume", "--accumulate", "2", "--seed", "1"), capsys)
    assert f"--resume from {last}: --accumulate 2 differs from the run's 1; --seed 1 differs from the " \
           f"run's 0" in error
    edited = tmp_path / "edited.txt"
    edited.write_text(data.read_text().replace("cat", "cow"))
    assert f"--data {edited} is not the file the run trained on" in _refused(_args(edited, out, "--resume"), capsys)
    assert f"the run is finished (step {STEPS} of --steps {STEPS}); raise --steps" in _refused(
        _args(data, out, "--resume"), capsys)
    (last / "trainer.json").unlink()
    _reseal(last)
    assert f"{last / 'trainer.json'}: missing" in _refused(_args(data, out, "--resume", steps=STEPS + 1), capsys)


def test_resume_refuses_an_optimizer_state_without_a_moment(data, finished):
    out, last = finished, finished / f"step-{STEPS}"
    path = last / "optimizer.ckpt"
    state = ms.load_checkpoint(str(path))
    dropped = next(name for name in state if name.startswith("adam_m."))
    os.remove(path)
    ms.save_checkpoint([{"name": name, "data": value} for name, value in state.items() if name != dropped], str(path))
    _reseal(last)
    with pytest.raises(CheckpointError, match=f"optimizer.ckpt: lacks {dropped}$"):
        train_cli.main(_args(data, out, "--resume", steps=STEPS + 1))


def test_resume_refuses_a_checkpoint_whose_files_changed_after_the_save(data, finished, capsys):
    """SHA256SUMS (which sha256sum -c reads) lists every file of a checkpoint; a resume refuses, by
    file name, one byte changed in the weights, a file added, a file removed, or a SHA256SUMS that is
    no regular file. A checkpoint saved before SHA256SUMS existed resumes, with a FutureWarning."""
    out = finished
    checkpoint = out / f"step-{STEPS}"
    assert subprocess.run(["sha256sum", "--check", "--quiet", "SHA256SUMS"], cwd=checkpoint).returncode == 0
    weights = checkpoint / "model.safetensors"
    original = weights.read_bytes()
    weights.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
    assert f"{weights}: sha256 differs from the one in SHA256SUMS" in _refused(_args(data, out, "--resume"), capsys)
    weights.write_bytes(original)
    (checkpoint / "model-extra.safetensors").write_bytes(original)
    assert f"{checkpoint / 'model-extra.safetensors'}: not in SHA256SUMS" in _refused(
        _args(data, out, "--resume"), capsys)
    (checkpoint / "model-extra.safetensors").unlink()
    (checkpoint / "optimizer.ckpt").unlink()
    assert f"{checkpoint / 'optimizer.ckpt'}: listed in SHA256SUMS but missing" in _refused(
        _args(data, out, "--resume"), capsys)
    (checkpoint / "SHA256SUMS").unlink()
    os.mkfifo(checkpoint / "SHA256SUMS")
    assert f"{checkpoint / 'SHA256SUMS'}: missing or not a regular file" in _refused(
        _args(data, out, "--resume"), capsys)
    (checkpoint / "SHA256SUMS").unlink()
    with pytest.warns(FutureWarning, match="no SHA256SUMS .* not verified"):
        run_directory.verify(checkpoint)


def _launch(data, out, faults, *extra, steps):
    args = ["--data-parallel", "--warmup", "0", "--min-lr-ratio", "1.0",
            *_args(data, out, *extra, steps=steps, save_every=100)]
    return launch(FAULTED, args, workers=2, timeout=300, env={"FAULTS": faults})


@pytest.mark.integration
@pytest.mark.starts_first
def test_data_parallel_run_stops_on_one_ranks_sigterm_and_resumes(data, tmp_path):
    """2 ranks, rank 0's saves slowed by 2 s (the other rank reaches the end first: it must not read
    what rank 0 has not written), 2 steps; resumed, rank 1 alone gets SIGTERM during step 3: both
    stop after step 3, rank 0 saves it. Resumed again to 4: the weights after steps 2, 3 and 4 equal
    one process's."""
    one = tmp_path / "one"
    train_cli.main(["--warmup", "0", "--min-lr-ratio", "1.0", *_args(data, one)])
    out = tmp_path / "dp"
    run = _launch(data, out, "slow-save", steps=2)
    assert run.returncode == 0, "\n".join(log[-3000:] for log in run.logs)
    run = _launch(data, out, "sigterm-rank-1-at-3", "--resume", steps=STEPS)
    assert run.returncode != 0 and (out / "latest").read_text() == "step-3", "\n".join(log[-3000:] for log in run.logs)
    assert "interrupted by another rank's signal: step 3 saved" in run.logs[0]
    assert "interrupted by a signal: step 3 saved" in run.logs[1]
    run = _launch(data, out, "", "--resume", steps=STEPS)
    assert run.returncode == 0, "\n".join(log[-3000:] for log in run.logs)
    for step in (2, 3, STEPS):
        _assert_same_weights(out / f"step-{step}", one / f"step-{step}", 1e-4)  # the ranks' sums round apart
