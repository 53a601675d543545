"""The op contract is the single source: registrations, checks and the docs/semantics.md table agree with it."""
import re
from pathlib import Path

import pytest
import yaml

from ms_rope_attention import checks
from ms_rope_attention.op_info import CONTRACT_PATH, build_reg_info, load_contract, markdown_table, opdef_source

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("target,any_dtype", [("CPU", True), ("Ascend", False)])
def test_reg_info_matches_contract(target, any_dtype):
    contract = load_contract()
    info = build_reg_info(target, {"scale": 0.5, "input_layout": "TND"}, any_dtype=any_dtype)
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
    else:  # q/k/v share one of 3 dtypes, the cos/sin pair one of 3: 9 combinations
        assert len(formats) == 9
        for row in formats:
            q, k, v, cos, sin, aq, akv, out, lse, rk = (entry[0] for entry in row)
            assert q == k == v == out == rk and cos == sin and lse == "float32" and aq == akv == "int64"


def test_unknown_attribute_rejected():
    with pytest.raises(KeyError, match="unknown attribute"):
        build_reg_info("CPU", {"softmax_scale": 1.0})


def test_checks_use_contract_values():
    raw = yaml.safe_load(CONTRACT_PATH.read_text())
    attrs = {a["name"]: a for a in raw["attrs"]}
    assert list(checks.LAYOUTS) == attrs["input_layout"]["values"]
    assert list(checks.ROTARY_MODES) == attrs["rotary_mode"]["values"]


def test_kernel_attribute_names_match_contract():
    """The C++ entry reads attributes by name: every name it reads is in the contract, and vice versa."""
    source = (ROOT / "ms_rope_attention/csrc/rfa_cpu_aot.cc").read_text()
    read = set(re.findall(r'extra->Get(?:Int|Str|Float|Bool)\("(\w+)"\)', source))
    assert read == {a["name"] for a in load_contract().attrs}


def test_semantics_table_is_generated():
    semantics = (ROOT / "docs/semantics.md").read_text()
    assert markdown_table() in semantics, \
        "docs/semantics.md table is stale: paste `python -m ms_rope_attention.op_info`"


ACLNN = ROOT / "ms_rope_attention/aclnn"
GE_TO_REG = {"ge::DT_FLOAT": "float32", "ge::DT_FLOAT16": "float16", "ge::DT_BF16": "bfloat16", "ge::DT_INT64": "int64"}


def test_ascend_opdef_is_generated_from_the_contract():
    assert (ACLNN / "op_host/rotary_flash_attention_opdef.h").read_text() == opdef_source(), \
        "stale OpDef: run `python -m ms_rope_attention.op_info --opdef > ms_rope_attention/aclnn/op_host/rotary_flash_attention_opdef.h`"


def test_ascend_opdef_reg_info_and_contract_agree():
    """Names, optionality and every dtype column of the OpDef equal the MindSpore Ascend reg_info."""
    contract = load_contract()
    text = (ACLNN / "op_host/rotary_flash_attention_opdef.h").read_text()
    tensors = re.findall(r'this->(Input|Output)\("(\w+)"\)\.ParamType\((\w+)\)\.DataType\(\{([^}]*)\}\)', text)
    info = build_reg_info("Ascend", {})
    assert [name for kind, name, _, _ in tensors if kind == "Input"] == [i["name"] for i in info["inputs"]]
    assert [name for kind, name, _, _ in tensors if kind == "Output"] == [o["name"] for o in info["outputs"]]
    assert [p == "OPTIONAL" for kind, _, p, _ in tensors if kind == "Input"] == [
        i["paramType"] == "optional" for i in info["inputs"]]
    columns = [[GE_TO_REG[t.strip()] for t in types.split(",")] for _, _, _, types in tensors]
    opdef_rows = sorted(zip(*columns))
    reg_rows = sorted(tuple(entry[0] for entry in row) for row in info["dtype_format"])
    assert opdef_rows == reg_rows
    attrs = re.findall(r'this->Attr\("(\w+)"\)', text)
    assert attrs == [a["name"] for a in contract.attrs] == [a["name"] for a in info["attr"]]


def test_ascend_host_and_kernel_follow_the_contract_order():
    contract = load_contract()
    host = (ACLNN / "op_host/rotary_flash_attention.cpp").read_text()
    enum = re.search(r"enum AttrIndex \{([^}]*)\}", host).group(1)
    camel = ["k" + "".join(part.title() for part in a["name"].split("_")) for a in contract.attrs]
    assert [e.strip() for e in enum.split(",")] == camel
    entry = (ACLNN / "op_kernel/rotary_flash_attention.cpp").read_text()
    params = re.findall(r"GM_ADDR (\w+)", entry)
    assert params == [i["name"] for i in contract.inputs] + [o["name"] for o in contract.outputs] + [
        "workspace", "tiling"]
