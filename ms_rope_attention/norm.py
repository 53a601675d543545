"""RMSNorm of float32 rows on the CPU as one aot ``Custom`` op (csrc/rfa_cpu_norm.cc, in the projection
library): y = x * (1 / sqrt(mean(x^2) + eps)) * weight over the last dimension, weight (H,) float32.

Why: the Llama model computing in bfloat16 keeps float32 activations between its ops, and its
RMSNorm in MindSpore's CPU ops (Cast, Mul, ReduceMean, Rsqrt, BroadcastTo, Mul) ran single-threaded,
each op writing an x-sized temporary: about 45 ms of a 470 ms 512-token prefill (7B dims, 2 layers,
MindSpore's profiler). The kernel reads each row once for its statistic and once to write y, on the
OpenMP threads. The backward is MindSpore's float32 ops. Contract: ``op_info/rms_norm.yaml``.
"""
from __future__ import annotations

import ctypes
import functools
import math

import numpy as np
from mindspore import ops

from .cpu_runtime import aot_call, library_path, make_primitive
from .linear import STEM, WHAT, library
from .op_info import RMS_NORM_PATH, attr_values, load_contract

_TEXTS = ("RfaRMSNormLastError",)
_FLOAT32_MAX = float(np.finfo(np.float32).max)


def _check_eps(eps) -> float:
    """eps as the contract's float; ValueError naming it unless finite, >= 0 and within float32's
    range (the kernel uses it as float32)."""
    value = attr_values(load_contract(str(RMS_NORM_PATH)), {"eps": eps})["eps"]
    if not (math.isfinite(value) and 0.0 <= value <= _FLOAT32_MAX):
        raise ValueError(f"eps: expected a finite value >= 0 within float32's range, got {eps!r}")
    return value


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float = 1e-6, out_shape: tuple | None = None,
             isa: str | None = None) -> np.ndarray:
    """The op's kernel (``RfaRMSNormRun``) called directly on numpy arrays (tests and the sanitizer
    run, no MindSpore), on the selected build or ``isa``'s; ``out_shape`` overrides the output buffer's
    shape to test the kernel's checks. ``eps`` reaches the kernel unchecked, so its own check is
    tested too. Raises ValueError with the kernel's message when it refuses the call."""
    x, weight = np.require(x, requirements="C"), np.require(weight, requirements="C")  # 0-d stays 0-d
    y = np.full(x.shape if out_shape is None else out_shape, np.nan, np.float32)
    lib = library(isa, _TEXTS)
    call = aot_call((x, weight, y))
    if lib.RfaRMSNormRun(ctypes.c_double(eps), 3, call.params, call.ndims, call.shapes, call.dtypes):
        raise ValueError(lib.RfaRMSNormLastError().decode())
    return y


def _bprop(eps: float):
    """The gradients of y = x r w with r = (mean(x^2) + eps)^(-1/2), on MindSpore's float32 ops: g = dy w,
    dx = r g - x r^3 mean(g x) (the statistic's share), dweight = the rows' sum of dy x r."""
    def bprop(x, weight, out, dout):
        hidden = weight.shape[0]
        xf, dy = x.reshape(-1, hidden), dout.reshape(-1, hidden)
        r = ops.rsqrt((xf * xf).mean(-1, keep_dims=True) + eps)
        g = dy * weight
        dx = r * g - xf * (r * r * r * (g * xf).mean(-1, keep_dims=True))
        dweight = (dy * (xf * r)).sum(0)
        return dx.reshape(x.shape), dweight
    return bprop


def rms_norm_op(eps: float = 1e-6) -> ops.Custom:
    """The aot primitive ``(x (..., H) float32, weight (H,) float32) -> x's shape float32`` with this
    ``eps`` (contract: ``op_info/rms_norm.yaml``), in the projection library; shapes from its C++
    InferShape, so GRAPH_MODE with a dynamic sequence length compiles once. An eps the kernel would
    refuse is refused here, naming it, not at the first launch."""
    return _primitive(_check_eps(eps))


@functools.lru_cache(maxsize=None)
def _primitive(eps: float) -> ops.Custom:
    """One primitive per eps."""
    library(texts=_TEXTS)  # OpenBLAS first, and fail here, not inside MindSpore
    # Not graph-launched: linear_op says why.
    return make_primitive(load_contract(str(RMS_NORM_PATH)), {"eps": eps}, library_path(STEM, WHAT),
                          bprop=_bprop(eps), any_dtype=False, graph_launch=False)
