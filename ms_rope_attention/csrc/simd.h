// Portable SIMD building blocks for the CPU kernel, written with GCC/Clang vector extensions so one
// source compiles to AVX-512, AVX2/FMA or baseline SSE2 (the build compiles it once per ISA and
// the Python loader picks the best one the CPU supports at run time).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#elif defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace rfa {
namespace simd {

#if defined(__AVX512F__)
constexpr int kLanes = 16;
constexpr int kRows = 12;  // GEMM micro-tile rows: 12 x 2 accumulators + 2 B vectors of 32 zmm
constexpr const char *kIsa = "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kLanes = 8;
constexpr int kRows = 6;   // 6 x 2 accumulators + 2 B vectors + 1 broadcast = 15 of 16 ymm
constexpr const char *kIsa = "avx2";
#else
constexpr int kLanes = 4;
constexpr int kRows = 6;
constexpr const char *kIsa = "generic";
#endif
constexpr int kVecs = 2;                    // GEMM micro-tile width in vectors
constexpr int kCols = kVecs * kLanes;       // GEMM micro-tile width in floats

typedef float vf __attribute__((vector_size(kLanes * 4)));
typedef int32_t vi __attribute__((vector_size(kLanes * 4)));

inline vf Load(const float *p) { vf v; std::memcpy(&v, p, sizeof v); return v; }
inline void Store(float *p, vf v) { std::memcpy(p, &v, sizeof v); }
inline vf Splat(float x) { return vf{} + x; }

// Horizontal max/sum as a halving tree (log2(kLanes) vector ops, not a chain of kLanes scalar ones:
// the softmax reduces every score row of every tile twice).
typedef float v8f __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));
typedef float v2f __attribute__((vector_size(8)));

template <typename Op>
inline float Reduce4(v4f v, Op op) {
  const v2f h = op(__builtin_shufflevector(v, v, 0, 1), __builtin_shufflevector(v, v, 2, 3));
  return op(h[0], h[1]);
}
template <typename Op>
inline float Reduce8(v8f v, Op op) {
  return Reduce4(op(__builtin_shufflevector(v, v, 0, 1, 2, 3), __builtin_shufflevector(v, v, 4, 5, 6, 7)), op);
}
template <typename Op>
inline float Reduce(vf v, Op op) {
#if defined(__AVX512F__)
  return Reduce8(op(__builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7),
                    __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15)), op);
#elif defined(__AVX2__) && defined(__FMA__)
  return Reduce8(v, op);
#else
  return Reduce4(v, op);
#endif
}
inline float ReduceMax(vf v) {
  return Reduce(v, [](auto a, auto b) { return a > b ? a : b; });
}
inline float ReduceSum(vf v) {
  return Reduce(v, [](auto a, auto b) { return a + b; });
}

// IEEE binary16 as the compiler spells it: GCC before 13 has no _Float16 in C++ on aarch64 (the host
// CPU of Ascend servers), where __fp16 is the same format.
#if defined(__aarch64__)
using Half = __fp16;
#else
using Half = _Float16;
#endif

typedef uint16_t vh __attribute__((vector_size(kLanes * 2)));
typedef uint32_t vu __attribute__((vector_size(kLanes * 4)));

// N floats as one vector, whatever the build's own width (kLanes): the decode path reads a float32
// cache 8 floats at a time in the AVX-512 build too (see rfa_cpu_decode.cc).
template <int N>
struct FloatsOf {  // (GCC drops vector_size from an alias template; a member typedef keeps it)
  typedef float type __attribute__((vector_size(N * 4)));
};
template <int N>
using Floats = typename FloatsOf<N>::type;

template <int N>
inline Floats<N> LoadFloats(const float *p) { Floats<N> v; std::memcpy(&v, p, sizeof v); return v; }
template <int N>
inline void StoreFloats(float *p, Floats<N> v) { std::memcpy(p, &v, sizeof v); }
template <int N>
inline float SumFloats(Floats<N> v) {
  if constexpr (N == 4) {
    return Reduce4(v, [](auto a, auto b) { return a + b; });
  } else {
    Floats<N / 2> lo, hi;
    std::memcpy(&lo, &v, sizeof lo);
    std::memcpy(&hi, reinterpret_cast<const char *>(&v) + sizeof lo, sizeof hi);
    return SumFloats<N / 2>(lo + hi);
  }
}

// The portable build (x86-64 without F16C) converts float16 with integer vector ops: exact, but ~20 ops a
// vector. It reads float16 through a table of all 65536 values instead, built with those ops when the
// library loads (HalfTable below).
#if !defined(__AVX512F__) && !(defined(__F16C__) && defined(__AVX2__)) && !defined(__aarch64__)
#define RFA_HALF_TABLE 1
inline vf HalfVectorArithmetic(const Half *src) {
  vh bits;
  std::memcpy(&bits, src, sizeof bits);
  const vu h = __builtin_convertvector(bits, vu);
  const vu magnitude = (h & 0x7fffu) << 13, exponent = magnitude & 0x0f800000u;
  vu w = magnitude + 0x38000000u;                      // rebias 15 -> 127
  w += vu(exponent == 0x0f800000u) & 0x38000000u;      // infinity / NaN: exponent all ones
  const vu tiny = vu(exponent == 0u);                  // zero / subnormal: renormalise
  vu shifted = w + 0x00800000u;
  vf f;
  std::memcpy(&f, &shifted, sizeof f);
  f -= Splat(6.103515625e-05f);                        // 2^-14
  std::memcpy(&shifted, &f, sizeof f);
  w = ((shifted & tiny) | (w & ~tiny)) | ((h & 0x8000u) << 16);
  std::memcpy(&f, &w, sizeof f);
  return f;
}

// Every float16 value as float32 (256 KB, one per library), built by the integer ops above. Four
// lookups a vector took the product x (1, 4096) by float16 W (11008, 4096), 2 threads, from
// 20.8-21.8 ms to 11.4-12.9 ms (float32 W: 8.7-9.2 ms; one program, alternating calls).
struct HalfTable {
  float value[65536];
  HalfTable() {
    for (uint32_t start = 0; start < 65536; start += kLanes) {
      uint16_t bits[kLanes];
      for (int i = 0; i < kLanes; ++i) bits[i] = static_cast<uint16_t>(start + i);
      Half halves[kLanes];
      std::memcpy(halves, bits, sizeof bits);
      Store(value + start, HalfVectorArithmetic(halves));
    }
  }
};
inline const HalfTable kHalfTable;
#endif

// kLanes float16 values at `src` as float32, exactly (subnormals, infinities and NaN included): the
// F16C / AVX-512 conversion where the build has it, aarch64's own conversion, else the table above.
// GCC converts a scalar _Float16 without F16C through a libgcc call per element: the portable
// x86-64 build read a float16 KV cache at 0.8 GB/s that way.
inline vf HalfVector(const Half *src) {
#if defined(__AVX512F__)  // the maskz form: GCC 12 warns of the plain form's undefined pass-through
  return (vf)_mm512_maskz_cvtph_ps(0xffff, _mm256_loadu_si256(reinterpret_cast<const __m256i *>(src)));
#elif defined(__F16C__) && defined(__AVX2__)
  return (vf)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i *>(src)));
#elif defined(__aarch64__)
  vf v;
  for (int i = 0; i < kLanes; ++i) v[i] = static_cast<float>(src[i]);
  return v;
#elif defined(__SSE2__)  // four lookups, paired in a tree (GCC chained the element-wise form)
  static_assert(kLanes == 4, "the portable x86-64 build is 128 bits wide");
  uint64_t bits;
  std::memcpy(&bits, src, sizeof bits);
  const float *table = kHalfTable.value;
  const __m128 a = _mm_load_ss(table + (bits & 0xffff)), b = _mm_load_ss(table + ((bits >> 16) & 0xffff));
  const __m128 c = _mm_load_ss(table + ((bits >> 32) & 0xffff)), d = _mm_load_ss(table + (bits >> 48));
  return (vf)_mm_movelh_ps(_mm_unpacklo_ps(a, b), _mm_unpacklo_ps(c, d));
#else
  uint16_t bits[kLanes];
  std::memcpy(bits, src, sizeof bits);
  vf v;
  for (int i = 0; i < kLanes; ++i) v[i] = kHalfTable.value[bits[i]];
  return v;
#endif
}

// kLanes bfloat16 values (uint16 bits) at `src` as float32: the bits shifted into the high half.
inline vf BFloat16Vector(const uint16_t *src) {
// One widening load (vpmovzxwd): GCC 12 splits the vector-extension form in two halves and
// reassembles them, which made bfloat16 products with several rows of x 1.4x slower than float16.
#if defined(__AVX512F__)  // the maskz form, as in HalfVector
  const vu w = (vu)_mm512_maskz_cvtepu16_epi32(0xffff, _mm256_loadu_si256(reinterpret_cast<const __m256i *>(src)));
  return (vf)(w << 16);
#elif defined(__AVX2__)
  const vu w = (vu)_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(src)));
  return (vf)(w << 16);
#else
  vh h;
  std::memcpy(&h, src, sizeof h);
  const vu w = __builtin_convertvector(h, vu) << 16;
  vf f;
  std::memcpy(&f, &w, sizeof f);
  return f;
#endif
}

// float16 <-> float32 rows. Float -> half rounds to nearest even (F16C where the build has it, GCC's
// conversion otherwise: outputs are few next to the inputs read).
inline void HalfToFloat(const Half *src, float *dst, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) Store(dst + i, HalfVector(src + i));
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

inline void FloatToHalf(const float *src, Half *dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i *>(dst + i),
                        _mm512_maskz_cvtps_ph(0xffff, _mm512_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#elif defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i *>(dst + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
  for (; i < n; ++i) dst[i] = static_cast<Half>(src[i]);
}

// bfloat16 (as uint16 bits) <-> float32 rows, a vector at a time with integer ops, next to the
// float16 ones. Float -> bfloat16 rounds to nearest even; NaN stays a (quiet) NaN, whatever its
// payload (rounding would carry an all-ones payload into -0.0).

inline void BFloat16ToFloat(const uint16_t *src, float *dst, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) Store(dst + i, BFloat16Vector(src + i));
  for (; i < n; ++i) {
    const uint32_t w = static_cast<uint32_t>(src[i]) << 16;
    std::memcpy(dst + i, &w, 4);
  }
}

// Float32 bit patterns (a uint32_t or a vu of them) -> bfloat16 bits in the low half.
template <typename U>
inline U BFloat16Bits(U w) {
  const U nearest = (w + 0x7fffu + ((w >> 16) & 1u)) >> 16;
  return (w & 0x7fffffffu) > 0x7f800000u ? (w >> 16) | 0x40u : nearest;
}

inline void FloatToBFloat16(const float *src, uint16_t *dst, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    vu w;
    std::memcpy(&w, src + i, sizeof w);
    const vh h = __builtin_convertvector(BFloat16Bits(w), vh);
    std::memcpy(dst + i, &h, sizeof h);
  }
  for (; i < n; ++i) {
    uint32_t w;
    std::memcpy(&w, src + i, 4);
    dst[i] = static_cast<uint16_t>(BFloat16Bits(w));
  }
}

// 2^x for x <= 127 (scores minus the row's reference max: at most a few units). Rounds x to the
// nearest integer n, evaluates 2^f on f in [-0.5, 0.5] with a degree-7 Taylor polynomial (relative
// error < 1e-8), and builds 2^n in the exponent bits. x <= -127 (masked, -inf) gives exactly 0.
inline vf Exp2(vf x) {
  const vf lo = Splat(-127.0f);
  x = x < lo ? lo : x;
  const vf shifter = Splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  const vf r = (x + shifter) - shifter;
  const vf f = x - r;
  const float l = 0.6931471805599453f;
  vf p = Splat(l * l * l * l * l * l * l / 5040.f);
  p = p * f + l * l * l * l * l * l / 720.f;
  p = p * f + l * l * l * l * l / 120.f;
  p = p * f + l * l * l * l / 24.f;
  p = p * f + l * l * l / 6.f;
  p = p * f + l * l / 2.f;
  p = p * f + l;
  p = p * f + 1.0f;
  const vi n = __builtin_convertvector(r, vi);
  const vi bits = (n + 127) << 23;
  vf scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// C[MR x NV*kLanes] (+)= A[MR x K] * B[K x NV*kLanes]; A broadcast by element, B loaded by vector.
template <int MR, int NV>
inline void MicroKernel(int64_t K, const float *A, int64_t lda, const float *B, int64_t ldb, float *C,
                        int64_t ldc, bool accumulate) {
  vf c[MR][NV];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NV; ++j) c[i][j] = accumulate ? Load(C + i * ldc + j * kLanes) : vf{};
  for (int64_t k = 0; k < K; ++k) {
    vf b[NV];
    for (int j = 0; j < NV; ++j) b[j] = Load(B + k * ldb + j * kLanes);
    for (int i = 0; i < MR; ++i) {
      // scalar * vector: a plain broadcast (Splat's `vf{} + x` would add a scalar add per row).
      const float a = A[i * lda + k];
      for (int j = 0; j < NV; ++j) c[i][j] += a * b[j];
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NV; ++j) Store(C + i * ldc + j * kLanes, c[i][j]);
}

using MicroKernelFn = void (*)(int64_t, const float *, int64_t, const float *, int64_t, float *, int64_t, bool);

template <int... MRs>
struct KernelTable {
  static constexpr MicroKernelFn wide[] = {MicroKernel<MRs, kVecs>...};
  static constexpr MicroKernelFn narrow[] = {MicroKernel<MRs, 1>...};
};

template <int N, int... Is>
struct MakeTable : MakeTable<N - 1, N, Is...> {};
template <int... Is>
struct MakeTable<0, Is...> { using type = KernelTable<Is...>; };

// C[M x N] (+)= A[M x K] * B[K x N], N a multiple of kLanes. The B panel of one column block stays
// in L1 while the row blocks stream past it.
//
// Causal tiles: for the row block [m0, m0 + kRows), n_limit[m0 / kRows] (when given) is how many
// columns of C it needs (the columns past it are not written), and k_limit[m0 / kRows] how many
// terms of the sum (a row block with none is left as it is), so the part of a diagonal tile that
// no row of a block can see is not computed at all.
inline void Gemm(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda, const float *B, int64_t ldb,
                 float *C, int64_t ldc, bool accumulate, const int64_t *n_limit = nullptr,
                 const int64_t *k_limit = nullptr) {
  using Table = MakeTable<kRows>::type;
  for (int64_t n0 = 0; n0 < N;) {
    const bool wide = N - n0 >= kCols;
    for (int64_t m0 = 0; m0 < M; m0 += kRows) {
      if (n_limit && n0 >= n_limit[m0 / kRows]) continue;
      const int64_t k = k_limit ? k_limit[m0 / kRows] : K;
      if (k == 0 && accumulate) continue;
      const int64_t mr = M - m0 < kRows ? M - m0 : kRows;
      const MicroKernelFn fn = wide ? Table::wide[mr - 1] : Table::narrow[mr - 1];
      fn(k, A + m0 * lda, lda, B + n0, ldb, C + m0 * ldc + n0, ldc, accumulate);
    }
    n0 += wide ? kCols : kLanes;
  }
}

}  // namespace simd
}  // namespace rfa
