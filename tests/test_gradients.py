"""Gradients through the op in MindSpore: ms.grad / value_and_grad / TrainOneStepCell / Model.train,
through the Cell and the functional op, in PyNative and GRAPH_MODE, against analytic float64
gradients (tests/reference.py, checked against finite differences in test_reference_gradients).

Tolerances as in test_kernel_backward.py: float32 2e-5 x max(1, |reference|), float16/bfloat16 8 ulp.
"""
import logging

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, nn, ops

import ms_rope_attention as mra
from ms_rope_attention import cpu_kernel, dispatch, functional, gradients
from cases import Case
from conftest import round_to, to_tensor
from reference import reference, reference_grad
from kernel_check import grad_tolerance


class Loss(nn.Cell):
    """sum(out * d_out) (+ sum(lse * d_lse)) (+ sum(rotated_key * d_rk)): its gradient is the VJP."""

    def __init__(self, use_lse, use_rk, **kwargs):
        super().__init__()
        self.op = mra.RotaryFlashAttentionOp(with_softmax_lse=use_lse, with_rotated_key=use_rk, **kwargs)
        self.use_lse, self.use_rk = use_lse, use_rk

    def construct(self, q, k, v, cos, sin, d_out, d_lse, d_rk, aq=None, ak=None):
        out, lse, rk = self.op(q, k, v, cos, sin, aq, ak)
        loss = (out.astype(ms.float32) * d_out).sum()
        if self.use_lse:
            loss = loss + ops.where(d_lse != 0, lse * d_lse, 0.0).sum()  # -inf lse rows: d_lse is 0 there
        if self.use_rk:
            loss = loss + (rk.astype(ms.float32) * d_rk).sum()
        return loss


def check_grads(case, rng, backend="fused", dtype="float32", use_lse=False, use_rk=False, key_rotated=False):
    q, k, v, cos, sin, aq, ak = case.make(rng)
    q, k, v = (round_to(t, dtype) for t in (q, k, v))
    out, lse, _ = reference(q, k, v, cos, sin, case.heads, case.layout, case.mode, case.rotary_dim, None, case.causal,
                            aq, ak, key_rotated)
    d_out = rng.standard_normal(out.shape)
    d_lse = np.where(np.isfinite(lse), rng.standard_normal(lse.shape), 0.0)
    d_rk = rng.standard_normal(k.shape)
    expected = reference_grad(q, k, v, cos, sin, d_out, d_lse if use_lse else None, d_rk if use_rk else None,
                              key_rotated=key_rotated, actual_seq_qlen=aq, actual_seq_kvlen=ak, **case.kwargs)
    net = Loss(use_lse, use_rk, backend=backend, key_rotated=key_rotated, **case.kwargs)
    f32 = lambda x: Tensor(np.asarray(x, np.float32))  # noqa: E731
    offsets = (Tensor(np.array(aq, np.int64)), Tensor(np.array(ak, np.int64))) if aq is not None else ()
    grads = ms.grad(net, grad_position=(0, 1, 2))(*(to_tensor(t, dtype) for t in (q, k, v)), f32(cos), f32(sin),
                                                  f32(d_out), f32(d_lse), f32(d_rk), *offsets)
    for name, got, want in zip(("d_query", "d_key", "d_value"), grads, expected):
        got = got.astype(ms.float32).asnumpy()
        assert got.shape == want.shape
        err = np.abs(got - want).max(initial=0)
        assert err <= grad_tolerance(dtype, want), f"{name}: max error {err}"


@pytest.mark.parametrize("layout", ["BNSD", "BSND", "BSH", "TND"])
@pytest.mark.parametrize("rotary", [(0, None), (1, 8)])
@pytest.mark.parametrize("causal", [True, False])
def test_layouts_modes_causal(mode, layout, rotary, causal, rng):
    case = Case(layout=layout, mode=rotary[0], rotary_dim=rotary[1], causal=causal, q_len=5, kv_len=9,
                q_lens=[3, 1, 4, 0], kv_lens=[3, 6, 9, 2])
    check_grads(case, rng)


@pytest.mark.parametrize("backend", ["fused", "unfused"])
@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_lse_and_rotated_key_gradients(mode, backend, layout, rng):
    """softmax_lse and rotated_key are differentiable outputs; their gradients join d_query/d_key."""
    case = Case(layout=layout, heads=4, kv_heads=2, q_len=6, kv_len=11, q_lens=[2, 4], kv_lens=[5, 6])
    check_grads(case, rng, backend=backend, use_lse=True, use_rk=True)


@pytest.mark.parametrize("backend", ["fused", "unfused"])
def test_keys_a_row_cannot_see_never_reach_its_gradient(mode, backend, rng):
    """NaN/Inf in keys/values past the causal bound of rows 0..36 leave those rows' d_query
    bit-identical (0 x NaN in dS K would carry them there). One net for the clean run and both
    poisons: one compile."""
    case = Case(layout="BSND", heads=4, kv_heads=2, q_len=50, kv_len=50, head_dim=16)
    q, k, v, cos, sin, _, _ = case.make(rng)
    d_out = rng.standard_normal(q.shape)
    grad = ms.grad(Loss(False, False, backend=backend, **case.kwargs), grad_position=(0,))
    f32 = lambda x: Tensor(np.asarray(x, np.float32))  # noqa: E731

    def d_query(poison=None):
        k2, v2 = k.copy(), v.copy()
        if poison is not None:
            k2[:, 37:], v2[:, 37:] = poison, poison
        return grad(f32(q), f32(k2), f32(v2), f32(cos), f32(sin), f32(d_out), f32(np.zeros(1)),
                    f32(np.zeros(1))).asnumpy()
    clean = d_query()
    assert np.isfinite(clean).all()
    for poison in (np.nan, np.inf):
        np.testing.assert_array_equal(d_query(poison)[:, :37], clean[:, :37], err_msg=f"poison {poison}")


@pytest.mark.parametrize("layout", ["BSH", "TND"])
def test_key_rotated(mode, layout, rng):
    case = Case(layout=layout, mode=1, heads=4, kv_heads=1, q_len=1, kv_len=13, q_lens=[1, 1], kv_lens=[13, 4])
    check_grads(case, rng, key_rotated=True, use_rk=True)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_low_precision(mode, dtype, rng):
    check_grads(Case(layout="BSND", q_len=17, kv_len=17, heads=4, kv_heads=1, head_dim=32), rng, dtype=dtype)


def test_reference_gradients(rng):
    """The float64 reference gradients against central finite differences of the float64 forward."""
    case = Case(layout="TND", mode=1, rotary_dim=8, heads=4, kv_heads=2, head_dim=16, q_lens=[1, 5, 0],
                kv_lens=[4, 9, 2], random_tables=True)
    q, k, v, cos, sin, aq, ak = case.make(rng)
    out, lse, rk = reference(q, k, v, cos, sin, case.heads, case.layout, case.mode, case.rotary_dim, None,
                             case.causal, aq, ak)
    d_out, d_lse, d_rk = (rng.standard_normal(x.shape) for x in (out, lse, rk))
    expected = reference_grad(q, k, v, cos, sin, d_out, d_lse, d_rk, actual_seq_qlen=aq, actual_seq_kvlen=ak,
                              **case.kwargs)

    def loss(*qkv):
        o, l, r = reference(*qkv, cos, sin, case.heads, case.layout, case.mode, case.rotary_dim, None, case.causal,
                            aq, ak)
        return (o * d_out).sum() + (l * d_lse).sum() + (r * d_rk).sum()

    eps = 1e-6
    for which, x in enumerate((q, k, v)):
        for index in [tuple(rng.integers(0, s) for s in x.shape) for _ in range(15)]:
            plus, minus = [list((q, k, v)) for _ in range(2)]
            plus[which], minus[which] = x.copy(), x.copy()
            plus[which][index] += eps
            minus[which][index] -= eps
            numeric = (loss(*plus) - loss(*minus)) / (2 * eps)
            assert abs(numeric - expected[which][index]) <= 1e-6 * max(1.0, abs(numeric))


def test_functional_value_and_grad_pynative(rng):
    ms.set_context(mode=ms.PYNATIVE_MODE)
    case = Case(layout="BSND", heads=4, kv_heads=2, q_len=7, kv_len=7)
    q, k, v, cos, sin, _, _ = case.make(rng)
    d_out = rng.standard_normal(q.shape)
    f32 = lambda x: Tensor(np.asarray(x, np.float32))  # noqa: E731

    def loss(q_, k_, v_):
        out, lse = mra.rotary_flash_attention(q_, k_, v_, f32(cos), f32(sin), input_layout="BSND",
                                              return_softmax_lse=True)
        return (out * f32(d_out)).sum() + lse.sum()

    value, grads = ms.value_and_grad(loss, grad_position=(0, 1, 2))(f32(q), f32(k), f32(v))
    out, lse, _ = reference(q, k, v, cos, sin, input_layout="BSND")
    assert abs(float(value) - ((out * d_out).sum() + lse.sum())) < 1e-3
    expected = reference_grad(q, k, v, cos, sin, d_out, np.ones(lse.shape), input_layout="BSND")
    for got, want in zip(grads, expected):
        assert np.abs(got.asnumpy() - want).max() <= grad_tolerance("float32", want)


class TinyAttentionModel(nn.Cell):
    """Projections around RotaryFlashAttention: enough to train."""

    def __init__(self, backend, hidden=32, heads=4, kv_heads=2):
        super().__init__()
        head_dim = hidden // heads
        self.q = nn.Dense(hidden, hidden, has_bias=False)
        self.k = nn.Dense(hidden, kv_heads * head_dim, has_bias=False)
        self.v = nn.Dense(hidden, kv_heads * head_dim, has_bias=False)
        self.o = nn.Dense(hidden, hidden, has_bias=False)
        self.attn = mra.RotaryFlashAttention(heads, head_dim, input_layout="BSH", max_position_embeddings=64,
                                             backend=backend)

    def construct(self, x):
        return self.o(self.attn(self.q(x), self.k(x), self.v(x)))


def _trained_losses(backend, steps, seed=0, dynamic=False):
    ms.set_seed(seed)
    np.random.seed(seed)
    net = TinyAttentionModel(backend)
    loss_net = nn.WithLossCell(net, nn.MSELoss())
    train = nn.TrainOneStepCell(loss_net, nn.Adam(net.trainable_params(), learning_rate=1e-2))
    if dynamic:
        train.set_inputs(Tensor(shape=[2, None, 32], dtype=ms.float32), Tensor(shape=[2, None, 32], dtype=ms.float32))
    rng = np.random.default_rng(seed)
    batches = [rng.standard_normal((2, length, 32)).astype(np.float32) for length in ((9, 16, 5) if dynamic else (12,))]
    losses = []
    for step in range(steps):
        x = batches[step % len(batches)]
        target = np.roll(x, 1, axis=1)  # a task attention can learn: copy the previous token
        losses.append(float(train(Tensor(x), Tensor(target)).asnumpy()))
    return losses, train


def test_train_one_step_fused_tracks_unfused(mode):
    """10 steps: the loss is down to 0.59 of the first by then (an unfused step in PyNative, its
    autodiff op by op, takes half a second on 2 busy cores)."""
    fused, _ = _trained_losses("fused", 10)
    unfused, _ = _trained_losses("unfused", 10)
    np.testing.assert_allclose(fused, unfused, rtol=2e-4, atol=1e-5)
    assert fused[-1] < 0.7 * fused[0]


def test_dynamic_sequence_length_compiles_once():
    ms.set_context(mode=ms.GRAPH_MODE)
    losses, train = _trained_losses("fused", 6, dynamic=True)
    assert len(train.compile_cache) == 1 and all(np.isfinite(losses))


def test_model_train(mode):
    import mindspore.dataset as ds

    ms.set_seed(0)
    net = TinyAttentionModel("fused")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 12, 32)).astype(np.float32)
    data = ds.NumpySlicesDataset({"x": x, "y": np.roll(x, 1, axis=1)}, shuffle=False).batch(4)
    loss_net = nn.WithLossCell(net, nn.MSELoss())
    loss = lambda: float(loss_net(Tensor(x), Tensor(np.roll(x, 1, axis=1))).asnumpy())  # noqa: E731
    before = loss()
    model = ms.Model(net, loss_fn=nn.MSELoss(), optimizer=nn.Adam(net.trainable_params(), learning_rate=1e-2))
    model.train(5, data, dataset_sink_mode=False)
    assert loss() < 0.9 * before


def test_backward_fallback_is_announced_and_strict_raises(monkeypatch, caplog, rng, request):
    """Without a fused backward the gradient is the unfused path's autodiff: one warning naming the
    backward; strict=True raises instead."""
    ms.set_context(mode=ms.PYNATIVE_MODE)
    monkeypatch.setattr(cpu_kernel, "FUSED_BACKWARD", False)
    monkeypatch.setattr(gradients, "_announced", set())
    dispatch.clear()  # backends built before had the fused backward, and those built here have none
    request.addfinalizer(dispatch.clear)
    case = Case(layout="BSND", q_len=6, kv_len=6)
    with caplog.at_level(logging.WARNING, logger="ms_rope_attention"):
        check_grads(case, rng, backend="auto", use_lse=True, use_rk=True)
        check_grads(case, rng, backend="auto")
    messages = [r.getMessage() for r in caplog.records if "rotary_fusion_fallback" in r.getMessage()]
    assert len(messages) == 1 and "backward" in messages[0]
    with pytest.raises(mra.RotaryFusionFallbackError, match="backward"):
        check_grads(case, rng, backend="fused")
