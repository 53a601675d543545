// weights::SmallRowsProductBF16 and weights::FloatToBFloat16 (ms_rope_attention/csrc/weight_rows.h)
// behind a C ABI, for tests/test_small_rows_bf16.py to call through ctypes: compiled by the test with
// the projection library's AVX-512 flags and nothing else (the header's target attribute adds
// avx512bf16 to the product alone).
#include <cstdint>

#include "weight_rows.h"

#ifndef RFA_BF16_DOT_PRODUCT
#error "compile with the AVX-512 build's flags: weight_rows.h has no bfloat16 product without them"
#endif

extern "C" {

int HasBF16DotProduct() { return rfa::weights::HasBF16DotProduct(); }

void SmallRowsProductBF16(int64_t m, int64_t n, int64_t k, const uint16_t *x_bf16, const uint16_t *w, float *y,
                          int64_t n0, int64_t n1) {
  rfa::weights::SmallRowsProductBF16(m, n, k, x_bf16, reinterpret_cast<const rfa::weights::BFloat16 *>(w), y, n0, n1);
}

void FloatToBFloat16(const float *src, uint16_t *dst, int64_t n) { rfa::weights::FloatToBFloat16(src, dst, n); }

}  // extern "C"
