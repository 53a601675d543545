"""The unfused path: standalone RoPE, then attention, from plain MindSpore ops.

It runs wherever MindSpore runs (GRAPH_MODE with dynamic shapes, and PyNative), is what the
dispatcher falls back to when no fused kernel applies, and is the baseline of every benchmark.
It materialises rotated Q/K and the full score matrix: exactly the memory traffic the fused
kernel avoids.  Computation is float32 whatever the input dtype.
"""
from __future__ import annotations

from mindspore import ops
import mindspore as ms

from .rope import apply_rope  # it lived here until rope.py took it: still importable from here

_NEG = -1e30  # finite "minus infinity" for masked scores, so no row becomes NaN
_BMM = ops.BatchMatMul()
_BMM_TRANSPOSED = ops.BatchMatMul(transpose_b=True)


def to_bnsd(x, layout, heads, head_dim):
    """(B, N, S, D) view of one input; TND becomes a single batch of T tokens."""
    if layout == "BNSD":
        return x
    if layout == "BSND":
        return x.transpose(0, 2, 1, 3)
    if layout == "BSH":
        return x.reshape(x.shape[0], x.shape[1], heads, head_dim).transpose(0, 2, 1, 3)
    return x.transpose(1, 0, 2).expand_dims(0)


def from_bnsd(x, layout):
    if layout == "BNSD":
        return x
    if layout == "BSND":
        return x.transpose(0, 2, 1, 3)
    if layout == "BSH":
        x = x.transpose(0, 2, 1, 3)
        return x.reshape(x.shape[0], x.shape[1], -1)
    return x.squeeze(0).transpose(1, 0, 2)


def segments(ends, total):
    """Per-token sequence id, and start offset of each token's sequence, from cumulative ends."""
    tokens = ops.arange(0, total, dtype=ms.int64)
    seg = (tokens.expand_dims(1) >= ends.expand_dims(0)).astype(ms.int64).sum(1)
    starts = ops.concat([ops.zeros((1,), ms.int64), ends[:-1]])
    return seg, tokens - starts[seg], ends - starts


def _visible_count(q_pos, q_seq_len, causal):
    """Each query row sees one contiguous run of keys, ``[first, first + count)`` in key index space,
    from its sequence's first key: (Sq,) int64 ``count``, its sequence's keys causally cut at its position."""
    return ops.minimum(ops.maximum(q_pos + 1, 0), q_seq_len) if causal else q_seq_len


def _mask(first, count, kv_len):
    """(Sq, Skv) bool: True where the key is hidden from the row."""
    k_index = ops.arange(0, kv_len, dtype=ms.int64).expand_dims(0)
    return ops.logical_or(k_index < first.expand_dims(1), k_index >= (first + count).expand_dims(1))


def _non_finite_keys(x):
    """(B, N, Skv, 1) bool: keys whose row of x (B, N, Skv, D) holds a NaN or Inf."""
    return ops.logical_not(ops.isfinite(x).all(axis=-1, keep_dims=True))


def _rows_seeing(flagged, first, count):
    """(B, N, Sq, 1) bool: whether a row's visible keys include a flagged one, from prefix counts over
    the keys (O(S) per head, no (Sq, Skv) work)."""
    prefix = ops.cumsum(flagged.astype(ms.float32), axis=2)
    prefix = ops.concat([ops.zeros_like(prefix[:, :, :1]), prefix], axis=2)  # flagged keys before each index
    return (ops.gather(prefix, first + count, 2) - ops.gather(prefix, first, 2)) > 0


def rope_at(x, cos, sin, positions, rotary_mode, rotary_dim):
    """x (B, N, S, D) float32, rotated at ``positions`` (S,)."""
    return apply_rope(x, ops.gather(cos, positions, 0), ops.gather(sin, positions, 0), rotary_mode, rotary_dim)


def unfused_rotary_flash_attention(query, key, value, cos, sin, actual_seq_qlen=None, actual_seq_kvlen=None, *,
                                   head_num, kv_head_num, head_dim, input_layout, rotary_mode, rotary_dim, scale,
                                   causal, with_softmax_lse, with_rotated_key, key_rotated=False):
    """(attention_out, softmax_lse, rotated_key) exactly as the fused op's contract.

    Geometry arguments (``head_num``, ``kv_head_num``, ``head_dim``, ``rotary_dim``, ``scale``) are
    already resolved by ``checks.check_inputs``; disabled outputs are empty (shape (0,)).
    ``key_rotated``: key already carries RoPE (a rotated KV cache) and is used as given.
    """
    layout = input_layout
    out_dtype = query.dtype
    cos = cos.astype(ms.float32)
    sin = sin.astype(ms.float32)
    q = to_bnsd(query.astype(ms.float32), layout, head_num, head_dim)
    k = to_bnsd(key.astype(ms.float32), layout, kv_head_num, head_dim)
    v = to_bnsd(value.astype(ms.float32), layout, kv_head_num, head_dim)
    q_len = q.shape[2]
    kv_len = k.shape[2]
    if layout == "TND":
        kv_ends = actual_seq_kvlen.astype(ms.int64)
        q_seg, q_local, q_lens = segments(actual_seq_qlen.astype(ms.int64), q_len)
        _, k_pos, kv_lens = segments(kv_ends, kv_len)
        row_kv_len = kv_lens[q_seg]
        q_pos = q_local + row_kv_len - q_lens[q_seg]
        first, count = (kv_ends - kv_lens)[q_seg], _visible_count(q_pos, row_kv_len, causal)
    else:
        q_pos = ops.arange(0, q_len, dtype=ms.int64) + (kv_len - q_len)
        k_pos = ops.arange(0, kv_len, dtype=ms.int64)
        first, count = ops.zeros_like(q_pos), _visible_count(q_pos, ops.full_like(q_pos, kv_len), causal)
    if rotary_dim == head_dim:  # the softmax scale rides on Q's (S, D) tables: one pass over Q fewer
        qr = rope_at(q, cos * scale, sin * scale, q_pos, rotary_mode, rotary_dim)
    else:
        qr = rope_at(q, cos, sin, q_pos, rotary_mode, rotary_dim) * scale
    kr = k if key_rotated else rope_at(k, cos, sin, k_pos, rotary_mode, rotary_dim)
    # A hidden key must not reach a row even holding NaN/Inf (a preallocated cache's garbage), but
    # 0 x NaN in the matmuls would carry it there. So the matmuls get K/V with non-finite values
    # zeroed, and the rows that do see one get NaN, found from prefix counts over the keys.
    # Per key, not per value: one pass over K and V each to flag, one to clean (a where: nan_to_num
    # took 5x longer on MindSpore's CPU backend).
    key_poison = _rows_seeing(_non_finite_keys(kr), first, count)      # (B, Nkv, Sq, 1)
    value_poison = _rows_seeing(_non_finite_keys(v), first, count)
    k_clean = ops.where(ops.isfinite(kr), kr, ops.zeros_like(kr))
    v_clean = ops.where(ops.isfinite(v), v, ops.zeros_like(v))
    group = head_num // kv_head_num
    batch = qr.shape[0]
    # GQA without copying K/V: the query heads of one KV head are stacked along the rows, (B, Nkv,
    # G*Sq, D), so both products are plain batched matmuls over (B, Nkv) (BatchMatMul does not
    # broadcast on the CPU) and K is read transposed in place (a swapaxes would copy it). Every
    # elementwise op on the scores is one more score-sized temporary, so: the scale went on Q, the
    # mask is a full-shape bool for masked_fill (MindSpore's CPU Select/Add broadcasting a (Sq, Skv)
    # mask over the heads took 3-4 score-sized buffers more), and one per-row factor on the output
    # zeroes rows that see no key and turns rows that see a non-finite one into NaN.
    rows = group * q_len
    scores = _BMM_TRANSPOSED(qr.reshape(batch, kv_head_num, rows, head_dim), k_clean)
    hidden = ops.tile(_mask(first, count, kv_len), (batch, kv_head_num, group, 1))  # (B, Nkv, G*Sq, Skv)
    scores = ops.masked_fill(scores, hidden, _NEG)
    key_poison_rows = ops.tile(key_poison, (1, 1, group, 1))             # (B, Nkv, G*Sq, 1)
    poison_rows = ops.logical_or(key_poison_rows, ops.tile(value_poison, (1, 1, group, 1)))
    row_sees_a_key = ops.tile((count > 0).astype(ms.float32).expand_dims(-1), (group, 1))
    row_factor = ops.where(poison_rows, ops.full_like(poison_rows, float("nan"), dtype=ms.float32), row_sees_a_key)
    attended = _BMM(ops.softmax(scores, axis=-1), v_clean) * row_factor
    out = from_bnsd(attended.reshape(batch, head_num, q_len, head_dim), layout).astype(out_dtype)
    if with_softmax_lse:
        lse = ops.logsumexp(scores, -1, keepdim=True)
        lse = ops.masked_fill(lse, ops.broadcast_to(row_sees_a_key == 0, lse.shape), -float("inf"))
        lse = ops.masked_fill(lse, key_poison_rows, float("nan"))
        lse = lse.reshape(batch, head_num, q_len)
        lse = lse.squeeze(0).transpose(1, 0) if layout == "TND" else lse
    else:
        lse = ops.zeros((0,), ms.float32)
    rotated_key = from_bnsd(kr, layout).astype(key.dtype) if with_rotated_key else ops.zeros((0,), key.dtype)
    return out, lse, rotated_key
