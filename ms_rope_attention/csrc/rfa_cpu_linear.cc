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
#include <algorithm>
#include <climits>
#include <cstring>
#include <exception>
#include <string>
#include <type_traits>
#include <vector>

#include <omp.h>
#include <cblas.h>  // scipy-openblas32's: every symbol carries its scipy_ prefix

#include "aot_abi.h"
#include "aot_attrs.h"
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

// compute_dtype's text -> Compute; "" or the message naming the attribute.
std::string ParseCompute(const char *text, Compute *compute) {
  const std::string value = text ? text : "(null)";
  if (value == "float32") *compute = Compute::kFloat32;
  else if (value == "bfloat16") *compute = Compute::kBFloat16;
  else if (value == "float16")
    // Measured on an AVX512-FP16 Xeon (2 cores, no AMX-FP16), 512 x 4096 x 4096: oneDNN 3.2's float16
    // matmul (brg:avx512_core_fp16) 363 GFLOP/s, float32 SGEMM 332, bfloat16 (AMX) 1299: 1.1x over
    // float32 is not worth float16's overflow of activations past 65504.
    return "compute_dtype: 'float16' is not offered by RfaLinear: oneDNN 3.2's float16 matmul ran only 1.1x as fast as "
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

// Checks x (..., K) float32, weight (N, K) float32/float16/bfloat16 (bfloat16 only, computing in
// bfloat16) or a packed uint8 buffer (packed_n = N >= 1; 0 for a plain weight) and y (..., N)
// float32, before any memory is touched.
std::string Validate(const int *ndims, int64_t *const *shapes, const char *const *dtypes, Compute compute,
                     int64_t packed_n, Gemm *g, WeightType *type) {
  const char *names[3] = {"x", "weight", "y"};
  if (!ndims || !shapes || !dtypes) return "launch: null ndims, shapes or dtypes array";
  for (int i = 0; i < 3; ++i) {
    const std::string dtype = dtypes[i] ? dtypes[i] : "none";
    if (i == 1) {
      if (dtype == "float32") *type = WeightType::kFloat32;
      else if (dtype == "float16") *type = WeightType::kFloat16;
      else if (dtype == "bfloat16") *type = WeightType::kBFloat16;
      else if (dtype == "uint8") *type = WeightType::kPacked;
      else return "weight: expected float32, float16, bfloat16 or uint8 (packed), got " + dtype;
      const bool packed = *type == WeightType::kPacked;
      if (compute == Compute::kBFloat16 && *type != WeightType::kBFloat16 && !packed)
        return "weight: expected bfloat16 with compute_dtype 'bfloat16' (round the weight once, at load), got " + dtype;
      if (packed && compute != Compute::kBFloat16)
        return "weight: a packed (uint8) weight needs compute_dtype 'bfloat16'";
      if (packed_n < 0 || (packed && packed_n == 0))
        return "packed_out_features: expected the out_features the uint8 weight was packed for (>= 1), got " +
               std::to_string(packed_n);
      if (!packed && packed_n > 0)
        return "weight: expected the uint8 buffer RfaLinearPack wrote, as packed_out_features is " +
               std::to_string(packed_n) + ", got " + dtype;
    } else if (dtype != "float32") {
      return std::string(names[i]) + ": expected float32, got " + dtype;
    }
    if (ndims[i] < 0 || ndims[i] > 8 || !shapes[i])
      return std::string(names[i]) + ": expected a rank 0..8 with a shape, got rank " + std::to_string(ndims[i]);
  }
  const int nx = ndims[0];
  const int64_t *x = shapes[0], *w = shapes[1], *y = shapes[2];
  if (nx < 1) return "x: expected at least 1 dimension (..., in_features), got a scalar";
  if (*type == WeightType::kPacked) {
    if (ndims[1] != 1) return "weight: expected the 1-D uint8 buffer RfaLinearPack wrote, got " + ShapeText(ndims[1], w);
    g->n = packed_n;
    g->k = x[nx - 1];
    if (g->k < 1 || g->k > INT_MAX || g->n > INT_MAX)
      return "x: expected in_features in [1, 2^31) with a packed weight, got " + ShapeText(nx, x);
    const int64_t bytes = rfa::onednn::PackedBytes(g->n, g->k);
    if (w[0] != bytes)
      return "weight: expected " + std::to_string(bytes) + " bytes, packed for (" + std::to_string(g->n) + ", " +
             std::to_string(g->k) + ") on this CPU, got " + ShapeText(1, w);
  } else {
    if (ndims[1] != 2) return "weight: expected 2 dimensions (out_features, in_features), got " + ShapeText(ndims[1], w);
    g->n = w[0];
    g->k = w[1];
    if (g->n < 0 || g->k < 0) return "weight: expected a concrete shape, got " + ShapeText(2, w);
    if (x[nx - 1] != g->k)
      return "x: expected its last dimension to be the weight's in_features " + std::to_string(g->k) + ", got x " +
             ShapeText(nx, x) + " and weight " + ShapeText(2, w);
  }
  g->m = 1;
  for (int i = 0; i + 1 < nx; ++i) {
    if (x[i] < 0) return "x: expected a concrete shape, got " + ShapeText(nx, x);
    if (x[i] != 0 && g->m > (int64_t(1) << 62) / x[i] / std::max<int64_t>(1, std::max(g->k, g->n)))
      return "x: expected fewer than 2^62 elements in x and y, got " + ShapeText(nx, x);
    g->m *= x[i];
  }
  if (g->n > INT_MAX || g->k > INT_MAX)
    return "weight: expected both dimensions below 2^31 (a BLAS int), got " + ShapeText(2, w);
  bool same = ndims[2] == nx && y[nx - 1] == g->n;
  for (int i = 0; same && i + 1 < nx; ++i) same = y[i] == x[i];
  if (!same) return "y: expected shape x.shape[:-1] + (out_features,), got y " + ShapeText(ndims[2], y) + " for x " +
                    ShapeText(nx, x) + " and weight " + ShapeText(ndims[1], w);
  return "";
}

// Decode-sized products: a few rows of x (one token per sequence). OpenBLAS's SGEMM ran them far
// below the memory bandwidth (x (8, 4096) by W (11008, 4096): 29 ms, where reading W once takes
// ~8 ms), so W is streamed once by weights::SmallRowsProduct, its rows split across threads.
// Measured on 2 AVX2 cores, float32 W (11008, 4096): M = 1, 2, 8 in 8.2, 12.0, 15.8 ms; at M = 16
// this ran no faster than SGEMM (40 ms), which keeps the larger float32 products. A half W has no
// SGEMM to go to without a float32 copy, and halves the bytes to read: it streams up to M = 16.
constexpr int64_t kSmallRows = 8, kSmallRowsHalf = 16;
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

template <typename W>
void SmallRows(const Gemm &g, const float *x, const W *w, float *y) {
  OnThreadRows(g.n, [&](int64_t n0, int64_t n1) { rfa::weights::SmallRowsProduct(g.m, g.n, g.k, x, w, y, n0, n1); });
}

#ifdef RFA_BF16_DOT_PRODUCT
// The bfloat16 form of SmallRows: x rounded to bfloat16 once (a thread's buffer, kept between calls),
// then W's rows split across threads as there.
void SmallRowsBF16(const Gemm &g, const float *x, const rfa::weights::BFloat16 *w, float *y) {
  thread_local std::vector<uint16_t> rounded;
  rounded.resize(static_cast<size_t>(g.m * g.k));
  rfa::weights::FloatToBFloat16(x, rounded.data(), g.m * g.k);
  const uint16_t *const x_bf16 = rounded.data();  // this thread's: inside the loop `rounded` is each worker's
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
      rfa::onednn::MultiplyBf16(g.m, g.n, g.k, x, reinterpret_cast<const uint16_t *>(w), y);
      return;
    }
  }
  constexpr bool kFloat = std::is_same_v<W, float>;
  if (g.m <= (kFloat ? kSmallRows : kSmallRowsHalf)) {
    SmallRows(g, x, w, y);
  } else if constexpr (kFloat) {
    Sgemm(g, x, w, g.n, y);
  } else {
    PanelGemm(g, x, w, y);
  }
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
  const LinearAttrs *data = &defaults;
  if (extra) {
    data = static_cast<const LinearAttrs *>(static_cast<mindspore::AotExtra *>(extra)->KernelData());
    if (!data) return Fail("kernel attributes missing (RfaLinearInit did not run)");
  }
  return RfaLinearRun(data->compute_dtype.c_str(), data->packed_out_features, nparam, params, ndims, shapes, dtypes);
}
