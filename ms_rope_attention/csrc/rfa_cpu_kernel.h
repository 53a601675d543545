// The fused CPU kernel's entry: one call computes RoPE + FlashAttention for a validated Problem.
#pragma once
#include "rfa_problem.h"

namespace rfa {
namespace cpu {

struct Buffers {
  const void *query, *key, *value, *cos, *sin;
  void *out;          // query's layout and dtype
  float *lse;         // may be null (not requested)
  void *rotated_key;  // key's layout and dtype; may be null (not requested)
};

// Tuning knobs; defaults are the production choice, tests shrink them to hit every tail path.
struct Tiling {
  int64_t rows = 240;      // target query rows per task (heads of a GQA group x query positions): big
                           // enough to amortise a K/V tile's trip through the cache over many rows, and
                           // a multiple of the GEMM micro-tile height (no short tail micro-tile)
  int64_t kv_block = 128;  // keys per tile (rounded up to the GEMM column block)
  int64_t min_split_keys = 256;  // decode: smallest KV chunk worth its own task
  int64_t pack_bytes = int64_t{4} << 20;  // packed (rotated, transposed) K/V of the (sequence, KV
                           // head) units packed at a time, before their query blocks run; a unit
                           // bigger than this is packed alone. Small enough to stay in cache while
                           // the query blocks re-read it: at S=2048 (2 MiB per unit) a 64 MiB chunk
                           // ran 1.5x slower than 4 MiB ones
  bool rotate = true;      // false only in benchmarks, to measure what the fused rotation costs
  int64_t stream_q_max = 16;  // decode path (rfa_cpu_decode.cc) when no sequence has more query rows
                              // than this (one token, or a speculative block); <= 0: never
};

void Run(const Problem &p, const Buffers &buf, const Tiling &tiling);
// The decode path: whether it takes this call, and the call itself (Run dispatches to it).
bool UsesDecodePath(const Problem &p, const Buffers &buf, const Tiling &tiling);
void RunDecode(const Problem &p, const Buffers &buf, const Tiling &tiling);
// Calls that took the decode path in this process: what shows that a decode step really ran it.
int64_t DecodeCalls();

// The backward (rfa_cpu_backward.cc): gradients w.r.t. query, key and value of the un-rotated
// inputs, from the forward's output and log-sum-exp.
struct GradBuffers {
  const void *query, *key, *value, *cos, *sin;
  const void *out;            // the forward's attention_out
  const float *lse;           // the forward's softmax_lse (natural log)
  const void *d_out;
  const float *d_lse;         // may be null: softmax_lse not used downstream
  const void *d_rotated_key;  // may be null: rotated_key not used downstream
  void *d_query, *d_key, *d_value;
};

struct GradTiling {
  int64_t block_q = 128;  // queries per tile (rounded up to a whole vector)
  int64_t block_k = 96;   // keys per tile: a multiple of both GEMM micro-tile heights (12 and 6)
  int64_t splits = 0;     // KV chunks per (sequence, KV head); 0 = as many as keep every thread busy
};

void RunBackward(const Problem &p, const GradBuffers &buf, const GradTiling &tiling);
const char *Isa();

// Sets p->bf16 from the compute_dtype attribute for this build and CPU (rfa::ResolveCompute); "" or
// the refusal of an explicit bfloat16 the kernel cannot compute, or of a bad RFA_BF16_ATTENTION for a
// bfloat16 call. Every entry calls it before Run.
std::string ResolveCompute(Compute requested, Problem *p);
// Whether this build and CPU compute bfloat16 dot products (what "auto" and "bfloat16" need).
bool NativeBf16();
// Whether the bfloat16 forward uses AMX tiles; allow 0/1 sets whether it may (default 1), -1 keeps it.
bool UseAmx(int64_t allow);
// The units the tiled path's bfloat16 products run on in this process and why (bf16.h UnitsReport):
// "amx", "avx512_bf16: ...", "fma: ..."; "" without bfloat16 arithmetic.
std::string Bf16Units();

}  // namespace cpu
}  // namespace rfa
