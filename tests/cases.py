"""Problem generation shared by the test files: shapes per layout, random unit-scale inputs."""
from dataclasses import dataclass, field

import numpy as np

from reference import rope_tables


@dataclass
class Case:
    layout: str = "BNSD"
    batch: int = 2
    heads: int = 4
    kv_heads: int = 2
    q_len: int = 5
    kv_len: int = 7
    head_dim: int = 16
    rotary_dim: int | None = None
    mode: int = 0
    causal: bool = True
    q_lens: list = field(default_factory=list)    # TND only
    kv_lens: list = field(default_factory=list)   # TND only
    table_rows: int | None = None
    random_tables: bool = False

    def shape(self, heads, length):
        d = self.head_dim
        return {"BNSD": (self.batch, heads, length, d), "BSND": (self.batch, length, heads, d),
                "BSH": (self.batch, length, heads * d), "TND": (length, heads, d)}[self.layout]

    def make(self, rng):
        """q, k, v, cos, sin (float64) and the TND offsets (or None)."""
        if self.layout == "TND":
            tq, tk = sum(self.q_lens), sum(self.kv_lens)
            aq, ak = np.cumsum(self.q_lens).tolist(), np.cumsum(self.kv_lens).tolist()
            longest = max(self.kv_lens) if self.kv_lens else 1
        else:
            tq, tk, aq, ak, longest = self.q_len, self.kv_len, None, None, self.kv_len
        q = rng.standard_normal(self.shape(self.heads, tq))
        k = rng.standard_normal(self.shape(self.kv_heads, tk))
        v = rng.standard_normal(self.shape(self.kv_heads, tk))
        rd = self.rotary_dim or self.head_dim
        rows = self.table_rows or max(longest, 1) + 3
        if self.random_tables:  # every angle exercised, as in flash-attention's rotary tests
            angles = rng.uniform(0, 2 * np.pi, (rows, rd // 2))
            angles = np.concatenate([angles, angles], 1) if self.mode == 0 else np.repeat(angles, 2, 1)
            cos, sin = np.cos(angles), np.sin(angles)
        else:
            cos, sin = rope_tables(rd, rows, mode=self.mode)
        return q, k, v, cos, sin, aq, ak

    @property
    def kwargs(self):
        return dict(head_num=self.heads, input_layout=self.layout, rotary_mode=self.mode,
                    rotary_dim=self.rotary_dim, causal=self.causal)
