"""RoPE scaling (Hugging Face ``rope_scaling``) checked frequency by frequency against the published
formulas, written here as plain scalar loops, and end to end through the model."""
import math

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor

from llama_reference import forward
from models.llama import LlamaForCausalLM, preset
from models.llama.rope_scaling import model_inverse_frequencies, model_rope_tables
from test_llama import random_state

BASE = preset("tiny", hidden_size=128, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)
D = 64  # head_dim of BASE


def plain(theta=10000.0, d=D):
    return [theta ** (-2 * i / d) for i in range(d // 2)]


def test_linear_is_position_interpolation():
    config = BASE.replace(rope_scaling={"rope_type": "linear", "factor": 4.0})
    inv, attention = model_inverse_frequencies(config, 256)
    assert attention == 1.0
    np.testing.assert_allclose(inv, np.array(plain()) / 4, rtol=1e-15)
    cos, _ = model_rope_tables(config, 256)
    cos0, _ = model_rope_tables(BASE, 256)
    np.testing.assert_allclose(cos[4 * 50], cos0[50], atol=1e-6)  # position 200 looks like position 50


def test_dynamic_ntk_rescales_the_base_beyond_the_trained_length():
    config = BASE.replace(rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    inv, _ = model_inverse_frequencies(config, 256)  # within max_position_embeddings: unchanged
    np.testing.assert_allclose(inv, plain(), rtol=1e-15)
    inv, _ = model_inverse_frequencies(config, 512)  # L = 2 L0: base * (2 * 2 - 1) ** (d / (d - 2))
    base = 10000.0 * 3.0 ** (D / (D - 2))
    np.testing.assert_allclose(inv, plain(base), rtol=1e-12)


def test_llama3_matches_the_published_rule():
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}  # Llama 3.1's released config
    config = BASE.replace(rope_theta=500000.0, rope_scaling=scaling)
    inv, _ = model_inverse_frequencies(config, 256)
    kinds = set()
    for got, f in zip(inv, plain(500000.0)):
        wavelength = 2 * math.pi / f
        if wavelength < 8192 / 4:
            want, kind = f, "high"
        elif wavelength > 8192 / 1:
            want, kind = f / 8, "low"
        else:
            smooth = (8192 / wavelength - 1) / (4 - 1)
            want, kind = (1 - smooth) * f / 8 + smooth * f, "mid"
        kinds.add(kind)
        assert got == pytest.approx(want, rel=1e-12)
    assert kinds == {"high", "mid", "low"}


def test_yarn_matches_the_paper():
    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}
    config = BASE.replace(rope_scaling=scaling)
    inv, attention = model_inverse_frequencies(config, 1024)
    assert attention == pytest.approx(0.1 * math.log(4.0) + 1)
    dim_of = lambda rotations: D * math.log(256 / (rotations * 2 * math.pi)) / (2 * math.log(10000.0))  # noqa: E731
    low, high = math.floor(dim_of(32)), math.ceil(dim_of(1))
    for i, (got, f) in enumerate(zip(inv, plain())):
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)  # 0: extrapolate (keep), 1: interpolate (/ factor)
        assert got == pytest.approx(f * (1 - ramp) + f / 4 * ramp, rel=1e-12)
    assert inv[0] == pytest.approx(1.0) and inv[-1] == pytest.approx(plain()[-1] / 4)
    cos, sin = model_rope_tables(config, 1024)
    np.testing.assert_allclose(cos[0], attention, rtol=1e-6)  # tables carry the attention scaling
    assert np.abs(sin[0]).max() == 0


def test_unknown_rope_type_is_rejected():
    with pytest.raises(ValueError, match="rope_scaling"):
        BASE.replace(rope_scaling={"rope_type": "longrope", "factor": 2.0})
    with pytest.raises(ValueError, match="rope_scaling.factor"):
        model_inverse_frequencies(BASE.replace(rope_scaling={"rope_type": "linear", "factor": 0.5}), 256)


@pytest.mark.parametrize("rope_scaling", [{"rope_type": "yarn", "factor": 4.0}, {"rope_type": "linear", "factor": 2.0}])
def test_model_uses_the_scaled_cache(rope_scaling, rng):
    ms.set_context(mode=ms.PYNATIVE_MODE)
    config = preset("tiny", rope_scaling=rope_scaling, partial_rotary_factor=0.5)
    model = LlamaForCausalLM(config)
    state = random_state(config, rng)
    for name, param in model.parameters_dict().items():
        param.set_data(Tensor(state[name]))
    ids = rng.integers(0, config.vocab_size, 40).tolist()
    inv, attention = model_inverse_frequencies(config, config.max_position_embeddings)
    expected = forward(state, config, ids, inv, attention)
    got = model(Tensor(np.array([ids], np.int32))).asnumpy()[0]
    assert np.abs(got - expected).max() <= 1e-4
