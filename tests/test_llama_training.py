"""Training the Llama model through the fused op: TrainOneStepCell fused vs unfused, mixed precision,
and the training CLI (``python -m models.llama.train``) end to end."""
import functools
import importlib
import json
import re
import sys
import warnings

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, amp, nn

from models.llama import LlamaForCausalLM, preset
from models.llama import train as train_cli
from models.llama.engine import Generator
from models.llama.losses import IGNORE_INDEX, LlamaForTraining
from models.llama.training import cli, data, run_directory, signals, trainer
from models.llama.weights import load_checkpoint


@functools.cache
def _losses(backend, steps=20, level=None, layout="BSH"):
    """The losses of ``steps`` train steps from seed 0, computed once per process (tests in GRAPH_MODE).
    One layer of the tiny model: each layer adds about 3 s to a train step's compile (8 s with two),
    every layer runs the same code, and the gradient reaches the attention op's q, k, v with one too."""
    ms.set_seed(0)
    lm = LlamaForCausalLM(preset("tiny", num_hidden_layers=1), backend=backend, layout=layout)
    net = LlamaForTraining(lm)
    optimizer = nn.AdamWeightDecay(net.trainable_params(), learning_rate=3e-3)
    step = (amp.build_train_network(net, optimizer, level=level, loss_scale_manager=None) if level
            else nn.TrainOneStepCell(net, optimizer))
    ids = np.random.default_rng(0).integers(0, 32, (2, 24)).astype(np.int32)
    ids[:, 12:] = ids[:, :12]  # the second half repeats the first: attention can learn to copy
    if layout == "TND":
        labels = ids.reshape(-1).copy()
        labels[[0, 24]] = IGNORE_INDEX
        batch = (Tensor(ids.reshape(-1)), Tensor(labels), Tensor(np.array([24, 48], np.int64)))
    else:
        batch = (Tensor(ids), Tensor(ids))
    return tuple(float(step(*batch).asnumpy()) for _ in range(steps))


@pytest.mark.xdist_group("llama_training_fused_losses")
def test_fused_tracks_unfused_graph_mode(graph):
    fused, unfused = _losses("fused"), _losses("unfused")
    np.testing.assert_allclose(fused, unfused, rtol=1e-4)  # float32 noise over 20 steps
    assert fused[-1] < 0.4 * fused[0]


@pytest.mark.xdist_group("llama_training_fused_losses")
def test_packed_tnd_batch_trains_like_bsh(graph):
    """Two sequences packed (TND) give the same losses as the same two as a BSH batch (the first 5
    steps of the BSH run test_fused_tracks_unfused_graph_mode trains: one compile for both)."""
    np.testing.assert_allclose(_losses("fused", 5, layout="TND"), _losses("fused")[:5], rtol=1e-4)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_mixed_precision(level, graph):
    """amp on a float32 model (float32 master weights): the loss falls, and fused and unfused track
    each other within float16 noise over the first 10 steps (O2 runs the attention op in float16; at
    this learning rate the two float16 trajectories drift apart by a few percent by step 20)."""
    fused, unfused = _losses("fused", 20, level=level), _losses("unfused", 20, level=level)
    assert np.isfinite(fused).all() and fused[-1] < 0.5 * fused[0]
    np.testing.assert_allclose(fused[:10], unfused[:10], rtol=1e-2)


@pytest.mark.integration
@pytest.mark.starts_first
def test_cli_trains_saves_generates_and_resumes(corpus, tmp_path, capsys):
    out = tmp_path / "run"
    common = ["--model", "tiny", "--data", str(corpus), "--out", str(out), "--seq-len", "64", "--batch-size", "2"]
    train_cli.main(common + ["--steps", "200", "--save-every", "100"])
    final = float(capsys.readouterr().out.split("final loss ")[1].split(";")[0])
    assert final < 1.5  # from ln(256) = 5.5 at the start: the loss fell
    checkpoint = out / "step-200"
    assert (out / "latest").read_text() == "step-200" and (checkpoint / "model.safetensors").exists()
    lm = load_checkpoint(checkpoint, logits="last")
    tokens = Generator(lm).generate([list(b"the ")], 12).tokens[0]
    assert len(tokens) == 12 and all(0 <= t < 256 for t in tokens)
    text = bytes(tokens).decode("utf-8", errors="replace")
    assert any(word in text for word in ("the", "cat", "dog", "sat")), text
    # Resume: the step counter and optimizer state carry on from the last checkpoint.
    train_cli.main(common + ["--steps", "205", "--resume", "--packing", "fixed"])
    assert json.loads((out / "step-205" / "trainer.json").read_text())["step"] == 205


def test_cli_varlen_packing_and_accumulation(corpus, tmp_path, capsys):
    """One layer: each adds about 3 s to the compile of the CLI's graphs, and the packing and the
    accumulation are the same with more."""
    train_cli.main(["--model", "tiny", "--layers", "1", "--data", str(corpus), "--out", str(tmp_path / "v"),
                    "--seq-len", "64", "--packing", "varlen", "--accumulate", "2", "--steps", "6"])
    assert "final loss" in capsys.readouterr().out


@pytest.mark.parametrize("content,message", [
    ("", "no documents (empty file)"),
    ("word " * 200, "longer than the context --seq-len 64"),
])
def test_cli_bad_data(content, message, tmp_path):
    path = tmp_path / "bad.txt"
    path.write_text(content)
    with pytest.raises(ValueError, match=re.escape(message)):
        train_cli.main(["--model", "tiny", "--data", str(path), "--out", str(tmp_path / "o"), "--seq-len", "64"])


def test_cli_too_little_data_for_a_batch(tmp_path):
    """Two short documents fill one row: a batch of 4 rows can never be made (this used to hang)."""
    path = tmp_path / "small.txt"
    path.write_text("the cat\nthe dog\n")
    with pytest.raises(ValueError, match="pack into 1 rows of --seq-len 64 tokens, fewer than --batch-size 4"):
        train_cli.main(["--model", "tiny", "--data", str(path), "--out", str(tmp_path / "o"), "--seq-len", "64",
                        "--batch-size", "4"])


def test_cli_missing_tokenizer(tmp_path, corpus):
    with pytest.raises(ValueError, match="tokenizer: a preset has no tokenizer"):
        train_cli.main(["--model", "7b", "--layers", "1", "--data", str(corpus), "--out", str(tmp_path / "o")])


# What models.llama.train held before training became a package: (name, its module now).
MOVED = [(name, data) for name in ("ByteTokenizer", "make_tokenizer", "read_documents", "batches",
                                   "data_parallel_share")] + \
    [(name, trainer) for name in ("TOKENIZER_FILES", "TRAINER_STATE", "REPLAY_ARGS", "learning_rates", "LossAndGrads",
                                  "clip_by_global_norm", "Trainer", "trainer_state", "replay_state",
                                  "resume_problems")] + \
    [("StopRequest", signals), ("build_model", cli), ("positive_int", cli)]


@pytest.mark.parametrize("name, module", MOVED, ids=[name for name, _ in MOVED])
def test_an_old_name_of_the_train_module_still_works_and_warns(name, module):
    """For one release users' imports of the old names keep working, told where the name went."""
    with pytest.warns(DeprecationWarning, match=re.escape(f"models.llama.train.{name} moved to {module.__name__}.")):
        assert getattr(train_cli, name) is getattr(module, name)


def test_the_cli_entry_point_and_the_old_run_directory_path():
    """``main`` is the CLI, not a moved name: no warning. ``models.llama.run_directory`` is the moved
    module itself (so a monkeypatch through either name reaches the one in use), with a warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert train_cli.main is cli.main
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        train_cli.no_such_name
    sys.modules.pop("models.llama.run_directory", None)
    with pytest.warns(DeprecationWarning, match="models.llama.run_directory moved to models.llama.training"):
        assert importlib.import_module("models.llama.run_directory") is run_directory
