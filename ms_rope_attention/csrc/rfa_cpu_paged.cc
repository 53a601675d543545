// MindSpore ops.Custom(func_type="aot") entries of the paged KV cache's ops (rfa_paged.h):
//   RotaryPagedAttention[Init|InferShape|InferType]  attention over a block-paged cache, on the
//                                                    decode path (rfa_cpu_decode.cc);
//   RotaryCacheWrite[Init|InferShape|InferType]      RoPE on the new keys + the write into the caches.
// The cache write stores into its key_cache / value_cache inputs in place (the Python side marks the
// primitive side_effect_mem and orders the reads after it); its one output is the count of tokens
// written. *Run entries take the attributes directly (ms_rope_attention.cpu_direct, tests).
#include <omp.h>

#include <atomic>
#include <exception>
#include <string>

#include "aot_abi.h"
#include "aot_attrs.h"
#include "last_error.h"
#include "rfa_cpu_kernel.h"
#include "rfa_paged.h"
#include "rows.h"

#define RFA_EXPORT __attribute__((visibility("default")))

using mindspore::AotExtra;

namespace {

rfa::LastError g_last_error("RotaryPagedAttention");
std::atomic<int64_t> g_paged_calls{0}, g_rotated_keys{0};

int Fail(const std::string &message) { return g_last_error.Fail(message); }

// The paged ops' attributes before their own are read (aot_attrs.h): the layout is always TND.
rfa::Attrs PagedDefaults() {
  rfa::Attrs a;
  a.layout = rfa::Layout::TND;
  return a;
}

thread_local rfa::cpu::Scratch tls_write_scratch;

// Every token's keys rotated at its position (unless already rotated) and its values, into the
// caches' rows at its slot, converted to the cache's dtype; -1 slots are skipped.
void RunCacheWrite(const rfa::CacheWrite &w, void *const *params) {
  using namespace rfa::cpu;
  const rfa::Problem &p = w.rope;
  const int64_t D = p.head_dim, rd = p.rotary_dim, H = p.kv_heads, mode = p.attrs.rotary_mode;
  const void *key = params[0], *value = params[1];
  void *key_cache = params[6], *value_cache = params[7];
  const Tables tables{&p, params[2], params[3]};
  bool ok = true;
#pragma omp parallel reduction(&& : ok)
  {
    float *row = nullptr, *rotated = nullptr, *out = nullptr, *c = nullptr, *s = nullptr;
    ScratchRegions regions;
    regions.Add(&row, D).Add(&rotated, D).Add(&out, D).Add(&c, rd).Add(&s, rd);
    ok = regions.Carve(&tls_write_scratch);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < w.tokens; ++i) {
      const int64_t slot = w.slot_mapping[i];
      if (!ok || slot < 0) continue;
      for (int64_t h = 0; h < H; ++h) {
        const int64_t src = (i * H + h) * D, dst = (slot * H + h) * D;
        const float *x = RowAsFloat(p.qkv_dtype, key, src, D, row);
        if (!w.key_rotated) {
          const int64_t pos = w.positions[i];
          Rotate(x, tables.Row(params[2], p.cos_dtype, pos, c), tables.Row(params[3], p.sin_dtype, pos, s), rd, D, mode,
                 1.0f, rotated);
          ToOriginalOrder(rotated, rd, D, mode, out);
          x = out;
        }
        StoreRow(w.cache_dtype, x, D, key_cache, dst);
        StoreRow(w.cache_dtype, RowAsFloat(p.qkv_dtype, value, src, D, row), D, value_cache, dst);
      }
    }
  }
  if (!ok) throw std::bad_alloc();
}

}  // namespace

extern "C" RFA_EXPORT const char *RotaryPagedAttentionLastError() { return g_last_error.Read(); }
// Calls of RotaryPagedAttention, and keys RotaryCacheWrite rotated, in this process so far.
extern "C" RFA_EXPORT int64_t RotaryPagedAttentionCalls() { return g_paged_calls.load(); }
extern "C" RFA_EXPORT int64_t RotaryCacheWriteRotatedKeys() { return g_rotated_keys.load(); }

extern "C" RFA_EXPORT int RotaryPagedAttentionInit(int *, int64_t **, const char **, AotExtra *extra) {
  return rfa::InitAttrs(extra, PagedDefaults());
}

extern "C" RFA_EXPORT std::vector<std::vector<int64_t>> RotaryPagedAttentionInferShape(int *ndims, int64_t **shapes,
                                                                                       AotExtra *extra) {
  rfa::Attrs a = PagedDefaults();
  rfa::ReadAttrs(extra, &a);
  return rfa::PagedOutputShapes(a, ndims[0], shapes[0]);
}

extern "C" RFA_EXPORT std::vector<TypeId> RotaryPagedAttentionInferType(std::vector<TypeId> inputs, AotExtra *) {
  return {inputs[0], kFloat32TypeId};  // attention_out: query's; softmax_lse: float32
}

extern "C" RFA_EXPORT int RotaryPagedAttentionRun(const rfa::Attrs *attrs, int *ndims, int64_t **shapes,
                                                  const char **dtypes, void **params) {
  try {
    if (!attrs) return Fail("attrs: null pointer");
    rfa::Problem problem;
    std::string err = rfa::ValidatePagedCall(*attrs, ndims, shapes, dtypes, params, &problem);
    if (err.empty()) err = rfa::cpu::ResolveCompute(attrs->compute, &problem);
    if (!err.empty()) return Fail(err);
    rfa::cpu::Buffers buf{params[0], params[1], params[2], params[3], params[4], params[rfa::kPagedInputs],
                          problem.attrs.with_lse ? static_cast<float *>(params[rfa::kPagedInputs + 1]) : nullptr,
                          nullptr};
    rfa::cpu::RunDecode(problem, buf, rfa::cpu::Tiling());
    g_paged_calls.fetch_add(1, std::memory_order_relaxed);
    return 0;
  } catch (const std::bad_alloc &) {
    return Fail("out of memory for the kernel's scratch buffers");
  } catch (const std::exception &e) {
    return Fail(e.what());
  }
}

extern "C" RFA_EXPORT int RotaryPagedAttention(int nparam, void **params, int *ndims, int64_t **shapes,
                                               const char **dtypes, void *, void *extra) {
  if (nparam < rfa::kPagedInputs + rfa::kPagedOutputs)
    return Fail("expected 8 inputs and 2 outputs, got " + std::to_string(nparam) + " params");
  std::string error;
  const rfa::Attrs *attrs = rfa::AttrsOf(extra, &error);
  if (!attrs) return Fail(error);
  return RotaryPagedAttentionRun(attrs, ndims, shapes, dtypes, params);
}

extern "C" RFA_EXPORT int RotaryCacheWriteInit(int *, int64_t **, const char **, AotExtra *extra) {
  return rfa::InitAttrs(extra, PagedDefaults());
}

// One output: MindSpore calls the single-output forms (a shape, a TypeId), not the vector-of-outputs ones.
extern "C" RFA_EXPORT std::vector<int64_t> RotaryCacheWriteInferShape(int *, int64_t **, AotExtra *) { return {1}; }

extern "C" RFA_EXPORT TypeId RotaryCacheWriteInferType(std::vector<TypeId> inputs, AotExtra *) {
  return inputs[4];  // written: int32, as positions
}

extern "C" RFA_EXPORT int RotaryCacheWriteRun(const rfa::Attrs *attrs, int *ndims, int64_t **shapes, const char **dtypes,
                                              void **params) {
  try {
    if (!attrs) return Fail("attrs: null pointer");
    rfa::CacheWrite write;
    const std::string err = rfa::ValidateCacheWrite(*attrs, ndims, shapes, dtypes, params, &write);
    if (!err.empty()) return Fail(err);
    RunCacheWrite(write, params);
    int64_t written = 0;
    for (int64_t i = 0; i < write.tokens; ++i) written += write.slot_mapping[i] >= 0;
    if (!write.key_rotated) g_rotated_keys.fetch_add(written * write.rope.kv_heads, std::memory_order_relaxed);
    *static_cast<int32_t *>(params[rfa::kWriteInputs]) = static_cast<int32_t>(written);
    return 0;
  } catch (const std::bad_alloc &) {
    return Fail("out of memory for the cache write's scratch rows");
  } catch (const std::exception &e) {
    return Fail(e.what());
  }
}

extern "C" RFA_EXPORT int RotaryCacheWrite(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                           void *, void *extra) {
  if (nparam < rfa::kWriteInputs + rfa::kWriteOutputs)
    return Fail("expected 8 inputs and 1 output, got " + std::to_string(nparam) + " params");
  std::string error;
  const rfa::Attrs *attrs = rfa::AttrsOf(extra, &error);
  if (!attrs) return Fail(error);
  return RotaryCacheWriteRun(attrs, ndims, shapes, dtypes, params);
}
