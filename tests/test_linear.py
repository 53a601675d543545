"""The projections' GEMM (ms_rope_attention/linear.py, csrc/rfa_cpu_linear.cc, csrc/weight_rows.h):
y = x W^T with W float32, float16 or bfloat16, against a float64 numpy reference of the same
(half-rounded) weights over swept shapes on every build this CPU runs; its refusals, the MindSpore
op in both modes with a dynamic sequence length, and its gradient.

Tolerance (float32 x, exact conversion of W, float32 accumulation over K terms): |y - y64| <= 1e-6 *
(|x| |W|^T) + 1e-7, about 8 float32 ulps of the sum of the terms' magnitudes, for every W dtype."""
import os
import re

import ml_dtypes
import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, nn, ops

from ms_rope_attention import linear
from ms_rope_attention.cpu_runtime import built_libraries, usable_isas

ISAS = [isa for isa in usable_isas() if isa in built_libraries(linear.STEM)]
WEIGHT_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}

SHAPES = [  # (x shape, out_features)
    ((1, 1), 1), ((1, 4096), 7), ((7, 13), 5), ((3, 5, 17), 9), ((2, 1, 3, 33), 65), ((129, 257), 130),
    ((0, 8), 4), ((4, 8), 0),
    # decode-sized rows (M <= 8: the library's own product): K and N off its vector and block sizes
    ((2, 4103), 11), ((8, 4096), 4097), ((5, 3), 1), ((1, 8, 9), 6), ((3, 33), 4099),
    # half W, 9 to 64 rows: the chunked product (chunks of 256 weights; groups of 4, 2 and 1 rows of x)
    ((9, 64), 8), ((16, 72), 13), ((17, 40), 7), ((2, 20, 70), 19), ((33, 700), 10), ((64, 4103), 9),
]


def reference(x, w):
    y = x.astype(np.float64) @ w.astype(np.float64).T
    bound = np.abs(x.astype(np.float64)) @ np.abs(w.astype(np.float64)).T
    return y, 1e-6 * bound + 1e-7


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("weight_dtype", WEIGHT_DTYPES)
@pytest.mark.parametrize("x_shape, out_features", SHAPES)
def test_kernel_equals_float64_reference(x_shape, out_features, weight_dtype, isa, rng):
    x = rng.standard_normal(x_shape).astype(np.float32)
    w = rng.standard_normal((out_features, x_shape[-1])).astype(np.float32).astype(WEIGHT_DTYPES[weight_dtype])
    y = linear.multiply(x, w, isa=isa)
    expected, tol = reference(x, w)
    assert y.shape == expected.shape
    assert np.all(np.abs(y - expected) <= tol)


@pytest.mark.parametrize("weight_dtype", ["float16", "bfloat16"])
def test_prefill_sized_half_product_spans_several_panels(weight_dtype, rng):
    """Past 64 rows of x, more W rows than one 64 MiB float32 panel holds (K = 8192: 2048 rows a
    panel), so the panel loop and its last, partial panel (52 rows) are exercised."""
    x = rng.standard_normal((65, 8192)).astype(np.float32)
    w = rng.standard_normal((2100, 8192)).astype(np.float32).astype(WEIGHT_DTYPES[weight_dtype])
    expected, tol = reference(x, w)
    assert np.all(np.abs(linear.multiply(x, w) - expected) <= tol)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("weight_dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("rows, k", [(9, 4096), (16, 700), (35, 4103), (64, 257)])
def test_each_row_of_a_half_product_is_that_row_alone(rows, k, weight_dtype, isa, rng):
    """Up to 64 rows of x by a half W, each row's result is bit for bit that row's alone (the decode
    step's product): a token's projections do not depend on what else its step holds."""
    x = rng.standard_normal((rows, k)).astype(np.float32)
    w = rng.standard_normal((37, k)).astype(np.float32).astype(WEIGHT_DTYPES[weight_dtype])
    together = linear.multiply(x, w, isa=isa)
    alone = np.concatenate([linear.multiply(x[i:i + 1], w, isa=isa) for i in range(rows)])
    assert np.array_equal(together, alone)


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
    (np.zeros((2, 3), np.float32), np.zeros((4, 3), np.float64), None,
     "weight: expected float32, float16, bfloat16 or uint8 (packed), got float64"),
    (np.zeros((2, 3), np.float16), np.zeros((4, 3), np.float16), None, "x: expected float32, got float16"),
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


@pytest.mark.parametrize("weight_dtype", ["float16", "bfloat16"])
def test_half_weights_keep_non_finite_values(weight_dtype, rng):
    x = rng.standard_normal((2, 16)).astype(np.float32)
    w = rng.standard_normal((5, 16)).astype(np.float32)
    w[1, 3], w[3, 0] = np.inf, np.nan
    y = linear.multiply(x, w.astype(WEIGHT_DTYPES[weight_dtype]))
    assert np.isinf(y[:, 1]).all() and np.isnan(y[:, 3]).all() and np.isfinite(y[:, [0, 2, 4]]).all()


class Projection(nn.Cell):
    def __init__(self, weight):
        super().__init__()
        self.weight = ms.Parameter(Tensor(weight), name="weight")
        self.op = linear.linear_op()

    def construct(self, x):
        return self.op(x, self.weight)


@pytest.mark.parametrize("weight_dtype", WEIGHT_DTYPES)
def test_op_in_both_modes_with_a_dynamic_sequence_length(mode, weight_dtype, rng):
    w = rng.standard_normal((24, 40)).astype(np.float32).astype(WEIGHT_DTYPES[weight_dtype])
    net = Projection(w)
    if mode == "graph":
        net.set_inputs(Tensor(shape=[2, None, 40], dtype=ms.float32))
    for length in (1, 5, 17, 40):
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


@pytest.mark.parametrize("weight_dtype", ["float16", "bfloat16"])
def test_gradients_with_half_weights(weight_dtype, rng):
    """dx in float32 from the exact weights; dW in the weight's dtype."""
    w = rng.standard_normal((10, 16)).astype(np.float32).astype(WEIGHT_DTYPES[weight_dtype])
    x = rng.standard_normal((3, 16)).astype(np.float32)
    dy = rng.standard_normal((3, 10)).astype(np.float32)
    net = Projection(w)
    grad = ops.GradOperation(get_all=True, get_by_list=True, sens_param=True)(net, net.trainable_params())
    (dx,), (dw,) = grad(Tensor(x), Tensor(dy))
    expected_dx = dy.astype(np.float64) @ w.astype(np.float64)
    assert np.abs(dx.asnumpy() - expected_dx).max() <= 1e-5 * max(1.0, np.abs(expected_dx).max())
    assert str(dw.dtype).lower() == weight_dtype
