// Fused RoPE + FlashAttention backward on the CPU (FlashAttention-2 style: P is recomputed tile by
// tile from the forward's log-sum-exp; no S x S matrix exists).
//
// Data flow, for a validated Problem:
//   1. Query pass, parallel over (sequence, query head): each Q row is rotated at its position and
//      scaled by scale*log2(e) (as in the forward) into a float32 slab, once row-major and once
//      transposed; dO likewise; per row lse*log2(e) and Delta = rowsum(dO * O) - d_lse. Rows are
//      padded to a whole query block (zero Q and dO, lse +inf: P = 0 there).
//   2. Key pass, parallel over tasks = (sequence, KV head, chunk of KV blocks). Per KV block: K rows
//      are rotated (or only reordered, key_rotated) into K and K^T tiles, V rows into a V tile; then
//      for every query head of the GQA group and every query block that sees the block:
//         S^T  = K Q^T           (keys x queries, log2 units)
//         P^T  = exp2(S^T - lse) (masked on causal-diagonal and padded tiles)
//         dP^T = V dO^T
//         dS^T = P^T * (dP^T - Delta)
//         dV  += P^T dO,  dK += dS^T Q,  dQ^T[task] += K^T dS^T
//      All five are plain GEMMs on the slabs as laid out: no tile is ever transposed in the loop.
//      The block's dK (plus d_rotated_key) is un-rotated (the transpose of RoPE) and written, with
//      dV, straight to the outputs: every key row belongs to exactly one task, so there are no races.
//   3. dQ pass, parallel over (sequence, query head): the task partials of dQ^T are summed in chunk
//      order, un-rotated and written. Each partial is owned by one task, so nothing is atomic and the
//      result does not depend on thread scheduling: gradients are bitwise deterministic run to run.
// A unit (sequence, KV head) is split into several chunks only when there are too few units to keep
// every thread busy (MQA, small batches); the extra memory is one dQ^T partial per chunk.
// Memory: O(tokens x heads x head_dim) float32 slabs, independent of S^2.
#include <omp.h>

#include <algorithm>
#include <limits>
#include <vector>

#include "rfa_cpu_kernel.h"
#include "rows.h"
#include "simd.h"

namespace rfa {
namespace cpu {
namespace {

using simd::kLanes;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kInf = std::numeric_limits<float>::infinity();

struct GradTask {
  int64_t seq, group;   // the unit: sequence and KV head
  int64_t kv_lo, kv_hi;  // its KV rows [kv_lo, kv_hi), whole KV blocks but the sequence's last
  int64_t dq_offset;    // its dQ^T partial: G heads x D x padded rows, in floats
};

struct GradPlan {
  int64_t group_size, block_q, block_k, head_pad;
  std::vector<int64_t> row_base, row_pad;  // per sequence: first padded query row, padded row count
  std::vector<int64_t> ld;                 // per sequence: row stride of its transposed (D x rows) slabs
  int64_t rows_total = 0;                  // padded query rows over all sequences
  std::vector<int64_t> ld_base;            // per sequence: its first column in a head's transposed slab
  int64_t ld_total = 0;                    // columns of one head's transposed slab
  std::vector<GradTask> tasks;
  std::vector<int64_t> first_task;         // per unit: index of its first task (chunks are consecutive)
  std::vector<int64_t> task_count;         // per unit
  int64_t dq_floats = 0;
};

GradPlan MakeGradPlan(const Problem &p, const GradTiling &t, int threads) {
  GradPlan plan;
  plan.group_size = p.q_heads / p.kv_heads;
  plan.block_q = RoundUp(std::max<int64_t>(1, t.block_q), kLanes);
  plan.block_k = std::max<int64_t>(1, t.block_k);
  plan.head_pad = RoundUp(p.head_dim, kLanes);
  for (int64_t b = 0; b < p.batch; ++b) {
    plan.row_base.push_back(plan.rows_total);
    plan.row_pad.push_back(RoundUp(p.q_lens[b], plan.block_q));
    plan.rows_total += plan.row_pad.back();
    // One cache line more than the padded rows: with a power-of-two stride every row of a GEMM's B
    // panel maps to the same L1 sets and the panel thrashes.
    plan.ld.push_back(plan.row_pad.back() + 16);
  }
  plan.ld_total = 0;
  for (int64_t b = 0; b < p.batch; ++b) {
    plan.ld_base.push_back(plan.ld_total);
    plan.ld_total += plan.ld[b];
  }
  const int64_t units = p.batch * p.kv_heads;
  int64_t busy = 0, most_blocks = 1;
  for (int64_t b = 0; b < p.batch; ++b)
    if (p.kv_lens[b] > 0) {
      busy += p.kv_heads;
      most_blocks = std::max(most_blocks, (p.kv_lens[b] + plan.block_k - 1) / plan.block_k);
    }
  // Too few units to keep every thread busy: split each unit's KV blocks into chunks.
  int64_t nsplit = 1;
  if (busy > 0 && busy < 2 * threads) nsplit = std::min(most_blocks, (4 * threads + busy - 1) / busy);
  if (t.splits > 0) nsplit = t.splits;
  plan.first_task.assign(units, 0);
  plan.task_count.assign(units, 0);
  for (int64_t u = 0; u < units; ++u) {
    const int64_t b = u / p.kv_heads, g = u % p.kv_heads, lk = p.kv_lens[b];
    plan.first_task[u] = static_cast<int64_t>(plan.tasks.size());
    const int64_t blocks = (lk + plan.block_k - 1) / plan.block_k;
    const int64_t chunks = std::min(nsplit, blocks);
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t lo = blocks * c / chunks * plan.block_k, hi = std::min(lk, blocks * (c + 1) / chunks * plan.block_k);
      plan.tasks.push_back({b, g, lo, hi, plan.dq_floats});
      plan.dq_floats += plan.group_size * p.head_dim * plan.ld[b];
    }
    plan.task_count[u] = static_cast<int64_t>(plan.tasks.size()) - plan.first_task[u];
  }
  return plan;
}

// The query-side slabs of the whole problem, float32, per query head then padded row.
struct Slabs {
  float *q, *qt, *dout, *doutt, *lse2, *delta, *dqt;
  int64_t head_stride_rows;  // padded rows of one head (all sequences)
};

class GradWorker {
 public:
  GradWorker(const Problem &p, const GradBuffers &buf, const GradPlan &plan, const Slabs &slabs)
      : p_(p), buf_(buf), plan_(plan), slabs_(slabs), tables_{&p, buf.cos, buf.sin} {}

  // Every pointer into the thread's scratch, from one list of regions (rows.h).
  bool Bind(Scratch *scratch) {
    const int64_t BK = plan_.block_k, BQ = plan_.block_q, Dp = plan_.head_pad, D = p_.head_dim, rd = p_.rotary_dim;
    ScratchRegions regions;
    regions.Add(&k_, BK * Dp).Add(&kt_, D * RoundUp(BK, kLanes)).Add(&v_, BK * Dp).Add(&dk_, BK * Dp).Add(&dv_, BK * Dp);
    regions.Add(&st_, BK * BQ).Add(&dpt_, BK * BQ);
    regions.Add(&row_, Dp).Add(&row2_, Dp).Add(&row3_, Dp).Add(&ctmp_, rd).Add(&stmp_, rd);
    return regions.Carve(scratch);
  }

  // 1. One (sequence, query head): rotated scaled Q, dO, lse in log2 units, Delta; padded rows zero.
  void PrepareQueries(int64_t seq, int64_t head) {
    const int64_t D = p_.head_dim, Dp = plan_.head_pad, Lp = plan_.row_pad[seq], ld = plan_.ld[seq];
    const int64_t lq = p_.q_lens[seq], first = head * slabs_.head_stride_rows + plan_.row_base[seq];
    float *q = slabs_.q + first * Dp, *dout = slabs_.dout + first * Dp;
    const int64_t tfirst = (head * plan_.ld_total + plan_.ld_base[seq]) * D;  // D x ld blocks
    float *qt = slabs_.qt + tfirst, *doutt = slabs_.doutt + tfirst;
    float *lse2 = slabs_.lse2 + first, *delta = slabs_.delta + first;
    const int64_t q_off = p_.kv_lens[seq] - lq;
    const int64_t qseq = seq * p_.q.batch + p_.q_start[seq] * p_.q.row + head * p_.q.head;
    const float qmul = p_.scale * kLog2e;
    for (int64_t i = 0; i < Lp; ++i) {
      float *qrow = q + i * Dp, *drow = dout + i * Dp;
      if (i >= lq) {
        std::memset(qrow, 0, Dp * sizeof(float));
        std::memset(drow, 0, Dp * sizeof(float));
        lse2[i] = kInf;
        delta[i] = 0.f;
      } else {
        const int64_t off = qseq + i * p_.q.row, pos = q_off + i;
        const float *x = RowAsFloat(p_.qkv_dtype, buf_.query, off, D, row_);
        Rotate(x, tables_.Row(buf_.cos, p_.cos_dtype, pos, ctmp_), tables_.Row(buf_.sin, p_.sin_dtype, pos, stmp_),
               p_.rotary_dim, D, p_.attrs.rotary_mode, qmul, qrow);
        LoadRow(p_.qkv_dtype, buf_.d_out, off, D, drow);
        const float *o = RowAsFloat(p_.qkv_dtype, buf_.out, off, D, row2_);
        float dot = 0.f;
        for (int64_t d = 0; d < D; ++d) dot += drow[d] * o[d];
        const int64_t li = seq * p_.lse.batch + head * p_.lse.head + (p_.q_start[seq] + i) * p_.lse.row;
        delta[i] = dot - (buf_.d_lse ? buf_.d_lse[li] : 0.f);
        // A row that saw no key (lse -inf) has P = 0 everywhere: +inf makes exp2(S - lse) exactly 0.
        lse2[i] = buf_.lse[li] == -kInf ? kInf : buf_.lse[li] * kLog2e;
        for (int64_t d = D; d < Dp; ++d) qrow[d] = drow[d] = 0.f;
      }
      for (int64_t d = 0; d < D; ++d) {
        qt[d * ld + i] = qrow[d];
        doutt[d * ld + i] = drow[d];
      }
    }
  }

  void ZeroPartial(const GradTask &t) {
    std::memset(slabs_.dqt + t.dq_offset, 0, plan_.group_size * p_.head_dim * plan_.ld[t.seq] * sizeof(float));
  }

  // 2. One task: its KV blocks against every query block of the GQA group that sees them.
  void RunTask(const GradTask &t) {
    const int64_t G = plan_.group_size, D = p_.head_dim, Dp = plan_.head_pad, BK = plan_.block_k,
                  BQ = plan_.block_q, BKp = RoundUp(BK, kLanes);
    const int64_t lq = p_.q_lens[t.seq], lk = p_.kv_lens[t.seq], ld = plan_.ld[t.seq], q_off = lk - lq;
    const int64_t kvhead = t.seq * p_.kv.batch + p_.kv_start[t.seq] * p_.kv.row + t.group * p_.kv.head;
    const bool causal = p_.attrs.causal;
    for (int64_t j0 = t.kv_lo; j0 < t.kv_hi; j0 += BK) {
      const int64_t n = std::min(BK, t.kv_hi - j0);
      LoadKeys(kvhead, j0, n, BKp);
      std::memset(dk_, 0, n * Dp * sizeof(float));
      std::memset(dv_, 0, n * Dp * sizeof(float));
      // Query rows that see key j0 at all: position q_off + i >= j0.
      const int64_t first_row = causal ? std::max<int64_t>(0, j0 - q_off) : 0;
      for (int64_t i0 = first_row / BQ * BQ; i0 < lq; i0 += BQ) {
        const int64_t nq = std::min(BQ, lq - i0);  // valid query rows of the block (the rest is padding)
        // Masking is needed where some query of the block is before some key (diagonal) or on padding.
        const bool masked = (causal && q_off + i0 < j0 + n - 1) || nq < BQ;
        for (int64_t gi = 0; gi < G; ++gi) {
          const int64_t head = t.group * G + gi;
          const int64_t first = head * slabs_.head_stride_rows + plan_.row_base[t.seq];
          const float *qs = slabs_.q + (first + i0) * Dp, *dout = slabs_.dout + (first + i0) * Dp;
          const int64_t tfirst = (head * plan_.ld_total + plan_.ld_base[t.seq]) * D + i0;
          const float *qt = slabs_.qt + tfirst, *doutt = slabs_.doutt + tfirst;
          const float *lse2 = slabs_.lse2 + first + i0, *delta = slabs_.delta + first + i0;
          simd::Gemm(n, BQ, D, k_, Dp, qt, ld, st_, BQ, false);
          simd::Gemm(n, BQ, D, v_, Dp, doutt, ld, dpt_, BQ, false);
          Softmax(n, j0, q_off + i0, nq, masked, lse2, delta);
          simd::Gemm(n, Dp, nq, st_, BQ, dout, Dp, dv_, Dp, true);
          simd::Gemm(n, Dp, nq, dpt_, BQ, qs, Dp, dk_, Dp, true);
          AccumulateQueryGradient(n, j0, q_off + i0, causal, slabs_.dqt + t.dq_offset + gi * D * ld + i0, ld);
        }
      }
      StoreKeyGradients(kvhead, j0, n);
    }
  }

  // dQ^T (D x block_q, row stride ld) += K^T dS^T. On a causal diagonal tile the GEMM takes only the
  // keys every query of the block sees; each later key is added to the queries that see it alone, so
  // a key a query cannot see (NaN in a preallocated cache's garbage) never meets its zero dS.
  void AccumulateQueryGradient(int64_t n, int64_t j0, int64_t qpos0, bool causal, float *dqt, int64_t ld) {
    const int64_t D = p_.head_dim, Dp = plan_.head_pad, BQ = plan_.block_q, BKp = RoundUp(plan_.block_k, kLanes);
    const int64_t seen_by_all = causal ? std::max<int64_t>(0, std::min(n, qpos0 - j0 + 1)) : n;
    if (seen_by_all > 0) simd::Gemm(D, BQ, seen_by_all, kt_, BKp, dpt_, BQ, dqt, ld, true);
    // The later keys a group of kLanes at a time: a GEMM over the columns (queries) that see the whole
    // group, from a vector boundary on, and each key alone over the few columns before that.
    for (int64_t r0 = seen_by_all; r0 < n; r0 += kLanes) {
      const int64_t r1 = std::min(n, r0 + kLanes);
      const int64_t first_col_of_last = j0 + r1 - 1 - qpos0;  // columns from here on see every key of the group
      const int64_t aligned = std::min(BQ, RoundUp(first_col_of_last, kLanes));
      if (aligned < BQ)
        simd::Gemm(D, BQ - aligned, r1 - r0, kt_ + r0, BKp, dpt_ + r0 * BQ + aligned, BQ, dqt + aligned, ld, true);
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t first_col = j0 + r - qpos0;  // the first query of the block at or after key j0 + r
        if (first_col >= aligned) continue;
        const float *ds = dpt_ + r * BQ, *krow = k_ + r * Dp;
        for (int64_t d = 0; d < D; ++d) {
          const float kv = krow[d];
          float *crow = dqt + d * ld;
          for (int64_t c = first_col; c < aligned; ++c) crow[c] += kv * ds[c];
        }
      }
    }
  }

  // 3. One (sequence, query head): sum the dQ^T partials of its unit's tasks in chunk order, then
  // un-rotate (dq = scale * RoPE^T(dQ)) and write.
  void FinishQueries(int64_t seq, int64_t head) {
    const int64_t G = plan_.group_size, D = p_.head_dim, ld = plan_.ld[seq], lq = p_.q_lens[seq];
    const int64_t unit = seq * p_.kv_heads + head / G, gi = head % G;
    const int64_t q_off = p_.kv_lens[seq] - lq;
    const int64_t qseq = seq * p_.q.batch + p_.q_start[seq] * p_.q.row + head * p_.q.head;
    const int64_t tasks = plan_.task_count[unit];
    for (int64_t i = 0; i < lq; ++i) {
      for (int64_t d = 0; d < D; ++d) row_[d] = 0.f;
      for (int64_t c = 0; c < tasks; ++c) {
        const float *part = slabs_.dqt + plan_.tasks[plan_.first_task[unit] + c].dq_offset + gi * D * ld + i;
        for (int64_t d = 0; d < D; ++d) row_[d] += part[d * ld];
      }
      const int64_t pos = q_off + i;
      RotateTransposed(row_, tables_.Row(buf_.cos, p_.cos_dtype, pos, ctmp_),
                       tables_.Row(buf_.sin, p_.sin_dtype, pos, stmp_), p_.rotary_dim, D, p_.attrs.rotary_mode,
                       p_.scale, row2_);
      StoreRow(p_.qkv_dtype, row2_, D, buf_.d_query, qseq + i * p_.q.row);
    }
  }

 private:
  // K rows rotated (kernel order) into k_ (row-major) and kt_ (transposed), V rows into v_.
  void LoadKeys(int64_t kvhead, int64_t j0, int64_t n, int64_t ldkt) {
    const int64_t D = p_.head_dim, Dp = plan_.head_pad, rd = p_.rotary_dim, mode = p_.attrs.rotary_mode;
    for (int64_t r = 0; r < n; ++r) {
      const int64_t off = kvhead + (j0 + r) * p_.kv.row, pos = j0 + r;
      const float *key = RowAsFloat(p_.qkv_dtype, buf_.key, off, D, row_);
      float *krow = k_ + r * Dp;
      if (p_.attrs.key_rotated) {
        ToKernelOrder(key, rd, D, mode, krow);
      } else {
        Rotate(key, tables_.Row(buf_.cos, p_.cos_dtype, pos, ctmp_), tables_.Row(buf_.sin, p_.sin_dtype, pos, stmp_),
               rd, D, mode, 1.0f, krow);
      }
      for (int64_t d = D; d < Dp; ++d) krow[d] = 0.f;
      for (int64_t d = 0; d < D; ++d) kt_[d * ldkt + r] = krow[d];
      float *vrow = v_ + r * Dp;
      LoadRow(p_.qkv_dtype, buf_.value, off, D, vrow);
      for (int64_t d = D; d < Dp; ++d) vrow[d] = 0.f;
    }
  }

  // P^T and dS^T of one (KV block, query block) tile, in place of S^T and dP^T. Row r is key
  // j0 + r, column c query c of the block at position qpos0 + c. Masked entries are selected to
  // 0, never multiplied by 0: a key a query cannot see must not reach its gradient even if it holds
  // NaN or Inf.
  void Softmax(int64_t n, int64_t j0, int64_t qpos0, int64_t nq, bool masked, const float *lse2,
               const float *delta) {
    const int64_t BQ = plan_.block_q;
    const bool causal = p_.attrs.causal;
    simd::vf lane;
    for (int l = 0; l < kLanes; ++l) lane[l] = static_cast<float>(l);
    const simd::vf zero = {};
    for (int64_t r = 0; r < n; ++r) {
      float *s = st_ + r * BQ, *dp = dpt_ + r * BQ;
      // Column c is visible iff c < nq and (not causal, or qpos0 + c >= key position).
      const float first_visible = causal ? static_cast<float>(j0 + r - qpos0) : 0.f;
      const simd::vf lo = simd::Splat(first_visible), hi = simd::Splat(static_cast<float>(nq));
      for (int64_t c = 0; c < BQ; c += kLanes) {
        const simd::vf pr = simd::Exp2(simd::Load(s + c) - simd::Load(lse2 + c));
        simd::vf ds = pr * (simd::Load(dp + c) - simd::Load(delta + c));
        simd::vf pv = pr;
        if (masked) {
          const simd::vf col = lane + static_cast<float>(c);
          const auto visible = (col >= lo) & (col < hi);
          pv = visible ? pr : zero;
          ds = visible ? ds : zero;
        }
        simd::Store(s + c, pv);
        simd::Store(dp + c, ds);
      }
    }
  }

  // dK (plus d_rotated_key) un-rotated into key's layout and dtype; dV as it is.
  void StoreKeyGradients(int64_t kvhead, int64_t j0, int64_t n) {
    const int64_t D = p_.head_dim, Dp = plan_.head_pad, rd = p_.rotary_dim, mode = p_.attrs.rotary_mode;
    const float kmul = 1.0f / kLog2e;  // dK accumulated against Q scaled by scale*log2(e); wanted: scale
    for (int64_t r = 0; r < n; ++r) {
      const int64_t off = kvhead + (j0 + r) * p_.kv.row, pos = j0 + r;
      float *dk = dk_ + r * Dp;
      for (int64_t d = 0; d < D; ++d) dk[d] *= kmul;
      if (p_.attrs.key_rotated) {  // the key as given was used: only undo the feature order
        ToOriginalOrder(dk, rd, D, mode, row2_);
        if (buf_.d_rotated_key) {
          LoadRow(p_.qkv_dtype, buf_.d_rotated_key, off, D, row3_);
          for (int64_t d = 0; d < D; ++d) row2_[d] += row3_[d];
        }
      } else {
        if (buf_.d_rotated_key) {  // rotated_key = RoPE(key): its gradient joins dK before un-rotating
          LoadRow(p_.qkv_dtype, buf_.d_rotated_key, off, D, row3_);
          ToKernelOrder(row3_, rd, D, mode, row_);
          for (int64_t d = 0; d < D; ++d) dk[d] += row_[d];
        }
        RotateTransposed(dk, tables_.Row(buf_.cos, p_.cos_dtype, pos, ctmp_),
                         tables_.Row(buf_.sin, p_.sin_dtype, pos, stmp_), rd, D, mode, 1.0f, row2_);
      }
      StoreRow(p_.qkv_dtype, row2_, D, buf_.d_key, off);
      StoreRow(p_.qkv_dtype, dv_ + r * Dp, D, buf_.d_value, off);
    }
  }

  const Problem &p_;
  const GradBuffers &buf_;
  const GradPlan &plan_;
  const Slabs &slabs_;
  Tables tables_;
  float *k_ = nullptr, *kt_ = nullptr, *v_ = nullptr, *dk_ = nullptr, *dv_ = nullptr;
  float *st_ = nullptr, *dpt_ = nullptr;  // S^T then P^T; dP^T then dS^T (block_k x block_q)
  float *row_ = nullptr, *row2_ = nullptr, *row3_ = nullptr, *ctmp_ = nullptr, *stmp_ = nullptr;
};

thread_local Scratch tls_grad_scratch, tls_slabs;

}  // namespace

void RunBackward(const Problem &p, const GradBuffers &buf, const GradTiling &tiling) {
  const int threads = omp_get_max_threads();
  const GradPlan plan = MakeGradPlan(p, tiling, threads);
  const int64_t D = p.head_dim, Dp = plan.head_pad, rows = plan.rows_total * p.q_heads;
  const int64_t cols = plan.ld_total * p.q_heads;
  // The query slabs are kept per calling thread across calls, like the forward's pack buffer: a
  // training loop calls the backward every step at the same shape, and fresh pages cost a fault each.
  Slabs slabs;
  slabs.head_stride_rows = plan.rows_total;
  ScratchRegions regions;
  regions.Add(&slabs.q, rows * Dp).Add(&slabs.dout, rows * Dp).Add(&slabs.qt, cols * D).Add(&slabs.doutt, cols * D);
  regions.Add(&slabs.lse2, rows).Add(&slabs.delta, rows).Add(&slabs.dqt, plan.dq_floats);
  if (!regions.Carve(&tls_slabs)) throw std::bad_alloc();
  const int64_t heads_items = p.batch * p.q_heads, ntasks = static_cast<int64_t>(plan.tasks.size());
  bool ok = true;
#pragma omp parallel num_threads(threads) reduction(&& : ok)
  {
    GradWorker worker(p, buf, plan, slabs);
    const bool bound = worker.Bind(&tls_grad_scratch);
    ok = bound;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < heads_items; ++i)
      if (bound) worker.PrepareQueries(i / p.q_heads, i % p.q_heads);
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < ntasks; ++i)
      if (bound) worker.ZeroPartial(plan.tasks[i]);
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < ntasks; ++i)
      if (bound) worker.RunTask(plan.tasks[i]);
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < heads_items; ++i)
      if (bound) worker.FinishQueries(i / p.q_heads, i % p.q_heads);
  }
  if (!ok) throw std::bad_alloc();
}

}  // namespace cpu
}  // namespace rfa
