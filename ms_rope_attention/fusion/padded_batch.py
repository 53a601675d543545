"""A batch whose sequences sit at different positions (a left-padded batch, as Hugging Face's
``generate`` builds one for prompts of unequal lengths) in the fused op's terms: per sequence, the
first key column it attends (``starts``), and one cos/sin table every sequence's positions index.

The op's TND layout expresses the rest: each sequence's keys before its start become a query-less
segment (a gap), the rest a segment whose queries see keys bottom-right causally, so query i of a
sequence that starts at ``s`` is at position ``past + i - s``, exactly where HF's left-padded
``position_ids`` put it. Everything is decided on the host from the mask and HF's cos rows, and a
batch that does not fit (a mask that is not such a band, positions that do not follow it) gets a
reason instead, for the caller to run the original code.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .family import MASKED_BELOW


@dataclass(frozen=True)
class Band:
    """Sequence b's query i (its row ``past + i`` of the keys) attends keys ``starts[b] .. past + i``."""
    starts: np.ndarray  # (B,) int64
    past: int
    q_len: int

    @property
    def uniform(self) -> bool:
        """No sequence is padded: the band is the plain causal rule for every sequence."""
        return not self.starts.any()

    def positions(self) -> np.ndarray:
        """(B, q_len) int64: each query's position; negative for a padding query of a prefill."""
        return self.past + np.arange(self.q_len)[None, :] - self.starts[:, None]

    def offsets(self) -> tuple[np.ndarray, np.ndarray]:
        """TND cumulative (actual_seq_qlen, actual_seq_kvlen) over the B * (past + q_len) keys of the
        batch, token-major. A prefill's padding queries (rows before their sequence's start) are a
        causal segment of their own (their outputs are HF's don't-care: no real query sees them);
        after a prefill the padding is a query-less gap."""
        total = self.past + self.q_len
        q, kv = [], []
        for start in self.starts.tolist():
            padding_queries = max(0, start - self.past)
            if start:
                q.append(padding_queries)
                kv.append(start)
            q.append(self.q_len - padding_queries)
            kv.append(total - start)
        return np.cumsum(q, dtype=np.int64), np.cumsum(kv, dtype=np.int64)


def attended(mask: np.ndarray, boolean: bool) -> np.ndarray | str:
    """(B, q, kv) bool: which keys each query attends, from HF's 4-D mask (True = attend for sdpa's
    boolean mask; 0 = attend, <= ``MASKED_BELOW`` = hidden for eager's additive one). Heads must
    agree; a reason string otherwise."""
    if mask.ndim != 4:
        return f"a {mask.ndim}-D attention mask (expected HF's (batch, 1, q, kv))"
    if boolean:
        keep = mask.astype(bool)
    else:
        keep = mask == 0
        if not np.all(keep | (mask <= MASKED_BELOW)):
            return "the additive mask has values other than 0 and a large negative (a bias, not a mask)"
    if not np.all(keep == keep[:, :1]):
        return "the mask differs across heads"
    return keep[:, 0]


def band(keep: np.ndarray, past: int) -> Band | str:
    """The ``Band`` this (B, q, kv) attend pattern is, or why it is none: every query that is a real
    token (row ``past + i`` at or after its sequence's start) must see exactly keys start..past + i,
    with the start read off the last query (always a real token when the batch is left-padded).
    Padding queries of a prefill (rows before the start) are HF's don't-care rows and are skipped."""
    batch, q_len, kv_len = keep.shape
    if kv_len != past + q_len:
        return f"the mask covers {kv_len} keys, the cache holds {past + q_len}"
    last = keep[:, -1]
    if not last.any(axis=1).all():
        return "a sequence whose last query attends no key"
    starts = last.argmax(axis=1).astype(np.int64)
    if np.any(starts > past) and past > 0:
        return "padding queries after the first call (a prompt fed in chunks inside its padding)"
    rows = past + np.arange(q_len)
    columns = np.arange(kv_len)
    expected = (columns[None, None, :] >= starts[:, None, None]) & (columns[None, None, :] <= rows[None, :, None])
    real = rows[None, :] >= starts[:, None]
    if not np.all((keep == expected)[real]):
        return "the mask is not causal with left padding (a custom mask, or right padding)"
    return Band(starts, past, q_len)


def position_table(rows: np.ndarray, the_band: Band) -> np.ndarray | None:
    """A (past + q_len, width) table whose row p is the cos (or sin) HF gave the queries at position p
    (``rows``: HF's (B or 1, q_len, width) rows, float32); None when two queries at one position were given
    different rows (positions that do not follow the mask, e.g. custom ``position_ids``). Rows no
    query sits at stay 0: only a prefill's keys read them, and each of its real keys is at a
    position some query of its own sequence sits at."""
    positions = the_band.positions()
    rows = np.broadcast_to(rows, positions.shape + rows.shape[-1:])
    real = positions >= 0
    table = np.zeros((the_band.past + the_band.q_len, rows.shape[-1]), np.float32)
    table[positions[real]] = rows[real]
    if not np.array_equal(table[positions[real]], rows[real]):
        return None
    return table
