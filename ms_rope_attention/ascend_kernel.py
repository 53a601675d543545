"""Registering the Ascend C kernel (``aclnn/``, built and installed with ``aclnn/build.sh``) as a
MindSpore ``ops.Custom`` aot op on an Ascend device.

MindSpore finds the op through CANN's custom-op search path (``ASCEND_CUSTOM_OPP_PATH`` or the
vendors of ``ASCEND_OPP_PATH``) and calls its aclnn API; it runs in PyNative and in GRAPH_MODE at
``jit_level`` O0/O1. Not run on hardware yet: see aclnn/README.md.
"""
from __future__ import annotations

import os
from pathlib import Path

import mindspore as ms
from mindspore import ops

from .cpu_direct import expected_shapes
from .flash_backward import SWITCH, chosen_backward, flash_attention_bprop
from .gradients import unfused_autodiff_bprop
from .op_info import build_reg_info, load_contract

ACLNN_HEADER = "aclnn_rotary_flash_attention.h"


def _vendor_dirs() -> list[Path]:
    dirs = [Path(p) for p in os.environ.get("ASCEND_CUSTOM_OPP_PATH", "").split(":") if p]
    opp = os.environ.get("ASCEND_OPP_PATH")
    if opp and (Path(opp) / "vendors").is_dir():
        dirs += sorted(p for p in (Path(opp) / "vendors").iterdir() if p.is_dir())
    return dirs


def package_status() -> str | None:
    """None when the op package is installed where MindSpore looks, else why it is not usable."""
    for vendor in _vendor_dirs():
        if (vendor / "op_api" / "include" / ACLNN_HEADER).exists():
            return None
    searched = ", ".join(str(d) for d in _vendor_dirs()) or "nothing (ASCEND_CUSTOM_OPP_PATH and ASCEND_OPP_PATH unset)"
    return (f"Ascend op package not installed ({ACLNN_HEADER} not found; searched {searched}); "
            "build it with ms_rope_attention/aclnn/build.sh")


def make_ascend_op(attrs: dict, grads_used: tuple[bool, bool], forwards, strict: bool,
                   parallel: tuple[int, int] | None = None) -> ops.Custom:
    """The aot ``Custom`` primitive bound to the installed aclnn op, for one attribute set. There is
    no Ascend backward kernel that has run on hardware yet: the backward is the autodiff of one of
    ``forwards`` (``gradients.AutodiffForwards``), as ``flash_backward.RFA_ASCEND_BACKWARD`` chooses
    (default: MindSpore's FlashAttention, no S x S matrix), announced once (``strict`` raises
    instead); ``op.backward_name`` says which. ``parallel=(dp, tp)``: with the semi-auto layouts of
    ``distributed.sharding`` (the forward only: the backward has no primitive of its own)."""
    layout, head_num = attrs.get("input_layout", "BNSD"), attrs.get("head_num") or None
    with_lse, with_rk = attrs.get("with_softmax_lse", False), attrs.get("with_rotated_key", False)

    def out_shape(q, k, *rest):
        return expected_shapes(q, k, layout, head_num, with_lse, with_rk)

    backward = chosen_backward()
    if backward == "flash_attention_score":
        bprop = flash_attention_bprop(forwards.flash_attention, forwards.unfused, grads_used, layout, head_num, strict)
    else:
        bprop = unfused_autodiff_bprop(forwards.unfused, grads_used[0],
                                       f"no fused backward kernel on Ascend ({SWITCH}=unfused)", strict)
    op = ops.Custom(load_contract().op_name, out_shape=out_shape,
                    out_dtype=lambda q, k, *rest: (q, ms.float32, k), func_type="aot", bprop=bprop,
                    reg_info=build_reg_info("Ascend", attrs))
    op.backward_name = backward
    if parallel is not None:
        from .distributed.sharding import shard_fused  # the distributed package only when asked for
        shard_fused(op, None, attrs, grads_used, *parallel)
    return op
