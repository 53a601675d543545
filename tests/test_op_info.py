"""The op contract is the single source: registrations, checks and the README table agree with it."""
import re
from pathlib import Path

import pytest
import yaml

from ms_rope_attention import checks
from ms_rope_attention.op_info import CONTRACT_PATH, build_reg_info, load_contract, markdown_table

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
    assert list(attrs) == [a["name"] for a in contract.attrs]
    assert attrs["scale"]["value"] == 0.5 and attrs["input_layout"]["value"] == "TND"
    assert attrs["causal"]["value"] is True and attrs["rotary_mode"]["value"] == 0
    formats = info["dtype_format"]
    if any_dtype:
        assert len(formats) == 1
    else:  # q/k/v share one of 3 dtypes, cos and sin 3 each: 27 combinations
        assert len(formats) == 27
        for row in formats:
            q, k, v, cos, sin, aq, akv, out, lse, rk = (entry[0] for entry in row)
            assert q == k == v == out == rk and lse == "float32" and aq == akv == "int64"


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


def test_readme_table_is_generated():
    readme = (ROOT / "README.md").read_text()
    assert markdown_table() in readme, "README table is stale: paste `python -m ms_rope_attention.op_info`"
