"""The paged KV cache's two ops on the CPU, as aot ``Custom`` primitives of the attention library:

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
both are inference ops (no gradient). On Ascend the same cache is read by MindSpore's own
``PagedAttention`` (the contracts' ``ascend`` rule); these primitives are CPU-only.
"""
from __future__ import annotations

import functools

import mindspore as ms

from .cpu_kernel import GraphLaunchedCustom, library, select_library
from .op_info import CACHE_WRITE_PATH, PAGED_ATTENTION_PATH, attr_values, build_reg_info, load_contract

PAGED_SYMBOL = "RotaryPagedAttention"
WRITE_SYMBOL = "RotaryCacheWrite"


def paged_contract():
    return load_contract(str(PAGED_ATTENTION_PATH))


def write_contract():
    return load_contract(str(CACHE_WRITE_PATH))


def _require_cpu(what: str) -> None:
    target = ms.get_context("device_target")
    if target != "CPU":
        raise RuntimeError(f"{what}: a CPU kernel; on {target} use MindSpore's PagedAttention / ReshapeAndCache over "
                           "the same cache (docs/serving.md)")


@ms.ops.constexpr(reuse_result=False)
def _graph_primitive(symbol: str, items: tuple) -> GraphLaunchedCustom:
    """``_primitive`` as a graph constant: the functions below are called inside ``construct`` too."""
    return _primitive(symbol, items)


@functools.lru_cache(maxsize=None)
def _primitive(symbol: str, items: tuple) -> GraphLaunchedCustom:
    contract = paged_contract() if symbol == PAGED_SYMBOL else write_contract()
    _require_cpu(contract.op_name)
    values = attr_values(contract, dict(items))
    _, path = select_library()
    library()  # refuse a library of another ABI here, not inside MindSpore
    op = GraphLaunchedCustom(f"{path}:{symbol}", out_shape=None, out_dtype=None, func_type="aot",
                             reg_info=build_reg_info("CPU", values, any_dtype=True, contract=contract))
    if symbol == WRITE_SYMBOL:
        op.add_prim_attr("side_effect_mem", True)  # it writes its cache inputs: keep it ordered, never pruned
    return op


def paged_attention_op(**attrs) -> GraphLaunchedCustom:
    """The primitive ``(query, key_cache, value_cache, cos, sin, block_tables, context_lens,
    q_seq_lens) -> (attention_out, softmax_lse)`` for these attributes (the contract's names and
    defaults), one per attribute set."""
    return _graph_primitive(PAGED_SYMBOL, tuple(sorted(attrs.items())))


def cache_write_op(**attrs) -> GraphLaunchedCustom:
    """The primitive ``(key, value, cos, sin, positions, slot_mapping, key_cache, value_cache) ->
    written`` for these attributes, one per attribute set. It writes the two caches in place."""
    return _graph_primitive(WRITE_SYMBOL, tuple(sorted(attrs.items())))


def rotary_paged_attention(query, key_cache, value_cache, cos, sin, block_tables, context_lens, q_seq_lens, *,
                           head_num=0, rotary_mode=0, rotary_dim=0, scale=0.0, key_rotated=True,
                           return_softmax_lse=False):
    """Attention of ``query`` (tokens, N, D) -- ``q_seq_lens[b]`` tokens of sequence b, at positions
    ``context_lens[b] - q_seq_lens[b] + i`` -- over the paged cache, causal; the query rotated at its
    positions, the cached keys used as they are (``key_rotated=False``: rotated as they are read).
    ``block_tables`` (B, max_blocks), ``context_lens`` and ``q_seq_lens`` (B,) are int32. Returns
    attention_out (tokens, N, D), and softmax_lse (tokens, N) with ``return_softmax_lse``."""
    op = paged_attention_op(head_num=head_num, rotary_mode=rotary_mode, rotary_dim=rotary_dim, scale=float(scale),
                            key_rotated=key_rotated, with_softmax_lse=return_softmax_lse)
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


def paged_calls() -> int:
    """Calls of RotaryPagedAttention in this process so far (the kernel's own count)."""
    return library().RotaryPagedAttentionCalls()


def rotated_keys() -> int:
    """Key heads RotaryCacheWrite rotated in this process so far (each new key once per KV head)."""
    return library().RotaryCacheWriteRotatedKeys()
