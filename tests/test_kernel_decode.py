"""The forward kernel's decode path (csrc/rfa_cpu_decode.cc: q_len <= 16 against a long KV range,
each K/V row read once in its own dtype, splits merged by log-sum-exp) against the float64
reference, called directly: q_len 1..16, every layout, GQA/MQA, float16/bfloat16 caches, a rotated
cache and keys rotated on the fly, and the general (packed) path on the same calls. Every check also
asserts which path the kernel took (its decode-call counter), so a decode path that stopped being
taken would fail here, not only show in a benchmark."""
import numpy as np
import pytest

from ms_rope_attention.testing import cpu_direct as kh
from ms_rope_attention.cpu_kernel import decode_calls, last_error
from cases import Case
from conftest import tolerance
from kernel_check import check_kernel, rounded
from reference import reference

PATHS = {"decode": 0, "packed": -1}  # stream_q_max: the default, or never the decode path


def check(case, rng, path="decode", **kwargs):
    before = decode_calls()
    check_kernel(case, rng, kh.run, last_error, with_rotated_key=False, stream_q_max=PATHS[path], **kwargs)
    assert (decode_calls() > before) == (path == "decode"), f"the kernel did not take the {path} path"


@pytest.mark.parametrize("layout", ["BNSD", "BSND", "BSH", "TND"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("key_rotated", [True, False])
@pytest.mark.parametrize("path", list(PATHS))
def test_layouts_dtypes(layout, dtype, key_rotated, path, rng):
    for q_len in (1, 4, 16):
        case = Case(layout=layout, heads=8, kv_heads=2, q_len=q_len, kv_len=333, head_dim=64, batch=2,
                    q_lens=[q_len, 0, 1, q_len], kv_lens=[333, 9, 1, 700], random_tables=True)
        check(case, rng, path, dtype=dtype, key_rotated=key_rotated)


@pytest.mark.parametrize("q_len", list(range(1, 17)))
def test_every_q_len(q_len, rng):
    """q_len 1..16 (speculative verification) with partial interleaved rotary and head_dim 40 (rows
    not a whole number of vectors: converted, not read in place)."""
    check(Case(layout="BSND", heads=4, kv_heads=2, q_len=q_len, kv_len=q_len + 290, head_dim=40, rotary_dim=24,
               mode=1, batch=1, random_tables=True), rng, key_rotated=q_len % 2 == 0)


@pytest.mark.parametrize("heads,kv_heads", [(32, 32), (32, 8), (32, 1)])
@pytest.mark.parametrize("kv_len", [1, 63, 65, 4099])
def test_gqa_and_splits(heads, kv_heads, kv_len, rng):
    """MHA, GQA and MQA, from one key to a KV range split across threads (kv_len 4099: several splits
    of whole blocks and a ragged last one)."""
    check(Case(layout="BSH", heads=heads, kv_heads=kv_heads, q_len=1, kv_len=kv_len, head_dim=64, batch=1), rng,
          key_rotated=True)


@pytest.mark.parametrize("causal", [True, False])
def test_not_causal(causal, rng):
    check(Case(layout="BNSD", heads=4, kv_heads=4, q_len=5, kv_len=200, head_dim=64, causal=causal), rng)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_preallocated_cache_rows_never_read(dtype, rng):
    """A preallocated cache as TND (each slot a sequence of its filled rows, then a query-less gap
    sequence over its unused rows, as the model's KV cache calls the op): NaN in every unused row
    changes nothing, and the result equals attention over the filled rows alone."""
    slots, capacity, heads, dim = 3, 96, 4, 64
    filled = np.array([40, 1, 96])
    q_lens = np.array([1, 1, 3])
    cache = rng.standard_normal((2, slots, capacity, heads, dim))
    for b, n in enumerate(filled):
        cache[:, b, n:] = np.nan
    k, v = (rounded(c.reshape(slots * capacity, heads, dim), dtype) for c in cache)
    q = rounded(rng.standard_normal((q_lens.sum(), heads, dim)), dtype)
    angles = rng.uniform(0, 2 * np.pi, (capacity, dim // 2))
    cos, sin = np.cos(np.concatenate([angles] * 2, 1)), np.sin(np.concatenate([angles] * 2, 1))
    seq_q = np.stack([q_lens, np.zeros(slots, int)], 1).reshape(-1)
    seq_kv = np.stack([filled, capacity - filled], 1).reshape(-1)
    code, out, lse, _ = kh.run(q, k, v, cos, sin, np.cumsum(seq_q), np.cumsum(seq_kv), dtype=dtype,
                               input_layout="TND", key_rotated=True, with_rotated_key=False)
    assert code == 0, last_error()
    keep = np.concatenate([np.arange(b * capacity, b * capacity + n) for b, n in enumerate(filled)])
    ro, rl, _ = reference(q, k[keep], v[keep], cos, sin, input_layout="TND", actual_seq_qlen=np.cumsum(q_lens),
                          actual_seq_kvlen=np.cumsum(filled), key_rotated=True)
    assert np.isfinite(out).all()
    assert np.abs(out - ro).max() <= tolerance(dtype, ro)
    assert np.abs(lse - rl).max() <= 1e-4


def test_rows_that_see_no_key(rng):
    """A TND sequence with queries and no keys in front of them is impossible (q_len <= kv_len), but
    a sequence of zero keys and zero queries between others is fine, and a causal row sees at least
    its own key: every output finite."""
    case = Case(layout="TND", heads=2, kv_heads=1, head_dim=32, q_lens=[0, 2, 0, 1], kv_lens=[0, 2, 5, 300])
    check(case, rng)
