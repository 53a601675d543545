// Tiling data shared by the host (op_host tiling) and the AI-core kernel, plus the task order both
// sides must agree on. It is the one definition of the tiling struct (in op_kernel/, as CANN's
// standard-C++ tiling requires; the host includes it). Kernel-safe: plain integers, no STL, and of
// CANN only the Matmul API's plain tiling struct, so the same header is compiled by the Ascend C
// compiler, by the host tiling (C++11), and by the CPU emulation and its tests.
#pragma once
#include <stdint.h>

#include "kernel_tiling/kernel_tiling.h"

#ifndef __aicore__
#define __aicore__
#endif

namespace rfa {
namespace ascend {

// Hardware facts of the first target, Atlas A2 (ascend910b). The tiling takes them as inputs
// (PlatformAscendC on a real device) and these are the defaults used when none are given.
constexpr int64_t kA2UbBytes = 192 * 1024 - 256;  // UB per vector core, as GetCoreMemSize(UB) reports it
constexpr int64_t kA2VectorCores = 48;       // AIV cores of a 910B (2 per AI core, 24 AI cores)
constexpr int64_t kBlockBytes = 32;          // UB address / DataCopy granularity
constexpr int64_t kSysWorkspaceBytes = 16 * 1024 * 1024;  // reserved for the Matmul API (MIX mode)

struct RfaTiling {
  // Problem (resolved attributes and geometry, element strides for every layout).
  int64_t batch, q_heads, kv_heads, group, head_dim, head_pad, rotary_dim, rotary_pad;
  int64_t q_len, kv_len, table_rows;
  int64_t layout, rotary_mode, causal, with_lse, with_rotated_key, key_rotated;
  int64_t q_batch_stride, q_head_stride, q_row_stride;
  int64_t kv_batch_stride, kv_head_stride, kv_row_stride;
  int64_t lse_batch_stride, lse_head_stride, lse_row_stride;
  float scale;
  // Plan.
  int64_t block_q;        // query rows per head in one task (the task's M is group * block_q)
  int64_t block_kv;       // keys per KV tile (N of Q K^T, K of P V)
  int64_t core_num;       // vector cores the tasks are spread over
  int64_t ub_bytes;       // Unified Buffer the kernel allocates (<= the core's capacity)
  int64_t ws_q, ws_k, ws_v, ws_p, ws_per_core;  // per-core workspace slices, byte offsets
  // K strategy: 0 = rotate each K tile as it is brought in (every query block re-rotates it);
  // 1 = rotate every K row once, before any attention (all cores, then SyncAll), into the
  // rotated_key output or, when that is not requested, into the shared workspace at ws_keys.
  int64_t k_prepass, ws_keys;
};

// Query blocks per sequence from which the K pre-pass pays off (see DESIGN.md, "Where K is rotated").
constexpr int64_t kPrepassMinQueryBlocks = 4;

__aicore__ inline int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
__aicore__ inline int64_t RoundUp(int64_t a, int64_t b) { return CeilDiv(a, b) * b; }

// The rotation's row buffers (RotaryRows in op_kernel/rfa_rotary_rows.h), in bytes, each 32-byte
// aligned: what both kernels hold to rotate, un-rotate and move one head_dim row at a time.
struct RowUbPlan {
  int64_t row_in;      // one q/k/v row in the input dtype (queue depth 2: load of row i+1 overlaps row i)
  int64_t table_in;    // one cos or sin row in the table dtype (depth 2)
  int64_t f32_row;     // x, permuted x, rotated y; cos, sin' and the sign per lane; Gather offsets (7 of them)
  int64_t row_out;     // one row in the input dtype on its way out (depth 2)
  int64_t total;
};

__aicore__ inline RowUbPlan PlanRowUb(int64_t head_pad, int64_t elem, int64_t table_elem) {
  RowUbPlan r;
  r.row_in = RoundUp(head_pad * elem, kBlockBytes);
  r.table_in = RoundUp(head_pad * table_elem, kBlockBytes);
  r.f32_row = RoundUp(head_pad * 4, kBlockBytes);
  r.row_out = r.row_in;
  r.total = 2 * r.row_in + 2 * r.table_in + 7 * r.f32_row + 2 * r.row_out;
  return r;
}

// Unified Buffer plan of one vector core for the forward, in bytes (every buffer 32-byte aligned).
// The host checks `total` against the core's capacity; the kernel allocates exactly these sizes.
struct UbPlan {
  RowUbPlan rows;      // the rotation's row buffers
  int64_t scores;      // S tile, M x block_kv float32 (the QK^T matmul's C, VECIN)
  int64_t probs;       // P tile in the input dtype (the P V matmul's A)
  int64_t acc;         // O accumulator and the P V result, M x head_dim float32 (one each)
  int64_t stats;       // running max m, sum l, row max, row sum, alpha, poison: M float32 each
  int64_t reduce_tmp;  // ReduceMax/ReduceSum shared temporary buffer
  int64_t reduce_out;  // ReduceMax/ReduceSum results, one 32-byte slot per row or key
  int64_t lse_stage;   // lse of a task laid out as its DataCopyPad blocks (32 bytes per row at most)
  int64_t total;
};

__aicore__ inline UbPlan PlanUb(int64_t m, int64_t block_kv, int64_t head_pad, int64_t elem, int64_t table_elem) {
  UbPlan u;
  u.rows = PlanRowUb(head_pad, elem, table_elem);
  u.scores = RoundUp(m * block_kv * 4, kBlockBytes);
  u.probs = RoundUp(m * block_kv * elem, kBlockBytes);
  u.acc = RoundUp(m * head_pad * 4, kBlockBytes);
  u.stats = RoundUp(m * 4, kBlockBytes);
  u.reduce_tmp = RoundUp(block_kv * 4, kBlockBytes);
  u.reduce_out = kBlockBytes * (m > block_kv ? m : block_kv);
  u.lse_stage = kBlockBytes * m;
  u.total = u.rows.total + u.scores + u.probs + 2 * u.acc + 6 * u.stats + u.reduce_tmp + u.reduce_out + u.lse_stage;
  return u;
}

// Causal load balance: tasks are enumerated heaviest first (query blocks from the end of each
// sequence, which see the most keys) and dealt to cores in a zigzag (0..C-1, then C-1..0, ...),
// so every core gets a mix of heavy and light blocks without any sorting on the device.
__aicore__ inline int64_t CoreOfTask(int64_t task, int64_t cores) {
  const int64_t round = task / cores, pos = task % cores;
  return (round % 2 == 0) ? pos : cores - 1 - pos;
}

struct Task {
  int64_t seq, group, q0, nq;
};

// Visits every task in the canonical order: rank r = 0, 1, ... counts query blocks from the end
// of each sequence; within a rank, sequences then KV heads. `q_len_of(b)` gives a sequence's
// query rows (from actual_seq_qlen for TND). Stops early when `visit` returns false.
template <typename QLenOf, typename Visit>
__aicore__ inline void ForEachTask(const RfaTiling &t, QLenOf q_len_of, Visit visit) {
  int64_t max_blocks = 0;
  for (int64_t b = 0; b < t.batch; ++b) {
    const int64_t nb = CeilDiv(q_len_of(b), t.block_q);
    max_blocks = nb > max_blocks ? nb : max_blocks;
  }
  int64_t index = 0;
  for (int64_t rank = 0; rank < max_blocks; ++rank) {
    for (int64_t b = 0; b < t.batch; ++b) {
      const int64_t lq = q_len_of(b), nb = CeilDiv(lq, t.block_q);
      if (rank >= nb) continue;
      const int64_t q0 = (nb - 1 - rank) * t.block_q;
      const int64_t nq = (lq - q0) < t.block_q ? (lq - q0) : t.block_q;
      for (int64_t g = 0; g < t.kv_heads; ++g) {
        Task task{b, g, q0, nq};
        if (!visit(index++, task)) return;
      }
    }
  }
}

}  // namespace ascend
}  // namespace rfa

// The op's tiling data: what REGISTER_TILING_DEFAULT names in the kernel entry and what the host's
// TilingFunc fills through GetTilingData.
struct RotaryFlashAttentionTilingData {
  rfa::ascend::RfaTiling rfa;
  AscendC::tiling::TCubeTiling qk;  // S = Q K^T: M = group * block_q, N = block_kv, K = head_dim
  AscendC::tiling::TCubeTiling pv;  // O += P V:  M = group * block_q, N = head_dim, K = block_kv
};
