"""The MLP's gate and up projections and SwiGLU as one op (``RfaSwiGLU``: ms_rope_attention/linear.py,
csrc/rfa_cpu_linear.cc, csrc/onednn_matmul.cc): y = silu(x Wg^T) * (x Wu^T), silu(g) = g * sigmoid(g),
against a float64 numpy reference over swept shapes on every build this CPU runs; its refusals, the
MindSpore op in both modes, its gradient, and the Llama model computing in bfloat16 with it.

What is rounded where. The reference is evaluated in float64 on the operands the op multiplies: with
compute_dtype "bfloat16", x rounded once to bfloat16 here (ml_dtypes, to nearest even, as the op rounds
it) and W bfloat16 as given; with "float32", x as given and W converted exactly from its dtype. So what
remains is the op's float32 arithmetic, each part bounded:

- the products g and u: float32 accumulation of K exact terms, |g - g64| <= eg = 1e-6 (|x| |Wg|^T), as
  RfaLinear's tests bound them (tests/test_linear.py, tests/test_linear_bf16.py); u likewise (eu);
- carried through the epilogue, |silu'| <= 1.1: 1.1 eg |u64| + |silu(g64)| eu + 1.1 eg eu;
- the epilogue itself (exp, the sigmoid's division, two products; oneDNN's swish and binary mul on the
  oneDNN path): 1e-6 |y64| (16 float32 ulps; measured at most 6.8 ulps, 4e-7, on every path), plus 1e-30
  absolute where silu underflows (g < -87: e^g below float32's smallest normal, flushed to 0).

The Llama model computing in bfloat16 (the tests named ``model``): see each test."""
import ctypes
import re

import ml_dtypes
import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, nn, ops

from ms_rope_attention import linear, swiglu_op
from ms_rope_attention.cpu_runtime import aot_call, built_libraries, usable_isas

ISAS = [isa for isa in usable_isas() if isa in built_libraries(linear.STEM)]
BF16 = ml_dtypes.bfloat16
WEIGHT_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": BF16}
# bfloat16 arithmetic needs oneDNN in the build and bfloat16 instructions in the CPU (AVX512-BF16 /
# AMX-BF16): the library says which is missing. Skipped only there; this project's CPUs have them.
BF16_PROBLEM = linear.library().RfaSwiGLUComputeProblem(b"bfloat16").decode()
needs_bf16 = pytest.mark.skipif(bool(BF16_PROBLEM), reason=BF16_PROBLEM)
# (compute_dtype, weight dtype): bfloat16 arithmetic takes bfloat16 weights only.
ARITHMETIC = [("float32", "float32"), ("float32", "float16"), ("float32", "bfloat16"),
              pytest.param("bfloat16", "bfloat16", marks=needs_bf16)]
ROWS = (1, 2, 3, 4, 5, 37, 130)  # up to 4: the decode-sized products (bfloat16: vdpbf16ps); 5 on: oneDNN or FMA / SGEMM


def operands(x, compute_dtype):
    """x as the op multiplies it, in float64: rounded once to bfloat16 for bfloat16 arithmetic."""
    return (x.astype(BF16) if compute_dtype == "bfloat16" else x).astype(np.float64)


def reference(x, gate_weight, up_weight, compute_dtype):
    """(y64, tolerance) on the rounded operands, per the module docstring."""
    x64 = operands(x.reshape(-1, x.shape[-1]), compute_dtype)
    wg, wu = gate_weight.astype(np.float64), up_weight.astype(np.float64)
    g, u = x64 @ wg.T, x64 @ wu.T
    eg, eu = 1e-6 * (np.abs(x64) @ np.abs(wg).T), 1e-6 * (np.abs(x64) @ np.abs(wu).T)
    with np.errstate(over="ignore"):
        silu = g / (1 + np.exp(-g))
    y = silu * u
    tolerance = 1.1 * eg * np.abs(u) + np.abs(silu) * eu + 1.1 * eg * eu + 1e-6 * np.abs(y) + 1e-30
    shape = x.shape[:-1] + (gate_weight.shape[0],)
    return y.reshape(shape), tolerance.reshape(shape)


def assert_close(y, x, gate_weight, up_weight, compute_dtype):
    expected, tolerance = reference(x, gate_weight, up_weight, compute_dtype)
    assert y.shape == expected.shape and y.dtype == np.float32
    excess = np.abs(y - expected) / tolerance
    assert np.all(excess <= 1), f"{excess.max():.2f} times the tolerance at {np.unravel_index(excess.argmax(), y.shape)}"


def weights(rng, shape, dtype):
    return tuple(rng.standard_normal(shape).astype(np.float32).astype(WEIGHT_DTYPES[dtype]) for _ in range(2))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("compute_dtype, weight_dtype", ARITHMETIC)
@pytest.mark.parametrize("k, f", [(40, 37), (72, 100), (256, 37)])
def test_kernel_equals_float64_reference(k, f, compute_dtype, weight_dtype, isa, rng, bf16_engines):
    gate, up = weights(rng, (f, k), weight_dtype)
    for m in ROWS:
        x = rng.standard_normal((m, k)).astype(np.float32)
        for _ in bf16_engines(compute_dtype):
            y = linear.multiply_swiglu(x, gate, up, isa=isa, compute_dtype=compute_dtype)
            assert_close(y, x, gate, up, compute_dtype)


@pytest.mark.parametrize("compute_dtype, weight_dtype", [("float32", "float16"), pytest.param("bfloat16", "bfloat16",
                                                                                              marks=needs_bf16)])
def test_a_long_sum_and_leading_dimensions(compute_dtype, weight_dtype, rng, bf16_engines):
    """K = 4096 (a 7B layer's hidden size), at decode and prefill sizes, x with leading dimensions."""
    gate, up = weights(rng, (129, 4096), weight_dtype)
    for shape in ((1, 4096), (2, 3, 4096)):
        x = rng.standard_normal(shape).astype(np.float32)
        for _ in bf16_engines(compute_dtype):
            y = linear.multiply_swiglu(x, gate, up, compute_dtype=compute_dtype)
            assert y.shape == shape[:-1] + (129,)
            assert_close(y, x, gate, up, compute_dtype)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("compute_dtype, weight_dtype", ARITHMETIC)
def test_the_products_are_rfalinears_and_the_epilogue_is_within_its_bound(compute_dtype, weight_dtype, isa, rng):
    """Where the op runs the library's own products (float32 arithmetic; bfloat16 up to 4 rows), g and u
    are RfaLinear's products of the same operands, bit for bit, so the op's result is the epilogue's
    alone: within 1e-6 |y64| of float64 silu(g) * u on RfaLinear's g and u, over |g| up to ~200."""
    gate, up = weights(rng, (100, 72), weight_dtype)
    for m in (1, 4) if compute_dtype == "bfloat16" else (1, 4, 37):
        x = (rng.standard_normal((m, 72)) * 8).astype(np.float32)
        g = linear.multiply(x, gate, isa=isa, compute_dtype=compute_dtype).astype(np.float64)
        u = linear.multiply(x, up, isa=isa, compute_dtype=compute_dtype).astype(np.float64)
        with np.errstate(over="ignore"):
            expected = g / (1 + np.exp(-g)) * u
        y = linear.multiply_swiglu(x, gate, up, isa=isa, compute_dtype=compute_dtype)
        assert np.abs(g).max() > 80 and np.all(np.abs(y - expected) <= 1e-6 * np.abs(expected) + 1e-30)


@needs_bf16
@pytest.mark.parametrize("k, f", [(72, 100), (40, 37)])
def test_packed_weights_give_the_plain_weights_result(k, f, rng, monkeypatch):
    """Both weights packed for oneDNN (linear.pack_weight): oneDNN at every M, with the epilogue as
    its post-ops. Where the plain weights take oneDNN too (M > 16, as RfaLinear's test has it) the
    results are the same bits; below, both are within the reference's bound."""
    monkeypatch.setenv("RFA_BF16_GEMM", "onednn")  # the plain weights on oneDNN too: the bits compared below
    gate, up = weights(rng, (f, k), "bfloat16")
    packed_gate, packed_up = linear.pack_weight(gate), linear.pack_weight(up)
    for m in (1, 4, 5, 37):
        x = rng.standard_normal((m, k)).astype(np.float32)
        y = linear.multiply_swiglu(x, packed_gate, packed_up, compute_dtype="bfloat16", packed_out_features=f)
        assert_close(y, x, gate, up, "bfloat16")
        if m > 16:
            assert np.array_equal(y, linear.multiply_swiglu(x, gate, up, compute_dtype="bfloat16"))


@pytest.mark.parametrize("compute_dtype, weight_dtype", ARITHMETIC)
@pytest.mark.parametrize("m", [4, 37])
def test_non_finite_values_stay_in_their_rows(m, compute_dtype, weight_dtype, rng, bf16_engines):
    """NaN or Inf in a row of x makes that row's outputs non-finite and leaves the others as the
    reference has them; with bfloat16 arithmetic 3.4e38 rounds past bfloat16's largest finite value
    to +inf (float32 arithmetic gets +inf itself there)."""
    gate, up = weights(rng, (37, 40), weight_dtype)
    x = rng.standard_normal((m, 40)).astype(np.float32)
    x[0, 3], x[1, 7], x[2, 11] = np.nan, -np.inf, np.float32(3.4e38) if compute_dtype == "bfloat16" else np.inf
    for _ in bf16_engines(compute_dtype):
        y = linear.multiply_swiglu(x, gate, up, compute_dtype=compute_dtype)
        assert not np.isfinite(y[:3]).any()
        assert_close(y[3:], x[3:], gate, up, compute_dtype)


@pytest.mark.parametrize("compute_dtype, weight_dtype", ARITHMETIC)
def test_silu_at_the_extremes(compute_dtype, weight_dtype, bf16_engines):
    """K = 1 and W = 1, so g = u = x: silu(-inf) = -inf * sigmoid(-inf) = -inf * 0 is NaN, as
    g * sigmoid(g) is in float32 (and MindSpore's SiLU); silu(inf) * inf = inf; e^-100 underflows to 0;
    silu(100) = 100. On 8 rows (oneDNN's swish where bfloat16) and on 4 (the library's loop)."""
    x = np.array([[-np.inf], [np.inf], [np.nan], [-100], [100], [0], [-0.0], [1]], np.float32)
    w = np.ones((3, 1), WEIGHT_DTYPES[weight_dtype])
    for _ in bf16_engines(compute_dtype):
        for rows in (slice(0, 8), slice(0, 4), slice(4, 8)):
            y = linear.multiply_swiglu(x[rows], w, w, compute_dtype=compute_dtype)[:, 0]
            expected = np.array([np.nan, np.inf, np.nan, 0, 1e4, 0, 0, 1 / (1 + np.exp(-1.0))], np.float32)[rows]
            assert np.allclose(y, expected, rtol=1e-6, atol=0, equal_nan=True), y


def test_empty_sums_and_empty_outputs():
    y = linear.multiply_swiglu(np.zeros((3, 0), np.float32), np.zeros((4, 0), np.float32), np.zeros((4, 0), np.float32))
    assert np.array_equal(y, np.zeros((3, 4), np.float32))  # written: silu(0) * 0
    assert linear.multiply_swiglu(np.zeros((0, 8), np.float32), *(np.zeros((4, 8), np.float32),) * 2).shape == (0, 4)
    assert linear.multiply_swiglu(np.zeros((2, 8), np.float32), *(np.zeros((0, 8), np.float32),) * 2).shape == (2, 0)


# ---- refusals: each names the argument and what it expected, before any memory is read or written ----

F32 = np.float32
BAD_INPUTS = [  # (x, gate_weight, up_weight, out_shape, compute_dtype, message)
    (np.zeros((2, 3), np.float64), np.zeros((4, 3), F32), np.zeros((4, 3), F32), None, "float32",
     "x: expected float32, got float64"),
    (np.zeros((), F32), np.zeros((4, 3), F32), np.zeros((4, 3), F32), (4,), "float32",
     "x: expected at least 1 dimension"),
    (np.zeros((2, 3), F32), np.zeros((4, 3), np.float64), np.zeros((4, 3), np.float64), None, "float32",
     "gate_weight: expected float32, float16, bfloat16 or uint8 (packed), got float64"),
    (np.zeros((2, 3), F32), np.zeros((4, 3), F32), np.zeros((4, 3), np.float16), None, "float32",
     "up_weight: expected gate_weight's dtype float32, got float16"),
    (np.zeros((2, 3), F32), np.zeros((4, 3), F32), np.zeros((5, 3), F32), None, "float32",
     "up_weight: expected gate_weight's shape (4, 3), got (5, 3)"),
    (np.zeros((2, 3), F32), np.zeros((4, 3), F32), np.zeros((12,), F32), None, "float32",
     "up_weight: expected gate_weight's shape (4, 3), got (12,)"),
    (np.zeros((2, 3), F32), np.zeros((4, 5), F32), np.zeros((4, 5), F32), (2, 4), "float32",
     "x: expected its last dimension to be the gate_weight's in_features 5, got x (2, 3) and gate_weight (4, 5)"),
    (np.zeros((2, 3), F32), np.zeros((12,), F32), np.zeros((12,), F32), (2, 4), "float32",
     "gate_weight: expected 2 dimensions (out_features, in_features), got (12,)"),
    (np.zeros((2, 3), F32), np.zeros((4, 3), F32), np.zeros((4, 3), F32), (2, 5), "float32",
     "y: expected shape x.shape[:-1] + (out_features,), got y (2, 5) for x (2, 3) and gate_weight (4, 3)"),
    (np.zeros((2, 3), F32), np.zeros((4, 3), F32), np.zeros((4, 3), F32), None, "float16",
     "compute_dtype: 'float16' is not offered by RfaSwiGLU"),
    (np.zeros((2, 3), F32), np.zeros((4, 3), F32), np.zeros((4, 3), F32), None, "bf16",
     "compute_dtype: expected 'float32' or 'bfloat16', got 'bf16'"),
    pytest.param(np.zeros((2, 3), F32), np.zeros((4, 3), F32), np.zeros((4, 3), F32), None, "bfloat16",
                 "gate_weight: expected bfloat16 with compute_dtype 'bfloat16'", marks=needs_bf16),
]


@pytest.mark.parametrize("x, gate_weight, up_weight, out_shape, compute_dtype, message", BAD_INPUTS)
def test_kernel_refuses_bad_input_by_name(x, gate_weight, up_weight, out_shape, compute_dtype, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        linear.multiply_swiglu(x, gate_weight, up_weight, out_shape, compute_dtype=compute_dtype)


def test_a_refused_call_writes_nothing():
    """The checks run before the output is touched: y keeps what it held."""
    x, gate, up = np.ones((2, 3), F32), np.ones((4, 3), F32), np.ones((5, 3), F32)
    y = np.full((2, 4), 7.0, F32)
    call = aot_call((x, gate, up, y))
    assert linear.library().RfaSwiGLURun(b"float32", ctypes.c_int64(0), 4, call.params, call.ndims, call.shapes,
                                         call.dtypes) == 1
    assert "up_weight: expected gate_weight's shape" in linear.library().RfaSwiGLULastError().decode()
    assert (y == 7).all()


@pytest.mark.parametrize("broken, message", [
    ("up dtype", "up_weight: expected gate_weight's dtype float32, got none"),
    ("up shape", "up_weight: expected gate_weight's shape (4, 3), got rank 2"),
    ("up data", "up_weight: null data pointer"),
    ("gate dtype", "gate_weight: expected float32, float16, bfloat16 or uint8 (packed), got none"),
    ("params", "expected 3 inputs (x, gate_weight, up_weight) and 1 output, got 3 params"),
])
def test_the_c_entry_refuses_null_arguments_by_name(broken, message):
    """MindSpore's entry itself (no extra: the contract's defaults), with a null dtype, shape or data
    pointer, or a wrong count of params."""
    lib = linear.library()
    arrays = (np.ones((2, 3), F32), np.ones((4, 3), F32), np.ones((4, 3), F32), np.zeros((2, 4), F32))
    call = aot_call(arrays)
    count = 3 if broken == "params" else 4
    if broken == "up dtype":
        call.dtypes[2] = None
    elif broken == "gate dtype":
        call.dtypes[1] = None
    elif broken == "up shape":
        call.shapes[2] = None
    elif broken == "up data":
        call.params[2] = None
    assert lib.RfaSwiGLU(count, call.params, call.ndims, call.shapes, call.dtypes, None, None) == 1
    assert message in lib.RfaSwiGLULastError().decode()
    assert (arrays[3] == 0).all()


@needs_bf16
@pytest.mark.parametrize("case, message", [
    ("up as stored", "up_weight: expected gate_weight's dtype uint8, got bfloat16"),
    ("up packed for another N in the same block", "up_weight: packed for (1, 11), used as (packed_out_features, "
                                                  "in_features) = (5, 11)"),
    ("up without its trailer", "up_weight: expected a buffer RfaLinearPack wrote (its trailer is missing)"),
    ("gate without its trailer", "gate_weight: expected a buffer RfaLinearPack wrote (its trailer is missing)"),
    ("float32 arithmetic", "gate_weight: a packed (uint8) weight needs compute_dtype 'bfloat16'"),
    ("no packed_out_features", "packed_out_features: expected the out_features the uint8 weight was packed for"),
    ("plain weights with packed_out_features", "gate_weight: expected the uint8 buffer RfaLinearPack wrote"),
])
def test_packed_weight_misuse_is_refused_by_name(case, message, rng):
    x = rng.standard_normal((3, 11)).astype(F32)
    gate, up = weights(rng, (5, 11), "bfloat16")
    packed_gate, packed_up = linear.pack_weight(gate), linear.pack_weight(up)
    n, compute = 5, "bfloat16"
    if case == "up as stored":
        packed_up = up
    elif case == "up packed for another N in the same block":
        packed_up = linear.pack_weight(up[:1])
        assert packed_up.size == packed_gate.size  # the size alone cannot tell
    elif case == "up without its trailer":
        packed_up[-64:-56] = 0
    elif case == "gate without its trailer":
        packed_gate[-64:-56] = 0
    elif case == "float32 arithmetic":
        compute = "float32"
    elif case == "no packed_out_features":
        n = 0
    else:
        packed_gate, packed_up = gate, up
    with pytest.raises(ValueError, match=re.escape(message)):
        linear.multiply_swiglu(x, packed_gate, packed_up, out_shape=(3, 5), compute_dtype=compute,
                               packed_out_features=n)


@pytest.mark.parametrize("value, message", [
    ("float16", "compute_dtype: 'float16' is not offered by RfaSwiGLU"),
    ("bf16", "compute_dtype: expected 'float32' or 'bfloat16', got 'bf16'"),
    (16, "compute_dtype: expected a str, got 16"),
])
def test_op_refuses_a_compute_dtype_it_cannot_run(value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        swiglu_op(value)


def test_op_refuses_packed_out_features_without_bfloat16_arithmetic():
    with pytest.raises(ValueError, match="packed_out_features: expected 0, or the out_features of weights packed"):
        swiglu_op("float32", packed_out_features=8)


def test_op_is_one_primitive_per_attributes():
    assert swiglu_op() is swiglu_op("float32") is not linear.linear_op()
    if not BF16_PROBLEM:
        assert swiglu_op("bfloat16") is swiglu_op("bfloat16") is not swiglu_op()


# ---- through MindSpore (not in the sanitizer run: the names hold "mindspore") ----------------------

class SwiGLU(nn.Cell):
    def __init__(self, gate, up, compute_dtype="float32", packed_out_features=0):
        super().__init__()
        trainable = not packed_out_features
        self.gate = ms.Parameter(Tensor(gate), name="gate", requires_grad=trainable)
        self.up = ms.Parameter(Tensor(up), name="up", requires_grad=trainable)
        self.op = swiglu_op(compute_dtype, packed_out_features)

    def construct(self, x):
        return self.op(x, self.gate, self.up)


class Reference(nn.Cell):
    """MindSpore's float32 ops: what LlamaMLP ran before the op (MatMul, SiLU, Mul)."""

    def __init__(self, gate, up):
        super().__init__()
        self.gate = ms.Parameter(Tensor(gate), name="gate")
        self.up = ms.Parameter(Tensor(up), name="up")
        self.matmul = ops.MatMul(transpose_b=True)

    def construct(self, x):
        x2 = x.reshape(-1, x.shape[-1])
        g = self.matmul(x2, self.gate.astype(ms.float32))
        u = self.matmul(x2, self.up.astype(ms.float32))
        return (ops.silu(g) * u).reshape(x.shape[:-1] + (self.gate.shape[0],))


@pytest.mark.parametrize("compute_dtype, weight_dtype", [("float32", "float16"), pytest.param(
    "bfloat16", "bfloat16", marks=needs_bf16)])
def test_mindspore_op_in_both_modes_with_a_dynamic_sequence_length(mode, compute_dtype, weight_dtype, rng):
    gate, up = weights(rng, (37, 40), weight_dtype)
    net = SwiGLU(gate, up, compute_dtype)
    if mode == "graph":
        net.set_inputs(Tensor(shape=[2, None, 40], dtype=ms.float32))
    for length in (1, 2, 3, 17):  # M = 2 and 4: the decode-sized products; 6 and 34: the others
        x = rng.standard_normal((2, length, 40)).astype(np.float32)
        y = net(Tensor(x)).asnumpy()
        assert_close(y, x, gate, up, compute_dtype)
        assert np.array_equal(y, linear.multiply_swiglu(x, gate, up, compute_dtype=compute_dtype))


@needs_bf16
def test_mindspore_op_with_packed_weights(mode, rng):
    gate, up = weights(rng, (37, 40), "bfloat16")
    net = SwiGLU(linear.pack_weight(gate), linear.pack_weight(up), "bfloat16", packed_out_features=37)
    for length in (1, 9):
        x = rng.standard_normal((1, length, 40)).astype(np.float32)
        y = net(Tensor(x)).asnumpy()
        assert y.shape == (1, length, 37)
        assert_close(y, x, gate, up, "bfloat16")


@pytest.mark.parametrize("compute_dtype, weight_dtype, case, message", [
    ("float32", "float32", "up rows", "up_weight: expected gate_weight's shape (37, 40), got (36, 40)"),
    pytest.param("bfloat16", "float32", "float32 weights", "gate_weight: expected bfloat16 with compute_dtype 'bfloat16'",
                 marks=needs_bf16),
])
def test_mindspore_op_refuses_bad_input_at_launch_by_name(compute_dtype, weight_dtype, case, message, rng):
    gate, up = weights(rng, (37, 40), weight_dtype)
    if case == "up rows":
        up = up[:36]
    net = SwiGLU(gate, up, compute_dtype)
    with pytest.raises(RuntimeError):
        net(Tensor(rng.standard_normal((2, 40)).astype(np.float32))).asnumpy()
    assert message in linear.library().RfaSwiGLULastError().decode()


@pytest.mark.parametrize("compute_dtype, weight_dtype", [("float32", "float32"), pytest.param(
    "bfloat16", "bfloat16", marks=needs_bf16)])
def test_mindspore_gradient_equals_autodiff_of_the_reference(mode, compute_dtype, weight_dtype, rng):
    """dx, dWg and dWu against MindSpore's autodiff of MatMul, SiLU and Mul on the same weights (in
    float32, as the op's backward is, whatever the forward's arithmetic): 1e-5 of the largest value;
    bfloat16 weights take their gradient in bfloat16, so to within its rounding (2^-8 relative)."""
    gate, up = weights(rng, (24, 16), weight_dtype)
    x = rng.standard_normal((3, 5, 16)).astype(np.float32)
    dy = rng.standard_normal((3, 5, 24)).astype(np.float32)
    grads = []
    # The reference on float32 copies of the weights (exact), so its gradients are float32.
    for net in (SwiGLU(gate, up, compute_dtype), Reference(gate.astype(np.float32), up.astype(np.float32))):
        grad = ops.GradOperation(get_all=True, get_by_list=True, sens_param=True)(net, net.trainable_params())
        (dx,), (dwg, dwu) = grad(Tensor(x), Tensor(dy))
        grads.append([dx, dwg, dwu])
    (dx, dwg, dwu), expected = grads[0], [g.asnumpy() for g in grads[1]]
    assert dx.dtype == ms.float32 and dwg.dtype == dwu.dtype == gate_dtype_of(weight_dtype)
    for got, want, half in zip((dx, dwg, dwu), expected, (False, True, True)):
        got = got.astype(ms.float32).asnumpy()
        bound = 1e-5 * np.abs(want).max() + (2.0 ** -7 * np.abs(want) if half and weight_dtype == "bfloat16" else 0)
        assert np.all(np.abs(got - want) <= bound)


def gate_dtype_of(weight_dtype):
    return {"float32": ms.float32, "float16": ms.float16, "bfloat16": ms.bfloat16}[weight_dtype]


# ---- the Llama model (not in the sanitizer run) --------------------------------------------------

@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    from models.llama.weights import save_hf_checkpoint
    from test_llama import CONFIG, random_state
    state = {k: v.astype(BF16) for k, v in random_state(CONFIG, np.random.default_rng(11)).items()}
    return state, save_hf_checkpoint(state, CONFIG, tmp_path_factory.mktemp("bf16"))


def mlps(model):
    return [layer.mlp for layer in model.model.layers]


def relative(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


@needs_bf16
def test_model_logits_with_the_op_are_those_of_the_separate_ops(bf16_checkpoint, rng):
    """A 2-layer bfloat16-compute model (GRAPH_MODE) with the op against the same model on the separate
    ops (``fused`` cleared): both round the same x once per projection, so g and u agree (bit for bit up
    to 4 rows) and h differs by the epilogues' float32 roundings. Up to 5 tokens that left the logits
    equal; with more, an h within an ulp of a bfloat16 rounding boundary of down_proj's input rounds the
    other way now and then (2^-8 of one value), and the layers after carry it: 5.6e-4 of the largest
    logit here (64 tokens), 4.4e-3 the most seen on other prompts of 29 and 100 tokens. Bound 1.5e-2,
    half the bfloat16 model's bound against float64 (tests/test_compute_dtype.py); against float64 both
    stay within that 3e-2 (1.25e-2 here, the two paths alike)."""
    from llama_reference import forward
    from models.llama.weights import load_checkpoint
    from test_llama import CONFIG
    state, path = bf16_checkpoint
    previous = ms.get_context("mode")
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        fused, separate = (load_checkpoint(path, progress=False) for _ in range(2))
        for mlp in mlps(separate):
            mlp.fused = False
        assert fused.compute_dtype == "bfloat16" and all(mlp.fused for mlp in mlps(fused))
        state64 = {k: v.astype(np.float64) for k, v in state.items()}
        for length in (3, 29, 64):
            ids = rng.integers(0, CONFIG.vocab_size, length)
            want = forward(state64, CONFIG, ids)
            ours, theirs = (model(Tensor(ids[None].astype(np.int32))).asnumpy()[0] for model in (fused, separate))
            assert relative(ours, theirs) <= 1.5e-2 and (length > 5 or np.array_equal(ours, theirs))
            assert relative(ours, want) <= 3e-2 and relative(theirs, want) <= 3e-2
    finally:
        ms.set_context(mode=previous)


@needs_bf16
def test_model_decode_on_the_paged_cache_matches_its_prefill(bf16_checkpoint, rng):
    """Greedy decode steps (one row: the op's vdpbf16ps products and its own epilogue) against one full
    forward over the same tokens (oneDNN with the post-ops): bfloat16 rounding in different orders and
    at different points, within 3e-2 of the largest logit (measured 1.0e-2, the separate ops' too)."""
    from models.llama.engine import PagedGenerator
    from models.llama.engine.kv_cache import block_bytes
    from models.llama.weights import load_checkpoint
    from test_llama import CONFIG, bsh_logits
    _, path = bf16_checkpoint
    previous = ms.get_context("mode")
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        model = load_checkpoint(path, progress=False)
        prompt = rng.integers(0, CONFIG.vocab_size, 9).tolist()
        paged = PagedGenerator(model, max_cache_bytes=8 * block_bytes(model.cache_config, 16, model.cache_dtype))
        paged.add_request(prompt, 8, eos_ids=())
        tokens, rows = [], []
        while paged.has_unfinished:
            tokens += [t.token for t in paged.step()]
            rows.append(paged.last_logits[0])
        full = bsh_logits(model, prompt + tokens[:-1])[len(prompt) - 1:]
        assert relative(np.stack(rows), full) <= 3e-2
    finally:
        ms.set_context(mode=previous)


@needs_bf16
def test_model_with_packed_weights_runs_the_op_on_them(bf16_checkpoint, rng):
    """``pack_weights`` packs gate and up and gives the op packed_out_features; the logits are the
    plain weights' (within 1e-5 of the largest, as tests/test_compute_dtype.py bounds the projections')."""
    from models.llama.weights import load_checkpoint
    from test_llama import CONFIG
    _, path = bf16_checkpoint
    plain, packed = (load_checkpoint(path, progress=False) for _ in range(2))
    packed.pack_weights()
    for mlp in mlps(packed):
        assert mlp.fused and mlp.gate_proj.packed and mlp.up_proj.packed and mlp.gate_proj.weight.dtype == ms.uint8
        assert mlp.swiglu is swiglu_op("bfloat16", packed_out_features=CONFIG.intermediate_size)
    for length in (1, 3, 29):
        ids = Tensor(rng.integers(0, CONFIG.vocab_size, (1, length)).astype(np.int32))
        assert relative(packed(ids).asnumpy(), plain(ids).asnumpy()) <= 1e-5


def _separate_ops_construct(self, x):
    """LlamaMLP.construct as it was before the op: the float32 model's path, to compare bit for bit."""
    x = self.f(x)
    return self.g(self.down_proj(ops.silu(self.gate_proj(x)) * self.up_proj(x)))


def test_model_computing_in_float32_never_uses_the_op_and_is_unchanged(bf16_checkpoint, rng, monkeypatch):
    """compute_dtype="float32" (here of a bfloat16 checkpoint) keeps the separate ops: no MLP holds the
    op, and the logits equal those of LlamaMLP's construct before the op, bit for bit (GRAPH_MODE)."""
    from models.llama.model import LlamaMLP
    from models.llama.weights import load_checkpoint
    from test_llama import CONFIG
    _, path = bf16_checkpoint
    previous = ms.get_context("mode")
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        model = load_checkpoint(path, progress=False, compute_dtype="float32")
        assert model.compute_dtype == "float32" and not any(mlp.fused or mlp.swiglu for mlp in mlps(model))
        ids = Tensor(rng.integers(0, CONFIG.vocab_size, (1, 29)).astype(np.int32))
        ours = model(ids).asnumpy()
        monkeypatch.setattr(LlamaMLP, "construct", _separate_ops_construct)
        before = load_checkpoint(path, progress=False, compute_dtype="float32")
        assert np.array_equal(ours, before(ids).asnumpy())
    finally:
        ms.set_context(mode=previous)
