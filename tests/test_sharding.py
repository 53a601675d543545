"""Semi-auto parallel layouts of the fused op's primitives (ms_rope_attention/layouts.py).

A CPU refuses semi-auto parallel, so what is checked here is what can be: the layouts MindSpore
stores on the real primitives (the Ascend aot primitive, constructible without an NPU, and the CPU
forward and gradient primitives), their count against the contract, the refused splits, and that a
sharded op outside a parallel context runs as the unsharded one. The compile and numerics on
hardware: ms_rope_attention/aclnn/verify_on_ascend.sh (tests/ascend/semi_auto_parallel.py).
"""
import dataclasses
import inspect

import numpy as np
import pytest
from mindspore import Tensor, nn, ops

import ms_rope_attention as mra
from ms_rope_attention import functional, layouts
from ms_rope_attention.attrs import OpAttrs
from ms_rope_attention.op_info import load_contract

R = -1  # "None" in a tensor map: replicated along that dimension
TABLE = (R, R)
OFFSETS = (R,)

# Expected layouts, written out: tensor maps in Layout's numbering for the device matrix (dp, tp),
# dp -> 1, tp -> 0. Keyed by (input_layout, dp, tp, with_rotated_key).
FORWARD = {
    ("BNSD", 2, 2, False): ([(1, 0, R, R)] * 3 + [TABLE] * 2,
                            [(1, 0, R, R), (1, 0, R), (R,)]),
    ("BSND", 2, 4, True): ([(1, R, 0, R)] * 3 + [TABLE] * 2,
                           [(1, R, 0, R), (1, 0, R), (1, R, 0, R)]),
    ("BSND", 1, 2, False): ([(1, R, 0, R)] * 3 + [TABLE] * 2,
                            [(1, R, 0, R), (1, 0, R), (R,)]),
    ("BSH", 4, 1, False): ([(1, R, R)] * 3 + [TABLE] * 2,
                           [(1, R, R), (1, R, R), (R,)]),
    ("TND", 1, 2, True): ([(R, 0, R)] * 3 + [TABLE] * 2 + [OFFSETS] * 2,
                          [(R, 0, R), (R, 0), (R, 0, R)]),
}
# The gradient primitive: the forward's inputs, attention_out, softmax_lse, d_attention_out, then
# d_softmax_lse / d_rotated_key when those gradients are used. Keyed by (input_layout, dp, tp,
# lse used, rotated_key used).
BACKWARD = {
    ("BNSD", 2, 2, False, False): ([(1, 0, R, R)] * 3 + [TABLE] * 2 + [(1, 0, R, R), (1, 0, R), (1, 0, R, R)],
                                   [(1, 0, R, R)] * 3),
    ("BSND", 2, 1, True, False): ([(1, R, 0, R)] * 3 + [TABLE] * 2
                                  + [(1, R, 0, R), (1, 0, R), (1, R, 0, R), (1, 0, R)],
                                  [(1, R, 0, R)] * 3),
    ("TND", 1, 2, True, True): ([(R, 0, R)] * 3 + [TABLE] * 2 + [OFFSETS] * 2
                                + [(R, 0, R), (R, 0), (R, 0, R), (R, 0), (R, 0, R)],
                                [(R, 0, R)] * 3),
}


def _stored(primitive, name, dp, tp):
    """The tensor maps of the primitive's stored ``in_layout``/``out_layout``, after checking that
    every entry is on the (dp, tp) device matrix with the aliases dp, tp."""
    layouts = primitive.attrs[name]
    for entry in layouts:
        assert entry["device_matrix"] == (dp, tp) and entry["alias_name"] == ("dp", "tp")
        assert entry["interleaved_parallel"] is False
    return [entry["tensor_map"] for entry in layouts]


def _grad_primitive(forward):
    """The CPU forward's gradient primitive: the ``grad_op`` its bprop (gradients.fused_bprop) calls."""
    return inspect.getclosurevars(forward.bprop).nonlocals["grad_op"]


def _cell_op(layout, dp, tp, with_rotated_key=False, **kwargs):
    return mra.RotaryFlashAttentionOp(4, layout, with_rotated_key=with_rotated_key, **kwargs).semi_auto_shard(dp, tp)


def _assert_layouts(primitive, expected, dp, tp):
    """``primitive`` marked self-defined-shard, with the expected (in, out) tensor maps stored."""
    assert primitive.attrs["self_define_shard"] is True
    expected_in, expected_out = expected
    assert _stored(primitive, "in_layout", dp, tp) == expected_in
    assert _stored(primitive, "out_layout", dp, tp) == expected_out


@pytest.mark.parametrize("key", list(FORWARD), ids=str)
def test_ascend_forward_primitive_layouts(key):
    from ms_rope_attention import ascend_kernel

    layout, dp, tp, with_rotated_key = key
    attrs = OpAttrs(head_num=4, input_layout=layout, with_rotated_key=with_rotated_key)
    kernel = ascend_kernel.make_kernel(attrs, functional.autodiff_forwards(attrs))
    layouts.shard(kernel, attrs, dp, tp)
    primitive = kernel.forward
    assert primitive.name == "Custom" and primitive.attrs["func_type"] == "aot"
    _assert_layouts(primitive, FORWARD[key], dp, tp)


@pytest.mark.parametrize("key", list(FORWARD), ids=str)
def test_cpu_forward_primitive_layouts(key):
    layout, dp, tp, with_rotated_key = key
    primitive = _cell_op(layout, dp, tp, with_rotated_key).sharded
    _assert_layouts(primitive, FORWARD[key], dp, tp)


@pytest.mark.parametrize("key", list(BACKWARD), ids=str)
def test_gradient_primitive_layouts(key):
    layout, dp, tp, lse_used, rotated_key_used = key
    op = _cell_op(layout, dp, tp, with_rotated_key=rotated_key_used, with_softmax_lse=lse_used)
    grad = _grad_primitive(op.sharded)
    _assert_layouts(grad, BACKWARD[key], dp, tp)


def test_layout_counts_follow_the_contract():
    contract = load_contract()
    required = [item for item in contract.inputs if not item.get("optional")]
    grad_required = [item for item in contract.backward.inputs if not item.get("optional")]
    assert (len(contract.inputs), len(required), len(contract.outputs)) == (7, 5, 3)
    assert (len(contract.backward.inputs), len(grad_required), len(contract.backward.outputs)) == (12, 8, 3)
    for layout in ("BNSD", "TND"):
        extra = 2 if layout == "TND" else 0  # the offsets, passed exactly for TND
        ins, outs = layouts.primitive_layouts({"input_layout": layout})
        assert (len(ins), len(outs)) == (len(required) + extra, len(contract.outputs))
        ins, outs = layouts.primitive_layouts({"input_layout": layout}, backward=True)
        assert (len(ins), len(outs)) == (len(grad_required) + extra, len(contract.backward.outputs))
        used = layouts.optional_inputs(layout, ["softmax_lse", "rotated_key"])
        ins, _ = layouts.primitive_layouts({"input_layout": layout}, backward=True, present=used)
        assert len(ins) == len(grad_required) + extra + 2


def test_a_contract_tensor_without_a_rule_is_refused(monkeypatch):
    """An input added to the YAML cannot shift the layouts silently."""
    contract = load_contract()
    mask = {"name": "attention_mask", "dtypes": ["bool"], "doc": "a new input"}
    grown = dataclasses.replace(contract, inputs=contract.inputs + (mask,))
    monkeypatch.setattr(layouts, "load_contract", lambda: grown)
    with pytest.raises(ValueError, match="attention_mask"):
        layouts.primitive_layouts({"input_layout": "BNSD"}, 2, 1)


@pytest.mark.parametrize("layout, dp, tp, message", [
    ("BSH", 1, 2, r"tp: expected 1 for input_layout='BSH', got 2: BSH fuses the heads"),
    ("TND", 2, 1, r"dp: expected 1 for input_layout='TND', got 2: TND concatenates"),
    ("BNSD", 0, 1, r"dp: expected a positive int, got 0"),
    ("BNSD", 1, True, r"tp: expected a positive int, got True"),
    ("BNSD", 2.0, 1, r"dp: expected a positive int, got 2.0"),
    ("NBSD", 1, 1, r"input_layout: expected one of"),
])
def test_refused_splits(layout, dp, tp, message):
    with pytest.raises(ValueError, match=message):
        layouts.primitive_layouts({"input_layout": layout}, dp, tp)
    with pytest.raises(ValueError, match=message):
        layouts.check_shard_shapes(layout, dp, tp, (2, 4, 8, 16), (2, 2, 8, 16), 4)


def test_refused_present_inputs():
    with pytest.raises(ValueError, match=r"present: \['d_softmax_lse'\] are not optional inputs of RotaryFlash"
                                         r"Attention \(those are \['actual_seq_kvlen', 'actual_seq_qlen'\]\)"):
        layouts.primitive_layouts({"input_layout": "BNSD"}, present={"d_softmax_lse"})


@pytest.mark.parametrize("layout, dp, tp, q_shape, k_shape, message", [
    ("BNSD", 2, 1, (3, 4, 8, 16), (3, 2, 8, 16), r"query: batch 3 is not divisible by dp=2"),
    ("BSH", 2, 1, (5, 8, 64), (5, 8, 32), r"query: batch 5 is not divisible by dp=2"),
    ("BSND", 1, 4, (2, 8, 6, 16), (2, 8, 2, 16), r"query: 6 heads are not divisible by tp=4"),
    ("BNSD", 1, 4, (2, 8, 8, 16), (2, 2, 8, 16), r"key: 2 KV heads are not divisible by tp=4 \(a KV head and"),
    ("TND", 1, 2, (10, 4, 16), (12, 1, 16), r"key: 1 KV heads are not divisible by tp=2"),
])
def test_refused_shapes(layout, dp, tp, q_shape, k_shape, message):
    with pytest.raises(ValueError, match=message):
        layouts.check_shard_shapes(layout, dp, tp, q_shape, k_shape, q_shape[-1] // 16 if layout == "BSH" else None)


def test_divisible_and_dynamic_shapes_pass():
    layouts.check_shard_shapes("BNSD", 2, 2, (4, 8, 8, 16), (4, 2, 8, 16))
    layouts.check_shard_shapes("BSH", 2, 1, (4, 8, 64), (4, 8, 32), 4)
    layouts.check_shard_shapes("BSND", 2, 2, (-1, -1, 8, 16), (-1, -1, 2, 16))  # dynamic batch: known at run time


def _inputs(layout, rng):
    if layout == "TND":
        q, k, v = (rng.standard_normal((t, n, 16)).astype(np.float32) for t, n in ((9, 4), (11, 2), (11, 2)))
        offsets = (Tensor(np.array([4, 9], np.int64)), Tensor(np.array([5, 11], np.int64)))
    else:
        q, k, v = (rng.standard_normal((2, n, 6, 16)).astype(np.float32) for n in (4, 2, 2))
        offsets = ()
    return [Tensor(x) for x in (q, k, v)], offsets


class _Loss(nn.Cell):
    def __init__(self, op, cos, sin):
        super().__init__()
        self.op, self.cos, self.sin = op, cos, sin

    def construct(self, q, k, v, *offsets):
        out, lse, _ = self.op(q, k, v, self.cos, self.sin, *offsets)
        return (out * out).sum() + lse.sum()


@pytest.mark.parametrize("layout", ["BNSD", "TND"])
def test_sharded_op_runs_as_the_unsharded_one_outside_a_parallel_context(layout, mode, rng):
    (q, k, v), offsets = _inputs(layout, rng)
    cos, sin = mra.shared_rope_tables(16, 32)
    plain = mra.RotaryFlashAttentionOp(4, layout, with_softmax_lse=True)
    sharded = mra.RotaryFlashAttentionOp(4, layout, with_softmax_lse=True).semi_auto_shard(dp=1 if layout == "TND"
                                                                                            else 2, tp=2)
    for a, b in zip(plain(q, k, v, cos, sin, *offsets), sharded(q, k, v, cos, sin, *offsets)):
        np.testing.assert_array_equal(a.asnumpy(), b.asnumpy())
    grad = ops.GradOperation(get_all=True)
    expected = grad(_Loss(plain, cos, sin))(q, k, v, *offsets)[:3]
    got = grad(_Loss(sharded, cos, sin))(q, k, v, *offsets)[:3]
    for a, b in zip(expected, got):
        assert np.abs(a.asnumpy()).max() > 0
        np.testing.assert_array_equal(a.asnumpy(), b.asnumpy())
    # The layouts live on the Cell's own primitives: the dispatch's shared primitive has none.
    shared = functional.backend_for(plain.attrs).fused
    assert "in_layout" not in shared.attrs and "self_define_shard" not in shared.attrs


def test_the_call_checks_the_global_shapes(mode, rng):
    (q, k, v), _ = _inputs("BNSD", rng)  # batch 2, 4 query heads, 2 KV heads
    cos, sin = mra.shared_rope_tables(16, 32)
    with pytest.raises(ValueError, match=r"key: 2 KV heads are not divisible by tp=4"):
        _cell_op("BNSD", 1, 4)(q, k, v, cos, sin)


def test_the_unfused_path_has_no_primitive_to_shard():
    with pytest.raises(ValueError, match=r"semi_auto_shard: the unfused path runs \(backend=unfused\)"):
        mra.RotaryFlashAttentionOp(4, "BNSD", backend="unfused").semi_auto_shard(2, 1)
