"""The decode-sized bfloat16 product (weights::SmallRowsProductBF16, vdpbf16ps) and the float32 ->
bfloat16 rounding its caller converts x with (weights::FloatToBFloat16), both in
ms_rope_attention/csrc/weight_rows.h, called through ctypes on tests/native/small_rows_bf16.cc,
which this module compiles with the projection library's AVX-512 flags (the header's target
attribute adds avx512bf16 to the product alone). Skipped where the CPU has no avx512_bf16 (it cannot
run the product) or there is no g++. Under AddressSanitizer (libasan preloaded, as `make sanitize`
runs the tests) the library is built with -fsanitize=address,undefined.

The product is checked against a float64 numpy product of the same bfloat16-rounded x and W (the
rounding done here, in numpy). Tolerance, from float32 accumulation: each of vdpbf16ps's 16 lanes
adds two exact products per 32 values of k (2 * ceil(k / 32) roundings), then a 4-level tree sums
the lanes, so |y - y64| <= (2 * ceil(k / 32) + 5) * 2^-24 * sum_j |x_j w_j|."""
import ctypes
import math
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "ms_rope_attention" / "csrc"
SOURCE = ROOT / "tests" / "native" / "small_rows_bf16.cc"
# setup.py's AVX-512 flags for the projection library (nothing more: no -mavx512bf16).
AVX512_FLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"]
SANITIZE_FLAGS = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-fno-sanitize-recover=all"]


def _cpu_flags() -> set:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


def _under_asan() -> bool:
    with open("/proc/self/maps") as f:
        return "libasan" in f.read()


pytestmark = [
    pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++"),
    pytest.mark.skipif(not {"avx512f", "avx512bw", "avx512_bf16"} <= _cpu_flags(),
                       reason="this CPU has no avx512_bf16: it cannot run the vdpbf16ps product"),
]


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    out = tmp_path_factory.mktemp("small_rows_bf16") / "small_rows_bf16.so"
    cmd = ["g++", "-std=c++17", "-O3", "-fPIC", "-shared", "-Wall", "-Wextra", "-Werror", f"-I{CSRC}", *AVX512_FLAGS,
           *(SANITIZE_FLAGS if _under_asan() else []), str(SOURCE), "-o", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    lib = ctypes.CDLL(str(out))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.SmallRowsProductBF16.argtypes = [i64, i64, i64, ptr, ptr, ptr, i64, i64]
    lib.SmallRowsProductBF16.restype = None
    lib.FloatToBFloat16.argtypes = [ptr, ptr, i64]
    lib.FloatToBFloat16.restype = None
    lib.HasBF16DotProduct.restype = ctypes.c_int
    return lib


def reference_bfloat16_bits(a: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits by value, in float64: of the two bfloat16 numbers around a (its
    truncation and the next one away from zero, 2^128 past the largest finite), the nearer, the
    even one on a tie; NaN gives the quiet NaN of the same sign, infinities and zeros stay."""
    a = np.ascontiguousarray(a, np.float32)
    bits = a.view(np.uint32)
    low = (bits >> 16).astype(np.uint16)
    exponent = ((bits >> 23) & 0xFF).astype(np.int64)
    ulp = np.ldexp(1.0, np.maximum(exponent, 1) - 127 - 7)  # of a bfloat16 with this exponent (subnormals: 2^-133)
    with np.errstate(invalid="ignore"):  # NaN and infinities, set apart below
        value = a.astype(np.float64)
        truncated = (bits & 0xFFFF0000).view(np.float32).astype(np.float64)
        below, above = np.abs(value - truncated), ulp - np.abs(value - truncated)
    up = (above < below) | ((above == below) & (low & 1 == 1))
    out = np.where(up & np.isfinite(value), low + 1, low).astype(np.uint16)
    nan = np.isnan(value)
    out[nan] = (low[nan] & 0x8000) | 0x7FC0
    return out


def as_float(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def to_bfloat16(lib, a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a, np.float32)
    out = np.empty(a.shape, np.uint16)
    lib.FloatToBFloat16(a.ctypes.data, out.ctypes.data, a.size)
    return out


def product(lib, x_bits, w_bits, n0, n1, fill=np.nan):
    m, k = x_bits.shape
    n = w_bits.shape[0]
    y = np.full((m, n), fill, np.float32)
    lib.SmallRowsProductBF16(m, n, k, x_bits.ctypes.data, w_bits.ctypes.data, y.ctypes.data, n0, n1)
    return y


def check_product(lib, m, n, k, n0, n1, seed=0):
    rng = np.random.default_rng(seed)
    x_bits = reference_bfloat16_bits(rng.standard_normal((m, k), np.float32))
    w_bits = reference_bfloat16_bits(rng.standard_normal((n, k), np.float32))
    x64, w64 = as_float(x_bits).astype(np.float64), as_float(w_bits).astype(np.float64)
    y = product(lib, x_bits, w_bits, n0, n1)
    want = x64 @ w64[n0:n1].T
    bound = (2 * math.ceil(k / 32) + 5) * 2.0**-24 * (np.abs(x64) @ np.abs(w64[n0:n1]).T)
    error = np.abs(y[:, n0:n1] - want)
    assert (error <= bound).all(), f"m {m} n {n} k {k} [{n0}, {n1}): worst error / bound {(error / bound).max():.3g}"
    outside = np.delete(y, np.arange(n0, n1), axis=1)
    assert np.isnan(outside).all(), "wrote y outside columns [n0, n1)"


def test_reports_the_cpu_has_bf16_dot_products(lib):
    assert lib.HasBF16DotProduct() == 1


@pytest.mark.parametrize("m", [1, 2, 3, 5, 7, 16])
@pytest.mark.parametrize("k", [1, 31, 32, 33, 4097])
def test_product_matches_float64_reference(lib, m, k):
    n = 23
    for n0, n1 in ((0, n), (3, 18), (5, 6), (22, 23), (1, 10)):
        check_product(lib, m, n, k, n0, n1, seed=m * 10000 + k)


def test_product_at_model_shapes(lib):
    check_product(lib, 16, 61, 4096, 1, 58)
    check_product(lib, 1, 9, 11008, 0, 9)
    check_product(lib, 7, 13, 11009, 2, 13)


def test_empty_slice_writes_nothing(lib):
    x = np.ones((2, 5), np.uint16)
    y = product(lib, x, np.ones((4, 5), np.uint16), 2, 2)
    assert np.isnan(y).all()


def test_nonfinite_values_propagate_as_in_float32(lib):
    """NaN in a row of x gives NaN in that row of y only; an infinite weight gives the infinity of
    its product's sign (or NaN where infinities of both signs meet, or one meets a zero of x)."""
    rng = np.random.default_rng(3)
    m, n, k = 3, 6, 70
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32)
    x[1, 40] = np.nan
    w[2, 5] = np.inf
    w[4, 7], w[4, 66] = np.inf, -np.inf
    x[2, 7] = 0.0
    x_bits, w_bits = reference_bfloat16_bits(x), reference_bfloat16_bits(w)
    with np.errstate(invalid="ignore"):
        want = as_float(x_bits).astype(np.float64) @ as_float(w_bits).astype(np.float64).T
    y = product(lib, x_bits, w_bits, 0, n)
    assert not np.isfinite(want).all() and np.isfinite(want).any()
    np.testing.assert_array_equal(np.isnan(y), np.isnan(want))
    np.testing.assert_array_equal(np.isinf(y), np.isinf(want))
    np.testing.assert_array_equal(y[np.isinf(want)], want[np.isinf(want)])


def test_subnormal_bfloat16_counts_as_zero(lib):
    """vdpbf16ps's fixed denormals-are-zero: a subnormal x (2^-130) times 2^10 adds nothing, where
    float32 arithmetic would add 2^-120 (a difference far below any tolerance above)."""
    x = reference_bfloat16_bits(np.array([[2.0**-130, 1.0]], np.float32))
    w = reference_bfloat16_bits(np.array([[2.0**10, 2.0**-100]], np.float32))
    assert product(lib, x, w, 0, 1)[0, 0] == np.float32(2.0**-100)


SPECIAL_BITS = [
    0x00000000, 0x80000000, 0x7F800000, 0xFF800000,  # zeros, infinities
    0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FFFFFFF, 0xFFFFFFFF, 0x7F80FFFF, 0x7FBF8000,  # NaN payloads
    0x00000001, 0x80000001, 0x00007FFF, 0x00008000, 0x00018000, 0x0000FFFF, 0x007FFFFF, 0x807FFFFF,  # subnormals
    0x007F8000, 0x007FFFFF, 0x00800000,  # the largest subnormals rounding up into the normal range
    0x7F7FFFFF, 0x7F7F8000, 0x7F7F7FFF, 0xFF7F8000,  # the largest finite: to infinity on the tie, not below it
    0x3F808000, 0x3F818000, 0x3F807FFF, 0x3F808001, 0xBF808000, 0xBF818000,  # ties to even, either side of them
    0x3F80FFFF, 0x3FFFFFFF, 0x3FFF8000,  # carries into the exponent
]


def test_float_to_bfloat16_rounds_to_nearest_even_bit_exact(lib):
    rng = np.random.default_rng(7)
    patterns = np.concatenate([
        np.array(SPECIAL_BITS, np.uint32),
        rng.integers(0, 2**32, 1 << 20, dtype=np.uint64).astype(np.uint32),  # every exponent, NaN included
        (rng.integers(0, 2**16, 1 << 16, dtype=np.uint32) << 16) | 0x8000,  # exact ties
        rng.integers(0, 2**32, 1 << 16, dtype=np.uint64).astype(np.uint32) & 0x807FFFFF,  # subnormals, zeros
    ])
    for offset in range(0, 17):  # every vector alignment and a scalar tail of every length
        values = patterns[offset:].view(np.float32)
        got, want = to_bfloat16(lib, values), reference_bfloat16_bits(values)
        nan = np.isnan(values)
        assert np.isnan(as_float(got[nan])).all(), "a NaN did not stay NaN"
        np.testing.assert_array_equal(got[nan] & 0x8000, want[nan] & 0x8000)  # its sign kept
        bad = np.flatnonzero(got[~nan] != want[~nan])
        assert bad.size == 0, [f"{b:#010x} -> {g:#06x}, expected {e:#06x}" for b, g, e in zip(
            values[~nan].view(np.uint32)[bad[:5]], got[~nan][bad[:5]], want[~nan][bad[:5]])]


def test_reference_rounding_agrees_with_ml_dtypes():
    """The rounding reference above against an independent one (ml_dtypes' bfloat16, where installed)."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(11)
    values = np.concatenate([np.array(SPECIAL_BITS, np.uint32),
                             rng.integers(0, 2**32, 1 << 18, dtype=np.uint64).astype(np.uint32)]).view(np.float32)
    finite = values[~np.isnan(values)]
    np.testing.assert_array_equal(reference_bfloat16_bits(finite), finite.astype(ml_dtypes.bfloat16).view(np.uint16))


def test_benchmark_program_runs_every_product(tmp_path):
    """benchmarks/small_rows.cc (benchmarks/small_rows.py's program) builds on this header and times
    all four products, vdpbf16ps included, and the read-only reference at a tiny shape."""
    import json
    import os

    out = tmp_path / "small_rows"
    source = ROOT / "benchmarks" / "small_rows.cc"
    done = subprocess.run(["g++", "-std=c++17", "-O1", "-fopenmp", "-Wall", "-Wextra", "-Werror", f"-I{CSRC}",
                           *AVX512_FLAGS, str(source), "-o", str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    run = subprocess.run([str(out), "13", "70", "2", "0", "1", "3"], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, OMP_NUM_THREADS="2"))
    assert run.returncode == 0, run.stderr
    points = [json.loads(line) for line in run.stdout.splitlines()]
    assert [p["m"] for p in points] == [1, 3]
    for p in points:
        assert set(p["products"]) == {"read only (sum of the bytes)", "float32", "float16 (F16C to float32)",
                                      "bfloat16 (to float32)", "bfloat16 (vdpbf16ps)"}
        assert all(len(q["times_s"]) == 2 for q in p["products"].values())
