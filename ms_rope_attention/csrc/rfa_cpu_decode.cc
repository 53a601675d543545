// The forward's decode path: a few query rows per sequence (q_len <= Tiling::stream_q_max: one token,
// or a speculative block) against a long KV range.
//
// Why a path of its own: the general path packs every K/V tile (rotated, transposed) before the query
// blocks read it, which pays off when hundreds of query rows re-read each tile. With one query row
// per head the pack is a second pass over K/V and its transposition costs more than the scores: the
// call ran at ~2 GB/s. Here each K/V row is read once, in place, by the one task that owns it:
//   - task = (sequence, KV heads, split of the KV range): every KV head of the sequence where a
//     token's heads are contiguous (BSND, BSH, TND), walked token by token so reads sweep memory in
//     order; one KV head for BNSD. The splits keep every thread busy and are merged by log-sum-exp;
//   - the task's rows are every query row of every query head of the GQA group (G x q_len), so a
//     K/V row read from memory serves the whole group;
//   - scores are dot products against the K row, read in place in its own dtype (a float16 or
//     bfloat16 cache is converted in registers: half the bytes of float32), online softmax per block
//     of keys in base 2, then O += P V row by row;
//   - causal rows (bottom-right) see keys up to their position; a key a row cannot see is never
//     read for it (a preallocated cache's unused rows may hold anything).
// Keys are rotated as they are read unless attrs.key_rotated (the KV-cache case: nothing to do).
// bfloat16 arithmetic (Problem::bf16) rounds where the general path does -- Q and K once after their
// float32 rotation, V, and P before P V -- and multiplies the rounded values in float32 (exact
// products, float32 sums): with one query row per head a K/V row meets too few rows for vdpbf16ps
// to pay for converting a float32 or float16 row into pairs. Rows read in place are rounded in
// registers as they are read (a bfloat16 cache needs nothing).
// A paged cache (Problem::paged, RotaryPagedAttention) is read the same way, each key's row found
// through its sequence's block table: no gather into a contiguous copy.
#include <omp.h>

#include <algorithm>
#include <limits>
#include <vector>

#include "bf16.h"
#include "rfa_cpu_kernel.h"
#include "rows.h"
#include "simd.h"

namespace rfa {
namespace cpu {
namespace {

using simd::kLanes;
constexpr float kLog2e = 1.4426950408889634f;
constexpr int64_t kBlock = 128;  // keys per online-softmax block

struct DecodeTask {
  int64_t seq, g0, g1, lo, hi, item, split;  // KV heads [g0, g1) of `seq`, keys [lo, hi)
};

struct DecodePlan {
  int64_t group_size = 0, groups = 0, rows = 0, head_pad = 0, nsplit = 1, items = 0;
  std::vector<DecodeTask> tasks;
};

// Where K/V rows of one head are contiguous (BNSD) a task takes one KV head; where a token's heads
// are (BSND, BSH, TND) it takes them all and walks the keys token by token: the reads then sweep
// memory in order (the hardware prefetcher follows them), instead of jumping a row of every head
// (N x D x 4 bytes: a new page per key) for each head in turn.
DecodePlan MakeDecodePlan(const Problem &p, const Tiling &t, int threads) {
  DecodePlan plan;
  plan.group_size = p.q_heads / p.kv_heads;
  plan.groups = p.kv.head < p.kv.row ? p.kv_heads : 1;
  plan.head_pad = RoundUp(p.head_dim, kLanes);
  int64_t max_q = 0, max_kv = 0;
  for (int64_t b = 0; b < p.batch; ++b) {
    max_q = std::max(max_q, p.q_lens[b]);
    max_kv = std::max(max_kv, p.kv_lens[b]);
  }
  plan.rows = plan.groups * plan.group_size * max_q;
  const int64_t per_seq = p.kv_heads / plan.groups;
  plan.items = p.batch * per_seq;
  // Enough tasks for dynamic scheduling to even out (4 per thread), none shorter than min_split_keys.
  const int64_t want = (4 * threads + plan.items - 1) / std::max<int64_t>(1, plan.items);
  plan.nsplit = std::max<int64_t>(1, std::min(want, max_kv / std::max<int64_t>(1, t.min_split_keys)));
  for (int64_t b = 0; b < p.batch; ++b) {
    const int64_t lq = p.q_lens[b], lk = p.kv_lens[b];  // the last query row sees every key
    if (lq == 0) continue;  // no queries (a TND gap sequence): nothing is read
    const int64_t chunk = RoundUp((lk + plan.nsplit - 1) / plan.nsplit, kBlock);
    for (int64_t u = 0; u < per_seq; ++u)
      for (int64_t s = 0; s < plan.nsplit; ++s) {
        const int64_t lo = std::min(lk, s * chunk), hi = std::min(lk, lo + chunk);
        plan.tasks.push_back({b, u * plan.groups, (u + 1) * plan.groups, lo, hi, b * per_seq + u, s});
      }
  }
  return plan;
}

// Unnormalised O rows, running max (log2 units) and sum of one (item, split).
struct DecodePartials {
  int64_t rows = 0, head_pad = 0, nsplit = 1;
  std::vector<float> o, m, l;
  void Resize(int64_t items) {
    o.assign(static_cast<size_t>(items * nsplit * rows * head_pad), 0.f);
    m.assign(static_cast<size_t>(items * nsplit * rows), kNegInf);
    l.assign(static_cast<size_t>(items * nsplit * rows), 0.f);
  }
  float *O(int64_t item, int64_t s) { return o.data() + (item * nsplit + s) * rows * head_pad; }
  float *M(int64_t item, int64_t s) { return m.data() + (item * nsplit + s) * rows; }
  float *L(int64_t item, int64_t s) { return l.data() + (item * nsplit + s) * rows; }
};

// Floats per vector as K/V rows of dtype T are streamed: the build's width, except that a float32
// cache is read 8 at a time in the AVX-512 build. Measured on 2 AVX-512 cores of an AMD EPYC, the
// builds' calls interleaved in one process (q_len 1, 32 heads, D 128): 8192 float32 keys in 8.8 ms
// median with 512-bit vectors, 7.6 ms with 256-bit ones; a float16 cache ran 10% faster with 512.
template <DType T>
constexpr int kStream = T == DType::F32 && kLanes > 8 ? 8 : kLanes;
template <DType T>
using Stream = simd::Floats<kStream<T>>;

// N floats rounded to bfloat16 values (round to nearest even, NaN kept: simd::BFloat16Bits), still
// float32: a float32 or float16 row read in place under bfloat16 arithmetic, rounded in registers.
template <int N>
struct BitsOf {  // a member typedef keeps vector_size (see simd::FloatsOf)
  typedef uint32_t type __attribute__((vector_size(N * 4)));
};
template <int N>
inline simd::Floats<N> RoundedToBFloat16(simd::Floats<N> x) {
  typename BitsOf<N>::type w;
  std::memcpy(&w, &x, sizeof w);
  w = simd::BFloat16Bits<typename BitsOf<N>::type>(w) << 16;
  std::memcpy(&x, &w, sizeof x);
  return x;
}

// kStream<T> elements of dtype T at element `off` of `base`, as float32 (rounded to bfloat16 values
// when `Round`): a half row is converted in registers as it is read (simd::HalfVector), never copied.
template <DType T, bool Round>
inline Stream<T> LoadAs(const void *base, int64_t off) {
  Stream<T> x;
  if constexpr (T == DType::F32) {
    x = simd::LoadFloats<kStream<T>>(static_cast<const float *>(base) + off);
  } else if constexpr (T == DType::F16) {
    x = simd::HalfVector(static_cast<const simd::Half *>(base) + off);
  } else {
    x = simd::BFloat16Vector(static_cast<const uint16_t *>(base) + off);
  }
  if constexpr (Round && T != DType::BF16) x = RoundedToBFloat16<kStream<T>>(x);
  return x;
}

// q . x for a row x of n elements (n a multiple of kLanes) at `off`.
template <DType T, bool Round>
inline float DotAs(const float *q, const void *base, int64_t off, int64_t n) {
  constexpr int N = kStream<T>;
  Stream<T> acc0 = {}, acc1 = {};
  int64_t i = 0;
  for (; i + 2 * N <= n; i += 2 * N) {
    acc0 += simd::LoadFloats<N>(q + i) * LoadAs<T, Round>(base, off + i);
    acc1 += simd::LoadFloats<N>(q + i + N) * LoadAs<T, Round>(base, off + i + N);
  }
  if (i < n) acc0 += simd::LoadFloats<N>(q + i) * LoadAs<T, Round>(base, off + i);
  return simd::SumFloats<N>(acc0 + acc1);
}

// o += p * x for a row x of n elements (n a multiple of kLanes) at `off`.
template <DType T, bool Round>
inline void AxpyAs(float *o, float p, const void *base, int64_t off, int64_t n) {
  constexpr int N = kStream<T>;
  for (int64_t i = 0; i < n; i += N)
    simd::StoreFloats<N>(o + i, simd::LoadFloats<N>(o + i) + p * LoadAs<T, Round>(base, off + i));
}

// `round`: the row's values rounded to bfloat16 as they are read (bfloat16 arithmetic on a float32
// or float16 row in place).
inline float Dot(const float *q, DType t, bool round, const void *base, int64_t off, int64_t n) {
  switch (t) {
    case DType::F16: return round ? DotAs<DType::F16, true>(q, base, off, n) : DotAs<DType::F16, false>(q, base, off, n);
    case DType::BF16: return DotAs<DType::BF16, false>(q, base, off, n);
    default: return round ? DotAs<DType::F32, true>(q, base, off, n) : DotAs<DType::F32, false>(q, base, off, n);
  }
}

inline void Axpy(float *o, float p, DType t, bool round, const void *base, int64_t off, int64_t n) {
  switch (t) {
    case DType::F16: return round ? AxpyAs<DType::F16, true>(o, p, base, off, n) : AxpyAs<DType::F16, false>(o, p, base, off, n);
    case DType::BF16: return AxpyAs<DType::BF16, false>(o, p, base, off, n);
    default: return round ? AxpyAs<DType::F32, true>(o, p, base, off, n) : AxpyAs<DType::F32, false>(o, p, base, off, n);
  }
}

// Rows of a task: for KV head g0 + u, query head (g0 + u) * G + gi, query i -> row (u * G + gi) * lq + i.
class DecodeWorker {
 public:
  DecodeWorker(const Problem &p, const Buffers &buf, const DecodePlan &plan, DecodePartials *partials)
      : p_(p), buf_(buf), plan_(plan), partials_(partials), tables_{&p, buf.cos, buf.sin} {}

  // Every pointer into the thread's scratch, from one list of regions (rows.h).
  bool Bind(Scratch *scratch) {
    const int64_t R = plan_.rows, Dp = plan_.head_pad, rd = p_.rotary_dim;
    ScratchRegions regions;
    regions.Add(&q_, R * Dp).Add(&s_, R * kBlock).Add(&o_, R * Dp).Add(&m_, R).Add(&l_, R);
    regions.Add(&row_, Dp).Add(&krow_, Dp).Add(&vrow_, Dp).Add(&tmp_, Dp).Add(&ctmp_, rd).Add(&stmp_, rd);
    if (!regions.Carve(scratch)) return false;
    try {
      valid_.resize(plan_.rows);
      key_rows_.resize(kBlock);
    } catch (const std::bad_alloc &) {
      return false;
    }
    return true;
  }

  void RunTask(const DecodeTask &t) {
    const int64_t G = plan_.group_size, D = p_.head_dim, Dp = plan_.head_pad, rd = p_.rotary_dim;
    const int64_t lq = p_.q_lens[t.seq], lk = p_.kv_lens[t.seq], mode = p_.attrs.rotary_mode;
    const int64_t per_group = G * lq, M = (t.g1 - t.g0) * per_group, q_off = lk - lq;
    const int64_t qseq = t.seq * p_.q.batch + p_.q_start[t.seq] * p_.q.row;
    // Q rows: rotated at their positions, scaled into log2 units (bfloat16: rounded first), zero-padded to Dp.
    const float qmul = p_.scale * kLog2e;
    for (int64_t r = 0; r < M; ++r) {
      const int64_t head = t.g0 * G + r / lq, i = r % lq, pos = q_off + i;
      float *dst = q_ + r * Dp;
      const float *x = RowAsFloat(p_.qkv_dtype, buf_.query, qseq + head * p_.q.head + i * p_.q.row, D, row_);
      Rotate(x, tables_.Row(buf_.cos, p_.cos_dtype, pos, ctmp_), tables_.Row(buf_.sin, p_.sin_dtype, pos, stmp_), rd,
             D, mode, p_.bf16 ? 1.0f : qmul, dst);
      if (p_.bf16) {
        bf16::RoundInPlace(dst, D);
        for (int64_t d = 0; d < D; ++d) dst[d] *= qmul;
      }
      for (int64_t d = D; d < Dp; ++d) dst[d] = 0.f;
      m_[r] = kNegInf;
      l_[r] = 0.f;
    }
    std::memset(o_, 0, M * Dp * sizeof(float));
    for (int64_t d = D; d < Dp; ++d) krow_[d] = vrow_[d] = 0.f;
    const int64_t kvseq = t.seq * p_.kv.batch + p_.kv_start[t.seq] * p_.kv.row;
    // Rows read in place (in their own dtype) when they are a whole number of vectors and, for K,
    // already rotated and in kernel order; else converted (and rotated) into a float32 row first.
    // bfloat16 arithmetic rounds a float32 or float16 row read in place as it reads it; a converted
    // row is rounded once when converted.
    const bool in_place = D == Dp;
    const bool k_in_place = in_place && p_.attrs.key_rotated && (mode == 0 || rd == 0);
    const DType kt = k_in_place ? p_.qkv_dtype : DType::F32, vt = in_place ? p_.qkv_dtype : DType::F32;
    const bool k_round = p_.bf16 && k_in_place, v_round = p_.bf16 && in_place;
    for (int64_t j0 = t.lo; j0 < t.hi; j0 += kBlock) {
      const int64_t n = std::min(kBlock, t.hi - j0);
      // Keys of this block each row sees: query i (position q_off + i) sees keys <= its position.
      int64_t block_valid = 0;
      for (int64_t r = 0; r < M; ++r) {
        valid_[r] = p_.attrs.causal ? std::max<int64_t>(0, std::min(n, q_off + r % lq - j0 + 1)) : n;
        block_valid = std::max(block_valid, valid_[r]);
      }
      KeyRowOffsets(t.seq, kvseq, j0, block_valid);
      for (int64_t j = 0; j < block_valid; ++j)
        for (int64_t g = t.g0; g < t.g1; ++g) {
          int64_t off = key_rows_[j] + g * p_.kv.head;
          const void *k = buf_.key;
          if (!k_in_place) {
            k = KeyRow(off, j0 + j);
            off = 0;
          }
          for (int64_t r = (g - t.g0) * per_group, e = r + per_group; r < e; ++r)
            if (j < valid_[r]) s_[r * kBlock + j] = Dot(q_ + r * Dp, kt, k_round, k, off, Dp);
        }
      for (int64_t r = 0; r < M; ++r) Softmax(r);
      for (int64_t j = 0; j < block_valid; ++j)
        for (int64_t g = t.g0; g < t.g1; ++g) {
          int64_t off = key_rows_[j] + g * p_.kv.head;
          const void *v = buf_.value;
          if (!in_place) {
            LoadRow(p_.qkv_dtype, buf_.value, off, D, vrow_);
            if (p_.bf16) bf16::RoundInPlace(vrow_, D);
            v = vrow_;
            off = 0;
          }
          for (int64_t r = (g - t.g0) * per_group, e = r + per_group; r < e; ++r)
            if (j < valid_[r]) Axpy(o_ + r * Dp, s_[r * kBlock + j], vt, v_round, v, off, Dp);
        }
    }
    std::memcpy(partials_->O(t.item, t.split), o_, M * Dp * sizeof(float));
    std::memcpy(partials_->M(t.item, t.split), m_, M * sizeof(float));
    std::memcpy(partials_->L(t.item, t.split), l_, M * sizeof(float));
  }

  // Merge the splits of one item by log-sum-exp, normalise, write out and lse.
  void MergeItem(const DecodeTask &t) {
    const int64_t G = plan_.group_size, D = p_.head_dim, Dp = plan_.head_pad, lq = p_.q_lens[t.seq];
    const int64_t qseq = t.seq * p_.q.batch + p_.q_start[t.seq] * p_.q.row;
    for (int64_t r = 0; r < (t.g1 - t.g0) * G * lq; ++r) {
      float m, l;
      MergeSplitRow(*partials_, t.item, plan_.nsplit, r, Dp, tmp_, &m, &l);
      const float inv = InverseSum(l);
      for (int64_t d = 0; d < D; ++d) tmp_[d] *= inv;
      const int64_t head = t.g0 * G + r / lq, i = r % lq;
      StoreRow(p_.qkv_dtype, tmp_, D, buf_.out, qseq + head * p_.q.head + i * p_.q.row);
      if (buf_.lse)
        buf_.lse[t.seq * p_.lse.batch + head * p_.lse.head + (p_.q_start[t.seq] + i) * p_.lse.row] =
            RowLse(m, l);
    }
  }

 private:
  // Element offsets (head 0) of keys [j0, j0 + n) of sequence `seq`: rows of one array from
  // `kvseq`, or, with a paged cache, the row of the block its block table names (validated).
  void KeyRowOffsets(int64_t seq, int64_t kvseq, int64_t j0, int64_t n) {
    const PagedKv &pg = p_.paged;
    if (!pg.tables) {
      for (int64_t j = 0; j < n; ++j) key_rows_[j] = kvseq + (j0 + j) * p_.kv.row;
      return;
    }
    const int32_t *table = pg.tables + seq * pg.max_blocks;
    for (int64_t j = 0; j < n; ++j) {
      const int64_t key = j0 + j;
      key_rows_[j] = (table[key / pg.block_size] * pg.block_size + key % pg.block_size) * p_.kv.row;
    }
  }

  // One K row as float32 in kernel order, zero-padded to Dp: converted, reordered or rotated.
  const float *KeyRow(int64_t off, int64_t pos) {
    const int64_t D = p_.head_dim, rd = p_.rotary_dim, mode = p_.attrs.rotary_mode;
    const float *x = RowAsFloat(p_.qkv_dtype, buf_.key, off, D, row_);
    if (p_.attrs.key_rotated)
      ToKernelOrder(x, rd, D, mode, krow_);
    else
      Rotate(x, tables_.Row(buf_.cos, p_.cos_dtype, pos, ctmp_), tables_.Row(buf_.sin, p_.sin_dtype, pos, stmp_), rd,
             D, mode, 1.0f, krow_);
    if (p_.bf16) bf16::RoundInPlace(krow_, D);
    return krow_;
  }

  // Online softmax of row r over the block's valid scores: probabilities left in place in s_.
  void Softmax(int64_t r) {
    const int64_t valid = valid_[r];
    if (valid == 0) return;
    float *srow = s_ + r * kBlock;
    float block_max = kNegInf;
    for (int64_t j = 0; j < valid; ++j) block_max = std::max(block_max, srow[j]);
    if (block_max > m_[r]) {
      if (m_[r] != kNegInf) {
        const float alpha = std::exp2(m_[r] - block_max);
        l_[r] *= alpha;
        const simd::vf va = simd::Splat(alpha);
        float *orow = o_ + r * plan_.head_pad;
        for (int64_t d = 0; d < plan_.head_pad; d += kLanes) simd::Store(orow + d, simd::Load(orow + d) * va);
      }
      m_[r] = block_max;
    }
    const simd::vf vm = simd::Splat(m_[r]);
    float sum = 0.f;
    int64_t j = 0;
    simd::vf vsum = {};
    for (; j + kLanes <= valid; j += kLanes) {
      const simd::vf e = simd::Exp2(simd::Load(srow + j) - vm);
      simd::Store(srow + j, e);
      vsum += e;
    }
    for (; j < valid; ++j) {
      srow[j] = std::exp2(srow[j] - m_[r]);
      sum += srow[j];
    }
    l_[r] += sum + simd::ReduceSum(vsum);
    if (p_.bf16) bf16::RoundInPlace(srow, valid);  // P V takes P in bfloat16; the sum is of the float32 P
  }

  const Problem &p_;
  const Buffers &buf_;
  const DecodePlan &plan_;
  DecodePartials *partials_;
  Tables tables_;
  float *q_ = nullptr, *s_ = nullptr, *o_ = nullptr, *m_ = nullptr, *l_ = nullptr;
  float *row_ = nullptr, *krow_ = nullptr, *vrow_ = nullptr, *tmp_ = nullptr, *ctmp_ = nullptr, *stmp_ = nullptr;
  std::vector<int64_t> valid_, key_rows_;
};

thread_local Scratch tls_decode_scratch;

}  // namespace

bool UsesDecodePath(const Problem &p, const Buffers &buf, const Tiling &t) {
  if (t.stream_q_max <= 0 || buf.rotated_key || !t.rotate) return false;
  for (int64_t b = 0; b < p.batch; ++b)
    if (p.q_lens[b] > t.stream_q_max) return false;
  return true;
}

void RunDecode(const Problem &p, const Buffers &buf, const Tiling &tiling) {
  const int threads = omp_get_max_threads();
  const DecodePlan plan = MakeDecodePlan(p, tiling, threads);
  DecodePartials partials;
  partials.rows = plan.rows;
  partials.head_pad = plan.head_pad;
  partials.nsplit = plan.nsplit;
  partials.Resize(plan.items);
  const int64_t ntasks = static_cast<int64_t>(plan.tasks.size());
  bool ok = true;
#pragma omp parallel num_threads(threads) reduction(&& : ok)
  {
    DecodeWorker worker(p, buf, plan, &partials);
    const bool bound = worker.Bind(&tls_decode_scratch);
    ok = bound;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < ntasks; ++i)
      if (bound) worker.RunTask(plan.tasks[i]);
    MergeSplitItems(worker, plan, bound);
  }
  if (!ok) throw std::bad_alloc();
}

}  // namespace cpu
}  // namespace rfa
