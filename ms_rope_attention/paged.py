"""The paged KV cache's two ops, called eagerly or inside a graph (their kernels: ``paged_kernel``):

- ``rotary_paged_attention``: a few query tokens per sequence (1..16) against a (num_blocks,
  block_size, Nkv, D) cache of rotated keys, read in place through each sequence's block table
  (the decode path's split-KV + log-sum-exp kernel; no gather into a contiguous copy);
- ``rotary_cache_write``: the new keys rotated once, each at its own position, and written with the
  values into the cache rows a slot mapping names (-1: skipped), in place: MindSpore's
  ``ReshapeAndCache`` with the RoPE in the same pass.

Why: a server's sequences have mixed lengths, and a cache paged in blocks holds them without
reserving each one's longest length (vLLM's reason for paging); MindFormers' serving path stores
its cache this way, and MindSpore 2.10's ``PagedAttention`` / ``ReshapeAndCache`` have no CPU
kernel. Contracts: ``op_info/rotary_paged_attention.yaml`` and ``op_info/rotary_cache_write.yaml``;
both are inference ops (no gradient). The primitives come from ``dispatch`` (the CPU's are
``paged_kernel``'s); on Ascend the same cache is read by MindSpore's own ``PagedAttention`` (the
contracts' ``ascend`` rule, which the dispatch's refusal quotes).
"""
from __future__ import annotations

from mindspore import ops

from . import dispatch
from .attrs import check_attention_compute_dtype
from .paged_kernel import paged_calls, rotated_keys  # noqa: F401  (the engine's tests read the kernel's counts here)


@ops.constexpr(reuse_result=False)
def _primitive(op_name: str, items: tuple):
    """``dispatch.paged_primitive`` as a graph constant: the functions below are called inside
    ``construct`` too."""
    return dispatch.paged_primitive(op_name, items)


def paged_attention_op(**attrs):
    """The primitive ``(query, key_cache, value_cache, cos, sin, block_tables, context_lens,
    q_seq_lens) -> (attention_out, softmax_lse)`` for these attributes (the contract's names and
    defaults), one per attribute set."""
    return _primitive("RotaryPagedAttention", tuple(sorted(attrs.items())))


def cache_write_op(**attrs):
    """The primitive ``(key, value, cos, sin, positions, slot_mapping, key_cache, value_cache) ->
    written`` for these attributes, one per attribute set. It writes the two caches in place."""
    return _primitive("RotaryCacheWrite", tuple(sorted(attrs.items())))


def rotary_paged_attention(query, key_cache, value_cache, cos, sin, block_tables, context_lens, q_seq_lens, *,
                           head_num=0, rotary_mode=0, rotary_dim=0, scale=0.0, key_rotated=True,
                           return_softmax_lse=False, compute_dtype="auto"):
    """Attention of ``query`` (tokens, N, D) -- ``q_seq_lens[b]`` tokens of sequence b, at positions
    ``context_lens[b] - q_seq_lens[b] + i`` -- over the paged cache, causal; the query rotated at its
    positions, the cached keys used as they are (``key_rotated=False``: rotated as they are read).
    ``block_tables`` (B, max_blocks), ``context_lens`` and ``q_seq_lens`` (B,) are int32. Returns
    attention_out (tokens, N, D), and softmax_lse (tokens, N) with ``return_softmax_lse``.
    ``compute_dtype``: the arithmetic of Q·Kᵀ and P·V, as ``rotary_flash_attention``'s."""
    op = paged_attention_op(head_num=head_num, rotary_mode=rotary_mode, rotary_dim=rotary_dim, scale=float(scale),
                            key_rotated=key_rotated, with_softmax_lse=return_softmax_lse,
                            compute_dtype=check_attention_compute_dtype(compute_dtype))
    out, lse = op(query, key_cache, value_cache, cos, sin, block_tables, context_lens, q_seq_lens)
    return (out, lse) if return_softmax_lse else out


def rotary_cache_write(key, value, cos, sin, positions, slot_mapping, key_cache, value_cache, *, rotary_mode=0,
                       rotary_dim=0, key_rotated=False):
    """Write ``key`` rotated at ``positions`` (each key once; as it is with ``key_rotated``) and
    ``value`` (tokens, Nkv, D) into ``key_cache`` / ``value_cache`` (Parameters, in place) at
    ``slot_mapping`` (int32 rows block * block_size + offset, -1 skipped). Returns the count of
    tokens written, a (1,) int32 tensor: pass the caches through ``ops.depend(cache, written)``
    where a read must follow the write."""
    op = cache_write_op(rotary_mode=rotary_mode, rotary_dim=rotary_dim, key_rotated=key_rotated)
    return op(key, value, cos, sin, positions, slot_mapping, key_cache, value_cache)

