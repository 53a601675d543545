// The Ascend tiling decisions of both ops, free of CANN: validate the problem (the same
// rfa::BuildProblem the CPU kernel uses), pick the query/KV block sizes that fit the vector core's
// Unified Buffer, and lay out the GM workspace. op_host/rotary_flash_attention.cpp (forward) and
// op_host/rotary_flash_attention_grad.cpp (backward) call them with the device's core count and UB
// size; the emulation (emulator/rfa_ascend_emulated.cc) and tests/test_ascend*.py call them here.
#pragma once
#include <algorithm>
#include <string>

#include "rfa_problem.h"
#include "rotary_flash_attention_grad_tiling.h"
#include "rotary_flash_attention_tiling.h"

namespace rfa {
namespace ascend {

struct Platform {  // a constructor for C++11 brace-initialisation (see rfa_problem.h, Strides)
  int64_t vector_cores, ub_bytes;
  Platform(int64_t cores = kA2VectorCores, int64_t ub = kA2UbBytes) : vector_cores(cores), ub_bytes(ub) {}
};

inline int64_t ElemBytes(DType t) { return t == DType::F32 ? 4 : 2; }

// Largest M (query rows of one task, all heads of a KV group) the cube handles in one pass.
constexpr int64_t kMaxTaskRows = 128;

// What the Ascend kernels refuse beyond the contract, or "" with the problem part of `t` filled
// (the plan fields zero).
inline std::string FillProblem(const Problem &p, const Platform &pf, RfaTiling *t) {
  if (pf.vector_cores < 1) return "platform: expected at least one vector core";
  if (p.head_dim % 16)
    return "query: head_dim " + std::to_string(p.head_dim) +
           " is not a multiple of 16, which the Ascend kernel needs for 32-byte aligned rows (64/80/96/128/256 are)";
  if (p.cos_dtype != p.sin_dtype) return "sin: expected the same dtype as cos on Ascend";
  *t = RfaTiling{};
  t->batch = p.batch;
  t->q_heads = p.q_heads;
  t->kv_heads = p.kv_heads;
  t->group = p.q_heads / p.kv_heads;
  t->head_dim = p.head_dim;
  t->head_pad = p.head_dim;  // multiple of 16: already 32-byte aligned for every dtype
  t->rotary_dim = p.rotary_dim;
  t->rotary_pad = RoundUp(p.rotary_dim, 16);
  t->q_len = p.q_len;
  t->kv_len = p.kv_len;
  t->table_rows = p.table_rows;
  t->layout = static_cast<int64_t>(p.attrs.layout);
  t->rotary_mode = p.attrs.rotary_mode;
  t->causal = p.attrs.causal;
  t->with_lse = p.attrs.with_lse;
  t->with_rotated_key = p.attrs.with_rotated_key;
  t->key_rotated = p.attrs.key_rotated;
  t->q_batch_stride = p.q.batch;
  t->q_head_stride = p.q.head;
  t->q_row_stride = p.q.row;
  t->kv_batch_stride = p.kv.batch;
  t->kv_head_stride = p.kv.head;
  t->kv_row_stride = p.kv.row;
  t->lse_batch_stride = p.lse.batch;
  t->lse_head_stride = p.lse.head;
  t->lse_row_stride = p.lse.row;
  t->scale = p.scale;
  return "";
}

// The first block sizes whose UB plan fits: block_kv from `kv_options` in order, block_q from `first_q`
// halving (only first_q when `fixed_q`); total_of(block_q, block_kv) is the plan's bytes. False when
// nothing fits.
template <typename TotalOf>
inline bool FirstFit(int64_t first_q, bool fixed_q, const int64_t *kv_options, int kv_count, int64_t ub_bytes,
                     TotalOf total_of, int64_t *block_q, int64_t *block_kv, int64_t *total) {
  for (int i = 0; i < kv_count; ++i) {
    for (int64_t bq = first_q; bq >= 1; bq = fixed_q ? 0 : bq / 2) {
      *total = total_of(bq, kv_options[i]);
      if (*total <= ub_bytes) {
        *block_q = bq;
        *block_kv = kv_options[i];
        return true;
      }
    }
  }
  return false;
}

// Consecutive workspace slices, each 512-byte aligned (whole cache lines for the cube's loads).
class Slices {
 public:
  int64_t Take(int64_t bytes) {
    const int64_t at = end_;
    end_ += RoundUp(bytes, 512);
    return at;
  }
  int64_t End() const { return end_; }

 private:
  int64_t end_ = 0;
};

inline std::string PlanTiling(const Problem &p, const Platform &pf, RfaTiling *t, int64_t block_q = 0,
                              int64_t block_kv = 0) {
  const std::string refused = FillProblem(p, pf, t);
  if (!refused.empty()) return refused;
  const int64_t group = t->group, elem = ElemBytes(p.qkv_dtype), telem = ElemBytes(p.cos_dtype);
  t->core_num = pf.vector_cores;

  // KV tile 128 (the cube's base block), or 64 if nothing fits. Query rows per head: up to 64 (enough
  // reuse of each K/V tile), with M = group * block_q <= 128, halved until the UB plan fits.
  const int64_t max_q = std::max<int64_t>(1, std::min<int64_t>(64, kMaxTaskRows / group));
  const int64_t first_q = block_q > 0 ? block_q : std::min<int64_t>(max_q, std::max<int64_t>(p.q_len, 1));
  const int64_t kv_options[2] = {block_kv > 0 ? block_kv : 128, 64}, head_pad = t->head_pad;
  auto total_of = [&](int64_t bq, int64_t bkv) { return PlanUb(group * bq, bkv, head_pad, elem, telem).total; };
  if (!FirstFit(first_q, block_q > 0, kv_options, block_kv > 0 ? 1 : 2, pf.ub_bytes, total_of, &t->block_q,
                &t->block_kv, &t->ub_bytes))
    return "tiling: head_dim " + std::to_string(p.head_dim) + " with " + std::to_string(group) +
           " query heads per KV head does not fit the " + std::to_string(pf.ub_bytes) + "-byte Unified Buffer";
  if (t->block_kv % 16) return "tiling: block_kv must be a multiple of 16";

  const int64_t m = group * t->block_q;
  Slices per_core;
  t->ws_q = per_core.Take(m * t->head_pad * elem);
  t->ws_k = per_core.Take(t->block_kv * t->head_pad * elem);
  t->ws_v = per_core.Take(t->block_kv * t->head_pad * elem);
  t->ws_p = per_core.Take(m * t->block_kv * elem);
  t->ws_per_core = per_core.End();

  int64_t most_blocks = 0;
  for (int64_t lq : p.q_lens) most_blocks = std::max(most_blocks, CeilDiv(lq, t->block_q));
  t->k_prepass = !p.attrs.key_rotated && (p.attrs.with_rotated_key || most_blocks >= kPrepassMinQueryBlocks);
  t->ws_keys = -1;
  if (t->k_prepass && !p.attrs.with_rotated_key) t->ws_keys = t->core_num * t->ws_per_core;
  return "";
}

inline int64_t QueryRows(const RfaTiling &t) { return t.layout == 3 ? t.q_len : t.batch * t.q_len; }
inline int64_t KeyRows(const RfaTiling &t) { return t.layout == 3 ? t.kv_len : t.batch * t.kv_len; }

inline int64_t KeyElements(const RfaTiling &t) {
  return (t.layout == 3 ? t.kv_len : t.batch * t.kv_len) * t.kv_heads * t.head_dim;
}

inline int64_t WorkspaceBytes(const RfaTiling &t, int64_t elem) {
  const int64_t keys = t.ws_keys >= 0 ? RoundUp(KeyElements(t) * elem, 512) : 0;
  return kSysWorkspaceBytes + t.core_num * t.ws_per_core + keys;
}

// The backward's plan: block_kv 64 (halved to 32, then 16, if nothing fits), block_q up to 64
// (halved until the UB plan fits), the head-major shared workspace and the per-core P/dS tiles.
// has_dlse / has_drk: whether d_softmax_lse / d_rotated_key are present (rfa::ValidateGradCall).
inline std::string PlanGradTiling(const Problem &p, const Platform &pf, bool has_dlse, bool has_drk, RfaTiling *t,
                                  RfaGradPlan *g, int64_t block_q = 0, int64_t block_kv = 0) {
  const std::string refused = FillProblem(p, pf, t);
  if (!refused.empty()) return refused;
  *g = RfaGradPlan{};
  const int64_t elem = ElemBytes(p.qkv_dtype), telem = ElemBytes(p.cos_dtype);
  int64_t longest_q = 1;
  for (int64_t lq : p.q_lens) longest_q = std::max(longest_q, lq);
  const int64_t first_q = block_q > 0 ? block_q : std::min<int64_t>(64, longest_q);
  const int64_t kv_options[3] = {block_kv > 0 ? block_kv : 64, 32, 16}, head_pad = t->head_pad;
  auto total_of = [&](int64_t bq, int64_t bkv) { return PlanGradUb(bq, bkv, head_pad, elem, telem).total; };
  if (!FirstFit(first_q, block_q > 0, kv_options, block_kv > 0 ? 1 : 3, pf.ub_bytes, total_of, &g->block_q,
                &g->block_kv, &g->ub_bytes))
    return "tiling: head_dim " + std::to_string(p.head_dim) + " does not fit the backward's " +
           std::to_string(pf.ub_bytes) + "-byte Unified Buffer";
  if (g->block_kv % 16) return "tiling: block_kv must be a multiple of 16";
  g->core_num = pf.vector_cores;
  g->has_dlse = has_dlse;
  g->has_drk = has_drk;
  g->q_rows = QueryRows(*t);
  g->kv_rows = KeyRows(*t);
  Slices shared, per_core;
  const int64_t q_elems = g->q_rows * t->q_heads * t->head_pad, kv_elems = g->kv_rows * t->kv_heads * t->head_pad;
  g->ws_qs = shared.Take(q_elems * elem);
  g->ws_do = shared.Take(q_elems * elem);
  g->ws_kr = shared.Take(kv_elems * elem);
  g->ws_v = shared.Take(kv_elems * elem);
  g->ws_lse = shared.Take(g->q_rows * t->q_heads * 4);
  g->ws_delta = shared.Take(g->q_rows * t->q_heads * 4);
  g->ws_cores = shared.End();
  g->ws_p = per_core.Take(g->block_q * g->block_kv * elem);
  g->ws_ds = per_core.Take(g->block_q * g->block_kv * elem);
  g->ws_per_core = per_core.End();
  return "";
}

inline int64_t GradWorkspaceBytes(const RfaGradPlan &g) {
  return kSysWorkspaceBytes + g.ws_cores + g.core_num * g.ws_per_core;
}

}  // namespace ascend
}  // namespace rfa
