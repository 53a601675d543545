"""y = x W^T on the CPU through OpenBLAS: the projections around the attention op, as an aot ``Custom`` op.

Why: at prefill lengths of a few hundred to a few thousand tokens a Llama layer's time is its seven
projection GEMMs, not attention, and MindSpore 2.10's CPU MatMul runs them slower than OpenBLAS on
the same cores (see docs/benchmarks.md and ``benchmarks/projections.py``). The weight
stays in Hugging Face's (out_features, in_features) layout, so checkpoints, training and the
MatMul path share it. The backward is MindSpore's MatMul (dx = dy W, dW = dy^T x).

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

import numpy as np
import scipy_openblas32
from mindspore import ops
from mindspore.ops import CustomRegOp, DataType

from .cpu_kernel import NOT_BUILT, built_file, kernel_dir

KERNEL_SYMBOL = "RfaLinear"


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


def library_path() -> Path:
    """The op's shared library (one build for every CPU: OpenBLAS dispatches on the CPU itself)."""
    path = built_file("_rfa_cpu_linear")
    if path is None:
        raise RuntimeError(f"no built projection GEMM library in {kernel_dir()} ({NOT_BUILT})")
    return path


@functools.lru_cache(maxsize=None)
def library() -> ctypes.CDLL:
    """The op's library, opened once per process after OpenBLAS (the handle MindSpore's dlopen shares)."""
    openblas()
    lib = ctypes.CDLL(str(library_path()))
    lib.RfaLinearLastError.restype = ctypes.c_char_p
    return lib


def multiply(x: np.ndarray, weight: np.ndarray, out_shape: tuple | None = None) -> np.ndarray:
    """x @ weight.T through the op's kernel entry, called directly (tests and the sanitizer run, no
    MindSpore); ``out_shape`` overrides the output buffer's shape to test the kernel's checks. Raises
    ValueError with the kernel's message when it refuses the call."""
    x, weight = np.require(x, requirements="C"), np.require(weight, requirements="C")  # 0-d stays 0-d
    if out_shape is None:
        out_shape = x.shape[:-1] + weight.shape[:1] if x.ndim and weight.ndim == 2 else (0,)
    y = np.full(out_shape, np.nan, np.float32)
    arrays = (x, weight, y)
    params = (ctypes.c_void_p * 3)(*[a.ctypes.data for a in arrays])
    ndims = (ctypes.c_int * 3)(*[a.ndim for a in arrays])
    shapes = (ctypes.POINTER(ctypes.c_int64) * 3)(*[(ctypes.c_int64 * max(a.ndim, 1))(*a.shape) for a in arrays])
    dtypes = (ctypes.c_char_p * 3)(*[str(a.dtype).encode() for a in arrays])
    lib = library()
    if lib.RfaLinear(3, params, ndims, shapes, dtypes, None, None):
        raise ValueError(lib.RfaLinearLastError().decode())
    return y


def _bprop():
    """dx = dy W and dW = dy^T x, on MindSpore's MatMul, for x (..., K), weight (N, K)."""
    matmul = ops.MatMul()
    matmul_ta = ops.MatMul(transpose_a=True)

    def bprop(x, weight, out, dout):
        in_features, out_features = weight.shape[1], weight.shape[0]
        dy = dout.reshape(-1, out_features)
        dx = matmul(dy, weight).reshape(x.shape)
        dw = matmul_ta(dy, x.reshape(-1, in_features))
        return dx, dw
    return bprop


@functools.lru_cache(maxsize=None)
def linear_op() -> ops.Custom:
    """The aot primitive ``(x (..., K) float32, weight (N, K) float32) -> (..., N)``; shapes from the
    library's C++ InferShape, so GRAPH_MODE with dynamic sequence lengths compiles once."""
    library()  # OpenBLAS first (its thread count), and fail here, not inside MindSpore
    reg = (CustomRegOp(KERNEL_SYMBOL).input(0, "x", "required").input(1, "weight", "required")
           .output(0, "y", "required").dtype_format(DataType.F32_Default, DataType.F32_Default, DataType.F32_Default)
           .target("CPU").get_op_info())
    return ops.Custom(f"{library_path()}:{KERNEL_SYMBOL}", out_shape=None, out_dtype=None, func_type="aot",
                      bprop=_bprop(), reg_info=reg)
