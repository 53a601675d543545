"""The projections' OpenBLAS GEMM (ms_rope_attention/linear.py, csrc/rfa_cpu_linear.cc): y = x W^T
against a float64 numpy reference over swept shapes, its refusals, the MindSpore op in both modes
with a dynamic sequence length, and its gradient.

Tolerance (float32 inputs, float32 accumulation over K terms): |y - y64| <= 1e-6 * (|x| |W|^T) + 1e-7,
about 8 float32 ulps of the sum of the terms' magnitudes."""
import os
import re

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, nn, ops

from ms_rope_attention import linear

SHAPES = [  # (x shape, out_features)
    ((1, 1), 1), ((1, 4096), 7), ((7, 13), 5), ((3, 5, 17), 9), ((2, 1, 3, 33), 65), ((129, 257), 130),
    ((0, 8), 4), ((4, 8), 0),
    # decode-sized rows (M <= 8, the library's own product): K and N off its vector and block sizes
    ((2, 4103), 11), ((8, 4096), 4097), ((5, 3), 1), ((1, 8, 9), 6), ((9, 64), 8),
]


def reference(x, w):
    y = x.astype(np.float64) @ w.astype(np.float64).T
    bound = np.abs(x.astype(np.float64)) @ np.abs(w.astype(np.float64)).T
    return y, 1e-6 * bound + 1e-7


@pytest.mark.parametrize("x_shape, out_features", SHAPES)
def test_kernel_equals_float64_reference(x_shape, out_features, rng):
    x = rng.standard_normal(x_shape).astype(np.float32)
    w = rng.standard_normal((out_features, x_shape[-1])).astype(np.float32)
    y = linear.multiply(x, w)
    expected, tol = reference(x, w)
    assert y.shape == expected.shape
    assert np.all(np.abs(y - expected) <= tol)


def test_empty_sum_is_zero(rng):
    y = linear.multiply(np.zeros((3, 0), np.float32), np.zeros((4, 0), np.float32))
    assert np.array_equal(y, np.zeros((3, 4), np.float32))  # the NaN-filled output buffer was written


def test_non_finite_inputs_propagate(rng):
    x = rng.standard_normal((4, 6)).astype(np.float32)
    w = rng.standard_normal((3, 6)).astype(np.float32)
    x[1, 2], w[2, 0] = np.nan, np.inf
    y = linear.multiply(x, w)
    assert np.isnan(y[1]).all() and not np.isfinite(y[:, 2]).any()
    assert np.isfinite(np.delete(np.delete(y, 1, 0), 2, 1)).all()


@pytest.mark.parametrize("x, w, out_shape, message", [
    (np.zeros((2, 3), np.float64), np.zeros((4, 3), np.float32), None, "x: expected float32, got float64"),
    (np.zeros((2, 3), np.float32), np.zeros((4, 3), np.float16), None, "weight: expected float32, got float16"),
    (np.zeros((2, 3), np.float32), np.zeros((4, 3), np.float32), (2, 4), None),
    (np.zeros((2, 3), np.float32), np.zeros((4, 3), np.float32), (2, 5), "y: expected shape x.shape[:-1] + (out_features,), got y (2, 5)"),
    (np.zeros((2, 3), np.float32), np.zeros((4, 3), np.float32), (1, 2, 4), "y: expected shape"),
    (np.zeros((2, 3), np.float32), np.zeros((4, 5), np.float32), (2, 4),
     "x: expected its last dimension to be the weight's in_features 5, got x (2, 3) and weight (4, 5)"),
    (np.zeros((2, 3), np.float32), np.zeros((12,), np.float32), (2, 4),
     "weight: expected 2 dimensions (out_features, in_features), got (12,)"),
    (np.zeros((), np.float32), np.zeros((4, 3), np.float32), (4,), "x: expected at least 1 dimension"),
])
def test_kernel_refuses_bad_input_by_name(x, w, out_shape, message):
    if message is None:
        assert linear.multiply(x, w, out_shape).shape == out_shape
        return
    with pytest.raises(ValueError, match=re.escape(message)):
        linear.multiply(x, w, out_shape)


def test_openblas_runs_on_this_process_cores():
    expected = int(os.environ.get("OPENBLAS_NUM_THREADS") or len(os.sched_getaffinity(0)))
    assert linear.blas_threads() == expected


class Projection(nn.Cell):
    def __init__(self, weight):
        super().__init__()
        self.weight = ms.Parameter(Tensor(weight), name="weight")
        self.op = linear.linear_op()

    def construct(self, x):
        return self.op(x, self.weight)


def test_op_in_both_modes_with_a_dynamic_sequence_length(mode, rng):
    w = rng.standard_normal((24, 40)).astype(np.float32)
    net = Projection(w)
    if mode == "graph":
        net.set_inputs(Tensor(shape=[2, None, 40], dtype=ms.float32))
    for length in (1, 5, 17):
        x = rng.standard_normal((2, length, 40)).astype(np.float32)
        y = net(Tensor(x)).asnumpy()
        expected, tol = reference(x, w)
        assert y.shape == (2, length, 24) and np.all(np.abs(y - expected) <= tol)


def test_gradients_equal_float64_reference(mode, rng):
    x = rng.standard_normal((3, 7, 16)).astype(np.float32)
    w = rng.standard_normal((10, 16)).astype(np.float32)
    dy = rng.standard_normal((3, 7, 10)).astype(np.float32)
    net = Projection(w)
    grad = ops.GradOperation(get_all=True, get_by_list=True, sens_param=True)(net, net.trainable_params())
    (dx,), (dw,) = grad(Tensor(x), Tensor(dy))
    dy64 = dy.reshape(-1, 10).astype(np.float64)
    expected_dx = (dy64 @ w.astype(np.float64)).reshape(x.shape)
    expected_dw = dy64.T @ x.reshape(-1, 16).astype(np.float64)
    assert np.abs(dx.asnumpy() - expected_dx).max() <= 1e-5 * max(1.0, np.abs(expected_dx).max())
    assert np.abs(dw.asnumpy() - expected_dw).max() <= 1e-5 * max(1.0, np.abs(expected_dw).max())
