"""y = x W^T on the CPU through OpenBLAS: the projections around the attention op, as an aot ``Custom`` op,
with W in float32 or in the checkpoint's own float16 / bfloat16 (x, y and the arithmetic float32).

Why: at prefill lengths of a few hundred to a few thousand tokens a Llama layer's time is its seven
projection GEMMs, not attention, and MindSpore 2.10's CPU MatMul runs them slower than OpenBLAS on
the same cores (see docs/benchmarks.md and ``benchmarks/projections.py``). The weight
stays in Hugging Face's (out_features, in_features) layout, so checkpoints, training and the
MatMul path share it. The backward is MindSpore's MatMul (dx = dy W, dW = dy^T x), in float32.

Half weights: a decode step's product is the time it takes to read W, so a float16 / bfloat16 W is
streamed and converted in registers (twice the float32 speed at the same bandwidth); a prefill's
converts panels of W to float32 for SGEMM. Conversions to float32 are exact, so the result is the
float32 product of the half-rounded weights (docs/half-weights.md says why this, not OpenBLAS's
``sbgemm`` or oneDNN).

OpenBLAS comes from the scipy-openblas32 wheel. It is loaded here first, by path, before MindSpore
opens the op's library, and given this process's cores as its thread count: loaded after MindSpore
has started, OpenBLAS sized its pool to one thread (measured: every projection ran at half speed).
``OPENBLAS_NUM_THREADS`` still decides when it is set.
"""
from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import mindspore as ms
import numpy as np
import scipy_openblas32
from mindspore import ops

from .cpu_runtime import direct_call, library_path, make_primitive, open_library
from .op_info import LINEAR_PATH, load_contract

STEM, WHAT = "_rfa_cpu_linear", "projection GEMM library"
WEIGHT_DTYPES = ("float32", "float16", "bfloat16")


@functools.lru_cache(maxsize=None)
def openblas() -> ctypes.CDLL:
    """The scipy-openblas32 library, opened once per process, with its thread count set."""
    lib = ctypes.CDLL(str(Path(scipy_openblas32.get_lib_dir()) / f"lib{scipy_openblas32.get_library()}.so"),
                      mode=ctypes.RTLD_GLOBAL)
    threads = os.environ.get("OPENBLAS_NUM_THREADS")
    lib.scipy_openblas_set_num_threads(int(threads) if threads else len(os.sched_getaffinity(0)))
    return lib


def blas_threads() -> int:
    """The thread count OpenBLAS runs the projections with."""
    return openblas().scipy_openblas_get_num_threads()


def library(isa: str | None = None, texts: tuple = ("RfaLinearLastError", "RfaLinearIsa")) -> ctypes.CDLL:
    """The projection library (the selected build, or ``isa``'s: its own products are compiled per
    instruction set), opened after OpenBLAS (its thread count; and the editable checkout's library
    finds OpenBLAS only this way). It holds the embedding's entry too: ``texts`` are the caller's."""
    openblas()
    return open_library(library_path(STEM, WHAT, isa), texts=texts)


def library_isa() -> str:
    """The instruction set of the build in use."""
    return library().RfaLinearIsa().decode()


def multiply(x: np.ndarray, weight: np.ndarray, out_shape: tuple | None = None, isa: str | None = None) -> np.ndarray:
    """x @ weight.T through the op's kernel entry, called directly (tests and the sanitizer run, no
    MindSpore); ``out_shape`` overrides the output buffer's shape to test the kernel's checks. Raises
    ValueError with the kernel's message when it refuses the call."""
    x, weight = np.require(x, requirements="C"), np.require(weight, requirements="C")  # 0-d stays 0-d
    if out_shape is None:
        out_shape = x.shape[:-1] + weight.shape[:1] if x.ndim and weight.ndim == 2 else (0,)
    y = np.full(out_shape, np.nan, np.float32)
    direct_call(library(isa), "RfaLinear", (x, weight, y), "RfaLinearLastError")
    return y


def _bprop():
    """dx = dy W and dW = dy^T x, on MindSpore's float32 MatMul, for x (..., K), weight (N, K); dW in
    the weight's dtype (training keeps float32 master weights: see docs/half-weights.md)."""
    matmul = ops.MatMul()
    matmul_ta = ops.MatMul(transpose_a=True)

    def bprop(x, weight, out, dout):
        in_features, out_features = weight.shape[1], weight.shape[0]
        dy = dout.reshape(-1, out_features)
        dx = matmul(dy, weight.astype(ms.float32)).reshape(x.shape)
        dw = matmul_ta(dy, x.reshape(-1, in_features)).astype(weight.dtype)
        return dx, dw
    return bprop


@functools.lru_cache(maxsize=None)
def linear_op() -> ops.Custom:
    """The aot primitive ``(x (..., K) float32, weight (N, K) float32/float16/bfloat16) -> (..., N)
    float32`` (contract: ``op_info/linear.yaml``); shapes from the library's C++ InferShape, so
    GRAPH_MODE with dynamic sequence lengths compiles once."""
    library()  # OpenBLAS first (its thread count), and fail here, not inside MindSpore
    # Not graph-launched, as before the runtime was shared (and the embedding likewise): a graph launch
    # gives bit-equal values and gradients here, but a 1x4096 by 4096x4096 product took the same
    # 8.7 ms eagerly either way on 2 busy cores, while the launch graph compiled 7 times for 3 shapes
    # with their gradients. Switching is a change to measure on its own (benchmarks/projections.py).
    return make_primitive(load_contract(str(LINEAR_PATH)), {}, library_path(STEM, WHAT), bprop=_bprop(),
                          any_dtype=False, graph_launch=False)
