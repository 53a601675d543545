"""How gradients flow through the fused op: the ``bprop`` attached to its ``Custom`` primitive.

- ``fused_bprop``: the backward kernel (``RotaryFlashAttentionGrad``, a second aot ``Custom`` op),
  FlashAttention-2 style from the forward's output and log-sum-exp, which the fused forward therefore
  always emits. cos/sin and the TND offsets get no gradient (zeros): they are tables and indices.
  On the CPU always; on Ascend when ``RFA_ASCEND_BACKWARD=kernel`` (``flash_backward``).
- ``unfused_autodiff_bprop``: for a device whose fused forward has no fused backward: MindSpore's
  autodiff of the unfused path on the same inputs (it holds S x S scores per head). On Ascend the
  default is ``flash_backward.flash_attention_bprop`` instead (MindSpore's FlashAttention gradient),
  which falls back to this one only where FlashAttention cannot take the call.
Never silent: the first backward logs one ``rotary_fusion_fallback`` warning naming the backward
that runs, and ``strict=True`` raises instead. A backward kernel that has not run on hardware is no
fallback: it logs one ``rotary_fusion_backward`` warning, which ``strict`` does not refuse.
"""
from __future__ import annotations

import logging
from typing import Callable, NamedTuple

from mindspore import ops

logger = logging.getLogger("ms_rope_attention")
_announced: set = set()

ZEROS_LIKE = ops.ZerosLike()


def no_grad(x):
    """The gradient of an input that gets none: zeros, or None for an absent optional input."""
    return None if x is None else ZEROS_LIKE(x)


def fused_bprop(grad_op, lse_used: bool, rotated_key_used: bool, unproven: str | None = None):
    """The bprop of the fused forward: ``grad_op`` gives (d_query, d_key, d_value). The gradients of
    softmax_lse / rotated_key are passed only when the caller uses those outputs (otherwise None:
    the kernel skips them). ``unproven``: the kernel's name where it has not run on hardware, which
    the first backward announces (``announce_backward``)."""

    def bprop(query, key, value, cos, sin, actual_seq_qlen, actual_seq_kvlen, out, dout):
        if unproven is not None:
            announce_backward(unproven)
        d_lse = dout[1] if lse_used else None
        d_rotated_key = dout[2] if rotated_key_used else None
        d_query, d_key, d_value = grad_op(query, key, value, cos, sin, actual_seq_qlen, actual_seq_kvlen, out[0],
                                          out[1], dout[0], d_lse, d_rotated_key)
        return (d_query, d_key, d_value, ZEROS_LIKE(cos), ZEROS_LIKE(sin), no_grad(actual_seq_qlen),
                no_grad(actual_seq_kvlen))

    return bprop


class AutodiffForwards(NamedTuple):
    """The op's forward rebuilt from MindSpore ops, for a fused forward whose backward is an
    autodiff: ``unfused`` (the unfused path: (out, lse, rotated_key)) and ``flash_attention``
    (RoPE + ``ops.flash_attention_score``: (out, rotated_key); Ascend only)."""
    unfused: Callable
    flash_attention: Callable


class FusedKernel(NamedTuple):
    """What a device's kernel factory returns for one attribute set: the ``forward`` primitive
    (its bprop attached), the gradient primitive ``grad`` its bprop calls (None when the backward
    is an autodiff) and ``backward_name``, which backward that is ('kernel', 'unfused' or
    'flash_attention_score'). The factory shards nothing: ``layouts.shard`` does, when asked."""
    forward: object
    grad: object
    backward_name: str


class RotaryFusionFallbackError(RuntimeError):
    """Raised under ``strict=True`` instead of falling back to the unfused path."""


UNFUSED = "the unfused RoPE + attention path"


def _warn_once(key: str, message: str, *args) -> None:
    if key not in _announced:
        _announced.add(key)
        logger.warning(message, *args)


def announce_fallback(reason: str, strict: bool, instead: str = UNFUSED) -> None:
    """One warning per reason per process (``rotary_fusion_fallback: ...; running <instead>``), or
    the strict error."""
    if strict:
        raise RotaryFusionFallbackError(f"rotary_fusion_fallback refused: {reason}")
    _warn_once(reason, "rotary_fusion_fallback: %s; running %s", reason, instead)


@ops.constexpr
def announce_backward_fallback(reason: str, strict: bool, instead: str = UNFUSED) -> bool:
    """Runs when the gradient is built: at compile time in GRAPH_MODE, at each backward in PyNative."""
    announce_fallback(f"backward: {reason}", strict, instead)
    return True


@ops.constexpr
def announce_backward(running: str) -> bool:
    """A chosen backward kernel that has not run on hardware: one ``rotary_fusion_backward: running
    <running>`` warning per process when the gradient is built. Not a fallback, so never refused."""
    _warn_once(running, "rotary_fusion_backward: running %s", running)
    return True


def unfused_autodiff_bprop(unfused_forward, lse_used: bool, reason: str | None, strict: bool):
    """The bprop of a fused forward without a fused backward: the vector-Jacobian product of
    ``unfused_forward`` (same inputs, same outputs as the fused op, with softmax_lse only when
    ``lse_used``) at the fused op's upstream gradients. ``reason`` None: the caller announces."""
    vjp = ops.GradOperation(get_all=True, sens_param=True)(unfused_forward)

    def bprop(query, key, value, cos, sin, actual_seq_qlen, actual_seq_kvlen, out, dout):
        if reason is not None:
            announce_backward_fallback(reason, strict)
        d_lse = dout[1] if lse_used else ops.zeros((0,), out[1].dtype)
        d_query, d_key, d_value = vjp(query, key, value, cos, sin, actual_seq_qlen, actual_seq_kvlen,
                                      (dout[0], d_lse, dout[2]))[:3]
        return (d_query, d_key, d_value, ZEROS_LIKE(cos), ZEROS_LIKE(sin), no_grad(actual_seq_qlen),
                no_grad(actual_seq_kvlen))

    return bprop
