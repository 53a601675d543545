"""cos/sin tables for RoPE: computed once in float64, stored in float32, shared by every user.

The tables are indexed by absolute position and laid out for the kernel's rotary mode:
mode 0 (rotate-half) ``[f0..f_{h-1}, f0..f_{h-1}]``; mode 1 (interleaved) ``[f0, f0, f1, f1, ...]``.
"""
from __future__ import annotations

import functools

import numpy as np


def inverse_frequencies(rotary_dim: int, theta: float = 10000.0) -> np.ndarray:
    """theta^(-2i/rotary_dim) for i < rotary_dim/2, in float64."""
    if rotary_dim < 2 or rotary_dim % 2:
        raise ValueError(f"rotary_dim: expected a positive even int, got {rotary_dim!r}")
    if not theta > 0:
        raise ValueError(f"rope_theta: expected a positive float, got {theta!r}")
    return 1.0 / theta ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)


def tables_from_inverse_frequencies(inv_freq: np.ndarray, max_positions: int, rotary_mode: int = 0,
                                    attention_scaling: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """(cos, sin) float32 tables of shape (max_positions, 2 * len(inv_freq))."""
    if max_positions < 1:
        raise ValueError(f"max_position_embeddings: expected a positive int, got {max_positions!r}")
    angles = np.outer(np.arange(max_positions, dtype=np.float64), np.asarray(inv_freq, np.float64))
    if rotary_mode == 0:
        angles = np.concatenate([angles, angles], axis=1)
    elif rotary_mode == 1:
        angles = np.repeat(angles, 2, axis=1)
    else:
        raise ValueError(f"rotary_mode: expected 0 or 1, got {rotary_mode!r}")
    cos = (np.cos(angles) * attention_scaling).astype(np.float32)
    sin = (np.sin(angles) * attention_scaling).astype(np.float32)
    return cos, sin


def rope_tables(rotary_dim: int, max_positions: int, theta: float = 10000.0,
                rotary_mode: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Plain Llama RoPE tables (no scaling)."""
    return tables_from_inverse_frequencies(inverse_frequencies(rotary_dim, theta), max_positions, rotary_mode)


@functools.lru_cache(maxsize=32)
def shared_rope_tables(rotary_dim: int, max_positions: int, theta: float = 10000.0, rotary_mode: int = 0):
    """MindSpore tensors of ``rope_tables``, one pair per setting for the whole process.

    Every layer (and every batch) that uses the same settings gets the same two tensors.
    """
    from mindspore import Tensor

    cos, sin = rope_tables(rotary_dim, max_positions, theta, rotary_mode)
    return Tensor(cos), Tensor(sin)
