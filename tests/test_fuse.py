"""fuse() in the main environment: this project's own models (reported "already fused"), sites no
family recognises, the report as a value and a table, strict and dry runs, bad arguments. The
third-party families are tested in their libraries' environments (tests/test_fuse_thirdparty.py)."""
import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, nn

from ms_rope_attention import FuseError, FuseReport, RotaryFlashAttention, fuse, unfuse
from models.llama import LlamaForCausalLM, preset


class SelfAttention(nn.Cell):
    """An attention class no family knows."""

    def construct(self, x):
        return x


class Block(nn.Cell):
    def __init__(self):
        super().__init__()
        self.attn = RotaryFlashAttention(2, 8)
        self.other = SelfAttention()
        self.dense = nn.Dense(4, 4)

    def construct(self, x):
        return self.dense(x)


def test_this_projects_llama_is_already_fused():
    model = LlamaForCausalLM(preset("tiny"))
    report = fuse(model, strict=True)
    assert isinstance(report, FuseReport) and report.all_fused and not report.fused
    layers = preset("tiny").num_hidden_layers
    assert [s.name for s in report] == [f"model.layers.{i}.self_attn" for i in range(layers)]
    assert {(s.family, s.status) for s in report} == {("ms_rope_attention", "already fused")}
    assert unfuse(model) == []


def test_every_site_gets_a_row_and_the_report_prints_as_a_table():
    net = Block()
    report = fuse(net)
    assert [(s.name, s.outcome) for s in report] == [
        ("attn", "already fused"), ("other", "not fused: no fuse family recognises test_fuse.SelfAttention")]
    assert report["other"].family is None and report.not_fused == ["other"] and not report.all_fused
    lines = str(report).splitlines()
    assert lines[0] == "fuse: 0 fused, 1 not fused, 1 already fused"
    assert lines[1].split() == ["site", "family", "outcome", "probe", "error"] and set(lines[2]) == {"-", " "}
    assert lines[4].startswith("other  -") and "no fuse family recognises" in lines[4]
    with pytest.raises(KeyError):
        report["missing"]
    with pytest.raises(FuseError, match="1 site"):
        fuse(net, strict=True)
    assert str(fuse(net, dry_run=True)).startswith("fuse (dry run): ")


def test_a_network_without_attention():
    net = nn.Dense(4, 4)
    report = fuse(net)
    assert len(report) == 0 and not report.all_fused
    with pytest.raises(FuseError, match="no attention site found"):
        fuse(net, strict=True)


def test_what_is_not_a_network_is_refused():
    with pytest.raises(TypeError, match="net: expected a mindspore.nn.Cell or a module with named_modules"):
        fuse(np.zeros(3))


def test_fused_models_still_run():
    ms.set_context(mode=ms.PYNATIVE_MODE)
    model = LlamaForCausalLM(preset("tiny"))
    fuse(model)
    out = model(Tensor(np.array([[1, 2, 3]], np.int32)))
    assert np.isfinite((out[0] if isinstance(out, tuple) else out).asnumpy()).all()
