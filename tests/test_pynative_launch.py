"""The fused primitive called eagerly (PyNative) launches through its own one-op graph
(``cpu_runtime.GraphLaunchedCustom``): same values as the GRAPH_MODE Cell, forward and gradient, a
bounded number of compiles as shapes change, and outputs that keep a mindtorch device tag."""
import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, nn

from ms_rope_attention import rope_tables, rotary_flash_attention
from ms_rope_attention.attrs import OpAttrs
from ms_rope_attention.functional import backend_for

pytestmark = pytest.mark.usefixtures("pynative")


@pytest.fixture
def pynative():
    ms.set_context(mode=ms.PYNATIVE_MODE)
    yield


def _inputs(length, heads=2, kv_heads=1, dim=16, seed=0):
    rng = np.random.default_rng(seed)
    q = Tensor(rng.standard_normal((1, heads, length, dim), dtype=np.float32))
    k, v = (Tensor(rng.standard_normal((1, kv_heads, length, dim), dtype=np.float32)) for _ in range(2))
    cos, sin = (Tensor(t) for t in rope_tables(dim, 64))
    return q, k, v, cos, sin


class _InGraph(nn.Cell):
    def construct(self, q, k, v, cos, sin):
        return rotary_flash_attention(q, k, v, cos, sin)


def _loss(q, k, v, cos, sin):
    return rotary_flash_attention(q, k, v, cos, sin).sum()


class _InGraphLoss(nn.Cell):
    def construct(self, q, k, v, cos, sin):
        return _loss(q, k, v, cos, sin)


def _graph(*inputs):
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        return _InGraph()(*inputs).asnumpy()
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)


def test_eager_calls_launch_through_a_graph_compiled_a_bounded_number_of_times():
    prim = backend_for(OpAttrs(scale=0.3)).fused
    assert prim.compiles == 0
    counts = []
    for length in (3, 5, 8, 13, 21, 34, 1):
        q, k, v, cos, sin = _inputs(length)
        eager = rotary_flash_attention(q, k, v, cos, sin, scale=0.3).asnumpy()
        ms.set_context(mode=ms.GRAPH_MODE)
        try:
            expected = rotary_flash_attention(q, k, v, cos, sin, scale=0.3)  # a top-level call: still eager
        finally:
            ms.set_context(mode=ms.PYNATIVE_MODE)
        np.testing.assert_array_equal(eager, expected.asnumpy())
        counts.append(prim.compiles)
    assert counts[0] == 1 and counts[-1] <= 3, counts  # then shape-generic: no compile per new length
    assert counts[-1] == counts[-2] == counts[-3], counts


def test_eager_values_and_gradients_equal_the_graph_cells():
    inputs = _inputs(19, heads=4, kv_heads=2)
    np.testing.assert_array_equal(rotary_flash_attention(*inputs).asnumpy(), _graph(*inputs))

    eager = ms.grad(_loss, grad_position=(0, 1, 2))

    class Grad(nn.Cell):
        def __init__(self):
            super().__init__()
            self.grad = ms.grad(_InGraphLoss(), grad_position=(0, 1, 2))

        def construct(self, q, k, v, cos, sin):
            return self.grad(q, k, v, cos, sin)

    got = eager(*inputs)
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        want = Grad()(*inputs)
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.asnumpy(), w.asnumpy(), rtol=0, atol=1e-6)


def test_outputs_carry_the_querys_device_tag():
    """mindtorch's tensors carry ``_device`` and its DynamicCache refuses a tensor without one."""
    q, k, v, cos, sin = _inputs(7)
    q._device = "cpu-tag"
    out, rotated_key = rotary_flash_attention(q, k, v, cos, sin, return_rotated_key=True)
    assert out._device == "cpu-tag" and rotated_key._device == "cpu-tag"
    untagged = rotary_flash_attention(*_inputs(7))
    assert not hasattr(untagged, "_device")
