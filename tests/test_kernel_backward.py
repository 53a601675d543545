"""The CPU kernel's backward against analytic float64 gradients, called directly (no MindSpore): every
layout, both rotary modes, partial rotary, GQA/MQA, causal and not, key_rotated, the gradients of
softmax_lse and rotated_key, every dtype, and tiny tiles and forced KV splits so every tail runs.

Tolerances (max abs error against the float64 gradients of the same dtype-rounded inputs):
float32 2e-5 x max(1, |reference|); float16 / bfloat16 8 ulp of the dtype at the same magnitude
(the output's own rounding, and Delta = rowsum(dO * O) computed from the forward's rounded O).
"""
import numpy as np
import pytest

from ms_rope_attention.testing import cpu_direct as kh
from ms_rope_attention.cpu_kernel import last_error
from cases import Case
from kernel_check import check_grad
from reference import reference

TILINGS = [{}, {"block_q": 8, "block_k": 5}, {"block_q": 16, "block_k": 7, "splits": 3}]


@pytest.mark.parametrize("layout", ["BNSD", "BSND", "BSH", "TND"])
@pytest.mark.parametrize("rotary", [(0, None), (1, None), (0, 16), (1, 8)])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("tiling", range(len(TILINGS)))
def test_layouts_modes_tilings(layout, rotary, causal, tiling, rng):
    case = Case(layout=layout, mode=rotary[0], rotary_dim=rotary[1], causal=causal, heads=6, kv_heads=2, q_len=37,
                kv_len=53, head_dim=32, q_lens=[1, 20, 0, 33, 0], kv_lens=[5, 20, 3, 70, 0], random_tables=True)
    check_grad(case, rng, **TILINGS[tiling])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_low_precision(dtype, layout, rng):
    case = Case(layout=layout, heads=4, kv_heads=2, q_len=40, kv_len=70, head_dim=64, rotary_dim=32,
                q_lens=[7, 33], kv_lens=[9, 61])
    check_grad(case, rng, dtype=dtype, block_q=16, block_k=24)


@pytest.mark.parametrize("layout", ["BSH", "TND"])
@pytest.mark.parametrize("mode", [0, 1])
def test_key_rotated(layout, mode, rng):
    """key_rotated: dK is w.r.t. the key as given (no un-rotation), d_rotated_key added as it is."""
    case = Case(layout=layout, mode=mode, heads=4, kv_heads=2, q_len=5, kv_len=77, head_dim=32, rotary_dim=16,
                q_lens=[1, 3, 0], kv_lens=[40, 3, 9])
    check_grad(case, rng, key_rotated=True, block_q=8, block_k=16)


@pytest.mark.parametrize("heads,kv_heads", [(32, 8), (32, 1), (3, 3)])
@pytest.mark.parametrize("q_len,kv_len", [(1, 1), (1, 300), (65, 65), (97, 200)])
def test_gqa_mqa_lengths(heads, kv_heads, q_len, kv_len, rng):
    case = Case(heads=heads, kv_heads=kv_heads, q_len=q_len, kv_len=kv_len, head_dim=64, batch=1, layout="BSND")
    check_grad(case, rng, with_dlse=False, with_drk=False)


@pytest.mark.parametrize("head_dim", [40, 80, 128, 256])
def test_head_dims(head_dim, rng):
    check_grad(Case(head_dim=head_dim, q_len=50, kv_len=50, heads=2, kv_heads=1, batch=2), rng, scale=0.3)


def test_sharp_softmax(rng):
    """A large scale: P is close to one-hot, lse carries the whole row; gradients still match."""
    check_grad(Case(q_len=64, kv_len=100, heads=2, kv_heads=1, head_dim=32, batch=1), rng, scale=2.0,
               block_q=16, block_k=16)


def test_deterministic_run_to_run(rng):
    """Split KV chunks each own their dQ partial, summed in chunk order: bit-identical every run."""
    case = Case(q_len=300, kv_len=300, heads=4, kv_heads=1, head_dim=64, batch=1)
    first = check_grad(case, np.random.default_rng(7), splits=5)
    for _ in range(3):
        again = check_grad(case, np.random.default_rng(7), splits=5)
        for a, b in zip(first, again):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("which,shape,message", [
    ("out", (1, 4, 5, 16), "attention_out: expected shape (2, 4, 5, 16)"),
    ("lse", (2, 4, 6), "softmax_lse: expected shape (2, 4, 5)"),
    ("d_out", (2, 4, 5, 8), "d_attention_out: expected shape"),
    ("d_rk", (2, 2, 7, 8), "d_rotated_key: expected shape (2, 2, 7, 16)"),
    ("d_query", (2, 4, 5, 15), "d_query: expected shape (2, 4, 5, 16)"),
])
def test_bad_gradient_inputs_rejected(which, shape, message, rng):
    case = Case()
    q, k, v, cos, sin, _, _ = case.make(rng)
    out, lse, rk = reference(q, k, v, cos, sin, **{k_: case.kwargs[k_] for k_ in ("head_num", "input_layout")})
    args = dict(out=out, lse=lse, d_out=out, d_rk=rk)
    out_shapes = None
    if which == "d_query":
        out_shapes = (shape, k.shape, v.shape)
    else:
        args[which] = np.zeros(shape)
    code, *_ = kh.run_grad(q, k, v, cos, sin, None, None, args["out"], args["lse"], args["d_out"], None, args["d_rk"],
                           out_shapes=out_shapes, **case.kwargs)
    assert code != 0 and message in last_error(), last_error()


@pytest.mark.parametrize("tiling", [{}, {"block_q": 16, "block_k": 7}, {"block_q": 8, "block_k": 32, "splits": 2}])
@pytest.mark.parametrize("poison", [np.nan, np.inf])
def test_keys_a_query_cannot_see_never_reach_its_gradient(tiling, poison, rng):
    """NaN/Inf in the keys and values past a query's causal bound leave its d_query bit-identical:
    on a causal diagonal tile no masked key meets the query's zero dS."""
    case = Case(q_len=50, kv_len=50, heads=4, kv_heads=2, head_dim=32, batch=1)
    q, k, v, cos, sin, _, _ = case.make(rng)
    d_out = rng.standard_normal(q.shape)
    grads = []
    for poisoned in (False, True):
        k2, v2 = k.copy(), v.copy()
        if poisoned:
            k2[:, :, 37:] = poison
            v2[:, :, 37:] = poison
        code, out, lse, _ = kh.run(q, k2, v2, cos, sin, **case.kwargs)
        assert code == 0, last_error()
        code, dq, dk, dv = kh.run_grad(q, k2, v2, cos, sin, None, None, out, lse, d_out, **tiling, **case.kwargs)
        assert code == 0, last_error()
        grads.append(dq)
    np.testing.assert_array_equal(grads[1][:, :, :37], grads[0][:, :, :37])
    assert np.isfinite(grads[0]).all()
