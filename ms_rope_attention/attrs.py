"""The op's attributes as one value, from the Cell or the call down to the kernel factories.

``OpAttrs`` holds the contract's attributes (``op_info``: same names, same order) and the two
dispatch options (``backend``, ``strict``). It is built by keyword only: ``strict`` and
``key_rotated`` are both bools, and a positional order would swap them silently the day it
changed. It stays a tuple because ``ops.constexpr`` hands a graph's constants over as plain
tuples: ``OpAttrs.of`` turns one back into the value.
"""
from __future__ import annotations

from typing import NamedTuple

from .op_info import load_contract


class _Fields(NamedTuple):
    # the contract's attributes, in its order; None where the contract's 0 means "from the inputs"
    head_num: int | None = None
    input_layout: str = "BNSD"
    rotary_mode: int = 0
    rotary_dim: int | None = None
    scale: float | None = None
    causal: bool = True
    with_softmax_lse: bool = False
    with_rotated_key: bool = False
    key_rotated: bool = False
    compute_dtype: str = "auto"
    # how the dispatch chooses the path
    backend: str = "auto"
    strict: bool = False


class OpAttrs(_Fields):
    """The attributes of one op instance; ``OpAttrs(head_num=4, causal=False)``."""

    __slots__ = ()
    FROM_INPUTS = ("head_num", "rotary_dim", "scale")  # None here, 0 in the contract and the kernels

    def __new__(cls, **fields) -> "OpAttrs":
        unknown = set(fields) - set(cls._fields)
        if unknown:
            raise TypeError(f"OpAttrs: unknown attribute(s) {sorted(unknown)}; expected some of {list(cls._fields)}")
        return super().__new__(cls, **fields)

    @classmethod
    def of(cls, values) -> "OpAttrs":
        """The value back from a plain tuple of its fields (what a graph hands a constexpr)."""
        return values if isinstance(values, cls) else cls._make(values)

    def kernel_attrs(self) -> dict:
        """The primitives' attributes: the contract's names, 0 for "from the inputs". The fused
        forward always emits softmax_lse: the backward needs it (a float per row); the op returns an
        empty lse when it was not asked for."""
        values = {name: getattr(self, name) for name in contract_attr_names()}
        values.update({name: values[name] or 0 for name in self.FROM_INPUTS}, with_softmax_lse=True)
        values["scale"] = float(values["scale"])
        return values


def check_attention_compute_dtype(value) -> str:
    """``value`` if the attention ops offer it as their attribute (the contract's ``compute_dtype``
    values; ``compute.check_compute_dtype`` checks the model's setting, which also names float16);
    float16 is refused by name (x86 has no float16 dot product accumulating in float32), anything
    else by the contract's list."""
    if value == "float16":
        raise ValueError("compute_dtype: 'float16' is not offered by the attention ops: x86 has no float16 dot "
                         "product accumulating in float32; use 'auto', 'float32' or 'bfloat16'")
    allowed = load_contract().attr("compute_dtype")["values"]
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"compute_dtype: expected one of {allowed}, got {value!r}")
    return value


def contract_attr_names() -> tuple:
    """The contract's attribute names, in its order: the first fields of ``OpAttrs``."""
    return tuple(attr["name"] for attr in load_contract().attrs)
