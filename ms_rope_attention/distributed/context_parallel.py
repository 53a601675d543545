"""Context-parallel rotary attention: a long sequence split across ranks, each rank attending with
its own queries to the whole sequence's keys and values.

The load-balanced layout (MindSpeed's): a sequence of S tokens is cut into 2W chunks of c = S / 2W
tokens and rank r holds chunks r and 2W-1-r, so every rank has as much causal work as the others
(an early chunk sees few keys, a late one many). A step:

1. the ranks' K and V chunks are gathered (``GatherChunks``) and put back in sequence order;
2. the rank's two query chunks run as **one TND call** of the fused op: chunk r against keys
   [0, (r+1)c), chunk 2W-1-r against keys [0, (2W-r)c). The op's bottom-right causal rule (query i
   at kv_len - q_len + i) and its absolute-position cos/sin tables put every query and key at its
   position in the whole sequence: the kernel needs nothing of its own for context parallelism;
3. the gradient of the gathered K/V goes back to the rank that holds each chunk (summed over ranks).

Gathering K/V costs one all-gather of the sequence's keys and values per layer (and its reduction in
the backward); it suits moderate context-parallel degrees and the CPU, whose collectives have no
send/recv. On Ascend, a ring (``ring.py``: K/V blocks passed rank to rank, per-block calls merged by
their log-sum-exp) overlaps communication with compute and never holds the whole K/V.
"""
from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops

from ..functional import rotary_flash_attention
from .collectives import GatherChunks


def _chunk_order(size: int) -> tuple[list[int], list[int]]:
    """(the chunks rank r holds, for every r in rank order; where each sequence chunk sits in that list)."""
    held = [c for r in range(size) for c in (r, 2 * size - 1 - r)]
    return held, [held.index(j) for j in range(2 * size)]


def load_balanced_chunks(x, rank: int, size: int, axis: int = 1):
    """Rank ``rank``'s part of ``x`` (numpy or Tensor): chunks ``rank`` and ``2*size-1-rank`` of the
    ``2*size`` equal chunks of ``axis``, concatenated."""
    length = x.shape[axis]
    if length % (2 * size):
        raise ValueError(f"sequence length {length}: expected a multiple of 2 x context-parallel size = {2 * size}")
    c = length // (2 * size)
    index = [slice(None)] * len(x.shape)
    parts = []
    for chunk in (rank, 2 * size - 1 - rank):
        index[axis] = slice(chunk * c, (chunk + 1) * c)
        parts.append(x[tuple(index)])
    return np.concatenate(parts, axis) if isinstance(x, np.ndarray) else ops.cat(parts, axis)


def load_balanced_merge(parts, axis: int = 1):
    """The whole sequence from every rank's ``load_balanced_chunks`` part, in rank order."""
    size = len(parts)
    _, where = _chunk_order(size)
    halves = [h for part in parts for h in np.split(np.asarray(part), 2, axis)]
    return np.concatenate([halves[i] for i in where], axis)


class ContextParallelRotaryAttention(nn.Cell):
    """RoPE + causal attention over a sequence split across a context-parallel group.

    ``construct(query, key, value, cos, sin)``: the rank's part of each (BSND: (B, 2c, N, D), as
    ``load_balanced_chunks`` cuts along axis 1), cos/sin tables covering the whole sequence.
    Returns the attention output of the rank's queries (B, 2c, N, D), and with
    ``with_softmax_lse`` also their log-sum-exp (B, N, 2c). GQA, partial rotary and both rotary
    modes as in ``rotary_flash_attention``; differentiable in GRAPH_MODE and PyNative.
    ``rank`` / ``size`` default to the group's (``mindspore.communication.init()`` first)."""

    def __init__(self, head_num=None, *, rotary_mode=0, rotary_dim=None, scale=None, with_softmax_lse=False,
                 group: str | None = None, rank: int | None = None, size: int | None = None,
                 native_backward: bool | None = None, strict=False):
        super().__init__()
        self.gather = GatherChunks(rank, size, group, native_backward)
        self.rank, self.size = self.gather.rank, self.gather.size
        self.head_num, self.rotary_mode, self.rotary_dim, self.scale = head_num, rotary_mode, rotary_dim, scale
        self.with_softmax_lse, self.strict = with_softmax_lse, strict
        self.order = Tensor(np.array(_chunk_order(self.size)[1], np.int32))

    def _whole_sequence(self, x):
        """Every rank's (B, 2c, N, D) part gathered and put in sequence order: (B, 2W c, N, D)."""
        b, two_c, n, d = x.shape
        c = two_c // 2
        parts = self.gather(x.reshape(1, b, 2, c, n, d))                       # (W, B, 2, c, N, D)
        chunks = parts.transpose(0, 2, 1, 3, 4, 5).reshape(2 * self.size, b, c, n, d)
        ordered = ops.gather(chunks, self.order, 0)                           # sequence order
        return ordered.transpose(1, 0, 2, 3, 4).reshape(b, 2 * self.size * c, n, d)

    def construct(self, query, key, value, cos, sin):
        b, two_c, n, d = query.shape
        c = two_c // 2
        _check_part(two_c, key.shape[1], value.shape[1])
        first, second = (self.rank + 1) * c, (2 * self.size - self.rank) * c   # keys each chunk sees
        whole_k, whole_v = self._whole_sequence(key), self._whole_sequence(value)
        # Per batch row: its first chunk's keys, then its second's (TND, two sequences per row).
        k = ops.cat((whole_k[:, :first], whole_k[:, :second]), 1).reshape(b * (first + second), key.shape[2], d)
        v = ops.cat((whole_v[:, :first], whole_v[:, :second]), 1).reshape(b * (first + second), value.shape[2], d)
        aq, akv = _offsets(b, c, first, second)
        result = rotary_flash_attention(query.reshape(b * two_c, n, d), k, v, cos, sin, self.head_num,
                                        input_layout="TND", rotary_mode=self.rotary_mode, rotary_dim=self.rotary_dim,
                                        scale=self.scale, actual_seq_qlen=aq, actual_seq_kvlen=akv,
                                        return_softmax_lse=self.with_softmax_lse, strict=self.strict)
        if not self.with_softmax_lse:
            return result.reshape(b, two_c, n, d)
        out, lse = result
        return out.reshape(b, two_c, n, d), lse.reshape(b, two_c, n).transpose(0, 2, 1)


@ops.constexpr
def _check_part(q_len, k_len, v_len):
    if q_len % 2 or k_len != q_len or v_len != q_len:
        raise ValueError(f"query/key/value: expected each rank's part of the sequence (two chunks of equal length, "
                         f"the same for query, key and value), got lengths {q_len}, {k_len}, {v_len}")
    return True


@ops.constexpr
def _offsets(batch, c, first, second):
    """TND cumulative ends: per batch row, two query chunks of c rows, their keys [0, first) and [0, second)."""
    q = np.cumsum([c] * (2 * batch))
    kv = np.cumsum([first, second] * batch)
    return Tensor(q, ms.int64), Tensor(kv, ms.int64)
