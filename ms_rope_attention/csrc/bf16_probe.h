// Which units run bfloat16 arithmetic faster on this CPU: its bfloat16 dot product (vdpbf16ps) or the
// float32 FMAs on the same operands widened exactly (a bfloat16 value is a float32's upper half, and a
// product of two is exact in float32, so both compute the same products; only the order of the float32
// sums differs, and vdpbf16ps's flushing of subnormals). The answer differs between CPUs that both have
// AVX512-BF16: on Zen 4 vdpbf16ps runs at twice the FMA rate (468 against 233 GFLOP/s on 2 cores), on
// an Intel Xeon (family 6, model 207, under KVM, AMX not offered) at less than half (166 against 366).
// So one probe per library and process times a vdpbf16ps loop against an FMA loop on the calling thread
// (best of 5 alternating runs, about 1 ms), and the FMA units take the work where 0.95 x the dot rate
// falls below 0.65 x the FMA rate: the fractions of each peak the two routes reach in the projections'
// GEMM (0.45x here, 2x on Zen 4: far from the line either way). Used by the projections (rfa_cpu_linear.cc)
// and the attention kernel (bf16.h); AMX tiles, where present, are each one's own first choice.
#pragma once
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <string>
#if defined(__AVX512F__) && defined(__x86_64__)
#include <immintrin.h>
#endif

namespace rfa {
namespace bf16_probe {

struct Rates {
  double dot = 0, fma = 0;  // FLOP/s of one thread: vdpbf16ps (0 where this build or CPU has none), float32 FMA
};

#if defined(__AVX512F__) && defined(__x86_64__)
inline volatile float g_sink;  // the loops' results land here, so neither is optimised away

// The lanes' sum into g_sink (stored and added: GCC 12's _mm512_reduce_add_ps warns of its own
// uninitialised temporaries).
__attribute__((target("avx512f"))) inline void Sink(__m512 s) {
  float lanes[16];
  _mm512_storeu_ps(lanes, s);
  float sum = 0;
  for (float lane : lanes) sum += lane;
  g_sink = sum;
}

#define RFA_REP16(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12) X(13) X(14) X(15)
#define RFA_DECL(i) __m512 c##i = _mm512_set1_ps(0.01f * (i));
#define RFA_SUM(i) s = _mm512_add_ps(s, c##i);
// `iters` x 16 independent vdpbf16ps (64 FLOP each) or float32 FMAs (32 FLOP each) on zmm registers.
__attribute__((target("avx512f,avx512bf16"))) inline void DotLoop(int64_t iters) {
#define RFA_STEP(i) c##i = _mm512_dpbf16_ps(c##i, a, b);
  const __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80), b = (__m512bh)_mm512_set1_epi16(0x3a83);  // 1, ~0.001
  RFA_REP16(RFA_DECL)
  for (int64_t n = 0; n < iters; ++n) { RFA_REP16(RFA_STEP) }
  __m512 s = _mm512_setzero_ps();
  RFA_REP16(RFA_SUM)
  Sink(s);
#undef RFA_STEP
}

__attribute__((target("avx512f,fma"))) inline void FmaLoop(int64_t iters) {
#define RFA_STEP(i) c##i = _mm512_fmadd_ps(c##i, a, b);
  const __m512 a = _mm512_set1_ps(0.999999f), b = _mm512_set1_ps(1e-6f);
  RFA_REP16(RFA_DECL)
  for (int64_t n = 0; n < iters; ++n) { RFA_REP16(RFA_STEP) }
  __m512 s = _mm512_setzero_ps();
  RFA_REP16(RFA_SUM)
  Sink(s);
#undef RFA_STEP
}
#undef RFA_DECL
#undef RFA_SUM
#undef RFA_REP16

inline double SecondsOf(void (*loop)(int64_t), int64_t iters) {
  const auto start = std::chrono::steady_clock::now();
  loop(iters);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// The best of 5 alternating runs of each loop: a run preempted or slowed by a neighbour loses to the others.
inline Rates Probe() {
  Rates best;
  if (!__builtin_cpu_supports("avx512bf16")) return best;
  constexpr int64_t kIters = 4096;  // 64K instructions a run: ~0.03-0.1 ms
  for (int run = 0; run < 5; ++run) {
    best.dot = std::max(best.dot, 16.0 * 64 * kIters / SecondsOf(DotLoop, kIters));
    best.fma = std::max(best.fma, 16.0 * 32 * kIters / SecondsOf(FmaLoop, kIters));
  }
  return best;
}
#else
inline Rates Probe() { return {}; }
#endif

// This library's rates, probed once per process at the first question.
inline const Rates &ProcessRates() {
  static const Rates rates = Probe();
  return rates;
}

// Whether the float32 FMAs run bfloat16 arithmetic faster than vdpbf16ps here (false where there is
// no vdpbf16ps to compare).
inline bool FmaFaster(const Rates &r) { return r.dot > 0 && 0.95 * r.dot < 0.65 * r.fma; }

// "vdpbf16ps X GFLOP/s, float32 FMA Y GFLOP/s on one thread": the evidence of a choice, for its report.
inline std::string Describe(const Rates &r) {
  const auto gflops = [](double flops) { return std::to_string(static_cast<int>(flops / 1e9 + 0.5)); };
  return "vdpbf16ps " + gflops(r.dot) + " GFLOP/s, float32 FMA " + gflops(r.fma) + " GFLOP/s on one thread";
}

// An environment variable that forces one of two units, read at each launch (the tests run every unit on
// every CPU): RFA_BF16_GEMM (the projections) and RFA_BF16_ATTENTION (the attention).
struct EnvChoice {
  const char *name, *first, *second;

  // "" (unset or "auto"), `first` or `second`; "?" for anything else.
  std::string Value() const {
    const char *value = std::getenv(name);
    const std::string text = value ? value : "";
    if (text.empty() || text == "auto") return "";
    return text == first || text == second ? text : "?";
  }

  // "" or why the variable cannot be followed (checked with the arguments, before any memory is touched).
  std::string Problem() const {
    if (Value() != "?") return "";
    return std::string(name) + ": expected 'auto', '" + first + "' or '" + second + "', got '" + std::getenv(name) + "'";
  }
};

}  // namespace bf16_probe
}  // namespace rfa
