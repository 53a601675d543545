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
from mindspore.ops import CustomRegOp, DataType

from .cpu_kernel import built_libraries, select_library

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


WEIGHT_DTYPES = ("float32", "float16", "bfloat16")


STEM = "_rfa_cpu_linear"


def library_path(isa: str | None = None) -> Path:
    """The best build of the op's library for this CPU (``RFA_CPU_ISA`` forces one, as for the
    attention kernel; ``isa`` picks one, for the tests): its own products are compiled per
    instruction set."""
    if isa is None:
        return select_library(STEM, "projection GEMM library")[1]
    built = built_libraries(STEM)
    if isa not in built:
        raise RuntimeError(f"no {isa} build of the projection GEMM library (built: {sorted(built)})")
    return built[isa]


def library_isa() -> str:
    """The instruction set of the build in use."""
    return library().RfaLinearIsa().decode()


@functools.lru_cache(maxsize=None)
def library(isa: str | None = None) -> ctypes.CDLL:
    """The op's library (the selected build, or ``isa``'s), opened once per process after OpenBLAS
    (the handle MindSpore's dlopen shares)."""
    openblas()
    lib = ctypes.CDLL(str(library_path(isa)))
    for entry in ("RfaLinearLastError", "RfaLinearIsa", "RfaEmbeddingLastError"):
        getattr(lib, entry).restype = ctypes.c_char_p
    return lib


def call_entry(entry: str, *arrays: np.ndarray, isa: str | None = None) -> None:
    """One of the library's aot entries called directly on numpy arrays (inputs then output), as
    MindSpore would launch it; ValueError with the library's message when it refuses the call."""
    params = (ctypes.c_void_p * len(arrays))(*[a.ctypes.data for a in arrays])
    ndims = (ctypes.c_int * len(arrays))(*[a.ndim for a in arrays])
    shapes = (ctypes.POINTER(ctypes.c_int64) * len(arrays))(*[(ctypes.c_int64 * max(a.ndim, 1))(*a.shape)
                                                              for a in arrays])
    dtypes = (ctypes.c_char_p * len(arrays))(*[str(a.dtype).encode() for a in arrays])
    lib = library(isa)
    if getattr(lib, entry)(len(arrays), params, ndims, shapes, dtypes, None, None):
        raise ValueError(getattr(lib, f"{entry}LastError")().decode())


def multiply(x: np.ndarray, weight: np.ndarray, out_shape: tuple | None = None, isa: str | None = None) -> np.ndarray:
    """x @ weight.T through the op's kernel entry, called directly (tests and the sanitizer run, no
    MindSpore); ``out_shape`` overrides the output buffer's shape to test the kernel's checks. Raises
    ValueError with the kernel's message when it refuses the call."""
    x, weight = np.require(x, requirements="C"), np.require(weight, requirements="C")  # 0-d stays 0-d
    if out_shape is None:
        out_shape = x.shape[:-1] + weight.shape[:1] if x.ndim and weight.ndim == 2 else (0,)
    y = np.full(out_shape, np.nan, np.float32)
    call_entry("RfaLinear", x, weight, y, isa=isa)
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
    float32``; shapes from the library's C++ InferShape, so GRAPH_MODE with dynamic sequence lengths
    compiles once."""
    library()  # OpenBLAS first (its thread count), and fail here, not inside MindSpore
    reg = CustomRegOp(KERNEL_SYMBOL).input(0, "x", "required").input(1, "weight", "required").output(0, "y", "required")
    for weight in (DataType.F32_Default, DataType.F16_Default, DataType.BF16_Default):
        reg = reg.dtype_format(DataType.F32_Default, weight, DataType.F32_Default)
    return ops.Custom(f"{library_path()}:{KERNEL_SYMBOL}", out_shape=None, out_dtype=None, func_type="aot",
                      bprop=_bprop(), reg_info=reg.target("CPU").get_op_info())
