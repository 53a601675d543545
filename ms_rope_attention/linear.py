"""y = x W^T on the CPU through OpenBLAS: the projections around the attention op, as an aot ``Custom`` op,
with W in float32 or in the checkpoint's own float16 / bfloat16 (x and y float32); the arithmetic is the
op's ``compute_dtype``: float32, or bfloat16 through oneDNN (a bfloat16 W).

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

``compute_dtype="bfloat16"``: x is rounded once to bfloat16 (to nearest even) inside the op and multiplied
by a bfloat16 W on oneDNN's matmul (AMX or AVX512-BF16 kernels, float32 accumulation), or the same
products on the float32 FMAs where this CPU's bfloat16 dot products are slower than those (``bf16_engine()``
says which, and why; csrc/rfa_cpu_linear.cc measured both). oneDNN is a private
copy inside the package (``_onednn/libdnnl_rfa.so.3``: setup.py says why); the library is refused at load
when another oneDNN was bound in its place (``onednn()`` names the one in use). A bfloat16 W runs either as
stored or, faster, reordered once at load into oneDNN's blocked layout for this CPU: ``pack_weight(w)``
(a uint8 buffer of ``packed_bytes(*w.shape)`` bytes, which replaces W) and ``linear_op("bfloat16",
packed_out_features=N)`` or ``multiply(..., packed_out_features=N)`` on it.

``swiglu_op``: a Llama MLP's gate and up projections and SwiGLU as one op of the same library, h =
silu(x Wg^T) * (x Wu^T) (contract ``op_info/swiglu.yaml``): on the same products as two ``linear_op``
calls, but with bfloat16 arithmetic x is rounded once for both, and the epilogue runs as oneDNN's
post-ops of the gate product (more than 4 rows) or in one loop after the decode-sized products, instead
of MindSpore's Sigmoid, Mul and Mul over the (tokens, intermediate) activations.
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

from .cpu_runtime import aot_call, library_path, make_primitive, open_library
from .op_info import LINEAR_PATH, SWIGLU_PATH, attr_values, load_contract

STEM, WHAT = "_rfa_cpu_linear", "projection GEMM library"
WEIGHT_DTYPES = ("float32", "float16", "bfloat16")
ENTRY_TEXTS = ("RfaLinearLastError", "RfaLinearIsa", "RfaLinearOnednn", "RfaLinearOnednnProblem", "RfaLinearComputeProblem",
               "RfaLinearBf16Engine", "RfaSwiGLULastError", "RfaSwiGLUComputeProblem")
ENTRY_COUNTS = ("RfaLinearPackedBytes",)


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


def library(isa: str | None = None, texts: tuple = ENTRY_TEXTS) -> ctypes.CDLL:
    """The projection library (the selected build, or ``isa``'s: its own products are compiled per
    instruction set), opened after OpenBLAS (its thread count; and the editable checkout's library
    finds OpenBLAS only this way). It holds the embedding's entry too: ``texts`` are the caller's.
    RuntimeError when it is bound to another oneDNN than its private copy (MindSpore's has the
    same SONAME; a wrong binding would run right but slowly, so it is refused, loudly)."""
    openblas()
    lib = open_library(library_path(STEM, WHAT, isa), texts=texts + tuple(t for t in ENTRY_TEXTS if t not in texts),
                       counts=ENTRY_COUNTS)
    problem = lib.RfaLinearOnednnProblem().decode()
    if problem:
        raise RuntimeError(problem)
    return lib


def onednn(isa: str | None = None) -> str:
    """The oneDNN the projection library runs its bfloat16 arithmetic on, as it reports itself
    (``"oneDNN 3.2.0 (OpenMP runtime)"``); ``""`` for a build without oneDNN."""
    return library(isa).RfaLinearOnednn().decode()


def bf16_engine(isa: str | None = None) -> str:
    """Which units run this process's bfloat16 products past a few rows, and why: ``"onednn: AMX"``,
    ``"fma: vdpbf16ps 83 GFLOP/s, float32 FMA 183 GFLOP/s on one thread"`` (the same arithmetic on the
    float32 FMAs, where this CPU's bfloat16 dot products are the slower units), or the
    ``RFA_BF16_GEMM`` override (``auto``, ``onednn`` or ``fma``)."""
    return library(isa).RfaLinearBf16Engine().decode()


def library_isa() -> str:
    """The instruction set of the build in use."""
    return library().RfaLinearIsa().decode()


def multiply(x: np.ndarray, weight: np.ndarray, out_shape: tuple | None = None, isa: str | None = None,
             compute_dtype: str = "float32", packed_out_features: int = 0) -> np.ndarray:
    """x @ weight.T through the op's kernel (``RfaLinearRun``), called directly (tests, benchmarks and
    the sanitizer run, no MindSpore), with the op's attributes ``compute_dtype`` and
    ``packed_out_features`` (N when ``weight`` is ``pack_weight``'s buffer); ``out_shape`` overrides
    the output buffer's shape to test the kernel's checks. Raises ValueError with the kernel's
    message when it refuses the call (the attributes included)."""
    x, weight = np.require(x, requirements="C"), np.require(weight, requirements="C")  # 0-d stays 0-d
    if out_shape is None:
        out_features = packed_out_features if weight.ndim == 1 else weight.shape[0] if weight.ndim == 2 else None
        out_shape = x.shape[:-1] + (out_features,) if x.ndim and out_features is not None else (0,)
    y = np.full(out_shape, np.nan, np.float32)
    lib = library(isa)
    call = aot_call((x, weight, y))
    text = compute_dtype.encode() if isinstance(compute_dtype, str) else repr(compute_dtype).encode()
    if lib.RfaLinearRun(ctypes.c_char_p(text), ctypes.c_int64(packed_out_features), 3, call.params, call.ndims,
                        call.shapes, call.dtypes):
        raise ValueError(lib.RfaLinearLastError().decode())
    return y


def packed_bytes(out_features: int, in_features: int) -> int:
    """The bytes of a bfloat16 (out_features, in_features) weight packed by ``pack_weight`` on this CPU
    (oneDNN's blocked layout, padded; the layout depends on the CPU and oneDNN, so pack at load, in the
    process that runs it, never store it). ValueError naming the argument when it cannot be packed here."""
    size = library().RfaLinearPackedBytes(ctypes.c_int64(out_features), ctypes.c_int64(in_features))
    if size < 0:
        raise ValueError(library().RfaLinearLastError().decode())
    return size


def pack_weight(weight: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``weight`` (out_features, in_features) bfloat16 reordered into oneDNN's blocked layout: ``out``
    (uint8, shape ``(packed_bytes(*weight.shape),)``, C-contiguous) or a new buffer. The layout starts
    at the buffer's first 64-byte boundary (off it, AMX ran 1.3-2x slower): pack into the memory it
    will run from, e.g. ``pack_weight(w, out=parameter.asnumpy())`` for a MindSpore Parameter of that
    size (a CPU tensor's asnumpy() is a view); a copy moved to another alignment is right, only slower. Use it in place of
    the weight with ``linear_op("bfloat16", packed_out_features=out_features)``; drop the original."""
    weight = np.require(weight, requirements="C")
    if out is None:
        if weight.ndim != 2:
            raise ValueError(f"weight: expected 2 dimensions (out_features, in_features), got {weight.shape}")
        out = np.empty(packed_bytes(*weight.shape), np.uint8)
    elif not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError("out: expected a writable C-contiguous uint8 buffer")
    lib = library()
    call = aot_call((weight, out), [str(weight.dtype), str(out.dtype)])
    if lib.RfaLinearPack(2, call.params, call.ndims, call.shapes, call.dtypes):
        raise ValueError(lib.RfaLinearLastError().decode())
    return out


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


def linear_op(compute_dtype: str = "float32", packed_out_features: int = 0) -> ops.Custom:
    """The aot primitive ``(x (..., K) float32, weight (N, K) float32/float16/bfloat16) -> (..., N)
    float32`` computing in ``compute_dtype`` ("float32", or "bfloat16" with a bfloat16 weight); with
    ``packed_out_features=N``, weight is ``pack_weight``'s uint8 buffer for a bfloat16 (N, K) W
    (inference only: no gradient through it). Contract: ``op_info/linear.yaml``. Shapes from the library's C++ InferShape, so GRAPH_MODE with
    dynamic sequence lengths compiles once. A value the library cannot compute is refused here,
    naming ``compute_dtype``, not at the first launch."""
    lib = library()  # OpenBLAS first (its thread count), and fail here, not inside MindSpore
    values = _checked_attrs(LINEAR_PATH, lib.RfaLinearComputeProblem, "a weight", compute_dtype, packed_out_features)
    # Not graph-launched, as before the runtime was shared (and the embedding likewise): a graph launch
    # gives bit-equal values and gradients here, but a 1x4096 by 4096x4096 product took the same
    # 8.7 ms eagerly either way on 2 busy cores, while the launch graph compiled 7 times for 3 shapes
    # with their gradients. Switching is a change to measure on its own (benchmarks/projections.py).
    return _primitive(values["compute_dtype"], values["packed_out_features"])


def _checked_attrs(contract_path, compute_problem, packed_what: str, compute_dtype, packed_out_features) -> dict:
    """The projection ops' attributes (``compute_dtype``, ``packed_out_features``) by their contract, each
    refused by name: the library's reasons for a compute dtype (float16, a build without oneDNN) first,
    then the contract's values, then packed weights outside bfloat16 arithmetic."""
    if isinstance(compute_dtype, str):
        problem = compute_problem(compute_dtype.encode()).decode()
        if problem:
            raise ValueError(problem)
    values = attr_values(load_contract(str(contract_path)), {"compute_dtype": compute_dtype,
                                                             "packed_out_features": packed_out_features})
    if values["packed_out_features"] < 0 or values["packed_out_features"] and compute_dtype != "bfloat16":
        raise ValueError(f"packed_out_features: expected 0, or the out_features of {packed_what} packed for "
                         f"compute_dtype 'bfloat16', got {packed_out_features!r} with compute_dtype {compute_dtype!r}")
    return values


@functools.lru_cache(maxsize=None)
def _primitive(compute_dtype: str, packed_out_features: int) -> ops.Custom:
    """One primitive per attribute values, however the caller spelled the defaults."""
    return make_primitive(load_contract(str(LINEAR_PATH)), {"compute_dtype": compute_dtype,
                                                            "packed_out_features": packed_out_features},
                          library_path(STEM, WHAT), bprop=_bprop(), any_dtype=False, graph_launch=False)


# ---- RfaSwiGLU: the MLP's gate and up projections and SwiGLU ----------------------------------------

def multiply_swiglu(x: np.ndarray, gate_weight: np.ndarray, up_weight: np.ndarray, out_shape: tuple | None = None,
                    isa: str | None = None, compute_dtype: str = "float32", packed_out_features: int = 0) -> np.ndarray:
    """silu(x @ gate_weight.T) * (x @ up_weight.T) through the op's kernel (``RfaSwiGLURun``), called
    directly (tests and the sanitizer run, no MindSpore), with the op's attributes as ``multiply`` takes
    them (``packed_out_features``: F when both weights are ``pack_weight``'s buffers); ``out_shape``
    overrides the output buffer's shape to test the kernel's checks. Raises ValueError with the kernel's
    message when it refuses the call."""
    x = np.require(x, requirements="C")
    gate_weight, up_weight = np.require(gate_weight, requirements="C"), np.require(up_weight, requirements="C")
    if out_shape is None:
        out_features = (packed_out_features if gate_weight.ndim == 1 else gate_weight.shape[0] if gate_weight.ndim == 2
                        else None)
        out_shape = x.shape[:-1] + (out_features,) if x.ndim and out_features is not None else (0,)
    y = np.full(out_shape, np.nan, np.float32)
    lib = library(isa)
    call = aot_call((x, gate_weight, up_weight, y))
    text = compute_dtype.encode() if isinstance(compute_dtype, str) else repr(compute_dtype).encode()
    if lib.RfaSwiGLURun(ctypes.c_char_p(text), ctypes.c_int64(packed_out_features), 4, call.params, call.ndims,
                        call.shapes, call.dtypes):
        raise ValueError(lib.RfaSwiGLULastError().decode())
    return y


def _swiglu_bprop():
    """From g = x Wg^T and u = x Wu^T recomputed on MindSpore's float32 MatMul, s = sigmoid(g):
    du = dy silu(g), dg = dy u s (1 + g (1 - s)); dx = dg Wg + du Wu, dWg = dg^T x, dWu = du^T x, the
    weights' gradients in their dtype (as RfaLinear's)."""
    matmul = ops.MatMul()
    matmul_tb = ops.MatMul(transpose_b=True)
    matmul_ta = ops.MatMul(transpose_a=True)
    sigmoid = ops.Sigmoid()

    def bprop(x, gate_weight, up_weight, out, dout):
        in_features, out_features = gate_weight.shape[1], gate_weight.shape[0]
        x2 = x.reshape(-1, in_features)
        wg, wu = gate_weight.astype(ms.float32), up_weight.astype(ms.float32)
        g, u = matmul_tb(x2, wg), matmul_tb(x2, wu)
        s = sigmoid(g)
        dy = dout.reshape(-1, out_features)
        du = dy * (g * s)
        dg = dy * u * (s * (1 + g * (1 - s)))
        dx = (matmul(dg, wg) + matmul(du, wu)).reshape(x.shape)
        return dx, matmul_ta(dg, x2).astype(gate_weight.dtype), matmul_ta(du, x2).astype(up_weight.dtype)
    return bprop


def swiglu_op(compute_dtype: str = "float32", packed_out_features: int = 0) -> ops.Custom:
    """The aot primitive ``(x (..., K) float32, gate_weight (F, K), up_weight (F, K)) -> (..., F) float32``
    computing silu(x Wg^T) * (x Wu^T) (silu(g) = g * sigmoid(g)), the weights float32 / float16 / bfloat16
    (one dtype for both) as ``linear_op`` takes them, in ``compute_dtype`` with ``linear_op``'s rules and
    refusals; with ``packed_out_features=F`` both are ``pack_weight``'s buffers (inference only: no
    gradient through them). Contract: ``op_info/swiglu.yaml``. Shapes from the library's C++ InferShape;
    a value the library cannot compute is refused here, naming ``compute_dtype``."""
    lib = library()
    values = _checked_attrs(SWIGLU_PATH, lib.RfaSwiGLUComputeProblem, "weights", compute_dtype, packed_out_features)
    return _swiglu_primitive(values["compute_dtype"], values["packed_out_features"])


@functools.lru_cache(maxsize=None)
def _swiglu_primitive(compute_dtype: str, packed_out_features: int) -> ops.Custom:
    """One primitive per attribute values; not graph-launched, as ``linear_op``'s. A packed primitive has
    no bprop (its weights are oneDNN's bytes, not W)."""
    return make_primitive(load_contract(str(SWIGLU_PATH)), {"compute_dtype": compute_dtype,
                                                            "packed_out_features": packed_out_features},
                          library_path(STEM, WHAT), bprop=None if packed_out_features else _swiglu_bprop(),
                          any_dtype=False, graph_launch=False)
