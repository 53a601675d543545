"""The fused CPU kernel against the float64 reference, called directly (no MindSpore): wide shape
sweeps, every dtype, tiny tiles so every tail and split path runs."""
import numpy as np
import pytest

from ms_rope_attention.testing import cpu_direct as kh
from ms_rope_attention.cpu_kernel import last_error
from cases import Case
from conftest import tolerance
from kernel_check import check_kernel
from reference import reference, rope_tables


def check(case, rng, dtype="float32", table_dtype="float32", scale=None, key_rotated=False, **tiling):
    check_kernel(case, rng, kh.run, last_error, dtype=dtype, table_dtype=table_dtype, scale=scale,
                 key_rotated=key_rotated, **tiling)


@pytest.mark.parametrize("layout", ["BNSD", "BSND", "BSH", "TND"])
@pytest.mark.parametrize("mode", [0, 1])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_layouts_modes_dtypes(layout, mode, causal, dtype, rng):
    case = Case(layout=layout, mode=mode, causal=causal, heads=6, kv_heads=2, q_len=37, kv_len=53, head_dim=32,
                rotary_dim=16, q_lens=[1, 20, 0, 33], kv_lens=[5, 20, 3, 70], random_tables=True)
    check(case, rng, dtype=dtype, rows=8, kv_block=16)


@pytest.mark.parametrize("q_len,kv_len", [(1, 1), (1, 700), (3, 3), (17, 17), (63, 64), (65, 129), (129, 217),
                                          (200, 200), (5, 781)])
def test_lengths_and_tails(q_len, kv_len, rng):
    check(Case(q_len=q_len, kv_len=kv_len, heads=4, kv_heads=4, head_dim=64, batch=1), rng)


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
def test_head_dims(head_dim, rng):
    check(Case(head_dim=head_dim, q_len=70, kv_len=70, heads=2, kv_heads=1, batch=1), rng)
    check(Case(head_dim=head_dim, rotary_dim=head_dim // 2, mode=1, q_len=9, kv_len=33, heads=2, kv_heads=2,
               batch=1), rng)


@pytest.mark.parametrize("heads,kv_heads", [(32, 8), (32, 1)])
@pytest.mark.parametrize("q_len,kv_len", [(1, 600), (48, 48)])
def test_gqa_mqa(heads, kv_heads, q_len, kv_len, rng):
    check(Case(heads=heads, kv_heads=kv_heads, q_len=q_len, kv_len=kv_len, head_dim=64, batch=1, layout="BSND"), rng)


def test_tnd_mixed_lengths(rng):
    lens = [1, 700, 37, 2, 129, 64, 511]
    q_lens = [1, 700, 1, 2, 100, 64, 3]
    check(Case(layout="TND", heads=8, kv_heads=2, head_dim=64, q_lens=q_lens, kv_lens=lens), rng)


def test_bfloat16_rounding_and_nan_bit_exact(rng):
    """bfloat16 in and out, bit for bit: with cos = 1/3 and sin = 0 the rotated key is exactly the
    float32 product x * (1/3), rounded to nearest even. A NaN stays NaN: one in V in the output
    column it feeds and nowhere else, and one with an all-ones payload in cos (which rounding would
    carry into -0.0) in the rotated key. head_dim 40 runs the vector conversion and its tail."""
    q, k, v = (rng.standard_normal((1, 1, 40, 40)) for _ in range(3))
    cos, sin = np.full((40, 40), 1 / 3, np.float32), np.zeros((40, 40), np.float32)
    key = kh.from_bf16_bits(kh.to_bf16_bits(k))
    expected = kh.from_bf16_bits(kh.to_bf16_bits(key * np.float32(1 / 3))).astype(np.float64)
    v_nan = v.copy()
    v_nan[0, 0, 0, 3] = np.nan
    code, out, _, rk = kh.run(q, k, v_nan, cos, sin, dtype="bfloat16", with_rotated_key=True, head_num=1)
    assert code == 0, last_error()
    np.testing.assert_array_equal(rk, expected)
    assert np.isnan(out[..., 3]).all() and np.isfinite(np.delete(out, 3, axis=-1)).all()
    cos.view(np.uint32)[5, 7] = 0x7FFFFFFF
    expected[0, 0, 5, 7] = np.nan
    code, _, _, rk = kh.run(q, k, v, cos, sin, dtype="bfloat16", with_rotated_key=True, head_num=1)
    assert code == 0, last_error()
    np.testing.assert_array_equal(rk, expected)


@pytest.mark.parametrize("table_dtype", ["float16", "bfloat16"])
def test_low_precision_tables(table_dtype, rng):
    check(Case(q_len=20, kv_len=40), rng, table_dtype=table_dtype)


def test_explicit_scale_and_large_positions(rng):
    # Real inverse frequencies at positions near 4096: the bf16-angle pitfall stays out of the kernel.
    case = Case(q_len=4, kv_len=4100, heads=2, kv_heads=1, head_dim=128, batch=1)
    check(case, rng, scale=0.05)


@pytest.mark.parametrize("causal", [True, False])
def test_sharp_softmax_rescales(causal, rng):
    """Scores of several tens (a large scale): a later tile's max often passes the row's reference
    max by more than the rescaling slack, so the running sum and O rows are rescaled mid-row."""
    case = Case(q_len=64, kv_len=200, heads=4, kv_heads=2, head_dim=32, batch=1, causal=causal)
    check(case, rng, scale=2.0, rows=8, kv_block=16)


@pytest.mark.parametrize("step", [0.5, 40.0])
def test_scores_growing_along_the_keys(step, rng):
    """Each key's score is `step` (log2 units) above the previous one's: every tile's max passes the
    last by far more than float32's exponent range allows without rescaling (step 40: 640 per
    16-key tile), or by just a few units (step 0.5). No rotation (cos 1, sin 0), one head."""
    n, d = 80, 16
    q = np.zeros((1, 1, n, d))
    q[..., 0] = 1.0
    k = np.zeros((1, 1, n, d))
    k[..., 0] = np.arange(n) * step / np.log2(np.e)  # scale 1: score = k[..., 0] in natural units
    v = rng.standard_normal((1, 1, n, d))
    cos, sin = np.ones((n, d)), np.zeros((n, d))
    ro, rl, _ = reference(q, k, v, cos, sin, scale=1.0)
    code, out, lse, _ = kh.run(q, k, v, cos, sin, scale=1.0, kv_block=16, rows=8, head_num=1)
    assert code == 0, last_error()
    assert np.abs(out - ro).max() <= tolerance("float32", ro)
    assert np.abs(lse - rl).max() <= 1e-4 + 1e-6 * np.abs(rl).max()


def test_decode_split_kv_matches_unsplit(rng):
    """q_len 1 over a long KV splits the KV range across threads (and the KV tiles, with kv_block=32);
    the log-sum-exp merge must match the reference."""
    case = Case(q_len=1, kv_len=3000, heads=2, kv_heads=1, head_dim=64, batch=1)
    check(case, rng)
    check(case, rng, kv_block=32)


@pytest.mark.parametrize("pack_tiles", [1, 6])
@pytest.mark.parametrize("causal", [True, False])
def test_packing_in_chunks(pack_tiles, causal, rng):
    """K/V are packed a chunk of (sequence, KV head) units at a time, a chunk bounded by a byte
    budget: one unit per chunk (a budget below one tile), and chunks of several short units next to
    units bigger than the budget (6 tiles of (32 x 16 + 16 x 32) x 4 = 4096 bytes), must give the
    same answer as everything in one chunk, for prefill blocks, a varlen batch and decode splits."""
    tiling = {"pack_bytes": 1 if pack_tiles == 1 else pack_tiles * 4096, "rows": 8, "kv_block": 16}
    check(Case(layout="TND", causal=causal, heads=4, kv_heads=2, head_dim=32, q_lens=[1, 33, 0, 70, 5],
               kv_lens=[60, 40, 3, 130, 20]), rng, **tiling)
    check(Case(q_len=1, kv_len=300, heads=2, kv_heads=1, head_dim=32, batch=1, causal=causal), rng, **tiling)


@pytest.mark.parametrize("layout", ["BSH", "TND"])
@pytest.mark.parametrize("mode", [0, 1])
def test_key_rotated_reads_key_as_given(layout, mode, rng):
    case = Case(layout=layout, mode=mode, heads=4, kv_heads=2, q_len=5, kv_len=77, head_dim=32, rotary_dim=16,
                q_lens=[1, 3, 0], kv_lens=[40, 3, 9])
    check(case, rng, rows=4, kv_block=16, key_rotated=True)
    check(Case(layout=layout, mode=mode, q_len=1, kv_len=2000, heads=2, kv_heads=1, q_lens=[1, 1],
               kv_lens=[2000, 700]), rng, key_rotated=True)  # decode: split KV


@pytest.mark.parametrize("mode", [0, 1])
def test_decode_on_rotated_cache_equals_full_attention(mode, rng):
    """Prefill emits rotated K; decoding the last token against that cache (key_rotated) gives the
    same row as attending over the whole sequence with un-rotated keys."""
    case = Case(layout="BSND", mode=mode, heads=4, kv_heads=2, q_len=65, kv_len=65, head_dim=64, batch=2)
    q, k, v, cos, sin, _, _ = case.make(rng)
    code, full, _, rotated = kh.run(q, k, v, cos, sin, **case.kwargs)
    assert code == 0, last_error()
    code, last, _, _ = kh.run(q[:, -1:], rotated, v, cos, sin, key_rotated=True, **case.kwargs)
    assert code == 0, last_error()
    assert np.abs(last - full[:, -1:]).max() <= 1e-5


def test_inputs_not_modified(rng):
    case = Case(q_len=9, kv_len=9)
    q, k, v, cos, sin, _, _ = case.make(rng)
    arrays = [a.astype(np.float32) for a in (q, k, v, cos, sin)]
    copies = [a.copy() for a in arrays]
    code, *_ = kh.run(*arrays, **case.kwargs)
    assert code == 0
    for a, c in zip(arrays, copies):
        np.testing.assert_array_equal(a, c)


def test_output_shape_mismatch_rejected(rng):
    q, k, v, cos, sin, _, _ = Case().make(rng)
    code, *_ = kh.run(q, k, v, cos, sin, out_shapes=((1,), (0,), (0,)), with_lse=False, with_rotated_key=False,
                      head_num=4)
    assert code != 0 and "attention_out" in last_error()


@pytest.mark.parametrize("aq,ak,message", [
    ([3, 2], [4, 7], "non-decreasing"),
    ([3, 6], [4, 7], "last offset must equal"),
    ([5, 5], [4, 7], "q_len 5 > kv_len 4"),
    ([3, 5], [4, 9], "last offset must equal the token count 7"),
    ([1, 5], [1, 7], "table has 5 positions, sequence 1 needs 6"),
])
def test_kernel_rejects_bad_offsets_before_reading(aq, ak, message, rng):
    q, k, v, cos, sin, _, _ = Case(layout="TND", q_lens=[3, 2], kv_lens=[4, 3], table_rows=5).make(rng)
    code, *_ = kh.run(q, k, v, cos, sin, aq, ak, input_layout="TND", head_num=4)
    assert code != 0 and message in last_error()


@pytest.mark.parametrize("tiling", [{}, {"rows": 8, "kv_block": 16}])
@pytest.mark.parametrize("poison", [np.nan, np.inf])
def test_keys_a_row_cannot_see_never_reach_it(tiling, poison, rng):
    """NaN/Inf in the keys and values past a row's causal bound (a preallocated cache's garbage, or
    the next sequence's) leaves that row exactly as with clean keys: a masked key is never multiplied
    by the row's zero probability. GQA 4/2 puts two heads' rows in one GEMM block."""
    case = Case(q_len=50, kv_len=50, heads=4, kv_heads=2, head_dim=32, batch=1)
    q, k, v, cos, sin, _, _ = case.make(rng)
    code, clean, clean_lse, _ = kh.run(q, k, v, cos, sin, **tiling, **case.kwargs)
    assert code == 0, last_error()
    k2, v2 = k.copy(), v.copy()
    k2[:, :, 37:] = poison
    v2[:, :, 37:] = poison
    code, out, lse, _ = kh.run(q, k2, v2, cos, sin, **tiling, **case.kwargs)
    assert code == 0, last_error()
    np.testing.assert_array_equal(out[:, :, :37], clean[:, :, :37])  # rows at positions 0..36
    np.testing.assert_array_equal(lse[:, :, :37], clean_lse[:, :, :37])
    assert not np.isfinite(out[:, :, 37:]).all()  # the rows that do see them


@pytest.mark.parametrize("layout,q_shape,k_shape,aq,ak", [
    ("BNSD", (1, 4, 0, 16), (1, 2, 0, 16), None, None),   # S = 0
    ("BNSD", (0, 4, 5, 16), (0, 2, 5, 16), None, None),   # B = 0
    ("BSND", (2, 0, 4, 16), (2, 6, 2, 16), None, None),   # q_len 0: only rotated_key
    ("TND", (0, 4, 16), (0, 2, 16), [0], [0]),            # a 0-token TND batch
    ("TND", (0, 4, 16), (7, 2, 16), [0, 0], [3, 7]),      # no queries, keys to rotate
])
def test_zero_size_inputs_give_empty_outputs(layout, q_shape, k_shape, aq, ak, rng):
    q, k, v = rng.standard_normal(q_shape), rng.standard_normal(k_shape), rng.standard_normal(k_shape)
    cos, sin = rope_tables(16, 8)
    for _ in range(2):  # the first call of a process and a later one behave the same
        code, out, lse, rot = kh.run(q, k, v, cos, sin, aq, ak, input_layout=layout, head_num=4)
        assert code == 0, last_error()
        assert out.shape == q.shape and rot.shape == k.shape
        expected = reference(q, k, v, cos, sin, 4, layout, actual_seq_qlen=aq, actual_seq_kvlen=ak)[2] if k.size else rot
        np.testing.assert_allclose(rot, expected, atol=1e-6)
        code, dq, dk, dv = kh.run_grad(q, k, v, cos, sin, aq, ak, out, lse, np.zeros(q.shape), None, None,
                                       input_layout=layout, head_num=4)
        assert code == 0, last_error()
        assert dq.shape == q.shape and dk.shape == k.shape and not np.isnan(dk).any()


def test_zero_heads_rejected_before_planning(rng):
    q, k, v = np.ones((1, 0, 5, 8)), np.ones((1, 2, 5, 8)), np.ones((1, 2, 5, 8))
    cos, sin = rope_tables(8, 8)
    code, *_ = kh.run(q, k, v, cos, sin)
    assert code != 0 and "query: expected at least one head" in last_error()


def test_zero_size_first_call_of_a_process():
    """An empty problem as the very first launch (no scratch allocated yet), in a fresh process."""
    import subprocess
    import sys

    script = ("import numpy as np\nfrom ms_rope_attention.testing import cpu_direct as kh\n"
              "from ms_rope_attention.cpu_kernel import last_error\n"
              "z = np.zeros((1, 4, 0, 16)); cos = np.ones((8, 16))\n"
              "code, out, lse, rot = kh.run(z, z[:, :2], z[:, :2], cos, cos)\n"
              "assert code == 0, last_error()\n"
              "code, *_ = kh.run_grad(z, z[:, :2], z[:, :2], cos, cos, None, None, out, lse, out)\n"
              "assert code == 0, last_error()\nprint('ok')\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-2000:]
