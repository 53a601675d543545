"""Semi-auto parallel (Ascend): the layouts of the fused op's primitives for a batch split (dp) and a
head split (tp). On the op's floor: it reads only the contract and the checks, and the dispatch
applies it (``shard``) to the primitives a factory returns; ``distributed`` re-exports it.

MindSpore's ``CustomInfo`` takes an aot ``Custom`` primitive into a semi-auto graph by the layouts
given to it (``self_define_shard``): it checks their count and device matrices, inserts no
communication, and runs the kernel on each rank's slices. That is sound exactly where the kernel is
embarrassingly parallel: whole sequences (a batch split) and whole heads with their KV group (a
head split). A sequence split is not: every query needs all keys of its sequence, so K/V would have
to travel; ``ContextParallelRotaryAttention`` does that with collectives.

The layouts are read off the contract (``op_info``): one per tensor input a call passes, one per
output, forward and backward. A tensor added to the YAML without a rule here is refused by name
rather than silently shifting every layout after it.
"""
from __future__ import annotations

from collections.abc import Iterable

from mindspore.parallel import Layout

from .checks import split_heads
from .op_info import load_contract

AXES = ("dp", "tp")  # the device matrix (dp, tp): rank = dp_index * tp + tp_index

# What each tensor of the contract is; a gradient ``d_<name>`` is what ``<name>`` is.
_ROLES = {"query": "heads", "key": "heads", "value": "heads", "attention_out": "heads", "rotated_key": "heads",
          "softmax_lse": "lse", "cos": "table", "sin": "table", "actual_seq_qlen": "offsets",
          "actual_seq_kvlen": "offsets"}
# Batch and head axes per layout; BSH is split by batch only, TND by heads only (see _check_degrees).
_SPLIT = {
    "BNSD": {"heads": ("dp", "tp", "None", "None"), "lse": ("dp", "tp", "None")},
    "BSND": {"heads": ("dp", "None", "tp", "None"), "lse": ("dp", "tp", "None")},
    "BSH": {"heads": ("dp", "None", "None"), "lse": ("dp", "None", "None")},
    "TND": {"heads": ("None", "tp", "None"), "lse": ("None", "tp")},
}
# Indexed by absolute position or global offset: every rank needs them whole.
_REPLICATED = {"table": ("None", "None"), "offsets": ("None",)}
_PLACEHOLDER = ("None",)  # an output switched off by its with_<name> attribute: shape (0,)


def _role(name: str) -> str:
    base = name[len("d_"):] if name.startswith("d_") else name
    if base not in _ROLES:
        raise ValueError(f"sharding: no rule for the contract's tensor {name!r}; give it a role in _ROLES")
    return _ROLES[base]


def _check_degrees(input_layout: str, dp, tp) -> None:
    layouts = load_contract().attr("input_layout")["values"]
    if input_layout not in layouts:
        raise ValueError(f"input_layout: expected one of {layouts}, got {input_layout!r}")
    for name, value in (("dp", dp), ("tp", tp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: expected a positive int, got {value!r}")
    if input_layout == "BSH" and tp > 1:
        raise ValueError(f"tp: expected 1 for input_layout='BSH', got {tp}: BSH fuses the heads into H = N*D, and "
                         "a split of H would hand each rank N/tp heads while the kernel's head_num stays N; "
                         "use BSND (the same memory, heads on their own axis) to split heads")
    if input_layout == "TND" and dp > 1:
        raise ValueError(f"dp: expected 1 for input_layout='TND', got {dp}: TND concatenates the sequences along T "
                         "and actual_seq_qlen/actual_seq_kvlen are offsets into the whole batch, so a split of T "
                         "would cut sequences; split heads (tp), or use BNSD/BSND for a batch split")


def optional_inputs(input_layout: str, gradients_of: Iterable[str] = ()) -> frozenset:
    """The optional inputs a call passes: the forward's (the TND offsets) exactly for TND, which
    requires them and refuses them elsewhere; for the backward also ``d_<output>`` for each forward
    output in ``gradients_of`` (the outputs whose gradients are used)."""
    contract = load_contract()
    forward = {item["name"] for item in contract.inputs if item.get("optional")} if input_layout == "TND" else set()
    return frozenset(forward | {f"d_{name}" for name in gradients_of})


def primitive_layouts(attrs: dict, dp: int = 1, tp: int = 1, *, backward: bool = False,
                      present: Iterable[str] | None = None) -> tuple[tuple[Layout, ...], tuple[Layout, ...]]:
    """(in_strategy, out_strategy) of the forward primitive (or, ``backward``, the gradient
    primitive) for the attribute set ``attrs`` (contract names, as the primitive builders take
    them) on a (dp, tp) device matrix.

    ``present``: the optional inputs passed (default ``optional_inputs(input_layout)``); absent
    ones take no layout, as they are no tensors. An output whose ``with_<name>`` attribute is off
    is a (0,) placeholder and is replicated.
    """
    contract = load_contract()
    values = {**contract.attr_defaults, **attrs}
    layout = values["input_layout"]
    _check_degrees(layout, dp, tp)
    op = contract.backward if backward else contract
    present = optional_inputs(layout) if present is None else frozenset(present)
    optional = {item["name"] for item in op.inputs if item.get("optional")}
    if not present <= optional:
        raise ValueError(f"present: {sorted(present - optional)} are not optional inputs of {op.op_name} "
                         f"(those are {sorted(optional)})")
    mesh = Layout((dp, tp), AXES)

    def layout_of(name):
        role = _role(name)
        return mesh(*(_REPLICATED[role] if role in _REPLICATED else _SPLIT[layout][role]))

    inputs = tuple(layout_of(item["name"]) for item in op.inputs if not item.get("optional") or item["name"] in present)
    outputs = tuple(layout_of(item["name"]) if values.get(f"with_{item['name']}", True) else mesh(*_PLACEHOLDER)
                    for item in op.outputs)
    return inputs, outputs


def shard_primitive(primitive, in_layouts, out_layouts):
    """Marks ``primitive`` self-defined-shard (what lets ``CustomInfo`` take an aot ``Custom``) and
    sets its layouts; outside a semi-auto context MindSpore ignores both. Returns the primitive."""
    primitive.add_prim_attr("self_define_shard", True)
    return primitive.shard(in_strategy=tuple(in_layouts), out_strategy=tuple(out_layouts))


def shard(kernel, attrs, dp: int, tp: int) -> None:
    """Shards a factory's ``gradients.FusedKernel``: its forward primitive and its gradient
    primitive (none where the device has no backward kernel), for the ``attrs.OpAttrs`` it was
    built for. softmax_lse / rotated_key have gradients exactly when the op returns them
    (``gradients.fused_bprop`` passes theirs to the backward only then)."""
    values = attrs.kernel_attrs()
    shard_primitive(kernel.forward, *primitive_layouts(values, dp, tp))
    if kernel.grad is not None:
        used = [name for name, is_used in (("softmax_lse", attrs.with_softmax_lse),
                                           ("rotated_key", attrs.with_rotated_key)) if is_used]
        present = optional_inputs(attrs.input_layout, used)
        shard_primitive(kernel.grad, *primitive_layouts(values, dp, tp, backward=True, present=present))


def check_shard_shapes(input_layout: str, dp: int, tp: int, query_shape, key_shape, head_num=None) -> None:
    """The divisibility a (dp, tp) split needs, on the global shapes (dynamic dimensions, None or
    -1, are skipped): dp divides the batch, tp divides the query heads and the KV heads, so every
    rank holds whole sequences and each KV head with the query heads of its group."""
    _check_degrees(input_layout, dp, tp)
    batch, _, q_heads, _ = split_heads("query", query_shape, input_layout, head_num)
    _, _, kv_heads, _ = split_heads("key", key_shape, input_layout, None if input_layout == "BSH" else head_num)
    if batch is not None and batch % dp:
        raise ValueError(f"query: batch {batch} is not divisible by dp={dp} (each rank takes whole sequences)")
    if q_heads is not None and q_heads % tp:
        raise ValueError(f"query: {q_heads} heads are not divisible by tp={tp}")
    if kv_heads is not None and kv_heads % tp:
        raise ValueError(f"key: {kv_heads} KV heads are not divisible by tp={tp} (a KV head and the query heads "
                         f"of its group must stay on one rank)")
