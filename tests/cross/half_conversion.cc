// simd::HalfVector (the kernels' float16 -> float32 conversion, read in registers from a float16 KV
// cache) against a conversion written here from the IEEE binary16 definition, for all 65536 bit
// patterns: zeros, subnormals, normals, infinities and NaNs. Built once per instruction set by
// tests/test_cross_builds.py (the portable x86-64 build looks values up in a table built with integer
// vector ops, the others convert with F16C / AVX-512 / aarch64 instructions). Exit status 0 when
// every pattern agrees.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>

#include "simd.h"

namespace {

// value = (-1)^s * 2^(e-15) * (1 + m/1024), or 2^-14 * m/1024 when e == 0; e == 31 is inf / NaN.
float Reference(uint16_t bits) {
  const int s = bits >> 15, e = (bits >> 10) & 31, m = bits & 1023;
  double magnitude;
  if (e == 31)
    magnitude = m ? NAN : INFINITY;
  else if (e == 0)
    magnitude = std::ldexp(m / 1024.0, -14);
  else
    magnitude = std::ldexp(1.0 + m / 1024.0, e - 15);
  return static_cast<float>(s ? -magnitude : magnitude);
}

// Every pattern through HalfVector: the number that differ.
int Check() {
  constexpr int N = rfa::simd::kLanes;
  int failed = 0;
  for (uint32_t start = 0; start < 65536; start += N) {
    uint16_t bits[N];
    for (int i = 0; i < N; ++i) bits[i] = static_cast<uint16_t>(start + i);
    rfa::simd::Half halves[N];
    std::memcpy(halves, bits, sizeof bits);
    float got[N];
    rfa::simd::Store(got, rfa::simd::HalfVector(halves));
    for (int i = 0; i < N; ++i) {
      const float want = Reference(bits[i]);
      const bool same = std::isnan(want) ? std::isnan(got[i]) : std::memcmp(&want, &got[i], 4) == 0;
      if (!same && failed++ < 10) std::printf("0x%04x: got %a, expected %a\n", bits[i], got[i], want);
    }
  }
  return failed;
}

}  // namespace

int main() {
  const int failed = Check();
  std::printf("%s: %d of 65536 float16 patterns differ\n", rfa::simd::kIsa, failed);
  return failed != 0;
}
