"""The KV cache of generation: preallocated per layer, written in place, read by the fused op.

Each layer has a rotated-key and a value Parameter of shape (slots * capacity + scratch, Nkv, D):
slot s owns rows [s * capacity, (s + 1) * capacity), filled from its start; the last ``scratch``
rows are where the padding tokens of a decode step (``KVCache.padded_tokens``) write. A step
writes only its new rows (``ScatterUpdate`` into the Parameter: no concatenation, no copy of the
cache, no cache in the graph's inputs or outputs) and the op reads each slot's filled rows in
place: the call is one TND problem in which every slot is two sequences, its filled rows (with the
step's queries, or none) then a query-less gap over its unused rows, which the kernel never
reads; the scratch rows end it the same way, a gap then the padding queries over the rows they
wrote.

Shapes are static per capacity: the generator compiles its graphs once per capacity bucket (the
decode graph once per padded token count too), and only ever grows the cache. ``Slots`` is the
host-side bookkeeping (which slot holds how many tokens) that continuous batching needs.
"""
from __future__ import annotations

import math

import mindspore as ms
import numpy as np
from mindspore import Parameter, ParameterTuple, Tensor, nn, ops
from mindspore.common.initializer import initializer

from ms_rope_attention import rotary_cache_write

BUCKET = 512  # capacities are BUCKET * 2^k (capped at the model's cos/sin table)
STEP_TOKENS = 16  # tokens per sequence a padded decode step takes (the op's decode path: 1..16)


def token_bucket(tokens: int) -> int:
    """The next power of two: the static token count of a padded decode step. MindSpore runs a
    static-shape graph faster than a dynamic one (measured: 126 against 140 ms median per batch-1
    step of a 2-layer Llama2-7B with 512 cached tokens on 2 cores, 119 against 126 with 2048), and
    powers of two bound the graphs of up to 16 tokens for each of 8 slots to 8."""
    return 1 << max(0, int(tokens) - 1).bit_length()


def bucket_capacity(tokens: int, limit: int) -> int:
    """The smallest capacity bucket holding ``tokens`` positions, at most ``limit``."""
    capacity = BUCKET
    while capacity < tokens:
        capacity *= 2
    return min(capacity, limit)


def scratch_rows(slots: int, capacity: int) -> int:
    """Rows for the padding of a step of up to ``STEP_TOKENS`` tokens per slot; at most a slot's
    rows: no sequence of the attention call is longer than the cos/sin table."""
    return min(capacity, max(token_bucket(n) - n for n in range(1, slots * STEP_TOKENS + 1)))


def cache_shape(config, slots: int, capacity: int) -> tuple[int, int, int]:
    """The shape of each layer's keys (and values): every slot's rows, then the scratch rows."""
    return slots * capacity + scratch_rows(slots, capacity), config.num_key_value_heads, config.dim_per_head


def cache_bytes(config, slots: int, capacity: int, dtype) -> int:
    """Bytes a ``KVCache`` of these sizes allocates (keys and values of every layer), known before
    anything is allocated."""
    return 2 * config.num_hidden_layers * math.prod(cache_shape(config, slots, capacity)) * dtype.itemsize


def _layer_caches(config, shape, dtype, prefix: str) -> tuple[ParameterTuple, ParameterTuple]:
    """Zeroed key and value Parameters of ``shape``, one of each per layer."""
    return tuple(ParameterTuple([Parameter(initializer("zeros", shape, dtype), name=f"{prefix}_{kind}.{i}",
                                           requires_grad=False) for i in range(config.num_hidden_layers)])
                 for kind in ("keys", "values"))


class KVCache(nn.Cell):
    """Rotated keys and values of ``slots`` sequences of up to ``capacity`` tokens, per layer."""

    def __init__(self, config, slots: int, capacity: int, dtype):
        super().__init__()
        if not isinstance(slots, int) or slots < 1:
            raise ValueError(f"slots: expected a positive int, got {slots!r}")
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity: expected a positive int, got {capacity!r}")
        self.slots, self.capacity = slots, capacity
        self.scratch_start = slots * capacity
        self.scratch = scratch_rows(slots, capacity)
        self.keys, self.values = _layer_caches(config, cache_shape(config, slots, capacity), dtype, "cache")

    @property
    def dtype(self):
        return self.keys[0].dtype

    def rows(self, slot: int, start: int, count: int) -> np.ndarray:
        """Flat cache rows of positions [start, start + count) of a slot."""
        return slot * self.capacity + np.arange(start, start + count)

    def padded_tokens(self, tokens: int) -> int:
        """The token count a step of ``tokens`` new tokens runs with: its ``token_bucket`` when the
        scratch rows hold the padding (up to ``STEP_TOKENS`` per slot), else ``tokens`` itself."""
        bucket = token_bucket(tokens)
        return bucket if bucket - tokens <= self.scratch else tokens

    def padding_rows(self, padding: int) -> np.ndarray:
        """The scratch rows ``padding`` tokens write: the last ones."""
        return self.scratch_start + np.arange(self.scratch - padding, self.scratch)

    def step_offsets(self, lengths: np.ndarray, new_tokens: np.ndarray, padding: int = 0) -> tuple[Tensor, Tensor]:
        """(actual_seq_qlen, actual_seq_kvlen) of an attention call over the whole cache: slot s is
        the sequence of its ``lengths[s]`` filled rows (the step's ``new_tokens[s]`` included, which
        are its queries), then a query-less gap sequence over the rest of its rows; the scratch rows
        are a gap, then the ``padding`` queries over the rows they wrote."""
        q = np.append(np.stack([new_tokens, np.zeros_like(new_tokens)], 1).reshape(-1), [0, padding])
        kv = np.append(np.stack([lengths, self.capacity - lengths], 1).reshape(-1), [self.scratch - padding, padding])
        return Tensor(np.cumsum(q), ms.int64), Tensor(np.cumsum(kv), ms.int64)


class Slots:
    """Which cache slot holds how many tokens: the host side of continuous batching."""

    def __init__(self, count: int):
        self.lengths = np.zeros(count, np.int64)
        self.busy = np.zeros(count, bool)

    def free(self) -> list[int]:
        return [int(s) for s in np.flatnonzero(~self.busy)]

    def take(self, slot: int) -> None:
        self.busy[slot], self.lengths[slot] = True, 0

    def release(self, slot: int) -> None:
        self.busy[slot], self.lengths[slot] = False, 0


def block_bytes(config, block_size: int, dtype) -> int:
    """Bytes one block of a ``PagedKVCache`` takes over every layer (keys and values)."""
    return 2 * config.num_hidden_layers * block_size * config.num_key_value_heads * config.dim_per_head * dtype.itemsize


class PagedKVCache(nn.Cell):
    """Rotated keys and values in ``num_blocks`` blocks of ``block_size`` positions, per layer:
    (num_blocks, block_size, Nkv, D) Parameters, the layout of MindFormers' and vLLM-MindSpore's
    caches, read in place by ``rotary_paged_attention`` and written by ``rotary_cache_write``.
    Which block holds what is the host's bookkeeping (``block_pool.BlockPool``)."""

    def __init__(self, config, num_blocks: int, block_size: int, dtype):
        super().__init__()
        if not isinstance(block_size, int) or block_size < 16 or block_size % 16:
            raise ValueError(f"block_size: expected a positive multiple of 16, got {block_size!r}")
        self.num_blocks, self.block_size = num_blocks, block_size
        shape = (num_blocks, block_size, config.num_key_value_heads, config.dim_per_head)
        self.keys, self.values = _layer_caches(config, shape, dtype, "paged")

    @property
    def dtype(self):
        return self.keys[0].dtype

    def copy_blocks(self, pairs) -> None:
        """The copy-on-write before a step: each (source, destination) block copied whole, keys and
        values, in every layer, in place, by eager calls of the cache write with the keys as they
        are. Not inside the step's graph: there the read of the cache before its in-place write made
        MindSpore 2.10 copy the whole cache in every step (measured on a 40-token prefill step of
        Llama2-7B's dimensions, 2 layers, float16 weights: 402 ms with a 0.25 GiB cache, 580 ms with
        2 GiB; 375 and 380 ms without that read)."""
        if not pairs:
            return
        bs, (kv_heads, dim) = self.block_size, self.keys[0].shape[2:]
        source = Tensor([s for s, _ in pairs], ms.int32)
        slots = Tensor((np.array([t for _, t in pairs])[:, None] * bs + np.arange(bs)).reshape(-1).astype(np.int32))
        positions = Tensor(np.zeros(len(pairs) * bs, np.int32))
        # the write's rotation tables, which it does not read with key_rotated
        cos, sin = Tensor(np.ones((1, dim), np.float32)), Tensor(np.zeros((1, dim), np.float32))
        for keys, values in zip(self.keys, self.values):
            rotary_cache_write(ops.gather(keys, source, 0).reshape(-1, kv_heads, dim),
                               ops.gather(values, source, 0).reshape(-1, kv_heads, dim), cos, sin, positions, slots,
                               keys, values, key_rotated=True)
