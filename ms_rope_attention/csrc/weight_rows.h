// Weights in a checkpoint's own precision (float32, float16 or bfloat16) read as float32: the
// decode-sized product y = x W^T that streams W once and converts it in registers, and the row
// conversion the prefill-sized product packs its float32 panels with. Arithmetic and accumulation
// are float32 whatever W's dtype: float16 / bfloat16 -> float32 is exact, so a half weight computes
// the float32 model of the same (half-rounded) checkpoint.
//
// Header-only on simd.h, so every instruction-set build of the projection library and the
// cross-built test program (tests/cross/weight_rows.cc, aarch64 under qemu) compile the same code.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "simd.h"

namespace rfa {
namespace weights {

using simd::Half;
using simd::vf;
constexpr int kLanes = simd::kLanes;

// bfloat16 as its bits: a type of its own so the templates below tell it from float16.
struct BFloat16 {
  uint16_t bits;
};

inline vf LoadAsFloat(const float *p) { return simd::Load(p); }
inline vf LoadAsFloat(const Half *p) { return simd::HalfVector(p); }
inline vf LoadAsFloat(const BFloat16 *p) { return simd::BFloat16Vector(&p->bits); }

inline float AsFloat(float v) { return v; }
inline float AsFloat(Half v) {
  float f;
  simd::HalfToFloat(&v, &f, 1);
  return f;
}
inline float AsFloat(BFloat16 v) {
  const uint32_t w = static_cast<uint32_t>(v.bits) << 16;
  float f;
  std::memcpy(&f, &w, 4);
  return f;
}

// n weights of one row as float32 (the panel a float32 GEMM then reads).
inline void RowToFloat(const float *src, float *dst, int64_t n) { std::memcpy(dst, src, static_cast<size_t>(n) * 4); }
inline void RowToFloat(const Half *src, float *dst, int64_t n) { simd::HalfToFloat(src, dst, n); }
inline void RowToFloat(const BFloat16 *src, float *dst, int64_t n) {
  simd::BFloat16ToFloat(&src->bits, dst, n);
}

// How far ahead of the reads each of the four rows of W is prefetched. The hardware prefetcher alone
// kept a float16 W (11008, 4096) read at ~0.85x the rate float32 rows reached (and a plain sum of
// the same bytes); asking for each row's line 1 KB ahead, once per line, brought it to ~0.92x, the
// float16 product from 1.71x to 1.83x less time than float32 (M = 1, 2 threads, AVX-512; float32
// itself ~2% faster). 256 B ahead gained half of that, 4 KB none.
constexpr int64_t kPrefetchBytes = 1024;

// Asks for the cache line kPrefetchBytes ahead of w + j in each row, when w + j starts a line's
// worth of W (j counts weights from the rows' start, a multiple of kLanes). A prefetch never
// faults, so past the last row it costs nothing.
template <typename W>
inline void PrefetchRows(const W *w0, const W *w1, const W *w2, const W *w3, int64_t j) {
  constexpr int64_t kLine = 64 / sizeof(W), kAhead = kPrefetchBytes / sizeof(W);
  if (j % kLine != 0) return;
  __builtin_prefetch(w0 + j + kAhead);
  __builtin_prefetch(w1 + j + kAhead);
  __builtin_prefetch(w2 + j + kAhead);
  __builtin_prefetch(w3 + j + kAhead);
}

// With many rows of x the products are limited by the work on W, not by reading it: W's rows
// converted (float16, bfloat16) and loaded from cache once per pass. Where there are 32 vector
// registers (AVX-512) a pass takes four rows of x (16 accumulators) instead of two. W (11008, 4096)
// from memory, one thread, same process: M = 8 float32 W 1.42x, float16 / bfloat16 W 1.28x faster;
// M = 16 1.53x, 1.21x / 1.25x.
constexpr bool kQuadRowsOfX = kLanes == 16;

// The end of every product below for one pair of x rows (xa, and xb = xa + k) and four rows of W: the
// pair's eight vector sums (a: xa's four, b: xb's) reduced, plus the last k % kLanes terms, written at
// ya and ya + n. One definition for all of them: GCC fuses (or not) these multiply-adds by the form of
// this code, so the products agree bit for bit only while they share it.
template <typename W>
inline void FinishPair(int64_t n, int64_t k, const float *xa, const W *const w[4], const vf *a, const vf *b,
                       float *ya) {
  const float *xb = xa + k;
  float s[8] = {simd::ReduceSum(a[0]), simd::ReduceSum(a[1]), simd::ReduceSum(a[2]), simd::ReduceSum(a[3]),
                simd::ReduceSum(b[0]), simd::ReduceSum(b[1]), simd::ReduceSum(b[2]), simd::ReduceSum(b[3])};
  for (int64_t j = k / kLanes * kLanes; j < k; ++j) {
    const float c0 = AsFloat(w[0][j]), c1 = AsFloat(w[1][j]), c2 = AsFloat(w[2][j]), c3 = AsFloat(w[3][j]);
    s[0] += c0 * xa[j]; s[1] += c1 * xa[j]; s[2] += c2 * xa[j]; s[3] += c3 * xa[j];
    s[4] += c0 * xb[j]; s[5] += c1 * xb[j]; s[6] += c2 * xb[j]; s[7] += c3 * xb[j];
  }
  std::memcpy(ya, s, 16);
  std::memcpy(ya + n, s + 4, 16);
}

// As FinishPair for one row of x.
template <typename W>
inline void FinishOne(int64_t k, const float *xa, const W *const w[4], const vf *a, float *ya) {
  float s[4] = {simd::ReduceSum(a[0]), simd::ReduceSum(a[1]), simd::ReduceSum(a[2]), simd::ReduceSum(a[3])};
  for (int64_t j = k / kLanes * kLanes; j < k; ++j) {
    s[0] += AsFloat(w[0][j]) * xa[j]; s[1] += AsFloat(w[1][j]) * xa[j];
    s[2] += AsFloat(w[2][j]) * xa[j]; s[3] += AsFloat(w[3][j]) * xa[j];
  }
  std::memcpy(ya, s, 16);
}

// y[:, r:n1] = x W[r:n1]^T one dot product at a time: the last rows of a slice, fewer than four.
template <typename W>
void RemainingRows(int64_t m, int64_t n, int64_t k, const float *x, const W *w, float *y, int64_t r, int64_t n1) {
  for (; r < n1; ++r)
    for (int64_t i = 0; i < m; ++i) {
      float s = 0.f;
      for (int64_t j = 0; j < k; ++j) s += AsFloat(w[r * k + j]) * x[i * k + j];
      y[i * n + r] = s;
    }
}

// y[i, q] = x[i] . W[q] for the four rows of x at x and the four consecutive rows of W at w0, written at
// y + i * n + q: what FourRows below computes for them as two pairs, bit for bit (the same lanes in the
// same order, then FinishPair).
template <typename W>
void QuadRowsOfX(int64_t n, int64_t k, const float *x, const W *w0, float *y) {
  const int64_t kv = k / kLanes * kLanes;
  const W *w[4] = {w0, w0 + k, w0 + 2 * k, w0 + 3 * k};
  vf acc[4][4] = {};
  for (int64_t j = 0; j < kv; j += kLanes) {
    PrefetchRows(w[0], w[1], w[2], w[3], j);
    vf r[4];
#pragma GCC unroll 4
    for (int q = 0; q < 4; ++q) r[q] = LoadAsFloat(w[q] + j);
#pragma GCC unroll 4
    for (int g = 0; g < 4; ++g) {
      const vf u = simd::Load(x + g * k + j);
#pragma GCC unroll 4
      for (int q = 0; q < 4; ++q) acc[g][q] += r[q] * u;
    }
  }
  FinishPair(n, k, x, w, acc[0], acc[1], y);
  FinishPair(n, k, x + 2 * k, w, acc[2], acc[3], y + 2 * n);
}

// y[:, r:r+4] = x W[r:r+4]^T for the four consecutive rows of W at w0 (each k long): dotted with four
// rows of x at a time where QuadRowsOfX runs, then two, then one, x staying in cache.
template <typename W>
void FourRows(int64_t m, int64_t n, int64_t k, const float *x, const W *w0, float *y, int64_t r) {
  const int64_t kv = k / kLanes * kLanes;
  const W *w[4] = {w0, w0 + k, w0 + 2 * k, w0 + 3 * k};
  int64_t i = 0;
  if constexpr (kQuadRowsOfX)
    for (; i + 4 <= m; i += 4) QuadRowsOfX(n, k, x + i * k, w0, y + i * n + r);
  for (; i + 2 <= m; i += 2) {
    const float *xa = x + i * k, *xb = xa + k;
    vf a[4] = {}, b[4] = {};
    for (int64_t j = 0; j < kv; j += kLanes) {
      PrefetchRows(w[0], w[1], w[2], w[3], j);
      const vf u = simd::Load(xa + j), v = simd::Load(xb + j);
      const vf r0 = LoadAsFloat(w[0] + j), r1 = LoadAsFloat(w[1] + j), r2 = LoadAsFloat(w[2] + j),
               r3 = LoadAsFloat(w[3] + j);
      a[0] += r0 * u; a[1] += r1 * u; a[2] += r2 * u; a[3] += r3 * u;
      b[0] += r0 * v; b[1] += r1 * v; b[2] += r2 * v; b[3] += r3 * v;
    }
    FinishPair(n, k, xa, w, a, b, y + i * n + r);
  }
  for (; i < m; ++i) {
    const float *xa = x + i * k;
    vf a[4] = {};
    for (int64_t j = 0; j < kv; j += kLanes) {
      PrefetchRows(w[0], w[1], w[2], w[3], j);
      const vf u = simd::Load(xa + j);
      a[0] += LoadAsFloat(w[0] + j) * u; a[1] += LoadAsFloat(w[1] + j) * u;
      a[2] += LoadAsFloat(w[2] + j) * u; a[3] += LoadAsFloat(w[3] + j) * u;
    }
    FinishOne(k, xa, w, a, y + i * n + r);
  }
}

// y[:, n0:n1] = x W[n0:n1]^T for x (m, k) and W (n, k) row-major, y (m, n). Blocks of four rows of
// W are each read once from memory and converted in registers, so the product runs at the speed W
// is read: the decode step's bound, which fewer bytes per weight (a half W) lowers. (Converting each
// block once into a float32 buffer that the pairs of x rows then read was tried: at M = 8 and 16 it
// ran at float32's speed or slower, the in-register form up to 1.8x faster than float32.)
//
// The portable x86-64 build converts float16 through a table (simd::HalfTable), which costs more than
// the products: with several rows of x it converts each block of four rows once into a buffer (in
// L2) and runs the float32 form over it: x (8, 4096) by float16 W (11008, 4096) at 0.71x float32's
// speed instead of 0.49x, x (16, 4096) 0.60x instead of 0.30x (one process, 2 threads).
template <typename W>
void SmallRowsProduct(int64_t m, int64_t n, int64_t k, const float *x, const W *w, float *y, int64_t n0, int64_t n1) {
  int64_t r = n0;
#ifdef RFA_HALF_TABLE
  if constexpr (std::is_same_v<W, Half>) {
    if (m > 1) {
      thread_local std::vector<float> rows;  // one per OpenMP worker, kept between calls
      rows.resize(static_cast<size_t>(4 * k));
      for (; r + 4 <= n1; r += 4) {
        RowToFloat(w + r * k, rows.data(), 4 * k);
        FourRows(m, n, k, x, rows.data(), y, r);
      }
    }
  }
#endif
  for (; r + 4 <= n1; r += 4) FourRows(m, n, k, x, w + r * k, y, r);
  RemainingRows(m, n, k, x, w, y, r, n1);
}

// ---- Many rows of x with a half W ---------------------------------------------------------------
//
// Past a few rows of x, the in-register form above converts each weight once per group of four x
// rows and reads both W and x from L2 at each pass. ChunkedRowsProduct converts each block of four
// rows of W once per call, kChunkK weights at a time, into a float32 buffer that stays in L1; every
// group of four x rows (two with 16 vector registers; up to kChunkedRowsMax in all) multiplies that
// chunk there, its partial sums kept in a buffer between chunks. Each (x row, W row) pair accumulates exactly as in QuadRowsOfX (the
// same lanes in the same order, then the same reduction and tail): the results are bit for bit those
// of SmallRowsProduct, and each row's is that row's alone. Measured with x (m, 4096) by a float16 W
// (11008, 4096), 2 threads of the Xeon without AMX, the forms alternating in one process (min of 7):
// m = 16, 26, 35, 64 in 11.5, 16.6, 20.0, 29.0 ms, against 12.4, 20.8, 26.9, 41.3 ms for
// SmallRowsProduct over blocks of 16 rows of x. At m = 8 it was 4% slower (chunks of 512); at m = 128
// and 256, SGEMM on widened panels was faster (70.8 and 90.7 ms against 90.6 and 130.8). Chunks of
// 128 or 512 weights, and blocks of 8 rows of W (3 rows of x a pass), gained nothing consistent.
constexpr int64_t kChunkK = 256, kChunkedRowsMax = 64;

// acc[g * 4 + q] += x[g] . wbuf[q] over one chunk of `len` weights (a multiple of kLanes), for G rows
// of x at x (each k apart) and the chunk's four converted rows of W in wbuf (each kChunkK apart).
template <int G>
inline void ChunkOfGroup(int64_t k, const float *x, const float *wbuf, int64_t len, vf *acc) {
  vf a[G][4];
#pragma GCC unroll 4
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 4
    for (int q = 0; q < 4; ++q) a[g][q] = acc[g * 4 + q];
  for (int64_t j = 0; j < len; j += kLanes) {
    vf r[4];
#pragma GCC unroll 4
    for (int q = 0; q < 4; ++q) r[q] = simd::Load(wbuf + q * kChunkK + j);
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) {
      const vf u = simd::Load(x + g * k + j);
#pragma GCC unroll 4
      for (int q = 0; q < 4; ++q) a[g][q] += r[q] * u;
    }
  }
#pragma GCC unroll 4
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 4
    for (int q = 0; q < 4; ++q) acc[g * 4 + q] = a[g][q];
}

// y[i, r:r+4] for the m (<= kChunkedRowsMax) rows of x at x and the four rows of W at w0: the chunks, then
// FinishPair / FinishOne as FourRows ends.
template <typename W>
void SlabTimesFourRows(int64_t m, int64_t n, int64_t k, const float *x, const W *w0, float *y, int64_t r) {
  const int64_t kv = k / kLanes * kLanes;
  const W *w[4] = {w0, w0 + k, w0 + 2 * k, w0 + 3 * k};
  alignas(64) float wbuf[4 * kChunkK];
  vf acc[kChunkedRowsMax * 4];
  for (int64_t i = 0; i < m * 4; ++i) acc[i] = vf{};
  for (int64_t k0 = 0; k0 < kv; k0 += kChunkK) {
    const int64_t len = std::min(kChunkK, kv - k0);
    for (int q = 0; q < 4; ++q)
      for (int64_t j = 0; j < len; j += kLanes) {
        if (j % (64 / sizeof(W)) == 0) __builtin_prefetch(w[q] + k0 + j + kPrefetchBytes / sizeof(W));
        simd::Store(wbuf + q * kChunkK + j, LoadAsFloat(w[q] + k0 + j));
      }
    int64_t i = 0;
    if constexpr (kQuadRowsOfX)  // 16 accumulators: with 16 vector registers (AVX2), pairs
      for (; i + 4 <= m; i += 4) ChunkOfGroup<4>(k, x + i * k + k0, wbuf, len, acc + i * 4);
    for (; i + 2 <= m; i += 2) ChunkOfGroup<2>(k, x + i * k + k0, wbuf, len, acc + i * 4);
    for (; i < m; ++i) ChunkOfGroup<1>(k, x + i * k + k0, wbuf, len, acc + i * 4);
  }
  int64_t i = 0;
  for (; i + 2 <= m; i += 2) FinishPair(n, k, x + i * k, w, acc + i * 4, acc + i * 4 + 4, y + i * n + r);
  if (i < m) FinishOne(k, x + i * k, w, acc + i * 4, y + i * n + r);
}

// SmallRowsProduct's result for m <= kChunkedRowsMax rows of x: the blocks of four rows of W in
// [n0, n1) (SlabTimesFourRows), the last (n1 - n0) % 4 rows as there.
template <typename W>
void ChunkedRowsProduct(int64_t m, int64_t n, int64_t k, const float *x, const W *w, float *y, int64_t n0,
                        int64_t n1) {
  int64_t r = n0;
  for (; r + 4 <= n1; r += 4) SlabTimesFourRows(m, n, k, x, w + r * k, y, r);
  RemainingRows(m, n, k, x, w, y, r, n1);
}

// The slice [n0, n1) of W's rows thread t of `threads` takes: whole blocks of four rows each, the
// last thread the rest.
inline void ThreadRows(int64_t n, int threads, int t, int64_t *n0, int64_t *n1) {
  const int64_t per = (n / threads + 3) / 4 * 4;
  *n0 = std::min(n, t * per);
  *n1 = t + 1 == threads ? n : std::min(n, *n0 + per);
}

// ---- bfloat16 x bfloat16 with float32 accumulation (vdpbf16ps) -------------------------------
//
// The decode-sized product of a bfloat16 W computed in bfloat16: x rounded once per call to
// bfloat16 (FloatToBFloat16, the caller's), W's bits fed as they are to vdpbf16ps, which multiplies
// 32 bfloat16 pairs of x and W (each product exact in float32) and adds them pairwise into 16
// float32 sums. No instruction converts W: the float32 form's widening load and shift per 16
// weights (BFloat16Vector) held it to 42% of the read bandwidth on Zen 4 (issue 54). With many rows
// of x the product is bound by vdpbf16ps itself: on this project's Xeon (AMX, 2 cores under KVM) it
// peaks at 114 GFLOP/s a core against 188 for float32 FMA, so from M = 8 it runs at the float32
// form's speed there; Zen 4 has twice its float32 rate in it.
// vdpbf16ps treats bfloat16 subnormals as zero and flushes subnormal results (its fixed DAZ / FTZ).
//
// Only in the AVX-512 x86-64 build, compiled for avx512bf16 by a target attribute: the caller runs
// it only where HasBF16DotProduct() says the CPU has it. The other builds have no such product (no
// portable fallback: there HasBF16DotProduct() is false and SmallRowsProductBF16 is not declared).

using simd::FloatToBFloat16;  // float32 -> bfloat16 bits, round to nearest even (simd.h); NaN stays NaN

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__x86_64__)
#define RFA_BF16_DOT_PRODUCT 1

inline bool HasBF16DotProduct() { return __builtin_cpu_supports("avx512bf16"); }

namespace bf16 {

constexpr int kPerVector = 32;  // bfloat16 values in a zmm: one 64-byte line of a W row

// y[i, r] = x[i] . W[r] for `G` rows of x at x (each k long) and `R` consecutive rows of W at w,
// written at y + i * n + r. One pass over k: each step loads one line of each W row and one of each
// x row, G x R vdpbf16ps into G x R accumulators; a masked load reads the last k % 32 values (the
// masked lanes read as zero in x and W, and are never touched in memory). With kPrefetch, asks for
// each W row's line kPrefetchBytes ahead (the pass that first reads this block of W from memory).
template <int G, int R, bool kPrefetch>
__attribute__((target("avx512bf16"))) inline void Tile(int64_t k, const uint16_t *x, const BFloat16 *w, float *y,
                                                      int64_t n) {
  const uint16_t *wr = &w->bits;
  __m512 acc[G][R];
#pragma GCC unroll 16
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) acc[g][r] = _mm512_setzero_ps();
  auto step = [&](int64_t j, __mmask32 mask) __attribute__((always_inline, target("avx512bf16"))) {
    __m512i wv[R];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) wv[r] = _mm512_maskz_loadu_epi16(mask, wr + r * k + j);
#pragma GCC unroll 16
    for (int g = 0; g < G; ++g) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + g * k + j);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) acc[g][r] = _mm512_dpbf16_ps(acc[g][r], xv, (__m512bh)wv[r]);
    }
  };
  const int64_t kv = k / kPerVector * kPerVector;
  int64_t j = 0;
  for (; j < kv; j += kPerVector) {
    if constexpr (kPrefetch) {
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char *>(wr + r * k + j) + kPrefetchBytes, _MM_HINT_T0);
    }
    step(j, ~__mmask32(0));
  }
  if (j < k) step(j, static_cast<__mmask32>((uint64_t(1) << (k - j)) - 1));
#pragma GCC unroll 16
  for (int g = 0; g < G; ++g)
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) y[g * n + r] = simd::ReduceSum((vf)acc[g][r]);
}

// y[i, r:r+R] = x[i] W[r:r+R]^T for the rows i of x from i on: G at a time, then the rest in one
// tile of fewer. The first pass over these rows of W (i == 0) prefetches them: it reads them from
// memory, the others from L2.
template <int G, int R>
__attribute__((target("avx512bf16"))) void TileRows(int64_t m, int64_t n, int64_t k, const uint16_t *x,
                                                   const BFloat16 *w, float *y, int64_t r, int64_t i) {
  for (; i + G <= m; i += G) {
    if (i == 0)
      Tile<G, R, true>(k, x + i * k, w + r * k, y + i * n + r, n);
    else
      Tile<G, R, false>(k, x + i * k, w + r * k, y + i * n + r, n);
  }
  if constexpr (G > 1)
    if (i < m) TileRows<G - 1, R>(m, n, k, x, w, y, r, i);
}

}  // namespace bf16

// y[:, n0:n1] = x W[n0:n1]^T for x (m, k) in bfloat16 bits (x rounded by the caller) and W (n, k)
// bfloat16, both row-major, y (m, n) float32. W's rows go in blocks, each read from memory once: its
// first pass (up to four rows of x) prefetches and streams it, the passes for the other rows of x find
// it in L2 (four rows of k = 11008 are 88 KB); x (at most 16 x 11008 x 2 bytes) stays in L2. Each
// tile keeps 16 accumulators: blocks of 8 rows of W for one or two rows of x, of 4 rows for more.
// (Eight rows read W from memory 3-8% faster than four at M = 1 and 2, one thread, same process;
// four rows for four rows of x reach vdpbf16ps's peak on this Xeon at M = 8 and 16.)
__attribute__((target("avx512bf16"))) inline void SmallRowsProductBF16(int64_t m, int64_t n, int64_t k,
                                                                      const uint16_t *x_bf16, const BFloat16 *w,
                                                                      float *y, int64_t n0, int64_t n1) {
  int64_t r = n0;
  if (m <= 2)
    for (; r + 8 <= n1; r += 8) bf16::TileRows<2, 8>(m, n, k, x_bf16, w, y, r, 0);
  for (; r + 4 <= n1; r += 4) bf16::TileRows<4, 4>(m, n, k, x_bf16, w, y, r, 0);
  for (; r < n1; ++r) bf16::TileRows<4, 1>(m, n, k, x_bf16, w, y, r, 0);  // the last rows of the slice
}
#else
inline bool HasBF16DotProduct() { return false; }
#endif

}  // namespace weights
}  // namespace rfa
