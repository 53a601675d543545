"""The numerics of ring context parallelism, on one process: what each rank of a ring computes.

In a ring (MindSpeed's, Megatron's with send/recv) no rank holds the whole K/V: K/V blocks travel
from rank to rank, and each rank attends its queries to one block at a time and merges the partial
results by their log-sum-exp. With this op a block's keys are rotated once, by the rank that owns
them, in the causal call of its own block (``return_rotated_key``), and travel rotated; every other
block is a non-causal call with ``key_rotated=True`` and the query's table rows sliced at its block's
start, so queries stay at their positions in the whole sequence.

This is the Ascend plan (HCCL send/recv, communication overlapped with the per-block calls); the
CPU's collectives have no send/recv, so ``ContextParallelRotaryAttention`` gathers K/V instead.
``ring_attention_blocks`` runs the ring's per-block calls on one process so that their numerics
are checked here against the one-call op (tests/test_context_parallel.py).
"""
from __future__ import annotations

from mindspore import ops

from ..functional import rotary_flash_attention


def merge_by_lse(out_a, lse_a, out_b, lse_b):
    """Attention over two disjoint key sets, from each one's output (B, S, N, D) and natural-log
    log-sum-exp (B, N, S): the outputs weighted by their share of the softmax mass, and the joint
    lse. A row that saw no key in either (lse -inf in both) stays 0 with lse -inf."""
    top = ops.maximum(lse_a, lse_b)
    shift = ops.where(ops.isinf(top), ops.zeros_like(top), top)
    wa, wb = ops.exp(lse_a - shift), ops.exp(lse_b - shift)
    mass = wa + wb
    lse = shift + ops.log(mass)
    safe = ops.where(mass > 0, mass, ops.ones_like(mass))
    wa, wb = (w / safe for w in (wa, wb))
    out = out_a * wa.transpose(0, 2, 1).expand_dims(-1) + out_b * wb.transpose(0, 2, 1).expand_dims(-1)
    return out.astype(out_a.dtype), lse


def ring_attention_blocks(query, key, value, cos, sin, blocks: int, head_num=None, *, rotary_mode=0, rotary_dim=None,
                          scale=None):
    """Causal RoPE attention (BSND) computed as a ring of ``blocks`` ranks would: block i's queries
    against block i (causal, rotating its keys once) and each earlier block's rotated keys
    (non-causal), merged by log-sum-exp. Returns (out (B, S, N, D), lse (B, N, S))."""
    length = query.shape[1]
    if length % blocks:
        raise ValueError(f"sequence length {length}: expected a multiple of blocks = {blocks}")
    c = length // blocks
    kwargs = dict(input_layout="BSND", rotary_mode=rotary_mode, rotary_dim=rotary_dim, scale=scale,
                  return_softmax_lse=True)
    rotated, outs, lses = [], [], []
    for i in range(blocks):
        rows = slice(i * c, (i + 1) * c)
        q, tables = query[:, rows], (cos[i * c:], sin[i * c:])
        out, lse, rotated_key = rotary_flash_attention(q, key[:, rows], value[:, rows], *tables, head_num,
                                                       return_rotated_key=True, **kwargs)
        for j in range(i):  # the blocks that came round the ring before this one's own
            part, part_lse = rotary_flash_attention(q, rotated[j], value[:, j * c:(j + 1) * c], *tables, head_num,
                                                    causal=False, key_rotated=True, **kwargs)
            out, lse = merge_by_lse(out, lse, part, part_lse)
        rotated.append(rotated_key)
        outs.append(out)
        lses.append(lse)
    return ops.cat(outs, 1), ops.cat(lses, 2)
