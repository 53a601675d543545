"""fuse() on MindFormers 2.0.0's Llama (tiny, random weights), GRAPH_MODE and PyNative: the training /
prefill path (use_past=False), and the serving path (use_past=True: InferAttention over the paged
cache), whose generate cannot run on a CPU unfused and after fuse gives use_past=False's tokens."""
import os
import sys
import tempfile
from pathlib import Path

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import mindformers_compat  # noqa: E402

mindformers_compat.install()
os.environ.setdefault("LOCAL_DEFAULT_PATH", tempfile.mkdtemp(prefix="mindformers-output-"))

from mindformers.models.llama import LlamaConfig, LlamaForCausalLM  # noqa: E402
from mindformers.models.llama import llama_transformer  # noqa: E402

from ms_rope_attention import FuseError, fuse, unfuse  # noqa: E402
from ms_rope_attention.fusion import FAMILIES  # noqa: E402
from ms_rope_attention.fusion import mindformers as family  # noqa: E402
from ms_rope_attention.paged import paged_calls, rotated_keys  # noqa: E402

LENGTH = 12
PROMPT = np.array([[5, 9, 3, 7, 11, 4, 8, 6, 2, 10, 12, 13]], np.int32)
PADDED = np.array([[5, 9, 3, 7, 11, 4, 8, 6, 2, 10, 0, 0]], np.int32)  # 0 is MindFormers' pad_token_id


@pytest.fixture(params=["pynative", "graph"])
def mode(request):
    ms.set_context(mode=ms.PYNATIVE_MODE if request.param == "pynative" else ms.GRAPH_MODE)
    yield request.param
    ms.set_context(mode=ms.PYNATIVE_MODE)


def tiny_llama(seed=0, **overrides):
    settings = dict(batch_size=1, seq_length=LENGTH, hidden_size=64, num_layers=2, num_heads=4, n_kv_heads=2,
                    intermediate_size=128, vocab_size=96, compute_dtype="float32", layernorm_compute_type="float32",
                    softmax_compute_type="float32", rotary_dtype="float32", param_init_type="float32",
                    use_past=False, use_flash_attention=False, use_rope_slice=True, fused_rms_norm=False)
    settings.update(overrides)
    ms.set_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**settings))
    model.set_train(False)
    return model


def logits(model, ids):
    return model(Tensor(ids))[0].asnumpy().astype(np.float64)


def relative(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


def test_every_site_fused_and_logits_match_the_original(mode, spy):
    model = tiny_llama()
    want = logits(model, PROMPT)  # compiled first: fuse must drop that graph for the fused code to run
    calls = spy(family)
    report = fuse(model)
    assert report.fused == ["model.layers.0.attention", "model.layers.1.attention"], str(report)
    assert all(site.probe_error < 1e-5 for site in report), str(report)
    if mode == "graph":
        assert any("compiled in GRAPH_MODE" in note for note in report.notes), str(report)
    got = logits(model, PROMPT)
    assert calls, "the fused op never ran"
    assert 0 < relative(got, want) < 1e-4
    assert unfuse(model) == report.fused
    np.testing.assert_array_equal(logits(model, PROMPT), want)


def test_a_pad_token_runs_the_original_code_and_says_so(mode, fallback_warnings):
    model = tiny_llama()
    want = logits(model, PADDED)
    fuse(model)
    np.testing.assert_array_equal(logits(model, PADDED), want)
    assert any("model.layers.0.attention" in m and "not exactly causal" in m for m in fallback_warnings()), \
        fallback_warnings()


def test_greedy_generation_is_unchanged():
    ms.set_context(mode=ms.PYNATIVE_MODE)
    model = tiny_llama(seed=3, is_dynamic=True)  # prompts shorter than seq_length

    def greedy(steps=5):
        ids = PROMPT[:, :6]
        for _ in range(steps):
            ids = np.concatenate([ids, logits(model, ids)[:, -1:].argmax(-1).astype(np.int32)], axis=1)
        return ids

    want = greedy()
    assert fuse(model).all_fused
    np.testing.assert_array_equal(greedy(), want)


def test_configurations_not_covered_are_reported_and_strict_refuses_them():
    model = tiny_llama(use_past=True, block_size=8, num_blocks=8)
    report = fuse(model)
    assert report.not_fused == ["model.layers.0.attention", "model.layers.1.attention"]
    assert report["model.layers.0.attention"].reason.startswith("block_size=8")
    with pytest.raises(FuseError, match="block_size=8"):
        fuse(model, strict=True)
    assert type(model.model.layers[0].attention.infer_attention).__name__ == "InferAttention"


# ---- use_past=True: MindFormers' serving path ----

SERVING = dict(seq_length=64, block_size=16, num_blocks=16, eos_token_id=95, pad_token_id=0)
PROMPTS = [[5, 9, 3, 7, 11, 4, 8, 6, 21, 10, 12, 13, 30], [17, 4, 9, 44, 3, 8, 60]]  # 13 and 7 tokens
NEW_TOKENS = 8  # the first prompt crosses into its second block of 16


def greedy_without_cache(model, prompt, steps):
    """use_past=False, PyNative: every step a full forward over the prompt and the tokens so far."""
    mode = ms.get_context("mode")
    ms.set_context(mode=ms.PYNATIVE_MODE)
    try:
        ids = np.array([prompt], np.int32)
        for _ in range(steps):
            ids = np.concatenate([ids, logits(model, ids)[:, -1:].argmax(-1).astype(np.int32)], axis=1)
    finally:
        ms.set_context(mode=mode)
    return ids[0, len(prompt):].tolist()


def serving_pair(eager, is_dynamic, use_flash_attention, batch_size):
    """A use_past=True model and a use_past=False one (dynamic lengths) with the same weights."""
    plain = tiny_llama(seed=5, is_dynamic=True, **SERVING)
    if eager:
        os.environ["ENFORCE_EAGER"] = "true"  # MindFormers' PyNative, read when the model is built
    try:
        ms.set_context(mode=ms.PYNATIVE_MODE if eager else ms.GRAPH_MODE)
        served = tiny_llama(seed=5, use_past=True, is_dynamic=is_dynamic, use_flash_attention=use_flash_attention,
                            batch_size=batch_size, **SERVING)
    finally:
        os.environ.pop("ENFORCE_EAGER", None)
    weights = {p.name: p for p in plain.get_parameters()}
    for p in served.get_parameters():
        if p.name in weights:
            p.set_data(weights[p.name].data)
    return served, plain


@pytest.mark.parametrize("eager, is_dynamic, use_flash_attention, batch", [
    (False, True, True, 2),    # GRAPH_MODE, prompts packed (TH), dynamic shapes: MindFormers' main path
    (False, False, True, 2),   # GRAPH_MODE, static shapes, prompts padded to seq_length (BSH)
    (True, False, False, 2),   # PyNative (ENFORCE_EAGER), BSH
], ids=["graph-TH", "graph-BSH", "pynative-BSH"])
def test_use_past_generate_runs_on_a_cpu_after_fuse_with_the_tokens_of_use_past_false(
        eager, is_dynamic, use_flash_attention, batch):
    served, plain = serving_pair(eager, is_dynamic, use_flash_attention, batch)
    prompts = PROMPTS[:batch]
    want = [greedy_without_cache(plain, p, NEW_TOKENS) for p in prompts]
    report = fuse(served)
    assert report.fused == ["model.layers.0.attention", "model.layers.1.attention"], str(report)
    assert report["model.layers.0.attention"].family == "mindformers-llama-infer"
    assert all(site.probe_error < 1e-5 for site in report), str(report)
    paged, rotated = paged_calls(), rotated_keys()
    for _ in range(2):  # a second generate: MindFormers sets its prefill flag again
        width = max(map(len, prompts))  # MindFormers takes a batch right-padded with pad_token_id
        out = served.generate([p + [0] * (width - len(p)) for p in prompts], max_new_tokens=NEW_TOKENS,
                              do_sample=False)
        got = [list(map(int, row))[len(p):len(p) + NEW_TOKENS] for row, p in zip(out, prompts)]
        assert got == want
    layers = 2
    assert paged_calls() - paged == 2 * layers * (NEW_TOKENS - 1)  # a paged decode call per layer and step
    assert rotated_keys() - rotated == 2 * layers * batch * (NEW_TOKENS - 1) * 2  # one new key per step, 2 KV heads


def test_use_past_unfused_cannot_run_on_a_cpu():
    """What fuse fixes: MindFormers' own serving kernels are Ascend's."""
    served, _ = serving_pair(False, True, True, 1)
    with pytest.raises(Exception):  # noqa: B017 (MindSpore's own error: no CPU kernel)
        served.generate(PROMPTS[:1], max_new_tokens=2, do_sample=False)


def test_use_past_unfuse_restores_infer_attention():
    served, _ = serving_pair(False, True, True, 1)
    report = fuse(served)
    infer = served.model.layers[0].attention.infer_attention
    assert type(infer).__name__.startswith("RotaryFused") and hasattr(infer, "rfa_cos")
    family = next(f for f in FAMILIES if f.name == "mindformers-llama-infer")
    family.uninstall(served.model.layers[1].attention)  # one site back: the model keeps its CPU twins
    assert type(served).__name__.startswith("RotaryFused") and "rfa_original_argmax" in vars(served)
    assert unfuse(served) == report.fused[:1]
    assert type(infer).__name__ == "InferAttention" and not hasattr(infer, "rfa_cos")
    assert type(served).__name__ == "LlamaForCausalLM" and "rfa_original_argmax" not in vars(served)


def test_edited_code_is_left_alone(monkeypatch):
    model = tiny_llama()
    edited = llama_transformer.LLamaAttention.construct

    def construct(self, x, freqs_cis, mask=None, **kwargs):  # e.g. a user's patch around the original
        return edited(self, x, freqs_cis, mask, **kwargs)

    monkeypatch.setattr(llama_transformer.LLamaAttention, "construct", construct)
    report = fuse(model)
    assert not report.fused and "differs from the tested" in report["model.layers.0.attention"].reason

    monkeypatch.undo()
    model.model.layers[1].attention.construct = lambda *args: None  # replaced on one instance
    report = fuse(model)
    assert report.fused == ["model.layers.0.attention"]
    assert report["model.layers.1.attention"].reason == "its construct was replaced on the instance"


def test_a_subclass_is_not_taken_for_the_tested_class():
    class MyAttention(llama_transformer.LLamaAttention):
        pass

    model = tiny_llama()
    model.model.layers[0].attention.__class__ = MyAttention
    report = fuse(model, dry_run=True)
    assert report["model.layers.0.attention"].reason.startswith("no fuse family recognises")
    assert report["model.layers.1.attention"].status == "fused" and report.dry_run
    assert type(model.model.layers[1].attention) is llama_transformer.LLamaAttention  # a dry run changes nothing
