// RotaryFlashAttention on an Ascend AI core (Atlas A2, MIX 1:2: this code runs on the two vector
// cores of an AI core and drives its cube core through the high-level Matmul API; the cube core
// leaves the kernel inside REGIST_MATMUL_OBJ in the entry). See ../DESIGN.md for the data flow, the
// buffer plan and the bytes moved compared with a standalone RoPE.
//
// Synchronisation: data crossing pipes (S scalar, V vector, MTE2 GM->UB, MTE3 UB->GM) goes through
// a TQue hand-off (VECIN: MTE2 -> V, VECOUT: V -> MTE3) or an explicit SetFlag/WaitFlag pair
// (Sync<...>), and GM the cube reads is fenced with PipeBarrier<PIPE_ALL> before each matmul.
//
// Per task (one sequence, one KV head, block_q query rows of each of the `group` query heads):
//   1. ROTATE Q (here, once per task): each Q row is loaded GM->UB, cast to float32, rotated as
//      y = x * cos + perm(x) * sin' (perm = swap halves or pairs via Gather, sign folded into sin'),
//      scaled by the softmax scale, cast back and written to this core's workspace slice. The
//      rotated Q block (<= 32 KiB) is re-read by the cube for every KV tile: it stays in L2.
//   2. ROTATE K (here, per KV tile): K rows are rotated the same way on their way to the workspace
//      tile the cube reads; V rows are staged beside them. The last query block of a sequence also
//      writes the rotated K to the `rotated_key` output (for the KV cache).
//   3. S = Q K^T on the cube into the UB (float32); online softmax per row on the vector unit;
//      P (input dtype) to the workspace; O = O * alpha + P V on the cube.
//   4. O / l cast to the output dtype; lse = m + ln l, staged in the UB and stored with DataCopyPad
//      (never scalar GM writes: cores share the 64-byte lines of the lse).
// Keys a row cannot see never reach it: their scores are masked before the softmax, and V rows
// holding NaN/Inf are zeroed in the workspace (P is exactly 0 there, but 0 x NaN is NaN); a row that
// does see such a value gets NaN.
// No rotated Q/K tensor of the problem's size is ever written to HBM: only per-core tiles that the
// cube consumes immediately (L2-resident on A2), instead of a standalone RoPE's full read + write of
// Q and K and the attention kernel's second read.
#pragma once
#include "kernel_operator.h"
#include "lib/matmul_intf.h"
#include "rfa_kernel_common.h"
#include "rotary_flash_attention_tiling.h"

namespace rfa {
namespace ascend {

constexpr float kMaskValue = -3.0e38f;  // masked score: exp(kMaskValue - m) == 0 for any finite m
constexpr float kMinInit = -1.0e30f;    // running max before the first key (finite: no inf - inf)
constexpr float kNegInf = -__builtin_inff();

template <typename T, typename TT>
class RotaryFlashAttentionKernel {
  using AType = matmul::MatmulType<TPosition::GM, CubeFormat::ND, T>;
  using BTransType = matmul::MatmulType<TPosition::GM, CubeFormat::ND, T, true>;
  using BType = matmul::MatmulType<TPosition::GM, CubeFormat::ND, T>;
  using CType = matmul::MatmulType<TPosition::VECIN, CubeFormat::ND, float>;
  using BiasType = matmul::MatmulType<TPosition::GM, CubeFormat::ND, float>;

 public:
  // Registered by REGIST_MATMUL_OBJ in the kernel entry, before Init.
  matmul::Matmul<AType, BTransType, CType, BiasType> mm_qk;
  matmul::Matmul<AType, BType, CType, BiasType> mm_pv;

  __aicore__ inline void Init(GM_ADDR query, GM_ADDR key, GM_ADDR value, GM_ADDR cos, GM_ADDR sin, GM_ADDR aq,
                              GM_ADDR akv, GM_ADDR out, GM_ADDR lse, GM_ADDR rotated_key, GM_ADDR workspace,
                              const RotaryFlashAttentionTilingData *tiling, AscendC::TPipe *pipe) {
    pipe_ = pipe;
    t_ = tiling->rfa;
    const int64_t q_elems = t_.layout == kLayoutTND ? t_.q_len * t_.q_heads * t_.head_dim
                                                    : t_.batch * t_.q_heads * t_.q_len * t_.head_dim;
    const int64_t kv_elems = t_.layout == kLayoutTND ? t_.kv_len * t_.kv_heads * t_.head_dim
                                                     : t_.batch * t_.kv_heads * t_.kv_len * t_.head_dim;
    query_.SetGlobalBuffer(reinterpret_cast<__gm__ T *>(query), q_elems);
    key_.SetGlobalBuffer(reinterpret_cast<__gm__ T *>(key), kv_elems);
    value_.SetGlobalBuffer(reinterpret_cast<__gm__ T *>(value), kv_elems);
    out_.SetGlobalBuffer(reinterpret_cast<__gm__ T *>(out), q_elems);
    if (t_.with_lse) lse_.SetGlobalBuffer(reinterpret_cast<__gm__ float *>(lse), q_elems / t_.head_dim);
    if (t_.with_rotated_key) rk_.SetGlobalBuffer(reinterpret_cast<__gm__ T *>(rotated_key), kv_elems);
    seq_.Init(t_, aq, akv);
    GM_ADDR user = AscendC::GetUserWorkspace(workspace);
    GM_ADDR mine = user + AscendC::GetBlockIdx() * t_.ws_per_core;
    // Where attention reads rotated keys from: the key itself (key_rotated), the rotated_key output
    // or the shared workspace (K pre-pass), or nowhere (each tile rotated on the fly).
    if (t_.key_rotated) {
      keys_ = key_;
    } else if (t_.k_prepass && t_.with_rotated_key) {
      keys_ = rk_;
    } else if (t_.k_prepass) {
      keys_.SetGlobalBuffer(reinterpret_cast<__gm__ T *>(user + t_.ws_keys), kv_elems);
    }
    const int64_t m = t_.group * t_.block_q;
    ws_q_.SetGlobalBuffer(reinterpret_cast<__gm__ T *>(mine + t_.ws_q), m * t_.head_pad);
    ws_k_.SetGlobalBuffer(reinterpret_cast<__gm__ T *>(mine + t_.ws_k), t_.block_kv * t_.head_pad);
    ws_v_.SetGlobalBuffer(reinterpret_cast<__gm__ T *>(mine + t_.ws_v), t_.block_kv * t_.head_pad);
    ws_p_.SetGlobalBuffer(reinterpret_cast<__gm__ T *>(mine + t_.ws_p), m * t_.block_kv);

    const UbPlan u = PlanUb(m, t_.block_kv, t_.head_pad, sizeof(T), sizeof(TT));
    rows_.Init(pipe_, t_, cos, sin, u.rows);
    pipe_->InitBuffer(scores_buf_, u.scores);
    pipe_->InitBuffer(probs_buf_, u.probs);
    pipe_->InitBuffer(o_buf_, u.acc);
    pipe_->InitBuffer(pv_buf_, u.acc);
    pipe_->InitBuffer(m_buf_, u.stats);
    pipe_->InitBuffer(l_buf_, u.stats);
    pipe_->InitBuffer(rowmax_buf_, u.stats);
    pipe_->InitBuffer(rowsum_buf_, u.stats);
    pipe_->InitBuffer(alpha_buf_, u.stats);
    pipe_->InitBuffer(poison_buf_, u.stats);
    pipe_->InitBuffer(reduce_buf_, u.reduce_tmp);
    pipe_->InitBuffer(reduce_out_buf_, u.reduce_out);
    pipe_->InitBuffer(lse_stage_buf_, u.lse_stage);
    mm_qk.SetOrgShape(m, t_.block_kv, t_.head_pad);
    mm_pv.SetOrgShape(m, t_.head_pad, t_.block_kv);
  }

  __aicore__ inline void Process() {
    // Tasks are spread over the tiling's vector workers; the launch has 2 x blockDim vector cores,
    // and the ones past core_num idle but still join the SyncAll (it waits for every launched core).
    const int64_t me = AscendC::GetBlockIdx(), cores = t_.core_num;
    if (t_.k_prepass) {  // every K row rotated exactly once, then every core may read any of them
      if (me < cores) RotateAllKeys(me, cores);
      AscendC::PipeBarrier<PIPE_ALL>();  // this core's rotated keys are in GM before the others read them
      AscendC::SyncAll();
    }
    if (me >= cores) return;
    ForEachTask(t_, QLenOf{this}, RunOwnTasks{this, me, cores});
    // Sequences with no query still owe their rotated keys. Without a pre-pass that only happens with
    // key_rotated (a requested rotated_key always takes the pre-pass), so it is a copy.
    if (t_.with_rotated_key && t_.layout == kLayoutTND && !t_.k_prepass) {
      int64_t index = 0;
      for (int64_t b = 0; b < t_.batch; ++b)
        for (int64_t g = 0; g < t_.kv_heads; ++g)
          if (seq_.QLen(b) == 0 && CoreOfTask(index++, cores) == me) EmitKeysOnly(b, g);
    }
  }

 private:
  // ForEachTask's callbacks (device code takes __aicore__ functors, not lambdas).
  struct QLenOf {
    RotaryFlashAttentionKernel *k;
    __aicore__ inline int64_t operator()(int64_t b) const { return k->seq_.QLen(b); }
  };
  struct RunOwnTasks {
    RotaryFlashAttentionKernel *k;
    int64_t me, cores;
    __aicore__ inline bool operator()(int64_t index, const Task &task) const {
      if (CoreOfTask(index, cores) == me) k->RunTask(task);
      return true;
    }
  };

  template <AscendC::HardEvent E>
  __aicore__ inline void Sync() {
    SyncPipes<E>(pipe_);
  }

  __aicore__ inline void RunTask(const Task &task) {
    const int64_t g = t_.group, d = t_.head_dim, nb = t_.block_kv;
    const int64_t m = g * task.nq, lq = seq_.QLen(task.seq), lk = seq_.KvLen(task.seq), q_off = lk - lq;
    LocalTensor<float> x = rows_.X(), y = rows_.Y();
    // 1. Rotate the Q block once (scale folded in) into the workspace, rows ordered (head, row).
    for (int64_t i = 0; i < task.nq; ++i) {
      rows_.LoadTables(q_off + task.q0 + i);
      for (int64_t gi = 0; gi < g; ++gi) {
        rows_.LoadRow(query_[seq_.QRow(task.seq, task.group * g + gi, task.q0 + i)], x);
        rows_.Rotate(x, y, t_.scale);
        rows_.StoreRow(y, ws_q_[(gi * task.nq + i) * t_.head_pad], nullptr);
      }
    }
    LocalTensor<float> o = o_buf_.Get<float>(), mrow = m_buf_.Get<float>(), lrow = l_buf_.Get<float>();
    AscendC::Duplicate(o, 0.0f, static_cast<int32_t>(m * t_.head_pad));
    AscendC::Duplicate(mrow, kMinInit, static_cast<int32_t>(m));
    AscendC::Duplicate(lrow, 0.0f, static_cast<int32_t>(m));
    // Without a pre-pass, the last query block (it sees every key) writes the rotated-key output.
    const bool emit_key = t_.with_rotated_key && !t_.k_prepass && task.q0 + task.nq == lq;
    const bool keys_ready = t_.key_rotated || t_.k_prepass;
    const int64_t kv_end = t_.causal ? q_off + task.q0 + task.nq : lk;
    AscendC::Duplicate(poison_buf_.Get<float>(), 0.0f, static_cast<int32_t>(m));
    for (int64_t j0 = 0; j0 < kv_end; j0 += nb) {
      const int64_t n = kv_end - j0 < nb ? kv_end - j0 : nb;
      // 2. K rows rotated into the workspace tile (and the rotated-key output); V rows beside them,
      //    each with a finiteness probe (sum of x - x: 0, or NaN when a value is NaN/Inf).
      LocalTensor<float> probe = rows_.Perm(), probes = reduce_out_buf_.Get<float>();
      for (int64_t j = 0; j < n; ++j) {
        const int64_t at = seq_.KvRow(task.seq, task.group, j0 + j);
        RotatedKey(at, j0 + j, keys_ready, x, y);
        const GlobalTensor<T> rk = rk_[at];
        rows_.StoreRow(y, ws_k_[j * t_.head_pad], emit_key ? &rk : nullptr);
        rows_.LoadRow(value_[at], x);
        AscendC::Sub(probe, x, x, static_cast<int32_t>(d));
        AscendC::ReduceSum(probes[j * kSlot], probe, reduce_buf_.Get<float>(), static_cast<int32_t>(d));
        rows_.StoreRow(x, ws_v_[j * t_.head_pad], nullptr);
      }
      for (int64_t j = n; j < nb; ++j) {  // tail tile: zero K and V rows, so full-size matmuls add nothing
        rows_.ZeroRow(ws_k_[j * t_.head_pad]);
        rows_.ZeroRow(ws_v_[j * t_.head_pad]);
      }
      // A V row with NaN/Inf is zeroed (after its first store: MTE3 keeps order); the rows that see
      // it are marked in OnlineSoftmax.
      Sync<AscendC::HardEvent::V_S>();
      int64_t first_bad = n;
      for (int64_t j = n - 1; j >= 0; --j) {
        const float p = probes.GetValue(j * kSlot);
        if (p != p) {
          first_bad = j;
          rows_.ZeroRow(ws_v_[j * t_.head_pad]);
        }
      }
      AscendC::PipeBarrier<PIPE_ALL>();  // workspace writes (MTE3) land before the cube reads them
      // 3. S = Q K^T (float32, in the UB).
      LocalTensor<float> s = scores_buf_.Get<float>();
      mm_qk.SetTensorA(ws_q_);
      mm_qk.SetTensorB(ws_k_, true);
      mm_qk.SetTail(static_cast<int>(m), static_cast<int>(nb), static_cast<int>(d));
      mm_qk.IterateAll(s);
      mm_qk.End();
      AscendC::PipeBarrier<PIPE_ALL>();  // S in the UB before the scalar masks it (IterateAll promises no visibility)
      OnlineSoftmax(task, q_off, j0, n, m, first_bad);
      AscendC::PipeBarrier<PIPE_ALL>();  // P in the workspace before the cube reads it
      // O = O * alpha + P V.
      LocalTensor<float> pv = pv_buf_.Get<float>(), alpha = alpha_buf_.Get<float>();
      mm_pv.SetTensorA(ws_p_);
      mm_pv.SetTensorB(ws_v_);
      mm_pv.SetTail(static_cast<int>(m), static_cast<int>(t_.head_pad), static_cast<int>(nb));
      mm_pv.IterateAll(pv);
      mm_pv.End();
      AscendC::PipeBarrier<PIPE_ALL>();  // PV in the UB before the vector pipe adds it
      for (int64_t r = 0; r < m; ++r) {
        LocalTensor<float> orow = o[r * t_.head_pad];
        AscendC::Muls(orow, orow, alpha.GetValue(r), static_cast<int32_t>(d));
        AscendC::Add(orow, orow, pv[r * t_.head_pad], static_cast<int32_t>(d));
      }
    }
    Finish(task, m);
  }

  // Scores of one tile -> P (input dtype) in the workspace; updates m, l and alpha per row, and marks
  // the rows that see key `first_bad` of the tile (a V row with NaN/Inf; n when none).
  __aicore__ inline void OnlineSoftmax(const Task &task, int64_t q_off, int64_t j0, int64_t n, int64_t m,
                                       int64_t first_bad) {
    const int64_t nb = t_.block_kv;
    LocalTensor<float> s = scores_buf_.Get<float>(), red = reduce_buf_.Get<float>(), out = reduce_out_buf_.Get<float>();
    LocalTensor<float> mrow = m_buf_.Get<float>(), lrow = l_buf_.Get<float>(), poison = poison_buf_.Get<float>();
    LocalTensor<float> rowmax = rowmax_buf_.Get<float>(), rowsum = rowsum_buf_.Get<float>();
    LocalTensor<float> alpha = alpha_buf_.Get<float>();
    // Mask what a row does not see: past its causal bound (diagonal tile) and the tail columns.
    for (int64_t r = 0; r < m; ++r) {
      int64_t valid = n;
      if (t_.causal) {
        const int64_t pos = q_off + task.q0 + r % task.nq;
        valid = pos - j0 + 1 < 0 ? 0 : (pos - j0 + 1 < n ? pos - j0 + 1 : n);
      }
      LocalTensor<float> row = s[r * nb];
      for (int64_t c = valid; c < nb; ++c) row.SetValue(c, kMaskValue);
      if (first_bad < valid) poison.SetValue(r, 1.0f);
    }
    Sync<AscendC::HardEvent::S_V>();
    for (int64_t r = 0; r < m; ++r)
      AscendC::ReduceMax(out[r * kSlot], s[r * nb], red, static_cast<int32_t>(nb));
    CollectSlots(rowmax, out, m);
    // Vector over rows: m_new = max(m, rowmax); alpha = exp(m - m_new).
    AscendC::Max(rowmax, rowmax, mrow, static_cast<int32_t>(m));
    AscendC::Sub(alpha, mrow, rowmax, static_cast<int32_t>(m));
    AscendC::Exp(alpha, alpha, static_cast<int32_t>(m));
    AscendC::Muls(mrow, rowmax, 1.0f, static_cast<int32_t>(m));
    Sync<AscendC::HardEvent::V_S>();
    LocalTensor<T> p = probs_buf_.Get<T>();
    for (int64_t r = 0; r < m; ++r) {
      LocalTensor<float> row = s[r * nb];
      AscendC::Adds(row, row, -mrow.GetValue(r), static_cast<int32_t>(nb));
      AscendC::Exp(row, row, static_cast<int32_t>(nb));
      AscendC::ReduceSum(out[r * kSlot], row, red, static_cast<int32_t>(nb));
      if constexpr (AscendC::IsSameType<T, float>::value) {
        AscendC::Muls(p[r * nb], row, 1.0f, static_cast<int32_t>(nb));
      } else {
        AscendC::Cast(p[r * nb], row, AscendC::RoundMode::CAST_RINT, static_cast<int32_t>(nb));
      }
    }
    CollectSlots(rowsum, out, m);
    // l = l * alpha + rowsum.
    AscendC::Mul(lrow, lrow, alpha, static_cast<int32_t>(m));
    AscendC::Add(lrow, lrow, rowsum, static_cast<int32_t>(m));
    Sync<AscendC::HardEvent::V_MTE3>();  // P was written by the vector unit into a TBuf: no queue syncs it
    AscendC::DataCopy(ws_p_, p, static_cast<uint32_t>(m * nb));
  }

  // dst[r] = the reduction result in slot r of `slots`, for r < m (vector -> scalar -> vector).
  __aicore__ inline void CollectSlots(const LocalTensor<float> &dst, const LocalTensor<float> &slots, int64_t m) {
    Sync<AscendC::HardEvent::V_S>();
    for (int64_t r = 0; r < m; ++r) dst.SetValue(r, slots.GetValue(r * kSlot));
    Sync<AscendC::HardEvent::S_V>();
  }

  // 4. O / l to the output, lse = m + ln l; a row that saw no key is 0 with lse -inf, a row that saw
  //    a non-finite value is NaN.
  __aicore__ inline void Finish(const Task &task, int64_t m) {
    LocalTensor<float> o = o_buf_.Get<float>(), mrow = m_buf_.Get<float>(), lrow = l_buf_.Get<float>();
    LocalTensor<float> lse = rowsum_buf_.Get<float>(), poison = poison_buf_.Get<float>();
    AscendC::Ln(lse, lrow, static_cast<int32_t>(m));
    AscendC::Add(lse, lse, mrow, static_cast<int32_t>(m));
    Sync<AscendC::HardEvent::V_S>();
    for (int64_t r = 0; r < m; ++r) {
      const int64_t gi = r / task.nq, i = r % task.nq, head = task.group * t_.group + gi;
      const float l = lrow.GetValue(r);
      const float scale = poison.GetValue(r) != 0.0f ? __builtin_nanf("") : (l > 0.0f ? 1.0f / l : 0.0f);
      LocalTensor<float> orow = o[r * t_.head_pad];
      AscendC::Muls(orow, orow, scale, static_cast<int32_t>(t_.head_dim));
      rows_.StoreRow(orow, out_[seq_.QRow(task.seq, head, task.q0 + i)], nullptr);
    }
    if (t_.with_lse) StoreLse(task, lse, lrow);
  }

  // The task's lse rows, staged as DataCopyPad blocks: per head (nq rows) when rows are contiguous in
  // the lse (B, N, S), per row (the group's heads) when heads are (TND's (T, N)).
  __aicore__ inline void StoreLse(const Task &task, const LocalTensor<float> &lse, const LocalTensor<float> &lrow) {
    LocalTensor<float> stage = lse_stage_buf_.Get<float>();
    const int64_t g = t_.group, nq = task.nq;
    const bool per_head = t_.lse_row_stride == 1;
    const int64_t len = per_head ? nq : g, count = per_head ? g : nq;
    const int64_t slot = RoundUp(len * 4, kBlockBytes) / 4;
    for (int64_t r = 0; r < g * nq; ++r) {
      const int64_t gi = r / nq, i = r % nq;
      const int64_t at = per_head ? gi * slot + i : i * slot + gi;
      stage.SetValue(at, lrow.GetValue(r) > 0.0f ? lse.GetValue(r) : kNegInf);
    }
    Sync<AscendC::HardEvent::S_MTE3>();
    const int64_t first = task.seq * t_.lse_batch_stride + task.group * g * t_.lse_head_stride +
                          (seq_.QStart(task.seq) + task.q0) * t_.lse_row_stride;
    const int64_t gap = (per_head ? t_.lse_head_stride : t_.lse_row_stride) - len;
    const AscendC::DataCopyExtParams copy{static_cast<uint16_t>(count), static_cast<uint32_t>(len * 4), 0,
                                          static_cast<uint32_t>(gap * 4), 0};
    AscendC::DataCopyPad(lse_[first], stage, copy);
  }

  // K pre-pass: this core's contiguous share of all (token, KV head) rows, rotated into keys_.
  __aicore__ inline void RotateAllKeys(int64_t me, int64_t cores) {
    const int64_t tokens = t_.layout == kLayoutTND ? t_.kv_len : t_.batch * t_.kv_len;
    const int64_t rows = tokens * t_.kv_heads, share = CeilDiv(rows, cores);
    const int64_t first = me * share, last = first + share < rows ? first + share : rows;
    LocalTensor<float> x = rows_.X(), y = rows_.Y();
    int64_t b = 0;
    for (int64_t r = first; r < last; ++r) {
      const int64_t token = r / t_.kv_heads, head = r % t_.kv_heads;
      b = seq_.SeqOf(true, token, b);
      const int64_t j = token - (t_.layout == kLayoutTND ? seq_.KvStart(b) : b * t_.kv_len);
      const int64_t at = seq_.KvRow(b, head, j);
      RotatedKey(at, j, false, x, y);
      rows_.StoreRow(y, keys_[at], nullptr);
    }
  }

  // Rotated keys of a sequence with no query rows (key_rotated: the keys as given).
  __aicore__ inline void EmitKeysOnly(int64_t b, int64_t group) {
    LocalTensor<float> x = rows_.X(), y = rows_.Y();
    for (int64_t j = 0; j < seq_.KvLen(b); ++j) {
      const int64_t at = seq_.KvRow(b, group, j);
      RotatedKey(at, j, true, x, y);
      rows_.StoreRow(y, rk_[at], nullptr);
    }
  }

  // Key row `at` (position `pos`) rotated, as float32 in y: read from keys_ when the keys there are
  // already rotated (key_rotated, or after the pre-pass), else loaded and rotated here (x is scratch).
  __aicore__ inline void RotatedKey(int64_t at, int64_t pos, bool ready, LocalTensor<float> x, LocalTensor<float> y) {
    if (ready) {
      rows_.LoadRow(keys_[at], y);
      return;
    }
    rows_.LoadRow(key_[at], x);
    rows_.LoadTables(pos);
    rows_.Rotate(x, y, 1.0f);
  }

  static constexpr int64_t kSlot = kBlockBytes / sizeof(float);  // one reduction result per 32-byte slot

  RfaTiling t_;
  AscendC::TPipe *pipe_ = nullptr;
  RotaryRows<T, TT> rows_;
  AscendC::TBuf<TPosition::VECIN> scores_buf_, pv_buf_;  // the matmuls' C
  AscendC::TBuf<TPosition::VECCALC> probs_buf_, o_buf_, m_buf_, l_buf_, rowmax_buf_, rowsum_buf_, alpha_buf_, poison_buf_, reduce_buf_,
      reduce_out_buf_, lse_stage_buf_;
  GlobalTensor<T> query_, key_, value_, out_, rk_, keys_, ws_q_, ws_k_, ws_v_, ws_p_;
  GlobalTensor<float> lse_;
  Sequences seq_;
};

}  // namespace ascend
}  // namespace rfa
