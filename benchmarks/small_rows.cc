// The decode-sized products of ms_rope_attention/csrc/weight_rows.h timed side by side in one
// process: y = x W^T for a few rows of x, W's rows split across the OpenMP threads as the projection
// library splits them (weights::ThreadRows), one call per product and round, the order of the
// products turning every round. Compiled and run by benchmarks/small_rows.py with the AVX-512 build's
// flags; prints one JSON object per M on stdout.
//
//   small_rows N K ROUNDS POOL_MIB M...
//
// Products: float32 W (SmallRowsProduct<float>), float16 W converted in registers (<Half>), bfloat16
// W converted in registers (<BFloat16>: float32 arithmetic), and where the CPU has avx512_bf16,
// bfloat16 W by vdpbf16ps (FloatToBFloat16 of x, timed with it, then SmallRowsProductBF16); and
// beside them, in the same rotation, a read-only pass over as many bytes (ReadOnly).
//
// Every call reads its W from a different place of one pool of POOL_MIB MiB that the calls walk
// through in turn, so W comes from memory as in a model's decode step (whose weights are many times
// the last-level cache), not from a cache the previous call filled. The pool's 16-bit words are
// bfloat16 values in [0.5, 1) of either sign, which read as float16 (about 1.75) and as float32 pairs
// are normal numbers too: no subnormal slows any product.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "weight_rows.h"

namespace {

using rfa::weights::BFloat16;
using rfa::weights::Half;

struct Pool {
  std::vector<uint16_t> words;
  size_t next = 0;  // in bytes
  // The next `bytes` of the pool (from its start when they no longer fit).
  const void *Take(size_t bytes) {
    if (next + bytes > words.size() * 2) next = 0;
    const void *p = reinterpret_cast<const char *>(words.data()) + next;
    next += (bytes + 4095) / 4096 * 4096;
    return p;
  }
};

template <typename Fn>
void OnThreads(int64_t n, Fn fn) {
  const int threads = omp_get_max_threads();
#pragma omp parallel for num_threads(threads) schedule(static, 1)
  for (int t = 0; t < threads; ++t) {
    int64_t n0, n1;
    rfa::weights::ThreadRows(n, threads, t, &n0, &n1);
    if (n0 < n1) fn(n0, n1);
  }
}

double Seconds(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// One product as the projection library would run it: x (m, k) float32, W (n, k) of its dtype.
struct Product {
  const char *name;
  size_t weight_bytes;
  void (*run)(int64_t m, int64_t n, int64_t k, const float *x, uint16_t *x_bf16, const void *w, float *y);
};

// The reference: W's bytes (as many as a half W's) summed as float32 vectors on the same threads,
// in the same slices, from the same pool, taking its turn between the products: what reading W
// costs on this machine at this moment, whatever the other processes on it are doing. (The pool's
// words as float32 are normal numbers: no slow arithmetic.)
void ReadOnly(int64_t, int64_t n, int64_t k, const float *, uint16_t *, const void *w, float *y) {
  OnThreads(n, [&](int64_t n0, int64_t n1) {
    const float *p = static_cast<const float *>(w) + n0 * k / 2, *end = static_cast<const float *>(w) + n1 * k / 2;
    rfa::simd::vf a = {}, b = {}, c = {}, d = {};
    constexpr int kL = rfa::simd::kLanes;
    for (; p + 4 * kL <= end; p += 4 * kL) {
      a += rfa::simd::Load(p); b += rfa::simd::Load(p + kL);
      c += rfa::simd::Load(p + 2 * kL); d += rfa::simd::Load(p + 3 * kL);
    }
    y[n0] = rfa::simd::ReduceSum((a + b) + (c + d));  // kept: the sum is an output
  });
}

template <typename W>
void ConvertingProduct(int64_t m, int64_t n, int64_t k, const float *x, uint16_t *, const void *w, float *y) {
  OnThreads(n, [&](int64_t n0, int64_t n1) {
    rfa::weights::SmallRowsProduct(m, n, k, x, static_cast<const W *>(w), y, n0, n1);
  });
}

#ifdef RFA_BF16_DOT_PRODUCT
void DotProduct(int64_t m, int64_t n, int64_t k, const float *x, uint16_t *x_bf16, const void *w, float *y) {
  rfa::weights::FloatToBFloat16(x, x_bf16, m * k);
  OnThreads(n, [&](int64_t n0, int64_t n1) {
    rfa::weights::SmallRowsProductBF16(m, n, k, x_bf16, static_cast<const BFloat16 *>(w), y, n0, n1);
  });
}
#endif

}  // namespace

int main(int argc, char **argv) {
  if (argc < 6) {
    std::fprintf(stderr, "usage: %s N K ROUNDS POOL_MIB M...\n", argv[0]);
    return 2;
  }
  const int64_t n = std::atoll(argv[1]), k = std::atoll(argv[2]);
  const int rounds = std::atoi(argv[3]);
  Pool pool;
  // At least one float32 W: POOL_MIB 0 reads the same W every call (from cache when it fits: the
  // products' arithmetic alone).
  pool.words.resize(std::max(static_cast<size_t>(std::atoll(argv[4])) << 19, static_cast<size_t>(2 * n * k)));
  uint32_t state = 12345;
  auto random = [&] { return state = state * 1664525u + 1013904223u; };
  for (auto &word : pool.words) word = static_cast<uint16_t>(0x3f00u | (random() >> 25) | ((random() >> 31) << 15));

  std::vector<Product> products = {{"read only (sum of the bytes)", 2, ReadOnly},
                                   {"float32", 4, ConvertingProduct<float>},
                                   {"float16 (F16C to float32)", 2, ConvertingProduct<Half>},
                                   {"bfloat16 (to float32)", 2, ConvertingProduct<BFloat16>}};
#ifdef RFA_BF16_DOT_PRODUCT
  if (rfa::weights::HasBF16DotProduct()) products.push_back({"bfloat16 (vdpbf16ps)", 2, DotProduct});
#endif
  for (int a = 5; a < argc; ++a) {
    const int64_t m = std::atoll(argv[a]);
    std::vector<float> x(m * k), y(m * n);
    std::vector<uint16_t> x_bf16(m * k);
    for (auto &v : x) v = static_cast<float>(static_cast<int32_t>(random())) / 2147483648.0f;
    std::vector<std::vector<double>> times(products.size());
    for (int round = -1; round < rounds; ++round) {  // round -1: warm-up (threads, first touch of y)
      for (size_t i = 0; i < products.size(); ++i) {
        const size_t p = (i + std::max(round, 0)) % products.size();
        const void *w = pool.Take(static_cast<size_t>(n * k) * products[p].weight_bytes);
        const auto start = std::chrono::steady_clock::now();
        products[p].run(m, n, k, x.data(), x_bf16.data(), w, y.data());
        const double t = Seconds(start);
        if (round >= 0) times[p].push_back(t);
      }
    }
    std::printf("{\"n\": %lld, \"k\": %lld, \"m\": %lld, \"threads\": %d, \"products\": {", (long long)n, (long long)k,
                (long long)m, omp_get_max_threads());
    for (size_t p = 0; p < products.size(); ++p) {
      std::printf("%s\"%s\": {\"weight_bytes\": %lld, \"times_s\": [", p ? ", " : "", products[p].name,
                  (long long)(n * k * products[p].weight_bytes));
      for (size_t i = 0; i < times[p].size(); ++i) std::printf("%s%.9f", i ? ", " : "", times[p][i]);
      std::printf("]}");
    }
    std::printf("}}\n");
    std::fflush(stdout);
  }
  return 0;
}
