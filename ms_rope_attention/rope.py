"""cos/sin tables for RoPE: computed once in float64, stored in float32, shared by every user.

The tables are indexed by absolute position and laid out for the kernel's rotary mode:
mode 0 (rotate-half) ``[f0..f_{h-1}, f0..f_{h-1}]``; mode 1 (interleaved) ``[f0, f0, f1, f1, ...]``.
"""
from __future__ import annotations

import functools

import numpy as np
from mindspore import Tensor, ops


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
    cos, sin = rope_tables(rotary_dim, max_positions, theta, rotary_mode)
    return Tensor(cos), Tensor(sin)


def interleaved_permutation(rotary_dim: int):
    """(index, sign) with rot(x) = x[..., index] * sign for interleaved pairs (mode 1):
    rot(x)[2i] = -x[2i+1], rot(x)[2i+1] = x[2i]. (Rotate-half, mode 0, is two slices instead.)"""
    index = np.arange(rotary_dim).reshape(-1, 2)[:, ::-1].reshape(-1)
    sign = np.tile([-1.0, 1.0], rotary_dim // 2)
    return index.astype(np.int32), sign.astype(np.float32)


def rotate_half(x):
    """rot(x) for rotate-half RoPE (mode 0): [-x2, x1] over the last axis, as two slices and a concat
    (a third faster on MindSpore's CPU backend than a Gather). Functional ops only, so it takes
    mindtorch's tensors too (their operators refuse untagged intermediates)."""
    half = x.shape[-1] // 2
    return ops.cat((ops.neg(x[..., half:]), x[..., :half]), -1)


def apply_rope(x, cos_rows, sin_rows, rotary_mode, rotary_dim):
    """Standalone RoPE: x (..., D) rotated on its first ``rotary_dim`` features, with
    ``cos_rows``/``sin_rows`` already gathered at each row's position and broadcastable to
    x[..., :rotary_dim]. The unfused path uses it for Q/K; a model (or a fused third-party forward)
    for the few new keys of a decode step before appending them to its rotated KV cache."""
    head_dim = x.shape[-1]
    part = x[..., :rotary_dim] if rotary_dim < head_dim else x
    if rotary_mode == 0:
        rotated_part = rotate_half(part)
    else:
        index, sign = interleaved_permutation(rotary_dim)
        rotated_part = ops.mul(ops.gather(part, Tensor(index), x.ndim - 1), Tensor(sign))
    rotated = ops.add(ops.mul(part, cos_rows), ops.mul(rotated_part, sin_rows))
    if rotary_dim < head_dim:
        rotated = ops.cat((rotated, x[..., rotary_dim:]), -1)
    return rotated
