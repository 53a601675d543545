"""Independent float64 numpy reference of rotary_flash_attention, written the plainest way.

Per sequence: rotate q and k with the tables at their absolute positions, then
softmax(q k^T * scale + mask) v.  No tiling, no online softmax, no shared code with the package.
"""
from __future__ import annotations

import numpy as np


def rope_tables(rotary_dim, max_positions, theta=10000.0, mode=0):
    """cos/sin tables (max_positions, rotary_dim) in float64, laid out for ``mode``."""
    inv_freq = 1.0 / theta ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)
    angles = np.outer(np.arange(max_positions, dtype=np.float64), inv_freq)
    if mode == 0:
        angles = np.concatenate([angles, angles], axis=1)
    else:
        angles = np.repeat(angles, 2, axis=1)
    return np.cos(angles), np.sin(angles)


def rotate(x, cos, sin, positions, mode, rotary_dim):
    """x (S, N, D) rotated on its first rotary_dim features: x*cos + rot(x)*sin."""
    x = x.astype(np.float64)
    rd = rotary_dim
    part = x[..., :rd]
    if mode == 0:
        half = rd // 2
        rot = np.concatenate([-part[..., half:], part[..., :half]], axis=-1)
    else:
        rot = np.empty_like(part)
        rot[..., 0::2] = -part[..., 1::2]
        rot[..., 1::2] = part[..., 0::2]
    c = np.asarray(cos, np.float64)[positions][:, None, :]
    s = np.asarray(sin, np.float64)[positions][:, None, :]
    return np.concatenate([part * c + rot * s, x[..., rd:]], axis=-1)


def attention_one_sequence(q, k, v, cos, sin, mode, rotary_dim, scale, causal, key_rotated=False):
    """q (Sq, N, D), k/v (Skv, Nkv, D) -> out (Sq, N, D), lse (Sq, N), rotated k (Skv, Nkv, D).

    ``key_rotated``: k already carries RoPE and is used as given."""
    sq, n, d = q.shape
    skv, nkv, _ = k.shape
    if skv == 0:  # an empty sequence (then q_len is 0 too)
        return np.zeros(q.shape), np.full((sq, n), -np.inf), np.zeros(k.shape)
    qr = rotate(q, cos, sin, np.arange(skv - sq, skv), mode, rotary_dim)
    kr = k.astype(np.float64) if key_rotated else rotate(k, cos, sin, np.arange(skv), mode, rotary_dim)
    group = n // nkv
    out = np.zeros((sq, n, d))
    lse = np.full((sq, n), -np.inf)
    q_pos = np.arange(skv - sq, skv)[:, None]
    allowed = (np.arange(skv)[None, :] <= q_pos) if causal else np.ones((sq, skv), bool)
    sees_a_key = allowed.any(axis=1)
    for h in range(n):
        scores = qr[:, h, :] @ kr[:, h // group, :].T * scale
        scores = np.where(allowed, scores, -np.inf)
        rows = np.nonzero(sees_a_key)[0]
        m = scores[rows].max(axis=1, keepdims=True)
        p = np.exp(scores[rows] - m)
        out[rows, h] = p @ v[:, h // group, :].astype(np.float64) / p.sum(axis=1, keepdims=True)
        lse[rows, h] = m[:, 0] + np.log(p.sum(axis=1))
    return out, lse, kr


def rotate_transposed(dy, cos, sin, positions, mode, rotary_dim):
    """The transpose of ``rotate`` applied to a gradient dy (S, N, D): written out from the
    Jacobian of y = x*cos + rot(x)*sin, independently of the kernel's formula."""
    dy = dy.astype(np.float64)
    rd = rotary_dim
    c = np.asarray(cos, np.float64)[positions][:, None, :]
    s = np.asarray(sin, np.float64)[positions][:, None, :]
    g = dy[..., :rd]
    dx = g * c  # d y_i / d x_i = cos_i
    if mode == 0:  # y_i = x_i c_i - x_{i+h} s_i;  y_{i+h} = x_{i+h} c_{i+h} + x_i s_{i+h}
        half = rd // 2
        dx[..., :half] += g[..., half:] * s[..., half:]
        dx[..., half:] -= g[..., :half] * s[..., :half]
    else:  # y_2i = x_2i c_2i - x_2i+1 s_2i;  y_2i+1 = x_2i+1 c_2i+1 + x_2i s_2i+1
        dx[..., 0::2] += g[..., 1::2] * s[..., 1::2]
        dx[..., 1::2] -= g[..., 0::2] * s[..., 0::2]
    return np.concatenate([dx, dy[..., rd:]], axis=-1)


def grad_one_sequence(q, k, v, cos, sin, mode, rotary_dim, scale, causal, d_out, d_lse, d_rk, key_rotated=False):
    """Analytic float64 gradients of attention_one_sequence: (dq (Sq,N,D), dk, dv (Skv,Nkv,D)) for
    the upstream gradients d_out (Sq,N,D), d_lse (Sq,N) or None, d_rk (Skv,Nkv,D) or None."""
    sq, n, d = q.shape
    skv, nkv, _ = k.shape
    if skv == 0:  # then q_len is 0 too: nothing to differentiate
        return np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    q_positions = np.arange(skv - sq, skv)
    qr = rotate(q, cos, sin, q_positions, mode, rotary_dim)
    kr = k.astype(np.float64) if key_rotated else rotate(k, cos, sin, np.arange(skv), mode, rotary_dim)
    v = v.astype(np.float64)
    group = n // nkv
    allowed = (np.arange(skv)[None, :] <= q_positions[:, None]) if causal else np.ones((sq, skv), bool)
    dqr = np.zeros((sq, n, d))
    dkr = np.zeros((skv, nkv, d)) if d_rk is None else np.array(d_rk, np.float64)
    dv = np.zeros((skv, nkv, d))
    for h in range(n):
        g = h // group
        scores = np.where(allowed, qr[:, h] @ kr[:, g].T * scale, -np.inf)
        m = scores.max(axis=1, keepdims=True)
        m = np.where(np.isfinite(m), m, 0.0)
        e = np.where(allowed, np.exp(scores - m), 0.0)
        total = e.sum(axis=1, keepdims=True)
        p = np.divide(e, total, out=np.zeros_like(e), where=total > 0)
        out = p @ v[:, g]
        dp = d_out[:, h] @ v[:, g].T
        # lse = log sum exp(scores): d lse / d score = p, so d_lse joins dP's row correction.
        row = (d_out[:, h] * out).sum(axis=1, keepdims=True)
        if d_lse is not None:
            row = row - d_lse[:, h][:, None]
        ds = p * (dp - row)
        dv[:, g] += p.T @ d_out[:, h]
        dqr[:, h] = scale * ds @ kr[:, g]
        dkr[:, g] += scale * ds.T @ qr[:, h]
    dq = rotate_transposed(dqr, cos, sin, q_positions, mode, rotary_dim)
    dk = dkr if key_rotated else rotate_transposed(dkr, cos, sin, np.arange(skv), mode, rotary_dim)
    return dq, dk, dv


def to_snd(x, layout, head_num=None):
    """One batch-major tensor as a list of (S, N, D) sequences (TND handled by the caller)."""
    x = np.asarray(x)
    if layout == "BNSD":
        return [x[b].transpose(1, 0, 2) for b in range(x.shape[0])]
    if layout == "BSND":
        return [x[b] for b in range(x.shape[0])]
    if layout == "BSH":
        return [x[b].reshape(x.shape[1], head_num, -1) for b in range(x.shape[0])]
    raise ValueError(layout)


def from_snd(seqs, layout):
    stacked = np.stack(seqs)
    if layout == "BNSD":
        return stacked.transpose(0, 2, 1, 3)
    if layout == "BSND":
        return stacked
    if layout == "BSH":
        return stacked.reshape(stacked.shape[0], stacked.shape[1], -1)
    raise ValueError(layout)


def reference(q, k, v, cos, sin, head_num=None, input_layout="BNSD", rotary_mode=0, rotary_dim=None,
              scale=None, causal=True, actual_seq_qlen=None, actual_seq_kvlen=None, key_rotated=False):
    """(out, lse, rotated_key) in float64; lse is (B, N, Sq) or (Tq, N) for TND."""
    q, k, v = (np.asarray(t, np.float64) for t in (q, k, v))
    if input_layout == "TND":
        head_dim = q.shape[-1]
    elif input_layout == "BSH":
        head_dim = q.shape[-1] // head_num
    else:
        head_dim = q.shape[-1]
    rd = rotary_dim or head_dim
    scale = scale if scale is not None else 1.0 / np.sqrt(head_dim)
    args = (cos, sin, rotary_mode, rd, scale, causal, key_rotated)
    if input_layout == "TND":
        out = np.zeros(q.shape)
        lse = np.full(q.shape[:2], -np.inf)
        kr = np.zeros(k.shape)
        q_start = kv_start = 0
        for q_end, kv_end in zip(actual_seq_qlen, actual_seq_kvlen):
            o, l, r = attention_one_sequence(q[q_start:q_end], k[kv_start:kv_end], v[kv_start:kv_end], *args)
            out[q_start:q_end], lse[q_start:q_end], kr[kv_start:kv_end] = o, l, r
            q_start, kv_start = q_end, kv_end
        return out, lse, kr
    kv_heads = None if input_layout != "BSH" else k.shape[-1] // head_dim
    results = [attention_one_sequence(qs, ks, vs, *args) for qs, ks, vs in
               zip(to_snd(q, input_layout, head_num), to_snd(k, input_layout, kv_heads), to_snd(v, input_layout, kv_heads))]
    out = from_snd([r[0] for r in results], input_layout)
    lse = np.stack([r[1].T for r in results])
    kr = from_snd([r[2] for r in results], input_layout)
    return out, lse, kr


def reference_grad(q, k, v, cos, sin, d_out, d_lse=None, d_rk=None, head_num=None, input_layout="BNSD",
                   rotary_mode=0, rotary_dim=None, scale=None, causal=True, actual_seq_qlen=None,
                   actual_seq_kvlen=None, key_rotated=False):
    """(dq, dk, dv) in float64, in the inputs' layout: gradients of sum(out * d_out) + sum(lse * d_lse)
    + sum(rotated_key * d_rk) w.r.t. the un-rotated query, key and value."""
    q, k, v, d_out = (np.asarray(t, np.float64) for t in (q, k, v, d_out))
    head_dim = q.shape[-1] // head_num if input_layout == "BSH" else q.shape[-1]
    rd = rotary_dim or head_dim
    scale = scale if scale is not None else 1.0 / np.sqrt(head_dim)
    args = (cos, sin, rotary_mode, rd, scale, causal)
    if input_layout == "TND":
        dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
        q_start = kv_start = 0
        for q_end, kv_end in zip(actual_seq_qlen, actual_seq_kvlen):
            qs, ks = slice(q_start, q_end), slice(kv_start, kv_end)
            dq[qs], dk[ks], dv[ks] = grad_one_sequence(
                q[qs], k[ks], v[ks], *args, d_out[qs], None if d_lse is None else d_lse[qs],
                None if d_rk is None else d_rk[ks], key_rotated)
            q_start, kv_start = q_end, kv_end
        return dq, dk, dv
    kv_heads = None if input_layout != "BSH" else k.shape[-1] // head_dim
    seqs = zip(to_snd(q, input_layout, head_num), to_snd(k, input_layout, kv_heads), to_snd(v, input_layout, kv_heads),
               to_snd(d_out, input_layout, head_num))
    results = []
    for b, (qs, ks, vs, dos) in enumerate(seqs):
        dl = None if d_lse is None else np.asarray(d_lse, np.float64)[b].T  # (N, Sq) -> (Sq, N)
        drk = None if d_rk is None else to_snd(d_rk, input_layout, kv_heads)[b]
        results.append(grad_one_sequence(qs, ks, vs, *args, dos, dl, drk, key_rotated))
    return tuple(from_snd([r[i] for r in results], input_layout) for i in range(3))
