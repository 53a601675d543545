// RMSNorm of float32 rows on the CPU, as a MindSpore aot op: y = x * (1 / sqrt(mean(x^2) + eps)) *
// weight over the last dimension, weight (H,) float32.
//
// Why: the Llama model computing in bfloat16 keeps its activations float32 between the ops, and its
// RMSNorm in MindSpore's CPU ops (Cast, Mul, ReduceMean, Rsqrt, BroadcastTo, Mul) ran single-threaded,
// each writing an x-sized temporary: ~45 ms of a 470 ms 512-token prefill (7B dims, 2 layers,
// MindSpore's profiler). Here each row is read once for its statistic and once more to write y, the
// rows split over the OpenMP threads.
//
// The sum of squares is float32 in several partial sums: 4 vectors of simd.h's width (FMA) in the
// AVX-512 and AVX2 builds, 8 scalar sums in plain C++ in the portable build; they are combined
// pairwise and the tail past them is added last (op_info/rms_norm.yaml states the rounding).
//
// Entries: RfaRMSNorm (x (..., H) float32, weight (H,) float32) -> y (x's shape) float32, eps read
// once by RfaRMSNormInit; RfaRMSNormRun (the same with eps given: direct calls without MindSpore);
// RfaRMSNormInferShape / RfaRMSNormInferType; RfaRMSNormLastError.
#include <algorithm>
#include <cfloat>
#include <charconv>
#include <cmath>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include "aot_abi.h"
#include "aot_attrs.h"
#include "last_error.h"
#include "rfa_problem.h"  // rfa::ShapeText
#include "simd.h"

#define RFA_EXPORT __attribute__((visibility("default")))

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define RFA_NORM_SIMD 1
#endif

namespace {

using rfa::ShapeText;

rfa::LastError g_last_error("RfaRMSNorm");

int Fail(const std::string &message) { return g_last_error.Fail(message); }

struct Rows {
  int64_t rows = 1, hidden = 0;
};

// The shortest text that reads back as `value` (Python's repr of it: 1e-06, -1.0, nan, inf).
std::string Text(double value) {
  char text[32];
  const auto result = std::to_chars(text, text + sizeof text, value);
  return std::string(text, result.ptr);
}

// eps: finite, >= 0 and within float32's range (it is used as float32).
std::string CheckEps(double eps) {
  if (!(eps >= 0.0) || !std::isfinite(eps) || eps > FLT_MAX)
    return "eps: expected a finite value >= 0 within float32's range, got " + Text(eps);
  return "";
}

// Checks x (..., H) float32 with H >= 1, weight (H,) float32 and y of x's shape float32, before any
// memory is touched.
std::string Validate(const int *ndims, int64_t *const *shapes, const char *const *dtypes, Rows *r) {
  const char *names[3] = {"x", "weight", "y"};
  if (!ndims || !shapes || !dtypes) return "launch: null ndims, shapes or dtypes array";
  for (int i = 0; i < 3; ++i) {
    const std::string dtype = dtypes[i] ? dtypes[i] : "none";
    if (dtype != "float32") return std::string(names[i]) + ": expected float32, got " + dtype;
    if (ndims[i] < 0 || ndims[i] > 8 || !shapes[i])
      return std::string(names[i]) + ": expected a rank 0..8 with a shape, got rank " + std::to_string(ndims[i]);
  }
  const int nx = ndims[0];
  const int64_t *x = shapes[0], *w = shapes[1], *y = shapes[2];
  if (nx < 1) return "x: expected at least 1 dimension (..., hidden), got a scalar";
  for (int i = 0; i < nx; ++i)
    if (x[i] < 0) return "x: expected a concrete shape, got " + ShapeText(nx, x);
  r->hidden = x[nx - 1];
  if (r->hidden < 1) return "x: expected its last dimension (hidden) >= 1, got " + ShapeText(nx, x);
  for (int i = 0; i + 1 < nx; ++i) {
    if (x[i] != 0 && r->rows > (int64_t(1) << 62) / x[i] / r->hidden)
      return "x: expected fewer than 2^62 elements, got " + ShapeText(nx, x);
    r->rows *= x[i];
  }
  if (ndims[1] != 1 || w[0] != r->hidden)
    return "weight: expected shape (" + std::to_string(r->hidden) + ",), x's last dimension, got weight " +
           ShapeText(ndims[1], w) + " for x " + ShapeText(nx, x);
  bool same = ndims[2] == nx;
  for (int i = 0; same && i < nx; ++i) same = y[i] == x[i];
  if (!same) return "y: expected x's shape " + ShapeText(nx, x) + ", got " + ShapeText(ndims[2], y);
  return "";
}

#ifdef RFA_NORM_SIMD
using rfa::simd::kLanes;
using rfa::simd::vf;

// a * b + c with one rounding.
inline vf MulAdd(vf a, vf b, vf c) {
#if defined(__AVX512F__)
  return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#else
  return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#endif
}

// The sum of x[i]^2 over one row: 4 vector accumulators, combined pairwise, then the tail.
float SumOfSquares(const float *x, int64_t n) {
  vf a0{}, a1{}, a2{}, a3{};
  int64_t i = 0;
  for (; i + 4 * kLanes <= n; i += 4 * kLanes) {
    const vf x0 = rfa::simd::Load(x + i), x1 = rfa::simd::Load(x + i + kLanes);
    const vf x2 = rfa::simd::Load(x + i + 2 * kLanes), x3 = rfa::simd::Load(x + i + 3 * kLanes);
    a0 = MulAdd(x0, x0, a0);
    a1 = MulAdd(x1, x1, a1);
    a2 = MulAdd(x2, x2, a2);
    a3 = MulAdd(x3, x3, a3);
  }
  for (; i + kLanes <= n; i += kLanes) {
    const vf v = rfa::simd::Load(x + i);
    a0 = MulAdd(v, v, a0);
  }
  float sum = rfa::simd::ReduceSum((a0 + a1) + (a2 + a3));
  for (; i < n; ++i) sum = std::fma(x[i], x[i], sum);
  return sum;
}

// y = (x * r) * w over one row.
void Scale(const float *x, const float *w, float r, float *y, int64_t n) {
  const vf rv = rfa::simd::Splat(r);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    rfa::simd::Store(y + i, (rfa::simd::Load(x + i) * rv) * rfa::simd::Load(w + i));
  for (; i < n; ++i) y[i] = (x[i] * r) * w[i];
}
#else
// The portable build, plain C++: 8 partial sums, combined pairwise, then the tail.
float SumOfSquares(const float *x, int64_t n) {
  constexpr int kSums = 8;
  float s[kSums] = {};
  int64_t i = 0;
  for (; i + kSums <= n; i += kSums)
    for (int j = 0; j < kSums; ++j) s[j] += x[i + j] * x[i + j];
  float sum = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
  for (; i < n; ++i) sum += x[i] * x[i];
  return sum;
}

void Scale(const float *x, const float *w, float r, float *y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = (x[i] * r) * w[i];
}
#endif

void Normalize(const Rows &g, const float *x, const float *w, float eps, float *y) {
  const float hidden = static_cast<float>(g.hidden);
#pragma omp parallel for schedule(static) if (g.rows > 1)
  for (int64_t row = 0; row < g.rows; ++row) {
    const float *xr = x + row * g.hidden;
    const float mean = SumOfSquares(xr, g.hidden) / hidden;
    const float r = 1.0f / std::sqrt(mean + eps);
    Scale(xr, w, r, y + row * g.hidden, g.hidden);
  }
}

}  // namespace

extern "C" RFA_EXPORT const char *RfaRMSNormLastError() { return g_last_error.Read(); }

// y's shape: x's; -1 stays -1 (dynamic dimensions).
extern "C" RFA_EXPORT std::vector<int64_t> RfaRMSNormInferShape(int *ndims, int64_t **shapes, mindspore::AotExtra *) {
  return std::vector<int64_t>(shapes[0], shapes[0] + ndims[0]);
}

extern "C" RFA_EXPORT TypeId RfaRMSNormInferType(std::vector<TypeId> inputs, mindspore::AotExtra *) { return inputs[0]; }

// What RfaRMSNormInit keeps for the launches of one kernel instance: eps.
struct NormAttrs : mindspore::AotKernelData {
  float eps = 1e-6f;  // the contract's default
};

extern "C" RFA_EXPORT int RfaRMSNormInit(int *, int64_t **, const char **, mindspore::AotExtra *extra) {
  auto *data = new NormAttrs;
  rfa::ReadNormAttrs(extra, &data->eps);
  extra->SetKernelData(data);
  return 0;
}

// Validates everything (eps, dtypes, shapes, data pointers), then normalizes. The MindSpore entry
// below and ms_rope_attention.norm.rms_norm (no MindSpore) call it.
extern "C" RFA_EXPORT int RfaRMSNormRun(double eps, int nparam, void **params, int *ndims, int64_t **shapes,
                                        const char **dtypes) {
  try {
    std::string err = CheckEps(eps);
    if (!err.empty()) return Fail(err);
    if (nparam != 3) return Fail("expected 2 inputs (x, weight) and 1 output, got " + std::to_string(nparam) + " params");
    if (!params) return Fail("launch: null params array");
    Rows g;
    err = Validate(ndims, shapes, dtypes, &g);
    if (!err.empty()) return Fail(err);
    if (g.rows == 0) return 0;
    const char *names[3] = {"x", "weight", "y"};
    for (int i = 0; i < 3; ++i)
      if (!params[i]) return Fail(std::string(names[i]) + ": null data pointer");
    Normalize(g, static_cast<const float *>(params[0]), static_cast<const float *>(params[1]), static_cast<float>(eps),
              static_cast<float *>(params[2]));
    return 0;
  } catch (const std::exception &e) {
    return Fail(e.what());
  }
}

// MindSpore's launch: eps as RfaRMSNormInit read it. A null `extra` (a direct call through the aot
// convention, as tests make it) takes the contract's default.
extern "C" RFA_EXPORT int RfaRMSNorm(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *,
                                     void *extra) {
  const NormAttrs defaults;
  const NormAttrs *data = rfa::LaunchAttrs(extra, defaults);
  if (!data) return Fail("kernel attributes missing (RfaRMSNormInit did not run)");
  return RfaRMSNormRun(data->eps, nparam, params, ndims, shapes, dtypes);
}
