// MindSpore ops.Custom(func_type="aot") entry points of the CPU kernel:
//   RotaryFlashAttentionInit        reads the attributes once per kernel instance
//   RotaryFlashAttentionInferShape  output shapes (C++ infer, so GRAPH_MODE compiles once for dynamic S)
//   RotaryFlashAttentionInferType   output dtypes (C++ too: no Python callable in the graph, so a graph
//                                   holding the op exports to MindIR and loads in a fresh process)
//   RotaryFlashAttention            validates shapes, dtypes and TND offsets, then runs the kernel
//   RotaryFlashAttentionGrad[Init|InferShape]  the same for the backward (d_query, d_key, d_value)
// Errors never crash: they return non-zero, print the message and keep it for
// RotaryFlashAttentionLastError(), which the Python side reads to raise a clear exception.
// RotaryFlashAttentionIsa and RotaryFlashAttentionDecodeCalls say which build runs and how many
// calls took the decode path; RotaryFlashAttentionNativeBf16 whether it computes bfloat16. The
// backward computes float32 whatever compute_dtype says (the gradient of the float32 math).
#include <cstdio>
#include <exception>
#include <mutex>
#include <string>

#include "aot_abi.h"
#include "aot_attrs.h"
#include "last_error.h"
#include "rfa_cpu_kernel.h"
#include "rfa_problem.h"

#define RFA_EXPORT __attribute__((visibility("default")))

using mindspore::AotExtra;

namespace {


rfa::LastError g_last_error("RotaryFlashAttention");

int Fail(const std::string &message) { return g_last_error.Fail(message); }

// Bounds of the test-only tiling knobs: past them the scratch arithmetic would overflow.
constexpr int64_t kMaxTile = int64_t(1) << 16, kMaxPackBytes = int64_t(1) << 40;

std::string CheckKnob(const char *name, int64_t value, int64_t most) {
  if (value <= most) return "";
  return std::string(name) + ": expected at most " + std::to_string(most) + " (or <= 0 for the default), got " +
         std::to_string(value);
}

}  // namespace

// The message of the last failed call, copied under the lock into this thread's own string: a
// failure on another thread cannot free the characters the caller is reading.
extern "C" RFA_EXPORT const char *RotaryFlashAttentionLastError() { return g_last_error.Read(); }
// The layout of rfa::Attrs and of the direct-call entries; cpu_direct.py and cpu_kernel.py refuse
// a library whose version differs from theirs.
extern "C" RFA_EXPORT int64_t RotaryFlashAttentionAbiVersion() { return rfa::kAbiVersion; }
extern "C" RFA_EXPORT const char *RotaryFlashAttentionIsa() { return rfa::cpu::Isa(); }
extern "C" RFA_EXPORT int64_t RotaryFlashAttentionDecodeCalls() { return rfa::cpu::DecodeCalls(); }
// 1 where compute_dtype "bfloat16" runs (this build, this CPU), else 0: what cpu_kernel.py reports.
extern "C" RFA_EXPORT int64_t RotaryFlashAttentionNativeBf16() { return rfa::cpu::NativeBf16() ? 1 : 0; }
// Whether the bfloat16 forward runs its products on AMX tiles: `allow` 0 or 1 sets whether it may
// (tests and benchmarks measure both on one machine), -1 keeps it; the answer is whether it will.
extern "C" RFA_EXPORT int64_t RotaryFlashAttentionAmx(int64_t allow) { return rfa::cpu::UseAmx(allow) ? 1 : 0; }
// The units the bfloat16 forward's tiled path multiplies on, and why (rfa::cpu::Bf16Units). Kept per thread
// like the last error.
extern "C" RFA_EXPORT const char *RotaryFlashAttentionBf16Units() {
  thread_local std::string text;
  text = rfa::cpu::Bf16Units();
  return text.c_str();
}

extern "C" RFA_EXPORT int RotaryFlashAttentionInit(int *, int64_t **, const char **, AotExtra *extra) {
  return rfa::InitAttrs(extra, rfa::Attrs());
}

extern "C" RFA_EXPORT std::vector<std::vector<int64_t>> RotaryFlashAttentionInferShape(int *ndims, int64_t **shapes, AotExtra *extra) {
  rfa::Attrs a;
  rfa::ReadAttrs(extra, &a);
  return rfa::InferShapes(a, ndims[0], shapes[0], ndims[1], shapes[1]);
}

extern "C" RFA_EXPORT std::vector<TypeId> RotaryFlashAttentionInferType(std::vector<TypeId> inputs, AotExtra *) {
  return {inputs[0], kFloat32TypeId, inputs[1]};  // attention_out: query's; softmax_lse: float32; rotated_key: key's
}

// Validates, then runs. Shared by the MindSpore entry below and ms_rope_attention.cpu_direct
// (tests, sanitizer run, benchmark); rows/kv_block/pack_bytes <= 0 and stream_q_max 0 keep the
// default tiling (stream_q_max < 0: never the decode path).
extern "C" RFA_EXPORT int RotaryFlashAttentionRun(const rfa::Attrs *attrs, int *ndims, int64_t **shapes, const char **dtypes,
                                       void **params, int64_t rows, int64_t kv_block, int64_t pack_bytes,
                                       int rotate, int64_t stream_q_max) {
  try {
    if (!attrs) return Fail("attrs: null pointer");
    for (const std::string &err : {CheckKnob("rows", rows, kMaxTile), CheckKnob("kv_block", kv_block, kMaxTile),
                                   CheckKnob("pack_bytes", pack_bytes, kMaxPackBytes),
                                   CheckKnob("stream_q_max", stream_q_max, kMaxTile)})
      if (!err.empty()) return Fail(err);
    rfa::Problem problem;
    std::string err = rfa::ValidateCall(*attrs, ndims, shapes, dtypes, params, &problem);
    if (err.empty()) err = rfa::cpu::ResolveCompute(attrs->compute, &problem);
    if (!err.empty()) return Fail(err);
    rfa::cpu::Buffers buf{params[0], params[1], params[2], params[3], params[4], params[rfa::kInputs],
                          attrs->with_lse ? static_cast<float *>(params[rfa::kInputs + 1]) : nullptr,
                          attrs->with_rotated_key ? params[rfa::kInputs + 2] : nullptr};
    rfa::cpu::Tiling tiling;
    if (rows > 0) tiling.rows = rows;
    if (kv_block > 0) tiling.kv_block = kv_block;
    if (pack_bytes > 0) tiling.pack_bytes = pack_bytes;
    tiling.rotate = rotate != 0;
    if (stream_q_max != 0) tiling.stream_q_max = stream_q_max;
    rfa::cpu::Run(problem, buf, tiling);
    return 0;
  } catch (const std::bad_alloc &) {
    return Fail("out of memory for the kernel's scratch buffers");
  } catch (const std::exception &e) {
    return Fail(e.what());
  }
}

extern "C" RFA_EXPORT int RotaryFlashAttention(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                    void *, void *extra) {
  if (nparam < rfa::kInputs + rfa::kOutputs) return Fail("expected 7 inputs and 3 outputs, got " + std::to_string(nparam) + " params");
  std::string error;
  const rfa::Attrs *attrs = rfa::AttrsOf(extra, &error);
  if (!attrs) return Fail(error);
  return RotaryFlashAttentionRun(attrs, ndims, shapes, dtypes, params, 0, 0, 0, 1, 0);
}

extern "C" RFA_EXPORT int RotaryFlashAttentionGradInit(int *, int64_t **, const char **, AotExtra *extra) {
  return RotaryFlashAttentionInit(nullptr, nullptr, nullptr, extra);
}

extern "C" RFA_EXPORT std::vector<std::vector<int64_t>> RotaryFlashAttentionGradInferShape(int *ndims, int64_t **shapes,
                                                                                          AotExtra *) {
  return {std::vector<int64_t>(shapes[0], shapes[0] + ndims[0]), std::vector<int64_t>(shapes[1], shapes[1] + ndims[1]),
          std::vector<int64_t>(shapes[2], shapes[2] + ndims[2])};
}

extern "C" RFA_EXPORT std::vector<TypeId> RotaryFlashAttentionGradInferType(std::vector<TypeId> inputs, AotExtra *) {
  return {inputs[0], inputs[1], inputs[2]};  // d_query, d_key, d_value: their inputs' dtypes
}

// Validates, then runs the backward; block_q/block_k/splits <= 0 keep the default tiling.
extern "C" RFA_EXPORT int RotaryFlashAttentionGradRun(const rfa::Attrs *attrs, int *ndims, int64_t **shapes,
                                                      const char **dtypes, void **params, int64_t block_q,
                                                      int64_t block_k, int64_t splits) {
  try {
    if (!attrs) return Fail("attrs: null pointer");
    for (const std::string &err : {CheckKnob("block_q", block_q, kMaxTile), CheckKnob("block_k", block_k, kMaxTile),
                                   CheckKnob("splits", splits, kMaxTile)})
      if (!err.empty()) return Fail(err);
    rfa::Problem problem;
    bool has_dlse = false, has_drk = false;
    const std::string err = rfa::ValidateGradCall(*attrs, ndims, shapes, dtypes, params, &problem, &has_dlse, &has_drk);
    if (!err.empty()) return Fail(err);
    const int o = rfa::kGradInputs;
    rfa::cpu::GradBuffers buf{params[0], params[1], params[2], params[3], params[4], params[7],
                              static_cast<const float *>(params[8]), params[9],
                              has_dlse ? static_cast<const float *>(params[10]) : nullptr,
                              has_drk ? params[11] : nullptr, params[o], params[o + 1], params[o + 2]};
    rfa::cpu::GradTiling tiling;
    if (block_q > 0) tiling.block_q = block_q;
    if (block_k > 0) tiling.block_k = block_k;
    if (splits > 0) tiling.splits = splits;
    rfa::cpu::RunBackward(problem, buf, tiling);
    return 0;
  } catch (const std::bad_alloc &) {
    return Fail("out of memory for the backward's scratch buffers");
  } catch (const std::exception &e) {
    return Fail(e.what());
  }
}

extern "C" RFA_EXPORT int RotaryFlashAttentionGrad(int nparam, void **params, int *ndims, int64_t **shapes,
                                                   const char **dtypes, void *, void *extra) {
  if (nparam < rfa::kGradInputs + rfa::kGradOutputs)
    return Fail("expected 12 inputs and 3 outputs, got " + std::to_string(nparam) + " params");
  std::string error;
  const rfa::Attrs *attrs = rfa::AttrsOf(extra, &error);
  if (!attrs) return Fail(error);
  return RotaryFlashAttentionGradRun(attrs, ndims, shapes, dtypes, params, 0, 0, 0);
}
