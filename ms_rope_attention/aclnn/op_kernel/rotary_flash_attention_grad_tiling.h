// Tiling data of the backward op (RotaryFlashAttentionGrad), shared by the host tiling and the AI-core
// kernel, and the task order both sides agree on. Kernel-safe, like the forward's tiling header (the
// problem part, RfaTiling, is the forward's: same attributes, geometry and strides).
//
// The backward is deterministic by ownership (../DESIGN.md, "The backward kernel"): a pre stage
// writes rotated Q (softmax scale folded in), dO, rotated K and V head-major into the workspace,
// with lse and Delta = rowsum(dO * O) - d_lse per query row; then every output row is owned by one
// task: a KV task (sequence, KV head, KV block) accumulates dK and dV over the query blocks and
// heads that see the block, a Q task (sequence, query head, query block) accumulates dQ over the KV
// blocks it sees. No atomics, no float32 gradient slabs, the same bits for any core count.
#pragma once
#include "rotary_flash_attention_tiling.h"

namespace rfa {
namespace ascend {

struct RfaGradPlan {
  int64_t block_q;        // query rows of one head in a block (M of S and dP, K of dV and dK)
  int64_t block_kv;       // keys in a block (N of S and dP, M of dV and dK, K of dQ)
  int64_t core_num;       // vector cores the work is spread over
  int64_t ub_bytes;       // Unified Buffer the kernel allocates (<= the core's capacity)
  int64_t has_dlse;       // d_softmax_lse given (else 0)
  int64_t has_drk;        // d_rotated_key given (else 0)
  int64_t q_rows;         // query tokens (batch * q_len, or T for TND)
  int64_t kv_rows;        // key tokens
  // Shared workspace (byte offsets from the user workspace), written by the pre stage, head-major:
  // row (sequence b, head h, position i) at ((b * heads + h) * len + i) (batch layouts) or
  // (h * tokens + start_b + i) (TND), so a block of one head is contiguous for the cube.
  int64_t ws_qs, ws_do, ws_kr, ws_v;  // rotated Q * scale, dO, rotated K (or K as given), V (input dtype)
  int64_t ws_lse, ws_delta;           // float32 per query row: lse (no-key rows: kNoKeyLse), Delta
  int64_t ws_cores;                   // start of the per-core slices
  int64_t ws_p, ws_ds, ws_per_core;   // per-core P and dS tiles (block_q x block_kv, input dtype)
};

// Query rows staged per flush in the pre stage (lse and Delta go out as one DataCopyPad per chunk).
constexpr int64_t kStatChunk = 64;

// Unified Buffer plan of one vector core for the backward, in bytes (every buffer 32-byte aligned).
struct GradUbPlan {
  RowUbPlan rows;      // the rotation's row buffers
  int64_t tile_f32;    // S -> P and dP -> dS, block_q x block_kv float32 (C of S = Q K^T, dP = dO V^T; VECIN)
  int64_t tile_t;      // P and dS in the input dtype on their way to the workspace (one each)
  int64_t part;        // C of dV/dK/dQ parts, max(block_q, block_kv) x head_dim float32 (VECIN)
  int64_t acc;         // dK and dV (KV task) or dQ (Q task) accumulators, same size (two)
  int64_t block_stats; // lse and Delta of a query block, contiguous (two)
  int64_t reduce_tmp;  // ReduceSum temporary
  int64_t slots;       // ReduceSum results (Delta's sum, the finiteness probe), one 32-byte slot per row of a chunk
  int64_t stage;       // a chunk's lse and Delta, contiguous, for one DataCopyPad each (two)
  int64_t total;
};

__aicore__ inline GradUbPlan PlanGradUb(int64_t block_q, int64_t block_kv, int64_t head_pad, int64_t elem,
                                        int64_t table_elem) {
  GradUbPlan u;
  const int64_t rows = block_q > block_kv ? block_q : block_kv;
  u.rows = PlanRowUb(head_pad, elem, table_elem);
  u.tile_f32 = RoundUp(block_q * block_kv * 4, kBlockBytes);
  u.tile_t = RoundUp(block_q * block_kv * elem, kBlockBytes);
  u.part = RoundUp(rows * head_pad * 4, kBlockBytes);
  u.acc = u.part;
  u.block_stats = RoundUp(block_q * 4, kBlockBytes);
  u.reduce_tmp = RoundUp((head_pad > block_kv ? head_pad : block_kv) * 4, kBlockBytes);
  u.slots = 2 * kBlockBytes * kStatChunk;
  u.stage = RoundUp(kStatChunk * 4, kBlockBytes);
  u.total = u.rows.total + 2 * u.tile_f32 + 2 * u.tile_t + u.part + 2 * u.acc + 2 * u.block_stats + u.reduce_tmp +
            u.slots + 2 * u.stage;
  return u;
}

// One unit of owned work: kind 0 = KV task (dK, dV of keys [first, first + count) of KV head
// `head`), kind 1 = Q task (dQ of queries [first, first + count) of query head `head`).
struct GradTask {
  int64_t kind, seq, head, first, count;
};

// Visits every task in the canonical order, heaviest first within each kind under causal masking:
// KV blocks from the start of each sequence (seen by the most queries), then query blocks from the
// end (seeing the most keys); within a rank, sequences then heads. `len_of(b, kv)` gives a
// sequence's query (kv = false) or key (kv = true) rows. Stops early when `visit` returns false.
template <typename LenOf, typename Visit>
__aicore__ inline void ForEachGradTask(const RfaTiling &t, const RfaGradPlan &g, LenOf len_of, Visit visit) {
  int64_t index = 0;
  for (int64_t kind = 0; kind < 2; ++kind) {
    const bool kv = kind == 0;
    const int64_t block = kv ? g.block_kv : g.block_q, heads = kv ? t.kv_heads : t.q_heads;
    int64_t max_blocks = 0;
    for (int64_t b = 0; b < t.batch; ++b) {
      const int64_t nb = CeilDiv(len_of(b, kv), block);
      max_blocks = nb > max_blocks ? nb : max_blocks;
    }
    for (int64_t rank = 0; rank < max_blocks; ++rank) {
      for (int64_t b = 0; b < t.batch; ++b) {
        const int64_t len = len_of(b, kv), nb = CeilDiv(len, block);
        if (rank >= nb) continue;
        const int64_t first = (kv ? rank : nb - 1 - rank) * block;
        const int64_t count = len - first < block ? len - first : block;
        for (int64_t h = 0; h < heads; ++h) {
          GradTask task{kind, b, h, first, count};
          if (!visit(index++, task)) return;
        }
      }
    }
  }
}

}  // namespace ascend
}  // namespace rfa

// The backward op's tiling data: what REGISTER_TILING_DEFAULT names in its kernel entry and what the
// host's TilingFunc fills through GetTilingData.
struct RotaryFlashAttentionGradTilingData {
  rfa::ascend::RfaTiling rfa;        // the problem (the forward's plan fields unused: zero)
  rfa::ascend::RfaGradPlan grad;
  AscendC::tiling::TCubeTiling nt;  // S = Qs Kr^T and dP = dO V^T: M = block_q, N = block_kv, K = head_dim
  AscendC::tiling::TCubeTiling tn;  // dV += P^T dO and dK += dS^T Qs: M = block_kv, N = head_dim, K = block_q
  AscendC::tiling::TCubeTiling nn;  // dQ += dS Kr: M = block_q, N = head_dim, K = block_kv
};
