// y = x W^T on the CPU through OpenBLAS's SGEMM, as a MindSpore aot op: the projections of a
// transformer layer (Q/K/V/O, gate/up/down) with W in Hugging Face's (out_features, in_features) layout.
//
// Why: at prefill lengths of a few hundred to a few thousand tokens, a Llama layer's time is these
// GEMMs, and MindSpore 2.10's CPU MatMul ran them at ~115-140 GFLOP/s on a 2-core AVX2 machine where
// OpenBLAS (the scipy-openblas32 wheel) ran the same shapes at ~140-160 (see
// docs/benchmarks.md). OpenBLAS picks its kernels for the running CPU itself, so this library is built once, not per ISA.
//
// Entries: RfaLinear (x (..., K), weight (N, K)) -> y (..., N), float32; RfaLinearInferShape /
// RfaLinearInferType (C++ infer, so GRAPH_MODE with a dynamic sequence length compiles once);
// RfaLinearLastError (the message of the last refused launch).
#include <algorithm>
#include <climits>
#include <cstdio>
#include <cstring>
#include <exception>
#include <mutex>
#include <string>
#include <vector>

#include <omp.h>
#include <cblas.h>  // scipy-openblas32's: every symbol carries its scipy_ prefix

#include "aot_abi.h"
#include "last_error.h"
#include "rfa_problem.h"  // rfa::ShapeText

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

// Checks x (..., K), weight (N, K) and y (..., N), all float32, before any memory is touched.
std::string Validate(const int *ndims, int64_t *const *shapes, const char *const *dtypes, Gemm *g) {
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
  if (nx < 1) return "x: expected at least 1 dimension (..., in_features), got a scalar";
  if (ndims[1] != 2) return "weight: expected 2 dimensions (out_features, in_features), got " + ShapeText(ndims[1], w);
  g->n = w[0];
  g->k = w[1];
  if (g->n < 0 || g->k < 0) return "weight: expected a concrete shape, got " + ShapeText(2, w);
  if (x[nx - 1] != g->k)
    return "x: expected its last dimension to be the weight's in_features " + std::to_string(g->k) + ", got x " +
           ShapeText(nx, x) + " and weight " + ShapeText(2, w);
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
                    ShapeText(nx, x) + " and weight " + ShapeText(2, w);
  return "";
}

// Decode-sized products: a few rows of x (one token per sequence). OpenBLAS's SGEMM ran them far
// below the memory bandwidth (x (8, 4096) by W (11008, 4096): 29 ms, where reading W once takes
// ~8 ms), so W is streamed once here: blocks of four of its rows dotted with two rows of x at a
// time (x stays in cache), the rows of W split across threads. Measured on 2 AVX2 cores, W (11008,
// 4096): M = 1, 2, 8 in 8.2, 12.0, 15.8 ms; at M = 16 this ran no faster than SGEMM (40 ms), which
// keeps the larger products.
constexpr int64_t kSmallRows = 8;
// The helpers below are always inlined: the vector-by-value ABI note GCC gives for them is moot.
#pragma GCC diagnostic ignored "-Wpsabi"
typedef float v8 __attribute__((vector_size(32)));
__attribute__((always_inline)) inline v8 L(const float *p) { v8 v; std::memcpy(&v, p, 32); return v; }
__attribute__((always_inline)) inline float Sum(v8 v) { float s = 0.f; for (int i = 0; i < 8; ++i) s += v[i]; return s; }

// y[:, n0:n1] for the rows [n0, n1) of W.
__attribute__((always_inline)) inline void Body(const Gemm &g, const float *x, const float *w, float *y, int64_t n0, int64_t n1) {
  const int64_t K = g.k, N = g.n, K8 = K / 8 * 8;
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) {
    const float *w0 = w + n * K, *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
    int64_t m = 0;
    for (; m + 2 <= g.m; m += 2) {
      const float *xa = x + m * K, *xb = xa + K;
      v8 a0 = {}, a1 = {}, a2 = {}, a3 = {}, b0 = {}, b1 = {}, b2 = {}, b3 = {};
      for (int64_t k = 0; k < K8; k += 8) {
        const v8 u = L(xa + k), v = L(xb + k), r0 = L(w0 + k), r1 = L(w1 + k), r2 = L(w2 + k), r3 = L(w3 + k);
        a0 += r0 * u; a1 += r1 * u; a2 += r2 * u; a3 += r3 * u;
        b0 += r0 * v; b1 += r1 * v; b2 += r2 * v; b3 += r3 * v;
      }
      float s[8] = {Sum(a0), Sum(a1), Sum(a2), Sum(a3), Sum(b0), Sum(b1), Sum(b2), Sum(b3)};
      for (int64_t k = K8; k < K; ++k) {
        s[0] += w0[k] * xa[k]; s[1] += w1[k] * xa[k]; s[2] += w2[k] * xa[k]; s[3] += w3[k] * xa[k];
        s[4] += w0[k] * xb[k]; s[5] += w1[k] * xb[k]; s[6] += w2[k] * xb[k]; s[7] += w3[k] * xb[k];
      }
      std::memcpy(y + m * N + n, s, 16);
      std::memcpy(y + (m + 1) * N + n, s + 4, 16);
    }
    for (; m < g.m; ++m) {
      const float *xa = x + m * K;
      v8 a0 = {}, a1 = {}, a2 = {}, a3 = {};
      for (int64_t k = 0; k < K8; k += 8) {
        const v8 u = L(xa + k);
        a0 += L(w0 + k) * u; a1 += L(w1 + k) * u; a2 += L(w2 + k) * u; a3 += L(w3 + k) * u;
      }
      float s[4] = {Sum(a0), Sum(a1), Sum(a2), Sum(a3)};
      for (int64_t k = K8; k < K; ++k) {
        s[0] += w0[k] * xa[k]; s[1] += w1[k] * xa[k]; s[2] += w2[k] * xa[k]; s[3] += w3[k] * xa[k];
      }
      std::memcpy(y + m * N + n, s, 16);
    }
  }
  for (; n < n1; ++n)
    for (int64_t m = 0; m < g.m; ++m) {
      float s = 0.f;
      for (int64_t k = 0; k < K; ++k) s += w[n * K + k] * x[m * K + k];
      y[m * N + n] = s;
    }
}
// The library is built once for every x86-64 CPU (unlike the attention kernel's per-ISA builds): the
// same body compiled for AVX2/FMA too, chosen at run time.
#if defined(__x86_64__)
__attribute__((target("avx2,fma"))) void SliceAvx2(const Gemm &g, const float *x, const float *w, float *y, int64_t n0, int64_t n1) { Body(g, x, w, y, n0, n1); }
#endif
void SliceBase(const Gemm &g, const float *x, const float *w, float *y, int64_t n0, int64_t n1) { Body(g, x, w, y, n0, n1); }

void SmallRows(const Gemm &g, const float *x, const float *w, float *y) {
#if defined(__x86_64__)
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  const auto slice = avx2 ? SliceAvx2 : SliceBase;
#else
  const auto slice = SliceBase;
#endif
  const int threads = omp_get_max_threads();
  const int64_t per = (g.n / threads + 3) / 4 * 4;  // whole blocks of four rows per thread
#pragma omp parallel for num_threads(threads) schedule(static, 1)
  for (int t = 0; t < threads; ++t) {
    const int64_t n0 = std::min(g.n, t * per), n1 = t + 1 == threads ? g.n : std::min(g.n, n0 + per);
    if (n0 < n1) slice(g, x, w, y, n0, n1);
  }
}
void Multiply(const Gemm &g, const float *x, const float *w, float *y) {
  if (g.k == 0) {  // an empty sum: BLAS may leave y untouched
    std::memset(y, 0, static_cast<size_t>(g.m * g.n) * sizeof(float));
    return;
  }
  if (g.m <= kSmallRows) {
    SmallRows(g, x, w, y);
    return;
  }
  constexpr int64_t kRowsPerCall = INT_MAX;  // M is a BLAS int: larger inputs go in slices of rows
  for (int64_t r = 0; r < g.m; r += kRowsPerCall) {
    const int64_t rows = std::min(kRowsPerCall, g.m - r);
    scipy_cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<blasint>(rows), static_cast<blasint>(g.n),
                      static_cast<blasint>(g.k), 1.0f, x + r * g.k, static_cast<blasint>(g.k), w,
                      static_cast<blasint>(g.k), 0.0f, y + r * g.n, static_cast<blasint>(g.n));
  }
}

}  // namespace

// Copied under the lock into this thread's own string (see RotaryFlashAttentionLastError).
extern "C" RFA_EXPORT const char *RfaLinearLastError() { return g_last_error.Read(); }

// y's shape: x.shape[:-1] + (out_features,); -1 stays -1 (dynamic dimensions).
extern "C" RFA_EXPORT std::vector<int64_t> RfaLinearInferShape(int *ndims, int64_t **shapes, mindspore::AotExtra *) {
  std::vector<int64_t> out(shapes[0], shapes[0] + ndims[0]);
  if (!out.empty() && ndims[1] == 2) out.back() = shapes[1][0];
  return out;
}

extern "C" RFA_EXPORT TypeId RfaLinearInferType(std::vector<TypeId> inputs, mindspore::AotExtra *) { return inputs[0]; }

extern "C" RFA_EXPORT int RfaLinear(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *,
                                    void *) {
  try {
    if (nparam != 3) return Fail("expected 2 inputs (x, weight) and 1 output, got " + std::to_string(nparam) + " params");
    Gemm g;
    const std::string err = Validate(ndims, shapes, dtypes, &g);
    if (!err.empty()) return Fail(err);
    const char *names[3] = {"x", "weight", "y"};
    const bool has_elements[3] = {g.m > 0 && g.k > 0, g.n > 0 && g.k > 0, g.m > 0 && g.n > 0};
    for (int i = 0; i < 3; ++i)
      if (has_elements[i] && !params[i]) return Fail(std::string(names[i]) + ": null data pointer");
    if (g.m > 0 && g.n > 0)
      Multiply(g, static_cast<const float *>(params[0]), static_cast<const float *>(params[1]),
               static_cast<float *>(params[2]));
    return 0;
  } catch (const std::exception &e) {
    return Fail(e.what());
  }
}
