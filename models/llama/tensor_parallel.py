"""Tensor parallelism for the Llama (Megatron's split): which part of the model a rank of the
tensor-parallel group holds. Each rank holds some heads (q/k/v column-parallel, o row-parallel),
some MLP features (gate/up column-parallel, down row-parallel) and a slice of the vocabulary
(embedding and LM head); KV heads are split too, or replicated when there are fewer of them than
ranks (their weight gradients then summed over the ranks sharing a head). Each rank reads only its
slices of a full Hugging Face checkpoint (``TensorParallel.index``, through safetensors' slices), and
``weights.gathered_state`` puts the full weights back together. ``model.py`` builds its layers from it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace
from functools import cached_property

import mindspore as ms
import numpy as np
from mindspore import ops

from ms_rope_attention.distributed import Axis, GroupCollective, ParallelMesh

from .config import LlamaConfig

# How each weight (Hugging Face name, (out, in) layout) is split: along its rows (output features)
# or its columns (input features); anything else (the norms) is replicated.
_ROWS = re.compile(r".*(self_attn\.(q|k|v)_proj|mlp\.(gate|up)_proj)\.weight$|^(model\.embed_tokens|lm_head)\.weight$")
_COLUMNS = re.compile(r".*(self_attn\.o_proj|mlp\.down_proj)\.weight$")
_KV = re.compile(r".*self_attn\.(k|v)_proj\.weight$")


@dataclass(frozen=True)
class TensorParallel:
    """Rank ``rank`` of ``size`` in the tensor-parallel group ``group``: which part of a Llama it
    holds. ``kv_share``: when there are fewer KV heads than ranks, the ranks that hold the same
    (replicated) KV head, whose k/v weight gradients are summed over them."""
    rank: int
    size: int
    group: str | None = None
    kv_share: Axis | None = None

    @classmethod
    def of_mesh(cls, config: LlamaConfig, mesh: ParallelMesh) -> "TensorParallel":
        """This rank's part along the mesh's tensor axis, checked against the model's dimensions."""
        axis = mesh.tensor
        tp = cls(axis.rank, axis.size, axis.group)
        tp.check(config)
        kv = config.num_key_value_heads
        return replace(tp, kv_share=axis.block(axis.size // kv)) if kv < axis.size else tp

    @cached_property
    def collective(self) -> GroupCollective:
        """The group's AllReduce/AllGather (one per process, for the gathers and sums outside a graph)."""
        return GroupCollective(self.rank, self.size, self.group)

    def check(self, config: LlamaConfig) -> None:
        size, kv = self.size, config.num_key_value_heads
        problems = [f"{name} {value}" for name, value in (
            ("num_attention_heads", config.num_attention_heads), ("intermediate_size", config.intermediate_size),
            ("vocab_size", config.vocab_size)) if value % size]
        if kv % size and size % kv:
            problems.append(f"num_key_value_heads {kv} (nor does it divide it)")
        if problems:
            raise ValueError(f"tensor parallel: the tensor-parallel degree {size} does not divide " + ", ".join(problems))

    def heads(self, config: LlamaConfig) -> int:
        return config.num_attention_heads // self.size

    def kv_heads(self, config: LlamaConfig) -> int:
        """KV heads per rank: a share of them, or one (replicated) when there are fewer than ranks."""
        return max(1, config.num_key_value_heads // self.size)

    def index(self, name: str, config: LlamaConfig):
        """This rank's part of the full tensor ``name``: a tuple of slices, or None (replicated)."""
        kv = config.num_key_value_heads
        if _KV.match(name) and kv < self.size:
            d = config.dim_per_head
            head = self.rank * kv // self.size  # the KV head of this rank's query heads
            return (slice(head * d, (head + 1) * d),)
        rows, columns = _ROWS.match(name), _COLUMNS.match(name)
        if not rows and not columns:
            return None
        full = _full_features(name, config)
        part = full // self.size
        chosen = slice(self.rank * part, (self.rank + 1) * part)
        return (chosen,) if rows else (slice(None), chosen)

    def copies(self, name: str, config: LlamaConfig) -> int:
        """How many ranks of the group hold the same values of ``name`` (1: a shard of its own)."""
        if _KV.match(name) and config.num_key_value_heads < self.size:
            return self.size // config.num_key_value_heads
        return self.size if self.index(name, config) is None else 1

    def gather(self, name: str, local, config: LlamaConfig) -> np.ndarray:
        """The full float32 tensor ``name`` from every rank's part ``local`` (a collective: every
        rank of the group calls it, for the same names in the same order)."""
        local = local.astype(ms.float32)
        index = self.index(name, config)
        if index is None:
            return local.asnumpy()
        axis = len(index) - 1
        gathered = self.collective.all_gather(ops.moveaxis(local, axis, 0))
        parts = np.split(gathered.asnumpy(), self.size, 0)
        copies = self.copies(name, config)
        return np.moveaxis(np.concatenate(parts[::copies], 0), 0, axis)  # one copy of each replicated head


def _full_features(name: str, config: LlamaConfig) -> int:
    """The split axis's length of the full tensor ``name``."""
    d = config.dim_per_head
    if "embed_tokens" in name or name.startswith("lm_head"):
        return config.vocab_size
    if "mlp." in name:
        return config.intermediate_size
    if _KV.match(name):
        return config.num_key_value_heads * d
    return config.num_attention_heads * d
