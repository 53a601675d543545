"""The paged engine's two graphs over a ``PagedKVCache``, and what a step builds for each: the
prefill graph (each sequence's new tokens packed in one call, their keys rotated once and written
by ``rotary_cache_write``, attention over cached prefix + new tokens by the fused op with
``key_rotated``: the context gathered from the blocks) and the decode graph (one call of
``rotary_paged_attention`` per layer, each sequence's new tokens attended over its blocks in
place).

Which graph a step runs: decode tokens only, or at most 16 tokens in all (``STEP_TOKENS``, the
paged kernel's queries per sequence), run the decode graph: each sequence's new tokens attended
over its blocks in place, the projections on the few-row path that streams the weights as stored.
Other steps run the prefill graph (each sequence's context gathered for the fused op, each decoding
request a sequence of one new token). That is why decode tokens leave a chunked step only up to
16 tokens (``paged_scheduler``): on 2 cores with Llama2-7B's dimensions (2 layers, half weights)
such a step took 159-168 ms beside a 60 ms decode step, where a 128-token chunk's prefill graph
step took 1.07 s (docs/serving.md). With 16 or more decode tokens, prompts take what the budget leaves.
A block a step's prompt shares and must write into is copied before the step, whichever graph runs
(``PagedKVCache.copy_blocks``).
"""
from __future__ import annotations

from typing import Callable

import mindspore as ms
import numpy as np
from mindspore import Tensor

from ..cache_views import PagedDecode, PagedPrefill
from .block_pool import SCRATCH_BLOCK, Growth, blocks_for
from .common import CacheGraph, dynamic_vector
from .kv_cache import STEP_TOKENS, PagedKVCache, token_bucket
from .paged_scheduler import PagedRequest, StepSequence

Grow = Callable[[PagedRequest, int], Growth]  # the blocks of a request's next positions (Scheduler.grow)


class _PagedPrefill(CacheGraph):
    """Whole prompts' uncached tokens (packed, ending at ``aq``; their sequences, cached prefix
    included, ending at ``akv``) into their blocks; logits of each prompt's last token."""

    @ms.jit
    def construct(self, input_ids, aq, akv, slots, positions, blocks, context):
        self.count_compile()
        view = PagedPrefill.build(self.cache.keys, self.cache.values, slots, positions, blocks, context)
        return self.lm(input_ids, aq, akv, view)


class _PagedDecode(CacheGraph):
    """1..16 new tokens per sequence (a decode token, or a prompt's chunk; padded to a power of two
    with filler sequences that write nothing), attended over the blocks in place; static shapes: one
    graph per token count."""

    @ms.jit
    def construct(self, input_ids, slots, positions, block_tables, context_lens, q_seq_lens):
        self.count_compile(input_ids.shape[0])
        view = PagedDecode.build(self.cache.keys, self.cache.values, slots, positions, block_tables, context_lens,
                                 q_seq_lens)
        return self.lm(input_ids, None, None, view)


def paged_graphs(model, cache: PagedKVCache) -> tuple[CacheGraph, CacheGraph]:
    """The prefill graph (its inputs dynamic: one graph for every step) and the decode graph."""
    prefill, decode = _PagedPrefill(model, cache), _PagedDecode(model, cache)
    # ids, query ends, key ends, slots, positions, the sequences' blocks, each key's row among theirs
    prefill.set_inputs(*[dynamic_vector(t) for t in (ms.int32, ms.int64, ms.int64, ms.int32, ms.int32, ms.int32,
                                                     ms.int32)])
    return prefill, decode


def runs_in_place(work: list[StepSequence]) -> bool:
    """The step runs the decode graph (the module's docstring says when, and why)."""
    return all(w.decode for w in work) or sum(len(w.ids) for w in work) <= STEP_TOKENS


def check_decode_ids(work: list[StepSequence], vocab: int) -> None:
    """Every pending token a step feeds is in the vocabulary: an id out of range would read a zero
    row of a float32 embedding, silently."""
    for request in (w.request for w in work if w.decode):
        if not 0 <= request.pending < vocab:
            raise RuntimeError(f"PagedGenerator: request {request.id} would decode token id {request.pending}, "
                               f"outside [0, {vocab}) (a bug of the engine: please report it)")


def run_prefill(graph: CacheGraph, cache: PagedKVCache, work: list[StepSequence], grow: Grow) -> np.ndarray:
    """The prefill graph over the step's sequences: prompt chunks (a whole prompt is one chunk)
    and, under chunked prefill, decoding requests as sequences of one new token."""
    bs = cache.block_size
    slots, positions, blocks, context, copies, ids, q_lens, kv_lens = [], [], [], [], [], [], [], []
    first_row = 0  # of this sequence's blocks among the step's
    for item in work:
        request = item.request
        start, length = request.seq.length, request.seq.length + len(item.ids)
        growth = grow(request, length - start)
        slots.append(growth.slots)
        copies += growth.copies
        positions.append(np.arange(start, length))
        held = request.seq.blocks[:blocks_for(length, bs)]
        blocks.append(held)
        context.append(first_row + np.arange(length))
        first_row += len(held) * bs
        ids.append(item.ids)
        q_lens.append(length - start)
        kv_lens.append(length)
    cache.copy_blocks(copies)
    args = (np.concatenate(ids).astype(np.int32), np.cumsum(q_lens).astype(np.int64),
            np.cumsum(kv_lens).astype(np.int64), np.concatenate(slots).astype(np.int32),
            np.concatenate(positions).astype(np.int32), np.concatenate(blocks).astype(np.int32),
            np.concatenate(context).astype(np.int32))
    return graph(*[Tensor(a) for a in args]).asnumpy()


def run_decode(graph: CacheGraph, cache: PagedKVCache, work: list[StepSequence], grow: Grow,
               table_width: int) -> np.ndarray:
    """The decode graph over the step's sequences, each its new tokens (a decode token, or a
    prompt chunk: ``q_seq_lens``) attended over its blocks in place (block tables of
    ``table_width`` entries); the logits of each one's last token. Padded to a power of two with
    filler sequences of one token that read the scratch block and write nothing, then sequences of
    no token."""
    lengths = [len(w.ids) for w in work]
    tokens = token_bucket(sum(lengths))
    fillers = tokens - sum(lengths)
    slots = np.full(tokens, -1, np.int32)
    positions = np.zeros(tokens, np.int32)
    ids = np.zeros(tokens, np.int32)
    tables = np.full((tokens, table_width), -1, np.int32)
    context, q_lens = np.zeros(tokens, np.int32), np.zeros(tokens, np.int32)
    fill = slice(len(work), len(work) + fillers)
    tables[fill, 0], context[fill], q_lens[fill] = SCRATCH_BLOCK, 1, 1
    row, copies = 0, []
    for i, (item, n) in enumerate(zip(work, lengths)):
        request = item.request
        start = request.seq.length
        growth = grow(request, n)
        copies += growth.copies
        rows = slice(row, row + n)
        slots[rows], positions[rows], ids[rows] = growth.slots, np.arange(start, start + n), item.ids
        tables[i, :len(request.seq.blocks)] = request.seq.blocks
        context[i], q_lens[i] = start + n, n
        row += n
    cache.copy_blocks(copies)
    logits = graph(Tensor(ids), Tensor(slots), Tensor(positions), Tensor(tables), Tensor(context),
                   Tensor(q_lens)).asnumpy()
    return logits[np.cumsum(lengths) - 1]
