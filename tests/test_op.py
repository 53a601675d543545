"""The MindSpore-facing op (functional and Cells) on both backends, in PyNative and GRAPH_MODE,
against the float64 reference."""
import logging
import types

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, nn

import ms_rope_attention as mra
from ms_rope_attention import dispatch, functional, gradients
from cases import Case
from one_graph import InOneGraph
from conftest import MS_DTYPES, round_to, to_numpy, to_tensor, tolerance
from reference import reference

BACKENDS = ["fused", "unfused"]


class OpNet(nn.Cell):
    def __init__(self, **kwargs):
        super().__init__()
        self.op = mra.RotaryFlashAttentionOp(with_softmax_lse=True, with_rotated_key=True, **kwargs)

    def construct(self, q, k, v, cos, sin, aq=None, ak=None):
        return self.op(q, k, v, cos, sin, aq, ak)


def prepare_case(case, rng, backend, dtype="float32", key_rotated=False):
    """(net, its inputs, check(outputs)) of one case against the float64 reference."""
    q, k, v, cos, sin, aq, ak = case.make(rng)
    q, k, v = (round_to(t, dtype) for t in (q, k, v))
    ro, rl, rk = reference(q, k, v, cos, sin, case.heads, case.layout, case.mode, case.rotary_dim, None, case.causal,
                           aq, ak, key_rotated)
    # float32 arithmetic on every input dtype (compute_dtype 'auto' is bfloat16 for bfloat16 inputs on a CPU
    # with avx512_bf16: tests/test_kernel_bf16.py checks that against its own reference)
    net = OpNet(backend=backend, key_rotated=key_rotated, compute_dtype="float32", **case.kwargs)
    offsets = (Tensor(np.array(aq, np.int64)), Tensor(np.array(ak, np.int64))) if aq is not None else ()
    inputs = (*(to_tensor(t, dtype) for t in (q, k, v)), Tensor(cos.astype(np.float32)),
              Tensor(sin.astype(np.float32)), *offsets)

    def check(out, lse, rot):
        assert out.dtype == MS_DTYPES[dtype], (case, dtype)
        assert np.abs(to_numpy(out) - ro).max() <= tolerance(dtype, ro), (case, dtype)
        assert np.abs(to_numpy(rot) - rk).max() <= tolerance(dtype, rk), (case, dtype)
        np.testing.assert_allclose(lse.asnumpy(), rl, atol=1e-4, err_msg=f"{case} {dtype}")
    return net, inputs, check


def run_case(case, rng, backend, dtype="float32", key_rotated=False):
    net, inputs, check = prepare_case(case, rng, backend, dtype, key_rotated)
    check(*net(*inputs))


def run_in_one_graph(prepared):
    """prepare_case's results run as one GRAPH_MODE graph, each output checked."""
    nets, inputs, checks = zip(*prepared)
    outs = InOneGraph(nets, [len(i) for i in inputs])(*(t for i in inputs for t in i))
    for check, out in zip(checks, outs):
        check(*out)


LAYOUTS, ROTARY, CAUSAL = ["BNSD", "BSND", "BSH", "TND"], [(0, None), (1, 8)], [True, False]


def layouts_case(layout, rotary, causal):
    return Case(layout=layout, mode=rotary[0], rotary_dim=rotary[1], causal=causal, q_len=5, kv_len=9,
                q_lens=[3, 1, 4], kv_lens=[3, 6, 9])


@pytest.mark.parametrize("mode", ["pynative"], indirect=True)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("rotary", ROTARY)
@pytest.mark.parametrize("causal", CAUSAL)
def test_layouts_modes_causal(mode, backend, layout, rotary, causal, rng):
    run_case(layouts_case(layout, rotary, causal), rng, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_layouts_modes_causal_in_one_graph(graph, backend):
    """test_layouts_modes_causal's cases in GRAPH_MODE as one graph, each on the inputs the rng fixture
    would give it."""
    run_in_one_graph([prepare_case(layouts_case(layout, rotary, causal), np.random.default_rng(1234), backend)
                      for layout in LAYOUTS for rotary in ROTARY for causal in CAUSAL])


LOW_PRECISION_CASE = Case(layout="BSND", q_len=17, kv_len=17, heads=4, kv_heads=1, head_dim=32)


@pytest.mark.parametrize("mode", ["pynative"], indirect=True)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_low_precision(mode, backend, dtype, rng):
    run_case(LOW_PRECISION_CASE, rng, backend, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_low_precision_in_one_graph(graph, backend):
    run_in_one_graph([prepare_case(LOW_PRECISION_CASE, np.random.default_rng(1234), backend, dtype)
                      for dtype in ("float16", "bfloat16")])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("heads,kv_heads,q_len,kv_len", [(32, 8, 7, 7), (32, 1, 1, 33), (4, 4, 1, 1), (4, 2, 17, 31)])
def test_gqa_and_lengths(backend, heads, kv_heads, q_len, kv_len, rng):
    ms.set_context(mode=ms.PYNATIVE_MODE)
    run_case(Case(heads=heads, kv_heads=kv_heads, q_len=q_len, kv_len=kv_len, head_dim=16, batch=1), rng, backend)


def key_rotated_case(layout):
    return Case(layout=layout, mode=1, rotary_dim=8, q_len=1, kv_len=9, q_lens=[1, 1, 2], kv_lens=[3, 6, 9])


@pytest.mark.parametrize("mode", ["pynative"], indirect=True)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["BSH", "TND"])
def test_key_rotated(mode, backend, layout, rng):
    run_case(key_rotated_case(layout), rng, backend, key_rotated=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_key_rotated_in_one_graph(graph, backend):
    run_in_one_graph([prepare_case(key_rotated_case(layout), np.random.default_rng(1234), backend, key_rotated=True)
                      for layout in ("BSH", "TND")])


def test_functional_returns(rng):
    ms.set_context(mode=ms.PYNATIVE_MODE)
    case = Case(layout="TND", q_lens=[2, 3], kv_lens=[4, 3])
    q, k, v, cos, sin, aq, ak = case.make(rng)
    args = [Tensor(t.astype(np.float32)) for t in (q, k, v, cos, sin)]
    out = mra.rotary_flash_attention(*args, 4, input_layout="TND", actual_seq_qlen=aq, actual_seq_kvlen=ak)
    ro, rl, rk = reference(q, k, v, cos, sin, 4, "TND", 0, None, None, True, aq, ak)
    np.testing.assert_allclose(out.asnumpy(), ro, atol=1e-5)
    out, lse = mra.rotary_flash_attention(*args, 4, input_layout="TND", actual_seq_qlen=aq, actual_seq_kvlen=ak,
                                          return_softmax_lse=True)
    np.testing.assert_allclose(lse.asnumpy(), rl, atol=1e-4)


def test_cell_owns_shared_tables_and_matches_reference(mode, rng):
    cell = mra.RotaryFlashAttention(head_num=4, head_dim=16, max_position_embeddings=64, input_layout="BSND")
    other = mra.RotaryFlashAttention(head_num=4, head_dim=16, max_position_embeddings=64, input_layout="BSND")
    assert cell.cos is other.cos and cell.sin is other.sin  # one cache for every layer
    assert cell.backend == "fused:CPU"
    q, k, v = (rng.standard_normal((2, 11, 4, 16)) for _ in range(3))
    cos, sin = mra.rope_tables(16, 64)
    ro, _, _ = reference(q, k, v, cos, sin, 4, "BSND")
    out = cell(*(Tensor(t.astype(np.float32)) for t in (q, k, v)))
    np.testing.assert_allclose(out.asnumpy(), ro, atol=1e-5)


def test_graph_mode_dynamic_sequence_compiles_once(rng):
    ms.set_context(mode=ms.GRAPH_MODE)
    cell = mra.RotaryFlashAttention(head_num=4, head_dim=16, max_position_embeddings=128, input_layout="BNSD",
                                    return_rotated_key=True)
    dyn = Tensor(shape=[1, 4, None, 16], dtype=ms.float32)
    cell.set_inputs(dyn, dyn, dyn)
    cos, sin = mra.rope_tables(16, 128)
    for length in (5, 64, 17, 100, 5):
        q, k, v = (rng.standard_normal((1, 4, length, 16)) for _ in range(3))
        out, rot = cell(*(Tensor(t.astype(np.float32)) for t in (q, k, v)))
        ro, _, rk = reference(q, k, v, cos, sin, 4)
        np.testing.assert_allclose(out.asnumpy(), ro, atol=1e-5)
        np.testing.assert_allclose(rot.asnumpy(), rk, atol=1e-5)
    assert len(cell.compile_cache) == 1  # one graph for every sequence length


def test_fallback_is_loud_and_strict_raises(monkeypatch, caplog, request):
    ms.set_context(mode=ms.PYNATIVE_MODE)
    monkeypatch.setitem(dispatch.FACTORIES, "CPU", types.SimpleNamespace(unavailable=lambda: "test: kernel missing"))
    monkeypatch.setattr(gradients, "_announced", set())
    dispatch.clear()  # and again after the test: its backends are the fallback's
    request.addfinalizer(dispatch.clear)
    with caplog.at_level(logging.WARNING, logger="ms_rope_attention"):
        cell = mra.RotaryFlashAttention(head_num=2, head_dim=8)
        mra.RotaryFlashAttention(head_num=2, head_dim=8)
    messages = [r.getMessage() for r in caplog.records if "rotary_fusion_fallback" in r.getMessage()]
    assert len(messages) == 1 and "test: kernel missing" in messages[0]  # one-time warning, with the reason
    assert cell.backend == "unfused"
    with pytest.raises(mra.RotaryFusionFallbackError, match="kernel missing"):
        mra.RotaryFlashAttention(head_num=2, head_dim=8, strict=True)
    with pytest.raises(mra.RotaryFusionFallbackError):
        mra.RotaryFlashAttention(head_num=2, head_dim=8, backend="fused")


def test_table_dtypes_are_cast_not_fallen_back(mode, rng):
    """float16 / float64 tables with float32 q: the fused kernel still runs (float32 math)."""
    case = Case(q_len=6, kv_len=6)
    q, k, v, cos, sin, _, _ = case.make(rng)
    ro, _, _ = reference(q, k, v, cos, sin, 4)
    for table_dtype, atol in ((np.float64, 1e-5), (np.float16, 3e-3)):
        net = OpNet(head_num=4, backend="auto")
        assert net.op.backend_name == "fused:CPU"
        out, _, _ = net(*(Tensor(t.astype(np.float32)) for t in (q, k, v)), Tensor(cos.astype(table_dtype)),
                        Tensor(sin.astype(table_dtype)))
        np.testing.assert_allclose(out.asnumpy(), ro, atol=atol)


@pytest.mark.parametrize("backend", ["fused", "unfused"])
def test_keys_a_row_cannot_see_never_reach_it(mode, backend, rng):
    """NaN/Inf in keys and values a row cannot see leave its output and lse bit-identical: past the
    causal bound (BSND), and in the next sequence of a TND batch. Rows that do see them are not
    finite. One net per layout for the clean call and both poisons (one compile each in GRAPH_MODE)."""
    for layout, q_lens, kv_lens in (("BSND", None, None), ("TND", [20, 13], [37, 13])):
        case = Case(layout=layout, heads=4, kv_heads=2, q_len=50, kv_len=50, head_dim=16, batch=1,
                    q_lens=q_lens or [], kv_lens=kv_lens or [])
        q, k, v, cos, sin, aq, ak = case.make(rng)
        net = OpNet(backend=backend, **case.kwargs)
        offsets = (Tensor(np.array(aq, np.int64)), Tensor(np.array(ak, np.int64))) if aq is not None else ()
        f32 = lambda x: Tensor(x.astype(np.float32))  # noqa: E731
        clean_out, clean_lse, _ = net(f32(q), f32(k), f32(v), f32(cos), f32(sin), *offsets)
        for poison in (np.nan, np.inf):
            k2, v2 = k.copy(), v.copy()
            if layout == "BSND":
                k2[:, 37:], v2[:, 37:] = poison, poison   # keys 37.. : rows 0..36 cannot see them
                hidden = (slice(None), slice(0, 37))
                seeing = (slice(None), slice(37, None))
            else:
                k2[37:], v2[37:] = poison, poison         # the second sequence's keys
                hidden = (slice(0, 20),)
                seeing = (slice(20, None),)
            out, lse, _ = net(f32(q), f32(k2), f32(v2), f32(cos), f32(sin), *offsets)
            np.testing.assert_array_equal(out.asnumpy()[hidden], clean_out.asnumpy()[hidden], err_msg=f"{poison}")
            lse_hidden = (slice(None), slice(None), slice(0, 37)) if layout == "BSND" else hidden
            np.testing.assert_array_equal(lse.asnumpy()[lse_hidden], clean_lse.asnumpy()[lse_hidden],
                                          err_msg=f"{poison}")
            assert not np.isfinite(out.asnumpy()[seeing]).all(), poison


def test_nan_in_a_short_query_reaches_its_rows(mode):
    """Issue 37's cases, on the decode path (q_len 5 <= 16): BNSD q, k, v (1, 4, 5, 8), causal; NaN
    at q[0, 1, 2, 3] makes that row's 8 outputs NaN, NaN at cos[4, 0] the 32 outputs of position 4
    (every head); every other output equals the clean call's, bitwise. One net for both (one compile)."""
    rng = np.random.default_rng(7)
    q, k, v = (rng.standard_normal((1, 4, 5, 8)).astype(np.float32) for _ in range(3))
    cos, sin = (t.astype(np.float32) for t in mra.rope_tables(8, 5))
    net = OpNet(head_num=4)
    clean = net(*(Tensor(t) for t in (q, k, v, cos, sin)))[0].asnumpy()
    for poison in ("query", "cos"):
        q2, cos2, bad = q.copy(), cos.copy(), np.zeros(q.shape, bool)
        if poison == "query":
            q2[0, 1, 2, 3] = np.nan
            bad[0, 1, 2] = True
        else:
            cos2[4, 0] = np.nan
            bad[:, :, 4] = True
        out = net(*(Tensor(t) for t in (q2, k, v, cos2, sin)))[0].asnumpy()
        assert np.isnan(out[bad]).all() and np.isnan(out).sum() == bad.sum(), poison
        np.testing.assert_array_equal(out[~bad], clean[~bad], err_msg=poison)
