"""Checkpoint configs as Hugging Face transformers writes them, in both spellings (>= 5:
``rope_parameters``; older: top-level ``rope_theta`` / ``rope_scaling`` / ``partial_rotary_factor``),
and Meta's params.json: both load to the same config, cos/sin tables and logits; the tables equal an
independent float64 computation of each scaling rule; every variant compiles in GRAPH_MODE; and
what cannot be honoured is an error, never ignored."""
import json
import math
import re

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor

from llama_reference import forward
from models.llama import LlamaForCausalLM, LlamaConfig, preset
from models.llama.config import META_SCALED_ROPE
from models.llama.engine.cli import main as generate_main
from models.llama.rope_scaling import model_rope_tables
from models.llama.weights import load_checkpoint, read_config, save_hf_checkpoint
from test_llama import random_state

TINY = preset("tiny")
THETA = 500000.0
SCALINGS = {
    "linear": {"factor": 2.0},
    "dynamic": {"factor": 2.0},
    "llama3": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    "yarn": {"factor": 4.0, "original_max_position_embeddings": 128, "beta_fast": 32.0, "beta_slow": 1.0},
}


def independent_inv_freq(kind, fields, theta, rd, cache, trained):
    """Each rule's inverse frequencies written as plain scalar loops from its published formula."""
    base = [theta ** (-2 * i / rd) for i in range(rd // 2)]
    if kind is None:
        return np.array(base), 1.0
    factor = fields["factor"]
    if kind == "linear":
        return np.array([f / factor for f in base]), 1.0
    if kind == "dynamic":  # NTK base for a context of `cache` positions beyond the trained length
        if cache <= trained:
            return np.array(base), 1.0
        new_theta = theta * (factor * cache / trained - (factor - 1)) ** (rd / (rd - 2))
        return np.array([new_theta ** (-2 * i / rd) for i in range(rd // 2)]), 1.0
    if kind == "llama3":
        low, high, original = fields["low_freq_factor"], fields["high_freq_factor"], fields[
            "original_max_position_embeddings"]
        out = []
        for f in base:
            wavelength = 2 * math.pi / f
            if wavelength < original / high:
                out.append(f)
            elif wavelength > original / low:
                out.append(f / factor)
            else:
                smooth = (original / wavelength - low) / (high - low)
                out.append((1 - smooth) * f / factor + smooth * f)
        return np.array(out), 1.0
    original = fields["original_max_position_embeddings"]  # yarn
    dim_of = lambda turns: rd * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(theta))  # noqa: E731
    low, high = max(math.floor(dim_of(fields["beta_fast"])), 0), min(math.ceil(dim_of(fields["beta_slow"])), rd - 1)
    out = []
    for i, f in enumerate(base):
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        out.append(f * (1 - ramp) + f / factor * ramp)
    return np.array(out), 0.1 * math.log(factor) + 1


def dimensions(**changes):
    """The tiny preset with one layer (a second computes the same RoPE tables and only adds to each
    graph's compile) as a config.json dict without any RoPE setting."""
    dims = dict(TINY.to_hf(), num_hidden_layers=1, **changes)
    for key in ("rope_theta", "rope_scaling", "partial_rotary_factor"):
        dims.pop(key, None)
    return dims


def configs(kind, partial=0.5):
    """The same settings as transformers >= 5 and as older versions write them."""
    dims = dimensions()
    scaling = SCALINGS.get(kind, {})
    new = dict(dims, rope_parameters={"rope_type": kind or "default", "rope_theta": THETA,
                                      "partial_rotary_factor": partial, **scaling})
    old = dict(dims, rope_theta=THETA, partial_rotary_factor=partial,
               rope_scaling={"type": kind, **scaling} if kind else None)
    return new, old


@pytest.mark.parametrize("kind", [None, "linear", "dynamic", "llama3", "yarn"])
def test_both_spellings_load_identically_and_match_the_rule(kind):
    new, old = configs(kind)
    a, b = LlamaConfig.from_hf(new), LlamaConfig.from_hf(old)
    assert a == b and a.rope_theta == THETA and a.rotary_dim == TINY.dim_per_head // 2
    assert a.rope_scaling_type == kind
    cache = 2 * TINY.max_position_embeddings  # beyond the trained length: dynamic rescales
    cos_a, sin_a = model_rope_tables(a, cache)
    cos_b, sin_b = model_rope_tables(b, cache)
    np.testing.assert_array_equal(cos_a, cos_b)
    np.testing.assert_array_equal(sin_a, sin_b)
    inv, attention = independent_inv_freq(kind, SCALINGS.get(kind), THETA, a.rotary_dim, cache,
                                          TINY.max_position_embeddings)
    angles = np.arange(cache)[:, None] * inv[None, :]
    np.testing.assert_allclose(cos_a, np.cos(np.concatenate([angles, angles], 1)) * attention, atol=2e-6)
    np.testing.assert_allclose(sin_a, np.sin(np.concatenate([angles, angles], 1)) * attention, atol=2e-6)


def test_rope_scaling_with_rope_type_key_and_no_scaling():
    _, old = configs("llama3")
    old["rope_scaling"] = {"rope_type": "llama3", **SCALINGS["llama3"]}
    assert LlamaConfig.from_hf(old).rope_scaling == {"rope_type": "llama3", **SCALINGS["llama3"]}
    plain = TINY.to_hf()
    assert LlamaConfig.from_hf(plain).rope_scaling is None and LlamaConfig.from_hf(plain).rope_theta == 10000.0


@pytest.mark.parametrize("edit,message", [
    (lambda c: c["rope_parameters"].update(rope_type="longrope"), "rope_type expected one of"),
    (lambda c: c["rope_parameters"].update(short_factor=[1.0]), "does not use ['short_factor']"),
    (lambda c: c.update(rope_parameters={"full_attention": {"rope_type": "default"}}), "per-layer-type"),
    (lambda c: c.update(rope_theta=10000.0), "rope_theta: 10000.0 at the top level"),
    (lambda c: c.update(rope_scaling={"type": "linear", "rope_type": "yarn", "factor": 2.0}), "disagree"),
    (lambda c: c["rope_parameters"].update(partial_rotary_factor=1.5), "partial_rotary_factor"),
])
def test_what_cannot_be_honoured_is_an_error(edit, message):
    new, _ = configs("yarn")
    edit(new)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
        LlamaConfig.from_hf(new)


def test_meta_llama3_params():
    params = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 256, "multiple_of": 32,
              "ffn_dim_multiplier": 1.3, "norm_eps": 1e-5, "rope_theta": THETA, "use_scaled_rope": True}
    config = LlamaConfig.from_meta(params)
    assert config.rope_theta == THETA and config.rope_scaling == META_SCALED_ROPE and config.rotary_mode == 1
    assert LlamaConfig.from_meta(dict(params, use_scaled_rope=False)).rope_scaling is None


LLAMA31 = LlamaConfig.from_hf(dimensions(
    head_dim=32, num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True,
    rope_parameters={"rope_type": "llama3", "rope_theta": THETA, **SCALINGS["llama3"]}))  # 4 x 32 != hidden 64


@pytest.mark.parametrize("name", ["llama3.1", "linear", "dynamic", "yarn"])
def test_scaled_models_compile_in_graph_mode_and_match_pynative_and_reference(name, tmp_path, rng):
    config = LLAMA31 if name == "llama3.1" else LlamaConfig.from_hf(configs(name, 1.0)[0])
    state = random_state(config, rng)
    if config.tie_word_embeddings:
        del state["lm_head.weight"]
    path = save_hf_checkpoint(state, config, tmp_path / name)
    ids = rng.integers(0, config.vocab_size, 37).tolist()
    logits = {}
    for mode in (ms.GRAPH_MODE, ms.PYNATIVE_MODE):
        ms.set_context(mode=mode)
        model = load_checkpoint(path, progress=False)
        logits[mode] = model(Tensor(np.array([ids], np.int32))).asnumpy()[0]
    inv, attention = independent_inv_freq(config.rope_scaling_type, config.rope_scaling, THETA, config.rotary_dim,
                                          config.max_position_embeddings, config.max_position_embeddings)
    expected = forward(state, config, ids, inv, attention)
    assert np.abs(logits[ms.GRAPH_MODE] - logits[ms.PYNATIVE_MODE]).max() <= 1e-5
    assert np.abs(logits[ms.GRAPH_MODE] - expected).max() <= 1e-4


def test_generate_cli_graph_mode_on_llama31_checkpoint(tmp_path, rng, capsys):
    state = random_state(LLAMA31, rng)
    del state["lm_head.weight"]
    path = save_hf_checkpoint(state, LLAMA31, tmp_path / "llama31")
    config = json.loads((path / "config.json").read_text())
    config.pop("rope_scaling"), config.pop("rope_theta")  # as transformers >= 5 writes it
    config["rope_parameters"] = {"rope_type": "llama3", "rope_theta": THETA, **SCALINGS["llama3"]}
    (path / "config.json").write_text(json.dumps(config))
    assert read_config(path)[0] == LLAMA31
    generate_main(["--checkpoint", str(path), "--ids", "1,5,9,77", "--max-new-tokens", "4", "--mode", "graph"])
    assert "prompt ids [1, 5, 9, 77] ->" in capsys.readouterr().out


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_mixed_precision_inference(level, rng):
    """amp on a float32 model: logits within float16 error of float32; norms and softmax statistics
    stay float32 (RMSNorm computes in float32; the kernel accumulates in float32). The amp model runs
    in GRAPH_MODE; the float32 reference in PyNative (it compiles no graph)."""
    from mindspore import amp

    state = random_state(TINY, rng)
    ids = Tensor(np.array([rng.integers(0, TINY.vocab_size, 29)], np.int32))
    full = LlamaForCausalLM(TINY)
    for name, param in full.parameters_dict().items():
        param.set_data(Tensor(state[name]))
    ms.set_context(mode=ms.PYNATIVE_MODE)
    expected = full(ids)[0].asnumpy()
    ms.set_context(mode=ms.GRAPH_MODE)
    mixed = amp.auto_mixed_precision(LlamaForCausalLM(TINY), level)
    for name, param in mixed.parameters_dict().items():
        param.set_data(Tensor(state[name]))
    got = mixed(ids)[0].asnumpy()
    assert np.abs(got - expected).max() <= 0.05 * np.abs(expected).max()


def test_dtype_accepts_mindspore_dtypes_and_strings():
    ms.set_context(mode=ms.PYNATIVE_MODE)
    for dtype in (ms.float16, "float16"):
        model = LlamaForCausalLM(TINY, dtype=dtype)
        assert model.model.embed_tokens.weight.dtype == ms.float16
    with pytest.raises(ValueError, match="dtype: expected one of"):
        LlamaForCausalLM(TINY, dtype=ms.int32)


def test_fields_a_config_json_leaves_out_take_transformers_defaults(tmp_path):
    """transformers' LlamaConfig defaults (4.57: rms_norm_eps 1e-6, max_position_embeddings 2048,
    num_key_value_heads = num_attention_heads), not the 7B preset's (1e-5, 4096, 32)."""
    config = LlamaConfig.from_hf({"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                                  "num_attention_heads": 8, "vocab_size": 100})
    assert (config.rms_norm_eps, config.max_position_embeddings, config.num_key_value_heads) == (1e-6, 2048, 8)
    assert (config.rope_theta, config.tie_word_embeddings, config.bos_token_id, config.eos_token_id) == \
        (10000.0, False, 1, 2)
    assert LlamaConfig.from_hf({}) == LlamaConfig(rms_norm_eps=1e-6, max_position_embeddings=2048)


@pytest.mark.parametrize("field, value, expected", [
    ("hidden_act", "gelu", "'silu'"), ("attention_bias", True, "False"), ("mlp_bias", True, "False"),
    ("sliding_window", 4096, "null (absent)")])
def test_what_the_model_does_not_compute_is_refused_naming_config_json(field, value, expected, tmp_path):
    raw = {**TINY.to_hf(), field: value}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    message = f"config.json: not a Llama config this model computes ({field}: {value!r} is not supported; this " \
              f"Llama computes {field} = {expected})"
    with pytest.raises(ValueError, match=re.escape(message)):
        read_config(tmp_path)
    for accepted in ({**raw, field: None}, {k: v for k, v in raw.items() if k != field}):
        (tmp_path / "config.json").write_text(json.dumps(accepted))
        assert read_config(tmp_path)[0] == TINY


def test_a_bad_config_json_or_params_json_is_an_error_naming_the_file(tmp_path):
    raw = {**TINY.to_hf(), "num_key_value_heads": 3}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=rf"{tmp_path / 'config.json'}: .*num_key_value_heads: 3 must divide"):
        read_config(tmp_path)
    meta = tmp_path / "meta"
    meta.mkdir()
    (meta / "params.json").write_text(json.dumps({"dim": 64, "n_heads": 4, "vocab_size": 100}))
    with pytest.raises(ValueError, match=rf"{meta / 'params.json'}: lacks 'n_layers'"):
        read_config(meta)
    (meta / "params.json").write_text("{not json")
    with pytest.raises(ValueError, match=rf"{meta / 'params.json'}: not a Llama params.json"):
        read_config(meta)


def test_a_corrupt_tokenizer_json_is_an_error_naming_the_file(tmp_path):
    from models.llama.tokenizer import Tokenizer

    (tmp_path / "tokenizer.json").write_text('{"model": 3}')
    with pytest.raises(ValueError, match=rf"{tmp_path / 'tokenizer.json'}: not a readable tokenizer"):
        Tokenizer.from_directory(tmp_path)
