// The RotaryFlashAttention problem as a kernel sees it: attributes, geometry in (batch, head,
// row) strides for every layout, and the validation shared by all backends (CPU kernel, Ascend
// tiling). Header-only and free of MindSpore/CANN so it can be unit-tested anywhere.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

namespace rfa {

enum class Layout { BNSD, BSND, BSH, TND };
enum class DType { F32, F16, BF16 };
// The arithmetic of Q K^T and P V (the compute_dtype attribute): Auto resolves per call (bfloat16 for
// bfloat16 inputs where the kernel can, float32 otherwise); softmax statistics and O stay float32.
enum class Compute { Auto, F32, BF16 };

// Version of the C layout below (Attrs) and of the direct-call entries' arguments; bump it with any
// change to either (ms_rope_attention/cpu_direct.py holds the same number).
constexpr int64_t kAbiVersion = 3;

struct Attrs {
  int64_t head_num = 0;
  Layout layout = Layout::BNSD;
  int64_t rotary_mode = 0;
  int64_t rotary_dim = 0;
  float scale = 0.0f;
  bool causal = true;
  bool with_lse = false;
  bool with_rotated_key = false;
  bool key_rotated = false;  // key already carries RoPE (a rotated KV cache): rotate query only
  Compute compute = Compute::Auto;
};

// One tensor's element strides: D is always contiguous. A constructor, not default member
// initialisers: op_host includes this header and CANN compiles it as C++11, where `= {b, h, r}`
// needs one.
struct Strides {
  int64_t batch, head, row;
  Strides(int64_t b = 0, int64_t h = 0, int64_t r = 0) : batch(b), head(h), row(r) {}
};

// A paged key/value cache (RotaryPagedAttention): key j of sequence b is row j % block_size of
// block tables[b * max_blocks + j / block_size] of a (num_blocks, block_size, Nkv, D) cache. Null
// tables: keys are rows kv_start[b] + j of one array, as for every other call.
struct PagedKv {
  const int32_t *tables = nullptr;
  int64_t block_size = 0, max_blocks = 0;
};

struct Problem {
  Attrs attrs;
  int64_t batch = 0, q_heads = 0, kv_heads = 0, head_dim = 0, rotary_dim = 0;
  int64_t q_len = 0, kv_len = 0;      // per sequence (batch layouts); token totals for TND
  int64_t table_rows = 0;
  float scale = 0.0f;
  DType qkv_dtype = DType::F32, cos_dtype = DType::F32, sin_dtype = DType::F32;
  Strides q, kv, lse;                 // lse strides are (batch, head, row) in elements
  std::vector<int64_t> q_start, q_lens, kv_start, kv_lens;  // per sequence, in rows
  PagedKv paged;
  bool bf16 = false;  // the resolved arithmetic (ResolveCompute): bfloat16 products, float32 accumulation
};

inline bool ParseLayout(const std::string &s, Layout *out) {
  if (s == "BNSD") *out = Layout::BNSD;
  else if (s == "BSND") *out = Layout::BSND;
  else if (s == "BSH") *out = Layout::BSH;
  else if (s == "TND") *out = Layout::TND;
  else return false;
  return true;
}

inline bool ParseDType(const std::string &s, DType *out) {
  if (s == "float32") *out = DType::F32;
  else if (s == "float16") *out = DType::F16;
  else if (s == "bfloat16") *out = DType::BF16;
  else return false;
  return true;
}

// The compute_dtype attribute's text. float16 is refused by name: x86 has no float16 dot product that
// accumulates in float32 (AVX512-FP16's vfmadd*ph accumulate in float16), so "float16 arithmetic"
// would be float32 arithmetic on rounded inputs at float32 speed.
inline std::string ParseCompute(const std::string &s, Compute *out) {
  if (s == "auto") *out = Compute::Auto;
  else if (s == "float32") *out = Compute::F32;
  else if (s == "bfloat16") *out = Compute::BF16;
  else if (s == "float16")
    return "compute_dtype: 'float16' is not offered by the attention ops: x86 has no float16 dot product "
           "accumulating in float32; use 'auto', 'float32' or 'bfloat16'";
  else return "compute_dtype: expected one of auto, float32, bfloat16, got '" + s + "'";
  return "";
}

// The arithmetic a call runs (p->bf16) for its inputs' dtype: Auto is bfloat16 for bfloat16 inputs
// where the kernel has bfloat16 dot products (`native_bf16`), float32 otherwise; an explicit
// bfloat16 the kernel cannot compute is refused (`build`: what it runs, for the message).
inline std::string ResolveCompute(Compute c, bool native_bf16, const std::string &build, Problem *p) {
  if (c == Compute::BF16 && !native_bf16)
    return "compute_dtype: 'bfloat16' needs the avx512_bf16 instructions (vdpbf16ps) and the kernel's avx512 build; "
           "this is " + build + "; use 'auto' or 'float32'";
  p->bf16 = c == Compute::BF16 || (c == Compute::Auto && native_bf16 && p->qkv_dtype == DType::BF16);
  return "";
}

inline std::string ShapeText(int ndim, const int64_t *shape) {
  std::string s = "(";
  for (int i = 0; i < ndim; ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + (ndim == 1 ? ",)" : ")");
}

// The dtype name of tensor `idx` of a launch; "none" for a null name (an absent optional input, or
// a direct caller's mistake: never dereferenced).
inline std::string DTypeName(const char *const *dtypes, int idx) {
  return dtypes && dtypes[idx] ? dtypes[idx] : "none";
}

// Whether the element count of `shape` fits in int64 with room for the kernels' index arithmetic
// (below 2^62); dimensions must be >= 0.
inline bool CountFits(int ndim, const int64_t *shape) {
  const int64_t limit = int64_t(1) << 62;
  int64_t count = 1;
  for (int i = 0; i < ndim; ++i) {
    if (shape[i] < 0) return false;
    if (shape[i] != 0 && count > limit / shape[i]) return false;
    count *= shape[i];
  }
  return true;
}

inline bool CountIsZero(int ndim, const int64_t *shape) {
  for (int i = 0; i < ndim; ++i)
    if (shape[i] == 0) return true;
  return false;
}

// Raw view of the op's tensors: rank, shape, dtype name and (for the TND offsets) data.
struct TensorDesc {
  int ndim = 0;
  const int64_t *shape = nullptr;
  std::string dtype;
};

// Geometry of q/k/v for the batch layouts: (batch, rows, heads, head_dim) + strides.
inline std::string SplitHeads(const char *name, const TensorDesc &t, Layout layout, int64_t heads_hint,
                              int64_t head_dim_hint, int64_t *b, int64_t *s, int64_t *n, int64_t *d, Strides *st) {
  const int want = (layout == Layout::BNSD || layout == Layout::BSND) ? 4 : 3;
  if (t.ndim != want)
    return std::string(name) + ": expected rank " + std::to_string(want) + " for this layout, got shape " +
           ShapeText(t.ndim, t.shape);
  for (int i = 0; i < t.ndim; ++i)
    if (t.shape[i] < 0) return std::string(name) + ": dynamic dimension at run time " + ShapeText(t.ndim, t.shape);
  if (!CountFits(t.ndim, t.shape))
    return std::string(name) + ": expected fewer than 2^62 elements, got shape " + ShapeText(t.ndim, t.shape);
  switch (layout) {
    case Layout::BNSD:
      *b = t.shape[0]; *n = t.shape[1]; *s = t.shape[2]; *d = t.shape[3];
      *st = {(*n) * (*s) * (*d), (*s) * (*d), *d};
      break;
    case Layout::BSND:
      *b = t.shape[0]; *s = t.shape[1]; *n = t.shape[2]; *d = t.shape[3];
      *st = {(*s) * (*n) * (*d), *d, (*n) * (*d)};
      break;
    case Layout::BSH: {
      *b = t.shape[0]; *s = t.shape[1];
      if (heads_hint > 0) {
        if (t.shape[2] % heads_hint) return std::string(name) + ": hidden size not a multiple of head_num";
        *n = heads_hint; *d = t.shape[2] / heads_hint;
      } else {
        if (head_dim_hint <= 0 || t.shape[2] % head_dim_hint)
          return std::string(name) + ": hidden size not a multiple of head_dim";
        *d = head_dim_hint; *n = t.shape[2] / head_dim_hint;
      }
      *st = {(*s) * t.shape[2], *d, t.shape[2]};
      break;
    }
    case Layout::TND:
      *b = 1; *s = t.shape[0]; *n = t.shape[1]; *d = t.shape[2];
      *st = {0, *d, (*n) * (*d)};
      break;
  }
  return "";
}

// head_dim, rotary_dim and the cos/sin tables (shapes, dtypes) against the attributes; fills the
// problem's head_dim, rotary_dim, table_rows, scale and table dtypes. Shared by every op that rotates.
inline std::string CheckRotary(const Attrs &a, int64_t qd, const TensorDesc &c, const TensorDesc &s, Problem *p) {
  if (a.rotary_mode != 0 && a.rotary_mode != 1)
    return "rotary_mode: expected 0 (rotate-half) or 1 (interleaved), got " + std::to_string(a.rotary_mode);
  if (!ParseDType(c.dtype, &p->cos_dtype)) return "cos: expected dtype float32, float16 or bfloat16, got " + c.dtype;
  if (!ParseDType(s.dtype, &p->sin_dtype)) return "sin: expected dtype float32, float16 or bfloat16, got " + s.dtype;
  if (s.dtype != c.dtype) return "sin: expected the same dtype as cos (" + c.dtype + "), got " + s.dtype;
  if (qd < 2 || qd % 2) return "query: head_dim must be even and >= 2, got " + std::to_string(qd);
  const int64_t rd = a.rotary_dim > 0 ? a.rotary_dim : qd;
  if (rd % 2 || rd > qd) return "rotary_dim: expected an even value <= head_dim " + std::to_string(qd) + ", got " + std::to_string(rd);
  for (const TensorDesc *t : {&c, &s}) {
    const char *name = t == &c ? "cos" : "sin";
    if (t->ndim != 2 || t->shape[1] != rd)
      return std::string(name) + ": expected shape (max_positions, " + std::to_string(rd) + "), got " + ShapeText(t->ndim, t->shape);
  }
  if (c.shape[0] != s.shape[0]) return "sin: expected the same shape as cos " + ShapeText(c.ndim, c.shape);
  if (!CountFits(c.ndim, c.shape)) return "cos: expected fewer than 2^62 elements, got shape " + ShapeText(c.ndim, c.shape);
  p->head_dim = qd; p->rotary_dim = rd;
  p->table_rows = c.shape[0];
  p->scale = a.scale > 0 ? a.scale : 1.0f / std::sqrt(static_cast<float>(qd));
  if (!std::isfinite(p->scale)) return "scale: expected a finite positive value";
  return "";
}

// Validate everything and fill `p`. Returns "" or an error naming the argument.
// `tensors` are query, key, value, cos, sin, actual_seq_qlen, actual_seq_kvlen (the last two may
// have dtype "none"); `q_ends`/`kv_ends` point to the TND offsets' data (may be null otherwise).
inline std::string BuildProblem(const Attrs &a, const TensorDesc *tensors, const int64_t *q_ends,
                                const int64_t *kv_ends, Problem *p) {
  p->attrs = a;
  const TensorDesc &q = tensors[0], &k = tensors[1], &v = tensors[2], &c = tensors[3], &s = tensors[4];
  if (!ParseDType(q.dtype, &p->qkv_dtype))
    return "query: expected dtype float32, float16 or bfloat16, got " + q.dtype;
  if (k.dtype != q.dtype) return "key: expected the same dtype as query (" + q.dtype + "), got " + k.dtype;
  if (v.dtype != q.dtype) return "value: expected the same dtype as query (" + q.dtype + "), got " + v.dtype;
  if (a.layout == Layout::BSH && a.head_num <= 0) return "head_num: required for input_layout BSH";

  int64_t qb, qs, qn, qd, kb, ks, kn, kd;
  std::string err = SplitHeads("query", q, a.layout, a.head_num, 0, &qb, &qs, &qn, &qd, &p->q);
  if (!err.empty()) return err;
  Strides vst;
  err = SplitHeads("key", k, a.layout, 0, qd, &kb, &ks, &kn, &kd, &p->kv);
  if (!err.empty()) return err;
  if (v.ndim != k.ndim) return "value: expected the same shape as key " + ShapeText(k.ndim, k.shape);
  for (int i = 0; i < k.ndim; ++i)
    if (v.shape[i] != k.shape[i])
      return "value: expected the same shape as key " + ShapeText(k.ndim, k.shape) + ", got " + ShapeText(v.ndim, v.shape);
  if (qn < 1) return "query: expected at least one head, got shape " + ShapeText(q.ndim, q.shape);
  if (kn < 1) return "key: expected at least one head, got shape " + ShapeText(k.ndim, k.shape);
  if (a.head_num > 0 && qn != a.head_num)
    return "head_num: " + std::to_string(a.head_num) + " does not match query's " + std::to_string(qn) + " heads";
  if (kb != qb) return "key: batch " + std::to_string(kb) + " does not match query's batch " + std::to_string(qb);
  if (kd != qd) return "key: head_dim " + std::to_string(kd) + " does not match query's " + std::to_string(qd);
  if (kn < 1 || qn % kn)
    return "key: " + std::to_string(kn) + " heads; query's " + std::to_string(qn) + " heads must be a multiple of them";
  p->q_heads = qn; p->kv_heads = kn;
  err = CheckRotary(a, qd, c, s, p);
  if (!err.empty()) return err;
  p->q_len = qs; p->kv_len = ks;

  const bool tnd = a.layout == Layout::TND;
  const bool has_q = tensors[5].dtype != "none";
  const bool has_kv = tensors[6].dtype != "none";
  p->q_start.clear(); p->q_lens.clear(); p->kv_start.clear(); p->kv_lens.clear();
  if (tnd) {
    if (!has_q || !has_kv) return "actual_seq_qlen, actual_seq_kvlen: both required for input_layout TND";
    for (int i = 5; i < 7; ++i)
      if (tensors[i].ndim != 1 || tensors[i].dtype != "int64")
        return std::string(i == 5 ? "actual_seq_qlen" : "actual_seq_kvlen") + ": expected a 1-D int64 tensor, got " +
               tensors[i].dtype + " " + ShapeText(tensors[i].ndim, tensors[i].shape);
    if (!q_ends || !kv_ends) return "actual_seq_qlen, actual_seq_kvlen: no data";
    const int64_t nb = tensors[5].shape[0];
    if (nb < 1) return "actual_seq_qlen: expected at least one sequence";
    if (tensors[6].shape[0] != nb)
      return "actual_seq_kvlen: expected " + std::to_string(nb) + " sequences like actual_seq_qlen";
    int64_t prev_q = 0, prev_kv = 0;
    for (int64_t i = 0; i < nb; ++i) {
      const int64_t lq = q_ends[i] - prev_q, lk = kv_ends[i] - prev_kv;
      if (lq < 0) return "actual_seq_qlen: cumulative end offsets must be non-decreasing";
      if (lk < 0) return "actual_seq_kvlen: cumulative end offsets must be non-decreasing";
      if (lq > lk) return "actual_seq_qlen: sequence " + std::to_string(i) + " has q_len " + std::to_string(lq) +
                          " > kv_len " + std::to_string(lk);
      if (lk > p->table_rows) return "cos: table has " + std::to_string(p->table_rows) + " positions, sequence " +
                                     std::to_string(i) + " needs " + std::to_string(lk);
      p->q_start.push_back(prev_q); p->q_lens.push_back(lq);
      p->kv_start.push_back(prev_kv); p->kv_lens.push_back(lk);
      prev_q = q_ends[i]; prev_kv = kv_ends[i];
    }
    if (prev_q != qs) return "actual_seq_qlen: last offset must equal the token count " + std::to_string(qs) + ", got " + std::to_string(prev_q);
    if (prev_kv != ks) return "actual_seq_kvlen: last offset must equal the token count " + std::to_string(ks) + ", got " + std::to_string(prev_kv);
    p->batch = nb;
    p->lse = {0, 1, qn};  // (T, N)
  } else {
    if (has_q || has_kv) return "actual_seq_qlen, actual_seq_kvlen: only for input_layout TND";
    if (qs > ks) return "query: q_len " + std::to_string(qs) + " must be <= kv_len " + std::to_string(ks);
    if (ks > p->table_rows) return "cos: table has " + std::to_string(p->table_rows) + " positions, kv_len " +
                                   std::to_string(ks) + " needs at least " + std::to_string(ks);
    p->batch = qb;
    for (int64_t b = 0; b < qb; ++b) {
      p->q_start.push_back(0); p->q_lens.push_back(qs);
      p->kv_start.push_back(0); p->kv_lens.push_back(ks);
    }
    p->lse = {qn * qs, qs, 1};  // (B, N, Sq)
  }
  return "";
}

// Output shapes of the op for given input shapes (the C++ InferShape); disabled outputs are (0,).
// A dimension past query's rank (a malformed call MindSpore's infer may still make) reads as -1
// (unknown): never a read past the shape.
inline std::vector<std::vector<int64_t>> InferShapes(const Attrs &a, int ndims_q, const int64_t *q_shape,
                                                      int ndims_k, const int64_t *k_shape) {
  ndims_q = q_shape ? std::max(ndims_q, 0) : 0;
  ndims_k = k_shape ? std::max(ndims_k, 0) : 0;
  auto q = [&](int i) { return i < ndims_q ? q_shape[i] : int64_t(-1); };
  std::vector<int64_t> out(q_shape, q_shape + ndims_q);
  std::vector<int64_t> lse{0};
  if (a.with_lse) {
    if (a.layout == Layout::TND) lse = {q(0), q(1)};
    else if (a.layout == Layout::BNSD) lse = {q(0), q(1), q(2)};
    else if (a.layout == Layout::BSND) lse = {q(0), q(2), q(1)};
    else lse = {q(0), a.head_num, q(1)};
  }
  std::vector<int64_t> rk{0};
  if (a.with_rotated_key) rk.assign(k_shape, k_shape + ndims_k);
  return {out, lse, rk};
}

// The whole check of one launch in the aot calling convention (7 inputs then 3 outputs: ndims,
// shapes, dtype names, data pointers): inputs, TND offsets (read only once their rank and dtype are
// right), and the output buffers against InferShapes. Every backend runs it before touching memory.
constexpr int kInputs = 7, kOutputs = 3;
// The forward's inputs by position, for messages about a launch's arrays.
inline const char *InputName(int i) {
  static const char *const names[kInputs] = {"query", "key", "value", "cos", "sin", "actual_seq_qlen",
                                             "actual_seq_kvlen"};
  return i >= 0 && i < kInputs ? names[i] : "input";
}
// BuildProblem on the forward's 7 inputs of a launch (the backward's first 7 are the same): the TND
// offsets' data is read only once their rank and dtype are right.
inline std::string ProblemOfCall(const Attrs &attrs, const int *ndims, int64_t *const *shapes,
                                 const char *const *dtypes, void *const *params, Problem *problem) {
  if (!ndims || !shapes || !dtypes || !params) return "launch: null ndims, shapes, dtypes or params array";
  TensorDesc tensors[kInputs];
  for (int i = 0; i < kInputs; ++i) {
    tensors[i].dtype = DTypeName(dtypes, i);
    if (tensors[i].dtype == "none") continue;  // an absent optional input: its shape is never read
    if (ndims[i] < 0 || ndims[i] > 8 || (ndims[i] > 0 && !shapes[i]))
      return std::string(InputName(i)) + " (input " + std::to_string(i) + "): expected a rank 0..8 with a shape, got rank " +
             std::to_string(ndims[i]);
    tensors[i].ndim = ndims[i];
    tensors[i].shape = shapes[i];
  }
  const bool offsets_ok = tensors[5].dtype == "int64" && tensors[5].ndim == 1 && tensors[6].dtype == "int64" &&
                          tensors[6].ndim == 1 && params[5] && params[6];
  return BuildProblem(attrs, tensors, offsets_ok ? static_cast<const int64_t *>(params[5]) : nullptr,
                      offsets_ok ? static_cast<const int64_t *>(params[6]) : nullptr, problem);
}

// Data pointers of the 5 tensor inputs, after their shapes passed: one with elements must have data.
inline std::string CheckInputData(const int *ndims, int64_t *const *shapes, void *const *params) {
  for (int i = 0; i < 5; ++i)
    if (!params[i] && !CountIsZero(ndims[i], shapes[i])) return std::string(InputName(i)) + ": null data pointer";
  return "";
}

inline std::string ValidateCall(const Attrs &attrs, const int *ndims, int64_t *const *shapes, const char *const *dtypes,
                                void *const *params, Problem *problem) {
  std::string err = ProblemOfCall(attrs, ndims, shapes, dtypes, params, problem);
  if (!err.empty()) return err;
  const auto expect = InferShapes(attrs, ndims[0], shapes[0], ndims[1], shapes[1]);
  const char *names[kOutputs] = {"attention_out", "softmax_lse", "rotated_key"};
  for (int o = 0; o < kOutputs; ++o) {
    const int idx = kInputs + o;
    bool same = static_cast<size_t>(ndims[idx]) == expect[o].size() && (ndims[idx] == 0 || shapes[idx]);
    for (int i = 0; same && i < ndims[idx]; ++i) same = shapes[idx][i] == expect[o][i];
    if (!same)
      return std::string(names[o]) + ": output buffer has shape " +
             (shapes[idx] ? ShapeText(ndims[idx], shapes[idx]) : std::string("(null)"));
  }
  const std::string q_dtype = DTypeName(dtypes, 0), k_dtype = DTypeName(dtypes, 1);
  if (DTypeName(dtypes, kInputs) != q_dtype) return "attention_out: expected query's dtype";
  if (attrs.with_lse && DTypeName(dtypes, kInputs + 1) != "float32") return "softmax_lse: expected float32";
  if (attrs.with_rotated_key && DTypeName(dtypes, kInputs + 2) != k_dtype) return "rotated_key: expected key's dtype";
  err = CheckInputData(ndims, shapes, params);
  if (!err.empty()) return err;
  const bool wanted[kOutputs] = {true, attrs.with_lse, attrs.with_rotated_key};
  for (int o = 0; o < kOutputs; ++o)
    if (wanted[o] && !params[kInputs + o] && !CountIsZero(ndims[kInputs + o], shapes[kInputs + o]))
      return std::string(names[o]) + ": null data pointer";
  return "";
}

// Whether tensor `idx` of a launch has `expect` shape and dtype `dtype`; "" or an error naming it.
inline std::string CheckTensor(const char *name, int idx, const int *ndims, int64_t *const *shapes,
                               const char *const *dtypes, const std::vector<int64_t> &expect, const std::string &dtype) {
  bool same = static_cast<size_t>(ndims[idx]) == expect.size() && (ndims[idx] == 0 || shapes[idx]);
  for (int i = 0; same && i < ndims[idx]; ++i) same = shapes[idx][i] == expect[i];
  const std::string got = DTypeName(dtypes, idx);
  if (!same || got != dtype)
    return std::string(name) + ": expected shape " + ShapeText(static_cast<int>(expect.size()), expect.data()) +
           " and dtype " + dtype + ", got " + (shapes[idx] ? ShapeText(ndims[idx], shapes[idx]) : "(null)") + " " + got;
  return "";
}

// The backward op (RotaryFlashAttentionGrad) in the aot calling convention: the forward's 7 inputs,
// then attention_out, softmax_lse (the forward's, always emitted for training), d_attention_out,
// d_softmax_lse and d_rotated_key (both optional: dtype "none", or an empty (0,) tensor, when the
// forward output was not used); outputs d_query, d_key, d_value. Everything is checked before any
// memory is read; `has_dlse` / `has_drk` say whether the optional gradients are present.
constexpr int kGradInputs = 12, kGradOutputs = 3;
inline std::string ValidateGradCall(const Attrs &attrs, const int *ndims, int64_t *const *shapes,
                                    const char *const *dtypes, void *const *params, Problem *problem, bool *has_dlse,
                                    bool *has_drk) {
  std::string err = ProblemOfCall(attrs, ndims, shapes, dtypes, params, problem);
  if (!err.empty()) return err;
  err = CheckInputData(ndims, shapes, params);
  if (!err.empty()) return err;
  Attrs all = attrs;
  all.with_lse = all.with_rotated_key = true;
  const auto fwd = InferShapes(all, ndims[0], shapes[0], ndims[1], shapes[1]);
  const std::vector<int64_t> v_shape(shapes[2], shapes[2] + ndims[2]);
  const std::string qd = DTypeName(dtypes, 0);
  auto absent = [&](int idx) {
    const std::string d = DTypeName(dtypes, idx);
    return d == "none" || (ndims[idx] == 1 && shapes[idx][0] == 0) || !params[idx];
  };
  *has_dlse = !absent(10);
  *has_drk = !absent(11);
  const struct { const char *name; int idx; const std::vector<int64_t> &shape; std::string dtype; bool check; } want[] = {
      {"attention_out", 7, fwd[0], qd, true},
      {"softmax_lse", 8, fwd[1], "float32", true},
      {"d_attention_out", 9, fwd[0], qd, true},
      {"d_softmax_lse", 10, fwd[1], "float32", *has_dlse},
      {"d_rotated_key", 11, fwd[2], qd, *has_drk},
      {"d_query", kGradInputs, fwd[0], qd, true},
      {"d_key", kGradInputs + 1, fwd[2], qd, true},
      {"d_value", kGradInputs + 2, v_shape, qd, true},
  };
  for (const auto &w : want) {
    if (!w.check) continue;
    err = CheckTensor(w.name, w.idx, ndims, shapes, dtypes, w.shape, w.dtype);
    if (!err.empty()) return err;
    if (!params[w.idx]) {
      bool empty = false;
      for (int64_t d : w.shape) empty = empty || d == 0;
      if (!empty) return std::string(w.name) + ": null data pointer";
    }
  }
  return "";
}

}  // namespace rfa
