"""The arithmetic the CPU ops compute in (``compute_dtype``), resolved once from the request, the
weights' dtype and this CPU's instructions: one rule for the attention op, the projections, the
model and the CLIs, so what runs is decided in one place and can always be reported.

Why a setting and not the activations' dtype: MindSpore 2.10's CPU backend has no bfloat16 Reshape,
Gather or MatMul, so the model's activations, RMSNorm and residual stream stay float32 in the graph;
the half arithmetic happens inside the ops (the projections' GEMM, Q·Kᵀ and P·V of the fused
attention), each rounding its float32 operands once, accumulating in float32.

``"auto"`` computes in a half checkpoint's own dtype where this CPU has native instructions for it
(AVX512-BF16 or AMX-BF16 for bfloat16; AVX512-FP16 or AMX-FP16 for float16), in float32 otherwise;
float32 weights compute in float32. An explicit half dtype this CPU cannot compute natively is
refused by name, never emulated silently. ``"float32"`` is today's arithmetic, bit for bit.
"""
from __future__ import annotations

import os

from .cpu_runtime import cpu_flags

COMPUTE_DTYPES = ("auto", "float32", "bfloat16", "float16")
HALF_DTYPES = ("bfloat16",)  # the half arithmetic the ops offer (the module's docstring says why not float16)
# The CPU flags (as /proc/cpuinfo names them) that compute each half dtype natively, any one enough.
NATIVE_FLAGS = {"bfloat16": ("avx512_bf16", "amx_bf16")}
FLOAT16_REFUSED = ("compute_dtype: 'float16' arithmetic is not offered: oneDNN 3.2's float16 matmul ran only 1.1x as "
                   "fast as float32 on an AVX512-FP16 CPU (bfloat16 3.9x); use 'auto' or 'float32' (a float16 "
                   "checkpoint computes in float32 on its own weights) or 'bfloat16'")


def native_half_dtypes(flags: set[str] | None = None) -> tuple[str, ...]:
    """The half dtypes this CPU (or ``flags``) computes with its own instructions; none when
    ``RFA_CPU_ISA`` forces a build below AVX-512 (the half kernels are in the AVX-512 build only)."""
    if os.environ.get("RFA_CPU_ISA", "avx512") != "avx512":
        return ()
    flags = cpu_flags() if flags is None else flags
    return tuple(dtype for dtype in HALF_DTYPES if any(flag in flags for flag in NATIVE_FLAGS[dtype]))


def check_compute_dtype(value: str) -> str:
    """``value`` if it is one of ``COMPUTE_DTYPES``; ValueError naming the argument otherwise."""
    if not isinstance(value, str) or value not in COMPUTE_DTYPES:
        raise ValueError(f"compute_dtype: expected one of {list(COMPUTE_DTYPES)}, got {value!r}")
    return value


def resolve_compute_dtype(requested: str, weight_dtype: str, flags: set[str] | None = None) -> str:
    """The dtype the ops compute in ('float32', 'bfloat16' or 'float16') for ``requested`` (one of
    ``COMPUTE_DTYPES``) and weights in ``weight_dtype`` ('float32', 'float16' or 'bfloat16')."""
    check_compute_dtype(requested)
    if requested == "float16":
        raise ValueError(FLOAT16_REFUSED)
    native = native_half_dtypes(flags)
    if requested == "auto":
        return weight_dtype if weight_dtype in native else "float32"
    if requested in HALF_DTYPES and requested not in native:
        raise ValueError(f"compute_dtype: {requested!r} needs one of the CPU instructions "
                         f"{list(NATIVE_FLAGS[requested])}, which this CPU does not have; use 'auto' or 'float32'")
    return requested
