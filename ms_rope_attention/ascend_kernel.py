"""Registering the Ascend C kernel (``aclnn/``, built and installed with ``aclnn/build.sh``) as a
MindSpore ``ops.Custom`` aot op on an Ascend device.

MindSpore finds the op through CANN's custom-op search path (``ASCEND_CUSTOM_OPP_PATH`` or the
vendors of ``ASCEND_OPP_PATH``) and calls its aclnn API; it runs in PyNative and in GRAPH_MODE at
``jit_level`` O0/O1. Not run on hardware yet: see aclnn/README.md.

The backward is one of three, as ``RFA_ASCEND_BACKWARD`` chooses (``flash_backward``):
``flash_attention_score`` (the default: the autodiff of RoPE + MindSpore's FlashAttention, whose
gradient is CANN's own), ``unfused`` (the unfused path's autodiff, S x S), or ``kernel``: the fused
backward kernel ``RotaryFlashAttentionGrad`` of the same package, a second aot ``Custom`` op,
verified on the CPU emulation only. The default stays off the kernel until it has run on hardware.
"""
from __future__ import annotations

import os
from pathlib import Path

import mindspore as ms
from mindspore import ops

from .flash_backward import SWITCH, chosen_backward, flash_attention_bprop
from .gradients import FusedKernel, fused_bprop, unfused_autodiff_bprop
from .op_info import build_reg_info, load_contract, output_shapes

ACLNN_HEADER = "aclnn_rotary_flash_attention.h"
GRAD_ACLNN_HEADER = "aclnn_rotary_flash_attention_grad.h"
BUILD_SCRIPT = "ms_rope_attention/aclnn/build.sh"


def _vendor_dirs() -> list[Path]:
    dirs = [Path(p) for p in os.environ.get("ASCEND_CUSTOM_OPP_PATH", "").split(":") if p]
    opp = os.environ.get("ASCEND_OPP_PATH")
    if opp and (Path(opp) / "vendors").is_dir():
        dirs += sorted(p for p in (Path(opp) / "vendors").iterdir() if p.is_dir())
    return dirs


def _missing(header: str) -> str | None:
    """None when ``header`` (one op's aclnn API) is installed where MindSpore looks, else where it
    was looked for."""
    for vendor in _vendor_dirs():
        if (vendor / "op_api" / "include" / header).exists():
            return None
    searched = ", ".join(str(d) for d in _vendor_dirs()) or "nothing (ASCEND_CUSTOM_OPP_PATH and ASCEND_OPP_PATH unset)"
    return f"{header} not found; searched {searched}"


def package_status() -> str | None:
    """None when the op package is installed where MindSpore looks, else why it is not usable."""
    missing = _missing(ACLNN_HEADER)
    return missing and f"Ascend op package not installed ({missing}); build it with {BUILD_SCRIPT}"


def unavailable() -> str | None:
    """The dispatch's question: why the fused op cannot run here (None: it can)."""
    return package_status()


def _kernel_bprop(attrs: dict, grads_used: tuple[bool, bool]):
    """(the fused backward's bprop, its ``Custom`` primitive), which fails here, when the op is built,
    if the installed package has no backward op: choosing it must not fall back silently."""
    grad = load_contract().backward
    missing = _missing(GRAD_ACLNN_HEADER)
    if missing:
        raise RuntimeError(f"{SWITCH}=kernel: the Ascend op package has no {grad.op_name} ({missing}); "
                           f"build and install it with {BUILD_SCRIPT}")
    grad_op = ops.Custom(grad.op_name, out_shape=lambda q, k, v, *rest: (q, k, v),
                         out_dtype=lambda q, k, v, *rest: (q, k, v), func_type="aot",
                         reg_info=build_reg_info("Ascend", attrs, backward=True))
    unproven = f"the fused backward kernel {grad.op_name} (verified on the CPU emulation only, not on hardware)"
    return fused_bprop(grad_op, *grads_used, unproven), grad_op


def make_kernel(attrs, forwards) -> FusedKernel:
    """The aot ``Custom`` primitive bound to the installed aclnn op, for one ``attrs.OpAttrs``, with
    the backward ``flash_backward.RFA_ASCEND_BACKWARD`` chooses: the autodiff of one of ``forwards``
    (``gradients.AutodiffForwards``; default MindSpore's FlashAttention, no S x S matrix), announced
    once as a fallback (strict raises instead), or the fused backward kernel, announced once as not
    run on hardware (not a fallback: strict allows it). ``backward_name`` says which."""
    if attrs.compute_dtype != "auto":
        raise ValueError(f"compute_dtype: on Ascend the cube units compute Q·Kᵀ and P·V in the inputs' dtype with "
                         f"float32 accumulation; only 'auto' is accepted there, got {attrs.compute_dtype!r}")
    values, grads_used = attrs.kernel_attrs(), (attrs.with_softmax_lse, attrs.with_rotated_key)
    strict = attrs.strict or attrs.backend == "fused"

    def out_shape(q, k, *rest):
        return output_shapes(q, k, values)

    backward, grad_op = chosen_backward(), None
    if backward == "kernel":
        bprop, grad_op = _kernel_bprop(values, grads_used)
    elif backward == "flash_attention_score":
        bprop = flash_attention_bprop(forwards.flash_attention, forwards.unfused, grads_used, attrs.input_layout,
                                      attrs.head_num, strict)
    else:
        bprop = unfused_autodiff_bprop(forwards.unfused, grads_used[0], f"{SWITCH}=unfused", strict)
    op = ops.Custom(load_contract().op_name, out_shape=out_shape,
                    out_dtype=lambda q, k, *rest: (q, ms.float32, k), func_type="aot", bprop=bprop,
                    reg_info=build_reg_info("Ascend", values))
    return FusedKernel(op, grad_op, backward)
