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


def make_ascend_op(attrs: dict, grads_used: tuple[bool, bool], unfused_forward, strict: bool,
                   parallel: tuple[int, int] | None = None) -> ops.Custom:
    """The aot ``Custom`` primitive bound to the installed aclnn op, for one attribute set. There is
    no Ascend backward kernel yet: gradients are the unfused path's autodiff, announced once
    (``strict`` raises instead). ``parallel=(dp, tp)``: with the semi-auto layouts of
    ``distributed.sharding`` (the forward only: the backward has no primitive of its own)."""
    layout, head_num = attrs.get("input_layout", "BNSD"), attrs.get("head_num") or None
    with_lse, with_rk = attrs.get("with_softmax_lse", False), attrs.get("with_rotated_key", False)

    def out_shape(q, k, *rest):
        return expected_shapes(q, k, layout, head_num, with_lse, with_rk)

    op = ops.Custom(load_contract().op_name, out_shape=out_shape,
                    out_dtype=lambda q, k, *rest: (q, ms.float32, k), func_type="aot",
                    bprop=unfused_autodiff_bprop(unfused_forward, grads_used[0], "no fused backward kernel on Ascend",
                                                 strict),
                    reg_info=build_reg_info("Ascend", attrs))
    if parallel is not None:
        from .distributed.sharding import shard_fused  # the distributed package only when asked for
        shard_fused(op, None, attrs, grads_used, *parallel)
    return op
