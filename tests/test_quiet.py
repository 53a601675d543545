"""Quiet by default: a normal run (generate, train, the Cell and the functional op in both modes with
dynamic shapes) prints no framework warning, each run in a fresh process whose whole output is read.
And the argument checks that dynamic shapes move still run: known dimensions when the graph
compiles, dynamic ones in the kernel when it launches."""
import os
import subprocess
import sys
from pathlib import Path

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, nn

import ms_rope_attention as mra
from ms_rope_attention.cpu_kernel import last_error

ROOT = Path(__file__).resolve().parents[1]
# A MindSpore log line ("[WARNING] ME(...)", "[ERROR] ...") or a Python warning ("...Warning: ...").
NOISE = ("[WARNING]", "[ERROR]", "Warning: ")


def _run(args, cwd):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    noisy = [line for line in output.splitlines() if any(mark in line for mark in NOISE)]
    assert not noisy, "\n".join(noisy[:20])
    return output


@pytest.mark.integration
@pytest.mark.parametrize("cache", [[], ["--paged"]], ids=["contiguous", "paged"])
def test_generate_is_quiet(tmp_path, cache):
    out = _run(["-m", "models.llama.generate", "--model", "tiny", "--ids", "1,15,27", "--ids", "1,9",
                "--max-new-tokens", "4", *cache], tmp_path)
    assert "backend fused:CPU" in out


@pytest.mark.integration
@pytest.mark.parametrize("packing", ["fixed", "varlen"])
def test_train_is_quiet(corpus, tmp_path, packing):
    out = _run(["-m", "models.llama.train", "--model", "tiny", "--data", str(corpus), "--out", str(tmp_path / "run"),
                "--seq-len", "64", "--batch-size", "2", "--steps", "2", "--packing", packing], tmp_path)
    assert "final loss" in out


@pytest.mark.integration
def test_cell_and_functional_with_dynamic_shapes_are_quiet(tmp_path):
    out = _run([str(ROOT / "tests" / "scripts" / "dynamic_shape_calls.py")], tmp_path)
    assert "calls done" in out


class _Attend(nn.Cell):
    def __init__(self):
        super().__init__()
        self.cos, self.sin = mra.shared_rope_tables(16, 64)

    def construct(self, q, k, v):
        return mra.rotary_flash_attention(q, k, v, self.cos, self.sin, input_layout="BSND")


def _dynamic_attend(kv_dim=16):
    """The op in a GRAPH_MODE Cell compiled for any sequence length (query head_dim 16)."""
    ms.set_context(mode=ms.GRAPH_MODE)
    net = _Attend()
    net.set_inputs(*(Tensor(shape=[1, None, 2, d], dtype=ms.float32) for d in (16, kv_dim, kv_dim)))
    return net


def _ones(length, dim=16):
    return Tensor(np.ones((1, length, 2, dim), np.float32))


def test_dynamic_graph_still_checks_known_dimensions_at_compile():
    net = _dynamic_attend(kv_dim=8)
    with pytest.raises(ValueError, match="key"):
        net(_ones(5), _ones(5, 8), _ones(5, 8))


def test_dynamic_graph_leaves_dynamic_dimensions_to_the_kernel():
    net = _dynamic_attend()
    assert net(_ones(5), _ones(5), _ones(5)).shape == (1, 5, 2, 16)
    with pytest.raises(RuntimeError):
        net(_ones(5), _ones(7), _ones(6)).asnumpy()  # key and value lengths differ: known only at launch
    assert "value" in last_error(), last_error()
