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
    (["a"], [7], "actual_seq_qlen: expected a sequence of ints"),
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


def test_cell_constructor_errors():
    with pytest.raises(ValueError, match="head_dim: expected a positive even int"):
        mra.RotaryFlashAttention(head_num=4, head_dim=7)
    with pytest.raises(ValueError, match="backend: expected one of"):
        mra.RotaryFlashAttention(head_num=4, head_dim=8, backend="gpu")
    with pytest.raises(ValueError, match="rotary_dim: 16 exceeds head_dim 8"):
        mra.RotaryFlashAttention(head_num=4, head_dim=8, rotary_dim=16)
