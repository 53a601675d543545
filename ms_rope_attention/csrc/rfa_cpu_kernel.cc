// Fused RoPE + FlashAttention forward on the CPU.
//
// Data flow:
//   1. Packing, by all threads, one chunk of (sequence, KV head) units at a time: K rows are
//      converted to float32, rotated and written transposed into packed K^T tiles (the pack already
//      touches every element, so the rotation rides along); V rows are converted into packed V
//      tiles. Every query block then reads the packed tiles: a key is rotated once per call, not
//      once per query block or per thread; the rotated_key output is written from that same
//      rotation. Chunks are bounded by Tiling::pack_bytes (at least one unit), so the packed copy
//      is O(S), never O(S^2).
//   Then per task (one sequence, one KV head, one block of query rows of every query head sharing
//   that KV head), on one thread:
//   2. Q rows are loaded once, converted to float32, rotated at their absolute positions and scaled
//      by scale*log2(e) into a row-major tile. Rotated Q never goes back to memory.
//   3. For each packed KV tile up to the causal bound; on a causal diagonal tile, the keys each block
//      of GEMM micro-tile rows sees: the GEMMs skip what no row of a block sees.
//   4. S = Q K^T (register-blocked GEMM), online softmax in base 2 with the running max/sum per row,
//      O = O*alpha + P V. No S x S matrix exists, only one S tile per thread.
//   5. O / l is converted to the output dtype; lse = (m + log2 l) * ln 2.
// Interleaved RoPE (mode 1) de-interleaves the rotated features of Q and K identically while
// packing, so both modes share the rotate-half arithmetic; Q K^T is invariant under the common
// permutation. A few query rows against a long KV range (decode) take rfa_cpu_decode.cc instead, and
// a short problem of this path splits the KV range across threads and merges by log-sum-exp.
//
// bfloat16 arithmetic (Problem::bf16, bf16.h): the same flow on bfloat16 operands with float32
// accumulation. Each K row is rotated in float32 as above, then rounded once to bfloat16 and packed as
// pairs of features ([D/2][kv_block][2]); V rows are rounded into pairs of keys ([kv_block/2][Dp][2]);
// Q rows are rotated in float32 and rounded once (unscaled: the scale multiplies the float32 scores in
// the softmax). P is rounded to bfloat16 before P V, as PyTorch's CPU flash attention and FlashAttention
// do; the running max, sum and O stay float32. The packed tiles are half the float32 ones. Where the
// CPU has AMX-BF16 the two products run on tiles (blocks of 16 rows, head_dim padded to 32 with zeros),
// else on vdpbf16ps (bf16.h), unless vdpbf16ps is the slower unit here: then the same rounded operands are
// widened back to float32 in the float32 layouts and the float32 GEMM computes the same products
// (Plan::widened; bf16.h ChosenUnits).
#include "rfa_cpu_kernel.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <vector>

#include "bf16.h"
#include "rows.h"
#include "simd.h"

namespace rfa {
namespace cpu {
namespace {

using simd::kCols;
using simd::kLanes;
using simd::kRows;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kRescaleSlack = 8.0f;  // log2 units: softmax numerators stay <= 256

struct Task {
  int64_t seq, group, q0, nq;  // query rows [q0, q0 + nq) of sequence `seq`, KV head `group`
  int64_t unit;                // seq * kv_heads + group: the tasks sharing one K/V
  int64_t kv_lo, kv_hi;        // KV range of this task (a split of [0, causal bound))
  int64_t split, item;         // split index, and the (seq, group, q-block) item it belongs to
  int64_t cost;
};

struct PackItem {
  int64_t seq, group, j0;  // keys [j0, j0 + kv_block) of one unit (fewer at the sequence's end)
  int64_t offset;          // where its packed K^T then V go in the pack buffer, in floats
};

// Pack items [pack_begin, pack_end) of the plan, then the tasks [task_begin, task_end) that read them.
struct Chunk {
  size_t pack_begin, pack_end, task_begin, task_end;
};

struct Plan {
  int64_t group_size, block_q, rows_max, kv_block, head_pad, nsplit;
  bool amx = false;       // bfloat16 on AMX tiles
  bool widened = false;   // bfloat16 on the float32 FMAs: operands rounded, kept as float32, float32 layouts
  bool pairs = false;     // bfloat16 pairs layouts (vdpbf16ps or AMX): p.bf16 && !widened
  int64_t row_block = 0;  // rows of a GEMM block: the micro-tile's, or 16 (a tile) with AMX
  int64_t feat_pad = 0;   // bfloat16: head_dim padded to 32 (an AMX tile's reduction), zeros past it
  int64_t tile_floats;               // one packed K^T tile (head_dim x kv_block) and V tile (kv_block x head_pad),
                                     // in float32 slots (bfloat16: half as many, two values a slot)
  std::vector<Task> tasks;
  std::vector<PackItem> packs;
  std::vector<Chunk> chunks;
  std::vector<int64_t> unit_offset;  // per unit: its first tile in the pack buffer, in floats
  int64_t pack_floats = 0;           // the pack buffer: two halves (alternate chunks), each the largest chunk
  int64_t items = 0;
};

// emit_keys: rotated_key is requested, so a sequence without queries is packed too (its rotation
// writes that output; no task reads its tiles).
Plan MakePlan(const Problem &p, const Tiling &t, int threads, bool emit_keys) {
  Plan plan;
  plan.group_size = p.q_heads / p.kv_heads;
  plan.block_q = std::max<int64_t>(1, t.rows / plan.group_size);
  // Prefer a block whose rows fill whole GEMM micro-tiles (a short tail tile runs far below peak),
  // giving up at most a quarter of the rows for it.
  for (int64_t bq = plan.block_q; plan.group_size * plan.block_q > simd::kRows && 4 * bq >= 3 * plan.block_q; --bq)
    if (plan.group_size * bq % simd::kRows == 0) {
      plan.block_q = bq;
      break;
    }
  plan.rows_max = plan.group_size * plan.block_q;
  plan.kv_block = RoundUp(std::max<int64_t>(1, t.kv_block), kCols);
  plan.head_pad = RoundUp(p.head_dim, kLanes);
  struct Item { int64_t seq, group, q0, nq, kv_end; };
  std::vector<Item> items;
  int64_t max_kv = 0;
  for (int64_t b = 0; b < p.batch; ++b) {
    const int64_t lq = p.q_lens[b], lk = p.kv_lens[b];
    for (int64_t g = 0; g < p.kv_heads; ++g)
      for (int64_t q0 = 0; q0 < lq; q0 += plan.block_q) {
        const int64_t nq = std::min(plan.block_q, lq - q0);
        const int64_t end = p.attrs.causal ? lk - lq + q0 + nq : lk;
        items.push_back({b, g, q0, nq, end});
        max_kv = std::max(max_kv, end);
      }
  }
  plan.items = static_cast<int64_t>(items.size());
  // Too few items to keep every thread busy (decode): split the KV range and merge afterwards.
  plan.nsplit = 1;
  if (plan.items > 0 && plan.items < 2 * threads) {
    const int64_t want = (4 * threads + plan.items - 1) / plan.items;
    const int64_t most = std::max<int64_t>(1, max_kv / std::max<int64_t>(1, t.min_split_keys));
    plan.nsplit = std::max<int64_t>(1, std::min(want, most));
  }
  for (int64_t i = 0; i < plan.items; ++i) {
    const Item &it = items[i];
    const int64_t chunk = RoundUp((it.kv_end + plan.nsplit - 1) / plan.nsplit, plan.kv_block);
    for (int64_t s = 0; s < plan.nsplit; ++s) {
      const int64_t lo = std::min(it.kv_end, s * chunk), hi = std::min(it.kv_end, lo + chunk);
      plan.tasks.push_back({it.seq, it.group, it.q0, it.nq, it.seq * p.kv_heads + it.group, lo, hi, s, i,
                            (hi - lo + 1) * it.nq});
    }
  }
  // Units heaviest first, then cut into chunks whose packed K/V fits in pack_bytes (a unit bigger
  // than that is a chunk of its own). A chunk's tasks run heaviest first (causal blocks near the end
  // of a sequence see the most keys) under dynamic scheduling, so it ends on light tasks.
  const int64_t units = p.batch * p.kv_heads;
  const bf16::Units chosen = p.bf16 ? bf16::ChosenUnits() : bf16::Units::kDot;
  plan.amx = p.bf16 && chosen == bf16::Units::kAmx;
  plan.widened = p.bf16 && chosen == bf16::Units::kFma;
  plan.pairs = p.bf16 && !plan.widened;
  plan.row_block = plan.amx ? 16 : simd::kRows;
  plan.feat_pad = RoundUp(p.head_dim, 32);
  plan.tile_floats = plan.pairs ? (plan.feat_pad * plan.kv_block + plan.kv_block * plan.head_pad) / 2  // kv_block is even
                            : p.head_dim * plan.kv_block + plan.kv_block * plan.head_pad;
  std::vector<int64_t> unit_cost(units, 0);
  for (const Task &task : plan.tasks) unit_cost[task.unit] += task.cost;
  std::vector<int64_t> order;
  for (int64_t u = 0; u < units; ++u)
    if (unit_cost[u] > 0 || (emit_keys && p.kv_lens[u / p.kv_heads] > 0)) order.push_back(u);
  std::stable_sort(order.begin(), order.end(), [&unit_cost](int64_t a, int64_t b) { return unit_cost[a] > unit_cost[b]; });
  std::vector<int64_t> chunk_of(units, -1);
  plan.unit_offset.assign(units, 0);
  int64_t used = 0;
  for (int64_t u : order) {
    const int64_t seq = u / p.kv_heads, tiles = (p.kv_lens[seq] + plan.kv_block - 1) / plan.kv_block;
    const int64_t floats = tiles * plan.tile_floats;
    if (plan.chunks.empty() || (used > 0 && (used + floats) * static_cast<int64_t>(sizeof(float)) > t.pack_bytes)) {
      plan.chunks.push_back({plan.packs.size(), plan.packs.size(), 0, 0});
      used = 0;
    }
    plan.unit_offset[u] = used;
    for (int64_t i = 0; i < tiles; ++i)
      plan.packs.push_back({seq, u % p.kv_heads, i * plan.kv_block, used + i * plan.tile_floats});
    used += floats;
    plan.chunks.back().pack_end = plan.packs.size();
    plan.pack_floats = std::max(plan.pack_floats, used);
    chunk_of[u] = static_cast<int64_t>(plan.chunks.size()) - 1;
  }
  // Odd chunks pack into the second half, so a chunk can be packed while the previous one's last
  // tasks still read theirs.
  const int64_t half = plan.pack_floats;
  if (plan.chunks.size() > 1) {
    plan.pack_floats = 2 * half;
    for (int64_t u = 0; u < units; ++u)
      if (chunk_of[u] % 2 == 1) plan.unit_offset[u] += half;
    for (PackItem &item : plan.packs)
      if (chunk_of[item.seq * p.kv_heads + item.group] % 2 == 1) item.offset += half;
  }
  std::stable_sort(plan.tasks.begin(), plan.tasks.end(), [&chunk_of](const Task &a, const Task &b) {
    return chunk_of[a.unit] != chunk_of[b.unit] ? chunk_of[a.unit] < chunk_of[b.unit] : a.cost > b.cost;
  });
  for (size_t i = 0, c = 0; c < plan.chunks.size(); ++c) {
    plan.chunks[c].task_begin = i;
    while (i < plan.tasks.size() && chunk_of[plan.tasks[i].unit] == static_cast<int64_t>(c)) ++i;
    plan.chunks[c].task_end = i;
  }
  return plan;
}

// Partial results of a split task: unnormalised O rows, running max (log2 units) and sum.
struct Partials {
  std::vector<float> o, m, l;
  int64_t stride_item = 0, rows = 0, head_pad = 0;
  float *O(int64_t item, int64_t split) { return o.data() + (item * stride_item + split) * rows * head_pad; }
  float *M(int64_t item, int64_t split) { return m.data() + (item * stride_item + split) * rows; }
  float *L(int64_t item, int64_t split) { return l.data() + (item * stride_item + split) * rows; }
};

class Worker {
 public:
  Worker(const Problem &p, const Buffers &buf, const Tiling &t, const Plan &plan, float *packed, Partials *partials)
      : p_(p), buf_(buf), tiling_(t), plan_(plan), packed_(packed), partials_(partials),
        tables_{&p, buf.cos, buf.sin} {}

  // Every pointer into the thread's scratch, from one list of regions (rows.h). Allocation
  // failures return false: nothing may throw inside the OpenMP region.
  bool Bind(Scratch *scratch) {
    const int64_t R = plan_.rows_max, D = p_.head_dim, Dp = plan_.head_pad, BK = plan_.kv_block, rd = p_.rotary_dim;
    const int64_t Rt = RoundUp(R, plan_.row_block);  // AMX writes whole 16-row tiles of S and O
    ScratchRegions regions;
    regions.Add(&q_, R * D).Add(&s_, Rt * BK).Add(&o_, Rt * Dp).Add(&m_, R).Add(&l_, R);
    regions.Add(&row_, Dp).Add(&orig_, Dp).Add(&tmp_, Dp).Add(&ctmp_, rd).Add(&stmp_, rd).Add(&stage_, kLanes * Dp);
    // bfloat16 rows, two to a float slot: Q, P, the staged K rows and one V row, rounded.
    float *q16 = nullptr, *p16 = nullptr, *stage16 = nullptr, *row16 = nullptr;
    const int64_t halves = plan_.pairs ? 1 : 0;
    regions.Add(&q16, halves * Rt * plan_.feat_pad / 2).Add(&p16, halves * Rt * BK / 2);
    regions.Add(&stage16, halves * kLanes * plan_.feat_pad / 2).Add(&row16, halves * Dp / 2);
    if (!regions.Carve(scratch)) return false;
    q16_ = reinterpret_cast<uint16_t *>(q16);
    p16_ = reinterpret_cast<uint16_t *>(p16);
    stage16_ = reinterpret_cast<uint16_t *>(stage16);
    row16_ = reinterpret_cast<uint16_t *>(row16);
    try {
      valid_.resize(R);
      kmin_.resize(Rt / plan_.row_block + 1);
      nlim_.resize(Rt / plan_.row_block + 1);
      klim_.resize(Rt / plan_.row_block + 1);
    } catch (const std::bad_alloc &) {
      return false;
    }
    return true;
  }

  void RunTask(const Task &t) {
    const int64_t G = plan_.group_size, D = p_.head_dim, Dp = plan_.head_pad, rd = p_.rotary_dim;
    const int64_t M = G * t.nq, mode = p_.attrs.rotary_mode, F = plan_.feat_pad, RB = plan_.row_block;
    const int64_t lq = p_.q_lens[t.seq], lk = p_.kv_lens[t.seq];
    const int64_t q_off = lk - lq;  // bottom-right: query i sits at position lk - lq + i
    const bool rotate = tiling_.rotate, bf16 = p_.bf16, pairs = plan_.pairs;
    // float32 scales Q into log2 units; bfloat16 rounds Q unscaled and scales the float32 scores instead.
    const float qmul = p_.scale * kLog2e, qscale = bf16 ? 1.0f : qmul, smul = bf16 ? qmul : 1.0f;
    const int64_t qseq = t.seq * p_.q.batch + p_.q_start[t.seq] * p_.q.row;
    // 2. Q tile: rotate once, scale into log2 units.
    for (int64_t gi = 0; gi < G; ++gi) {
      const int64_t head = t.group * G + gi;
      for (int64_t i = 0; i < t.nq; ++i) {
        const int64_t pos = q_off + t.q0 + i;
        float *dst = q_ + (gi * t.nq + i) * D;
        const float *x = RowAsFloat(p_.qkv_dtype, buf_.query, qseq + head * p_.q.head + (t.q0 + i) * p_.q.row, D, row_);
        if (rotate) {
          Rotate(x, tables_.Row(buf_.cos, p_.cos_dtype, pos, ctmp_), tables_.Row(buf_.sin, p_.sin_dtype, pos, stmp_), rd,
                 D, mode, qscale, dst);
        } else {
          for (int64_t d = 0; d < D; ++d) dst[d] = x[d] * qscale;
        }
        if (pairs) {
          uint16_t *q16 = q16_ + (gi * t.nq + i) * F;
          bf16::Round(dst, q16, D);
          std::memset(q16 + D, 0, (F - D) * sizeof(uint16_t));
        } else if (bf16) {
          bf16::RoundInPlace(dst, D);
        }
      }
    }
    if (plan_.amx) {  // the rows up to a whole tile: zero (their S and O rows are never read)
      std::memset(q16_ + M * F, 0, (RoundUp(M, RB) - M) * F * sizeof(uint16_t));
      bf16::AmxConfigure();
    }
    for (int64_t r = 0; r < M; ++r) { m_[r] = kNegInf; l_[r] = 0.f; }
    std::memset(o_, 0, M * Dp * sizeof(float));
    const int64_t BK = plan_.kv_block;
    for (int64_t j0 = t.kv_lo; j0 < t.kv_hi; j0 += BK) {
      const int64_t n = std::min(BK, t.kv_hi - j0), np = RoundUp(n, kLanes);
      // The packed K^T (row stride BK) and V tiles. Tiles are packed whole (up to the sequence's last
      // key); the keys past this task's causal bound are masked like any other.
      const float *kt = packed_ + plan_.unit_offset[t.unit] + j0 / BK * plan_.tile_floats;
      const float *v = kt + p_.head_dim * BK;
      const uint16_t *kt16 = reinterpret_cast<const uint16_t *>(kt), *v16 = kt16 + F * BK;
      // 3. Keys of the tile each row sees. On a causal diagonal tile the GEMMs cover, per micro-tile
      //    row block, only the columns (Q K^T) and keys (P V) that some row of the block sees.
      const bool diagonal = p_.attrs.causal && q_off + t.q0 - j0 + 1 < n;
      for (int64_t r = 0; r < M; ++r)
        valid_[r] = diagonal ? std::max<int64_t>(0, std::min(n, q_off + t.q0 + r % t.nq - j0 + 1)) : n;
      if (diagonal)
        for (int64_t b = 0; b * RB < M; ++b) {
          const auto first = valid_.begin() + b * RB, last = valid_.begin() + std::min(M, (b + 1) * RB);
          kmin_[b] = *std::min_element(first, last);
          nlim_[b] = RoundUp(*std::max_element(first, last), kLanes);
        }
      // 4. Scores, then online softmax per row.
      if (plan_.amx)
        bf16::AmxGemm(RoundUp(M, RB), np, F, q16_, F, kt16, 2 * BK, s_, np, false, diagonal ? nlim_.data() : nullptr);
      else if (pairs)
        bf16::Gemm(M, np, D, q16_, F, kt16, 2 * BK, s_, np, false, diagonal ? nlim_.data() : nullptr);
      else
        simd::Gemm(M, np, D, q_, D, kt, BK, s_, np, false, diagonal ? nlim_.data() : nullptr);
      const simd::vf vmul = simd::Splat(smul);
      for (int64_t r = 0; r < M; ++r) {
        float *srow = s_ + r * np;
        const int64_t valid = valid_[r];
        if (valid == 0) {  // this row sees no key of the tile: contributes nothing to P V
          std::memset(srow, 0, np * sizeof(float));
          if (pairs) std::memset(p16_ + r * BK, 0, np * sizeof(uint16_t));
          continue;
        }
        for (int64_t j = valid; j < np; ++j) srow[j] = kNegInf;
        simd::vf vmax = simd::Splat(kNegInf);
        for (int64_t j = 0; j < np; j += kLanes) {
          const simd::vf x = simd::Load(srow + j);
          vmax = x > vmax ? x : vmax;
        }
        // The row's reference max moves only when a tile's max passes it by more than kRescaleSlack:
        // below that, P = 2^(s - m) <= 2^kRescaleSlack cannot overflow, and the O row and the sum
        // need no rescaling (most tiles after the first few).
        const float tile_max = simd::ReduceMax(vmax) * smul;
        if (tile_max > m_[r] + kRescaleSlack) {
          if (m_[r] != kNegInf) {  // the first tile has nothing to rescale (O and l are 0)
            const float alpha = std::exp2(m_[r] - tile_max);
            l_[r] *= alpha;
            float *orow = o_ + r * Dp;
            const simd::vf va = simd::Splat(alpha);
            for (int64_t d = 0; d < Dp; d += kLanes) simd::Store(orow + d, simd::Load(orow + d) * va);
          }
          m_[r] = tile_max;
        }
        simd::vf vsum = {};
        const simd::vf vm = simd::Splat(m_[r]);
        for (int64_t j = 0; j < np; j += kLanes) {
          const simd::vf e = simd::Exp2(simd::Load(srow + j) * vmul - vm);
          simd::Store(srow + j, e);
          vsum += e;
        }
        l_[r] += simd::ReduceSum(vsum);
        // P rounded to bfloat16 after the sum above (of the float32 P) took it.
        if (pairs) bf16::Round(srow, p16_ + r * BK, np);
        else if (bf16) bf16::RoundInPlace(srow, np);
      }
      if (pairs) {
        PairsTimesV(M, n, diagonal, v16);
        continue;
      }
      // P V. On a diagonal tile the GEMM takes, per row block, only the keys every row of the block sees;
      // each row adds the rest of its own keys itself. A key a row cannot see is never multiplied by
      // that row's zero probability: 0 x NaN (a preallocated cache's garbage) would poison the row.
      simd::Gemm(M, Dp, n, s_, np, v, Dp, o_, Dp, true, nullptr, diagonal ? kmin_.data() : nullptr);
      if (diagonal)
        for (int64_t r = 0; r < M; ++r) {
          float *orow = o_ + r * Dp;
          const float *srow = s_ + r * np;
          for (int64_t j = kmin_[r / RB]; j < valid_[r]; ++j) {
            const simd::vf p = simd::Splat(srow[j]);
            const float *vrow = v + j * Dp;
            for (int64_t d = 0; d < Dp; d += kLanes) simd::Store(orow + d, simd::Load(orow + d) + p * simd::Load(vrow + d));
          }
        }
    }
    if (plan_.amx) bf16::AmxRelease();
    if (plan_.nsplit > 1) {
      std::memcpy(partials_->O(t.item, t.split), o_, M * Dp * sizeof(float));
      std::memcpy(partials_->M(t.item, t.split), m_, M * sizeof(float));
      std::memcpy(partials_->L(t.item, t.split), l_, M * sizeof(float));
    } else {
      Finish(t, o_, m_, l_);
    }
  }

  // O += P V on bfloat16 pairs of keys: per row block, the keys every row of the block sees (all n
  // off the causal diagonal) in whole pairs (whole 32-key tiles with AMX), then each row's own
  // remaining keys one at a time (an odd count's last key, the diagonal's ragged edge): a key a row
  // cannot see never meets its zero probability.
  void PairsTimesV(int64_t M, int64_t n, bool diagonal, const uint16_t *v16) {
    const int64_t Dp = plan_.head_pad, BK = plan_.kv_block, RB = plan_.row_block, step = plan_.amx ? 32 : 2;
    for (int64_t b = 0; b * RB < M; ++b) klim_[b] = (diagonal ? kmin_[b] : n) / step * step;
    if (plan_.amx)
      bf16::AmxGemm(RoundUp(M, RB), Dp, n, p16_, BK, v16, 2 * Dp, o_, Dp, true, nullptr, klim_.data());
    else
      bf16::Gemm(M, Dp, n, p16_, BK, v16, 2 * Dp, o_, Dp, true, nullptr, klim_.data());
    for (int64_t r = 0; r < M; ++r)
      for (int64_t j = klim_[r / RB]; j < valid_[r]; ++j)
        bf16::AddKey(o_ + r * Dp, bf16::ToFloat(p16_[r * BK + j]), v16, j, Dp);
  }

  // Merge the splits of one item by log-sum-exp, then write it.
  void MergeItem(const Task &t) {
    const int64_t M = plan_.group_size * t.nq, Dp = plan_.head_pad;
    for (int64_t r = 0; r < M; ++r) MergeSplitRow(*partials_, t.item, plan_.nsplit, r, Dp, o_ + r * Dp, &m_[r], &l_[r]);
    Finish(t, o_, m_, l_);
  }

  // 1. One tile of keys: rotated and transposed into K^T (row stride kv_block, columns past the
  // last key zero up to a whole vector), V rows after it (row stride head_pad, padding zero), and
  // the keys into rotated_key when it is requested (as given when they already carry RoPE, or when
  // the rotation is switched off).
  // Contiguous packed tiles keep the GEMM's B panels in cache; reading V in place with the
  // layout's row stride measured slower.
  void PackTile(const PackItem &item) {
    const int64_t D = p_.head_dim, Dp = plan_.head_pad, BK = plan_.kv_block, rd = p_.rotary_dim;
    const int64_t mode = p_.attrs.rotary_mode, j0 = item.j0, n = std::min(BK, p_.kv_lens[item.seq] - j0);
    float *kt = packed_ + item.offset, *v = kt + D * BK;
    uint16_t *kt16 = reinterpret_cast<uint16_t *>(kt), *v16 = kt16 + plan_.feat_pad * BK;
    const int64_t kvhead = item.seq * p_.kv.batch + p_.kv_start[item.seq] * p_.kv.row + item.group * p_.kv.head;
    for (int64_t j = 0; j < n; ++j) {
      const int64_t off = kvhead + (j0 + j) * p_.kv.row;
      const float *key = RowAsFloat(p_.qkv_dtype, buf_.key, off, D, row_);
      // Rows go to a staging block of kLanes keys, then K^T is written one vector (kLanes keys of
      // one feature) at a time: contiguous stores, not D scattered ones per key.
      float *staged = stage_ + (j % kLanes) * Dp;
      if (!tiling_.rotate) {
        std::memcpy(staged, key, D * sizeof(float));
        if (buf_.rotated_key) StoreRow(p_.qkv_dtype, key, D, buf_.rotated_key, off);
      } else if (p_.attrs.key_rotated) {  // a rotated KV cache: only reordered like Q
        ToKernelOrder(key, rd, D, mode, staged);
        if (buf_.rotated_key) StoreRow(p_.qkv_dtype, key, D, buf_.rotated_key, off);
      } else {
        const int64_t pos = j0 + j;
        Rotate(key, tables_.Row(buf_.cos, p_.cos_dtype, pos, ctmp_), tables_.Row(buf_.sin, p_.sin_dtype, pos, stmp_),
               rd, D, mode, 1.0f, staged);
        if (buf_.rotated_key) {
          ToOriginalOrder(staged, rd, D, mode, orig_);
          StoreRow(p_.qkv_dtype, orig_, D, buf_.rotated_key, off);
        }
      }
      if (j % kLanes == kLanes - 1 || j == n - 1) {
        const int64_t first = j - j % kLanes, count = j - first + 1;
        if (plan_.pairs) {
          PackKeyPairs(count, kt16 + 2 * first);
        } else {
          if (plan_.widened)
            for (int64_t jj = 0; jj < count; ++jj) bf16::RoundInPlace(stage_ + jj * Dp, D);
          for (int64_t d = 0; d < D; ++d) {
            simd::vf col = {};
            for (int64_t jj = 0; jj < count; ++jj) col[jj] = stage_[jj * Dp + d];
            simd::Store(kt + d * BK + first, col);
          }
        }
      }
      float *vrow = plan_.pairs ? tmp_ : v + j * Dp;
      LoadRow(p_.qkv_dtype, buf_.value, off, D, vrow);
      for (int64_t d = D; d < Dp; ++d) vrow[d] = 0.f;
      if (plan_.widened) bf16::RoundInPlace(vrow, D);
      if (plan_.pairs) {  // key j is the low (even j) or high half of its pair's words
        bf16::Round(vrow, row16_, Dp);
        uint16_t *pairs = v16 + (j / 2) * 2 * Dp + j % 2;
        for (int64_t d = 0; d < Dp; ++d) pairs[2 * d] = row16_[d];
      }
    }
  }

 private:
  // The `count` staged K rows (float32, kernel order), rounded to bfloat16 and written as pairs of
  // features: word (d/2, key) of the tile, one vector of kLanes keys per pair of features, the keys
  // past `count` and the features past head_dim (up to feat_pad) zero.
  void PackKeyPairs(int64_t count, uint16_t *kt16) {
    const int64_t D = p_.head_dim, Dp = plan_.head_pad, BK = plan_.kv_block, F = plan_.feat_pad;
    for (int64_t jj = 0; jj < count; ++jj) {
      bf16::Round(stage_ + jj * Dp, stage16_ + jj * F, D);
      std::memset(stage16_ + jj * F + D, 0, (F - D) * sizeof(uint16_t));
    }
    for (int64_t d2 = 0; d2 < F / 2; ++d2) {
      simd::vu col = {};
      for (int64_t jj = 0; jj < count; ++jj) {
        uint32_t word;
        std::memcpy(&word, stage16_ + jj * F + 2 * d2, 4);
        col[jj] = word;
      }
      std::memcpy(kt16 + d2 * 2 * BK, &col, sizeof col);
    }
  }

  // 5. Normalise and write the output rows and their log-sum-exp.
  void Finish(const Task &t, const float *o, const float *m, const float *l) {
    const int64_t G = plan_.group_size, D = p_.head_dim, Dp = plan_.head_pad;
    const int64_t qseq = t.seq * p_.q.batch + p_.q_start[t.seq] * p_.q.row;
    for (int64_t gi = 0; gi < G; ++gi) {
      const int64_t head = t.group * G + gi;
      for (int64_t i = 0; i < t.nq; ++i) {
        const int64_t r = gi * t.nq + i;
        const float inv = InverseSum(l[r]);
        for (int64_t d = 0; d < D; ++d) tmp_[d] = o[r * Dp + d] * inv;
        StoreRow(p_.qkv_dtype, tmp_, D, buf_.out, qseq + head * p_.q.head + (t.q0 + i) * p_.q.row);
        if (buf_.lse) {
          const int64_t idx = t.seq * p_.lse.batch + head * p_.lse.head + (p_.q_start[t.seq] + t.q0 + i) * p_.lse.row;
          buf_.lse[idx] = RowLse(m[r], l[r]);
        }
      }
    }
  }

  const Problem &p_;
  const Buffers &buf_;
  const Tiling &tiling_;
  const Plan &plan_;
  float *packed_;  // the current chunk's packed K/V tiles, shared by all threads
  Partials *partials_;
  Tables tables_;
  float *q_ = nullptr, *s_ = nullptr, *o_ = nullptr, *m_ = nullptr, *l_ = nullptr;
  float *row_ = nullptr, *orig_ = nullptr, *tmp_ = nullptr, *ctmp_ = nullptr, *stmp_ = nullptr;
  float *stage_ = nullptr;  // kLanes K rows, before they are written transposed
  uint16_t *q16_ = nullptr, *p16_ = nullptr, *stage16_ = nullptr, *row16_ = nullptr;  // bfloat16 arithmetic
  std::vector<int64_t> valid_;      // per row of the task: keys of the current tile it sees
  std::vector<int64_t> kmin_, nlim_;  // per micro-tile row block: keys every row of it sees, and
                                      // score columns to compute (up to the keys some row sees)
  std::vector<int64_t> klim_;         // bfloat16: per row block, keys its P V GEMM takes
};

thread_local Scratch tls_scratch, tls_packed;

}  // namespace

const char *Isa() { return simd::kIsa; }

bool NativeBf16() { return bf16::Native(); }

bool UseAmx(int64_t allow) {
  if (allow >= 0) bf16::amx_allowed.store(allow != 0);
  return bf16::UseAmx();
}

std::string ResolveCompute(Compute requested, Problem *p) {
  const std::string err = rfa::ResolveCompute(requested, bf16::Native(), bf16::Build(), p);
  return err.empty() && p->bf16 ? bf16::UnitsProblem() : err;
}

std::string Bf16Units() { return bf16::UnitsReport(); }

namespace {
std::atomic<int64_t> g_decode_calls{0};
}  // namespace

int64_t DecodeCalls() { return g_decode_calls.load(std::memory_order_relaxed); }

void Run(const Problem &p, const Buffers &buf, const Tiling &tiling) {
  if (UsesDecodePath(p, buf, tiling)) {
    g_decode_calls.fetch_add(1, std::memory_order_relaxed);
    return RunDecode(p, buf, tiling);
  }
  const int threads = omp_get_max_threads();
  const Plan plan = MakePlan(p, tiling, threads, buf.rotated_key != nullptr);
  Partials partials;
  if (plan.nsplit > 1) {
    partials.stride_item = plan.nsplit;
    partials.rows = plan.rows_max;
    partials.head_pad = plan.head_pad;
    const size_t slots = static_cast<size_t>(plan.items) * plan.nsplit;
    partials.o.resize(slots * plan.rows_max * plan.head_pad);
    partials.m.resize(slots * plan.rows_max);
    partials.l.resize(slots * plan.rows_max);
  }
  float *packed = tls_packed.Get(plan.pack_floats);
  if (!packed) throw std::bad_alloc();
  bool ok = true;
#pragma omp parallel num_threads(threads) reduction(&& : ok)
  {
    // Every thread must reach every worksharing loop, so a thread without scratch only records it.
    Worker worker(p, buf, tiling, plan, packed, &partials);
    const bool bound = worker.Bind(&tls_scratch);
    ok = bound;
    // Chunk c is packed into half c % 2 and read after the barrier that ends its packing. A thread
    // done with chunk c's tasks goes on to pack chunk c + 1 into the other half, whose readers (chunk
    // c - 1's tasks) all finished before that barrier of chunk c.
    for (const Chunk &c : plan.chunks) {
#pragma omp for schedule(dynamic, 1)
      for (size_t i = c.pack_begin; i < c.pack_end; ++i)
        if (bound) worker.PackTile(plan.packs[i]);
#pragma omp for schedule(dynamic, 1) nowait
      for (size_t i = c.task_begin; i < c.task_end; ++i)
        if (bound) worker.RunTask(plan.tasks[i]);
    }
    if (plan.nsplit > 1) {
#pragma omp barrier  // the last chunk's tasks are done before their splits are merged
      MergeSplitItems(worker, plan, bound);
    }
  }
  if (!ok) throw std::bad_alloc();
}

}  // namespace cpu
}  // namespace rfa
