"""NaN and Inf in the data, on every path of the forward kernel and every build this CPU runs.

docs/semantics.md: NaN/Inf reach exactly the rows that meet them. A non-finite query element, or a
non-finite cos/sin row, poisons that position's rows; a non-finite key or value poisons the rows
that see it (an -Inf score is a zero probability, as in the reference); rows that never meet the
value are bit-for-bit what they are without it. The expectation is computed here in float64, one
row at a time over the keys that row sees, so that a key a row cannot see takes no part at all.

The paths: decode (q_len <= 16, its KV range split across threads when long), the tiled path on
one task per query block, and the tiled path with its KV range split and merged by log-sum-exp.
The decode path and both splits once turned a NaN row into a finite one (the merge took a split
whose maximum stayed -inf, since NaN never wins a comparison, for a split that saw no key).
"""
import numpy as np
import pytest

from ms_rope_attention.testing import cpu_direct
from ms_rope_attention.cpu_runtime import built_libraries, usable_isas
from reference import rope_tables, rotate

ISAS = [isa for isa in usable_isas() if isa in built_libraries()]
HEADS, KV_HEADS, DIM = 2, 1, 8
# path -> (q_len, kv_len, stream_q_max): kv_len 600 splits the KV range (256-key minimum per split).
PATHS = {"decode": (5, 40, 0), "decode-split": (3, 600, 0), "tiled": (20, 40, -1), "tiled-split": (20, 600, -1)}
TARGETS = ("query", "key", "value", "cos", "sin")


def expected(q, k, v, cos, sin, causal=True):
    """(out, lse) for BNSD inputs, each row over the keys it sees only."""
    b, n, sq, d = q.shape
    skv, group = k.shape[2], n // k.shape[1]
    out, lse = np.zeros(q.shape), np.zeros((b, n, sq))
    positions = np.arange(skv - sq, skv)
    for i in range(b):
        qr = rotate(q[i].transpose(1, 0, 2), cos, sin, positions, 0, d)
        kr = rotate(k[i].transpose(1, 0, 2), cos, sin, np.arange(skv), 0, d)
        for h in range(n):
            for r in range(sq):
                seen = slice(0, positions[r] + 1 if causal else skv)
                with np.errstate(invalid="ignore", over="ignore"):
                    s = kr[seen, h // group] @ qr[r, h] / np.sqrt(d)
                    m = s.max()
                    p = np.exp(s - m)
                    out[i, h, r] = p @ v[i, h // group, seen].astype(np.float64) / p.sum()
                    lse[i, h, r] = m + np.log(p.sum())
    return out, lse


def poisoned(rng, path, target, value):
    q_len, kv_len, _ = PATHS[path]
    q = rng.standard_normal((1, HEADS, q_len, DIM))
    k, v = (rng.standard_normal((1, KV_HEADS, kv_len, DIM)) for _ in range(2))
    cos, sin = rope_tables(DIM, kv_len)
    row = kv_len - q_len + q_len // 2  # the position of a middle query row
    if target == "query":
        q[0, 1, q_len // 2, 3] = value
    elif target in ("key", "value"):
        (k if target == "key" else v)[0, 0, row, 5] = value  # the rows before it never see it
    else:
        (cos if target == "cos" else sin)[row, 1] = value
    return q, k, v, cos, sin


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
def test_nonfinite_reaches_exactly_its_rows(isa, path, target, value):
    rng = np.random.default_rng(7)
    q, k, v, cos, sin = poisoned(rng, path, target, value)
    want_out, want_lse = expected(q, k, v, cos, sin)
    calls = cpu_direct.cpu_library(isa).RotaryFlashAttentionDecodeCalls
    before = calls()
    code, out, lse, _ = cpu_direct.run(q, k, v, cos, sin, isa=isa, head_num=HEADS, with_rotated_key=False,
                                       stream_q_max=PATHS[path][2])
    assert code == 0
    assert (calls() > before) == path.startswith("decode"), "the call took another path"
    for name, got, want in (("attention_out", out, want_out), ("softmax_lse", lse, want_lse)):
        assert (np.isnan(got) == np.isnan(want)).all(), f"{name}: NaN at {np.argwhere(np.isnan(got) != np.isnan(want))}"
        assert (np.isinf(got) == np.isinf(want)).all(), f"{name}: Inf at {np.argwhere(np.isinf(got) != np.isinf(want))}"
        finite = np.isfinite(want)
        assert np.abs(got[finite] - want[finite]).max(initial=0) <= 1e-4
    assert np.isfinite(want_out).any() and not np.isfinite(want_out).all()  # the case poisons some rows only


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("path", list(PATHS))
def test_rows_that_never_meet_nan_are_bit_identical(isa, path):
    """Rows before a NaN key (causal) and rows of the other head than a NaN query element's give
    the same bits as the clean call."""
    rng = np.random.default_rng(11)
    q, k, v, cos, sin = poisoned(rng, path, "query", 0.25)
    stream = PATHS[path][2]
    _, clean, clean_lse, _ = cpu_direct.run(q, k, v, cos, sin, isa=isa, head_num=HEADS, with_rotated_key=False,
                                            stream_q_max=stream)
    q_nan = q.copy()
    q_nan[0, 1, q.shape[2] // 2, 3] = np.nan
    _, out, lse, _ = cpu_direct.run(q_nan, k, v, cos, sin, isa=isa, head_num=HEADS, with_rotated_key=False,
                                    stream_q_max=stream)
    poisoned_row = np.zeros(out.shape[:-1], bool)
    poisoned_row[0, 1, q.shape[2] // 2] = True
    assert np.isnan(out[poisoned_row]).all() and np.isnan(lse[poisoned_row]).all()
    assert (out[~poisoned_row] == clean[~poisoned_row]).all() and (lse[~poisoned_row] == clean_lse[~poisoned_row]).all()
