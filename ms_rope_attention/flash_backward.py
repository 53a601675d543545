"""The Ascend backward, chosen by one switch, the environment variable ``RFA_ASCEND_BACKWARD``:

- ``flash_attention_score`` (default): MindSpore's own FlashAttention gradient, so training never
  builds an S x S matrix where FlashAttention can take the call. The default because its gradient
  is CANN's own operator (FlashAttentionScoreGrad), while the fused backward kernel has not run on
  hardware (neither has this project's use of either);
- ``unfused``: the autodiff of the unfused path (S x S scores per head);
- ``kernel``: the fused backward kernel ``RotaryFlashAttentionGrad`` (``aclnn/``, the same package as
  the forward), verified on the CPU emulation only, not on hardware (``ascend_kernel``).

For ``flash_attention_score`` the op's forward is rebuilt as standalone RoPE then
``ops.flash_attention_score`` (CANN's FlashAttentionScore; its gradient, FlashAttentionScoreGrad,
recomputes the scores tile by tile); the vector-Jacobian product of that at the fused op's upstream
gradients is the backward. FlashAttentionScoreGrad gives the gradients of the *rotated* q/k, and the
autodiff of the rotation applies its transpose, the un-rotation, so what comes out is the gradient
of the op's un-rotated inputs. The rotated q/k of the recomputation are O(S x D), like the
forward's inputs.

Where FlashAttention cannot take a call (float32, a head size that is not a multiple of 16 or
above 512, more than 256 query heads, or a used softmax_lse, whose gradient FlashAttentionScoreGrad
does not take) the unfused autodiff runs, announced with the reason. Rows that see no key (a TND
sequence with more queries than keys; the contract refuses q_len > kv_len elsewhere) are data, not
known when the graph is built: how FlashAttentionScoreGrad treats them waits for hardware.
"""
from __future__ import annotations

import os

import mindspore as ms
import numpy as np
from mindspore import Tensor, ops

from .gradients import ZEROS_LIKE, announce_backward_fallback, no_grad, unfused_autodiff_bprop
from .unfused import from_bnsd, rope_at, segments, to_bnsd

SWITCH = "RFA_ASCEND_BACKWARD"
# Why the op is not on its own backward kernel: the reason every announced stand-in starts with.
NOT_KERNEL = f"the fused backward kernel has not run on hardware ({SWITCH}=kernel to use it)"
BACKWARDS = ("flash_attention_score", "unfused", "kernel")  # the first is the default
FLASH_DTYPES = (ms.float16, ms.bfloat16)
# sparse_mode 3 (rightDownCausal): causal with the diagonal at the bottom right, as the op's
# causal rule (query i sits at kv_len - q_len + i), per sequence in TND; it takes CANN's
# compressed 2048 x 2048 mask, True above the diagonal.
_RIGHT_DOWN_CAUSAL = 3
_CAUSAL_MASK = Tensor(np.triu(np.ones((2048, 2048), np.bool_), 1))


def chosen_backward() -> str:
    """The backward the switch asks for on Ascend."""
    value = os.environ.get(SWITCH, BACKWARDS[0])
    if value not in BACKWARDS:
        raise ValueError(f"{SWITCH}: expected one of {list(BACKWARDS)}, got {value!r}")
    return value


def rotary_flash_attention_score(query, key, value, cos, sin, actual_seq_qlen, actual_seq_kvlen, *, head_num,
                                 kv_head_num, head_dim, input_layout, rotary_mode, rotary_dim, scale, causal,
                                 key_rotated, flash_attention=None):
    """(attention_out, rotated_key) of the op's contract from standalone RoPE (float32, at the op's
    positions) and ``flash_attention`` (default ``ops.flash_attention_score``) on the rotated q/k
    in the inputs' own layout and dtype."""
    flash_attention = flash_attention or ops.flash_attention_score
    layout = input_layout
    q = to_bnsd(query.astype(ms.float32), layout, head_num, head_dim)
    k = to_bnsd(key.astype(ms.float32), layout, kv_head_num, head_dim)
    cos, sin = cos.astype(ms.float32), sin.astype(ms.float32)
    if layout == "TND":
        q_seg, q_local, q_lens = segments(actual_seq_qlen.astype(ms.int64), q.shape[2])
        _, k_pos, kv_lens = segments(actual_seq_kvlen.astype(ms.int64), k.shape[2])
        q_pos = q_local + kv_lens[q_seg] - q_lens[q_seg]
    else:
        q_pos = ops.arange(0, q.shape[2], dtype=ms.int64) + (k.shape[2] - q.shape[2])
        k_pos = ops.arange(0, k.shape[2], dtype=ms.int64)
    rotated_query = from_bnsd(rope_at(q, cos, sin, q_pos, rotary_mode, rotary_dim), layout).astype(query.dtype)
    rotated_key = key if key_rotated else from_bnsd(rope_at(k, cos, sin, k_pos, rotary_mode, rotary_dim),
                                                     layout).astype(key.dtype)
    out = flash_attention(rotated_query, rotated_key, value, head_num,
                          attn_mask=_CAUSAL_MASK if causal else None,
                          actual_seq_qlen=actual_seq_qlen, actual_seq_kvlen=actual_seq_kvlen,
                          scalar_value=float(scale), input_layout=layout,
                          sparse_mode=_RIGHT_DOWN_CAUSAL if causal else 0)
    return out, rotated_key


@ops.constexpr
def flash_attention_refusal(dtype, query_shape, input_layout, head_num, lse_used) -> str:
    """Why ``ops.flash_attention_score`` cannot take this call's gradient ("" when it can)."""
    if dtype not in FLASH_DTYPES:
        return f"{str(dtype).lower()} inputs (MindSpore's FlashAttention takes float16 and bfloat16 only)"
    if lse_used:
        return "the softmax_lse output is used (FlashAttentionScoreGrad takes no gradient of it)"
    if input_layout == "BSH":
        heads, head_dim = head_num, query_shape[2] // head_num
    elif input_layout == "TND":
        heads, head_dim = query_shape[1], query_shape[2]
    else:
        heads, head_dim = query_shape[1 if input_layout == "BNSD" else 2], query_shape[3]
    if head_dim % 16 or head_dim > 512:
        return f"head size {head_dim} (MindSpore's FlashAttention takes multiples of 16 up to 512)"
    if heads > 256:
        return f"{heads} query heads (MindSpore's FlashAttention takes at most 256)"
    return ""


def flash_attention_bprop(flash_forward, unfused_forward, grads_used: tuple[bool, bool], input_layout: str,
                          head_num, strict: bool):
    """The bprop of the fused Ascend forward: the vector-Jacobian product of ``flash_forward``
    (``(query, key, value, cos, sin, actual_seq_qlen, actual_seq_kvlen) -> (attention_out,
    rotated_key)``), or of ``unfused_forward`` where FlashAttention refuses the call. Both announced."""
    lse_used, rotated_key_used = grads_used
    vjp = ops.GradOperation(get_all=True, sens_param=True)(flash_forward)
    unfused = unfused_autodiff_bprop(unfused_forward, lse_used, None, strict)

    def bprop(query, key, value, cos, sin, actual_seq_qlen, actual_seq_kvlen, out, dout):
        refusal = flash_attention_refusal(query.dtype, query.shape, input_layout, head_num, lse_used)
        if refusal:
            announce_backward_fallback(f"{NOT_KERNEL}, and {refusal}", strict,
                                       "the unfused autodiff (S x S scores per head)")
            return unfused(query, key, value, cos, sin, actual_seq_qlen, actual_seq_kvlen, out, dout)
        announce_backward_fallback(NOT_KERNEL, strict,
                                   "MindSpore's FlashAttention backward on the rotated q/k")
        d_rotated_key = dout[2] if rotated_key_used else ZEROS_LIKE(key)
        d_query, d_key, d_value = vjp(query, key, value, cos, sin, actual_seq_qlen, actual_seq_kvlen,
                                      (dout[0], d_rotated_key))[:3]
        return (d_query, d_key, d_value, ZEROS_LIKE(cos), ZEROS_LIKE(sin), no_grad(actual_seq_qlen),
                no_grad(actual_seq_kvlen))

    return bprop
