"""The Ascend C kernel (``aclnn/op_kernel``) compiled for the CPU against the AscendC emulation
(``aclnn/emulator``), and its tiling: what the tests use to verify the Ascend op without an NPU.

``run`` and ``run_grad`` are ``cpu_direct.run`` / ``cpu_direct.run_grad`` on this library (same C
entries, same checks); ``plan`` and ``grad_plan`` return the forward's / backward's tiling for a
problem plus the work each core receives.
"""
from __future__ import annotations

import ctypes

import numpy as np

from ..cpu_runtime import built_file, kernel_dir, open_library
from . import cpu_direct


class Tiling(ctypes.Structure):  # mirrors rfa::ascend::RfaTiling in aclnn/op_kernel/rotary_flash_attention_tiling.h
    _fields_ = [(name, ctypes.c_int64) for name in (
        "batch", "q_heads", "kv_heads", "group", "head_dim", "head_pad", "rotary_dim", "rotary_pad", "q_len", "kv_len",
        "table_rows", "layout", "rotary_mode", "causal", "with_lse", "with_rotated_key", "key_rotated",
        "q_batch_stride", "q_head_stride", "q_row_stride", "kv_batch_stride", "kv_head_stride", "kv_row_stride",
        "lse_batch_stride", "lse_head_stride", "lse_row_stride")] + [("scale", ctypes.c_float)] + [
        (name, ctypes.c_int64) for name in ("block_q", "block_kv", "core_num", "ub_bytes", "ws_q", "ws_k", "ws_v",
                                            "ws_p", "ws_per_core", "k_prepass", "ws_keys")]

    def as_dict(self) -> dict:
        return {name: getattr(self, name) for name, _ in self._fields_}


class GradPlan(ctypes.Structure):  # mirrors rfa::ascend::RfaGradPlan in aclnn/op_kernel/rotary_flash_attention_grad_tiling.h
    _fields_ = [(name, ctypes.c_int64) for name in (
        "block_q", "block_kv", "core_num", "ub_bytes", "has_dlse", "has_drk", "q_rows", "kv_rows", "ws_qs", "ws_do",
        "ws_kr", "ws_v", "ws_lse", "ws_delta", "ws_cores", "ws_p", "ws_ds", "ws_per_core")]
    as_dict = Tiling.as_dict


def library() -> ctypes.CDLL:
    """The emulation's one build (no ISA variants: it verifies the Ascend kernel, not speed)."""
    path = built_file("_rfa_ascend_emulated")
    if path is None:
        raise RuntimeError(f"the emulated Ascend kernel is not built in {kernel_dir()}: it is built into a checkout "
                           "only (pip install -e ., or python setup.py build_ext --inplace), not into a wheel")
    return open_library(path, texts=("RotaryFlashAttentionLastError",))


def last_error() -> str:
    return library().RotaryFlashAttentionLastError().decode()


def run(*args, **kwargs):
    """``cpu_direct.run`` on the emulated Ascend kernel: (code, out, lse, rotated_key)."""
    return cpu_direct.run(*args, kernel=library(), **kwargs)


def run_grad(*args, **kwargs):
    """``cpu_direct.run_grad`` on the emulated Ascend backward kernel: (code, d_query, d_key, d_value)."""
    return cpu_direct.run_grad(*args, kernel=library(), **kwargs)


def plan(q, k, v, cos, sin, aq=None, ak=None, *, cores=48, ub_bytes=192 * 1024 - 256, block_q=0, block_kv=0, **kwargs):
    """(code, tiling dict, work per core (query rows x keys), workspace bytes) for one problem."""
    args, _, keep = cpu_direct.prepare(q, k, v, cos, sin, aq, ak, **kwargs)
    tiling = Tiling()
    work = (ctypes.c_int64 * cores)()
    workspace = ctypes.c_int64()
    code = library().RfaAscendPlan(*args, ctypes.c_int64(cores), ctypes.c_int64(ub_bytes), ctypes.c_int64(block_q),
                                   ctypes.c_int64(block_kv), ctypes.byref(tiling), work, ctypes.byref(workspace))
    del keep
    return code, tiling.as_dict(), np.array(work[:], np.int64), workspace.value


def grad_plan(q, k, v, cos, sin, aq=None, ak=None, *, cores=48, ub_bytes=192 * 1024 - 256, block_q=0, block_kv=0,
              **kwargs):
    """(code, problem tiling dict, backward plan dict, score entries recomputed per core, workspace
    bytes) of the backward for one problem."""
    args, _, keep = cpu_direct.prepare(q, k, v, cos, sin, aq, ak, **kwargs)
    tiling, grad = Tiling(), GradPlan()
    work = (ctypes.c_int64 * cores)()
    workspace = ctypes.c_int64()
    code = library().RfaAscendGradPlan(*args, ctypes.c_int64(cores), ctypes.c_int64(ub_bytes),
                                       ctypes.c_int64(block_q), ctypes.c_int64(block_kv), ctypes.byref(tiling),
                                       ctypes.byref(grad), work, ctypes.byref(workspace))
    del keep
    return code, tiling.as_dict(), grad.as_dict(), np.array(work[:], np.int64), workspace.value
