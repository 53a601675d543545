"""compute_dtype='bfloat16' of the fused kernel (csrc/bf16.h): bfloat16 products, float32 accumulation.

Against the float64 reference on the operands the kernel rounds (bf16_reference.py: rotated Q/K and V
rounded to bfloat16, P unrounded) within the bound stated there: P rounded to bfloat16 moves an
output by at most 2^-8 max|v| at any head dim; the output dtype's half-ulp on top. A focused sweep,
not a cartesian product: every layout, head dims 40/72/128, GQA 3 and 7, causal and not, partial and
interleaved rotary, S = 1, odd lengths and lengths not a multiple of the tile (shrunken tiles hit
every tail), TND with empty and uneven sequences, float32 / float16 / bfloat16 inputs; the decode
path and the paged cache; NaN/Inf as in float32; 'float32' bit for bit today's arithmetic; the
refusals. One MindSpore check (GRAPH_MODE and PyNative) runs the op as a model does. The tiled
path's products run on AMX tiles where the CPU has them, else on vdpbf16ps, or on the float32 FMAs
where those are faster: every one this CPU runs is swept here (the ``tiles`` fixture).
"""
import re

import mindspore as ms
import numpy as np
import pytest

from ms_rope_attention import RotaryFlashAttention, cpu_kernel, dispatch, rotary_paged_attention
from ms_rope_attention.cpu_runtime import built_libraries, cpu_flags, usable_isas
from ms_rope_attention.gradients import RotaryFusionFallbackError
from ms_rope_attention.testing import cpu_direct as kd
from bf16_reference import reference_bf16, tolerance, to_bf16
from cases import Case
from kernel_check import rounded
from test_kernel_nonfinite import HEADS, PATHS, TARGETS, expected, poisoned
from test_paged import paged_case

ISAS = [isa for isa in usable_isas() if isa in built_libraries()]
NATIVE = [isa for isa in ISAS if kd.cpu_library(isa).RotaryFlashAttentionNativeBf16()]
needs_bf16 = pytest.mark.skipif(not NATIVE, reason="no kernel build computes bfloat16 on this CPU (avx512_bf16)")
# The MindSpore-level tests run the selected build (RFA_CPU_ISA may force one without bfloat16).
needs_selected_bf16 = pytest.mark.skipif(not (NATIVE and cpu_kernel.native_bfloat16()),
                                         reason="the selected kernel build does not compute bfloat16")
# The units the tiled path's products run on (csrc/bf16.h ChosenUnits): vdpbf16ps, the float32 FMAs on the
# same rounded operands (RFA_BF16_ATTENTION=fma), and AMX tiles where the CPU has them: every one this CPU
# runs is swept (the ``tiles`` fixture).
TILES = ["avx512_bf16", "fma"] + (["amx"] if NATIVE and cpu_kernel.bfloat16_tiles(isa=NATIVE[0]) == "amx" else [])


@pytest.fixture(params=TILES)
def tiles(request, monkeypatch):
    """The tiled path's bfloat16 products on AMX tiles, on vdpbf16ps or on the float32 FMAs (then the
    default again)."""
    monkeypatch.setenv("RFA_BF16_ATTENTION", "fma" if request.param == "fma" else "dot")
    assert cpu_kernel.bfloat16_tiles(request.param == "amx", isa=NATIVE[0]) == request.param
    yield request.param
    cpu_kernel.bfloat16_tiles(True, isa=NATIVE[0])


# lse: float32 statistics of the unrounded P; a rotated element whose float32 and float64 rotations
# round to neighbouring bfloat16 values moves one score by 2^-8 of one |q_d k_d| scale (< 1e-2 for
# these unit-normal inputs); float32 sums stay far below.
LSE_TOL = 1e-2

# (case, tiling): shrunken tiles (rows, kv_block) put tails in every GEMM and tile.
SMALL = dict(rows=24, kv_block=32)
SWEEP = [
    (Case(layout="BNSD", batch=1, heads=6, kv_heads=2, q_len=37, kv_len=53, head_dim=40), {}),
    (Case(layout="BNSD", batch=2, heads=3, kv_heads=1, q_len=1, kv_len=1, head_dim=40), {}),
    (Case(layout="BSND", batch=2, heads=7, kv_heads=1, q_len=129, kv_len=301, head_dim=72, causal=False), SMALL),
    (Case(layout="BSND", batch=1, heads=3, kv_heads=1, q_len=45, kv_len=45, head_dim=72, mode=1, rotary_dim=40), SMALL),
    (Case(layout="BSH", batch=1, heads=6, kv_heads=2, q_len=50, kv_len=77, head_dim=128, rotary_dim=64), SMALL),
    (Case(layout="BSH", batch=2, heads=7, kv_heads=7, q_len=33, kv_len=33, head_dim=128, causal=False, mode=1), {}),
    (Case(layout="TND", heads=6, kv_heads=2, q_lens=[3, 0, 17, 1], kv_lens=[5, 2, 40, 1], head_dim=128, mode=1,
          rotary_dim=64), dict(rows=12, kv_block=32)),
    (Case(layout="TND", heads=7, kv_heads=1, q_lens=[70, 31], kv_lens=[70, 95], head_dim=40, causal=False), SMALL),
    (Case(layout="BNSD", batch=1, heads=3, kv_heads=1, q_len=512, kv_len=512, head_dim=128), {}),
]


def run_bf16(case, rng, dtype, isa=None, **tiling):
    """(kernel out, lse, reference out, lse, v) of one call with compute_dtype='bfloat16'."""
    q, k, v, cos, sin, aq, ak = case.make(rng)
    q, k, v = (rounded(t, dtype) for t in (q, k, v))
    code, out, lse, _ = kd.run(q, k, v, cos, sin, aq, ak, dtype=dtype, compute_dtype="bfloat16", isa=isa,
                               with_rotated_key=False, **tiling, **case.kwargs)
    assert code == 0, cpu_kernel.last_error()
    ref_out, ref_lse = reference_bf16(q, k, v, cos, sin, aq, ak, **case.kwargs)
    return out, lse, ref_out, ref_lse, v


def assert_close(out, lse, ref_out, ref_lse, v, dtype):
    assert np.abs(out - ref_out).max(initial=0) <= tolerance(v, dtype, ref_out)
    finite = np.isfinite(ref_lse)
    assert (np.isfinite(lse) == finite).all()
    assert np.abs(lse[finite] - ref_lse[finite]).max(initial=0) <= LSE_TOL


@needs_bf16
@pytest.mark.parametrize("case,tiling", SWEEP, ids=[f"{c.layout}-d{c.head_dim}-g{c.heads // c.kv_heads}-{i}"
                                                    for i, (c, _) in enumerate(SWEEP)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_forward_matches_the_rounded_reference(case, tiling, dtype, tiles, rng):
    assert_close(*run_bf16(case, rng, dtype, isa=NATIVE[0], stream_q_max=-1, **tiling), dtype)


@needs_bf16
@pytest.mark.parametrize("q_len,kv_len,path", [(1, 300, 0), (5, 40, 0), (16, 700, 0), (5, 40, -1), (16, 700, -1)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_path_rounds_where_the_tiled_path_does(q_len, kv_len, path, dtype, tiles, rng):
    """The decode path (q_len <= 16, rfa_cpu_decode.cc) and the tiled path on the same calls: both
    within the bound of the same reference, and the decode path really taken."""
    case = Case(layout="BSND", batch=2, heads=6, kv_heads=2, q_len=q_len, kv_len=kv_len, head_dim=72, mode=1,
                rotary_dim=40)
    before = kd.cpu_library(NATIVE[0]).RotaryFlashAttentionDecodeCalls()
    assert_close(*run_bf16(case, rng, dtype, isa=NATIVE[0], stream_q_max=path), dtype)
    assert (kd.cpu_library(NATIVE[0]).RotaryFlashAttentionDecodeCalls() > before) == (path == 0)


@needs_bf16
def test_bfloat16_really_rounds_and_float32_is_todays_arithmetic(rng):
    """'float32' gives the bits of 'auto' on float32 and float16 inputs (today's path); 'bfloat16'
    differs from it, and is further from the float64 result of the unrounded inputs than float32 is."""
    case, _ = SWEEP[-1]
    q, k, v, cos, sin, aq, ak = case.make(rng)
    runs = {c: kd.run(q, k, v, cos, sin, compute_dtype=c, isa=NATIVE[0], **case.kwargs) for c in ("auto", "float32",
                                                                                                  "bfloat16")}
    assert all((runs["auto"][i] == runs["float32"][i]).all() for i in (1, 2, 3))
    half = [kd.run(q, k, v, cos, sin, dtype="float16", compute_dtype=c, isa=NATIVE[0], **case.kwargs)[1]
            for c in ("auto", "float32")]
    assert (half[0] == half[1]).all()
    ref = reference_bf16.__globals__["reference"](q, k, v, cos, sin, case.heads, case.layout, case.mode,
                                                  case.rotary_dim, None, case.causal)[0]
    err32, err16 = (np.abs(runs[c][1] - ref).max() for c in ("float32", "bfloat16"))
    assert err16 > 10 * err32 and (runs["bfloat16"][3] == runs["float32"][3]).all()  # rotated_key: float32 rotation


@needs_bf16
def test_auto_is_bfloat16_for_bfloat16_inputs_only(rng):
    case, _ = SWEEP[0]
    q, k, v, cos, sin, _, _ = case.make(rng)
    q, k, v = (to_bf16(t) for t in (q, k, v))
    out = {c: kd.run(q, k, v, cos, sin, dtype="bfloat16", compute_dtype=c, isa=NATIVE[0], **case.kwargs)[1]
           for c in ("auto", "float32", "bfloat16")}
    assert (out["auto"] == out["bfloat16"]).all() and not (out["auto"] == out["float32"]).all()
    for dtype in ("float32", "float16", "bfloat16"):
        want = "bfloat16" if dtype == "bfloat16" else "float32"
        assert cpu_kernel.compute_dtype_for("auto", dtype, isa=NATIVE[0]) == want
        assert cpu_kernel.compute_dtype_for("bfloat16", dtype, isa=NATIVE[0]) == "bfloat16"
        assert cpu_kernel.compute_dtype_for("float32", dtype, isa=NATIVE[0]) == "float32"


@needs_bf16
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
def test_nonfinite_reaches_exactly_its_rows(path, target, value, tiles):
    """test_kernel_nonfinite.py's matrix with bfloat16 arithmetic: the same rows NaN / Inf (NaN and
    Inf survive the rounding), the finite ones within the bfloat16 bound."""
    rng = np.random.default_rng(7)
    q, k, v, cos, sin = poisoned(rng, path, target, value)
    want_out, want_lse = expected(q, k, v, cos, sin)
    code, out, lse, _ = kd.run(q, k, v, cos, sin, isa=NATIVE[0], head_num=HEADS, with_rotated_key=False,
                               stream_q_max=PATHS[path][2], compute_dtype="bfloat16")
    assert code == 0
    for got, want, tol in ((out, want_out, 2.0 ** -8 * np.nanmax(np.abs(np.where(np.isfinite(v), v, 0))) + 0.01),
                           (lse, want_lse, LSE_TOL + 0.05)):
        assert (np.isnan(got) == np.isnan(want)).all() and (np.isinf(got) == np.isinf(want)).all()
        finite = np.isfinite(want)
        assert np.abs(got[finite] - want[finite]).max(initial=0) <= tol  # unrounded float64: a loose check


@needs_bf16
@pytest.mark.parametrize("path", list(PATHS))
def test_rows_that_never_meet_nan_are_bit_identical(path, tiles):
    """As in float32: a NaN query element poisons its own row only; every other row (same AMX tile
    and vdpbf16ps block included) has the bits of the clean call."""
    rng = np.random.default_rng(11)
    q, k, v, cos, sin = poisoned(rng, path, "query", 0.25)
    run = dict(isa=NATIVE[0], head_num=HEADS, with_rotated_key=False, stream_q_max=PATHS[path][2],
               compute_dtype="bfloat16")
    _, clean, clean_lse, _ = kd.run(q, k, v, cos, sin, **run)
    q[0, 1, q.shape[2] // 2, 3] = np.nan
    _, out, lse, _ = kd.run(q, k, v, cos, sin, **run)
    hit = np.zeros(out.shape[:-1], bool)
    hit[0, 1, q.shape[2] // 2] = True
    assert np.isnan(out[hit]).all() and np.isnan(lse[hit]).all()
    assert (out[~hit] == clean[~hit]).all() and (lse[~hit] == clean_lse[~hit]).all()


# RotaryFlashAttentionBf16Units' report of the automatic choice (csrc/bf16_probe.h).
UNITS_REPORT = re.compile(r"(avx512_bf16|fma): vdpbf16ps (\d+) GFLOP/s, float32 FMA (\d+) GFLOP/s on one thread")


@needs_bf16
def test_the_units_are_the_faster_by_the_probe(monkeypatch):
    """Unforced, the report names the units and the rates they were chosen by: the float32 FMAs exactly
    where 0.95 x the dot-product rate is below 0.65 x the FMA rate (AMX: always the tiles)."""
    monkeypatch.delenv("RFA_BF16_ATTENTION", raising=False)
    report = cpu_kernel.bfloat16_units(NATIVE[0])
    if report != "amx":
        match = UNITS_REPORT.fullmatch(report)
        assert match, report
        dot, fma = float(match[2]), float(match[3])
        assert dot > 0 and fma > 0 and match[1] == ("fma" if 0.95 * dot < 0.65 * fma else "avx512_bf16"), report
    monkeypatch.setenv("RFA_BF16_ATTENTION", "fma")
    assert cpu_kernel.bfloat16_units(NATIVE[0]) == "fma: RFA_BF16_ATTENTION=fma"


@needs_bf16
def test_the_units_compute_the_same_products_in_another_order(monkeypatch, rng):
    """vdpbf16ps and the FMAs multiply the same rounded operands exactly: their outputs agree far inside
    the bound of the rounded reference, and are not bit for bit the same (the sums' order differs)."""
    case, tiling = SWEEP[2]
    runs = []
    for units in ("dot", "fma"):
        monkeypatch.setenv("RFA_BF16_ATTENTION", units)
        runs.append(run_bf16(case, np.random.default_rng(5), "float32", isa=NATIVE[0], stream_q_max=-1, **tiling))
    (dot, *_), (fma, _, ref_out, _, v) = runs
    assert np.abs(dot - fma).max() <= tolerance(v, "float32", ref_out) / 8 and not np.array_equal(dot, fma)


@needs_bf16
@pytest.mark.parametrize("value", ["amx", "FMA", " dot"])
def test_a_bad_units_variable_is_refused_before_any_write(value, monkeypatch, rng):
    """RFA_BF16_ATTENTION is read at each launch: a value other than auto / dot / fma refuses a bfloat16
    call by name with the outputs untouched; float32 arithmetic does not read it."""
    case, _ = SWEEP[0]
    q, k, v, cos, sin, _, _ = case.make(rng)
    monkeypatch.setenv("RFA_BF16_ATTENTION", value)
    args, outputs, keep = kd.prepare(q, k, v, cos, sin, compute_dtype="bfloat16", **case.kwargs)
    assert kd.launch(args, isa=NATIVE[0]) != 0 and np.isnan(outputs[1]).all()
    assert kd.cpu_library(NATIVE[0]).RotaryFlashAttentionLastError().decode() == (
        f"RFA_BF16_ATTENTION: expected 'auto', 'dot' or 'fma', got '{value}'")
    assert kd.run(q, k, v, cos, sin, compute_dtype="float32", isa=NATIVE[0], **case.kwargs)[0] == 0
    del keep


@needs_bf16
@pytest.mark.parametrize("cache_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("key_rotated", [True, False])
def test_paged_cache_is_the_contiguous_decode_path(cache_dtype, key_rotated, rng):
    """The paged op with bfloat16 arithmetic: bit for bit the contiguous decode path on the same
    keys (one code path), and within the bound of the rounded reference."""
    (q, kc, vc, cos, sin, tables, ctx, q_lens), _, _, attrs = paged_case(
        rng, [300, 45, 7], [1, 4, 3], heads=7, kv_heads=1, head_dim=40, dtype=cache_dtype, key_rotated=key_rotated)
    code, paged, paged_lse = kd.paged_run(q, kc, vc, cos, sin, tables, ctx, q_lens, dtype=cache_dtype,
                                          compute_dtype="bfloat16", isa=NATIVE[0], **attrs)
    assert code == 0, kd.paged_last_error(NATIVE[0])
    rows = [tables[b, j // kc.shape[1]] * kc.shape[1] + j % kc.shape[1] for b in range(3) for j in range(ctx[b])]
    k, v = kc.reshape(-1, *kc.shape[2:])[rows], vc.reshape(-1, *vc.shape[2:])[rows]
    tnd = dict(input_layout="TND", head_num=q.shape[1], key_rotated=key_rotated)
    code, flat, flat_lse, _ = kd.run(q, k, v, cos, sin, np.cumsum(q_lens), np.cumsum(ctx), dtype=cache_dtype,
                                     compute_dtype="bfloat16", isa=NATIVE[0], with_rotated_key=False, **tnd)
    assert code == 0 and (paged == flat).all() and (paged_lse == flat_lse).all()
    ref_out, ref_lse = reference_bf16(q, k, v, cos, sin, np.cumsum(q_lens), np.cumsum(ctx), **tnd)
    assert_close(paged, paged_lse, ref_out, ref_lse, v, cache_dtype)


@pytest.mark.parametrize("isa", ISAS)
def test_explicit_bfloat16_is_refused_where_it_cannot_run_before_any_write(isa, rng):
    """The avx2 and generic builds (and a CPU without avx512_bf16) refuse 'bfloat16' naming what it
    needs, with the outputs untouched; 'auto' computes float32 there, bit for bit."""
    case, _ = SWEEP[0]
    q, k, v, cos, sin, _, _ = case.make(rng)
    native = kd.cpu_library(isa).RotaryFlashAttentionNativeBf16() == 1
    assert native == (isa == "avx512" and "avx512_bf16" in cpu_flags())
    args, outputs, keep = kd.prepare(q, k, v, cos, sin, dtype="bfloat16", compute_dtype="bfloat16", **case.kwargs)
    code = kd.launch(args, isa=isa)
    if native:
        assert code == 0
        return
    assert code != 0 and np.isnan(outputs[1]).all()
    message = kd.cpu_library(isa).RotaryFlashAttentionLastError().decode()
    assert message.startswith("compute_dtype: 'bfloat16' needs the avx512_bf16 instructions (vdpbf16ps)"), message
    with pytest.raises(ValueError, match="compute_dtype: 'bfloat16' needs the avx512_bf16 instructions"):
        cpu_kernel.compute_dtype_for("bfloat16", "bfloat16", isa=isa)
    auto, f32 = (kd.run(q, k, v, cos, sin, dtype="bfloat16", compute_dtype=c, isa=isa, **case.kwargs)[1]
                 for c in ("auto", "float32"))
    assert (auto == f32).all()
    del keep


@pytest.mark.parametrize("value,message", [
    ("float16", "compute_dtype: 'float16' is not offered by the attention ops: x86 has no float16 dot product"),
    ("half", "compute_dtype: expected one of ['auto', 'float32', 'bfloat16'], got 'half'"),
])
def test_other_compute_dtypes_are_refused_by_name(value, message, rng):
    with pytest.raises(ValueError, match=re.escape(message)):
        RotaryFlashAttention(4, 16, compute_dtype=value)
    (q, kc, vc, cos, sin, tables, ctx, q_lens), _, _, _ = paged_case(rng, [20], [1])
    with pytest.raises(ValueError, match=re.escape(message)):
        rotary_paged_attention(*(ms.Tensor(x) for x in (q.astype(np.float32), kc.astype(np.float32),
                                                        vc.astype(np.float32), cos.astype(np.float32),
                                                        sin.astype(np.float32), tables, ctx, q_lens)),
                               compute_dtype=value)


@needs_bf16
def test_unfused_path_announces_that_it_computes_float32(caplog):
    dispatch.clear()
    with pytest.raises(RotaryFusionFallbackError, match="the unfused path computes float32"):
        RotaryFlashAttention(4, 16, backend="unfused", compute_dtype="bfloat16", strict=True)
    cell = RotaryFlashAttention(4, 16, backend="unfused", compute_dtype="bfloat16")
    assert "the unfused path computes float32" in caplog.text and cell.arithmetic("bfloat16") == "float32"


@needs_selected_bf16
def test_through_mindspore(mode, rng):
    """A Cell with compute_dtype='bfloat16' on float32 activations (as the Llama model keeps them),
    GRAPH_MODE and PyNative (the ``mode`` fixture): the kernel's bfloat16 result, and the Cell says
    what it computes."""
    heads, dim = 6, 72
    cell = RotaryFlashAttention(heads, dim, input_layout="BSND", compute_dtype="bfloat16", max_position_embeddings=64)
    assert cell.compute_dtype == "bfloat16" and cell.backend == "fused:CPU"
    assert cell.arithmetic(ms.float32) == "bfloat16"
    assert RotaryFlashAttention(heads, dim).arithmetic("float32") == "float32"
    q = rng.standard_normal((1, 37, heads, dim)).astype(np.float32)
    k, v = (rng.standard_normal((1, 41, 2, dim)).astype(np.float32) for _ in range(2))
    out = cell(*(ms.Tensor(x) for x in (q, k, v))).asnumpy()
    cos, sin = cell.cos.asnumpy(), cell.sin.asnumpy()
    want = kd.run(q, k, v, cos, sin, input_layout="BSND", head_num=heads, compute_dtype="bfloat16")[1]
    assert (out == want).all()


@needs_selected_bf16
def test_backward_is_the_float32_gradient(rng):
    """The backward computes float32 whatever compute_dtype says: from a bfloat16 forward's output and
    lse it gives the float32 forward's gradients up to what the bfloat16 forward moved (its output and
    lse, within the bound above), and the same bits for compute_dtype 'float32' and 'auto' on float32."""
    ms.set_context(mode=ms.PYNATIVE_MODE)
    heads, dim = 6, 72
    q = ms.Tensor(rng.standard_normal((1, 37, heads, dim)).astype(np.float32))
    k, v = (ms.Tensor(rng.standard_normal((1, 41, 2, dim)).astype(np.float32)) for _ in range(2))
    grads = {}
    for compute in ("auto", "float32", "bfloat16"):
        cell = RotaryFlashAttention(heads, dim, input_layout="BSND", compute_dtype=compute, max_position_embeddings=64)
        grads[compute] = [g.asnumpy() for g in ms.grad(lambda *x: cell(*x).sum(), grad_position=(0, 1, 2))(q, k, v)]
    assert all((a == b).all() for a, b in zip(grads["auto"], grads["float32"]))
    for g16, g32 in zip(grads["bfloat16"], grads["float32"]):
        assert np.isfinite(g16).all() and np.abs(g16 - g32).max() <= 2.0 ** -5 * np.abs(g32).max()
