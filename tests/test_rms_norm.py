"""The fused RMSNorm (ms_rope_attention/norm.py, csrc/rfa_cpu_norm.cc, op_info/rms_norm.yaml): against a
float64 numpy reference on the same float32 inputs over rows 1/37/512 and hidden 40/72/128/4097 (odd,
off every vector width), with batch dims (B, S, H) and (T, H), on every build this CPU runs; NaN/Inf
rows as the float64 formula gives them; bad input refused by name, called directly and through
MindSpore; the op in both modes and its gradient against MindSpore's autodiff of the model's old ops;
and the Llama model: computing in bfloat16 it runs the op and stays close to the same model on the
old ops, computing in float32 it never runs the op and is bit for bit the old model.

Tolerance (float32 squares summed in >= 8 partial sums, then 4 float32 roundings for r and y):
|y - y64| <= 1e-6 * |x * w| * r64, r64 = 1 / sqrt(mean(x^2) + eps) in float64. The largest error seen
on these inputs was 2.8e-7 of that (portable build, hidden 4097); the worst-case bound of a float32
sum of 4097 squares in 8 partial sums is (4097 / 8 + 3) * 2^-24 = 3e-5, never approached by random
rows."""
import re

import ml_dtypes
import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, nn, ops

from ms_rope_attention import linear, norm, rms_norm_op
from ms_rope_attention.compute import native_half_dtypes
from ms_rope_attention.cpu_runtime import built_libraries, direct_call, usable_isas

ISAS = [isa for isa in usable_isas() if isa in built_libraries(linear.STEM)]
EPS = 1e-5
LEADING = [(1,), (37,), (512,), (1, 37), (2, 256)]  # (T, H) and (B, S, H): 1, 37 and 512 rows
HIDDEN = [40, 72, 128, 4097]


def reference(x, w, eps):
    """y in float64 and its scale |x w| r, the float32 eps as the kernel uses it."""
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        r = 1.0 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + np.float64(np.float32(eps)))
        return x64 * r * w64, np.abs(x64 * w64) * r


def last_error() -> str:
    return linear.library(texts=("RfaRMSNormLastError",)).RfaRMSNormLastError().decode()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("leading", LEADING, ids=lambda s: "x".join(map(str, s)))
def test_kernel_equals_float64_reference(leading, hidden, isa, rng):
    x = rng.standard_normal(leading + (hidden,)).astype(np.float32)
    w = (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)
    y = norm.rms_norm(x, w, EPS, isa=isa)
    expected, scale = reference(x, w, EPS)
    assert y.shape == x.shape and y.dtype == np.float32
    assert np.all(np.abs(y - expected) <= 1e-6 * scale)


@pytest.mark.parametrize("isa", ISAS)
def test_one_element_rows_and_no_rows(isa, rng):
    x = rng.standard_normal((5, 1)).astype(np.float32)
    w = np.array([0.5], np.float32)
    expected, scale = reference(x, w, EPS)
    assert np.all(np.abs(norm.rms_norm(x, w, EPS, isa=isa) - expected) <= 1e-6 * scale)
    assert norm.rms_norm(np.zeros((0, 3, 8), np.float32), np.ones(8, np.float32), EPS, isa=isa).shape == (0, 3, 8)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("hidden", [40, 4097])
def test_non_finite_rows_give_what_the_float64_formula_gives(hidden, isa, rng):
    """NaN, +Inf and -Inf in one element of a row (at the vector body and at the tail), a zero row
    with eps 0 (0 / 0), and an Inf weight: NaN exactly where float64's y is NaN, Inf where it is Inf,
    the rest within the tolerance; the rows without them bit-identical to a clean call."""
    x = rng.standard_normal((8, hidden)).astype(np.float32)
    w = (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)
    clean = norm.rms_norm(x, w, 0.0, isa=isa)
    x[1, 3], x[2, hidden - 1], x[3, 5], x[4] = np.nan, np.inf, -np.inf, 0.0
    x[5, 0], x[5, hidden - 2] = np.inf, -np.inf
    y = norm.rms_norm(x, w, 0.0, isa=isa)
    expected, scale = reference(x, w, 0.0)
    assert np.array_equal(np.isnan(y), np.isnan(expected))
    assert np.array_equal(np.isinf(y), np.isinf(expected)) and np.array_equal(y[np.isinf(y)], expected[np.isinf(y)])
    assert np.isnan(y[[1, 4]]).all() and np.isnan(y[[2, 3]]).sum() == 2  # NaN at each Inf, 0 elsewhere
    finite = np.isfinite(expected)
    assert np.all(np.abs(y[finite] - expected[finite]) <= 1e-6 * scale[finite])
    assert np.array_equal(y[[0, 6, 7]], clean[[0, 6, 7]])
    w[7] = np.inf  # a column of Inf (NaN where x * r is 0)
    y, (expected, _) = norm.rms_norm(x, w, 0.0, isa=isa), reference(x, w, 0.0)
    assert np.array_equal(np.isnan(y), np.isnan(expected)) and np.array_equal(np.isinf(y), np.isinf(expected))


def test_a_sum_of_squares_past_float32_overflows_as_the_float32_ops_do():
    x = np.array([[3e19, 1.0, 2.0, 1.0]], np.float32)
    assert np.array_equal(norm.rms_norm(x, np.ones(4, np.float32), EPS), np.zeros((1, 4), np.float32))


@pytest.mark.parametrize("x, w, out_shape, eps, message", [
    (np.zeros((2, 3), np.float64), np.zeros(3, np.float32), None, EPS, "x: expected float32, got float64"),
    (np.zeros((2, 3), np.float32), np.zeros(3, np.float16), None, EPS, "weight: expected float32, got float16"),
    (np.zeros((2, 3), np.float32), np.zeros(3, ml_dtypes.bfloat16), None, EPS, "weight: expected float32, got bfloat16"),
    (np.zeros((), np.float32), np.zeros(3, np.float32), (), EPS, "x: expected at least 1 dimension (..., hidden)"),
    (np.zeros((2, 0), np.float32), np.zeros(0, np.float32), None, EPS,
     "x: expected its last dimension (hidden) >= 1, got (2, 0)"),
    (np.zeros((2, 3), np.float32), np.zeros(4, np.float32), None, EPS,
     "weight: expected shape (3,), x's last dimension, got weight (4,) for x (2, 3)"),
    (np.zeros((2, 3), np.float32), np.zeros((1, 3), np.float32), None, EPS, "weight: expected shape (3,)"),
    (np.zeros((2, 3), np.float32), np.zeros(3, np.float32), (3, 2), EPS, "y: expected x's shape (2, 3), got (3, 2)"),
    (np.zeros((2, 3), np.float32), np.zeros(3, np.float32), (2, 3, 1), EPS, "y: expected x's shape (2, 3)"),
    (np.zeros((2, 3), np.float32), np.zeros(3, np.float32), None, -1e-6,
     "eps: expected a finite value >= 0 within float32's range, got -1e-06"),
    (np.zeros((2, 3), np.float32), np.zeros(3, np.float32), None, float("nan"), "eps: expected a finite value >= 0 within float32's range, got nan"),
    (np.zeros((2, 3), np.float32), np.zeros(3, np.float32), None, float("inf"), "eps: expected a finite value >= 0 within float32's range, got inf"),
    (np.zeros((2, 3), np.float32), np.zeros(3, np.float32), None, 1e39,
     "eps: expected a finite value >= 0 within float32's range, got 1e+39"),
])
def test_kernel_refuses_bad_input_by_name(x, w, out_shape, eps, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        norm.rms_norm(x, w, eps, out_shape)


def test_the_launch_entry_checks_y_and_takes_the_default_eps_without_attributes(rng):
    """RfaRMSNorm called as MindSpore calls it, without its attributes (the contract's eps, 1e-6)."""
    x = rng.standard_normal((3, 40)).astype(np.float32)
    w = rng.standard_normal(40).astype(np.float32)
    lib = linear.library(texts=("RfaRMSNormLastError",))
    y = np.empty_like(x)
    direct_call(lib, "RfaRMSNorm", (x, w, y), "RfaRMSNormLastError")
    assert np.array_equal(y, norm.rms_norm(x, w, 1e-6))
    with pytest.raises(ValueError, match=re.escape("y: expected float32, got float64")):
        direct_call(lib, "RfaRMSNorm", (x, w, np.empty(x.shape)), "RfaRMSNormLastError")
    with pytest.raises(ValueError, match=re.escape("expected 2 inputs (x, weight) and 1 output, got 2 params")):
        direct_call(lib, "RfaRMSNorm", (x, w), "RfaRMSNormLastError")


class Norm(nn.Cell):
    def __init__(self, weight, eps=EPS):
        super().__init__()
        self.weight = ms.Parameter(Tensor(weight), name="weight")
        self.op = rms_norm_op(eps)

    def construct(self, x):
        return self.op(x, self.weight)


class OldNorm(nn.Cell):
    """models/llama/layers.py's RMSNorm cell before the fused op (at f2e2ae6), on the given weight."""

    def __init__(self, weight, eps=EPS):
        super().__init__()
        self.weight = ms.Parameter(Tensor(weight), name="weight")
        self.eps = eps

    def construct(self, x):
        xf = x.astype(ms.float32)
        inverse_rms = ops.rsqrt((xf * xf).mean(-1, keep_dims=True) + self.eps)
        normed = (xf * inverse_rms.broadcast_to(xf.shape)).astype(x.dtype)
        return normed * self.weight.astype(x.dtype).broadcast_to(normed.shape)


def test_op_through_mindspore_in_both_modes_with_a_dynamic_sequence_length(mode, rng):
    w = (1 + 0.1 * rng.standard_normal(72)).astype(np.float32)
    net = Norm(w, eps=0.25)  # large enough that the launch's eps (RfaRMSNormInit's) shows in every element
    if mode == "graph":
        net.set_inputs(Tensor(shape=[2, None, 72], dtype=ms.float32))
    for length in (1, 5, 37):
        x = rng.standard_normal((2, length, 72)).astype(np.float32)
        y = net(Tensor(x)).asnumpy()
        assert y.shape == x.shape and np.array_equal(y, norm.rms_norm(x, w, 0.25))  # the same kernel


@pytest.mark.parametrize("eps", [-1.0, float("nan"), float("inf"), 1e39, "1e-6", True])
def test_bad_eps_refused_by_name_before_mindspore(eps):
    with pytest.raises(ValueError, match="eps: expected"):
        rms_norm_op(eps)


def test_bad_input_through_mindspore_refused_by_the_kernel_naming_it(mode, rng):
    """A weight that does not fit x reaches the kernel (the C++ InferShape takes x's shape), which
    refuses it at launch. (A float16 x or weight is cast to float32 by MindSpore's kernel selection,
    which lists the contract's one dtype combination, as for linear_op.)"""
    net = Norm(np.ones(41, np.float32))
    with pytest.raises(RuntimeError):
        net(Tensor(rng.standard_normal((3, 40)).astype(np.float32))).asnumpy()
    assert "weight: expected shape (40,), x's last dimension, got weight (41,) for x (3, 40)" in last_error()


def test_gradient_through_mindspore_equals_autodiff_of_the_old_ops(mode, rng):
    x = rng.standard_normal((3, 7, 40)).astype(np.float32)
    w = (1 + 0.1 * rng.standard_normal(40)).astype(np.float32)
    dy = rng.standard_normal((3, 7, 40)).astype(np.float32)
    grads = []
    for net in (Norm(w), OldNorm(w)):
        grad = ops.GradOperation(get_all=True, get_by_list=True, sens_param=True)(net, net.trainable_params())
        (dx,), (dw,) = grad(Tensor(x), Tensor(dy))
        grads.append((dx.asnumpy(), dw.asnumpy()))
    (dx, dw), (dx_old, dw_old) = grads
    assert dx.dtype == np.float32 and dw.shape == (40,)
    assert np.abs(dx - dx_old).max() <= 1e-5 * np.abs(dx_old).max()
    assert np.abs(dw - dw_old).max() <= 1e-5 * np.abs(dw_old).max()


# The model: a tiny Llama (tests/test_llama.py's), computing in bfloat16 on bfloat16 weights or in float32.
needs_bf16 = pytest.mark.skipif("bfloat16" not in native_half_dtypes(),
                                reason="this CPU has no bfloat16 instructions (avx512_bf16/AMX-BF16)")


def _norms(model):
    from models.llama.layers import RMSNorm
    return [cell for _, cell in model.cells_and_names() if isinstance(cell, RMSNorm)]


def _model(compute_dtype, weight_dtype, use_op=True):
    from models.llama import LlamaForCausalLM
    from test_llama import CONFIG, random_state
    model = LlamaForCausalLM(CONFIG, compute_dtype=compute_dtype, weight_dtype=weight_dtype)
    state = random_state(CONFIG, np.random.default_rng(11))
    for name, param in model.parameters_dict().items():
        param.set_data(Tensor(state[name]).astype(param.dtype))
    if not use_op:
        for cell in _norms(model):
            cell.use_op = False  # read as a constant when the graph compiles: before the first call
    return model


@needs_bf16
def test_mindspore_model_computing_in_bfloat16_runs_the_op_close_to_the_old_ops(graph, rng):
    """One bfloat16-compute model, its norms fused and on MindSpore's ops. Each norm's output differs
    by float32 roundings (the op ran: another summation order), within the kernel's tolerance; the
    logits within 2^-8 of the largest: a float32 rounding of a norm's output can move the next
    projection's bfloat16 rounding of it by one bfloat16 ulp (2^-8 relative). (Seen: the logits were
    bit-equal, no rounding moved.)"""
    fused, old = _model("bfloat16", "bfloat16"), _model("bfloat16", "bfloat16", use_op=False)
    assert len(_norms(fused)) == 5 and all(cell.use_op and cell.op is not None for cell in _norms(fused))
    x = rng.standard_normal((2, 33, 64)).astype(np.float32)
    for cell, before in zip(_norms(fused), _norms(old)):
        got, want = cell(Tensor(x)).asnumpy(), before(Tensor(x)).asnumpy()
        _, scale = reference(x, cell.weight.asnumpy(), cell.eps)
        assert not np.array_equal(got, want) and np.all(np.abs(got - want) <= 1e-6 * scale)
    ids = Tensor(rng.integers(0, 256, (2, 33)).astype(np.int32))
    got, want = fused(ids).asnumpy(), old(ids).asnumpy()
    error = np.abs(got - want).max() / np.abs(want).max()
    print(f"bfloat16 model, fused norm against MindSpore's ops: max error {error:.2e} of the largest logit")
    assert error <= 2 ** -8


def test_mindspore_model_computing_in_float32_never_runs_the_op_and_is_bit_identical(graph, rng):
    """compute_dtype="float32" keeps MindSpore's ops: the same logits, bit for bit, as the same weights
    with every norm replaced by the cell as it was."""
    model, today = _model("float32", "float32"), _model("float32", "float32")
    assert len(_norms(model)) == 5 and not any(cell.use_op or cell.op is not None for cell in _norms(model))
    for layer in today.model.layers:
        layer.input_layernorm = OldNorm(layer.input_layernorm.weight.asnumpy(), layer.input_layernorm.eps)
        layer.post_attention_layernorm = OldNorm(layer.post_attention_layernorm.weight.asnumpy(),
                                                 layer.post_attention_layernorm.eps)
    today.model.norm = OldNorm(today.model.norm.weight.asnumpy(), today.model.norm.eps)
    assert not _norms(today)
    ids = Tensor(rng.integers(0, 256, (2, 33)).astype(np.int32))
    assert np.array_equal(model(ids).asnumpy(), today(ids).asnumpy())
