"""The methods a fused class gains: whether a call is the op's, the fused op itself, and the fallback's
announcement when it is not (read by the rebuilt construct as ``self.rfa_*``)."""
from __future__ import annotations

import mindspore as ms
from mindspore import Tensor, ops

from ...functional import rotary_flash_attention
from ..masks import additive_mask_is_causal, bool_mask_is_causal

FALLBACK_REASONS = ("the mask is not exactly causal", "the rotations differ across the batch",
                    "dropout runs while training")


def _cos_of(self, freqs):
    """The op's (.., S, D) interleaved cos table of complex rotations (.., S, D / 2)."""
    return ops.repeat_interleave(ops.real(freqs), 2, -1)


def _sin_of(self, freqs):
    return ops.repeat_interleave(ops.imag(freqs), 2, -1)


def _causal(self, mask):
    if self.rfa_mask_kind == "additive":
        return additive_mask_is_causal(mask)
    return bool_mask_is_causal(ops.logical_not(mask) if self.rfa_mask_kind == "hide" else mask)


def _shared_rows(cos):
    rows = ops.reshape(cos, (-1, cos.shape[-2], cos.shape[-1]))
    return ops.all(ops.equal(rows, rows[:1]))


def _applies(self, mask, cos):
    """Whether this call is the fused op's: an exactly causal mask, one set of rotations for the whole
    batch, and no dropout while training."""
    if self.rfa_dropout and self.training:
        return Tensor(False)
    return ops.logical_and(_causal(self, mask), _shared_rows(cos))


def _fallback(self, mask, cos):
    """The mask, after the site's announcement of why this call runs the original code (bit i of the
    code: ``FALLBACK_REASONS[i]``; a dependency keeps the announcing op in the graph)."""
    code = ops.cast(ops.logical_not(_causal(self, mask)), ms.int32) + \
        2 * ops.cast(ops.logical_not(_shared_rows(cos)), ms.int32)
    if self.rfa_dropout and self.training:
        code = code + 4
    return ops.depend(mask, self.rfa_announce(ops.reshape(code, (1,))))


def _attend(self, query, key, value, cos, sin, scale):
    """The fused op on the block's BNSD q/k/v (k and v before any head repeat: the op's GQA), or on
    (B * N, S, D) ones (batch and heads merged, as for ``bmm``: one batch of B * N heads), with the
    tables as (S, D) (their first row set: ``_applies`` checked they are the batch's)."""
    cos = ops.reshape(cos, (-1, cos.shape[-2], cos.shape[-1]))[0]
    sin = ops.reshape(sin, (-1, sin.shape[-2], sin.shape[-1]))[0]
    mode, width = self.rfa_rotary_mode, cos.shape[-1]  # partial rotary: the tables' width
    if query.ndim == 3:
        out = rotary_flash_attention(ops.expand_dims(query, 0), ops.expand_dims(key, 0), ops.expand_dims(value, 0),
                                     cos, sin, scale=scale, rotary_mode=mode, rotary_dim=width)
        return ops.squeeze(out, 0)
    return rotary_flash_attention(query, key, value, cos, sin, scale=scale, rotary_mode=mode, rotary_dim=width)


METHODS = {"rfa_attend": _attend, "rfa_applies": _applies, "rfa_fallback": _fallback, "rfa_cos_of": _cos_of,
           "rfa_sin_of": _sin_of}
