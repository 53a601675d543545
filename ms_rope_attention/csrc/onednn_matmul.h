// The projections' bfloat16 product through oneDNN's matmul primitive: y (m, n) float32 =
// bf16(x) (m, k) W^T, W (n, k) bfloat16 as the checkpoint stores it, float32 accumulation.
//
// Why oneDNN: it runs this product on the CPU's bfloat16 units (AMX tiles, or avx512_core_bf16's
// dot products on Zen 4) at close to their peak, which no BLAS wheel on PyPI offers; the library's
// own products stay for float32 arithmetic. The library is a private copy of the onednn-cpu-gomp
// wheel's, renamed (libdnnl_rfa.so.3), because MindSpore maps its own oneDNN under the same SONAME
// (setup.py says how it is built, linear.py checks what was bound). Built without it
// (RFA_WITH_ONEDNN undefined: not x86_64, or no wheel at build time), Built() is false and the
// caller refuses the bfloat16 arithmetic.
#pragma once
#include <cstdint>
#include <string>

namespace rfa {
namespace onednn {

// Whether this build of the projection library has oneDNN.
bool Built();

// The oneDNN library bound at load, as it reports itself: "oneDNN 3.2.0 (OpenMP runtime)"; "" when
// not built with it.
std::string BoundLibrary();

// "" when the bound library is the one this build was made for (3.2.x, OpenMP runtime, i.e. the
// private copy) or none was built in; otherwise what was found instead. A wrong binding computes
// right answers slowly (MindSpore's copy: one thread), so it is refused, never run.
std::string BoundLibraryProblem();

// "" when oneDNN runs bfloat16 products on this CPU's own bfloat16 instructions (AVX512-BF16 or
// AMX-BF16, within ONEDNN_MAX_CPU_ISA); otherwise what it found. Without them oneDNN would emulate
// them, slower than the float32 arithmetic: refused, never run silently (as compute.py does).
std::string NativeBf16Problem();

// Whether oneDNN runs bfloat16 products on AMX tiles here (its effective ISA, within ONEDNN_MAX_CPU_ISA).
bool UsesAmx();

// y = round_to_nearest_even_bf16(x) W^T for x (m, k) float32, w (n, k) bfloat16 bits, y (m, n)
// float32, all row-major and dense; m, n, k >= 1. x is rounded once into a buffer of this thread;
// the primitive comes from oneDNN's own cache (bounded, thread-safe) keyed by the shapes. Throws
// dnnl::error (a std::exception) when oneDNN fails.
void MultiplyBf16(int64_t m, int64_t n, int64_t k, const float *x, const uint16_t *w, float *y);

// W reordered once into the blocked layout oneDNN's matmul picks for it on this CPU (a copy made at
// load, in place of the checkpoint's: measured 5-15% faster at M = 512 and 2048 on AMX, ~1.5x at
// M = 1..16; benchmarks/onednn_layout.cc). The layout belongs to this CPU and oneDNN build: packed
// in the process that runs it, never stored. n, k >= 1. The buffer is up to 63 bytes of slack (so the
// layout starts 64-byte aligned where it was packed: pack into the memory it will run from), oneDNN's
// layout, a 64-byte trailer (what it was packed for).
constexpr int64_t kPackedTrailerBytes = 64, kPackedSlackBytes = 64;
int64_t PackedBytes(int64_t n, int64_t k);
void Pack(int64_t n, int64_t k, const uint16_t *w, void *packed);  // packed: PackedBytes(n, k) bytes
// "" when `packed` (PackedBytes(n, k) bytes) was packed for (n, k) in this CPU's layout; else why not,
// naming the argument `name`.
std::string PackedProblem(int64_t n, int64_t k, const void *packed, const std::string &name = "weight");
void MultiplyBf16Packed(int64_t m, int64_t n, int64_t k, const float *x, const void *packed, float *y);

// A Llama MLP's gate and up products and SwiGLU: y (m, n) = silu(g) * u for g = bf16(x) Wg^T and
// u = bf16(x) Wu^T, silu(g) = g * sigmoid(g). x is rounded once, for both products; u goes into a float32
// buffer of this thread (m x n, kept between calls like x's); then g is computed with oneDNN's post-ops
// eltwise swish (alpha 1) and binary mul by u, so the epilogue runs on the accumulators, not as a pass
// of its own over memory. The weights as for MultiplyBf16 (both as stored) or MultiplyBf16Packed (both
// packed for (n, k)); m, n, k >= 1.
void SwiGluBf16(int64_t m, int64_t n, int64_t k, const float *x, const uint16_t *gate, const uint16_t *up, float *y);
void SwiGluBf16Packed(int64_t m, int64_t n, int64_t k, const float *x, const void *gate, const void *up, float *y);

}  // namespace onednn
}  // namespace rfa
