// weights::SmallRowsProduct (the projection library's decode-sized product, csrc/weight_rows.h) with
// W in float32, float16 and bfloat16 against a float64 product of the same weights, over shapes whose
// K and N are off the vector width and the block of four rows; and weights::RowToFloat for all 65536
// bfloat16 bit patterns against the definition (the bits in the high half of a float32); each row of x
// alone gives the batch's bits, and weights::ChunkedRowsProduct gives SmallRowsProduct's. Built once
// per instruction set, and for aarch64 under qemu, by tests/test_cross_builds.py. Exit status 0 when
// every case agrees.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "weight_rows.h"

namespace {

using rfa::weights::BFloat16;
using rfa::weights::Half;

// A deterministic value in [-1, 1), exactly representable in all three weight types (a multiple of 2^-6).
float Value(uint32_t i) { return static_cast<float>(static_cast<int>((i * 2654435761u) >> 25) - 64) / 64.0f; }

template <typename W>
W Store(float v);
template <>
float Store<float>(float v) { return v; }
template <>
Half Store<Half>(float v) { return static_cast<Half>(v); }
template <>
BFloat16 Store<BFloat16>(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  return BFloat16{static_cast<uint16_t>(bits >> 16)};  // exact: v has few mantissa bits
}

template <typename W>
int CheckProduct(int64_t m, int64_t n, int64_t k) {
  std::vector<float> x(m * k), w32(n * k), y(m * n, NAN);
  std::vector<W> w(n * k);
  for (int64_t i = 0; i < m * k; ++i) x[i] = Value(static_cast<uint32_t>(i + 7));
  for (int64_t i = 0; i < n * k; ++i) {
    w32[i] = Value(static_cast<uint32_t>(3 * i + 1));
    w[i] = Store<W>(w32[i]);
  }
  rfa::weights::SmallRowsProduct(m, n, k, x.data(), w.data(), y.data(), 0, n);
  int failed = 0;
  for (int64_t i = 0; i < m; ++i)
    for (int64_t r = 0; r < n; ++r) {
      double want = 0, bound = 0;
      for (int64_t j = 0; j < k; ++j) {
        want += static_cast<double>(x[i * k + j]) * w32[r * k + j];
        bound += std::fabs(static_cast<double>(x[i * k + j]) * w32[r * k + j]);
      }
      if (!(std::fabs(y[i * n + r] - want) <= 1e-6 * bound + 1e-7) && failed++ < 5)
        std::printf("m %lld n %lld k %lld: y[%lld, %lld] = %g, expected %g\n", (long long)m, (long long)n,
                    (long long)k, (long long)i, (long long)r, y[i * n + r], want);
    }
  // Each row of x alone gives the same bits as in the batch (every sum in the same order, whatever
  // rows of x share a pass over W), on an x of full mantissas, whose sums round.
  for (int64_t i = 0; i < m * k; ++i) x[i] = (x[i] + Value(static_cast<uint32_t>(5 * i + 2)) / 97.0f) / 3.0f;
  rfa::weights::SmallRowsProduct(m, n, k, x.data(), w.data(), y.data(), 0, n);
  std::vector<float> row(n);
  for (int64_t i = 0; i < m; ++i) {
    rfa::weights::SmallRowsProduct(1, n, k, x.data() + i * k, w.data(), row.data(), 0, n);
    if (std::memcmp(row.data(), y.data() + i * n, n * sizeof(float)) != 0 && failed++ < 5)
      std::printf("m %lld n %lld k %lld: row %lld alone differs from the batch's\n", (long long)m, (long long)n,
                  (long long)k, (long long)i);
  }
  // The chunked product (up to kChunkedRowsMax rows) gives the same bits as SmallRowsProduct.
  if (m <= rfa::weights::kChunkedRowsMax) {
    std::vector<float> chunked(m * n, NAN);
    rfa::weights::ChunkedRowsProduct(m, n, k, x.data(), w.data(), chunked.data(), 0, n);
    if (std::memcmp(chunked.data(), y.data(), m * n * sizeof(float)) != 0 && failed++ < 5)
      std::printf("m %lld n %lld k %lld: the chunked product differs from SmallRowsProduct\n", (long long)m,
                  (long long)n, (long long)k);
  }
  return failed != 0;
}

int CheckBFloat16Patterns() {
  std::vector<BFloat16> src(65536);
  std::vector<float> got(65536);
  for (uint32_t i = 0; i < 65536; ++i) src[i].bits = static_cast<uint16_t>(i);
  volatile int64_t count = 65536;  // a run-time length: GCC misjudges the scalar tail of a constant one
  rfa::weights::RowToFloat(src.data(), got.data(), count);
  int failed = 0;
  for (uint32_t i = 0; i < 65536; ++i) {
    const uint32_t want = i << 16;
    uint32_t bits;
    std::memcpy(&bits, &got[i], 4);
    if (bits != want) ++failed;
  }
  return failed;
}

}  // namespace

int main() {
  const int64_t shapes[][3] = {{1, 1, 1}, {1, 7, 40}, {2, 9, 72}, {3, 13, 33}, {8, 4, 4099}, {16, 11, 129}, {5, 3, 17},
                               {35, 9, 700}, {64, 6, 263}};
  int failed = 0, cases = 0;
  for (const auto &s : shapes) {
    failed += CheckProduct<float>(s[0], s[1], s[2]);
    failed += CheckProduct<Half>(s[0], s[1], s[2]);
    failed += CheckProduct<BFloat16>(s[0], s[1], s[2]);
    cases += 3;
  }
  const int patterns = CheckBFloat16Patterns();
  std::printf("%s: %d of %d product cases failed, %d of 65536 bfloat16 patterns differ\n", rfa::simd::kIsa, failed,
              cases, patterns);
  return failed != 0 || patterns != 0;
}
