"""The paged KV cache's two ops on the CPU: their primitives (entries of the attention library,
csrc/rfa_cpu_paged.cc), made by ``cpu_runtime.make_primitive`` from their contracts, and the
kernel's own counts. The dispatch's factory for them; ``paged`` is where they are called.
"""
from __future__ import annotations

import ctypes

from .cpu_kernel import ABI, STEM, WHAT
from .cpu_runtime import library_path, make_primitive, open_library
from .op_info import CACHE_WRITE_PATH, PAGED_ATTENTION_PATH, Contract, load_contract

CONTRACT_PATHS = {"RotaryPagedAttention": PAGED_ATTENTION_PATH, "RotaryCacheWrite": CACHE_WRITE_PATH}


def contract(op_name: str) -> Contract:
    """The contract of one of the two ops, by its name."""
    return load_contract(str(CONTRACT_PATHS[op_name]))


def library(isa: str | None = None) -> ctypes.CDLL:
    """The attention library (the selected build, or ``isa``'s), with the paged entries' result types."""
    return open_library(library_path(STEM, WHAT, isa), ABI, texts=("RotaryPagedAttentionLastError",),
                        counts=("RotaryPagedAttentionCalls", "RotaryCacheWriteRotatedKeys"))


def make_op(op_name: str, values: dict):
    """The primitive of ``op_name`` for checked attribute ``values``. The cache write writes its
    cache inputs in place: a side effect, kept in order and never pruned."""
    library()  # refuse a library of another ABI here, not inside MindSpore
    return make_primitive(contract(op_name), values, library_path(STEM, WHAT),
                          side_effect=op_name == "RotaryCacheWrite")


def last_error(isa: str | None = None) -> str:
    """The message of the paged ops' last refused launch."""
    return library(isa).RotaryPagedAttentionLastError().decode()


def paged_calls() -> int:
    """Calls of RotaryPagedAttention in this process so far (the kernel's own count)."""
    return library().RotaryPagedAttentionCalls()


def rotated_keys() -> int:
    """Key heads RotaryCacheWrite rotated in this process so far (each new key once per KV head)."""
    return library().RotaryCacheWriteRotatedKeys()
