"""Calls the CPU kernel's C entries (``RotaryFlashAttentionRun``, its backward's, and the paged
cache's ``RotaryPagedAttentionRun`` / ``RotaryCacheWriteRun``) directly on numpy arrays (ctypes).

No MindSpore in the loop: the tests use it for wide shape sweeps with shrunken tiles (every tail
path), the sanitizer run drives it, and the benchmark uses it to switch the rotation off and
measure what the fused RoPE costs.
"""
import ctypes

import numpy as np

from .. import cpu_kernel, paged_kernel
from ..cpu_runtime import aot_call
from ..op_info import output_shapes

LAYOUT_CODES = {"BNSD": 0, "BSND": 1, "BSH": 2, "TND": 3}  # the C ABI's enum of the contract's layouts
COMPUTE_CODES = {"auto": 0, "float32": 1, "bfloat16": 2}  # rfa::Compute


class Attrs(ctypes.Structure):  # mirrors rfa::Attrs in csrc/rfa_problem.h (cpu_kernel.ABI_VERSION)
    _fields_ = [("head_num", ctypes.c_int64), ("layout", ctypes.c_int), ("rotary_mode", ctypes.c_int64),
                ("rotary_dim", ctypes.c_int64), ("scale", ctypes.c_float), ("causal", ctypes.c_bool),
                ("with_lse", ctypes.c_bool), ("with_rotated_key", ctypes.c_bool), ("key_rotated", ctypes.c_bool),
                ("compute", ctypes.c_int)]


def to_bf16_bits(x):
    """float -> bfloat16 bit patterns (uint16), round to nearest even."""
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return bits.astype(np.uint16)


def from_bf16_bits(b):
    return (b.astype(np.uint32) << 16).view(np.float32)


def encode(x, dtype):
    if dtype == "float32":
        return np.ascontiguousarray(x, np.float32)
    if dtype == "float16":
        return np.ascontiguousarray(x, np.float16)
    return to_bf16_bits(x)


def decode(x, dtype):
    return (from_bf16_bits(x) if dtype == "bfloat16" else x).astype(np.float64)


def _empty_outputs(shapes, dtypes):
    """Output buffers pre-filled with NaN, so a value the kernel fails to write shows up."""
    np_dtypes = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16}
    return [np.full(shape, np.nan if odt != "bfloat16" else 0x7FC0, np_dtypes[odt]) for shape, odt in zip(shapes, dtypes)]


def _forward_inputs(q, k, v, cos, sin, aq, ak, dtype, table_dtype):
    """The forward's 7 inputs as kernel arrays (None for absent offsets) and their dtype names."""
    inputs = [encode(q, dtype), encode(k, dtype), encode(v, dtype), encode(cos, table_dtype), encode(sin, table_dtype)]
    inputs += [None if ends is None else np.ascontiguousarray(ends, np.int64) for ends in (aq, ak)]
    return inputs, [dtype] * 3 + [table_dtype] * 2 + ["none" if ends is None else "int64" for ends in (aq, ak)]


def prepare(q, k, v, cos, sin, aq=None, ak=None, *, head_num=None, input_layout="BNSD", rotary_mode=0,
            rotary_dim=None, scale=None, causal=True, dtype="float32", table_dtype="float32", with_lse=True,
            with_rotated_key=True, key_rotated=False, compute_dtype="float32", out_shapes=None):
    """(C arguments of one launch: attrs, ndims, shapes, dtypes, params; output arrays). The arrays
    must outlive the call, so the caller keeps the returned tuple alive until it is done.
    ``compute_dtype`` defaults to 'float32' (the arithmetic the kernel tests check on every input
    dtype), not the op's 'auto': a test or benchmark of bfloat16 arithmetic asks for it."""
    attrs = Attrs(head_num or 0, LAYOUT_CODES[input_layout], rotary_mode, rotary_dim or 0, scale or 0.0, causal,
                  with_lse, with_rotated_key, key_rotated, COMPUTE_CODES[compute_dtype])
    inputs, dtypes = _forward_inputs(q, k, v, cos, sin, aq, ak, dtype, table_dtype)
    shapes = out_shapes or output_shapes(q.shape, k.shape, {"input_layout": input_layout, "head_num": head_num or 0,
                                                           "with_softmax_lse": with_lse,
                                                           "with_rotated_key": with_rotated_key})
    outputs = _empty_outputs(shapes, [dtype, "float32", dtype])
    call = aot_call(inputs + outputs, dtypes + [dtype, "float32", dtype])
    return (ctypes.byref(attrs),) + call.convention(), outputs, (attrs, call)


def cpu_library(isa=None):
    """The CPU kernel build of ``isa`` (one of ``cpu_runtime.ISAS``), by default the selected one."""
    return cpu_kernel.library(isa)


def launch(args, *, rows=0, kv_block=0, pack_bytes=0, rotate=True, stream_q_max=0, kernel=None, isa=None) -> int:
    """One forward launch on ``prepare``'s arguments; the return code (non-zero: the message is in
    ``cpu_kernel.last_error()``). Tiling knobs at 0 keep the default; ``stream_q_max`` < 0 keeps the
    call off the decode path. ``kernel`` is another library with the same C entry (the emulated
    Ascend kernel, which has no decode path and takes no ``stream_q_max``); by default the CPU
    kernel, the build of ``isa`` if given."""
    knobs = (ctypes.c_int64(rows), ctypes.c_int64(kv_block), ctypes.c_int64(pack_bytes), ctypes.c_int(int(rotate)))
    if kernel is not None:
        return kernel.RotaryFlashAttentionRun(*args, *knobs)
    return cpu_library(isa).RotaryFlashAttentionRun(*args, *knobs, ctypes.c_int64(stream_q_max))


def run(q, k, v, cos, sin, aq=None, ak=None, *, dtype="float32", rows=0, kv_block=0, pack_bytes=0, rotate=True,
        stream_q_max=0, kernel=None, isa=None, **kwargs):
    """(return code, out, lse, rotated_key) with outputs decoded to float64.

    Keyword arguments are those of ``prepare`` and ``launch``.
    """
    args, (out, lse, rk), keep = prepare(q, k, v, cos, sin, aq, ak, dtype=dtype, **kwargs)
    code = launch(args, rows=rows, kv_block=kv_block, pack_bytes=pack_bytes, rotate=rotate, stream_q_max=stream_q_max,
                  kernel=kernel, isa=isa)
    del keep
    return code, decode(out, dtype), lse.astype(np.float64), decode(rk, dtype)


def prepare_grad(q, k, v, cos, sin, aq, ak, out, lse, d_out, d_lse=None, d_rotated_key=None, *, head_num=None,
                 input_layout="BNSD", rotary_mode=0, rotary_dim=None, scale=None, causal=True, dtype="float32",
                 table_dtype="float32", key_rotated=False, out_shapes=None):
    """``prepare`` for the backward entry: (attrs, ndims, shapes, dtypes, params; d_query, d_key,
    d_value buffers; what must outlive the call). ``out``/``lse`` are the forward's outputs."""
    attrs = Attrs(head_num or 0, LAYOUT_CODES[input_layout], rotary_mode, rotary_dim or 0, scale or 0.0, causal,
                  True, True, key_rotated)
    inputs, dtypes = _forward_inputs(q, k, v, cos, sin, aq, ak, dtype, table_dtype)
    inputs += [encode(out, dtype), np.ascontiguousarray(lse, np.float32), encode(d_out, dtype),
               None if d_lse is None else np.ascontiguousarray(d_lse, np.float32),
               None if d_rotated_key is None else encode(d_rotated_key, dtype)]
    dtypes += [dtype, "float32", dtype, "none" if d_lse is None else "float32",
               "none" if d_rotated_key is None else dtype]
    outputs = _empty_outputs(out_shapes or (q.shape, k.shape, v.shape), [dtype] * 3)
    call = aot_call(inputs + outputs, dtypes + [dtype] * 3)
    return (ctypes.byref(attrs),) + call.convention(), outputs, (attrs, call)


def run_grad(*args, dtype="float32", block_q=0, block_k=0, splits=0, kernel=None, isa=None, **kwargs):
    """(return code, d_query, d_key, d_value) of the backward entry ``RotaryFlashAttentionGradRun``,
    decoded to float64. Arguments are those of ``prepare_grad``; ``block_q``/``block_k``/``splits``
    <= 0 keep the default tiling. ``kernel``: another library with the same entry (the emulated
    Ascend kernel, which takes no ``splits``); by default the CPU kernel, the build of ``isa`` if given."""
    call, outputs, keep = prepare_grad(*args, dtype=dtype, **kwargs)
    code = (kernel or cpu_library(isa)).RotaryFlashAttentionGradRun(*call, ctypes.c_int64(block_q), ctypes.c_int64(block_k),
                                                 ctypes.c_int64(splits))
    del keep
    return (code,) + tuple(decode(o, dtype) for o in outputs)


def _int32(x):
    return np.ascontiguousarray(x, np.int32)


def paged_arguments(q, key_cache, value_cache, cos, sin, block_tables, context_lens, q_seq_lens, *, dtype="float32",
                    cache_dtype=None, table_dtype="float32", head_num=0, rotary_mode=0, rotary_dim=0, scale=0.0,
                    key_rotated=True, with_lse=True, compute_dtype="float32", out_shapes=None):
    """``prepare`` for ``RotaryPagedAttentionRun``: (C arguments, outputs, what must outlive the
    call). The caches are encoded to ``cache_dtype`` (default: ``dtype``, as the op requires), the
    tables to ``table_dtype``."""
    attrs = Attrs(head_num, LAYOUT_CODES["TND"], rotary_mode, rotary_dim, scale, True, with_lse, False, key_rotated,
                  COMPUTE_CODES[compute_dtype])
    cache_dtype = cache_dtype or dtype
    inputs = [encode(q, dtype), encode(key_cache, cache_dtype), encode(value_cache, cache_dtype),
              encode(cos, table_dtype), encode(sin, table_dtype), _int32(block_tables), _int32(context_lens),
              _int32(q_seq_lens)]
    dtypes = [dtype] + [cache_dtype] * 2 + [table_dtype] * 2 + ["int32"] * 3
    shapes = out_shapes or (q.shape, (q.shape[0], q.shape[1]) if with_lse else (0,))
    outputs = _empty_outputs(shapes, [dtype, "float32"])
    call = aot_call(inputs + outputs, dtypes + [dtype, "float32"])
    return (ctypes.byref(attrs),) + call.convention(), outputs, (attrs, call)


def paged_launch(prepared, kernel=None) -> int:
    """One ``RotaryPagedAttentionRun`` launch of ``paged_arguments``' result (by default on the
    selected build); its return code."""
    return (kernel or cpu_library()).RotaryPagedAttentionRun(*prepared[0])


def paged_run(*args, dtype="float32", isa=None, **kwargs):
    """(return code, out, lse) of one paged launch, outputs decoded to float64; arguments are those
    of ``paged_arguments``. A non-zero code: the message is in ``paged_last_error()``."""
    prepared = paged_arguments(*args, dtype=dtype, **kwargs)
    code = paged_launch(prepared, cpu_library(isa))
    out, lse = prepared[1]
    return code, decode(out, dtype), lse.astype(np.float64)


def cache_write_run(key, value, cos, sin, positions, slot_mapping, key_cache, value_cache, *, dtype="float32",
                    cache_dtype="float32", table_dtype="float32", rotary_mode=0, rotary_dim=0, key_rotated=False,
                    isa=None):
    """(return code, written, key_cache, value_cache) of ``RotaryCacheWriteRun``: the caches given
    (float arrays, encoded to ``cache_dtype``) are written in a copy, returned decoded to float64."""
    attrs = Attrs(0, LAYOUT_CODES["TND"], rotary_mode, rotary_dim, 0.0, True, False, False, key_rotated)
    caches = [encode(key_cache, cache_dtype), encode(value_cache, cache_dtype)]
    inputs = [encode(key, dtype), encode(value, dtype), encode(cos, table_dtype), encode(sin, table_dtype),
              _int32(positions), _int32(slot_mapping)] + caches
    written = np.full((1,), -7, np.int32)
    dtypes = [dtype] * 2 + [table_dtype] * 2 + ["int32"] * 2 + [cache_dtype] * 2 + ["int32"]
    call = aot_call(inputs + [written], dtypes)
    code = cpu_library(isa).RotaryCacheWriteRun(ctypes.byref(attrs), *call.convention())
    del call
    return code, int(written[0]), decode(caches[0], cache_dtype), decode(caches[1], cache_dtype)


def paged_last_error(isa=None) -> str:
    """The message of the paged ops' last refused launch."""
    return paged_kernel.last_error(isa)
