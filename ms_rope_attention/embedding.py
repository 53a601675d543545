"""Token-embedding lookup of a float32 / float16 / bfloat16 table on the CPU, rows out as float32, as
an aot ``Custom`` op (csrc/rfa_cpu_embedding.cc, in the projection library).

Why: a Llama embedding kept in the checkpoint's half precision halves its memory (0.26 GB of
Llama2-7B's 0.52), and MindSpore 2.10's CPU backend has no bfloat16 Gather; the op reads each row
once and converts it as it copies it. An id outside the vocabulary is refused, naming it.
"""
from __future__ import annotations

import functools

import mindspore as ms
import numpy as np
from mindspore import ops

from .cpu_runtime import direct_call, library_path, make_primitive
from .linear import STEM, WHAT, library
from .op_info import EMBEDDING_PATH, load_contract

_TEXTS = ("RfaEmbeddingLastError",)


def lookup(ids: np.ndarray, table: np.ndarray, out_shape: tuple | None = None, isa: str | None = None) -> np.ndarray:
    """``table[ids]`` as float32 through the op's entry, called directly (tests, no MindSpore);
    ``out_shape`` overrides the output's shape to test the kernel's checks."""
    ids, table = np.require(ids, requirements="C"), np.require(table, requirements="C")
    if out_shape is None:
        out_shape = ids.shape + table.shape[1:2]
    y = np.full(out_shape, np.nan, np.float32)
    direct_call(library(isa, _TEXTS), "RfaEmbedding", (ids, table, y), "RfaEmbeddingLastError")
    return y


def _bprop():
    """No gradient flows to the ids; the table's is the rows' gradients summed per id (float32, then
    the table's dtype)."""
    def bprop(ids, table, out, dout):
        rows = dout.reshape(-1, table.shape[1])
        grad = ops.unsorted_segment_sum(rows, ids.reshape(-1).astype(ms.int32), table.shape[0])
        return ops.zeros_like(ids), grad.astype(table.dtype)
    return bprop


@functools.lru_cache(maxsize=None)
def embedding_op() -> ops.Custom:
    """The aot primitive ``(ids (...) int32/int64, table (V, H) float32/float16/bfloat16) -> (..., H)
    float32`` (contract: ``op_info/embedding.yaml``), in the projection library."""
    library(texts=_TEXTS)  # OpenBLAS first, and fail here, not inside MindSpore
    # Not graph-launched: linear_op says why.
    return make_primitive(load_contract(str(EMBEDDING_PATH)), {}, library_path(STEM, WHAT), bprop=_bprop(),
                          any_dtype=False, graph_launch=False)
