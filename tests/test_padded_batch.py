"""``fusion.padded_batch``: a left-padded batch's attend pattern and positions in the fused op's TND
terms, against masks and rows built independently here (numpy, the way HF builds them)."""
import numpy as np
import pytest

from ms_rope_attention.fusion import padded_batch


def hf_keep(lengths, q_len, past):
    """HF's left-padded causal attend pattern (B, q, kv): sequence b's real tokens are its last
    lengths[b] of past + q_len columns."""
    total = past + q_len
    keep = np.zeros((len(lengths), q_len, total), bool)
    for b, n in enumerate(lengths):
        start = total - n
        for i in range(q_len):
            keep[b, i, start:past + i + 1] = past + i >= start
    return keep


@pytest.mark.parametrize("lengths, q_len, past", [([3, 11, 7, 1], 11, 0), ([4, 12, 8, 2], 1, 11),
                                                  ([5, 5], 1, 4), ([9, 16, 4], 3, 13)])
def test_band_of_a_left_padded_batch(lengths, q_len, past):
    keep = hf_keep(lengths, q_len, past)
    band = padded_batch.band(keep, past)
    total = past + q_len
    assert list(band.starts) == [total - n for n in lengths]
    q_offsets, kv_offsets = band.offsets()
    assert kv_offsets[-1] == len(lengths) * total and q_offsets[-1] == len(lengths) * q_len
    # Each real query of the TND segments sees exactly the keys HF's mask keeps.
    q_ends, kv_ends = np.r_[0, q_offsets], np.r_[0, kv_offsets]
    for seg in range(len(q_offsets)):
        q_count, kv_count = q_ends[seg + 1] - q_ends[seg], kv_ends[seg + 1] - kv_ends[seg]
        for i in range(q_count):
            token, seen = q_ends[seg] + i, np.arange(kv_ends[seg], kv_ends[seg] + kv_count - q_count + i + 1)
            b, row = divmod(token, q_len)
            if past + row >= band.starts[b]:  # a real query (padding queries are HF's don't-care)
                np.testing.assert_array_equal(np.flatnonzero(keep[b, row]) + b * total, seen)


def test_positions_and_tables_follow_hf_position_ids():
    lengths, q_len, past = [3, 6], 1, 5
    band = padded_batch.band(hf_keep(lengths, q_len, past), past)
    np.testing.assert_array_equal(band.positions(), [[2], [5]])  # the 3rd and 6th real tokens
    rows = np.array([[[0.3]], [[0.5]]], np.float32)
    table = padded_batch.position_table(rows, band)
    assert table.shape == (6, 1) and table[2, 0] == np.float32(0.3) and table[5, 0] == np.float32(0.5)
    # The same position given two different rotations: no table.
    band = padded_batch.band(hf_keep([6, 6], 1, 5), 5)
    assert padded_batch.position_table(rows, band) is None


@pytest.mark.parametrize("change, reason", [
    (lambda k: k[:, :, ::-1], "not causal with left padding"),
    (lambda k: np.concatenate([k, k[:, :, -1:]], 2), "the mask covers"),
])
def test_what_is_no_band_says_why(change, reason):
    keep = np.ascontiguousarray(change(hf_keep([3, 5], 5, 0)))
    assert reason in padded_batch.band(keep, 0)


def test_masks_as_hf_gives_them():
    keep = hf_keep([2, 3], 3, 0)
    additive = np.where(keep, 0.0, np.finfo(np.float32).min)[:, None]
    np.testing.assert_array_equal(padded_batch.attended(additive, boolean=False), keep)
    np.testing.assert_array_equal(padded_batch.attended(keep[:, None], boolean=True), keep)
    assert "bias" in padded_batch.attended(additive + 0.5, boolean=False)
    two_heads = np.concatenate([keep[:, None], ~keep[:, None]], 1)
    assert "differs across heads" in padded_batch.attended(two_heads, boolean=True)


def test_padding_queries_after_the_first_call_are_refused():
    assert "padding queries after the first call" in padded_batch.band(hf_keep([9, 16, 2], 3, 13), 13)
