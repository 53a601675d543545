// RotaryFlashAttentionGrad on an Ascend AI core (Atlas A2, MIX 1:2, as the forward): the gradients of
// RotaryFlashAttention w.r.t. the un-rotated query and key and the value, FlashAttention-2 style, from
// the forward's output and softmax_lse. No S x S matrix exists anywhere: P and dS live one
// block_q x block_kv tile at a time. See ../DESIGN.md, "The backward kernel".
//
// With Qs = rope(Q) * scale, Kr = rope(K) (or K as given with key_rotated), S = Qs Kr^T,
// P = exp(S - lse), dP = dO V^T, Delta = rowsum(dO * O) - d_lse and dS = P * (dP - Delta):
//   dV = P^T dO, dKr = dS^T Qs (+ d_rotated_key), dQr = scale * dS Kr,
// and dQ, dK are dQr, dKr un-rotated (the rotation's transpose at the row's position).
//
// 1. PRE STAGE (every vector core, a contiguous share of rows; then SyncAll): Qs, dO, Kr and V are
//    written head-major into the workspace, so one head's block is contiguous for the cube; lse
//    (rows that saw no key: kNoKeyLse, so their P is exactly 0) and Delta per query row beside them.
//    A row holding NaN/Inf (in Q, dO, O, lse or d_lse; in K or V) is zeroed in the workspace, so
//    0 x NaN in the cube cannot carry it to rows that never see it; a query row's lse becomes NaN,
//    so the keys it sees get NaN gradients; a row that sees a bad key has a NaN lse or output from
//    the forward, so it is such a row itself.
// 2. KV TASKS (sequence, KV head, KV block): for each query block that sees the block, and each query
//    head of the group, in that fixed order: S and dP on the cube, P and dS on the vector unit (then
//    exactly 0 where a row does not see the key, whatever lse and Delta hold), then
//    dV += P^T dO and dK += dS^T Qs on the cube, accumulated in the UB in float32; then dK (+ the
//    rotated-key gradient) is un-rotated and both are written once.
// 3. Q TASKS (sequence, query head, query block): for each KV block the block sees, S, dP, dS again,
//    and dQ += dS Kr; then dQ is scaled, un-rotated and written once.
// Every output row is written by exactly one task, in a fixed order: no atomics, and the same bits
// for any core count.
//
// Synchronisation as in the forward: queues for MTE2 -> V and V -> MTE3 of rows, SetFlag/WaitFlag
// pairs (SyncPipes) for scalar <-> vector and vector -> MTE3 hand-offs of TBufs, and
// PipeBarrier<PIPE_ALL> around every matmul (its A/B written by this core's MTE3 before, its C read
// by the scalar and vector units after, and its C buffer reused after the vector unit read it).
#pragma once
#include "kernel_operator.h"
#include "lib/matmul_intf.h"
#include "rfa_kernel_common.h"
#include "rotary_flash_attention_grad_tiling.h"

namespace rfa {
namespace ascend {

constexpr float kNoKeyLse = 3.0e38f;     // lse of a row that saw no key: exp(S - kNoKeyLse) == 0, finite

template <typename T, typename TT>
class RotaryFlashAttentionGradKernel {
  using AType = matmul::MatmulType<TPosition::GM, CubeFormat::ND, T>;
  using ATransType = matmul::MatmulType<TPosition::GM, CubeFormat::ND, T, true>;
  using BTransType = matmul::MatmulType<TPosition::GM, CubeFormat::ND, T, true>;
  using CType = matmul::MatmulType<TPosition::VECIN, CubeFormat::ND, float>;
  using BiasType = matmul::MatmulType<TPosition::GM, CubeFormat::ND, float>;

 public:
  // Registered by REGIST_MATMUL_OBJ in the kernel entry, before Init.
  matmul::Matmul<AType, BTransType, CType, BiasType> mm_nt;  // S = Qs Kr^T, dP = dO V^T
  matmul::Matmul<ATransType, AType, CType, BiasType> mm_tn;  // dV part = P^T dO, dK part = dS^T Qs
  matmul::Matmul<AType, AType, CType, BiasType> mm_nn;       // dQ part = dS Kr

  __aicore__ inline void Init(GM_ADDR query, GM_ADDR key, GM_ADDR value, GM_ADDR cos, GM_ADDR sin, GM_ADDR aq,
                              GM_ADDR akv, GM_ADDR out, GM_ADDR lse, GM_ADDR d_out, GM_ADDR d_lse, GM_ADDR d_rk,
                              GM_ADDR d_query, GM_ADDR d_key, GM_ADDR d_value, GM_ADDR workspace,
                              const RotaryFlashAttentionGradTilingData *tiling, AscendC::TPipe *pipe) {
    pipe_ = pipe;
    t_ = tiling->rfa;
    g_ = tiling->grad;
    const int64_t d = t_.head_dim, q_rows = g_.q_rows * t_.q_heads, kv_rows = g_.kv_rows * t_.kv_heads;
    query_.SetGlobalBuffer(reinterpret_cast<__gm__ T *>(query), q_rows * d);
    out_.SetGlobalBuffer(reinterpret_cast<__gm__ T *>(out), q_rows * d);
    d_out_.SetGlobalBuffer(reinterpret_cast<__gm__ T *>(d_out), q_rows * d);
    d_query_.SetGlobalBuffer(reinterpret_cast<__gm__ T *>(d_query), q_rows * d);
    key_.SetGlobalBuffer(reinterpret_cast<__gm__ T *>(key), kv_rows * d);
    value_.SetGlobalBuffer(reinterpret_cast<__gm__ T *>(value), kv_rows * d);
    d_key_.SetGlobalBuffer(reinterpret_cast<__gm__ T *>(d_key), kv_rows * d);
    d_value_.SetGlobalBuffer(reinterpret_cast<__gm__ T *>(d_value), kv_rows * d);
    lse_.SetGlobalBuffer(reinterpret_cast<__gm__ float *>(lse), q_rows);
    if (g_.has_dlse) d_lse_.SetGlobalBuffer(reinterpret_cast<__gm__ float *>(d_lse), q_rows);
    if (g_.has_drk) d_rk_.SetGlobalBuffer(reinterpret_cast<__gm__ T *>(d_rk), kv_rows * d);
    seq_.Init(t_, aq, akv);
    GM_ADDR user = AscendC::GetUserWorkspace(workspace);
    ws_qs_.SetGlobalBuffer(reinterpret_cast<__gm__ T *>(user + g_.ws_qs), q_rows * d);
    ws_do_.SetGlobalBuffer(reinterpret_cast<__gm__ T *>(user + g_.ws_do), q_rows * d);
    ws_kr_.SetGlobalBuffer(reinterpret_cast<__gm__ T *>(user + g_.ws_kr), kv_rows * d);
    ws_v_.SetGlobalBuffer(reinterpret_cast<__gm__ T *>(user + g_.ws_v), kv_rows * d);
    ws_lse_.SetGlobalBuffer(reinterpret_cast<__gm__ float *>(user + g_.ws_lse), q_rows);
    ws_delta_.SetGlobalBuffer(reinterpret_cast<__gm__ float *>(user + g_.ws_delta), q_rows);
    GM_ADDR mine = user + g_.ws_cores + AscendC::GetBlockIdx() * g_.ws_per_core;
    const int64_t bq = g_.block_q, nb = g_.block_kv;
    ws_p_.SetGlobalBuffer(reinterpret_cast<__gm__ T *>(mine + g_.ws_p), bq * nb);
    ws_ds_.SetGlobalBuffer(reinterpret_cast<__gm__ T *>(mine + g_.ws_ds), bq * nb);

    const GradUbPlan u = PlanGradUb(bq, nb, t_.head_pad, sizeof(T), sizeof(TT));
    rows_.Init(pipe_, t_, cos, sin, u.rows);
    pipe_->InitBuffer(s_buf_, u.tile_f32);
    pipe_->InitBuffer(dp_buf_, u.tile_f32);
    pipe_->InitBuffer(p_out_buf_, u.tile_t);
    pipe_->InitBuffer(ds_out_buf_, u.tile_t);
    pipe_->InitBuffer(part_buf_, u.part);
    pipe_->InitBuffer(acc_a_buf_, u.acc);
    pipe_->InitBuffer(acc_b_buf_, u.acc);
    pipe_->InitBuffer(lse_block_buf_, u.block_stats);
    pipe_->InitBuffer(delta_block_buf_, u.block_stats);
    pipe_->InitBuffer(reduce_buf_, u.reduce_tmp);
    pipe_->InitBuffer(slots_buf_, u.slots);
    pipe_->InitBuffer(lse_stage_buf_, u.stage);
    pipe_->InitBuffer(delta_stage_buf_, u.stage);
    mm_nt.SetOrgShape(bq, nb, t_.head_pad);
    mm_tn.SetOrgShape(nb, t_.head_pad, bq);
    mm_nn.SetOrgShape(bq, t_.head_pad, nb);
  }

  __aicore__ inline void Process() {
    // The launch has 2 x blockDim vector cores for core_num workers: the ones past core_num idle but
    // still join the SyncAll (it waits for every launched vector core).
    const int64_t me = AscendC::GetBlockIdx(), cores = g_.core_num;
    if (me < cores) {
      PrepareQueries(me, cores);
      PrepareKeys(me, cores);
    }
    AscendC::PipeBarrier<PIPE_ALL>();  // this core's workspace rows are in GM before any core reads them
    AscendC::SyncAll();
    if (me >= cores) return;
    ForEachGradTask(t_, g_, LenOf{this}, RunOwnTasks{this, me, cores});
  }

 private:
  // ForEachGradTask's callbacks (device code takes __aicore__ functors, not lambdas).
  struct LenOf {
    RotaryFlashAttentionGradKernel *k;
    __aicore__ inline int64_t operator()(int64_t b, bool kv) const { return kv ? k->seq_.KvLen(b) : k->seq_.QLen(b); }
  };
  struct RunOwnTasks {
    RotaryFlashAttentionGradKernel *k;
    int64_t me, cores;
    __aicore__ inline bool operator()(int64_t index, const GradTask &task) const {
      if (CoreOfTask(index, cores) != me) return true;
      if (task.kind == 0) {
        k->RunKvTask(task);
      } else {
        k->RunQTask(task);
      }
      return true;
    }
  };

  template <AscendC::HardEvent E>
  __aicore__ inline void Sync() {
    SyncPipes<E>(pipe_);
  }

  // Head-major row index of (sequence, head, position) in the workspace (rows of head_dim elements).
  __aicore__ inline int64_t QueryRow(int64_t b, int64_t head, int64_t i) const {
    return t_.layout == kLayoutTND ? head * g_.q_rows + seq_.QStart(b) + i : (b * t_.q_heads + head) * t_.q_len + i;
  }
  __aicore__ inline int64_t KeyRow(int64_t b, int64_t head, int64_t j) const {
    return t_.layout == kLayoutTND ? head * g_.kv_rows + seq_.KvStart(b) + j
                                   : (b * t_.kv_heads + head) * t_.kv_len + j;
  }
  __aicore__ inline int64_t QueryOffset(int64_t b) const { return seq_.KvLen(b) - seq_.QLen(b); }

  // ---- 1. pre stage ----

  // This core's share of the query rows, head-major: Qs and dO rows to the workspace, lse and Delta
  // staged per chunk of kStatChunk rows and written with one DataCopyPad each (cores share the
  // 64-byte lines of these float arrays, so no scalar GM writes).
  __aicore__ inline void PrepareQueries(int64_t me, int64_t cores) {
    const int64_t rows = g_.q_rows * t_.q_heads, share = CeilDiv(rows, cores), d = t_.head_dim;
    const int64_t first = me * share, last = first + share < rows ? first + share : rows;
    LocalTensor<float> x = rows_.X(), y = rows_.Y(), slots = slots_buf_.Get<float>();
    LocalTensor<float> probes = slots[kStatChunk * kSlot], prod = rows_.Perm(), o = part_buf_.Get<float>();
    LocalTensor<float> lse_stage = lse_stage_buf_.Get<float>(), delta_stage = delta_stage_buf_.Get<float>();
    int64_t b = 0, last_token = -1;
    for (int64_t c0 = first; c0 < last; c0 += kStatChunk) {
      const int64_t n = last - c0 < kStatChunk ? last - c0 : kStatChunk;
      const int64_t chunk_b = b, chunk_token = last_token;  // where the second walk over the chunk starts
      for (int64_t r = 0; r < n; ++r) {
        int64_t head, i;
        b = RowOf(false, c0 + r, b, &last_token, &head, &i);
        const int64_t at = seq_.QRow(b, head, i), hm = (c0 + r) * d;
        rows_.LoadRow(query_[at], x);
        rows_.LoadTables(QueryOffset(b) + i);
        rows_.Rotate(x, y, t_.scale);
        rows_.StoreRow(y, ws_qs_[hm], nullptr);
        AscendC::Sub(x, y, y, static_cast<int32_t>(d));  // the probe: 0 where Qs is finite, NaN elsewhere
        rows_.LoadRow(d_out_[at], y);
        rows_.StoreRow(y, ws_do_[hm], nullptr);
        rows_.LoadRow(out_[at], o);
        AscendC::Mul(prod, y, o, static_cast<int32_t>(d));  // dO * O: Delta's terms; NaN/Inf if either is
        AscendC::ReduceSum(slots[r * kSlot], prod, reduce_buf_.Get<float>(), static_cast<int32_t>(d));
        AscendC::Add(x, x, prod, static_cast<int32_t>(d));
        AscendC::ReduceSum(probes[r * kSlot], x, reduce_buf_.Get<float>(), static_cast<int32_t>(d));
      }
      Sync<AscendC::HardEvent::V_S>();
      b = chunk_b;
      last_token = chunk_token;
      for (int64_t r = 0; r < n; ++r) {
        int64_t head, i;
        b = RowOf(false, c0 + r, b, &last_token, &head, &i);
        const int64_t at = seq_.LseAt(b, head, i);
        const float lse = lse_.GetValue(at), d_lse = g_.has_dlse ? d_lse_.GetValue(at) : 0.0f;
        const float delta = slots.GetValue(r * kSlot) - d_lse, probe = probes.GetValue(r * kSlot) * 0.0f;
        if (probe == 0.0f && delta - delta == 0.0f && (lse - lse == 0.0f || lse == -__builtin_inff())) {
          lse_stage.SetValue(r, lse == -__builtin_inff() ? kNoKeyLse : lse);
          delta_stage.SetValue(r, delta);
        } else {  // NaN/Inf in the row: zeroed for the cube (after its first store: MTE3 keeps order), NaN lse
          lse_stage.SetValue(r, __builtin_nanf(""));
          delta_stage.SetValue(r, 0.0f);
          rows_.ZeroRow(ws_qs_[(c0 + r) * d]);
          rows_.ZeroRow(ws_do_[(c0 + r) * d]);
        }
      }
      Sync<AscendC::HardEvent::S_MTE3>();
      const AscendC::DataCopyExtParams copy{1, static_cast<uint32_t>(n * 4), 0, 0, 0};
      AscendC::DataCopyPad(ws_lse_[c0], lse_stage, copy);
      AscendC::DataCopyPad(ws_delta_[c0], delta_stage, copy);
      Sync<AscendC::HardEvent::MTE3_S>();  // the stages are rewritten by the next chunk's scalar stores
    }
  }

  // (sequence, head, position) of head-major row `row` of the keys (kv) or queries; `b` is the previous
  // row's sequence and `last_token` its token (TND: tokens ascend within a head, so the search
  // resumes from b).
  __aicore__ inline int64_t RowOf(bool kv, int64_t row, int64_t b, int64_t *last_token, int64_t *head,
                                  int64_t *i) const {
    const int64_t len = kv ? t_.kv_len : t_.q_len, heads = kv ? t_.kv_heads : t_.q_heads;
    if (t_.layout != kLayoutTND) {
      *head = (row / len) % heads;
      *i = row % len;
      return row / (len * heads);
    }
    const int64_t tokens = kv ? g_.kv_rows : g_.q_rows, token = row % tokens;
    *head = row / tokens;
    b = seq_.SeqOf(kv, token, token > *last_token ? b : 0);
    *last_token = token;
    *i = token - (kv ? seq_.KvStart(b) : seq_.QStart(b));
    return b;
  }

  // This core's share of the key rows, head-major: Kr (K as given with key_rotated) and V; a row with
  // NaN/Inf in either is zeroed (the rows that see it have a NaN lse from the forward).
  __aicore__ inline void PrepareKeys(int64_t me, int64_t cores) {
    const int64_t rows = g_.kv_rows * t_.kv_heads, share = CeilDiv(rows, cores), d = t_.head_dim;
    const int64_t first = me * share, last = first + share < rows ? first + share : rows;
    LocalTensor<float> x = rows_.X(), y = rows_.Y(), probe = rows_.Perm(), probes = slots_buf_.Get<float>();
    int64_t b = 0, last_token = -1;
    for (int64_t c0 = first; c0 < last; c0 += kStatChunk) {
      const int64_t n = last - c0 < kStatChunk ? last - c0 : kStatChunk;
      for (int64_t r = 0; r < n; ++r) {
        const int64_t row = c0 + r;
        int64_t head, j;
        b = RowOf(true, row, b, &last_token, &head, &j);
        const int64_t at = seq_.KvRow(b, head, j);
        if (t_.key_rotated) {
          rows_.LoadRow(key_[at], y);
        } else {
          rows_.LoadRow(key_[at], x);
          rows_.LoadTables(j);
          rows_.Rotate(x, y, 1.0f);
        }
        rows_.StoreRow(y, ws_kr_[row * d], nullptr);
        rows_.LoadRow(value_[at], x);
        rows_.StoreRow(x, ws_v_[row * d], nullptr);
        AscendC::Sub(probe, y, y, static_cast<int32_t>(d));  // 0 where Kr and V are finite, NaN elsewhere
        AscendC::Add(probe, probe, x, static_cast<int32_t>(d));
        AscendC::Sub(probe, probe, x, static_cast<int32_t>(d));
        AscendC::ReduceSum(probes[r * kSlot], probe, reduce_buf_.Get<float>(), static_cast<int32_t>(d));
      }
      Sync<AscendC::HardEvent::V_S>();
      for (int64_t r = 0; r < n; ++r) {
        if (probes.GetValue(r * kSlot) == 0.0f) continue;
        rows_.ZeroRow(ws_kr_[(c0 + r) * d]);  // after its first store: MTE3 keeps order
        rows_.ZeroRow(ws_v_[(c0 + r) * d]);
      }
    }
  }

  // ---- 2./3. the tile both tasks recompute ----

  // C = A B of `mm` into `c`, fenced on both sides: A/B (this core's MTE3 writes) land before the
  // cube reads them, the vector unit is done with c before the cube overwrites it, and c is in the
  // UB before anyone reads it (IterateAll promises no visibility).
  template <typename Mm>
  __aicore__ inline void Multiply(Mm &mm, const LocalTensor<float> &c) {
    AscendC::PipeBarrier<PIPE_ALL>();
    mm.IterateAll(c);
    mm.End();
    AscendC::PipeBarrier<PIPE_ALL>();
  }

  // P and dS of query rows [q0, q0 + nq) of query head `head` against keys [j0, j0 + n) of KV head
  // `kv_head`, sequence b, written to this core's workspace tiles (rows of block_kv, input dtype):
  // dS always, P when `with_p`. Keys a row does not see (causal bound, tile tail) get P = dS = 0.
  __aicore__ inline void ScoreGradients(int64_t b, int64_t head, int64_t kv_head, int64_t q0, int64_t nq, int64_t j0,
                                        int64_t n, bool with_p) {
    const int64_t nb = g_.block_kv, d = t_.head_dim, q_row = QueryRow(b, head, q0);
    const int64_t q_at = q_row * d, k_at = KeyRow(b, kv_head, j0) * d;
    LocalTensor<float> s = s_buf_.Get<float>(), dp = dp_buf_.Get<float>();
    LocalTensor<float> lse = lse_block_buf_.Get<float>(), delta = delta_block_buf_.Get<float>();
    const AscendC::DataCopyExtParams copy{1, static_cast<uint32_t>(nq * 4), 0, 0, 0};
    AscendC::DataCopyPad(lse, ws_lse_[q_row], copy, AscendC::DataCopyPadExtParams<float>{});
    AscendC::DataCopyPad(delta, ws_delta_[q_row], copy, AscendC::DataCopyPadExtParams<float>{});
    mm_nt.SetTail(static_cast<int>(nq), static_cast<int>(n), static_cast<int>(d));
    mm_nt.SetTensorA(ws_qs_[q_at]);
    mm_nt.SetTensorB(ws_kr_[k_at], true);
    Multiply(mm_nt, s);
    mm_nt.SetTensorA(ws_do_[q_at]);
    mm_nt.SetTensorB(ws_v_[k_at], true);
    Multiply(mm_nt, dp);  // its closing barrier also lands the lse / Delta copies for the scalar unit
    LocalTensor<T> p_out = p_out_buf_.Get<T>(), ds_out = ds_out_buf_.Get<T>();
    const int32_t cols = static_cast<int32_t>(nb);
    for (int64_t r = 0; r < nq; ++r) {
      LocalTensor<float> srow = s[r * nb], dprow = dp[r * nb];
      AscendC::Adds(srow, srow, -lse.GetValue(r), cols);
      AscendC::Exp(srow, srow, cols);                        // P
      AscendC::Adds(dprow, dprow, -delta.GetValue(r), cols);
      AscendC::Mul(dprow, dprow, srow, cols);                // dS = P (dP - Delta)
    }
    // Exactly 0 where a row does not see the key (past its causal bound, tile tail columns), whatever
    // the row's lse and Delta hold (NaN for a row with NaN/Inf: it must not reach keys it never saw).
    Sync<AscendC::HardEvent::V_S>();
    const int64_t q_pos = QueryOffset(b) + q0;
    for (int64_t r = 0; r < nq; ++r) {
      int64_t valid = n;
      if (t_.causal) {
        const int64_t seen = q_pos + r - j0 + 1;
        valid = seen < 0 ? 0 : (seen < n ? seen : n);
      }
      for (int64_t c = valid; c < nb; ++c) {
        s[r * nb].SetValue(c, 0.0f);
        dp[r * nb].SetValue(c, 0.0f);
      }
    }
    Sync<AscendC::HardEvent::S_V>();
    for (int64_t r = 0; r < nq; ++r) {
      if (with_p) ToInput(p_out[r * nb], s[r * nb], cols);
      ToInput(ds_out[r * nb], dp[r * nb], cols);
    }
    Sync<AscendC::HardEvent::V_MTE3>();  // the tiles are TBufs: no queue orders the vector unit and MTE3
    if (with_p) AscendC::DataCopy(ws_p_, p_out, static_cast<uint32_t>(nq * nb));
    AscendC::DataCopy(ws_ds_, ds_out, static_cast<uint32_t>(nq * nb));
    // The next tile's casts into p_out / ds_out come after the matmul reading these (Multiply fences).
  }

  __aicore__ inline void ToInput(const LocalTensor<T> &dst, const LocalTensor<float> &src, int32_t count) {
    if constexpr (AscendC::IsSameType<T, float>::value) {
      AscendC::Muls(dst, src, 1.0f, count);
    } else {
      AscendC::Cast(dst, src, AscendC::RoundMode::CAST_RINT, count);
    }
  }

  // ---- 2. KV task: dK and dV of keys [first, first + count) of one KV head ----
  __aicore__ inline void RunKvTask(const GradTask &task) {
    const int64_t b = task.seq, kv_head = task.head, j0 = task.first, n = task.count, d = t_.head_dim;
    const int64_t lq = seq_.QLen(b), q_off = QueryOffset(b), bq = g_.block_q;
    LocalTensor<float> dk = acc_a_buf_.Get<float>(), dv = acc_b_buf_.Get<float>(), part = part_buf_.Get<float>();
    AscendC::Duplicate(dk, 0.0f, static_cast<int32_t>(n * d));
    AscendC::Duplicate(dv, 0.0f, static_cast<int32_t>(n * d));
    // Queries that see key j0 at least: position q_off + i >= j0 under causal masking.
    const int64_t first_q = t_.causal && j0 - q_off > 0 ? j0 - q_off : 0;
    for (int64_t q0 = first_q; q0 < lq; q0 += bq) {
      const int64_t nq = lq - q0 < bq ? lq - q0 : bq;
      for (int64_t gi = 0; gi < t_.group; ++gi) {
        const int64_t head = kv_head * t_.group + gi, q_at = QueryRow(b, head, q0) * d;
        ScoreGradients(b, head, kv_head, q0, nq, j0, n, true);
        mm_tn.SetTail(static_cast<int>(n), static_cast<int>(d), static_cast<int>(nq));
        mm_tn.SetTensorA(ws_p_, true);
        mm_tn.SetTensorB(ws_do_[q_at]);
        Multiply(mm_tn, part);
        AscendC::Add(dv, dv, part, static_cast<int32_t>(n * d));
        mm_tn.SetTensorA(ws_ds_, true);
        mm_tn.SetTensorB(ws_qs_[q_at]);
        Multiply(mm_tn, part);
        AscendC::Add(dk, dk, part, static_cast<int32_t>(n * d));
      }
    }
    LocalTensor<float> x = rows_.X(), y = rows_.Y();
    for (int64_t j = 0; j < n; ++j) {
      const int64_t at = seq_.KvRow(b, kv_head, j0 + j);
      LocalTensor<float> dk_row = dk[j * t_.head_pad];
      if (g_.has_drk) {  // the rotated key's gradient joins dKr before the un-rotation
        rows_.LoadRow(d_rk_[at], x);
        AscendC::Add(dk_row, dk_row, x, static_cast<int32_t>(d));
      }
      if (t_.key_rotated) {
        rows_.StoreRow(dk_row, d_key_[at], nullptr);
      } else {
        rows_.LoadTables(j0 + j);
        rows_.Unrotate(dk_row, y, 1.0f);
        rows_.StoreRow(y, d_key_[at], nullptr);
      }
      rows_.StoreRow(dv[j * t_.head_pad], d_value_[at], nullptr);
    }
  }

  // ---- 3. Q task: dQ of queries [first, first + count) of one query head ----
  __aicore__ inline void RunQTask(const GradTask &task) {
    const int64_t b = task.seq, head = task.head, q0 = task.first, nq = task.count, d = t_.head_dim;
    const int64_t kv_head = head / t_.group, q_off = QueryOffset(b), nb = g_.block_kv;
    const int64_t kv_end = t_.causal ? q_off + q0 + nq : seq_.KvLen(b);
    LocalTensor<float> dq = acc_a_buf_.Get<float>(), part = part_buf_.Get<float>();
    AscendC::Duplicate(dq, 0.0f, static_cast<int32_t>(nq * d));
    for (int64_t j0 = 0; j0 < kv_end; j0 += nb) {
      const int64_t n = kv_end - j0 < nb ? kv_end - j0 : nb;
      ScoreGradients(b, head, kv_head, q0, nq, j0, n, false);
      mm_nn.SetTail(static_cast<int>(nq), static_cast<int>(d), static_cast<int>(n));
      mm_nn.SetTensorA(ws_ds_);
      mm_nn.SetTensorB(ws_kr_[KeyRow(b, kv_head, j0) * d]);
      Multiply(mm_nn, part);
      AscendC::Add(dq, dq, part, static_cast<int32_t>(nq * d));
    }
    LocalTensor<float> y = rows_.Y();
    for (int64_t i = 0; i < nq; ++i) {
      rows_.LoadTables(q_off + q0 + i);
      rows_.Unrotate(dq[i * t_.head_pad], y, t_.scale);
      rows_.StoreRow(y, d_query_[seq_.QRow(b, head, q0 + i)], nullptr);
    }
  }

  static constexpr int64_t kSlot = kBlockBytes / sizeof(float);  // one reduction result per 32-byte slot

  RfaTiling t_;
  RfaGradPlan g_;
  AscendC::TPipe *pipe_ = nullptr;
  Sequences seq_;
  RotaryRows<T, TT> rows_;
  AscendC::TBuf<TPosition::VECIN> s_buf_, dp_buf_, part_buf_;  // the matmuls' C
  AscendC::TBuf<TPosition::VECCALC> p_out_buf_, ds_out_buf_, acc_a_buf_, acc_b_buf_, lse_block_buf_, delta_block_buf_,
      reduce_buf_, slots_buf_, lse_stage_buf_, delta_stage_buf_;
  GlobalTensor<T> query_, key_, value_, out_, d_out_, d_rk_, d_query_, d_key_, d_value_;
  GlobalTensor<T> ws_qs_, ws_do_, ws_kr_, ws_v_, ws_p_, ws_ds_;
  GlobalTensor<float> lse_, d_lse_, ws_lse_, ws_delta_;
};

}  // namespace ascend
}  // namespace rfa
