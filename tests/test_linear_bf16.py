"""The projections' bfloat16 arithmetic (``compute_dtype="bfloat16"``: csrc/onednn_matmul.cc on oneDNN's
matmul) against a float64 numpy reference evaluated on the same rounded inputs: x rounded once to
bfloat16 (to nearest even, as the op does), W bfloat16 as given. Its refusals, the MindSpore op in both
modes, the private oneDNN in both import orders with MindSpore, and its threads.

Tolerance: every product of two bfloat16 values is exact in float32; what remains is float32
accumulation of K terms in oneDNN's order: |y - y64| <= 1e-6 * (|bf16(x)| |W|^T) + 1e-30, about 8
float32 ulps of the sum of the terms' magnitudes (the float32 path's bound, tests/test_linear.py).
Where the sums are exact in float32 (small integers), the result is checked bit for bit."""
import os
import re
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, nn

from ms_rope_attention import linear
from ms_rope_attention.cpu_runtime import built_libraries, cpu_flags, direct_call, usable_isas

ROOT = Path(__file__).resolve().parents[1]
ISAS = [isa for isa in usable_isas() if isa in built_libraries(linear.STEM)]
BUILT = bool(linear.onednn())
needs_onednn = pytest.mark.skipif(not BUILT, reason="projection library built without oneDNN (not x86_64 Linux)")
# bfloat16 arithmetic needs oneDNN in the build and bfloat16 instructions in the CPU (AVX512-BF16 / AMX-BF16), or
# it is refused with the library's own words: its tests run where it runs; where it does not (an AVX2 CPU),
# test_this_cpus_refusal checks that every entry refuses it with those words.
BF16_PROBLEM = linear.library().RfaLinearComputeProblem(b"bfloat16").decode()
needs_bf16 = pytest.mark.skipif(bool(BF16_PROBLEM), reason=BF16_PROBLEM)
BF16 = ml_dtypes.bfloat16


def bf16(a):
    """``a`` rounded to bfloat16 (ml_dtypes: to nearest even), as an array of that dtype."""
    return np.asarray(a, np.float32).astype(BF16)


def reference(x, w):
    """(y64, tolerance) on the rounded operands: x rounded to bfloat16 here as the op rounds it."""
    xr, w64 = bf16(x).astype(np.float64), w.astype(np.float64)
    return xr @ w64.T, 1e-6 * (np.abs(xr) @ np.abs(w64).T) + 1e-30


@needs_bf16
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("m", [1, 2, 16, 17, 37, 512])
@pytest.mark.parametrize("n, k", [(40, 72), (72, 40), (11, 1), (1, 11), (1, 1), (130, 257), (4099, 33)])
def test_equals_float64_reference_on_rounded_inputs(m, n, k, isa, rng, bf16_engines):
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = bf16(rng.standard_normal((n, k)))
    expected, tol = reference(x, w)
    for _ in bf16_engines():
        y = linear.multiply(x, w, isa=isa, compute_dtype="bfloat16")
        assert y.shape == (m, n) and y.dtype == np.float32
        assert np.all(np.abs(y - expected) <= tol), np.max(np.abs(y - expected) / tol)


@needs_bf16
def test_leading_dimensions_and_a_long_sum(rng, bf16_engines):
    x = rng.standard_normal((2, 3, 5, 4096)).astype(np.float32)
    w = bf16(rng.standard_normal((19, 4096)))
    expected, tol = reference(x.reshape(-1, 4096), w)
    for _ in bf16_engines():
        y = linear.multiply(x, w, compute_dtype="bfloat16")
        assert y.shape == (2, 3, 5, 19) and np.all(np.abs(y.reshape(-1, 19) - expected) <= tol)


@needs_bf16
@pytest.mark.parametrize("m", [1, 37])
def test_exact_where_the_math_is_exact(m, rng, bf16_engines):
    """Small integers: bfloat16 holds them, and every partial sum is an integer below 2^24, so any
    float32 summation order gives the exact result, bit for bit, on either engine."""
    x = rng.integers(-8, 9, (m, 300)).astype(np.float32)
    w = rng.integers(-8, 9, (45, 300)).astype(BF16)
    for _ in bf16_engines():
        y = linear.multiply(x, w, compute_dtype="bfloat16")
        assert np.array_equal(y, (x.astype(np.float64) @ w.astype(np.float64).T).astype(np.float32))


@needs_bf16
def test_x_is_rounded_to_nearest_even(bf16_engines):
    """Halfway cases between bfloat16 neighbours (7 stored mantissa bits) go to the even one, others
    to the nearest: not truncation. K = 1 and W = 1, so y is bf16(x) itself; 5 rows (past the decode
    path), on either engine, and 4 rows (the decode path)."""
    half_ulp = 2.0 ** -8
    x = np.array([1 + half_ulp, 1 + 3 * half_ulp, 1 + 1.5 * half_ulp, -(1 + 3 * half_ulp), 1 + 0.5 * half_ulp],
                 np.float32)[:, None]
    expected = np.array([1, 1 + 4 * half_ulp, 1 + 2 * half_ulp, -(1 + 4 * half_ulp), 1], np.float32)
    for _ in bf16_engines():
        for rows in (slice(0, 5), slice(0, 4)):
            y = linear.multiply(x[rows], np.ones((1, 1), BF16), compute_dtype="bfloat16")[:, 0]
            assert np.array_equal(y, expected[rows])
            assert np.array_equal(y, x[rows, 0].astype(BF16).astype(np.float32))


@needs_bf16
@pytest.mark.parametrize("m", [4, 9])  # the decode path; past it
def test_non_finite_values_propagate(m, rng, bf16_engines):
    x = rng.standard_normal((m, 24)).astype(np.float32)
    w = bf16(rng.standard_normal((3, 24)))
    x[1, 2] = np.nan
    x[2, 5] = np.float32(3.4e38)  # rounds up past bfloat16's largest finite value: +inf
    for _ in bf16_engines():
        y = linear.multiply(x, w, compute_dtype="bfloat16")
        assert np.isnan(y[1]).all() and np.isinf(y[2]).all()
        assert np.isfinite(np.delete(y, [1, 2], axis=0)).all()


@needs_bf16
def test_empty_sum_and_empty_outputs(bf16_engines):
    for _ in bf16_engines():
        for m in (3, 9):
            y = linear.multiply(np.zeros((m, 0), np.float32), np.zeros((4, 0), BF16), compute_dtype="bfloat16")
            assert np.array_equal(y, np.zeros((m, 4), np.float32))
        assert linear.multiply(np.zeros((0, 8), np.float32), np.zeros((4, 8), BF16), compute_dtype="bfloat16").shape == (0, 4)
        assert linear.multiply(np.zeros((9, 8), np.float32), np.zeros((0, 8), BF16), compute_dtype="bfloat16").shape == (9, 0)


# The engines of bfloat16 arithmetic past 4 rows (csrc/rfa_cpu_linear.cc: ChosenBf16Engine): oneDNN on the
# bfloat16 units, or the same products on the float32 FMAs where this CPU's vdpbf16ps is the slower.
ENGINE_REPORT = re.compile(r"(onednn|fma): vdpbf16ps (\d+) GFLOP/s, float32 FMA (\d+) GFLOP/s on one thread")


@needs_onednn
def test_the_engine_is_the_faster_units_by_the_probe(monkeypatch):
    """Unforced, the report names the engine and the rates it was chosen by: the FMA engine exactly where
    0.95 x the dot-product rate is below 0.65 x the FMA rate (AMX: always oneDNN)."""
    monkeypatch.delenv("RFA_BF16_GEMM", raising=False)
    report = linear.bf16_engine()
    if "avx512_bf16" not in cpu_flags() or linear.library_isa() != "avx512":  # nothing to probe with
        assert report in ("onednn: AMX", "onednn: no vdpbf16ps in this CPU or build to probe"), report
    elif report != "onednn: AMX":
        match = ENGINE_REPORT.fullmatch(report)
        assert match, report
        dot, fma = float(match[2]), float(match[3])
        assert dot > 0 and fma > 0
        assert match[1] == ("fma" if 0.95 * dot < 0.65 * fma else "onednn"), report
    for forced in ("onednn", "fma"):
        monkeypatch.setenv("RFA_BF16_GEMM", forced)
        assert linear.bf16_engine() == f"{forced}: RFA_BF16_GEMM={forced}"


@needs_bf16
def test_both_engines_agree_within_the_bound_and_differ_only_in_order(rng, bf16_engines):
    """The same arithmetic on other units: both within the float64 bound, and not bit-identical in
    general (another float32 summation order), at a prefill-sized product."""
    x = rng.standard_normal((64, 1000)).astype(np.float32)
    w = bf16(rng.standard_normal((48, 1000)))
    expected, tol = reference(x, w)
    results = {engine: linear.multiply(x, w, compute_dtype="bfloat16") for engine in bf16_engines()}
    for y in results.values():
        assert np.all(np.abs(y - expected) <= tol)
    assert not np.array_equal(results["onednn"], results["fma"])


@needs_bf16
@pytest.mark.parametrize("value", ["FMA", "amx", "1", " fma"])
def test_a_bad_engine_setting_is_refused_by_name(value, monkeypatch):
    monkeypatch.setenv("RFA_BF16_GEMM", value)
    x, w = np.ones((9, 3), np.float32), np.ones((4, 3), BF16)
    with pytest.raises(ValueError, match=re.escape(f"RFA_BF16_GEMM: expected 'auto', 'onednn' or 'fma', got '{value}'")):
        linear.multiply(x, w, compute_dtype="bfloat16")
    for m in (1, 9):  # float32 arithmetic never reads it
        assert (linear.multiply(np.ones((m, 3), np.float32), w) == 3).all()
    monkeypatch.setenv("RFA_BF16_GEMM", "auto")
    assert (linear.multiply(x, w, compute_dtype="bfloat16") == 3).all()


@needs_bf16
@pytest.mark.parametrize("weight_dtype", [np.float32, np.float16])
def test_bfloat16_arithmetic_refuses_other_weight_dtypes(weight_dtype):
    if not BUILT:
        pytest.skip("refused for the build first (test_a_build_without_onednn_refuses_by_name)")
    with pytest.raises(ValueError, match=re.escape("weight: expected bfloat16 with compute_dtype 'bfloat16'")):
        linear.multiply(np.ones((2, 3), np.float32), np.ones((4, 3), weight_dtype), compute_dtype="bfloat16")


@pytest.mark.parametrize("value, message", [
    ("float16", "compute_dtype: 'float16' is not offered by RfaLinear"),
    ("bf16", "compute_dtype: expected 'float32' or 'bfloat16', got 'bf16'"),
    ("", "compute_dtype: expected 'float32' or 'bfloat16', got ''"),
])
def test_bad_compute_dtype_is_refused_by_name(value, message):
    x, w = np.ones((2, 3), np.float32), np.ones((4, 3), BF16)
    with pytest.raises(ValueError, match=re.escape(message)):
        linear.multiply(x, w, compute_dtype=value)
    with pytest.raises(ValueError, match=re.escape(message)):
        linear.linear_op(value)


def test_op_refuses_a_non_string_compute_dtype():
    with pytest.raises(ValueError, match="compute_dtype: expected a str, got 16"):
        linear.linear_op(16)


def test_a_build_without_onednn_refuses_by_name():
    if BUILT:
        pytest.skip("this build has oneDNN")
    with pytest.raises(ValueError, match="compute_dtype: 'bfloat16' needs oneDNN"):
        linear.multiply(np.ones((2, 3), np.float32), np.ones((4, 3), BF16), compute_dtype="bfloat16")


@pytest.mark.parametrize("weight_dtype", [np.float32, np.float16, BF16])
def test_float32_arithmetic_is_the_default_entry_bit_for_bit(weight_dtype, rng):
    """compute_dtype 'float32' is the same computation as the entry without the attribute (the
    aot entry called without MindSpore's extra, i.e. the contract's default), at decode and prefill
    sizes."""
    for m in (1, 9, 64):
        x = rng.standard_normal((m, 96)).astype(np.float32)
        w = rng.standard_normal((50, 96)).astype(weight_dtype)
        y = np.full((m, 50), np.nan, np.float32)
        direct_call(linear.library(), "RfaLinear", (x, w, y), "RfaLinearLastError")
        assert np.array_equal(linear.multiply(x, w, compute_dtype="float32"), y)


@needs_bf16
def test_bfloat16_differs_from_float32_arithmetic(rng):
    """The attribute reaches the kernel: rounding x changes the result beyond float32's rounding."""
    x = rng.standard_normal((5, 64)).astype(np.float32)
    w = bf16(rng.standard_normal((7, 64)))
    y32, y16 = linear.multiply(x, w), linear.multiply(x, w, compute_dtype="bfloat16")
    expected32 = x.astype(np.float64) @ w.astype(np.float64).T
    assert np.abs(y16 - expected32).max() > 100 * np.abs(y32 - expected32).max()


class Projection(nn.Cell):
    def __init__(self, weight, compute_dtype):
        super().__init__()
        self.weight = ms.Parameter(Tensor(weight), name="weight")
        self.op = linear.linear_op(compute_dtype)

    def construct(self, x):
        return self.op(x, self.weight)


@needs_bf16
def test_op_in_both_modes_with_a_dynamic_sequence_length(mode, rng):
    w = bf16(rng.standard_normal((24, 40)))
    net = Projection(w, "bfloat16")
    if mode == "graph":
        net.set_inputs(Tensor(shape=[2, None, 40], dtype=ms.float32))
    for length in (1, 17, 40):
        x = rng.standard_normal((2, length, 40)).astype(np.float32)
        y = net(Tensor(x)).asnumpy()
        expected, tol = reference(x.reshape(-1, 40), w)
        assert y.shape == (2, length, 24) and np.all(np.abs(y.reshape(-1, 24) - expected) <= tol)
        assert np.array_equal(y, linear.multiply(x, w, compute_dtype="bfloat16"))


@needs_bf16
def test_op_is_one_primitive_per_compute_dtype():
    assert linear.linear_op() is linear.linear_op("float32")
    if BUILT:
        assert linear.linear_op("bfloat16") is linear.linear_op("bfloat16") is not linear.linear_op()


@needs_bf16
def test_op_refuses_a_float32_weight_under_bfloat16_at_launch(rng):
    net = Projection(rng.standard_normal((4, 8)).astype(np.float32), "bfloat16")
    with pytest.raises(RuntimeError):
        net(Tensor(rng.standard_normal((2, 8)).astype(np.float32))).asnumpy()
    assert "weight: expected bfloat16 with compute_dtype 'bfloat16'" in linear.library().RfaLinearLastError().decode()


# In a fresh interpreter: the private oneDNN is the one bound, beside MindSpore's own (same SONAME
# libdnnl.so.3), whichever loads first. CHECK runs after both are loaded.
CHECK = """
import numpy as np, ml_dtypes, mindspore as ms
from mindspore import ops, Tensor
from ms_rope_attention import linear
a = np.arange(12, dtype=np.float32).reshape(3, 4) / 7
b = np.arange(20, dtype=np.float32).reshape(4, 5) / 3
got = ops.MatMul()(Tensor(a), Tensor(b)).asnumpy()
assert np.allclose(got, a @ b, rtol=1e-6), got
x = np.arange(60, dtype=np.float32).reshape(5, 12) - 30
w = (np.arange(36, dtype=np.float32).reshape(3, 12) - 18).astype(ml_dtypes.bfloat16)
assert np.array_equal(linear.multiply(x, w, compute_dtype='bfloat16'), (x @ w.astype(np.float32).T))
maps = open('/proc/self/maps').read()
assert 'libdnnl_rfa.so.3' in maps and '/mindspore/lib/libdnnl.so.3' in maps, 'expected both oneDNNs mapped'
print('onednn', linear.onednn())
"""
OURS_FIRST = """
import ctypes, os, sysconfig
import scipy_openblas32
folder = os.environ.get('RFA_CPU_KERNEL_DIR') or os.path.join({root!r}, 'ms_rope_attention')
ctypes.CDLL(os.path.join(scipy_openblas32.get_lib_dir(), 'lib' + scipy_openblas32.get_library() + '.so'),
            mode=ctypes.RTLD_GLOBAL)  # as linear.py does: the library finds OpenBLAS this way in a checkout
ctypes.CDLL(os.path.join(folder, '_rfa_cpu_linear_generic' + sysconfig.get_config_var('EXT_SUFFIX')))
assert 'libdnnl_rfa.so.3' in open('/proc/self/maps').read()  # ours and its oneDNN, before MindSpore's
import mindspore as ms; ms.set_device('CPU')
"""


def fresh(code: str) -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    return run.stdout


@needs_bf16
@pytest.mark.parametrize("order", ["mindspore first", "ours first"])
def test_private_onednn_beside_mindspores_in_both_import_orders(order):
    prelude = "import mindspore as ms; ms.set_device('CPU')\n" if order == "mindspore first" else OURS_FIRST.format(
        root=str(ROOT))
    out = fresh(prelude + CHECK)
    assert re.search(r"onednn oneDNN 3\.2\.\d+ \(OpenMP runtime\)", out), out


@needs_bf16
@pytest.mark.parametrize("omp_threads", [None, "1"])
def test_onednn_runs_on_the_openmp_pool_of_the_process(omp_threads):
    """One OpenMP runtime (libgomp) for our kernels and oneDNN: its thread count is the process's
    cores, or OMP_NUM_THREADS; as oneDNN's verbose mode reports it."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env.update(PYTHONPATH=str(ROOT), ONEDNN_VERBOSE="1", RFA_BF16_GEMM="onednn",
               **({"OMP_NUM_THREADS": omp_threads} if omp_threads else {}))
    code = ("import numpy as np, ml_dtypes; from ms_rope_attention import linear; "
            "linear.multiply(np.ones((64, 32), np.float32), np.ones((16, 32), ml_dtypes.bfloat16), "
            "compute_dtype='bfloat16')")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    threads = re.findall(r"runtime:OpenMP,nthr:(\d+)", run.stdout)
    assert threads == [omp_threads or str(len(os.sched_getaffinity(0)))], run.stdout[-2000:]
    assert re.search(r"exec,cpu,matmul,brg:avx512_core_(amx|bf16)", run.stdout) or "avx512_bf16" not in open(
        "/proc/cpuinfo").read(), run.stdout[-2000:]


@needs_onednn
@pytest.mark.parametrize("cap", ["AVX512_CORE", "AVX2"])
def test_a_cpu_without_bfloat16_instructions_is_refused_by_name(cap):
    """oneDNN capped below AVX512-BF16 (ONEDNN_MAX_CPU_ISA: what it finds on such a CPU) would emulate
    the bfloat16 products: refused, naming compute_dtype and the instructions found, in the op and the
    direct call alike; float32 arithmetic runs."""
    code = """
import numpy as np, ml_dtypes
from ms_rope_attention import linear
x, w = np.ones((2, 3), np.float32), np.ones((4, 3), ml_dtypes.bfloat16)
for call in (lambda: linear.multiply(x, w, compute_dtype='bfloat16'), lambda: linear.linear_op('bfloat16')):
    try:
        call()
        raise SystemExit('not refused')
    except ValueError as e:
        print(e)
assert (linear.multiply(x, w) == 3).all()
"""
    env = dict(os.environ, PYTHONPATH=str(ROOT), ONEDNN_MAX_CPU_ISA=cap)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    best = cap.lower() if cap == "AVX2" or "avx512bw" in cpu_flags() else "avx2"  # the cap, or the CPU's below it
    expected = (f"compute_dtype: 'bfloat16' needs bfloat16 instructions (AVX512-BF16 or AMX-BF16), which oneDNN does "
                f"not find on this CPU (its best: {best}")
    assert run.stdout.count(expected) == 2, run.stdout


@pytest.mark.skipif(not BF16_PROBLEM, reason="this CPU and build run bfloat16 arithmetic (the tests above check it)")
def test_this_cpus_refusal_is_the_librarys_problem_by_name(rng):
    """Where bfloat16 arithmetic cannot run (no oneDNN, or no bfloat16 instructions), every entry refuses it
    with the library's words, naming compute_dtype, before touching memory; float32 arithmetic of the same
    bfloat16 weight runs."""
    x, w = rng.standard_normal((3, 8)).astype(np.float32), bf16(rng.standard_normal((5, 8)))
    assert BF16_PROBLEM.startswith("compute_dtype: 'bfloat16'"), BF16_PROBLEM
    for call in (lambda: linear.multiply(x, w, compute_dtype="bfloat16"), lambda: linear.linear_op("bfloat16"),
                 lambda: linear.linear_op("bfloat16", packed_out_features=5)):
        with pytest.raises(ValueError, match=re.escape(BF16_PROBLEM)):
            call()
    assert np.allclose(linear.multiply(x, w), x.astype(np.float64) @ w.astype(np.float64).T, rtol=1e-5, atol=1e-5)


# W reordered once into oneDNN's blocked layout (linear.pack_weight): the same products as W as stored
# where both run on oneDNN (M > 16); decode-sized rows of W as stored stream into vdpbf16ps instead
# (another summation order: both within the reference's bound).
@needs_bf16
@pytest.mark.parametrize("m", [1, 17, 512])
@pytest.mark.parametrize("n, k", [(40, 72), (11, 1), (1, 11), (4099, 33)])
def test_packed_weight_gives_the_plain_weights_result(m, n, k, rng, monkeypatch):
    monkeypatch.setenv("RFA_BF16_GEMM", "onednn")  # the plain weight on oneDNN too: the bits compared below
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = bf16(rng.standard_normal((n, k)))
    packed = linear.pack_weight(w)
    assert packed.dtype == np.uint8 and packed.shape == (linear.packed_bytes(n, k),)
    y = linear.multiply(x, packed, compute_dtype="bfloat16", packed_out_features=n)
    expected, tol = reference(x, w)
    assert y.shape == (m, n) and np.all(np.abs(y - expected) <= tol)
    plain = linear.multiply(x, w, compute_dtype="bfloat16")
    assert np.array_equal(y, plain) if m > 16 else np.all(np.abs(plain - expected) <= tol)


@needs_bf16
@pytest.mark.parametrize("shift", [0, 16, 48])
def test_pack_into_the_callers_buffer_at_any_alignment_and_copy_it(shift, rng):
    """The layout starts at the buffer's first 64-byte boundary, wherever the caller's buffer starts;
    a copy at another alignment (MindSpore copying a numpy buffer) still gives the same products."""
    x = rng.standard_normal((5, 40)).astype(np.float32)
    w = bf16(rng.standard_normal((24, 40)))
    size = linear.packed_bytes(24, 40)
    block = np.zeros(size + 128, np.uint8)
    start = (-block.ctypes.data % 64 + shift) % 64
    out = block[start:start + size]
    assert linear.pack_weight(w, out) is out
    expected = linear.multiply(x, linear.pack_weight(w), compute_dtype="bfloat16", packed_out_features=24)
    assert np.array_equal(linear.multiply(x, out, compute_dtype="bfloat16", packed_out_features=24), expected)
    moved = block[start + 8:start + 8 + size]
    moved[:] = out.copy()
    assert np.array_equal(linear.multiply(x, moved, compute_dtype="bfloat16", packed_out_features=24), expected)


@needs_bf16
@pytest.mark.parametrize("case, message", [
    ("another N in the same block", "weight: packed for (1, 11), used as (packed_out_features, in_features) = (5, 11)"),
    ("no trailer", "weight: expected a buffer RfaLinearPack wrote (its trailer is missing)"),
    ("another layout", "weight: packed in another layout than this CPU's oneDNN picks"),
    ("wrong size", "weight: expected"),
    ("float32 arithmetic", "weight: a packed (uint8) weight needs compute_dtype 'bfloat16'"),
    ("no packed_out_features", "packed_out_features: expected the out_features the uint8 weight was packed for"),
    ("plain weight with packed_out_features", "weight: expected the uint8 buffer RfaLinearPack wrote"),
])
def test_packed_weight_misuse_is_refused_by_name(case, message, rng):
    x = rng.standard_normal((3, 11)).astype(np.float32)
    w = bf16(rng.standard_normal((1, 11)))
    packed, n, weight, compute = linear.pack_weight(w), 1, None, "bfloat16"
    if case == "another N in the same block":
        n = 5
        assert linear.packed_bytes(5, 11) == packed.size  # the size alone cannot tell
    elif case == "no trailer":
        packed[-64:-56] = 0
    elif case == "another layout":
        packed[-40] ^= 1  # the trailer's layout fingerprint
    elif case == "wrong size":
        packed = packed[:-1].copy()
    elif case == "float32 arithmetic":
        compute = "float32"
    elif case == "no packed_out_features":
        n = 0
    else:
        weight = w
    with pytest.raises(ValueError, match=re.escape(message)):
        linear.multiply(x, packed if weight is None else weight, compute_dtype=compute, packed_out_features=n,
                        out_shape=(3, max(n, 1)))


@needs_bf16
def test_pack_refuses_a_weight_that_is_not_bfloat16():
    with pytest.raises(ValueError, match=re.escape("weight: expected bfloat16, got float32")):
        linear.pack_weight(np.ones((4, 3), np.float32))
    with pytest.raises(ValueError, match=re.escape("packed: expected shape")):
        linear.pack_weight(np.ones((4, 3), BF16), np.zeros(7, np.uint8))
    with pytest.raises(ValueError, match=re.escape("in_features: expected [1, 2^31), got 0")):
        linear.packed_bytes(4, 0)


def test_packed_out_features_needs_bfloat16_arithmetic():
    with pytest.raises(ValueError, match="packed_out_features: expected 0, or the out_features of a weight packed"):
        linear.linear_op("float32", packed_out_features=8)


@needs_bf16
def test_op_with_a_packed_weight_in_both_modes(mode, rng):
    w = bf16(rng.standard_normal((24, 40)))

    class Packed(nn.Cell):
        def __init__(self):
            super().__init__()
            self.weight = ms.Parameter(Tensor(linear.pack_weight(w)), name="weight", requires_grad=False)
            self.op = linear.linear_op("bfloat16", packed_out_features=24)

        def construct(self, x):
            return self.op(x, self.weight)

    net = Packed()
    if mode == "graph":
        net.set_inputs(Tensor(shape=[2, None, 40], dtype=ms.float32))
    for length in (1, 17, 40):
        x = rng.standard_normal((2, length, 40)).astype(np.float32)
        y = net(Tensor(x)).asnumpy()
        assert y.shape == (2, length, 24)
        packed = linear.pack_weight(w)
        assert np.array_equal(y, linear.multiply(x, packed, compute_dtype="bfloat16", packed_out_features=24))
