"""The Ascend C backward kernel (aclnn/op_kernel/rotary_flash_attention_grad.h) without an NPU: its
tiling, and the kernel source run through the AscendC emulation against the float64 reference
gradients over the forward's matrix (every layout, both rotary modes, partial rotary, GQA/MQA, causal
and not, key_rotated, the softmax_lse and rotated_key gradients, every dtype pair, tile tails, odd
core counts), plus what the design promises: rows whose lse is -inf contribute nothing, and the bits
do not depend on the core count (every output row has one owner).

Tolerances: float32 as the CPU backward's (2e-5 x max(1, |reference|)); float16 / bfloat16 twice
the CPU backward's 8 ulp: the cube takes rotated Q/K, P and dS in the input dtype (one more rounding
of each than the CPU kernel, as for the forward)."""
import numpy as np
import pytest

from ms_rope_attention.testing import ascend_emulated as emu
from ms_rope_attention.testing import cpu_direct
from cases import Case
from kernel_check import check_grad, rounded

UB = 192 * 1024 - 256  # GetCoreMemSize(UB) on Atlas A2


def check(case, rng, dtype="float32", table_dtype="float32", block_q=4, block_k=16, **kwargs):
    return check_grad(case, rng, dtype, run_grad=emu.run_grad, last_error=emu.last_error,
                      factor=1 if dtype == "float32" else 2, table_dtype=table_dtype, block_q=block_q,
                      block_k=block_k, **kwargs)


# ---- tiling ----

@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("heads,kv_heads", [(32, 32), (32, 8), (32, 1)])
def test_grad_tiling_fits_the_unified_buffer(dtype, head_dim, heads, kv_heads, rng):
    case = Case(heads=heads, kv_heads=kv_heads, head_dim=head_dim, q_len=1000, kv_len=1000, batch=1, layout="BSND")
    q, k, v, cos, sin, _, _ = case.make(rng)
    code, tiling, grad, _, workspace = emu.grad_plan(q, k, v, cos, sin, dtype=dtype, **case.kwargs)
    assert code == 0, emu.last_error()
    elem = 4 if dtype == "float32" else 2
    assert 0 < grad["ub_bytes"] <= UB
    assert grad["block_kv"] in (64, 32, 16) and 1 <= grad["block_q"] <= 64
    assert (grad["block_kv"] * elem) % 32 == 0
    if head_dim <= 128:  # the Llama sizes keep full 64 x 64 tiles
        assert (grad["block_q"], grad["block_kv"]) == (64, 64)
    for key in ("ws_qs", "ws_do", "ws_kr", "ws_v", "ws_lse", "ws_delta", "ws_cores", "ws_p", "ws_ds", "ws_per_core"):
        assert grad[key] % 512 == 0
    # O(tokens x heads x head_dim): Qs, dO, Kr, V copies, two floats per query row, per-core tiles.
    q_rows, kv_rows = 1000 * heads, 1000 * kv_heads
    shared = 2 * q_rows * head_dim * elem + 2 * kv_rows * head_dim * elem + 2 * q_rows * 4
    assert shared <= grad["ws_cores"] <= shared + 6 * 512
    assert workspace == 16 * 2**20 + grad["ws_cores"] + 48 * grad["ws_per_core"]


def test_grad_tiling_refuses_what_it_cannot_do(rng):
    q, k, v, cos, sin, _, _ = Case(head_dim=256, q_len=8, kv_len=8).make(rng)
    code, *_ = emu.grad_plan(q, k, v, cos, sin, ub_bytes=16 * 1024)
    assert code != 0 and "does not fit the backward's 16384-byte Unified Buffer" in emu.last_error()
    q, k, v, cos, sin, _, _ = Case(head_dim=72, rotary_dim=72, q_len=8, kv_len=8).make(rng)
    code, *_ = emu.grad_plan(q, k, v, cos, sin)
    assert code != 0 and "head_dim 72 is not a multiple of 16" in emu.last_error()


def expected_pairs(q_lens, kv_lens, heads, causal):
    """Score entries the backward recomputes: every (query row, visible key) pair twice (once by the
    KV task owning the key, once by the Q task owning the query)."""
    return 2 * heads * sum(sum(lk - lq + i + 1 if causal else lk for i in range(lq)) for lq, lk in zip(q_lens, kv_lens))


@pytest.mark.parametrize("cores", [1, 7, 48])
@pytest.mark.parametrize("causal", [True, False])
def test_grad_work_covers_every_pair_for_any_core_count(cores, causal, rng):
    q_lens, kv_lens = [1, 700, 37, 2, 129, 0, 511], [1, 700, 300, 2, 129, 5, 511]
    case = Case(layout="TND", heads=8, kv_heads=2, head_dim=64, q_lens=q_lens, kv_lens=kv_lens, causal=causal)
    q, k, v, cos, sin, aq, ak = case.make(rng)
    code, _, _, work, _ = emu.grad_plan(q, k, v, cos, sin, aq, ak, cores=cores, **case.kwargs)
    assert code == 0, emu.last_error()
    assert work.sum() == expected_pairs(q_lens, kv_lens, 8, causal)


@pytest.mark.parametrize("heads,kv_heads", [(32, 32), (32, 8)])
def test_grad_causal_work_is_balanced_across_cores(heads, kv_heads, rng):
    """Llama2 prefill shapes on 48 vector cores: the zigzag deal of heaviest-first KV and Q tasks
    keeps every core within 10% of the mean."""
    case = Case(heads=heads, kv_heads=kv_heads, head_dim=128, q_len=4096, kv_len=4096, batch=1, layout="BSND")
    q, k, v, cos, sin, _, _ = case.make(rng)
    code, _, _, work, _ = emu.grad_plan(q, k, v, cos, sin, dtype="float16", **case.kwargs)
    assert code == 0, emu.last_error()
    assert work.max() / work.mean() < 1.10


# ---- the kernel on the emulation ----

@pytest.mark.parametrize("layout", ["BNSD", "BSND", "BSH", "TND"])
@pytest.mark.parametrize("rotary", [(0, None), (1, None), (0, 16), (1, 8)])
@pytest.mark.parametrize("causal", [True, False])
def test_emulated_grad_layouts_modes(layout, rotary, causal, rng):
    """Tails of every tile (block_q 4, block_kv 16; lengths 1..40), empty TND sequences, GQA 2."""
    case = Case(layout=layout, mode=rotary[0], rotary_dim=rotary[1], causal=causal, heads=4, kv_heads=2, q_len=9,
                kv_len=21, head_dim=32, q_lens=[1, 9, 0, 6, 0], kv_lens=[5, 9, 3, 40, 0], random_tables=True)
    check(case, rng)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("table_dtype", ["float32", "float16", "bfloat16"])
def test_emulated_grad_low_precision(dtype, table_dtype, rng):
    case = Case(layout="BSND", heads=4, kv_heads=2, q_len=17, kv_len=33, head_dim=64, rotary_dim=32, batch=1)
    check(case, rng, dtype, table_dtype)


@pytest.mark.parametrize("table_dtype", ["float16", "bfloat16"])
def test_emulated_grad_float32_inputs_low_precision_tables(table_dtype, rng):
    check(Case(layout="BNSD", heads=2, kv_heads=1, q_len=9, kv_len=20, head_dim=32), rng, table_dtype=table_dtype)


@pytest.mark.parametrize("layout", ["BSH", "TND"])
@pytest.mark.parametrize("mode", [0, 1])
def test_emulated_grad_key_rotated(layout, mode, rng):
    """key_rotated: dK is w.r.t. the key as given (no un-rotation), d_rotated_key added as it is."""
    case = Case(layout=layout, mode=mode, heads=4, kv_heads=2, q_len=5, kv_len=37, head_dim=32, rotary_dim=16,
                q_lens=[1, 3, 0], kv_lens=[20, 3, 9])
    check(case, rng, key_rotated=True)


@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (8, 1), (3, 3)])
@pytest.mark.parametrize("q_len,kv_len", [(1, 1), (1, 40), (17, 17), (33, 65)])
def test_emulated_grad_gqa_mqa_lengths(heads, kv_heads, q_len, kv_len, rng):
    check(Case(heads=heads, kv_heads=kv_heads, q_len=q_len, kv_len=kv_len, head_dim=32, batch=1, layout="BSND"), rng,
          with_dlse=False, with_drk=False)


@pytest.mark.parametrize("head_dim", [80, 128])
def test_emulated_grad_default_tiling(head_dim, rng):
    """The planned 64 x 64 tiles (no overrides): one tile's tails at 70 keys and 40 queries."""
    check(Case(heads=4, kv_heads=1, head_dim=head_dim, q_len=40, kv_len=70, batch=1, layout="BSH"), rng,
          block_q=0, block_k=0, scale=0.3)


def test_emulated_grad_sharp_softmax(rng):
    """A large scale: P close to one-hot, lse carrying the whole row."""
    check(Case(q_len=24, kv_len=40, heads=2, kv_heads=1, head_dim=32, batch=1), rng, scale=2.0)


def grad_inputs(case, rng, dtype="float32"):
    q, k, v, cos, sin, aq, ak = case.make(rng)
    q, k, v = (rounded(t, dtype) for t in (q, k, v))
    code, out, lse, _ = cpu_direct.run(q, k, v, cos, sin, aq, ak, dtype=dtype, with_rotated_key=False, **case.kwargs)
    assert code == 0
    d_out = rounded(rng.standard_normal(out.shape), dtype)
    return (q, k, v, cos, sin, aq, ak, out, lse, d_out, rng.standard_normal(lse.shape), rounded(
        rng.standard_normal(k.shape), dtype))


@pytest.mark.parametrize("cores", ["1", "3", "8"])
def test_emulated_grad_is_bit_identical_for_any_core_count(cores, monkeypatch, rng):
    """Ownership, not atomics: the same inputs give the same bits on 1, 3 (an idle vector core that
    must still reach the pre stage's SyncAll) and 8 cores, and run to run."""
    case = Case(layout="TND", heads=4, kv_heads=1, head_dim=32, q_lens=[13, 0, 30], kv_lens=[20, 4, 30])
    inputs = grad_inputs(case, np.random.default_rng(11), "float16")
    monkeypatch.setenv("RFA_EMULATED_CORES", "5")
    code, *reference_bits = emu.run_grad(*inputs, dtype="float16", block_q=4, block_k=16, **case.kwargs)
    assert code == 0, emu.last_error()
    monkeypatch.setenv("RFA_EMULATED_CORES", cores)
    for _ in range(2):
        code, *grads = emu.run_grad(*inputs, dtype="float16", block_q=4, block_k=16, **case.kwargs)
        assert code == 0, emu.last_error()
        for got, want in zip(grads, reference_bits):
            np.testing.assert_array_equal(got, want)


def test_emulated_grad_rows_whose_lse_is_minus_infinity_contribute_nothing(rng):
    """A row given lse = -inf (it saw no key, e.g. a block of a ring-attention merge): its P is exactly
    0, so its d_query is 0 and d_key / d_value are those of the other rows alone, as the CPU backward
    has them; a kernel computing exp(S - lse) there would put inf/NaN everywhere."""
    case = Case(layout="BNSD", heads=2, kv_heads=1, q_len=12, kv_len=20, head_dim=32, batch=1)
    q, k, v, cos, sin, aq, ak, out, lse, d_out, d_lse, d_rk = grad_inputs(case, rng)
    lse, out, d_lse = lse.copy(), out.copy(), d_lse.copy()
    lse[:, :, [3, 7]] = -np.inf
    out[:, :, [3, 7]] = 0.0
    d_lse[:, :, [3, 7]] = 0.0
    code, *want = cpu_direct.run_grad(q, k, v, cos, sin, aq, ak, out, lse, d_out, d_lse, d_rk, **case.kwargs)
    assert code == 0
    code, *got = emu.run_grad(q, k, v, cos, sin, aq, ak, out, lse, d_out, d_lse, d_rk, block_q=4, block_k=16,
                              **case.kwargs)
    assert code == 0, emu.last_error()
    assert (got[0][:, :, [3, 7]] == 0).all()
    for g, w in zip(got, want):
        assert np.isfinite(g).all()
        np.testing.assert_allclose(g, w, atol=2e-5 * max(1.0, np.abs(w).max()), rtol=0)


def test_emulated_grad_reports_instead_of_crashing(rng):
    case = Case()
    q, k, v, cos, sin, aq, ak, out, lse, d_out, d_lse, d_rk = grad_inputs(case, rng)
    code, *_ = emu.run_grad(q, k, v, cos, sin, aq, ak, out, lse[:, :, :-1], d_out, **case.kwargs)
    assert code != 0 and "softmax_lse: expected shape (2, 4, 5)" in emu.last_error()
    code, *_ = emu.run_grad(q, k, v, cos, sin, aq, ak, out, lse, d_out, splits=2, **case.kwargs)
    assert code != 0 and "splits: a CPU kernel tiling knob" in emu.last_error()


def clean_and_poisoned(case, rng, poison, **tiling):
    """The emulated backward's (d_query, d_key, d_value) on clean inputs, then with ``poison(q, k, v,
    d_out)`` applied to copies, each from the CPU forward's output and lse of those inputs."""
    q, k, v, cos, sin, aq, ak = case.make(rng)
    d_out = rng.standard_normal(q.shape)
    runs = []
    for poisoned in (False, True):
        q2, k2, v2, d2 = q.copy(), k.copy(), v.copy(), d_out.copy()
        if poisoned:
            poison(q2, k2, v2, d2)
        code, out, lse, _ = cpu_direct.run(q2, k2, v2, cos, sin, aq, ak, with_rotated_key=False, **case.kwargs)
        assert code == 0
        code, *grads = emu.run_grad(q2, k2, v2, cos, sin, aq, ak, out, lse, d2, **tiling, **case.kwargs)
        assert code == 0, emu.last_error()
        runs.append(grads)
    return runs


def assert_untouched(clean, poisoned, index):
    np.testing.assert_array_equal(poisoned[index], clean[index])
    assert np.isfinite(poisoned[index]).all()


@pytest.mark.parametrize("poison", [np.nan, np.inf])
def test_emulated_grad_keys_a_query_cannot_see_never_reach_its_gradient(poison, rng):
    """NaN/Inf in keys and values past a query's causal bound leave its d_query bit-identical and
    finite (the workspace rows holding them are zeroed, so 0 x NaN never happens in the cube); the
    rows that see them get non-finite gradients, from the forward's lse and output."""

    def past_37(q, k, v, d_out):
        k[:, 37:], v[:, 37:] = poison, poison

    case = Case(q_len=50, kv_len=50, heads=4, kv_heads=2, head_dim=32, batch=1, layout="BSND")
    (dq, *_), (dq_poisoned, *_) = clean_and_poisoned(case, rng, past_37, block_q=8, block_k=16)
    assert_untouched(dq, dq_poisoned, (slice(None), slice(0, 37)))
    assert not np.isfinite(dq_poisoned[:, 37:]).all()


def test_emulated_grad_poisoned_queries_never_reach_keys_they_cannot_see(rng):
    """NaN in the query and its upstream gradient at rows 0..3 (which see keys 0..3 only): the keys
    past them and the other rows keep bit-identical, finite gradients."""

    def first_4(q, k, v, d_out):
        q[:, :4], d_out[:, :4] = np.nan, np.nan

    case = Case(q_len=40, kv_len=40, heads=4, kv_heads=2, head_dim=32, batch=1, layout="BSND")
    clean, poisoned = clean_and_poisoned(case, rng, first_4, block_q=8, block_k=16)
    for which in range(3):
        assert_untouched(clean[which], poisoned[which], (slice(None), slice(4, None)))
    assert not np.isfinite(poisoned[1][:, :4]).all()


def test_emulated_grad_a_poisoned_sequence_stays_in_its_sequence(rng):
    """TND: NaN in every input row of one sequence (q, k, v, d_out) leaves the other sequences'
    d_query, d_key and d_value bit-identical and finite."""

    def sequence_1(q, k, v, d_out):
        q[9:16], k[20:27], v[20:27], d_out[9:16] = np.nan, np.nan, np.nan, np.nan

    case = Case(layout="TND", heads=4, kv_heads=2, head_dim=32, q_lens=[9, 7, 5], kv_lens=[20, 7, 11])
    clean, poisoned = clean_and_poisoned(case, rng, sequence_1, block_q=4, block_k=16)
    for which, rows in ((0, np.r_[0:9, 16:21]), (1, np.r_[0:20, 27:38]), (2, np.r_[0:20, 27:38])):
        assert_untouched(clean[which], poisoned[which], rows)
    assert not np.isfinite(poisoned[0][9:16]).all()
