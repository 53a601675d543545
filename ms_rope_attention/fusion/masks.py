"""Whether a mask is exactly causal (so the fused op's own causal rule may replace it), in MindSpore
ops that run eagerly and inside a graph (where the mask is data, decided per call), and the
announcement a fallback branch makes at run time. Functional ops only, no Tensor methods: mindtorch
replaces those with versions that refuse a tensor without its device tag."""
from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import ops

from .family import MASKED_BELOW, SiteAnnouncer


def _causal_keep(q_len, k_len):
    """(q_len, k_len) bool: query i sees keys j <= i + k_len - q_len (the bottom-right rule)."""
    return ops.gt(ops.tril(ops.ones((q_len, k_len), ms.float32), k_len - q_len), 0)


def additive_mask_is_causal(mask):
    """An additive mask (0 = attend, <= -1e4 = hidden; any leading dims) that hides exactly the
    future keys of every query: a 0-d bool Tensor."""
    attended = ops.equal(mask, 0)
    keep = _causal_keep(mask.shape[-2], mask.shape[-1])
    return ops.logical_and(ops.all(ops.equal(attended, keep)), ops.all(ops.logical_or(attended, ops.le(mask, MASKED_BELOW))))


def bool_mask_is_causal(mask):
    """A boolean mask (True = attend) equal to the causal rule for every batch and head."""
    return ops.all(ops.equal(mask, _causal_keep(mask.shape[-2], mask.shape[-1])))


def fallback_announcer(site: str, *reasons: str):
    """An op for a fallback branch: run (eagerly or by the graph, on the CPU as a ``pyfunc`` op), it
    logs the site's ``rotary_fusion_fallback`` warning for each reason whose bit is set in its int32
    argument (bit i: ``reasons[i]``; ``ops.ones((1,), ms.int32)`` for a single reason), once per
    reason. Returns its argument."""

    announcer = SiteAnnouncer(site)

    def announce(code):
        bits = int(np.asarray(code).reshape(-1)[0])
        for i, reason in enumerate(reasons):
            if bits >> i & 1:
                announcer(reason)
        return code

    return ops.Custom(announce, out_shape=lambda shape: shape, out_dtype=lambda dtype: dtype, func_type="pyfunc")
