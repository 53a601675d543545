"""The op contract is the single source: registrations, checks and the docs/semantics.md table agree with it."""
import itertools
import re
from pathlib import Path

import pytest
import yaml

from ms_rope_attention import checks
from ms_rope_attention.op_info import (CONTRACT_PATH, EMBEDDING_PATH, LINEAR_PATH, OTHER_CONTRACTS,
                                      PAGED_ATTENTION_PATH, RMS_NORM_PATH, SWIGLU_PATH, attr_values, build_reg_info,
                                      load_contract, markdown_table, opdef_source)

ROOT = Path(__file__).resolve().parents[1]


FORWARD_AND_BACKWARD = pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])

# Tensors of either op that share one dtype in every combination: query's (3 choices), the tables'
# (3 choices, independent of query's), the log-sum-exps and the TND offsets.
SAME_DTYPE = {"query": {"query", "key", "value", "attention_out", "rotated_key", "d_attention_out", "d_rotated_key",
                        "d_query", "d_key", "d_value"},
              "cos": {"cos", "sin"}, "float32": {"softmax_lse", "d_softmax_lse"},
              "int64": {"actual_seq_qlen", "actual_seq_kvlen"}}


def contract_of(backward: bool):
    return load_contract().backward if backward else load_contract()


@FORWARD_AND_BACKWARD
@pytest.mark.parametrize("target,any_dtype", [("CPU", True), ("Ascend", False)])
def test_reg_info_matches_contract(target, any_dtype, backward):
    contract = contract_of(backward)
    info = build_reg_info(target, {"scale": 0.5, "input_layout": "TND"}, any_dtype=any_dtype, backward=backward)
    assert info["op_name"] == contract.op_name and info["target"] == target
    assert [i["name"] for i in info["inputs"]] == [i["name"] for i in contract.inputs]
    assert [i["paramType"] for i in info["inputs"]] == ["optional" if i.get("optional") else "required"
                                                         for i in contract.inputs]
    assert [o["name"] for o in info["outputs"]] == [o["name"] for o in contract.outputs]
    attrs = {a["name"]: a for a in info["attr"]}
    text_attrs = [f"{a['name']}_text" for a in contract.attrs if a["type"] == "float"] if target == "CPU" else []
    assert list(attrs) == [a["name"] for a in contract.attrs] + text_attrs
    if target == "CPU":
        assert attrs["scale_text"]["value"] == "0.5"  # the exact text keeps PyNative's kernel cache apart
    assert attrs["scale"]["value"] == 0.5 and attrs["input_layout"]["value"] == "TND"
    assert attrs["causal"]["value"] is True and attrs["rotary_mode"]["value"] == 0
    formats = info["dtype_format"]
    if any_dtype:
        assert len(formats) == 1
        return
    names = [i["name"] for i in contract.inputs] + [o["name"] for o in contract.outputs]
    assert sorted(names) == sorted(n for group in SAME_DTYPE.values() for n in group if n in names)  # each in one group
    pairs = set()
    for row in formats:  # query's dtype x the tables' dtype: 9 combinations
        dtype = dict(zip(names, (entry[0] for entry in row), strict=True))
        shared = {key: {dtype[n] for n in group if n in dtype} for key, group in SAME_DTYPE.items()}
        assert all(len(dtypes) == 1 for dtypes in shared.values()), shared
        assert shared["float32"] == {"float32"} and shared["int64"] == {"int64"}
        pairs.add((dtype["query"], dtype["cos"]))
    assert len(formats) == 9 and pairs == set(itertools.product(["float32", "float16", "bfloat16"], repeat=2))


def test_unknown_attribute_rejected():
    with pytest.raises(KeyError, match="unknown attribute"):
        build_reg_info("CPU", {"softmax_scale": 1.0})


def test_checks_use_contract_values():
    raw = yaml.safe_load(CONTRACT_PATH.read_text())
    attrs = {a["name"]: a for a in raw["attrs"]}
    assert list(checks.LAYOUTS) == attrs["input_layout"]["values"]
    assert list(checks.ROTARY_MODES) == attrs["rotary_mode"]["values"]


CSRC = ROOT / "ms_rope_attention/csrc"
ATTRIBUTE_READ = r'extra->Get(?:Int|Str|Float|Bool)\("(\w+)"\)'


def test_one_attribute_reader_reads_the_contracts_attributes():
    """The C++ entries read attributes by name, in one reader (aot_attrs.h): every name it reads is
    one of the contracts', and every contract's attribute is read; no entry reads one itself."""
    read = set(re.findall(ATTRIBUTE_READ, (CSRC / "aot_attrs.h").read_text()))
    assert read == {a["name"] for path in (CONTRACT_PATH, *OTHER_CONTRACTS) for a in load_contract(str(path)).attrs}
    for entry in ("rfa_cpu_aot.cc", "rfa_cpu_paged.cc"):
        source = (CSRC / entry).read_text()
        assert "rfa::InitAttrs(" in source and not re.findall(ATTRIBUTE_READ, source), entry


def test_semantics_table_is_generated():
    semantics = (ROOT / "docs/semantics.md").read_text()
    assert markdown_table() in semantics, \
        "docs/semantics.md table is stale: paste `python -m ms_rope_attention.op_info`"


@pytest.mark.parametrize("path", OTHER_CONTRACTS, ids=lambda path: path.stem)
def test_the_other_contracts_tables_are_generated(path):
    """Each other op's table in docs/semantics.md is its contract's: one contracts page for the seven ops."""
    assert markdown_table(load_contract(str(path))) in (ROOT / "docs/semantics.md").read_text(), \
        "docs/semantics.md's other tables are stale: paste `python -m ms_rope_attention.op_info --others`"


DTYPE_ROWS = {"linear": [("float32", weight, "float32") for weight in ("float32", "float16", "bfloat16", "uint8")],
              "swiglu": [("float32", weight, weight, "float32") for weight in ("float32", "float16", "bfloat16", "uint8")],
              "embedding": [(ids, table, "float32") for ids in ("int32", "int64")
                            for table in ("float32", "float16", "bfloat16")],
              "rms_norm": [("float32", "float32", "float32")]}


@pytest.mark.parametrize("path", [LINEAR_PATH, SWIGLU_PATH, EMBEDDING_PATH, RMS_NORM_PATH], ids=lambda path: path.stem)
def test_the_projection_registrations_follow_their_contracts(path):
    """linear's, swiglu's, embedding's and rms_norm's CPU registrations list each dtype combination of the
    contract, in its order (swiglu's two weights always of one dtype), and its attributes (compute_dtype,
    rms_norm's eps) with their defaults; a float attribute also as its exact text (build_reg_info says why)."""
    contract = load_contract(str(path))
    info = build_reg_info("CPU", {}, contract=contract)
    assert info["op_name"] == contract.op_name
    texts = [(f"{a['name']}_text", repr(float(a["default"]))) for a in contract.attrs if a["type"] == "float"]
    assert [(a["name"], a["value"]) for a in info["attr"]] == [(a["name"], a["default"]) for a in contract.attrs] + texts
    assert [i["name"] for i in info["inputs"]] == [i["name"] for i in contract.inputs]
    assert [tuple(entry[0] for entry in row) for row in info["dtype_format"]] == DTYPE_ROWS[path.stem]


def test_paged_attribute_values_are_checked():
    contract = load_contract(str(PAGED_ATTENTION_PATH))
    assert attr_values(contract, {})["key_rotated"] is True
    with pytest.raises(ValueError, match="rotary_mode: expected one of"):
        attr_values(contract, {"rotary_mode": 2})
    with pytest.raises(ValueError, match="unknown attribute"):
        attr_values(contract, {"input_layout": "TND"})
    with pytest.raises(ValueError, match="key_rotated: expected a bool"):
        attr_values(contract, {"key_rotated": 1})


ACLNN = ROOT / "ms_rope_attention/aclnn"
GE_TO_REG = {"ge::DT_FLOAT": "float32", "ge::DT_FLOAT16": "float16", "ge::DT_BF16": "bfloat16", "ge::DT_INT64": "int64"}


OPDEF = {False: "op_host/rotary_flash_attention_opdef.h", True: "op_host/rotary_flash_attention_grad_opdef.h"}


@FORWARD_AND_BACKWARD
def test_ascend_opdef_is_generated_from_the_contract(backward):
    flag = " --backward" if backward else ""
    assert (ACLNN / OPDEF[backward]).read_text() == opdef_source(backward), \
        f"stale OpDef: run `python -m ms_rope_attention.op_info --opdef{flag} > ms_rope_attention/aclnn/{OPDEF[backward]}`"


@FORWARD_AND_BACKWARD
def test_ascend_opdef_reg_info_and_contract_agree(backward):
    """Names, optionality and every dtype column of the OpDef equal the MindSpore Ascend reg_info and
    the contract; only the TND offsets, whose data the tiling reads on the host, are value-dependent."""
    contract = contract_of(backward)
    text = (ACLNN / OPDEF[backward]).read_text()
    tensors = re.findall(r'this->(Input|Output)\("(\w+)"\)\.ParamType\((\w+)\)\.DataType\(\{([^}]*)\}\)([^;]*);', text)
    info = build_reg_info("Ascend", {}, backward=backward)
    inputs = [(name, param) for kind, name, param, _, _ in tensors if kind == "Input"]
    assert [name for name, _ in inputs] == [i["name"] for i in info["inputs"]] == [i["name"] for i in contract.inputs]
    assert [name for kind, name, _, _, _ in tensors if kind == "Output"] == [o["name"] for o in info["outputs"]] == [
        o["name"] for o in contract.outputs]
    assert [param == "OPTIONAL" for _, param in inputs] == [i["paramType"] == "optional" for i in info["inputs"]] == [
        bool(i.get("optional")) for i in contract.inputs]
    assert [name for _, name, _, _, rest in tensors if "ValueDepend" in rest] == ["actual_seq_qlen", "actual_seq_kvlen"]
    columns = [[GE_TO_REG[t.strip()] for t in types.split(",")] for _, _, _, types, _ in tensors]
    opdef_rows = sorted(zip(*columns))
    reg_rows = sorted(tuple(entry[0] for entry in row) for row in info["dtype_format"])
    assert opdef_rows == reg_rows
    attrs = re.findall(r'this->Attr\("(\w+)"\)', text)
    assert attrs == [a["name"] for a in contract.attrs] == [a["name"] for a in info["attr"]]


def test_ascend_host_reads_attributes_in_contract_order():
    """Both ops' host sides read the attributes by index (rfa_host_common.h), in the contract's order."""
    contract = load_contract()
    assert contract.backward.attrs == contract.attrs
    host = (ACLNN / "op_host/rfa_host_common.h").read_text()
    enum = re.search(r"enum AttrIndex \{([^}]*)\}", host).group(1)
    camel = ["k" + "".join(part.title() for part in a["name"].split("_")) for a in contract.attrs]
    assert [e.strip() for e in enum.split(",")] == camel


@FORWARD_AND_BACKWARD
def test_ascend_kernel_entry_follows_the_contract(backward):
    """The msopgen template compiles op_kernel/<op_file>.cpp and calls its entry <op_file>, op_file
    being the op type in snake case (opbuild's default opFile.value and opInterface.value); the entry
    takes the op's inputs, then its outputs, the workspace and the tiling data."""
    contract = contract_of(backward)
    snake = re.sub(r"(?<!^)([A-Z])", r"_\1", contract.op_name).lower()
    entry = (ACLNN / "op_kernel" / f"{snake}.cpp").read_text()
    name, params = re.search(r'extern "C" __global__ __aicore__ void (\w+)\(([^)]*)\)', entry).groups()
    assert name == snake
    assert re.findall(r"GM_ADDR (\w+)", params) == [i["name"] for i in contract.inputs] + [
        o["name"] for o in contract.outputs] + ["workspace", "tiling"]
