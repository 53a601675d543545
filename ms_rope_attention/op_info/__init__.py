"""The seven ops' contracts (``rotary_flash_attention.yaml``; the paged cache's
``rotary_paged_attention.yaml`` and ``rotary_cache_write.yaml``; the CPU ops around the attention:
``linear.yaml``, the MLP's ``swiglu.yaml``, ``embedding.yaml`` and ``rms_norm.yaml``) and what is generated from them.

Everything that describes an op's interface -- MindSpore ``CustomRegOp`` registrations for each
backend, the Python argument checks and the semantics tables in docs/semantics.md -- is derived from
the YAML files beside this module, so the backends cannot drift apart.
"""
from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

CONTRACT_PATH = Path(__file__).with_name("rotary_flash_attention.yaml")
PAGED_ATTENTION_PATH = Path(__file__).with_name("rotary_paged_attention.yaml")
CACHE_WRITE_PATH = Path(__file__).with_name("rotary_cache_write.yaml")
LINEAR_PATH = Path(__file__).with_name("linear.yaml")
SWIGLU_PATH = Path(__file__).with_name("swiglu.yaml")
EMBEDDING_PATH = Path(__file__).with_name("embedding.yaml")
RMS_NORM_PATH = Path(__file__).with_name("rms_norm.yaml")
# The contracts docs/semantics.md shows below the attention's own table, in its order.
OTHER_CONTRACTS = (PAGED_ATTENTION_PATH, CACHE_WRITE_PATH, LINEAR_PATH, SWIGLU_PATH, EMBEDDING_PATH, RMS_NORM_PATH)

_REG_TYPES = {"int": "int", "float": "float", "bool": "bool", "str": "str"}
_PY_TYPES = {"int": int, "float": float, "bool": bool, "str": str}


@dataclass(frozen=True)
class Contract:
    """Parsed contract: plain dictionaries straight from the YAML, plus convenient lookups."""

    op_name: str
    inputs: tuple
    outputs: tuple
    attrs: tuple
    semantics: dict
    summary: str
    backward: "Contract | None" = None  # the gradient op: the forward's inputs, then its own; same attrs

    def attr(self, name: str) -> dict:
        for attr in self.attrs:
            if attr["name"] == name:
                return attr
        raise KeyError(name)

    def input(self, name: str) -> dict:
        for item in self.inputs:
            if item["name"] == name:
                return item
        raise KeyError(name)

    @property
    def attr_defaults(self) -> dict:
        return {a["name"]: a["default"] for a in self.attrs}


@functools.lru_cache(maxsize=None)
def load_contract(path: str | None = None) -> Contract:
    """Read and sanity-check the YAML contract (a malformed contract fails loudly at import)."""
    raw = yaml.safe_load(Path(path or CONTRACT_PATH).read_text())
    for attr in raw["attrs"]:
        kind = attr["type"]
        if kind not in _PY_TYPES:
            raise ValueError(f"op_info: attr {attr['name']!r} has unknown type {kind!r}")
        if not isinstance(attr["default"], _PY_TYPES[kind]) and not (kind == "float" and isinstance(attr["default"], int)):
            raise ValueError(f"op_info: default of attr {attr['name']!r} is not a {kind}")
        if "values" in attr and attr["default"] not in attr["values"]:
            raise ValueError(f"op_info: default of attr {attr['name']!r} is not one of {attr['values']}")
    backward = None
    if "backward" in raw:
        grad = raw["backward"]
        backward = Contract(op_name=grad["op_name"], inputs=tuple(raw["inputs"]) + tuple(grad["inputs"]),
                            outputs=tuple(grad["outputs"]), attrs=tuple(raw["attrs"]),
                            semantics=dict(grad["semantics"]), summary=grad["summary"])
    return Contract(op_name=raw["op_name"], inputs=tuple(raw["inputs"]), outputs=tuple(raw["outputs"]),
                    attrs=tuple(raw["attrs"]), semantics=dict(raw["semantics"]), summary=raw["summary"],
                    backward=backward)


def dtype_combinations(contract: Contract) -> list[tuple[str, ...]]:
    """Every dtype combination the contract allows: one dtype name per input then per output.

    Inputs tied by ``same_dtype_as`` share one dtype; outputs follow their ``dtype`` rule.
    """
    free = [item for item in contract.inputs if "same_dtype_as" not in item]
    rows = []
    for combo in itertools.product(*[item["dtypes"] for item in free]):
        chosen = dict(zip((item["name"] for item in free), combo))
        for item in contract.inputs:
            if "same_dtype_as" in item:
                chosen[item["name"]] = chosen[item["same_dtype_as"]]
        row = [chosen[item["name"]] for item in contract.inputs]
        for out in contract.outputs:
            rule = out["dtype"]
            row.append(chosen[rule[len("same_as_"):]] if rule.startswith("same_as_") else rule)
        rows.append(tuple(row))
    return rows


def _ms_dtype_formats(contract: Contract) -> list[tuple]:
    """``dtype_combinations`` as MindSpore ``DataType`` rows."""
    from mindspore.ops import DataType

    names = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64", "int32": "I32", "uint8": "U8"}
    return [tuple(getattr(DataType, f"{names[d]}_Default") for d in row) for row in dtype_combinations(contract)]


def opdef_source(backward: bool = False) -> str:
    """The body of a CANN ``OpDef`` (inputs, outputs, attrs, dtype columns) for aclnn/op_host: the forward's
    (``rotary_flash_attention_opdef.h``), or with ``backward=True`` the gradient op's
    (``rotary_flash_attention_grad_opdef.h``).

    Column i of every DataType list is one supported combination, so the lists are generated, never
    edited by hand (a misaligned column would silently change what the op accepts).
    """
    contract = load_contract()
    if backward:
        contract = contract.backward
    ge = {"float32": "ge::DT_FLOAT", "float16": "ge::DT_FLOAT16", "bfloat16": "ge::DT_BF16", "int64": "ge::DT_INT64"}
    rows = dtype_combinations(contract)
    fmt = "{" + ", ".join(["ge::FORMAT_ND"] * len(rows)) + "}"
    command = "python -m ms_rope_attention.op_info --opdef" + (" --backward" if backward else "")
    lines = [f"// Generated from op_info/rotary_flash_attention.yaml by `{command}`;",
             "// do not edit (tests/test_op_info.py checks it is current)."]
    tensors = [("Input", i, item) for i, item in enumerate(contract.inputs)]
    tensors += [("Output", len(contract.inputs) + i, item) for i, item in enumerate(contract.outputs)]
    for kind, column, item in tensors:
        types = "{" + ", ".join(ge[row[column]] for row in rows) + "}"
        param = "OPTIONAL" if item.get("optional") else "REQUIRED"
        line = f'this->{kind}("{item["name"]}").ParamType({param}).DataType({types}).Format({fmt})'
        if item.get("value_depend"):
            line += ".ValueDepend(OPTIONAL)"  # the tiling reads the data on the host
        elif kind == "Input":
            line += ".AutoContiguous()"  # the kernel reads its inputs as dense arrays
        lines.append(line + ";")
    setters = {"int": "Int", "str": "String", "float": "Float", "bool": "Bool"}
    for attr in contract.attrs:
        default = attr["default"]
        kind = attr["type"]
        value = f'"{default}"' if kind == "str" else str(default).lower() if kind == "bool" else (
            repr(float(default)) if kind == "float" else str(default))
        lines.append(f'this->Attr("{attr["name"]}").AttrType(OPTIONAL).{setters[attr["type"]]}({value});')
    return "\n".join(lines) + "\n"


def output_shapes(query_shape, key_shape, attr_values: dict[str, Any]) -> tuple[tuple, tuple, tuple]:
    """The shapes of attention_out, softmax_lse and rotated_key for a call with these query/key
    shapes and attribute values (the contract's names; missing ones take its defaults): the rule
    the kernels' InferShape implements. A disabled output is (0,)."""
    values = {**load_contract().attr_defaults, **attr_values}
    q, layout = tuple(query_shape), values["input_layout"]
    if not values["with_softmax_lse"]:
        lse = (0,)
    elif layout == "TND":
        lse = (q[0], q[1])
    elif layout == "BNSD":
        lse = (q[0], q[1], q[2])
    elif layout == "BSND":
        lse = (q[0], q[2], q[1])
    else:
        lse = (q[0], values["head_num"], q[1])
    return q, lse, tuple(key_shape) if values["with_rotated_key"] else (0,)


def attr_values(contract: Contract, given: dict[str, Any]) -> dict[str, Any]:
    """Every attribute of ``contract`` with ``given`` over its defaults, as the kernel reads them;
    an unknown name or a value outside the contract's ``values`` is a ValueError naming it."""
    unknown = set(given) - set(contract.attr_defaults)
    if unknown:
        raise ValueError(f"{contract.op_name}: unknown attribute(s) {sorted(unknown)}; "
                         f"expected some of {sorted(contract.attr_defaults)}")
    values = {}
    for attr in contract.attrs:
        value = given.get(attr["name"], attr["default"])
        kind = _PY_TYPES[attr["type"]]
        if isinstance(value, bool) != (kind is bool) or not isinstance(value, (int, float) if kind is float else kind):
            raise ValueError(f"{attr['name']}: expected a {attr['type']}, got {value!r}")
        if "values" in attr and value not in attr["values"]:
            raise ValueError(f"{attr['name']}: expected one of {attr['values']}, got {value!r}")
        values[attr["name"]] = kind(value)
    return values


def build_reg_info(target: str, attr_values: dict[str, Any], *, any_dtype: bool = False, backward: bool = False,
                   contract: Contract | None = None):
    """The ``CustomRegOp`` op-info for one backend, with the attribute values of one op instance;
    ``backward=True`` for the gradient op; ``contract``: another op's, by default
    RotaryFlashAttention's.

    ``any_dtype=True`` registers ``None_None`` formats: the CPU aot kernel checks dtypes itself
    (with clearer messages than MindSpore's kernel selection), and optional inputs arrive as "none".
    """
    from mindspore.ops import CustomRegOp, DataType

    contract = contract or load_contract()
    if backward:
        contract = contract.backward
    unknown = set(attr_values) - set(contract.attr_defaults)
    if unknown:
        raise KeyError(f"unknown attribute(s) {sorted(unknown)}; the contract has {sorted(contract.attr_defaults)}")
    reg = CustomRegOp(contract.op_name)
    for index, item in enumerate(contract.inputs):
        reg = reg.input(index, item["name"], "optional" if item.get("optional") else "required")
    for index, item in enumerate(contract.outputs):
        reg = reg.output(index, item["name"], "required")
    n_tensors = len(contract.inputs) + len(contract.outputs)
    if any_dtype:
        reg = reg.dtype_format(*[DataType.None_None] * n_tensors)
    else:
        for row in _ms_dtype_formats(contract):
            reg = reg.dtype_format(*row)
    for attr in contract.attrs:
        value = attr_values.get(attr["name"], attr["default"])
        value = _PY_TYPES[attr["type"]](value)
        reg = reg.attr(attr["name"], "required", _REG_TYPES[attr["type"]], value=value)
    if target == "CPU":
        # MindSpore's PyNative kernel cache keys float attributes by a short decimal text, so 1e-20
        # and 0.0 (the "default" scale) would share one kernel; the exact text of every float
        # attribute, as an extra string attribute, keeps their kernels apart. The kernel ignores it.
        for attr in contract.attrs:
            if attr["type"] == "float":
                text = repr(float(attr_values.get(attr["name"], attr["default"])))
                reg = reg.attr(f"{attr['name']}_text", "required", "str", value=text)
    return reg.target(target).get_op_info()


def markdown_table(contract: Contract | None = None) -> str:
    """A semantics table of docs/semantics.md, generated from a contract (RotaryFlashAttention's,
    with its backward, by default)."""
    contract = contract or load_contract()
    lines = ["| kind | name | type / dtypes | default | meaning |", "|---|---|---|---|---|"]
    for item in contract.inputs:
        kind = "input (optional)" if item.get("optional") else "input"
        lines.append(f"| {kind} | `{item['name']}` | {', '.join(item['dtypes'])} | | {item['doc']} |")
    for item in contract.outputs:
        lines.append(f"| output | `{item['name']}` | {item['dtype']} | | {item['doc']} |")
    for attr in contract.attrs:
        allowed = f" in {attr['values']}" if "values" in attr else ""
        lines.append(f"| attr | `{attr['name']}` | {attr['type']}{allowed} | `{attr['default']}` | {attr['doc']} |")
    for key, text in contract.semantics.items():
        lines.append(f"| rule | {key} | | | {text} |")
    grad = contract.backward
    if grad is None:
        return "\n".join(lines)
    forward_inputs = len(contract.inputs)
    for item in grad.inputs[forward_inputs:]:
        kind = "grad input (optional)" if item.get("optional") else "grad input"
        lines.append(f"| {kind} | `{item['name']}` | {', '.join(item['dtypes'])} | | {item['doc']} |")
    for item in grad.outputs:
        lines.append(f"| grad output | `{item['name']}` | {item['dtype']} | | {item['doc']} |")
    for key, text in grad.semantics.items():
        lines.append(f"| grad rule | {key} | | | {text} |")
    return "\n".join(lines)

