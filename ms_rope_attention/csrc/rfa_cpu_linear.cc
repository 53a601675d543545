// y = x W^T on the CPU, as a MindSpore aot op: the projections of a transformer layer (Q/K/V/O,
// gate/up/down, the LM head) with W in Hugging Face's (out_features, in_features) layout, in
// float32 or in the checkpoint's own float16 / bfloat16 (x and y float32). The arithmetic is the
// attribute compute_dtype: "float32" (W converted exactly) or "bfloat16" (x rounded once to
// bfloat16, W bfloat16, float32 accumulation, through oneDNN: onednn_matmul.h).
//
// Why: at prefill lengths of a few hundred to a few thousand tokens, a Llama layer's time is these
// GEMMs, and MindSpore 2.10's CPU MatMul ran them at ~115-140 GFLOP/s on a 2-core AVX2 machine where
// OpenBLAS (the scipy-openblas32 wheel) ran the same shapes at ~140-160 (see docs/benchmarks.md);
// at decode a step's time is reading the weights, which half weights halve. OpenBLAS picks its own
// kernels for the running CPU; the library's own products (weight_rows.h) are built once per
// instruction set, like the attention kernel, and chosen at run time by linear.py.
//
// Entries: RfaLinear (x (..., K) float32, weight (N, K) float32/float16/bfloat16, or the uint8
// buffer RfaLinearPack wrote) -> y (..., N) float32, its compute_dtype and packed_out_features read
// once by RfaLinearInit; RfaLinearRun (the same with the attributes given: direct calls without
// MindSpore); RfaLinearPackedBytes / RfaLinearPack (a bfloat16 W reordered once, at load, into
// oneDNN's blocked layout, in the caller's buffer); RfaLinearInferShape / RfaLinearInferType (C++ infer, so
// GRAPH_MODE with a dynamic sequence length compiles once); RfaLinearLastError (the message of the
// last refused launch); RfaLinearIsa (the instruction set of this build); RfaLinearOnednn /
// RfaLinearOnednnProblem (the oneDNN bound at load, and what is wrong with it, if anything);
// RfaLinearComputeProblem (whether a compute_dtype can run here).
//
// RfaSwiGLU (x (..., K) float32, gate_weight and up_weight (F, K) of one dtype as RfaLinear's weight, or
// both packed) -> y (..., F) float32 = silu(x Wg^T) * (x Wu^T): a Llama MLP's gate and up projections and
// SwiGLU in one launch, on the same products (x rounded to bfloat16 once for both; with oneDNN the
// epilogue is the gate product's post-ops). Its entries RfaSwiGLURun / RfaSwiGLUInit / RfaSwiGLUInferShape
// / RfaSwiGLUInferType / RfaSwiGLULastError / RfaSwiGLUComputeProblem are RfaLinear's counterparts.
#include <algorithm>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <type_traits>
#include <vector>

#include <omp.h>
#include <cblas.h>  // scipy-openblas32's: every symbol carries its scipy_ prefix

#include "aot_abi.h"
#include "aot_attrs.h"
#include "bf16_probe.h"
#include "last_error.h"
#include "onednn_matmul.h"
#include "rfa_problem.h"  // rfa::ShapeText
#include "weight_rows.h"

#define RFA_EXPORT __attribute__((visibility("default")))

namespace {

using rfa::ShapeText;

// One message for the process, as the attention op keeps it: MindSpore launches on its own threads,
// and the caller reads the message from another.
rfa::LastError g_last_error("RfaLinear");

int Fail(const std::string &message) { return g_last_error.Fail(message); }

struct Gemm {
  int64_t m = 0, n = 0, k = 0;  // rows of x, out_features, in_features
};

// kPacked: a bfloat16 W reordered by RfaLinearPack into oneDNN's blocked layout (uint8 bytes).
enum class WeightType { kFloat32, kFloat16, kBFloat16, kPacked };
enum class Compute { kFloat32, kBFloat16 };

// compute_dtype's text -> Compute; "" or the message naming the attribute (and `op`, the entry asked).
std::string ParseCompute(const char *text, Compute *compute, const std::string &op = "RfaLinear") {
  const std::string value = text ? text : "(null)";
  if (value == "float32") *compute = Compute::kFloat32;
  else if (value == "bfloat16") *compute = Compute::kBFloat16;
  else if (value == "float16")
    // Measured on an AVX512-FP16 Xeon (2 cores, no AMX-FP16), 512 x 4096 x 4096: oneDNN 3.2's float16
    // matmul (brg:avx512_core_fp16) 363 GFLOP/s, float32 SGEMM 332, bfloat16 (AMX) 1299: 1.1x over
    // float32 is not worth float16's overflow of activations past 65504.
    return "compute_dtype: 'float16' is not offered by " + op + ": oneDNN 3.2's float16 matmul ran only 1.1x as fast as "
           "float32 SGEMM where measured (bfloat16: 3.9x); use 'bfloat16' (a bfloat16 weight) or 'float32'";
  else return "compute_dtype: expected 'float32' or 'bfloat16', got '" + value + "'";
  if (*compute == Compute::kBFloat16 && !rfa::onednn::Built())
    return "compute_dtype: 'bfloat16' needs oneDNN, which this build of the projection library does not have (built "
           "without the onednn-cpu-gomp wheel, which exists for x86_64 Linux only); use 'float32'";
  if (*compute == Compute::kBFloat16) {
    const std::string bound = rfa::onednn::BoundLibraryProblem(), isa = rfa::onednn::NativeBf16Problem();
    if (!bound.empty()) return "compute_dtype: 'bfloat16' cannot run: " + bound;
    if (!isa.empty()) return "compute_dtype: 'bfloat16' " + isa;
  }
  return "";
}

std::string Bf16EngineProblem();  // below, with the engines

// Checks x (..., K) float32, weight (N, K) float32/float16/bfloat16 (bfloat16 only, computing in
// bfloat16) or a packed uint8 buffer (packed_n = N >= 1; 0 for a plain weight) and y (..., N)
// float32, before any memory is touched. `weight_name`: the weight's name in the messages (RfaSwiGLU
// checks its gate_weight this way).
std::string Validate(const int *ndims, int64_t *const *shapes, const char *const *dtypes, Compute compute,
                     int64_t packed_n, Gemm *g, WeightType *type, const std::string &weight_name = "weight") {
  const std::string names[3] = {"x", weight_name, "y"};
  const std::string &wn = weight_name;
  if (!ndims || !shapes || !dtypes) return "launch: null ndims, shapes or dtypes array";
  for (int i = 0; i < 3; ++i) {
    const std::string dtype = dtypes[i] ? dtypes[i] : "none";
    if (i == 1) {
      if (dtype == "float32") *type = WeightType::kFloat32;
      else if (dtype == "float16") *type = WeightType::kFloat16;
      else if (dtype == "bfloat16") *type = WeightType::kBFloat16;
      else if (dtype == "uint8") *type = WeightType::kPacked;
      else return wn + ": expected float32, float16, bfloat16 or uint8 (packed), got " + dtype;
      const bool packed = *type == WeightType::kPacked;
      if (compute == Compute::kBFloat16 && *type != WeightType::kBFloat16 && !packed)
        return wn + ": expected bfloat16 with compute_dtype 'bfloat16' (round the weight once, at load), got " + dtype;
      if (packed && compute != Compute::kBFloat16)
        return wn + ": a packed (uint8) weight needs compute_dtype 'bfloat16'";
      if (packed_n < 0 || (packed && packed_n == 0))
        return "packed_out_features: expected the out_features the uint8 weight was packed for (>= 1), got " +
               std::to_string(packed_n);
      if (!packed && packed_n > 0)
        return wn + ": expected the uint8 buffer RfaLinearPack wrote, as packed_out_features is " +
               std::to_string(packed_n) + ", got " + dtype;
    } else if (dtype != "float32") {
      return names[i] + ": expected float32, got " + dtype;
    }
    if (ndims[i] < 0 || ndims[i] > 8 || !shapes[i])
      return names[i] + ": expected a rank 0..8 with a shape, got rank " + std::to_string(ndims[i]);
  }
  const int nx = ndims[0];
  const int64_t *x = shapes[0], *w = shapes[1], *y = shapes[2];
  if (nx < 1) return "x: expected at least 1 dimension (..., in_features), got a scalar";
  if (*type == WeightType::kPacked) {
    if (ndims[1] != 1) return wn + ": expected the 1-D uint8 buffer RfaLinearPack wrote, got " + ShapeText(ndims[1], w);
    g->n = packed_n;
    g->k = x[nx - 1];
    if (g->k < 1 || g->k > INT_MAX || g->n > INT_MAX)
      return "x: expected in_features in [1, 2^31) with a packed weight, got " + ShapeText(nx, x);
    const int64_t bytes = rfa::onednn::PackedBytes(g->n, g->k);
    if (w[0] != bytes)
      return wn + ": expected " + std::to_string(bytes) + " bytes, packed for (" + std::to_string(g->n) + ", " +
             std::to_string(g->k) + ") on this CPU, got " + ShapeText(1, w);
  } else {
    if (ndims[1] != 2) return wn + ": expected 2 dimensions (out_features, in_features), got " + ShapeText(ndims[1], w);
    g->n = w[0];
    g->k = w[1];
    if (g->n < 0 || g->k < 0) return wn + ": expected a concrete shape, got " + ShapeText(2, w);
    if (x[nx - 1] != g->k)
      return "x: expected its last dimension to be the " + wn + "'s in_features " + std::to_string(g->k) + ", got x " +
             ShapeText(nx, x) + " and " + wn + " " + ShapeText(2, w);
  }
  g->m = 1;
  for (int i = 0; i + 1 < nx; ++i) {
    if (x[i] < 0) return "x: expected a concrete shape, got " + ShapeText(nx, x);
    if (x[i] != 0 && g->m > (int64_t(1) << 62) / x[i] / std::max<int64_t>(1, std::max(g->k, g->n)))
      return "x: expected fewer than 2^62 elements in x and y, got " + ShapeText(nx, x);
    g->m *= x[i];
  }
  if (g->n > INT_MAX || g->k > INT_MAX)
    return wn + ": expected both dimensions below 2^31 (a BLAS int), got " + ShapeText(2, w);
  bool same = ndims[2] == nx && y[nx - 1] == g->n;
  for (int i = 0; same && i + 1 < nx; ++i) same = y[i] == x[i];
  if (!same) return "y: expected shape x.shape[:-1] + (out_features,), got y " + ShapeText(ndims[2], y) + " for x " +
                    ShapeText(nx, x) + " and " + wn + " " + ShapeText(ndims[1], w);
  return compute == Compute::kBFloat16 ? Bf16EngineProblem() : "";
}

// Decode-sized products: a few rows of x (one token per sequence). OpenBLAS's SGEMM ran them far
// below the memory bandwidth (x (8, 4096) by W (11008, 4096): 29 ms, where reading W once takes
// ~8 ms), so W is streamed once by weights::SmallRowsProduct, its rows split across threads.
// Measured on 2 AVX2 cores, float32 W (11008, 4096): M = 1, 2, 8 in 8.2, 12.0, 15.8 ms; at M = 16
// this ran no faster than SGEMM (40 ms), which keeps the larger float32 products.
constexpr int64_t kSmallRows = 8;

// A half W past kSmallRows rows of x, up to weights::kChunkedRowsMax: weights::ChunkedRowsProduct,
// which converts W once per call in chunks that stay in L1 (its comment has the measurements), instead
// of PanelGemm, which widens every panel of W to float32 in memory for SGEMM at each call.
constexpr int64_t kFewRowsBF16 = 4;  // bfloat16 arithmetic: see Multiply

// Prefill-sized products with a half W: panels of W's rows converted to float32 on the OpenMP
// threads and multiplied by SGEMM, which packs them as it would a float32 W. (Converting on the
// OpenMP threads lost to one thread while OpenBLAS's idle workers spun for ~0.1 s after each SGEMM;
// with them asleep (OPENBLAS_THREAD_TIMEOUT, ms_rope_attention/__init__.py) it won: x (512, 4096) by
// W (11008, 4096) or (4096, 4096) float16 ran at 0.80-0.96x float32's speed against one thread's
// 0.74-0.90x, faster in each of 8 same-process comparisons (docs/threads.md).)
// SGEMM packs x again for each panel, so fewer, larger panels cost less: 64 MB panels (a whole
// (4096, 4096) W, a third of an (11008, 4096) one) ran 1-5% faster than 32 MB ones in each of 6
// same-process comparisons (x (512, 4096 or 11008), float16 W; 128 MB gained nothing more). The
// buffer is one per launching thread, a fraction of a percent of a 7B model's half weights.
constexpr int64_t kPanelBytes = int64_t(64) << 20;

// product(n0, n1) for each thread's slice [n0, n1) of W's rows (weights::ThreadRows), on the OpenMP threads.
template <typename Product>
void OnThreadRows(int64_t n, Product product) {
  const int threads = omp_get_max_threads();
#pragma omp parallel for num_threads(threads) schedule(static, 1)
  for (int t = 0; t < threads; ++t) {
    int64_t n0, n1;
    rfa::weights::ThreadRows(n, threads, t, &n0, &n1);
    if (n0 < n1) product(n0, n1);
  }
}

// `buffer` (a thread_local of the caller's: MindSpore may launch on several threads at once) holding
// `count` values, kept between calls; in the sanitizer build (RFA_EXACT_SCRATCH) sized exactly at each
// call, so an overrun is caught.
template <typename T>
T *Scratch(std::vector<T> &buffer, int64_t count) {
#ifdef RFA_EXACT_SCRATCH
  std::vector<T>().swap(buffer);
#endif
  buffer.resize(static_cast<size_t>(count));
  return buffer.data();
}

#ifdef RFA_BF16_DOT_PRODUCT
// x (count values) rounded once to bfloat16 bits (to nearest even), in a buffer of this launching
// thread: the decode-sized products' operand.
const uint16_t *BFloat16Bits(const float *x, int64_t count) {
  thread_local std::vector<uint16_t> buffer;
  uint16_t *const bits = Scratch(buffer, count);
  rfa::weights::FloatToBFloat16(x, bits, count);
  return bits;
}
#endif

template <typename W>
void SmallRows(const Gemm &g, const float *x, const W *w, float *y) {
  OnThreadRows(g.n, [&](int64_t n0, int64_t n1) { rfa::weights::SmallRowsProduct(g.m, g.n, g.k, x, w, y, n0, n1); });
}

template <typename W>
void ChunkedRows(const Gemm &g, const float *x, const W *w, float *y) {
  OnThreadRows(g.n, [&](int64_t n0, int64_t n1) { rfa::weights::ChunkedRowsProduct(g.m, g.n, g.k, x, w, y, n0, n1); });
}

#ifdef RFA_BF16_DOT_PRODUCT
// The bfloat16 form of SmallRows: x rounded to bfloat16 once (a thread's buffer, kept between calls),
// then W's rows split across threads as there.
void SmallRowsBF16(const Gemm &g, const float *x, const rfa::weights::BFloat16 *w, float *y) {
  const uint16_t *const x_bf16 = BFloat16Bits(x, g.m * g.k);
  OnThreadRows(g.n, [&](int64_t n0, int64_t n1) {
    rfa::weights::SmallRowsProductBF16(g.m, g.n, g.k, x_bf16, w, y, n0, n1);
  });
}
#endif

// y (rows, n) = x (rows, k) P^T for a float32 panel P of `cols` rows, written at column `col` of y.
void Sgemm(const Gemm &g, const float *x, const float *panel, int64_t cols, float *y) {
  constexpr int64_t kRowsPerCall = INT_MAX;  // M is a BLAS int: larger inputs go in slices of rows
  for (int64_t r = 0; r < g.m; r += kRowsPerCall) {
    const int64_t rows = std::min(kRowsPerCall, g.m - r);
    scipy_cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<blasint>(rows), static_cast<blasint>(cols),
                      static_cast<blasint>(g.k), 1.0f, x + r * g.k, static_cast<blasint>(g.k), panel,
                      static_cast<blasint>(g.k), 0.0f, y + r * g.n, static_cast<blasint>(g.n));
  }
}

template <typename W>
void PanelGemm(const Gemm &g, const float *x, const W *w, float *y) {
  const int64_t panel_rows = std::max<int64_t>(16, kPanelBytes / 4 / g.k / 16 * 16);
  thread_local std::vector<float> panel;  // MindSpore may launch on several threads at once
  panel.resize(static_cast<size_t>(std::min(panel_rows, g.n) * g.k));
  float *const buffer = panel.data();  // this thread's: inside the parallel loop `panel` is each worker's own
  const int threads = omp_get_max_threads();
  for (int64_t n0 = 0; n0 < g.n; n0 += panel_rows) {
    const int64_t cols = std::min(panel_rows, g.n - n0);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < cols; ++r) rfa::weights::RowToFloat(w + (n0 + r) * g.k, buffer + r * g.k, g.k);
    Sgemm(g, x, buffer, cols, y + n0);
  }
}

// ---- Which units run bfloat16 arithmetic past kFewRowsBF16 rows ---------------------------------------
// The arithmetic is fixed: x rounded once to bfloat16, W bfloat16, every product exact in float32,
// float32 sums. Which units run it is a question about this CPU (bf16_probe.h). oneDNN runs it on the
// bfloat16 units (AMX tiles, or vdpbf16ps) at close to their rate: brg:avx512_core_bf16 at 97% of the
// vdpbf16ps peak, x (512, 4096) by W (4096, 4096). Where vdpbf16ps is slower than the float32 FMAs, the
// same products on the FMAs are faster (the FMA engine): x rounded and widened back into a buffer, W's
// panels widened exactly, SGEMM (PanelGemm, about 65% of the FMA peak at these shapes). So oneDNN
// wherever it runs on AMX, otherwise the probe's answer. RFA_BF16_GEMM=onednn or fma overrides the choice
// (read at each launch: the tests run both engines on every CPU); a weight packed for oneDNN always runs
// on oneDNN.
enum class Bf16Engine { kOnednn, kFma };

constexpr rfa::bf16_probe::EnvChoice kBf16GemmChoice{"RFA_BF16_GEMM", "onednn", "fma"};

std::string Bf16EngineProblem() { return kBf16GemmChoice.Problem(); }

struct Bf16Choice {
  Bf16Engine engine;
  std::string why;  // RfaLinearBf16Engine's text
};

// The process's own choice, without RFA_BF16_GEMM: made once, at the first bfloat16 launch.
const Bf16Choice &AutomaticBf16Choice() {
  static const Bf16Choice choice = []() -> Bf16Choice {
    if (rfa::onednn::UsesAmx()) return {Bf16Engine::kOnednn, "onednn: AMX"};
    const rfa::bf16_probe::Rates &rates = rfa::bf16_probe::ProcessRates();
    if (rates.dot == 0) return {Bf16Engine::kOnednn, "onednn: no vdpbf16ps in this CPU or build to probe"};
    const bool fma = rfa::bf16_probe::FmaFaster(rates);
    return {fma ? Bf16Engine::kFma : Bf16Engine::kOnednn,
            std::string(fma ? "fma" : "onednn") + ": " + rfa::bf16_probe::Describe(rates)};
  }();
  return choice;
}

Bf16Engine ChosenBf16Engine() {
  const std::string forced = kBf16GemmChoice.Value();
  if (forced == "fma") return Bf16Engine::kFma;
  if (forced == "onednn") return Bf16Engine::kOnednn;
  return AutomaticBf16Choice().engine;
}

// x (count values) rounded to bfloat16 and widened back to float32, in a buffer of this launching
// thread (Scratch): the FMA engine's operand. Rounded and widened a chunk at a time on the OpenMP threads.
const float *RoundedToBf16(const float *x, int64_t count) {
  thread_local std::vector<float> buffer;
  float *const out = Scratch(buffer, count);  // this thread's: inside the loop `buffer` is each worker's own
  constexpr int64_t kChunk = 4096;
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < count; c += kChunk) {
    uint16_t bits[kChunk];
    const int64_t len = std::min(kChunk, count - c);
    rfa::weights::FloatToBFloat16(x + c, bits, len);
    rfa::weights::RowToFloat(reinterpret_cast<const rfa::weights::BFloat16 *>(bits), out + c, len);
  }
  return out;
}

template <typename W>
void Multiply(const Gemm &g, Compute compute, const float *x, const W *w, float *y) {
  if (g.k == 0) {  // an empty sum: BLAS may leave y untouched
    std::memset(y, 0, static_cast<size_t>(g.m * g.n) * sizeof(float));
    return;
  }
  if constexpr (std::is_same_v<W, rfa::weights::BFloat16>) {
    static_assert(sizeof(W) == sizeof(uint16_t), "a bfloat16 weight is its 16 bits");
    if (compute == Compute::kBFloat16) {
#ifdef RFA_BF16_DOT_PRODUCT
      // A few rows of a weight as stored: x rounded once, W streamed into vdpbf16ps with no
      // conversion (weight_rows.h). Measured on the AMX Xeon, W (11008, 4096) from memory, same
      // process: M = 1 and 4 as fast as oneDNN on the packed W or faster (3.4 / 3.8 ms against 7.2 /
      // 4.1 ms, min), M = 16 4x slower (17.7 against 4.3: AMX). A weight packed for oneDNN (the
      // model's) takes MultiplyBf16Packed at every M.
      if (g.m <= kFewRowsBF16 && rfa::weights::HasBF16DotProduct()) {
        SmallRowsBF16(g, x, w, y);
        return;
      }
#endif
      if (ChosenBf16Engine() == Bf16Engine::kFma)
        Multiply(g, Compute::kFloat32, RoundedToBf16(x, g.m * g.k), w, y);
      else
        rfa::onednn::MultiplyBf16(g.m, g.n, g.k, x, reinterpret_cast<const uint16_t *>(w), y);
      return;
    }
  }
  constexpr bool kFloat = std::is_same_v<W, float>;
  if (g.m <= kSmallRows) {
    SmallRows(g, x, w, y);
  } else if constexpr (kFloat) {
    Sgemm(g, x, w, g.n, y);
  } else if (g.m <= rfa::weights::kChunkedRowsMax) {
    ChunkedRows(g, x, w, y);
  } else {
    PanelGemm(g, x, w, y);
  }
}

// ---- RfaSwiGLU: y = silu(x Wg^T) * (x Wu^T), a Llama MLP's gate and up projections and SwiGLU ----------

// One message for RfaSwiGLU's refusals, apart from RfaLinear's (its own LastError entry).
rfa::LastError g_swiglu_error("RfaSwiGLU");

int FailSwiGlu(const std::string &message) { return g_swiglu_error.Fail(message); }

// A float32 buffer of `count` values for the up product, this launching thread's (Scratch).
float *UpScratch(int64_t count) {
  thread_local std::vector<float> buffer;
  return Scratch(buffer, count);
}

// e^x for x <= 0, one vector: n = round(x log2 e), r = x - n ln 2 in two parts (Cody and Waite: n C1 is
// exact for |n| <= 126), e^r by its Taylor polynomial of degree 7 on |r| <= ln2 / 2 (truncation < 6e-9
// relative), times 2^n built in the exponent bits; 0 below -87.3, where e^x is below float32's smallest
// normal. Within a few float32 ulps everywhere: simd::Exp2(x log2 e) (the attention's, for arguments of
// a few units) loses up to half an ulp of x log2 e, which at x = -80 is 60 ulps of e^x. NaN stays NaN.
inline rfa::simd::vf ExpNonPositive(rfa::simd::vf x) {
  using rfa::simd::vf;
  using rfa::simd::vi;
  const vi underflow = x < -87.3f;
  x = underflow ? rfa::simd::Splat(0.0f) : x;  // replaced by 0 below; keeps n in range
  const vf shifter = rfa::simd::Splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  const vf n = (x * 1.4426950408889634f + shifter) - shifter;
  const vf r = (x - n * 0.693359375f) - n * -2.12194440e-4f;  // ln 2 = 0.693359375 - 2.12194440e-4
  vf p = rfa::simd::Splat(1.0f / 5040.f);
  p = p * r + 1.0f / 720.f;
  p = p * r + 1.0f / 120.f;
  p = p * r + 1.0f / 24.f;
  p = p * r + 1.0f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;  // n in [-126, 0]: a normal 2^n
  vf scale;
  std::memcpy(&scale, &bits, sizeof scale);
  const vf e = p * scale;
  return underflow ? rfa::simd::Splat(0.0f) : e;
}

// silu(g) * u for one vector of each: silu(g) = g * sigmoid(g) in float32, sigmoid from t = exp(-|g|)
// (t in [0, 1], so nothing overflows): 1 / (1 + t) for g >= 0, t / (1 + t) below. NaN stays NaN;
// g = -inf gives -inf * 0 = NaN, as g * sigmoid(g) does in float32, and g = +inf gives inf.
inline rfa::simd::vf SiluTimes(rfa::simd::vf g, rfa::simd::vf u) {
  using rfa::simd::vf;
  const vf magnitude = g < 0.0f ? -g : g;
  const vf t = ExpNonPositive(-magnitude);
  const vf s = 1.0f / (1.0f + t);
  const vf sigmoid = g >= 0.0f ? s : t * s;
  return g * sigmoid * u;
}

// h[i] = silu(g[i]) * u[i] for i < count (h may be g: each value is read before it is written). The
// last count % kLanes values go through the same vector code, copied into a padded vector, so every
// position computes the same function.
void SiluTimesRange(int64_t count, const float *g, const float *u, float *h) {
  constexpr int kLanes = rfa::simd::kLanes;
  int64_t i = 0;
  for (; i + kLanes <= count; i += kLanes)
    rfa::simd::Store(h + i, SiluTimes(rfa::simd::Load(g + i), rfa::simd::Load(u + i)));
  if (i < count) {
    float a[kLanes] = {}, b[kLanes] = {}, c[kLanes];
    const size_t rest = static_cast<size_t>(count - i) * sizeof(float);
    std::memcpy(a, g + i, rest);
    std::memcpy(b, u + i, rest);
    rfa::simd::Store(c, SiluTimes(rfa::simd::Load(a), rfa::simd::Load(b)));
    std::memcpy(h + i, c, rest);
  }
}

// The epilogue over m x n values as its own pass, on the OpenMP threads in blocks of 16 KB of y.
void SiluTimesParallel(int64_t count, const float *g, const float *u, float *h) {
  constexpr int64_t kBlock = 4096;
  const int64_t blocks = (count + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t start = b * kBlock;
    SiluTimesRange(std::min(kBlock, count - start), g + start, u + start, h + start);
  }
}

#ifdef RFA_BF16_DOT_PRODUCT
// Decode-sized rows in bfloat16 (SmallRowsBF16's product for both weights): x rounded once, then each
// thread its slice of W's rows, gate into y and up into the buffer, then silu(g) * u on that slice while
// it is in cache: the one epilogue loop, no pass of its own.
void SwiGluSmallRowsBF16(const Gemm &g, const float *x, const rfa::weights::BFloat16 *gate,
                         const rfa::weights::BFloat16 *up, float *y) {
  const uint16_t *const x_bf16 = BFloat16Bits(x, g.m * g.k);
  float *const u = UpScratch(g.m * g.n);
  OnThreadRows(g.n, [&](int64_t n0, int64_t n1) {
    rfa::weights::SmallRowsProductBF16(g.m, g.n, g.k, x_bf16, gate, y, n0, n1);
    rfa::weights::SmallRowsProductBF16(g.m, g.n, g.k, x_bf16, up, u, n0, n1);
    for (int64_t i = 0; i < g.m; ++i) SiluTimesRange(n1 - n0, y + i * g.n + n0, u + i * g.n + n0, y + i * g.n + n0);
  });
}
#endif

// y = silu(x Wg^T) * (x Wu^T) for weights as stored (m, n, k >= 1). bfloat16 arithmetic: up to
// kFewRowsBF16 rows stream both weights into vdpbf16ps (SwiGluSmallRowsBF16), more take oneDNN with the
// epilogue as the gate product's post-ops (onednn::SwiGluBf16), or the FMA engine (ChosenBf16Engine: the
// float32 path below on the rounded x); x is rounded once either way. float32
// arithmetic: RfaLinear's products for this weight dtype (Multiply), gate into y and up into the buffer,
// then the epilogue as a pass of its own.
template <typename W>
void SwiGlu(const Gemm &g, Compute compute, const float *x, const W *gate, const W *up, float *y) {
  if constexpr (std::is_same_v<W, rfa::weights::BFloat16>) {
    if (compute == Compute::kBFloat16) {
#ifdef RFA_BF16_DOT_PRODUCT
      if (g.m <= kFewRowsBF16 && rfa::weights::HasBF16DotProduct()) {
        SwiGluSmallRowsBF16(g, x, gate, up, y);
        return;
      }
#endif
      if (ChosenBf16Engine() == Bf16Engine::kOnednn) {
        rfa::onednn::SwiGluBf16(g.m, g.n, g.k, x, reinterpret_cast<const uint16_t *>(gate),
                                reinterpret_cast<const uint16_t *>(up), y);
        return;
      }
      x = RoundedToBf16(x, g.m * g.k);  // the FMA engine: float32 products of the rounded x, as below
      compute = Compute::kFloat32;
    }
  }
  float *const u = UpScratch(g.m * g.n);
  Multiply(g, compute, x, gate, y);
  Multiply(g, compute, x, up, u);
  SiluTimesParallel(g.m * g.n, y, u, y);
}

}  // namespace

// Copied under the lock into this thread's own string (see RotaryFlashAttentionLastError).
extern "C" RFA_EXPORT const char *RfaLinearLastError() { return g_last_error.Read(); }

extern "C" RFA_EXPORT const char *RfaLinearIsa() { return rfa::simd::kIsa; }

// The oneDNN this library is bound to ("" when built without it), and "" or what is wrong with it:
// linear.py refuses the library at load on the latter. Kept per thread like the last error.
extern "C" RFA_EXPORT const char *RfaLinearOnednn() {
  thread_local std::string text;
  text = rfa::onednn::BoundLibrary();
  return text.c_str();
}

extern "C" RFA_EXPORT const char *RfaLinearOnednnProblem() {
  thread_local std::string text;
  text = rfa::onednn::BoundLibraryProblem();
  return text.c_str();
}

// Which units run this process's bfloat16 products past a few rows, and why: "onednn: ...", "fma: ..."
// (ChosenBf16Engine). Kept per thread like the last error.
extern "C" RFA_EXPORT const char *RfaLinearBf16Engine() {
  thread_local std::string text;
  const std::string forced = kBf16GemmChoice.Value();
  if (forced == "?") text = Bf16EngineProblem();
  else if (!forced.empty()) text = forced + ": RFA_BF16_GEMM=" + forced;
  else text = AutomaticBf16Choice().why;
  return text.c_str();
}

// "" when this library computes in `compute_dtype`, else why not (linear_op refuses it up front).
extern "C" RFA_EXPORT const char *RfaLinearComputeProblem(const char *compute_dtype) {
  thread_local std::string text;
  Compute compute;
  text = ParseCompute(compute_dtype, &compute);
  return text.c_str();
}

// y's shape: x.shape[:-1] + (out_features,); -1 stays -1 (dynamic dimensions).
extern "C" RFA_EXPORT std::vector<int64_t> RfaLinearInferShape(int *ndims, int64_t **shapes, mindspore::AotExtra *extra) {
  std::vector<int64_t> out(shapes[0], shapes[0] + ndims[0]);
  std::string compute_dtype;
  int64_t packed_out_features = 0;
  if (extra) rfa::ReadLinearAttrs(extra, &compute_dtype, &packed_out_features);
  if (!out.empty() && ndims[1] == 2) out.back() = shapes[1][0];
  if (!out.empty() && ndims[1] == 1 && packed_out_features > 0) out.back() = packed_out_features;  // a packed W
  return out;
}

extern "C" RFA_EXPORT TypeId RfaLinearInferType(std::vector<TypeId> inputs, mindspore::AotExtra *) { return inputs[0]; }

// What RfaLinearInit keeps for the launches of one kernel instance: the compute_dtype attribute.
struct LinearAttrs : mindspore::AotKernelData {
  std::string compute_dtype = "float32";
  int64_t packed_out_features = 0;  // 0: W as stored; N: a uint8 buffer RfaLinearPack wrote for (N, K)
};

extern "C" RFA_EXPORT int RfaLinearInit(int *, int64_t **, const char **, mindspore::AotExtra *extra) {
  auto *data = new LinearAttrs;
  rfa::ReadLinearAttrs(extra, &data->compute_dtype, &data->packed_out_features);
  extra->SetKernelData(data);
  return 0;
}

// Bytes of a bfloat16 (out_features, in_features) W packed by RfaLinearPack on this CPU; -1 (the
// reason in RfaLinearLastError) when this library cannot pack (no oneDNN, no bfloat16 instructions)
// or a dimension is outside [1, 2^31).
extern "C" RFA_EXPORT int64_t RfaLinearPackedBytes(int64_t out_features, int64_t in_features) {
  try {
    Compute compute;
    const std::string err = ParseCompute("bfloat16", &compute);
    if (!err.empty()) return Fail(err), -1;
    if (out_features < 1 || out_features > INT_MAX)
      return Fail("out_features: expected [1, 2^31), got " + std::to_string(out_features)), -1;
    if (in_features < 1 || in_features > INT_MAX)
      return Fail("in_features: expected [1, 2^31), got " + std::to_string(in_features)), -1;
    return rfa::onednn::PackedBytes(out_features, in_features);
  } catch (const std::exception &e) {
    return Fail(e.what()), -1;
  }
}

// Packs weight (N, K) bfloat16 into packed (RfaLinearPackedBytes(N, K),) uint8 (aot convention,
// nparam 2): the caller's buffer, so the model keeps this copy in place of the checkpoint's.
extern "C" RFA_EXPORT int RfaLinearPack(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes) {
  try {
    if (nparam != 2 || !params || !ndims || !shapes || !dtypes)
      return Fail("pack: expected 2 params (weight, packed) with their ndims, shapes and dtypes");
    const std::string wtype = dtypes[0] ? dtypes[0] : "none", ptype = dtypes[1] ? dtypes[1] : "none";
    if (wtype != "bfloat16") return Fail("weight: expected bfloat16, got " + wtype);
    if (ndims[0] != 2 || !shapes[0]) return Fail("weight: expected 2 dimensions (out_features, in_features)");
    const int64_t n = shapes[0][0], k = shapes[0][1];
    const int64_t bytes = RfaLinearPackedBytes(n, k);
    if (bytes < 0) return 1;  // the reason is recorded
    if (ptype != "uint8") return Fail("packed: expected uint8, got " + ptype);
    if (ndims[1] != 1 || !shapes[1] || shapes[1][0] != bytes)
      return Fail("packed: expected shape (" + std::to_string(bytes) + ",) for weight " + ShapeText(2, shapes[0]) +
                  ", got " + (shapes[1] ? ShapeText(ndims[1], shapes[1]) : std::string("none")));
    if (!params[0] || !params[1]) return Fail("pack: null data pointer");
    rfa::onednn::Pack(n, k, static_cast<const uint16_t *>(params[0]), params[1]);
    return 0;
  } catch (const std::exception &e) {
    return Fail(e.what());
  }
}

// Validates everything (compute_dtype, dtypes, shapes, data pointers), then multiplies. The
// MindSpore entry below and ms_rope_attention.linear.multiply (no MindSpore) call it.
extern "C" RFA_EXPORT int RfaLinearRun(const char *compute_dtype, int64_t packed_out_features, int nparam,
                                       void **params, int *ndims, int64_t **shapes, const char **dtypes) {
  try {
    Compute compute = Compute::kFloat32;
    std::string err = ParseCompute(compute_dtype, &compute);
    if (!err.empty()) return Fail(err);
    if (nparam != 3) return Fail("expected 2 inputs (x, weight) and 1 output, got " + std::to_string(nparam) + " params");
    if (!params) return Fail("launch: null params array");
    Gemm g;
    WeightType type = WeightType::kFloat32;
    err = Validate(ndims, shapes, dtypes, compute, packed_out_features, &g, &type);
    if (!err.empty()) return Fail(err);
    const char *names[3] = {"x", "weight", "y"};
    const bool has_elements[3] = {g.m > 0 && g.k > 0, (g.n > 0 && g.k > 0) || type == WeightType::kPacked,
                                  g.m > 0 && g.n > 0};
    for (int i = 0; i < 3; ++i)
      if (has_elements[i] && !params[i]) return Fail(std::string(names[i]) + ": null data pointer");
    if (type == WeightType::kPacked) {  // its trailer, read before anything is written
      err = rfa::onednn::PackedProblem(g.n, g.k, params[1]);
      if (!err.empty()) return Fail(err);
    }
    if (g.m > 0 && g.n > 0) {
      const auto *x = static_cast<const float *>(params[0]);
      auto *y = static_cast<float *>(params[2]);
      if (type == WeightType::kPacked)  // k >= 1 (Validate)
        rfa::onednn::MultiplyBf16Packed(g.m, g.n, g.k, x, params[1], y);
      else if (type == WeightType::kFloat16)
        Multiply(g, compute, x, static_cast<const rfa::weights::Half *>(params[1]), y);
      else if (type == WeightType::kBFloat16)
        Multiply(g, compute, x, static_cast<const rfa::weights::BFloat16 *>(params[1]), y);
      else
        Multiply(g, compute, x, static_cast<const float *>(params[1]), y);
    }
    return 0;
  } catch (const std::bad_alloc &) {
    return Fail("out of memory for the bfloat16 copy of x");
  } catch (const std::exception &e) {
    return Fail(e.what());
  }
}

// MindSpore's launch: compute_dtype as RfaLinearInit read it. A null `extra` (a direct call
// through the aot convention, as tests make it) takes the contract's default, float32.
extern "C" RFA_EXPORT int RfaLinear(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *,
                                    void *extra) {
  const LinearAttrs defaults;
  const LinearAttrs *data = rfa::LaunchAttrs(extra, defaults);
  if (!data) return Fail("kernel attributes missing (RfaLinearInit did not run)");
  return RfaLinearRun(data->compute_dtype.c_str(), data->packed_out_features, nparam, params, ndims, shapes, dtypes);
}

// ---- RfaSwiGLU's entries -------------------------------------------------------------------------

extern "C" RFA_EXPORT const char *RfaSwiGLULastError() { return g_swiglu_error.Read(); }

// "" when RfaSwiGLU computes in `compute_dtype` here, else why not (swiglu_op refuses it up front).
extern "C" RFA_EXPORT const char *RfaSwiGLUComputeProblem(const char *compute_dtype) {
  thread_local std::string text;
  Compute compute;
  text = ParseCompute(compute_dtype, &compute, "RfaSwiGLU");
  return text.c_str();
}

// y's shape: x.shape[:-1] + (out_features,), out_features gate_weight's rows or packed_out_features.
extern "C" RFA_EXPORT std::vector<int64_t> RfaSwiGLUInferShape(int *ndims, int64_t **shapes,
                                                                mindspore::AotExtra *extra) {
  return RfaLinearInferShape(ndims, shapes, extra);  // x and gate_weight are inputs 0 and 1, as x and weight
}

extern "C" RFA_EXPORT TypeId RfaSwiGLUInferType(std::vector<TypeId> inputs, mindspore::AotExtra *) { return inputs[0]; }

extern "C" RFA_EXPORT int RfaSwiGLUInit(int *ndims, int64_t **shapes, const char **dtypes, mindspore::AotExtra *extra) {
  return RfaLinearInit(ndims, shapes, dtypes, extra);  // the same two attributes
}

// Validates everything (compute_dtype; x, gate_weight and y as RfaLinear checks x, weight and y;
// up_weight the same dtype and shape as gate_weight; data pointers; both packed buffers' trailers),
// then computes. The MindSpore entry below and linear.multiply_swiglu (no MindSpore) call it.
extern "C" RFA_EXPORT int RfaSwiGLURun(const char *compute_dtype, int64_t packed_out_features, int nparam,
                                       void **params, int *ndims, int64_t **shapes, const char **dtypes) {
  try {
    Compute compute = Compute::kFloat32;
    std::string err = ParseCompute(compute_dtype, &compute, "RfaSwiGLU");
    if (!err.empty()) return FailSwiGlu(err);
    if (nparam != 4)
      return FailSwiGlu("expected 3 inputs (x, gate_weight, up_weight) and 1 output, got " + std::to_string(nparam) +
                        " params");
    if (!params) return FailSwiGlu("launch: null params array");
    if (!ndims || !shapes || !dtypes) return FailSwiGlu("launch: null ndims, shapes or dtypes array");
    int tensor_ndims[3] = {ndims[0], ndims[1], ndims[3]};
    int64_t *tensor_shapes[3] = {shapes[0], shapes[1], shapes[3]};
    const char *tensor_dtypes[3] = {dtypes[0], dtypes[1], dtypes[3]};
    Gemm g;
    WeightType type = WeightType::kFloat32;
    err = Validate(tensor_ndims, tensor_shapes, tensor_dtypes, compute, packed_out_features, &g, &type, "gate_weight");
    if (!err.empty()) return FailSwiGlu(err);
    const std::string gate_dtype = dtypes[1], up_dtype = dtypes[2] ? dtypes[2] : "none";  // dtypes[1]: Validate
    if (up_dtype != gate_dtype)
      return FailSwiGlu("up_weight: expected gate_weight's dtype " + gate_dtype + ", got " + up_dtype);
    const std::string gate_shape = ShapeText(ndims[1], shapes[1]);
    bool same = ndims[2] == ndims[1] && shapes[2];
    for (int i = 0; same && i < ndims[1]; ++i) same = shapes[2][i] == shapes[1][i];
    if (!same)
      return FailSwiGlu("up_weight: expected gate_weight's shape " + gate_shape + ", got " +
                        (ndims[2] >= 0 && ndims[2] <= 8 && shapes[2] ? ShapeText(ndims[2], shapes[2])
                                                                     : "rank " + std::to_string(ndims[2])));
    const bool packed = type == WeightType::kPacked;
    const char *names[4] = {"x", "gate_weight", "up_weight", "y"};
    const bool has_elements[4] = {g.m > 0 && g.k > 0, (g.n > 0 && g.k > 0) || packed, (g.n > 0 && g.k > 0) || packed,
                                  g.m > 0 && g.n > 0};
    for (int i = 0; i < 4; ++i)
      if (has_elements[i] && !params[i]) return FailSwiGlu(std::string(names[i]) + ": null data pointer");
    if (packed) {  // both trailers, read before anything is written
      for (int i = 1; i <= 2; ++i) {
        err = rfa::onednn::PackedProblem(g.n, g.k, params[i], names[i]);
        if (!err.empty()) return FailSwiGlu(err);
      }
    }
    if (g.m == 0 || g.n == 0) return 0;
    const auto *x = static_cast<const float *>(params[0]);
    auto *y = static_cast<float *>(params[3]);
    if (g.k == 0) {  // empty sums: g = u = 0, and silu(0) * 0 = 0
      std::memset(y, 0, static_cast<size_t>(g.m * g.n) * sizeof(float));
      return 0;
    }
    if (packed)  // k >= 1 (Validate)
      rfa::onednn::SwiGluBf16Packed(g.m, g.n, g.k, x, params[1], params[2], y);
    else if (type == WeightType::kFloat16)
      SwiGlu(g, compute, x, static_cast<const rfa::weights::Half *>(params[1]),
             static_cast<const rfa::weights::Half *>(params[2]), y);
    else if (type == WeightType::kBFloat16)
      SwiGlu(g, compute, x, static_cast<const rfa::weights::BFloat16 *>(params[1]),
             static_cast<const rfa::weights::BFloat16 *>(params[2]), y);
    else
      SwiGlu(g, compute, x, static_cast<const float *>(params[1]), static_cast<const float *>(params[2]), y);
    return 0;
  } catch (const std::bad_alloc &) {
    return FailSwiGlu("out of memory for the bfloat16 copy of x or the up product's buffer");
  } catch (const std::exception &e) {
    return FailSwiGlu(e.what());
  }
}

// MindSpore's launch: the attributes as RfaSwiGLUInit read them; a null `extra` (a direct call through
// the aot convention) takes the contract's defaults.
extern "C" RFA_EXPORT int RfaSwiGLU(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *,
                                    void *extra) {
  const LinearAttrs defaults;
  const LinearAttrs *data = rfa::LaunchAttrs(extra, defaults);
  if (!data) return FailSwiGlu("kernel attributes missing (RfaSwiGLUInit did not run)");
  return RfaSwiGLURun(data->compute_dtype.c_str(), data->packed_out_features, nparam, params, ndims, shapes, dtypes);
}
