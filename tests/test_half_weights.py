"""Half checkpoints kept in their own precision (issue 39): float16 / bfloat16 safetensors (Hugging
Face and Meta layouts) load with their weights' dtype by default, with no float32 copy
of any weight (peak RSS asserted, in a process of its own, on the bfloat16 model forced onto the
AVX2 build, a CPU without bfloat16 instructions), and compute the float32 model of the same
half-rounded weights (compute_dtype="float32"; the default, "auto", computes a half checkpoint in
its own dtype where the CPU has instructions for it: tests/test_compute_dtype.py): logits within 1e-4
relative in both modes, the same greedy tokens, the float16 KV cache by default. Training-side
models keep float32 master weights."""
import json
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor

from models.llama import LlamaForCausalLM, preset
from models.llama.generate import Generator
from models.llama.weights import checkpoint_dtype, load_checkpoint, save_hf_checkpoint
from test_llama import CONFIG, meta_checkpoint, random_state, state_shapes

ROOT = Path(__file__).resolve().parents[1]
HALF = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
RTOL = 1e-4


@pytest.fixture(scope="module", params=list(HALF))
def half_checkpoint(request, tmp_path_factory):
    state = {k: v.astype(HALF[request.param]) for k, v in random_state(CONFIG, np.random.default_rng(3)).items()}
    return request.param, state, save_hf_checkpoint(state, CONFIG, tmp_path_factory.mktemp(request.param))


def relative(a, b):
    return np.abs(a - b).max() / np.abs(b).max()


@pytest.fixture(scope="module")
def half_and_full(half_checkpoint):
    """The half checkpoint's model as loaded by default (its weights' dtype, computing in float32) and
    converted to float32, loaded once for the tests that run them; their first layer only (every layer
    runs the same code, and each adds to the compiles of their forward and generator graphs)."""
    _, _, path = half_checkpoint
    return (load_checkpoint(path, progress=False, compute_dtype="float32", num_layers=1),
            load_checkpoint(path, progress=False, weight_dtype="float32", num_layers=1))


def test_half_checkpoint_keeps_its_dtype_and_equals_the_float32_model(half_checkpoint, half_and_full, mode, rng):
    dtype, _, path = half_checkpoint
    half, full = half_and_full
    assert checkpoint_dtype(path) == dtype
    assert str(half.weight_dtype).lower() == dtype and half.dtype == ms.float32 and half.cache_dtype == ms.float16
    assert full.weight_dtype == ms.float32 and full.cache_dtype == ms.float32
    norms = [p for name, p in half.parameters_dict().items() if "norm" in name]
    assert norms and all(p.dtype == ms.float32 for p in norms)
    ids = Tensor(rng.integers(0, CONFIG.vocab_size, (2, 13)).astype(np.int32))
    assert relative(half(ids).asnumpy(), full(ids).asnumpy()) <= RTOL


def test_half_checkpoint_generates_the_float32_models_greedy_tokens(half_and_full, rng):
    """The generators compile their graphs in either execution mode: run once per dtype."""
    half, full = half_and_full
    prompts = [rng.integers(0, CONFIG.vocab_size, n).tolist() for n in (9, 4)]
    got = Generator(half, slots=2).generate(prompts, 6)
    want = Generator(full, slots=2, cache_dtype="float16").generate(prompts, 6)
    assert got.tokens == want.tokens


def test_tied_embeddings_with_half_weights(rng):
    config = CONFIG.replace(tie_word_embeddings=True)
    state = random_state(config, np.random.default_rng(5))
    state.pop("lm_head.weight")
    half = {k: v.astype(np.float16) for k, v in state.items()}
    ids = Tensor(rng.integers(0, config.vocab_size, (1, 7)).astype(np.int32))
    models = []
    for weight_dtype in ("float16", "float32"):
        lm = LlamaForCausalLM(config, weight_dtype=weight_dtype, compute_dtype="float32")
        for name, p in lm.parameters_dict().items():
            p.set_data(Tensor(half[name].astype(np.float32)).astype(p.dtype))
        models.append(lm(ids).asnumpy())
    assert relative(*models) <= RTOL


def test_meta_half_checkpoint_keeps_its_dtype(tmp_path, rng):
    state = {k: v.astype(ml_dtypes.bfloat16) for k, v in random_state(CONFIG, np.random.default_rng(4)).items()}
    directory = meta_checkpoint(state, CONFIG, tmp_path / "meta", shards=2)
    lm = load_checkpoint(directory, progress=False, compute_dtype="float32")
    assert lm.weight_dtype == ms.bfloat16
    reference = load_checkpoint(save_hf_checkpoint(state, CONFIG, tmp_path / "hf"), progress=False,
                                weight_dtype="float32")
    ids = Tensor(rng.integers(0, CONFIG.vocab_size, (1, 9)).astype(np.int32))
    assert relative(lm(ids).asnumpy(), reference(ids).asnumpy()) <= RTOL


def test_training_models_keep_float32_master_weights(half_checkpoint):
    """The trainer builds its model in float32 and load_weights converts into it."""
    from models.llama.weights import load_weights
    _, _, path = half_checkpoint
    lm = LlamaForCausalLM(CONFIG)
    load_weights(lm, path, progress=False)
    assert all(p.dtype == ms.float32 for p in lm.trainable_params())


LOAD_SCRIPT = """
import json, resource, sys
import mindspore as ms
ms.set_device("CPU")
from models.llama.weights import load_checkpoint
from ms_rope_attention import linear
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
lm = load_checkpoint(sys.argv[1], progress=False, logits="last")
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
weights = sum(p.nbytes for p in lm.get_parameters())
print(json.dumps({"peak_growth": after - before, "weights": weights, "dtype": str(lm.weight_dtype),
                  "isa": linear.library_isa()}))
"""


def test_loading_makes_no_float32_copy(tmp_path):
    """A 0.23 GB bfloat16 model (0.47 GB in float32): the load's peak RSS growth stays below the
    weights plus a quarter, where one float32 copy of them would add twice the weights. The load
    reads no value: every weight is 0.01 (drawing 117 M random numbers took seconds)."""
    config = preset("tiny").replace(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                                    num_attention_heads=8, num_key_value_heads=8, vocab_size=32000)
    state = {name: np.full(shape, 0.01, ml_dtypes.bfloat16) for name, shape in state_shapes(config).items()}
    path = save_hf_checkpoint(state, config, tmp_path / "bf16")
    del state
    out = subprocess.run([sys.executable, "-c", LOAD_SCRIPT, str(path)], capture_output=True, text=True, cwd=ROOT,
                         env={**__import__("os").environ, "RFA_CPU_ISA": "avx2", "PYTHONPATH": str(ROOT)},
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["dtype"] == "BFloat16" and result["isa"] == "avx2"
    assert result["weights"] > 2e8
    assert result["peak_growth"] < 1.25 * result["weights"], result
