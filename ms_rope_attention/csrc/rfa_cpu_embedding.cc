// The token-embedding lookup of a half table on the CPU, as a MindSpore aot op: rows of a (V, H)
// float32 / float16 / bfloat16 table at the ids, as float32.
//
// Why: an embedding kept in the checkpoint's float16 / bfloat16 halves its memory, but MindSpore
// 2.10's CPU backend has no bfloat16 Gather, and a float16 Gather followed by a Cast writes the rows
// twice; this reads each row once and converts it as it is copied (weight_rows.h). An id outside
// [0, V) is refused with its position before anything is written.
//
// Entries: RfaEmbedding (ids (...) int32/int64, table (V, H)) -> y (..., H) float32;
// RfaEmbeddingInferShape / RfaEmbeddingInferType; RfaEmbeddingLastError.
#include <algorithm>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include "aot_abi.h"
#include "last_error.h"
#include "rfa_problem.h"  // rfa::ShapeText
#include "weight_rows.h"

#define RFA_EXPORT __attribute__((visibility("default")))

namespace {

using rfa::ShapeText;

rfa::LastError g_last_error("RfaEmbedding");

struct Lookup {
  int64_t tokens = 1, vocab = 0, hidden = 0;
  bool ids64 = false;
  std::string table_dtype;
};

// Checks ids (...) int32/int64, table (V, H) float32/float16/bfloat16 and y ids.shape + (H,) float32.
std::string Validate(const int *ndims, int64_t *const *shapes, const char *const *dtypes, Lookup *l) {
  if (!ndims || !shapes || !dtypes) return "launch: null ndims, shapes or dtypes array";
  const char *names[3] = {"ids", "table", "y"};
  for (int i = 0; i < 3; ++i)
    if (ndims[i] < 0 || ndims[i] > 8 || !shapes[i] || !dtypes[i])
      return std::string(names[i]) + ": expected a rank 0..8 with a shape and a dtype, got rank " +
             std::to_string(ndims[i]);
  const std::string ids = dtypes[0], table = dtypes[1], y = dtypes[2];
  if (ids != "int32" && ids != "int64") return "ids: expected int32 or int64, got " + ids;
  if (table != "float32" && table != "float16" && table != "bfloat16")
    return "table: expected float32, float16 or bfloat16, got " + table;
  if (y != "float32") return "y: expected float32, got " + y;
  l->ids64 = ids == "int64";
  l->table_dtype = table;
  if (ndims[1] != 2) return "table: expected 2 dimensions (vocab, hidden), got " + ShapeText(ndims[1], shapes[1]);
  l->vocab = shapes[1][0];
  l->hidden = shapes[1][1];
  if (l->vocab < 0 || l->hidden < 0) return "table: expected a concrete shape, got " + ShapeText(2, shapes[1]);
  for (int i = 0; i < ndims[0]; ++i) {
    if (shapes[0][i] < 0) return "ids: expected a concrete shape, got " + ShapeText(ndims[0], shapes[0]);
    if (shapes[0][i] && l->tokens > (int64_t(1) << 62) / shapes[0][i] / std::max<int64_t>(1, l->hidden))
      return "ids: expected fewer than 2^62 output elements, got " + ShapeText(ndims[0], shapes[0]);
    l->tokens *= shapes[0][i];
  }
  bool same = ndims[2] == ndims[0] + 1 && shapes[2][ndims[0]] == l->hidden;
  for (int i = 0; same && i < ndims[0]; ++i) same = shapes[2][i] == shapes[0][i];
  if (!same)
    return "y: expected shape ids.shape + (hidden,), got y " + ShapeText(ndims[2], shapes[2]) + " for ids " +
           ShapeText(ndims[0], shapes[0]) + " and table " + ShapeText(2, shapes[1]);
  return "";
}

template <typename Id>
std::string CheckIds(const Id *ids, int64_t tokens, int64_t vocab) {
  for (int64_t t = 0; t < tokens; ++t)
    if (ids[t] < 0 || ids[t] >= vocab)
      return "ids: expected values in [0, " + std::to_string(vocab) + "), got " + std::to_string(ids[t]) +
             " at flat index " + std::to_string(t);
  return "";
}

template <typename Id, typename W>
void Gather(const Lookup &l, const Id *ids, const W *table, float *y) {
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < l.tokens; ++t)
    rfa::weights::RowToFloat(table + static_cast<int64_t>(ids[t]) * l.hidden, y + t * l.hidden, l.hidden);
}

template <typename Id>
void GatherAs(const Lookup &l, const Id *ids, const void *table, float *y) {
  if (l.table_dtype == "float16")
    Gather(l, ids, static_cast<const rfa::weights::Half *>(table), y);
  else if (l.table_dtype == "bfloat16")
    Gather(l, ids, static_cast<const rfa::weights::BFloat16 *>(table), y);
  else
    Gather(l, ids, static_cast<const float *>(table), y);
}

}  // namespace

extern "C" RFA_EXPORT const char *RfaEmbeddingLastError() { return g_last_error.Read(); }

// y's shape: ids.shape + (hidden,); -1 stays -1 (dynamic dimensions).
extern "C" RFA_EXPORT std::vector<int64_t> RfaEmbeddingInferShape(int *ndims, int64_t **shapes, mindspore::AotExtra *) {
  std::vector<int64_t> out(shapes[0], shapes[0] + ndims[0]);
  out.push_back(ndims[1] == 2 ? shapes[1][1] : -1);
  return out;
}

extern "C" RFA_EXPORT TypeId RfaEmbeddingInferType(std::vector<TypeId>, mindspore::AotExtra *) {
  return kFloat32TypeId;
}

extern "C" RFA_EXPORT int RfaEmbedding(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                       void *, void *) {
  try {
    if (nparam != 3)
      return g_last_error.Fail("expected 2 inputs (ids, table) and 1 output, got " + std::to_string(nparam) + " params");
    Lookup l;
    std::string err = Validate(ndims, shapes, dtypes, &l);
    if (!err.empty()) return g_last_error.Fail(err);
    if (l.tokens == 0 || l.hidden == 0) return 0;
    if (!params[0] || !params[2] || !params[1]) return g_last_error.Fail("launch: null data pointer");
    err = l.ids64 ? CheckIds(static_cast<const int64_t *>(params[0]), l.tokens, l.vocab)
                  : CheckIds(static_cast<const int32_t *>(params[0]), l.tokens, l.vocab);
    if (!err.empty()) return g_last_error.Fail(err);
    auto *y = static_cast<float *>(params[2]);
    if (l.ids64)
      GatherAs(l, static_cast<const int64_t *>(params[0]), params[1], y);
    else
      GatherAs(l, static_cast<const int32_t *>(params[0]), params[1], y);
    return 0;
  } catch (const std::exception &e) {
    return g_last_error.Fail(e.what());
  }
}
