"""RoPE frequency scaling from a Hugging Face ``rope_scaling`` dict, computed once into the shared
cos/sin cache of the model (every layer reads the same two tables).

Each function returns ``(inverse_frequencies, attention_scaling)`` in float64; the tables are then
``cos(p * inv_freq) * attention_scaling`` (and likewise sin), built by
``ms_rope_attention.rope.tables_from_inverse_frequencies``.

- linear (Chen et al. 2023, "position interpolation"): inv_freq / factor.
- dynamic NTK (bloc97, 2023): base' = base * (factor * L / L0 - (factor - 1)) ** (d / (d - 2)) for a
  context L > L0. The cache is computed once, for L = the cache length, so it equals Hugging Face's
  per-length recomputation whenever a sequence fills the cache; unlike that recomputation it never
  changes the rotation of keys already in a (rotated) KV cache.
- llama3 (Meta, Llama 3.1): low frequencies divided by factor, high kept, a smooth ramp between.
- yarn (Peng et al. 2023): per-frequency blend of interpolation and extrapolation by a linear ramp
  between the beta_fast/beta_slow correction dims, and attention scaling 0.1 ln(factor) + 1.
"""
from __future__ import annotations

import math

import numpy as np

from ms_rope_attention import inverse_frequencies, tables_from_inverse_frequencies

from .config import LlamaConfig


def _factor(scaling: dict) -> float:
    factor = scaling.get("factor")
    if not isinstance(factor, (int, float)) or isinstance(factor, bool) or factor < 1:
        raise ValueError(f"rope_scaling.factor: expected a float >= 1, got {factor!r}")
    return float(factor)


def linear(inv_freq, scaling, config, max_positions):
    return inv_freq / _factor(scaling), 1.0


def dynamic(inv_freq, scaling, config, max_positions):
    factor, dim = _factor(scaling), config.rotary_dim
    original = scaling.get("original_max_position_embeddings") or config.max_position_embeddings
    if max_positions <= original:
        return inv_freq, 1.0
    base = config.rope_theta * (factor * max_positions / original - (factor - 1)) ** (dim / (dim - 2))
    return inverse_frequencies(dim, base), 1.0


def llama3(inv_freq, scaling, config, max_positions):
    factor = _factor(scaling)
    low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
    original = float(scaling.get("original_max_position_embeddings", 8192))
    if not high > low:
        raise ValueError(f"rope_scaling: high_freq_factor ({high}) must exceed low_freq_factor ({low})")
    wavelength = 2 * math.pi / inv_freq
    smooth = np.clip((original / wavelength - low) / (high - low), 0.0, 1.0)
    # smooth = 0 for wavelengths above original/low (divided by factor), 1 below original/high (kept).
    return (1 - smooth) * inv_freq / factor + smooth * inv_freq, 1.0


def yarn(inv_freq, scaling, config, max_positions):
    factor, dim, base = _factor(scaling), config.rotary_dim, config.rope_theta
    original = scaling.get("original_max_position_embeddings") or config.max_position_embeddings
    beta_fast, beta_slow = scaling.get("beta_fast") or 32.0, scaling.get("beta_slow") or 1.0

    def correction_dim(rotations):  # the dim whose wavelength makes `rotations` turns over `original`
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    extrapolate = 1.0 - ramp  # 1: keep the frequency (fast dims), 0: interpolate by factor (slow dims)
    scaled = inv_freq / factor * (1 - extrapolate) + inv_freq * extrapolate

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = scaling.get("attention_factor")
    if attention is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    return scaled, float(attention)


SCALINGS = {"linear": linear, "dynamic": dynamic, "llama3": llama3, "yarn": yarn}


def model_inverse_frequencies(config: LlamaConfig, max_positions: int) -> tuple[np.ndarray, float]:
    """(inverse frequencies, attention scaling) of ``config`` for a cache of ``max_positions``."""
    inv_freq = inverse_frequencies(config.rotary_dim, config.rope_theta)
    kind = config.rope_scaling_type
    if kind in (None, "default"):
        return inv_freq, 1.0
    return SCALINGS[kind](inv_freq, config.rope_scaling, config, max_positions)


def model_rope_tables(config: LlamaConfig, max_positions: int) -> tuple[np.ndarray, np.ndarray]:
    """float32 (cos, sin) of shape (max_positions, rotary_dim) in the config's rotary mode."""
    inv_freq, attention = model_inverse_frequencies(config, max_positions)
    return tables_from_inverse_frequencies(inv_freq, max_positions, config.rotary_mode, attention)
