// bfloat16 products with float32 accumulation (compute_dtype "bfloat16") for the attention kernels:
// rounding float32 rows to bfloat16, the register-blocked GEMM on bfloat16 pairs (vdpbf16ps), and the
// same products on AMX tiles (tdpbf16ps) where the CPU has them.
//
// No build of its own: the routines are compiled inside the AVX-512 build with the avx512bf16 target
// attribute and entered only when the CPU has the instructions (Native()); the other builds have no
// bfloat16 arithmetic, and ResolveCompute (rfa_problem.h) refuses an explicit "bfloat16" there before
// any memory is read, so their stubs below are never called.
//
// Pair layout: vdpbf16ps multiplies a 32-bit word of two bfloat16 values (low, high) of A by the
// same-position word of B and adds both products to one float32 lane. The reduction index is therefore
// split in pairs: for S = Q K^T (reduced over head_dim) Q rows are plain bfloat16 rows (consecutive
// features pair up) and K^T is packed [D/2][keys][2]; for O += P V (reduced over keys) P rows are plain
// bfloat16 rows and V is packed [keys/2][Dp][2]. A word of A is broadcast, a vector of 16 words of B
// is loaded: 16 output columns per instruction. The same layouts are AMX's: A tiles are 16 rows of 32
// bfloat16 values, B tiles 16 pair rows of 16 words (Intel's "VNNI" layout), C tiles 16 x 16 float32.
//
// Why AMX too, and the FMA units: on Sapphire Rapids vdpbf16ps runs at about half the float32 FMA rate
// (measured on this project's Xeon: 84 against 166 GFLOP/s, benchmarks/harness.py arithmetic_peaks), so
// only the tiles make bfloat16 faster there; on Zen 4 (no AMX) vdpbf16ps runs at twice the FMA rate.
// Where there are no tiles and vdpbf16ps is the slower unit (bf16_probe.h), the tiled path runs the
// same products on the float32 FMAs instead (ChosenUnits): the rounded operands widened back to float32
// in the float32 layouts, and the float32 GEMM.
#pragma once
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#if defined(__AVX512F__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "bf16_probe.h"
#include "simd.h"

namespace rfa {
namespace bf16 {

using simd::kLanes;

// A bfloat16 row element as float32 (exact: bfloat16 is float32's upper half).
inline float ToFloat(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &w, 4);
  return f;
}

// orow[0..Dp) += p * V[j][0..Dp) for key j of a packed V tile (pairs of keys, row stride 2 * Dp
// elements): the one-key form of the P V product, float32 products of the bfloat16 values. Used for
// the keys of a tile a row sees past the ones every row of its block sees (so a key a row cannot see
// is never multiplied by its zero probability: 0 x NaN would poison the row).
inline void AddKey(float *orow, float p, const uint16_t *v, int64_t j, int64_t Dp) {
  const uint16_t *pairs = v + (j / 2) * 2 * Dp;
  const simd::vf vp = simd::Splat(p);
  for (int64_t d = 0; d < Dp; d += kLanes) {
    simd::vu w;
    std::memcpy(&w, pairs + 2 * d, sizeof w);
    w = j % 2 ? w & 0xffff0000u : w << 16;
    simd::vf x;
    std::memcpy(&x, &w, sizeof x);
    simd::Store(orow + d, simd::Load(orow + d) + vp * x);
  }
}

#if defined(__AVX512F__)
#define RFA_BF16_TARGET __attribute__((target("avx512bf16,avx512bw,avx512vl,avx512f")))

// Whether this build and this CPU compute bfloat16 dot products.
inline bool Native() { return __builtin_cpu_supports("avx512bf16"); }

// n float32 values -> bfloat16, round to nearest even (vcvtneps2bf16: a NaN stays a quiet NaN;
// like vdpbf16ps itself it flushes float32 subnormals, far below any value attention sees, to zero).
RFA_BF16_TARGET inline void Round(const float *src, uint16_t *dst, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? 0xffff : static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m256bh h = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, src + i));
    _mm256_mask_storeu_epi16(dst + i, m, (__m256i)h);
  }
}

// x[0..n) rounded to bfloat16 in place, kept as float32 (the decode path's operands).
RFA_BF16_TARGET inline void RoundInPlace(float *x, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? 0xffff : static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m256i h = (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, x + i));
    const simd::vu w = (simd::vu)_mm512_maskz_cvtepu16_epi32(0xffff, h) << 16;  // maskz: as simd.h says
    _mm512_mask_storeu_ps(x + i, m, (__m512)w);
  }
}

// C[MR x NV*16] (+)= A[MR x 2K] * B[2K x NV*16]: K pairs; A rows of bfloat16 (lda elements), B rows
// of 16-word pair vectors (ldb elements between pair rows).
template <int MR, int NV>
RFA_BF16_TARGET inline void MicroKernel(int64_t K, const uint16_t *A, int64_t lda, const uint16_t *B, int64_t ldb,
                                        float *C, int64_t ldc, bool accumulate) {
  __m512 c[MR][NV];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NV; ++j) c[i][j] = accumulate ? _mm512_loadu_ps(C + i * ldc + j * 16) : _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512bh b[NV];
    for (int j = 0; j < NV; ++j) b[j] = (__m512bh)_mm512_loadu_si512(B + k * ldb + j * 32);
    for (int i = 0; i < MR; ++i) {
      uint32_t word;
      std::memcpy(&word, A + i * lda + 2 * k, 4);
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(word));
      for (int j = 0; j < NV; ++j) c[i][j] = _mm512_dpbf16_ps(c[i][j], a, b[j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NV; ++j) _mm512_storeu_ps(C + i * ldc + j * 16, c[i][j]);
}

using MicroKernelFn = void (*)(int64_t, const uint16_t *, int64_t, const uint16_t *, int64_t, float *, int64_t, bool);

template <int... MRs>
struct KernelTable {
  static constexpr MicroKernelFn wide[] = {MicroKernel<MRs, simd::kVecs>...};
  static constexpr MicroKernelFn narrow[] = {MicroKernel<MRs, 1>...};
};
template <int N, int... Is>
struct MakeTable : MakeTable<N - 1, N, Is...> {};
template <int... Is>
struct MakeTable<0, Is...> { using type = KernelTable<Is...>; };

// simd::Gemm's blocking and causal limits (n_limit in columns, k_limit in terms, per block of
// simd::kRows rows) on bfloat16 pairs: C[M x N] (+)= A[M x K] * B, N a multiple of 16, K and the
// limits even (B has K / 2 pair rows).
RFA_BF16_TARGET inline void Gemm(int64_t M, int64_t N, int64_t K, const uint16_t *A, int64_t lda, const uint16_t *B,
                                 int64_t ldb, float *C, int64_t ldc, bool accumulate, const int64_t *n_limit = nullptr,
                                 const int64_t *k_limit = nullptr) {
  using Table = MakeTable<simd::kRows>::type;
  for (int64_t n0 = 0; n0 < N;) {
    const bool wide = N - n0 >= simd::kCols;
    for (int64_t m0 = 0; m0 < M; m0 += simd::kRows) {
      if (n_limit && n0 >= n_limit[m0 / simd::kRows]) continue;
      const int64_t k = (k_limit ? k_limit[m0 / simd::kRows] : K) / 2;
      if (k == 0 && accumulate) continue;
      const int64_t mr = M - m0 < simd::kRows ? M - m0 : simd::kRows;
      const MicroKernelFn fn = wide ? Table::wide[mr - 1] : Table::narrow[mr - 1];
      fn(k, A + m0 * lda, lda, B + 2 * n0, ldb, C + m0 * ldc + n0, ldc, accumulate);
    }
    n0 += wide ? simd::kCols : kLanes;
  }
}
#undef RFA_BF16_TARGET

// Whether the CPU has AMX-BF16 tiles and the kernel (Linux) let this process use them: the tile data
// state must be requested once per process (arch_prctl ARCH_REQ_XCOMP_PERM), else the first tile
// instruction faults.
inline bool AmxPermitted() {
  static const bool permitted = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 22)) || !(d & (1u << 24))) return false;
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return permitted;
}

#define RFA_AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f")))

// Every tile 16 rows of 64 bytes (palette 1), loaded on this thread before a task's tile products
// (another library may have configured the tiles otherwise) and released after them. A constant:
// GCC 12 dropped the stores of a configuration built on the stack before ldtilecfg read it.
struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t bytes_per_row[16];
  uint8_t rows[16];
};
inline constexpr TileConfig kTileConfig = {1, 0, {}, {64, 64, 64, 64, 64, 64, 64, 64}, {16, 16, 16, 16, 16, 16, 16, 16}};
RFA_AMX_TARGET inline void AmxConfigure() { _tile_loadconfig(&kTileConfig); }
RFA_AMX_TARGET inline void AmxRelease() { _tile_release(); }

// C[M x N] (+)= A[M x K] * B: M and N multiples of 16, K a multiple of 32 (bfloat16 elements; B has
// K / 2 pair rows). Per block of 16 rows, n_limit (when given) is how many columns of C it needs (a
// multiple of 16) and k_limit how many terms (a multiple of 32; a block with none is left as it is).
// Tiles: C 0-1, A 4, B 6-7; one row block against two column blocks at a time.
RFA_AMX_TARGET inline void AmxGemm(int64_t M, int64_t N, int64_t K, const uint16_t *A, int64_t lda, const uint16_t *B,
                                   int64_t ldb, float *C, int64_t ldc, bool accumulate,
                                   const int64_t *n_limit = nullptr, const int64_t *k_limit = nullptr) {
  for (int64_t m0 = 0; m0 < M; m0 += 16) {
    const int64_t k = k_limit ? k_limit[m0 / 16] : K, n = n_limit ? n_limit[m0 / 16] : N;
    if (k == 0 && accumulate) continue;
    const uint16_t *a = A + m0 * lda;
    float *c = C + m0 * ldc;
    for (int64_t n0 = 0; n0 < n; n0 += 32) {
      const bool two = n0 + 16 < n;
      if (accumulate) {
        _tile_loadd(0, c + n0, ldc * 4);
        if (two) _tile_loadd(1, c + n0 + 16, ldc * 4);
      } else {
        _tile_zero(0);
        _tile_zero(1);
      }
      for (int64_t k0 = 0; k0 < k; k0 += 32) {
        _tile_loadd(4, a + k0, lda * 2);
        _tile_loadd(6, B + k0 / 2 * ldb + 2 * n0, ldb * 2);
        _tile_dpbf16ps(0, 4, 6);
        if (two) {
          _tile_loadd(7, B + k0 / 2 * ldb + 2 * (n0 + 16), ldb * 2);
          _tile_dpbf16ps(1, 4, 7);
        }
      }
      _tile_stored(0, c + n0, ldc * 4);
      if (two) _tile_stored(1, c + n0 + 16, ldc * 4);
    }
  }
}
#undef RFA_AMX_TARGET
#else
// Never called (see above): this build has no bfloat16 arithmetic.
inline bool Native() { return false; }
inline void Round(const float *, uint16_t *, int64_t) { std::abort(); }
inline void RoundInPlace(float *, int64_t) { std::abort(); }
inline void Gemm(int64_t, int64_t, int64_t, const uint16_t *, int64_t, const uint16_t *, int64_t, float *, int64_t,
                 bool, const int64_t * = nullptr, const int64_t * = nullptr) {
  std::abort();
}
inline bool AmxPermitted() { return false; }
inline void AmxConfigure() { std::abort(); }
inline void AmxRelease() { std::abort(); }
inline void AmxGemm(int64_t, int64_t, int64_t, const uint16_t *, int64_t, const uint16_t *, int64_t, float *, int64_t,
                    bool, const int64_t * = nullptr, const int64_t * = nullptr) {
  std::abort();
}
#endif

// Whether the bfloat16 forward may use AMX tiles where the CPU has them (default yes): the tests
// and the benchmark switch it off to run the vdpbf16ps GEMM on the same machine.
inline std::atomic<bool> amx_allowed{true};
inline bool UseAmx() { return amx_allowed.load(std::memory_order_relaxed) && Native() && AmxPermitted(); }

// The units the tiled path's bfloat16 products run on: AMX tiles, vdpbf16ps on bfloat16 pairs, or the
// float32 FMAs on the same rounded operands widened back to float32.
enum class Units { kAmx, kDot, kFma };

// RFA_BF16_ATTENTION: "dot" (the bfloat16 units: AMX tiles where allowed, else vdpbf16ps) or "fma".
inline constexpr bf16_probe::EnvChoice kUnitsChoice{"RFA_BF16_ATTENTION", "dot", "fma"};

// "" or why RFA_BF16_ATTENTION cannot be followed (checked with the arguments, before any memory is read).
inline std::string UnitsProblem() { return kUnitsChoice.Problem(); }

// This launch's units (a bfloat16 launch: Native()): RFA_BF16_ATTENTION's, else AMX where allowed, else
// the probe's faster unit.
inline Units ChosenUnits() {
  const std::string forced = kUnitsChoice.Value();
  if (forced == "fma") return Units::kFma;
  if (UseAmx()) return Units::kAmx;
  if (forced == "dot") return Units::kDot;
  return bf16_probe::FmaFaster(bf16_probe::ProcessRates()) ? Units::kFma : Units::kDot;
}

// ChosenUnits and why: "amx", "avx512_bf16: <rates>", "fma: <rates>" or "<unit>: RFA_BF16_ATTENTION=<value>";
// "" where this build and CPU have no bfloat16 arithmetic.
inline std::string UnitsReport() {
  if (!Native()) return "";
  const std::string forced = kUnitsChoice.Value();
  if (forced == "?") return UnitsProblem();
  const Units units = ChosenUnits();
  const std::string name = units == Units::kAmx ? "amx" : units == Units::kDot ? "avx512_bf16" : "fma";
  if (!forced.empty()) return name + ": RFA_BF16_ATTENTION=" + forced;
  return units == Units::kAmx ? name : name + ": " + bf16_probe::Describe(bf16_probe::ProcessRates());
}

// The build and CPU, as ResolveCompute's refusal names them.
inline const char *Build() {
  if (!std::strcmp(simd::kIsa, "avx512")) return Native() ? "the avx512 build on a CPU with avx512_bf16"
                                                         : "the avx512 build on a CPU without avx512_bf16";
  return !std::strcmp(simd::kIsa, "avx2") ? "the avx2 build" : "the generic build";
}

}  // namespace bf16
}  // namespace rfa
