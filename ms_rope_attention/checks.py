"""Argument checks for ``rotary_flash_attention``: one implementation for every path.

Pure Python on shapes, dtype names and attribute values, so it runs eagerly in PyNative and at
graph-compile time in GRAPH_MODE (through ``ops.constexpr``).  Dynamic dimensions (``None`` or
``-1``) are skipped; the C++ kernel re-checks them at run time before touching memory.
Every error names the argument and what was expected.
"""
from __future__ import annotations

import math
from typing import NamedTuple

from .op_info import load_contract

_CONTRACT = load_contract()
LAYOUTS = tuple(_CONTRACT.attr("input_layout")["values"])
ROTARY_MODES = tuple(_CONTRACT.attr("rotary_mode")["values"])
TENSOR_DTYPES = tuple(_CONTRACT.input("query")["dtypes"])
TABLE_DTYPES = tuple(_CONTRACT.input("cos")["dtypes"])
_RANKS = {"BNSD": 4, "BSND": 4, "BSH": 3, "TND": 3}
_FLOAT32_MAX = 3.4028234663852886e38
_FLOAT32_TINY = 1.1754943508222875e-38  # smallest normal float32: the kernel computes in float32
_SHAPE_TEXT = {"BNSD": "(B, N, S, D)", "BSND": "(B, S, N, D)", "BSH": "(B, S, N*D)", "TND": "(T, N, D)"}


def dtype_name(dtype) -> str:
    """'float32', 'bfloat16', ... for a MindSpore dtype, numpy dtype or string. Qualified spellings
    count as their last part: with mindnlp's mindtorch loaded, ``str(ms.float32)`` is
    'mindspore.float32' instead of 'Float32'."""
    text = str(dtype).lower().rsplit(".", 1)[-1]
    return {"float": "float32", "half": "float16"}.get(text, text)


def _known(dim) -> bool:
    return dim is not None and dim >= 0


class Geometry(NamedTuple):
    """What the checks learned about the problem (``None`` where a dimension is dynamic). A tuple,
    so that it crosses ``ops.constexpr`` into graph code (``Geometry(*values)`` there)."""

    batch: int | None
    q_heads: int | None
    kv_heads: int | None
    q_len: int | None
    kv_len: int | None
    head_dim: int | None
    rotary_dim: int | None
    scale: float | None


def check_attrs(attrs) -> None:
    """Attribute checks that need no shapes (run once, in ``__init__`` or eagerly), on an
    ``attrs.OpAttrs``."""
    head_num, input_layout, rotary_mode = attrs.head_num, attrs.input_layout, attrs.rotary_mode
    rotary_dim, scale, causal = attrs.rotary_dim, attrs.scale, attrs.causal
    if not isinstance(input_layout, str) or input_layout not in LAYOUTS:
        raise ValueError(f"input_layout: expected one of {list(LAYOUTS)}, got {input_layout!r}")
    if isinstance(rotary_mode, bool) or rotary_mode not in ROTARY_MODES:
        raise ValueError(f"rotary_mode: expected one of {list(ROTARY_MODES)} "
                         f"(0 rotate-half, 1 interleaved), got {rotary_mode!r}")
    if head_num is not None and (isinstance(head_num, bool) or not isinstance(head_num, int) or head_num < 1):
        raise ValueError(f"head_num: expected a positive int, got {head_num!r}")
    if input_layout == "BSH" and head_num is None:
        raise ValueError("head_num: required for input_layout='BSH' (hidden size = head_num * head_dim)")
    if rotary_dim is not None and (isinstance(rotary_dim, bool) or not isinstance(rotary_dim, int)
                                   or rotary_dim < 2 or rotary_dim % 2):
        raise ValueError(f"rotary_dim: expected a positive even int, got {rotary_dim!r}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                              or not math.isfinite(scale) or not _FLOAT32_TINY <= scale <= _FLOAT32_MAX):
        raise ValueError(f"scale: expected a finite positive float within float32's normal range "
                         f"[{_FLOAT32_TINY:.3g}, {_FLOAT32_MAX:.3g}], got {scale!r}")
    if not isinstance(causal, bool):
        raise ValueError(f"causal: expected a bool, got {causal!r}")


def check_flags(**flags) -> None:
    """Boolean options must be bools: 1, "no" or None would otherwise be read as True or False."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name}: expected a bool, got {value!r}")


def split_heads(name, shape, layout, head_num):
    """(batch, seq, heads, head_dim) of one q/k/v tensor of the layout's rank (``check_inputs``
    checks the ranks first); None for dynamic dims."""
    dims = tuple(d if _known(d) else None for d in shape)
    if layout == "BNSD":
        return dims[0], dims[2], dims[1], dims[3]
    if layout == "BSND":
        return dims[0], dims[1], dims[2], dims[3]
    if layout == "TND":
        return None, dims[0], dims[1], dims[2]
    hidden = dims[2]
    if head_num is None or hidden is None:
        return dims[0], dims[1], None, None
    if hidden % head_num:
        raise ValueError(f"{name}: hidden size {hidden} is not a multiple of head_num={head_num} (BSH)")
    return dims[0], dims[1], head_num, hidden // head_num


def _check_dtypes(q_dtype, k_dtype, v_dtype, cos_dtype, sin_dtype) -> None:
    """q/k/v in the kernel's dtypes and alike; cos/sin floating and alike (cast if need be)."""
    for name, dtype in (("query", q_dtype), ("key", k_dtype), ("value", v_dtype)):
        if dtype_name(dtype) not in TENSOR_DTYPES:
            raise TypeError(f"{name}: expected dtype in {list(TENSOR_DTYPES)}, got {dtype_name(dtype)}")
    for name, dtype in (("key", k_dtype), ("value", v_dtype)):
        if dtype_name(dtype) != dtype_name(q_dtype):
            raise TypeError(f"{name}: expected the same dtype as query ({dtype_name(q_dtype)}), got {dtype_name(dtype)}")
    for name, dtype in (("cos", cos_dtype), ("sin", sin_dtype)):
        if not dtype_name(dtype).startswith(("float", "bfloat")):
            raise TypeError(f"{name}: expected a floating dtype, got {dtype_name(dtype)}")
    if dtype_name(sin_dtype) != dtype_name(cos_dtype):
        raise TypeError(f"sin: expected the same dtype as cos ({dtype_name(cos_dtype)}), got {dtype_name(sin_dtype)}")


def _check_offsets(layout, actual_seq_qlen, actual_seq_kvlen) -> None:
    """The TND offsets: both present, 1-D int64, exactly for TND."""
    if layout == "TND":
        if actual_seq_qlen is None or actual_seq_kvlen is None:
            raise ValueError("actual_seq_qlen, actual_seq_kvlen: both required for input_layout='TND' "
                             "(cumulative end offsets of each sequence)")
        for name, (dtype, rank) in (("actual_seq_qlen", actual_seq_qlen), ("actual_seq_kvlen", actual_seq_kvlen)):
            if dtype_name(dtype) != "int64" or rank != 1:
                raise TypeError(f"{name}: expected a 1-D int64 tensor of cumulative end offsets, got a rank-{rank} "
                                f"{dtype_name(dtype)} tensor")
    elif actual_seq_qlen is not None or actual_seq_kvlen is not None:
        raise ValueError(f"actual_seq_qlen, actual_seq_kvlen: only for input_layout='TND', got {layout!r}")


def _check_tables(rotary_dim, head_dim, kv_len, layout, cos_shape, sin_shape):
    """cos/sin: rank 2, (max_positions, rotary_dim), equal shapes, enough positions; returns the
    resolved rotary_dim (None when head_dim is dynamic)."""
    rd = rotary_dim if rotary_dim is not None else head_dim
    if rd is not None and head_dim is not None and rd > head_dim:
        raise ValueError(f"rotary_dim: {rd} exceeds head_dim {head_dim}")
    for name, shape in (("cos", cos_shape), ("sin", sin_shape)):
        shape = tuple(shape)
        if len(shape) != 2:
            raise ValueError(f"{name}: expected a rank-2 table (max_positions, rotary_dim), got shape {shape}")
        if rd is not None and _known(shape[1]) and shape[1] != rd:
            hint = "" if rotary_dim is not None else f" (pass rotary_dim={shape[1]} for partial rotary)"
            raise ValueError(f"{name}: expected shape (max_positions, {rd}), got {shape}{hint}")
    if all(_known(d) for d in tuple(cos_shape) + tuple(sin_shape)) and tuple(cos_shape) != tuple(sin_shape):
        raise ValueError(f"sin: expected the same shape as cos {tuple(cos_shape)}, got {tuple(sin_shape)}")
    if layout != "TND" and kv_len is not None and _known(cos_shape[0]) and cos_shape[0] < kv_len:
        raise ValueError(f"cos: table has {cos_shape[0]} positions, kv_len {kv_len} needs at least {kv_len}")
    return rd


def check_inputs(attrs, tensors, offsets) -> Geometry:
    """Check every static property of a call; returns the resolved geometry. ``attrs``: an
    ``attrs.OpAttrs``; ``tensors``: (shape, dtype) of query, key, value, cos and sin; ``offsets``:
    for actual_seq_qlen and actual_seq_kvlen, None (absent) or the (dtype, rank) of the tensor."""
    check_attrs(attrs)
    head_num, input_layout, rotary_dim, scale = attrs.head_num, attrs.input_layout, attrs.rotary_dim, attrs.scale
    (q_shape, q_dtype), (k_shape, k_dtype), (v_shape, v_dtype), (cos_shape, cos_dtype), (sin_shape, sin_dtype) = tensors
    actual_seq_qlen, actual_seq_kvlen = offsets
    _check_dtypes(q_dtype, k_dtype, v_dtype, cos_dtype, sin_dtype)
    layout = input_layout
    for name, tensor_shape in (("query", q_shape), ("key", k_shape), ("value", v_shape)):
        if len(tuple(tensor_shape)) != _RANKS[layout]:
            raise ValueError(f"{name}: expected a rank-{_RANKS[layout]} tensor {_SHAPE_TEXT[layout]} for "
                             f"input_layout={layout!r}, got shape {tuple(tensor_shape)}")
    kv_head_num = None
    if layout == "BSH" and _known(k_shape[-1]) and _known(q_shape[-1]):
        if q_shape[-1] % head_num:
            raise ValueError(f"query: hidden size {q_shape[-1]} is not a multiple of head_num={head_num} (BSH)")
        head_dim = q_shape[-1] // head_num
        if head_dim < 2 or head_dim % 2:
            raise ValueError(f"query: head_dim must be even and >= 2 for RoPE, got {head_dim} "
                             f"(hidden size {q_shape[-1]} / head_num {head_num}, BSH)")
        if k_shape[-1] % head_dim:
            raise ValueError(f"key: hidden size {k_shape[-1]} is not a multiple of head_dim={head_dim} (BSH)")
        kv_head_num = k_shape[-1] // head_dim
        if kv_head_num < 1:
            raise ValueError(f"key: expected at least one head, got hidden size {k_shape[-1]} (BSH)")
    qb, qs, qn, qd = split_heads("query", q_shape, layout, head_num)
    kb, ks, kn, kd = split_heads("key", k_shape, layout, kv_head_num)
    split_heads("value", v_shape, layout, kv_head_num)
    if tuple(k_shape) != tuple(v_shape) and all(_known(d) for d in tuple(k_shape) + tuple(v_shape)):
        raise ValueError(f"value: expected the same shape as key {tuple(k_shape)}, got {tuple(v_shape)}")
    for name, heads, shape in (("query", qn, q_shape), ("key", kn, k_shape)):
        if heads is not None and heads < 1:
            raise ValueError(f"{name}: expected at least one head, got shape {tuple(shape)} "
                             f"({_SHAPE_TEXT[layout]} for input_layout={layout!r})")
    if qd is not None and (qd < 2 or qd % 2):
        raise ValueError(f"query: head_dim must be even and >= 2 for RoPE, got {qd}")
    if head_num is not None and qn is not None and qn != head_num:
        raise ValueError(f"head_num: {head_num} does not match query's {qn} heads")
    if qb is not None and kb is not None and qb != kb:
        raise ValueError(f"key: batch {kb} does not match query's batch {qb}")
    if qd is not None and kd is not None and qd != kd:
        raise ValueError(f"key: head_dim {kd} does not match query's head_dim {qd}")
    if qn is not None and kn is not None and (kn < 1 or qn % kn):
        raise ValueError(f"key: {kn} heads; query's {qn} heads must be a multiple of them (GQA/MQA)")
    if layout != "TND" and qs is not None and ks is not None and qs > ks:
        raise ValueError(f"query: q_len {qs} must be <= kv_len {ks} (queries sit at the end of the "
                         "key sequence, bottom-right aligned)")
    _check_offsets(layout, actual_seq_qlen, actual_seq_kvlen)
    rd = _check_tables(rotary_dim, qd, ks, layout, cos_shape, sin_shape)
    resolved_scale = scale if scale is not None else (1.0 / math.sqrt(qd) if qd else None)
    return Geometry(batch=qb, q_heads=qn, kv_heads=kn, q_len=qs, kv_len=ks, head_dim=qd, rotary_dim=rd,
                    scale=resolved_scale)


def check_actual_seq(actual_seq_qlen, actual_seq_kvlen, total_q, total_kv, max_positions) -> None:
    """Value checks of the TND offsets (needs concrete values: PyNative, or the kernel at run time)."""
    import numpy as np

    q = np.asarray(actual_seq_qlen, dtype=np.int64).reshape(-1)
    kv = np.asarray(actual_seq_kvlen, dtype=np.int64).reshape(-1)
    for name, ends, total in (("actual_seq_qlen", q, total_q), ("actual_seq_kvlen", kv, total_kv)):
        if ends.size == 0:
            raise ValueError(f"{name}: expected at least one sequence, got none")
        lengths = np.diff(np.concatenate([[0], ends]))
        if (lengths < 0).any():
            raise ValueError(f"{name}: cumulative end offsets must be non-decreasing, got {ends.tolist()}")
        if total is not None and ends[-1] != total:
            raise ValueError(f"{name}: last offset must equal the token count {total}, got {int(ends[-1])}")
    if q.size != kv.size:
        raise ValueError(f"actual_seq_kvlen: expected {q.size} sequences like actual_seq_qlen, got {kv.size}")
    q_lens = np.diff(np.concatenate([[0], q]))
    kv_lens = np.diff(np.concatenate([[0], kv]))
    bad = np.nonzero(q_lens > kv_lens)[0]
    if bad.size:
        b = int(bad[0])
        raise ValueError(f"actual_seq_qlen: sequence {b} has q_len {q_lens[b]} > kv_len {kv_lens[b]}")
    if max_positions is not None and kv_lens.max() > max_positions:
        raise ValueError(f"cos: table has {max_positions} positions, the longest sequence needs {int(kv_lens.max())}")
