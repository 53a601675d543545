"""The paged KV cache's ops (csrc/rfa_paged.h, csrc/rfa_cpu_paged.cc, ms_rope_attention/paged.py):

- RotaryPagedAttention against the float64 reference over a cache whose blocks are shuffled (each
  sequence's block table non-contiguous) and whose unused blocks hold NaN: any read outside a
  sequence's own keys shows up; block sizes 16, 48 and 128, q_len 0..16, GQA groups 1/3/4/7, head
  dims 40/72/128, partial and interleaved rotary, float16/bfloat16 caches, every ISA build; and equal
  to the contiguous op's decode path on the same keys;
- RotaryCacheWrite: -1 slots skipped, per-token positions, each key rotated once (counted), the
  cached key bit-equal to RotaryFlashAttention's rotated_key, conversion to the cache's dtype;
- bad input refused naming the argument, before any read or write (the cache stays as it was);
- both ops as MindSpore primitives in GRAPH_MODE and PyNative, writing a Parameter in place, from
  the dispatch like the fused op: one per attribute set and device, refused on a device without
  their kernel with the contract's ``ascend`` rule.
"""
import re

import numpy as np
import pytest

import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops

from ms_rope_attention import dispatch, paged, paged_kernel, rotary_cache_write, rotary_paged_attention
from ms_rope_attention.cpu_runtime import GraphLaunchedCustom, built_libraries, usable_isas
from ms_rope_attention.paged_kernel import paged_calls
from ms_rope_attention.testing import cpu_direct as kd
from conftest import tolerance
from kernel_check import rounded
from reference import attention_one_sequence, rope_tables, rotate

ISAS = [isa for isa in usable_isas() if isa in built_libraries()]
TABLE_ROWS = 4096


def paged_case(rng, ctx, q_lens, *, heads=8, kv_heads=2, head_dim=64, block_size=16, spare_blocks=5, mode=0,
               rotary_dim=None, dtype="float32", key_rotated=True, max_blocks=None):
    """A shuffled paged cache holding each sequence's keys (rotated at their positions when
    ``key_rotated``), NaN in every block and table entry no sequence uses; the reference output."""
    rd = rotary_dim or head_dim
    cos, sin = rope_tables(rd, TABLE_ROWS, mode=mode)
    needed = [-(-int(n) // block_size) for n in ctx]
    nb = sum(needed) + spare_blocks
    order = rng.permutation(nb)
    mb = max_blocks or max(max(needed), 1) + 1
    tables = np.full((len(ctx), mb), -1, np.int32)
    kc = np.full((nb, block_size, kv_heads, head_dim), np.nan)
    vc = np.full_like(kc, np.nan)
    q = rounded(rng.standard_normal((int(sum(q_lens)), heads, head_dim)), dtype)
    out, lse = np.zeros(q.shape), np.zeros(q.shape[:2])
    used, start = 0, 0
    for b, (n, lq) in enumerate(zip(ctx, q_lens)):
        k = rounded(rng.standard_normal((n, kv_heads, head_dim)), dtype)
        v = rounded(rng.standard_normal((n, kv_heads, head_dim)), dtype)
        stored = rounded(rotate(k, cos, sin, np.arange(n), mode, rd), dtype) if key_rotated else k
        for j in range(needed[b]):
            block = order[used]
            used += 1
            tables[b, j] = block
            rows = slice(j * block_size, min(n, (j + 1) * block_size))
            kc[block, :rows.stop - rows.start] = stored[rows]
            vc[block, :rows.stop - rows.start] = v[rows]
        if lq:
            o, l, _ = attention_one_sequence(q[start:start + lq], stored, v, cos, sin, mode, rd, 1 / np.sqrt(head_dim),
                                             True, key_rotated=key_rotated)
            out[start:start + lq], lse[start:start + lq] = o, l
        start += lq
    inputs = (q, kc, vc, cos, sin, tables, np.asarray(ctx, np.int32), np.asarray(q_lens, np.int32))
    return inputs, out, lse, dict(rotary_mode=mode, rotary_dim=rotary_dim or 0, key_rotated=key_rotated)


def check_paged(inputs, out, lse, attrs, dtype="float32", isa=None):
    code, got, got_lse = kd.paged_run(*inputs, dtype=dtype, isa=isa, **attrs)
    assert code == 0, kd.paged_last_error(isa)
    assert np.isfinite(got).all(), "a NaN block or table entry was read"
    np.testing.assert_allclose(got, out, rtol=0, atol=tolerance(dtype, out))
    rows = np.isfinite(lse)
    np.testing.assert_allclose(got_lse[rows], lse[rows], rtol=0, atol=1e-4)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("block_size", [16, 128])
def test_paged_matches_the_reference(isa, dtype, block_size, rng):
    ctx, q_lens = [37, 1, 300, 16, 129], [1, 1, 5, 16, 0]
    check_paged(*paged_case(rng, ctx, q_lens, block_size=block_size, dtype=dtype), dtype=dtype, isa=isa)


@pytest.mark.parametrize("q_len", range(1, 17))
def test_every_query_count(q_len, rng):
    ctx = [q_len, q_len + 47, 2 * q_len + 200]
    check_paged(*paged_case(rng, ctx, [q_len] * 3, block_size=48))


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 8, 40), (6, 2, 72), (7, 1, 128), (12, 4, 64)])
@pytest.mark.parametrize("mode,rotary_dim", [(0, None), (1, None), (0, 32), (1, 24)])
@pytest.mark.parametrize("key_rotated", [True, False])
def test_gqa_head_dims_and_rotary(heads, kv_heads, head_dim, mode, rotary_dim, key_rotated, rng):
    """Tail head dims (not a whole number of vectors), GQA groups 1/3/7/3, partial and interleaved
    rotary, and keys rotated as they are read (key_rotated=False, FlashInfer's form)."""
    case = paged_case(rng, [70, 3, 161], [2, 3, 1], heads=heads, kv_heads=kv_heads, head_dim=head_dim, mode=mode,
                      rotary_dim=rotary_dim, key_rotated=key_rotated)
    check_paged(*case)


def test_paged_equals_the_contiguous_decode_path(rng):
    """The same keys, once paged and once as one TND array: the two calls agree to float32 rounding."""
    (q, kc, vc, cos, sin, tables, ctx, q_lens), _, _, attrs = paged_case(rng, [300, 45], [1, 4])
    code, paged, paged_lse = kd.paged_run(q, kc, vc, cos, sin, tables, ctx, q_lens, **attrs)
    assert code == 0, kd.paged_last_error()
    flat_k = kc.reshape(-1, *kc.shape[2:])
    flat_v = vc.reshape(-1, *vc.shape[2:])
    rows = [tables[b, j // kc.shape[1]] * kc.shape[1] + j % kc.shape[1] for b in range(2) for j in range(ctx[b])]
    code, contiguous, lse, _ = kd.run(q, flat_k[rows], flat_v[rows], cos, sin, np.cumsum(q_lens), np.cumsum(ctx),
                                      input_layout="TND", head_num=q.shape[1], key_rotated=True, with_rotated_key=False)
    assert code == 0
    np.testing.assert_allclose(paged, contiguous, rtol=0, atol=1e-6)
    np.testing.assert_allclose(paged_lse, lse, rtol=0, atol=1e-6)


def _bad(inputs, **change):
    names = ["q", "kc", "vc", "cos", "sin", "tables", "ctx", "q_lens"]
    values = dict(zip(names, inputs))
    values.update(change)
    return [values[n] for n in names]


@pytest.mark.parametrize("change,message", [
    (lambda i: dict(tables=np.where(i[5] == i[5][0, 1], -1, i[5])), "block_tables: sequence 0 needs block 1 of 3"),
    (lambda i: dict(tables=np.where(i[5] == i[5][1, 0], 99, i[5])), "block_tables: sequence 1 needs block 0"),
    (lambda i: dict(ctx=np.array([40, 200], np.int32)), "context_lens: sequence 1 holds 200 keys, more than"),
    (lambda i: dict(ctx=np.array([40, 0], np.int32)), "context_lens: sequence 1 holds 0 keys, fewer than"),
    (lambda i: dict(q_lens=np.array([17, 2], np.int32)), "q_seq_lens: sequence 0 has 17 query tokens"),
    (lambda i: dict(q_lens=np.array([1, 1], np.int32)), "q_seq_lens: expected them to sum to query's 3 tokens"),
    (lambda i: dict(kc=i[1][:, :8], vc=i[2][:, :8]), "key_cache: block_size (dimension 1) must be a positive multiple of 16"),
    (lambda i: dict(vc=i[2][:-1]), "value_cache: expected shape"),
    (lambda i: dict(kc=np.concatenate([i[1], i[1][:, :, :1]], 2), vc=np.concatenate([i[2], i[2][:, :, :1]], 2)),
     "key_cache: 3 KV heads; query's 8 heads"),
    (lambda i: dict(q=i[0][..., :32]), "key_cache: head_dim 64 does not match query's 32"),
    (lambda i: dict(cos=i[3][:41], sin=i[4][:41]), "cos: table has 41 positions, sequence 0 needs 42"),
])
def test_bad_calls_are_refused_naming_the_argument(change, message, rng):
    inputs, *_ = paged_case(rng, [42, 2], [1, 2])
    code, *_ = kd.paged_run(*_bad(inputs, **change(inputs)))
    assert code != 0 and message in kd.paged_last_error(), kd.paged_last_error()


def test_a_cache_of_another_dtype_than_the_query_is_refused(rng):
    """The op takes one dtype for query and caches (a float32 model casts its query to a float16
    cache's dtype, as for the contiguous op)."""
    inputs, *_ = paged_case(rng, [20], [1])
    code, *_ = kd.paged_run(*inputs, cache_dtype="float16")
    assert code != 0
    assert "key_cache: expected the same dtype as query (float32), got float16" in kd.paged_last_error()


# ---- RotaryCacheWrite ----

def write_case(rng, tokens=9, kv_heads=2, head_dim=72, block_size=16, blocks=6):
    k = rng.standard_normal((tokens, kv_heads, head_dim))
    v = rng.standard_normal((tokens, kv_heads, head_dim))
    positions = rng.integers(0, 500, tokens)
    slots = rng.permutation(blocks * block_size)[:tokens].astype(np.int32)
    slots[[1, 4]] = -1  # padding tokens
    cache = np.full((blocks, block_size, kv_heads, head_dim), 7.0)
    return k, v, positions, slots, cache


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype,cache_dtype", [("float32", "float32"), ("float32", "float16"),
                                               ("float32", "bfloat16"), ("float16", "float16"),
                                               ("bfloat16", "bfloat16")])
@pytest.mark.parametrize("mode,rotary_dim", [(0, 0), (1, 0), (0, 40)])
def test_cache_write_rotates_each_key_once_and_skips_padding(isa, dtype, cache_dtype, mode, rotary_dim, rng):
    k, v, positions, slots, cache = write_case(rng)
    k, v = rounded(k, dtype), rounded(v, dtype)
    cos, sin = rope_tables(rotary_dim or k.shape[2], TABLE_ROWS, mode=mode)
    lib = kd.cpu_library(isa)
    before = lib.RotaryCacheWriteRotatedKeys()
    code, written, kc, vc = kd.cache_write_run(k, v, cos, sin, positions, slots, cache, cache, dtype=dtype,
                                               cache_dtype=cache_dtype, rotary_mode=mode, rotary_dim=rotary_dim,
                                               isa=isa)
    assert code == 0, kd.paged_last_error(isa)
    keep = slots >= 0
    assert written == keep.sum()
    assert lib.RotaryCacheWriteRotatedKeys() - before == keep.sum() * k.shape[1]  # once per written key head
    flat_k, flat_v = kc.reshape(-1, *k.shape[1:]), vc.reshape(-1, *k.shape[1:])
    want = rotate(k, cos, sin, positions, mode, rotary_dim or k.shape[2])
    np.testing.assert_allclose(flat_k[slots[keep]], rounded(want[keep], cache_dtype), rtol=0,
                               atol=tolerance(cache_dtype, want))
    np.testing.assert_array_equal(flat_v[slots[keep]], rounded(v[keep], cache_dtype))
    untouched = np.setdiff1d(np.arange(flat_k.shape[0]), slots[keep])
    assert (flat_k[untouched] == 7).all() and (flat_v[untouched] == 7).all()


def test_cached_key_is_the_prefill_ops_rotated_key_bit_for_bit(rng):
    """A key written by the cache write at position p equals RotaryFlashAttention's rotated_key of
    the same key at p: a prompt's cache may be filled by either, and decode reads them alike."""
    n, kv_heads, d = 37, 2, 64
    k = rng.standard_normal((n, kv_heads, d))
    q = rng.standard_normal((n, 4, d))
    cos, sin = rope_tables(d, TABLE_ROWS)
    code, _, _, rotated = kd.run(q, k, k, cos, sin, np.array([n]), np.array([n]), input_layout="TND", head_num=4)
    assert code == 0
    cache = np.zeros((3, 16, kv_heads, d))
    code, _, kc, _ = kd.cache_write_run(k, k, cos, sin, np.arange(n), np.arange(n), cache, cache)
    assert code == 0
    np.testing.assert_array_equal(kc.reshape(-1, kv_heads, d)[:n], rotated)


@pytest.mark.parametrize("change,message", [
    (lambda s, p: (np.where(s == s[0], s[2], s), p), "slot_mapping: tokens 0 and 2 both write slot"),
    (lambda s, p: (np.where(s == s[3], 96, s), p), "slot_mapping: token 3 has slot 96, expected -1 (skip) or 0..95"),
    (lambda s, p: (np.where(s == s[3], -2, s), p), "slot_mapping: token 3 has slot -2"),
    (lambda s, p: (s, np.where(np.arange(len(p)) == 5, 4096, p)), "positions: token 5 is at 4096, expected 0..4095"),
])
def test_bad_writes_are_refused_and_touch_nothing(change, message, rng):
    k, v, positions, slots, cache = write_case(rng)
    slots, positions = change(slots, positions)
    cos, sin = rope_tables(k.shape[2], TABLE_ROWS)
    code, _, kc, vc = kd.cache_write_run(k, v, cos, sin, positions, slots.astype(np.int32), cache, cache)
    assert code != 0 and message in kd.paged_last_error(), kd.paged_last_error()
    assert (kc == 7).all() and (vc == 7).all()


# ---- as MindSpore primitives ----

class PagedStep(nn.Cell):
    """One serving step: write the new tokens' keys and values, then attend over the cache."""

    def __init__(self, blocks, block_size, kv_heads, head_dim, cos, sin, dtype=ms.float32):
        super().__init__()
        shape = (blocks, block_size, kv_heads, head_dim)
        self.key_cache = Parameter(Tensor(np.full(shape, np.nan, np.float32), dtype), name="key_cache",
                                   requires_grad=False)
        self.value_cache = Parameter(Tensor(np.full(shape, np.nan, np.float32), dtype), name="value_cache",
                                     requires_grad=False)
        self.cos, self.sin = Tensor(cos, ms.float32), Tensor(sin, ms.float32)

    def construct(self, q, k, v, positions, slots, tables, ctx, q_lens):
        written = rotary_cache_write(k, v, self.cos, self.sin, positions, slots, self.key_cache, self.value_cache)
        key_cache = ops.depend(self.key_cache, written)
        value_cache = ops.depend(self.value_cache, written)
        return rotary_paged_attention(q, key_cache, value_cache, self.cos, self.sin, tables, ctx, q_lens), written


@pytest.mark.parametrize("mode", [ms.GRAPH_MODE, ms.PYNATIVE_MODE])
def test_write_then_attend_as_primitives(mode, rng):
    """Two sequences prefilled into shuffled blocks, then decode steps at different positions in
    one call each (one sequence crossing a block boundary); every step equals the reference."""
    ms.set_context(mode=mode)
    heads, kv_heads, d, bs = 4, 2, 32, 16
    cos, sin = rope_tables(d, 256)
    step = PagedStep(8, bs, kv_heads, d, cos.astype(np.float32), sin.astype(np.float32))
    tables = np.array([[6, 1, 3], [0, 5, -1]], np.int32)
    lengths = [0, 0]
    ks = [rng.standard_normal((60, kv_heads, d)) for _ in range(2)]
    vs = [rng.standard_normal((60, kv_heads, d)) for _ in range(2)]
    calls = paged_calls()

    def slot(b, pos):
        return tables[b, pos // bs] * bs + pos % bs

    def run(new):  # new: tokens per sequence this step (its queries, at the end of its context)
        pos = [np.arange(lengths[b], lengths[b] + new[b]) for b in range(2)]
        k = np.concatenate([ks[b][pos[b]] for b in range(2)]).astype(np.float32)
        v = np.concatenate([vs[b][pos[b]] for b in range(2)]).astype(np.float32)
        q = rng.standard_normal((sum(new), heads, d)).astype(np.float32)
        slots = np.concatenate([slot(b, pos[b]) for b in range(2)]).astype(np.int32)
        ctx = np.array([lengths[b] + new[b] for b in range(2)], np.int32)
        out, written = step(Tensor(q), Tensor(k), Tensor(v), Tensor(np.concatenate(pos).astype(np.int32)),
                            Tensor(slots), Tensor(tables), Tensor(ctx), Tensor(np.array(new, np.int32)))
        assert int(written.asnumpy()[0]) == sum(new)
        start = 0
        for b in range(2):
            kr = rotate(ks[b][:ctx[b]].astype(np.float32), cos, sin, np.arange(ctx[b]), 0, d)
            want, _, _ = attention_one_sequence(q[start:start + new[b]], kr, vs[b][:ctx[b]].astype(np.float32), cos,
                                                sin, 0, d, 1 / np.sqrt(d), True, key_rotated=True)
            np.testing.assert_allclose(out.asnumpy()[start:start + new[b]], want, rtol=0, atol=2e-5)
            start += new[b]
            lengths[b] = int(ctx[b])

    run([14, 5])   # prefill-sized pieces (<= 16 tokens each)
    run([1, 1])    # sequence 0 crosses into its second block
    run([3, 1])
    run([1, 16])   # sequence 1 into its second block, 16 query tokens
    assert paged_calls() - calls == 4


def test_the_primitives_come_from_the_dispatch_one_per_attribute_set():
    """Attribute sets are checked against the contract, each gets one primitive (graph-launched when
    called eagerly), the cache write is a side effect, and ``dispatch.clear()`` forgets them."""
    first = paged.paged_attention_op(head_num=4, scale=0.5)
    assert first is paged.paged_attention_op(scale=0.5, head_num=4)
    assert type(first) is GraphLaunchedCustom and first.attrs["scale_text"] == "0.5"
    write = paged.cache_write_op(rotary_mode=1)
    assert write.attrs["side_effect_mem"] and "side_effect_mem" not in first.attrs
    with pytest.raises(ValueError, match="key_rotated: expected a bool"):
        paged.cache_write_op(key_rotated=1)
    dispatch.clear()
    assert paged.paged_attention_op(head_num=4, scale=0.5) is not first


def test_a_device_without_the_kernels_is_refused_with_the_contracts_ascend_rule(monkeypatch):
    monkeypatch.setattr(dispatch, "device", lambda: "Ascend")
    for op_name, make in (("RotaryPagedAttention", paged.paged_attention_op),
                          ("RotaryCacheWrite", paged.cache_write_op)):
        rule = paged_kernel.contract(op_name).semantics["ascend"]
        with pytest.raises(RuntimeError, match=f"{op_name}: no kernel for device 'Ascend'; {re.escape(rule)}"):
            make()
