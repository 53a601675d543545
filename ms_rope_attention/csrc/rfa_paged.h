// The paged KV cache's two ops as a kernel sees them, validated before any memory is read (block
// tables, lengths, positions and slots included):
//   RotaryPagedAttention  queries of a few tokens per sequence against a (num_blocks, block_size,
//                         Nkv, D) cache read in place through block tables: the decode path's Problem
//                         with PagedKv set;
//   RotaryCacheWrite      new keys rotated once at their own positions and written, with the values,
//                         into the caches at a slot mapping (-1: skipped); MindSpore's
//                         ReshapeAndCache with RoPE in the same pass.
// Contracts: op_info/rotary_paged_attention.yaml and op_info/rotary_cache_write.yaml.
#pragma once
#include <algorithm>
#include <string>
#include <vector>

#include "rfa_problem.h"

namespace rfa {

constexpr int64_t kBlockSizeMultiple = 16;  // MindFormers' default 16 and vLLM-MindSpore's 128 are multiples
constexpr int64_t kPagedMaxQueries = 16;    // query tokens per sequence: one, or a speculative block

constexpr int kPagedInputs = 8, kPagedOutputs = 2;
inline const char *PagedName(int i) {
  static const char *const names[kPagedInputs + kPagedOutputs] = {
      "query", "key_cache", "value_cache", "cos", "sin", "block_tables", "context_lens", "q_seq_lens",
      "attention_out", "softmax_lse"};
  return i >= 0 && i < kPagedInputs + kPagedOutputs ? names[i] : "tensor";
}

constexpr int kWriteInputs = 8, kWriteOutputs = 1;
inline const char *WriteName(int i) {
  static const char *const names[kWriteInputs + kWriteOutputs] = {
      "key", "value", "cos", "sin", "positions", "slot_mapping", "key_cache", "value_cache", "written"};
  return i >= 0 && i < kWriteInputs + kWriteOutputs ? names[i] : "tensor";
}

// The launch's arrays as TensorDescs: every one required, rank 0..8 with a shape, no negative or
// overflowing dimension, and data behind it when it has elements.
inline std::string DescribeAll(int count, const char *(*name)(int), const int *ndims, int64_t *const *shapes,
                               const char *const *dtypes, void *const *params, TensorDesc *out) {
  if (!ndims || !shapes || !dtypes || !params) return "launch: null ndims, shapes, dtypes or params array";
  for (int i = 0; i < count; ++i) {
    if (ndims[i] < 0 || ndims[i] > 8 || (ndims[i] > 0 && !shapes[i]))
      return std::string(name(i)) + ": expected a rank 0..8 with a shape, got rank " + std::to_string(ndims[i]);
    out[i].ndim = ndims[i];
    out[i].shape = shapes[i];
    out[i].dtype = DTypeName(dtypes, i);
    if (!CountFits(out[i].ndim, out[i].shape))
      return std::string(name(i)) + ": expected non-negative dimensions and fewer than 2^62 elements, got shape " +
             ShapeText(out[i].ndim, out[i].shape);
    if (!params[i] && !CountIsZero(out[i].ndim, out[i].shape)) return std::string(name(i)) + ": null data pointer";
  }
  return "";
}

inline bool SameShape(const TensorDesc &t, const std::vector<int64_t> &shape) {
  if (static_cast<size_t>(t.ndim) != shape.size()) return false;
  for (int i = 0; i < t.ndim; ++i)
    if (t.shape[i] != shape[i]) return false;
  return true;
}

inline std::string ExpectShape(const char *name, const TensorDesc &t, const std::vector<int64_t> &shape) {
  if (SameShape(t, shape)) return "";
  return std::string(name) + ": expected shape " + ShapeText(static_cast<int>(shape.size()), shape.data()) + ", got " +
         ShapeText(t.ndim, t.shape);
}

inline std::string ExpectInt32(const char *name, const TensorDesc &t) {
  return t.dtype == "int32" ? "" : std::string(name) + ": expected dtype int32, got " + t.dtype;
}

// A (num_blocks, block_size, kv_heads, head_dim) cache and its twin: shape, dtype, block size.
inline std::string CheckCaches(const TensorDesc &kc, const TensorDesc &vc, const char *kname, const char *vname) {
  DType dt;
  if (!ParseDType(kc.dtype, &dt)) return std::string(kname) + ": expected dtype float32, float16 or bfloat16, got " + kc.dtype;
  if (vc.dtype != kc.dtype)
    return std::string(vname) + ": expected the same dtype as " + kname + " (" + kc.dtype + "), got " + vc.dtype;
  if (kc.ndim != 4)
    return std::string(kname) + ": expected shape (num_blocks, block_size, kv_heads, head_dim), got " +
           ShapeText(kc.ndim, kc.shape);
  const std::vector<int64_t> shape(kc.shape, kc.shape + 4);
  std::string err = ExpectShape(vname, vc, shape);
  if (!err.empty()) return err;
  if (kc.shape[1] < 1 || kc.shape[1] % kBlockSizeMultiple)
    return std::string(kname) + ": block_size (dimension 1) must be a positive multiple of " +
           std::to_string(kBlockSizeMultiple) + ", got " + std::to_string(kc.shape[1]);
  if (kc.shape[2] < 1) return std::string(kname) + ": expected at least one KV head, got shape " + ShapeText(4, kc.shape);
  return "";
}

// Output shapes of RotaryPagedAttention (its C++ InferShape): attention_out as query; softmax_lse
// (tokens, heads) or (0,).
inline std::vector<std::vector<int64_t>> PagedOutputShapes(const Attrs &a, int ndims_q, const int64_t *q_shape) {
  ndims_q = q_shape ? std::max(ndims_q, 0) : 0;
  auto q = [&](int i) { return i < ndims_q ? q_shape[i] : int64_t(-1); };
  std::vector<int64_t> out(q_shape, q_shape + ndims_q);
  std::vector<int64_t> lse{0};
  if (a.with_lse) lse = {q(0), q(1)};
  return {out, lse};
}

// RotaryPagedAttention: validate the launch (8 inputs, 2 outputs) and fill `p` as a TND decode
// problem whose keys are the cache's rows reached through the block tables. The attributes used
// are head_num, rotary_mode, rotary_dim, scale, key_rotated and with_lse; the op is always causal
// (query i of a sequence of context_len keys is at position context_len - q_len + i).
inline std::string ValidatePagedCall(const Attrs &attrs, const int *ndims, int64_t *const *shapes,
                                     const char *const *dtypes, void *const *params, Problem *p) {
  TensorDesc t[kPagedInputs + kPagedOutputs];
  std::string err = DescribeAll(kPagedInputs + kPagedOutputs, PagedName, ndims, shapes, dtypes, params, t);
  if (!err.empty()) return err;
  const TensorDesc &q = t[0], &kc = t[1], &vc = t[2], &c = t[3], &s = t[4], &bt = t[5], &cl = t[6], &ql = t[7];
  Attrs a = attrs;
  a.layout = Layout::TND;
  a.causal = true;
  a.with_rotated_key = false;
  p->attrs = a;
  if (!ParseDType(q.dtype, &p->qkv_dtype)) return "query: expected dtype float32, float16 or bfloat16, got " + q.dtype;
  if (q.ndim != 3) return "query: expected shape (tokens, heads, head_dim), got " + ShapeText(q.ndim, q.shape);
  err = CheckCaches(kc, vc, "key_cache", "value_cache");
  if (!err.empty()) return err;
  if (kc.dtype != q.dtype) return "key_cache: expected the same dtype as query (" + q.dtype + "), got " + kc.dtype;
  const int64_t T = q.shape[0], N = q.shape[1], D = q.shape[2];
  const int64_t NB = kc.shape[0], BS = kc.shape[1], NKV = kc.shape[2];
  if (N < 1) return "query: expected at least one head, got shape " + ShapeText(3, q.shape);
  if (a.head_num > 0 && N != a.head_num)
    return "head_num: " + std::to_string(a.head_num) + " does not match query's " + std::to_string(N) + " heads";
  if (kc.shape[3] != D)
    return "key_cache: head_dim " + std::to_string(kc.shape[3]) + " does not match query's " + std::to_string(D);
  if (N % NKV)
    return "key_cache: " + std::to_string(NKV) + " KV heads; query's " + std::to_string(N) + " heads must be a multiple of them";
  p->q_heads = N;
  p->kv_heads = NKV;
  err = CheckRotary(a, D, c, s, p);
  if (!err.empty()) return err;
  if (bt.ndim != 2) return "block_tables: expected shape (batch, max_blocks), got " + ShapeText(bt.ndim, bt.shape);
  const int64_t B = bt.shape[0], MB = bt.shape[1];
  if (B < 1) return "block_tables: expected at least one sequence, got shape " + ShapeText(2, bt.shape);
  for (const std::string &e : {ExpectInt32("block_tables", bt), ExpectInt32("context_lens", cl),
                               ExpectInt32("q_seq_lens", ql), ExpectShape("context_lens", cl, {B}),
                               ExpectShape("q_seq_lens", ql, {B})})
    if (!e.empty()) return e;
  const auto expect = PagedOutputShapes(a, 3, q.shape);
  err = ExpectShape("attention_out", t[8], expect[0]);
  if (err.empty()) err = ExpectShape("softmax_lse", t[9], expect[1]);
  if (!err.empty()) return err;
  if (t[8].dtype != q.dtype) return "attention_out: expected query's dtype " + q.dtype + ", got " + t[8].dtype;
  if (a.with_lse && t[9].dtype != "float32") return "softmax_lse: expected float32, got " + t[9].dtype;

  const int32_t *tables = static_cast<const int32_t *>(params[5]);
  const int32_t *ctx = static_cast<const int32_t *>(params[6]), *qlens = static_cast<const int32_t *>(params[7]);
  p->q_start.clear(); p->q_lens.clear(); p->kv_start.clear(); p->kv_lens.clear();
  int64_t total_q = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t lq = qlens[b], lk = ctx[b], seq = b;
    if (lq < 0 || lq > kPagedMaxQueries)
      return "q_seq_lens: sequence " + std::to_string(seq) + " has " + std::to_string(lq) + " query tokens, expected 0.." +
             std::to_string(kPagedMaxQueries);
    if (lk < lq)
      return "context_lens: sequence " + std::to_string(seq) + " holds " + std::to_string(lk) + " keys, fewer than its " +
             std::to_string(lq) + " query tokens (context_lens counts the step's own tokens)";
    const int64_t needed = (lk + BS - 1) / BS;
    if (needed > MB)
      return "context_lens: sequence " + std::to_string(seq) + " holds " + std::to_string(lk) + " keys, more than its " +
             std::to_string(MB) + " blocks of " + std::to_string(BS) + " hold";
    if (lk > p->table_rows)
      return "cos: table has " + std::to_string(p->table_rows) + " positions, sequence " + std::to_string(seq) +
             " needs " + std::to_string(lk);
    for (int64_t k = 0; k < needed; ++k) {
      const int64_t block = tables[b * MB + k];
      if (block < 0 || block >= NB)
        return "block_tables: sequence " + std::to_string(seq) + " needs block " + std::to_string(k) + " of " +
               std::to_string(needed) + " for its " + std::to_string(lk) + " keys, got " + std::to_string(block) +
               " (expected 0.." + std::to_string(NB - 1) + ")";
    }
    p->q_start.push_back(total_q); p->q_lens.push_back(lq);
    p->kv_start.push_back(0); p->kv_lens.push_back(lk);
    total_q += lq;
  }
  if (total_q != T)
    return "q_seq_lens: expected them to sum to query's " + std::to_string(T) + " tokens, got " + std::to_string(total_q);
  p->batch = B;
  p->head_dim = D;
  p->q_len = T;
  p->kv_len = NB * BS;
  p->q = Strides(0, D, N * D);
  p->kv = Strides(0, D, NKV * D);
  p->lse = Strides(0, 1, N);
  p->paged.tables = tables;
  p->paged.block_size = BS;
  p->paged.max_blocks = MB;
  return "";
}

// RotaryCacheWrite's problem: Problem carries the rotation (tables, dims, mode, key dtype).
struct CacheWrite {
  Problem rope;
  DType cache_dtype = DType::F32;
  int64_t tokens = 0, slots = 0;  // new tokens; cache rows (num_blocks * block_size)
  bool key_rotated = false;       // key already carries RoPE: written as it is
  const int32_t *positions = nullptr, *slot_mapping = nullptr;
};

// RotaryCacheWrite: validate the launch (8 inputs, 1 output) and fill `w`. A slot is a cache row
// (block * block_size + offset) or -1 (skipped); two tokens may not share a slot (the result would
// depend on which thread wrote last).
inline std::string ValidateCacheWrite(const Attrs &attrs, const int *ndims, int64_t *const *shapes,
                                      const char *const *dtypes, void *const *params, CacheWrite *w) {
  TensorDesc t[kWriteInputs + kWriteOutputs];
  std::string err = DescribeAll(kWriteInputs + kWriteOutputs, WriteName, ndims, shapes, dtypes, params, t);
  if (!err.empty()) return err;
  const TensorDesc &k = t[0], &v = t[1], &c = t[2], &s = t[3], &pos = t[4], &slots = t[5], &kc = t[6], &vc = t[7];
  Problem *p = &w->rope;
  p->attrs = attrs;
  w->key_rotated = attrs.key_rotated;
  if (!ParseDType(k.dtype, &p->qkv_dtype)) return "key: expected dtype float32, float16 or bfloat16, got " + k.dtype;
  if (v.dtype != k.dtype) return "value: expected the same dtype as key (" + k.dtype + "), got " + v.dtype;
  if (k.ndim != 3) return "key: expected shape (tokens, kv_heads, head_dim), got " + ShapeText(k.ndim, k.shape);
  err = ExpectShape("value", v, std::vector<int64_t>(k.shape, k.shape + 3));
  if (!err.empty()) return err;
  err = CheckCaches(kc, vc, "key_cache", "value_cache");
  if (!err.empty()) return err;
  ParseDType(kc.dtype, &w->cache_dtype);
  const int64_t T = k.shape[0], NKV = k.shape[1], D = k.shape[2];
  if (kc.shape[2] != NKV || kc.shape[3] != D)
    return "key_cache: expected (num_blocks, block_size, " + std::to_string(NKV) + ", " + std::to_string(D) +
           ") like key's heads and head_dim, got " + ShapeText(4, kc.shape);
  p->kv_heads = NKV;
  err = CheckRotary(attrs, D, c, s, p);
  if (!err.empty()) return err;
  for (const std::string &e : {ExpectInt32("positions", pos), ExpectInt32("slot_mapping", slots),
                               ExpectShape("positions", pos, {T}), ExpectShape("slot_mapping", slots, {T}),
                               ExpectInt32("written", t[8]), ExpectShape("written", t[8], {1})})
    if (!e.empty()) return e;
  w->tokens = T;
  w->slots = kc.shape[0] * kc.shape[1];
  w->positions = static_cast<const int32_t *>(params[4]);
  w->slot_mapping = static_cast<const int32_t *>(params[5]);
  std::vector<std::pair<int64_t, int64_t>> used;
  for (int64_t i = 0; i < T; ++i) {
    const int64_t slot = w->slot_mapping[i], at = w->positions[i];
    if (slot == -1) continue;
    if (slot < 0 || slot >= w->slots)
      return "slot_mapping: token " + std::to_string(i) + " has slot " + std::to_string(slot) + ", expected -1 (skip) or 0.." +
             std::to_string(w->slots - 1) + " (num_blocks * block_size)";
    if (!attrs.key_rotated && (at < 0 || at >= p->table_rows))
      return "positions: token " + std::to_string(i) + " is at " + std::to_string(at) + ", expected 0.." +
             std::to_string(p->table_rows - 1) + " (the cos/sin table's rows)";
    used.emplace_back(slot, i);
  }
  std::sort(used.begin(), used.end());
  for (size_t i = 1; i < used.size(); ++i)
    if (used[i].first == used[i - 1].first)
      return "slot_mapping: tokens " + std::to_string(used[i - 1].second) + " and " + std::to_string(used[i].second) +
             " both write slot " + std::to_string(used[i].first);
  return "";
}

}  // namespace rfa
