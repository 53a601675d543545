"""The float64 reference of compute_dtype='bfloat16', on the operands the kernel rounds.

The kernel rotates Q and K in float32 and rounds them once to bfloat16, rounds V, and rounds P to
bfloat16 before P V (docs/semantics.md, compute_dtype). Here: Q and K are rotated in float64 from
the inputs the kernel received, rotated Q/K and V are rounded to bfloat16 (round to nearest even),
and attention runs in float64 on them with P unrounded (``reference`` with identity tables). The
rounded P makes an exact reference impossible; ``tolerance`` bounds what it can change.
"""
import numpy as np

from ms_rope_attention.testing import cpu_direct
from reference import reference, rotate, to_snd, from_snd

P_ROUNDING = 2.0 ** -8  # bfloat16 round-to-nearest: relative error of each probability


def to_bf16(x):
    return cpu_direct.decode(cpu_direct.encode(x, "bfloat16"), "bfloat16")


def _rotated(x, cos, sin, mode, rotary_dim, layout, heads, lens_q, lens_kv, is_query):
    """x rotated in float64 at its positions (query i of a sequence at kv_len - q_len + i)."""
    if layout == "TND":
        out, start = np.empty(x.shape), 0
        for lq, lk in zip(lens_q, lens_kv):
            n = lq if is_query else lk
            positions = np.arange(lk - lq, lk) if is_query else np.arange(lk)
            out[start:start + n] = rotate(x[start:start + n], cos, sin, positions, mode, rotary_dim or x.shape[-1])
            start += n
        return out
    seqs = to_snd(x, layout, heads)
    lq, lk = lens_q[0], lens_kv[0]
    positions = np.arange(lk - lq, lk) if is_query else np.arange(lk)
    return from_snd([rotate(s, cos, sin, positions, mode, rotary_dim or s.shape[-1]) for s in seqs], layout)


def reference_bf16(q, k, v, cos, sin, aq=None, ak=None, *, head_num=None, input_layout="BNSD", rotary_mode=0,
                   rotary_dim=None, causal=True, key_rotated=False, scale=None):
    """(out, lse) in float64 on bfloat16-rounded rotated Q, K and V, P unrounded. ``q``, ``k``,
    ``v`` are what the kernel received (already rounded to the inputs' dtype)."""
    kv_heads = None
    if input_layout == "TND":
        lens_q, lens_kv = np.diff([0, *aq]), np.diff([0, *ak])
    else:
        axis = {"BNSD": 2, "BSND": 1, "BSH": 1}[input_layout]
        lens_q, lens_kv = [q.shape[axis]], [k.shape[axis]]
        if input_layout == "BSH":
            kv_heads = k.shape[2] // (q.shape[2] // head_num)
    qr = _rotated(q, cos, sin, rotary_mode, rotary_dim, input_layout, head_num, lens_q, lens_kv, True)
    kr = k if key_rotated else _rotated(k, cos, sin, rotary_mode, rotary_dim, input_layout, kv_heads, lens_q, lens_kv,
                                        False)
    identity = np.ones_like(cos), np.zeros_like(sin)  # the rotation is done: the reference's is exact with these
    out, lse, _ = reference(to_bf16(qr), to_bf16(kr), to_bf16(v), *identity, head_num, input_layout, rotary_mode,
                            rotary_dim, scale, causal, aq, ak, True)
    return out, lse


def tolerance(v, out_dtype, out_ref):
    """Bound on |kernel - reference_bf16| for attention_out: P rounded to bfloat16 moves each
    probability by at most 2^-8 of itself, so the output row sum_j p_j v_j / l by at most 2^-8 max|v|
    whatever the head dim and length; the output's own rounding to ``out_dtype`` adds one half-ulp
    of it; 2^-12 covers float32 accumulation and a rotated element whose float32 and float64
    rotations round to neighbouring bfloat16 values (rare, one ulp of one term of a score)."""
    out_eps = {"float32": 0.0, "float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}[out_dtype]
    return P_ROUNDING * np.abs(v).max(initial=0) + out_eps * np.abs(out_ref).max(initial=0) + 2.0 ** -12
