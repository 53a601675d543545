"""Every bad input raises a clear error naming the argument and what was expected, in PyNative
(functional) and GRAPH_MODE (Cell, at compile time), on both backends."""
import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, nn

import ms_rope_attention as mra


def t(shape, dtype=np.float32):
    return Tensor(np.ones(shape, dtype))


COS = t((16, 8))
GOOD = dict(query=t((1, 4, 5, 8)), key=t((1, 2, 5, 8)), value=t((1, 2, 5, 8)), cos=COS, sin=COS)

# (overrides of the inputs, attributes, exception type, message fragment)
BAD_INPUTS = [
    (dict(query=t((4, 5, 8))), {}, ValueError, "query: expected a rank-4 tensor (B, N, S, D)"),
    (dict(key=t((2, 2, 5, 8)), value=t((2, 2, 5, 8))), {}, ValueError, "key: batch 2 does not match query's batch 1"),
    (dict(key=t((1, 2, 5, 6)), value=t((1, 2, 5, 6))), {}, ValueError, "key: head_dim 6 does not match"),
    (dict(key=t((1, 3, 5, 8)), value=t((1, 3, 5, 8))), {}, ValueError, "must be a multiple of them"),
    (dict(value=t((1, 2, 4, 8))), {}, ValueError, "value: expected the same shape as key"),
    (dict(query=t((1, 4, 6, 8))), {}, ValueError, "q_len 6 must be <= kv_len 5"),
    ({}, dict(rotary_dim=5), ValueError, "rotary_dim: expected a positive even int"),
    ({}, dict(rotary_dim=10), ValueError, "rotary_dim: 10 exceeds head_dim 8"),
    (dict(cos=t((16, 4)), sin=t((16, 4))), {}, ValueError, "pass rotary_dim=4 for partial rotary"),
    (dict(cos=t((4, 8)), sin=t((4, 8))), {}, ValueError, "cos: table has 4 positions, kv_len 5 needs at least 5"),
    (dict(sin=t((12, 8))), {}, ValueError, "sin: expected the same shape as cos"),
    (dict(sin=t((16, 8), np.float16)), {}, TypeError, "sin: expected the same dtype as cos (float32), got float16"),
    (dict(cos=t((16, 8, 1))), {}, ValueError, "cos: expected a rank-2 table"),
    ({}, dict(input_layout="SBH"), ValueError, "input_layout: expected one of"),
    ({}, dict(rotary_mode=2), ValueError, "rotary_mode: expected one of [0, 1]"),
    ({}, dict(input_layout="BSH"), ValueError, "head_num: required for input_layout='BSH'"),
    ({}, dict(head_num=3), ValueError, "head_num: 3 does not match query's 4 heads"),
    ({}, dict(scale=-1.0), ValueError, "scale: expected a finite positive float"),
    (dict(query=t((1, 4, 5, 8), np.int32)), {}, TypeError, "query: expected dtype in ['float32', 'float16', 'bfloat16'], got int32"),
    (dict(key=t((1, 2, 5, 8), np.float16), value=t((1, 2, 5, 8), np.float16)), {}, TypeError,
     "key: expected the same dtype as query (float32), got float16"),
    (dict(cos=t((16, 8), np.int32)), {}, TypeError, "cos: expected a floating dtype"),
    (dict(query=t((1, 4, 5, 7)), key=t((1, 2, 5, 7)), value=t((1, 2, 5, 7))), dict(rotary_dim=6), ValueError,
     "head_dim must be even"),
    # Found by trying the op as a hostile caller would (issue 12): each once crashed or was accepted.
    (dict(query=t((1, 0, 5, 8))), {}, ValueError, "query: expected at least one head"),
    (dict(query=t((1, 4, 5, 0)), key=t((1, 2, 5, 0)), value=t((1, 2, 5, 0))), dict(rotary_dim=2), ValueError,
     "head_dim must be even and >= 2"),
    ({}, dict(scale=1e39), ValueError, "scale: expected a finite positive float within float32's normal range"),
    ({}, dict(scale=1e-39), ValueError, "scale: expected a finite positive float within float32's normal range"),
    ({}, dict(causal=1), ValueError, "causal: expected a bool, got 1"),
    ({}, dict(rotary_mode=True), ValueError, "rotary_mode: expected one of [0, 1]"),
    ({}, dict(rotary_dim=4.0), ValueError, "rotary_dim: expected a positive even int, got 4.0"),
    ({}, dict(head_num=True), ValueError, "head_num: expected a positive int, got True"),
    (dict(query=t((1, 5, 4, 8)), key=t((1, 5, 4, 8)), value=t((1, 5, 4, 8))), dict(input_layout="TND"), ValueError,
     "query: expected a rank-3 tensor (T, N, D) for input_layout='TND'"),
]


class OpNet(nn.Cell):
    def __init__(self, **attrs):
        super().__init__()
        self.op = mra.RotaryFlashAttentionOp(**attrs)

    def construct(self, q, k, v, cos, sin, aq=None, ak=None):
        return self.op(q, k, v, cos, sin, aq, ak)


@pytest.mark.parametrize("backend", ["auto", "unfused"])
@pytest.mark.parametrize("overrides,attrs,error,message", BAD_INPUTS)
def test_bad_input(mode, backend, overrides, attrs, error, message):
    inputs = {**GOOD, **overrides}
    if mode == "pynative":
        with pytest.raises(error) as info:
            mra.rotary_flash_attention(*inputs.values(), backend=backend, **attrs)
    else:
        with pytest.raises(error) as info:
            OpNet(backend=backend, **attrs)(*inputs.values())
    assert message in str(info.value)


TND = dict(query=t((5, 4, 8)), key=t((7, 2, 8)), value=t((7, 2, 8)), cos=COS, sin=COS)


@pytest.mark.parametrize("backend", ["auto", "unfused"])
@pytest.mark.parametrize("aq,ak,message", [
    (None, None, "both required for input_layout='TND'"),
    ([3, 2], [4, 7], "actual_seq_qlen: cumulative end offsets must be non-decreasing"),
    ([3, 4], [4, 7], "actual_seq_qlen: last offset must equal the token count 5"),
    ([3, 5], [4, 8], "actual_seq_kvlen: last offset must equal the token count 7"),
    ([5, 5], [4, 7], "actual_seq_qlen: sequence 0 has q_len 5 > kv_len 4"),
    ([3, 5], [7], "actual_seq_kvlen: expected 2 sequences"),
    (["a"], [7], "actual_seq_qlen: expected integer cumulative end offsets"),
    ([2.5, 5.0], [4, 7], "actual_seq_qlen: expected integer cumulative end offsets"),  # never truncated
    ([True, 5], [4, 7], "actual_seq_qlen: expected integer cumulative end offsets"),
    (Tensor(np.array([3, 5], np.int32)), [4, 7], "actual_seq_qlen: expected a 1-D int64 tensor"),
    (Tensor(np.array([3.0, 5.0], np.float32)), [4, 7], "actual_seq_qlen: expected a 1-D int64 tensor"),
    (Tensor(np.array([[3, 5]], np.int64)), [4, 7], "actual_seq_qlen: expected a 1-D int64 tensor of cumulative end offsets, got a rank-2"),
])
def test_bad_tnd_offsets_pynative(backend, aq, ak, message):
    ms.set_context(mode=ms.PYNATIVE_MODE)
    with pytest.raises((ValueError, TypeError), match=message.replace("(", r"\(").replace(")", r"\)")):
        mra.rotary_flash_attention(*TND.values(), input_layout="TND", actual_seq_qlen=aq, actual_seq_kvlen=ak,
                                   backend=backend)


def test_bad_tnd_offsets_graph_mode_kernel_reports():
    """Offsets are data: in GRAPH_MODE the kernel checks them before reading anything and fails."""
    from ms_rope_attention.cpu_kernel import last_error

    ms.set_context(mode=ms.GRAPH_MODE)
    net = OpNet(input_layout="TND")
    with pytest.raises(RuntimeError, match="AOT kernel"):
        net(*TND.values(), Tensor(np.array([3, 2], np.int64)), Tensor(np.array([4, 7], np.int64)))
    assert "non-decreasing" in last_error()


def test_offsets_rejected_outside_tnd():
    ms.set_context(mode=ms.PYNATIVE_MODE)
    with pytest.raises(ValueError, match="only for input_layout='TND'"):
        mra.rotary_flash_attention(*GOOD.values(), actual_seq_qlen=[5], actual_seq_kvlen=[5])


def test_non_tensor_rejected():
    with pytest.raises(TypeError, match="query: expected a mindspore Tensor"):
        mra.rotary_flash_attention(np.ones((1, 4, 5, 8)), *list(GOOD.values())[1:])
    with pytest.raises(TypeError, match="cos: expected a mindspore Tensor, got list"):
        mra.rotary_flash_attention(*list(GOOD.values())[:3], [[1.0] * 8] * 16, COS)


@pytest.mark.parametrize("flag", ["return_softmax_lse", "return_rotated_key", "key_rotated", "strict"])
@pytest.mark.parametrize("value", ["no", 1, None])
def test_flags_must_be_bools(flag, value):
    """Even after a valid call built and cached an op: 1 == True, but 1 is not a valid flag."""
    ms.set_context(mode=ms.PYNATIVE_MODE)
    mra.rotary_flash_attention(*GOOD.values())
    with pytest.raises(TypeError, match=f"{flag}: expected a bool, got {value!r}"):
        mra.rotary_flash_attention(*GOOD.values(), **{flag: value})


@pytest.mark.parametrize("attr,value", [("causal", 1), ("rotary_mode", True), ("rotary_dim", 8.0),
                                        ("head_num", True)])
def test_op_cache_does_not_conflate_equal_values_of_other_types(attr, value):
    ms.set_context(mode=ms.PYNATIVE_MODE)
    valid = {"causal": True, "rotary_mode": 1, "rotary_dim": 8, "head_num": 4}[attr]
    mra.rotary_flash_attention(*GOOD.values(), **{attr: valid})
    with pytest.raises(ValueError, match=attr):
        mra.rotary_flash_attention(*GOOD.values(), **{attr: value})


@pytest.mark.parametrize("scale", [1e-20, 1e-25, 3e-38])
def test_tiny_scale_is_honoured(scale, rng):
    """A tiny scale is not the 'default' sentinel: the scores vanish and attention is uniform."""
    from reference import reference

    ms.set_context(mode=ms.PYNATIVE_MODE)
    q, k, v = (rng.standard_normal(shape) for shape in ((1, 4, 5, 8), (1, 2, 5, 8), (1, 2, 5, 8)))
    cos = np.ones((16, 8))
    got = mra.rotary_flash_attention(*(Tensor(x.astype(np.float32)) for x in (q, k, v, cos, cos * 0)), scale=scale)
    expected = reference(q, k, v, cos, cos * 0, scale=scale)[0]
    assert np.abs(got.asnumpy() - expected).max() < 1e-5


def test_cell_constructor_errors():
    with pytest.raises(ValueError, match="head_dim: expected a positive even int"):
        mra.RotaryFlashAttention(head_num=4, head_dim=7)
    with pytest.raises(ValueError, match="backend: expected one of"):
        mra.RotaryFlashAttention(head_num=4, head_dim=8, backend="gpu")
    with pytest.raises(ValueError, match="rotary_dim: 16 exceeds head_dim 8"):
        mra.RotaryFlashAttention(head_num=4, head_dim=8, rotary_dim=16)


CRASH_GUARD = """
import sys, numpy as np, mindspore as ms
from mindspore import Tensor, nn
ms.set_device("CPU")
MODES = {"pynative": ms.PYNATIVE_MODE, "graph": ms.GRAPH_MODE}
ms.set_context(mode=MODES[sys.argv[1]])
import ms_rope_attention as mra

class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        self.op = mra.RotaryFlashAttentionOp()
    def construct(self, q, k, v, cos, sin):
        return self.op(q, k, v, cos, sin)

cos = Tensor(np.ones((16, 8), np.float32))
cases = {"zero query heads": (Tensor(np.ones((1, 0, 5, 8), np.float32)), Tensor(np.ones((1, 2, 5, 8), np.float32))),
         "numpy query": (np.ones((1, 4, 5, 8), np.float32), Tensor(np.ones((1, 2, 5, 8), np.float32)))}
for mode_name in sys.argv[1:]:
    ms.set_context(mode=MODES[mode_name])
    for name, (q, k) in cases.items():
        try:
            Net()(q, k, k, cos, cos)
            print(mode_name, name, "ran", flush=True)
        except (ValueError, TypeError, RuntimeError) as exc:
            print(mode_name, name, "raised", type(exc).__name__, flush=True)
"""


def test_former_crashes_raise_instead(tmp_path):
    """Inputs that once killed the process (SIGFPE in the kernel's planning for zero query heads;
    SIGABRT for a numpy array in a GRAPH_MODE Cell, from a Python dtype callable in the graph) now
    raise, in a subprocess so a crash fails this test instead of the run: one for both modes, PyNative's
    cases first (each line printed as it is done: a crash's output shows the mode and case it ended in)."""
    import subprocess
    import sys

    script = tmp_path / "crash_guard.py"  # GRAPH_MODE compiles from source: a file, not python -c
    script.write_text(CRASH_GUARD)
    result = subprocess.run([sys.executable, str(script), "pynative", "graph"], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, f"crashed ({result.returncode}) after {result.stdout!r}: {result.stderr[-2000:]}"
    for mode_name in ("pynative", "graph"):
        assert f"{mode_name} zero query heads raised ValueError" in result.stdout, result.stdout
        assert f"{mode_name} numpy query" in result.stdout, result.stdout


def test_offsets_of_the_wrong_type_are_named_in_graph_mode():
    ms.set_context(mode=ms.GRAPH_MODE)
    with pytest.raises(TypeError, match="actual_seq_qlen: expected a mindspore Tensor, got str"):
        OpNet(input_layout="TND")(*TND.values(), "3,5", "4,7")


class _QualifiedDtype:
    """A dtype that prints qualified, as MindSpore's do with mindnlp's mindtorch loaded."""

    def __init__(self, name):
        self.name = name

    def __str__(self):
        return f"mindspore.{self.name}"


def test_qualified_dtype_names_are_read_as_their_dtype():
    from ms_rope_attention import checks
    assert [checks.dtype_name(_QualifiedDtype(n)) for n in ("float32", "bfloat16", "int64")] == [
        "float32", "bfloat16", "int64"]
    assert checks.dtype_name(ms.float32) == "float32" and checks.dtype_name(np.dtype("float16")) == "float16"
    f32 = _QualifiedDtype("float32")
    shape, table = (1, 2, 5, 16), (64, 16)
    from ms_rope_attention.attrs import OpAttrs
    tensors = [(shape, f32)] * 3 + [(table, f32)] * 2
    geometry = checks.check_inputs(OpAttrs(), tensors, (None, None))
    assert geometry.head_dim == 16
    with pytest.raises(TypeError, match=r"query: expected dtype in .*, got int32"):
        checks.check_inputs(OpAttrs(), [(shape, _QualifiedDtype("int32"))] + tensors[1:], (None, None))
