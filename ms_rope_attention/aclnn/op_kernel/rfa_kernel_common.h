// What the forward and the backward kernel share on a vector core: pipe synchronisation, the
// sequences' geometry (TND offsets read from GM), moving one head_dim row between GM and the UB
// (cast to and from float32), the rotation y = x * cos + perm(x) * sin' at one position, and its
// transpose, dx = dy * cos + perm(dy * sin'), which un-rotates a gradient (perm swaps halves or
// pairs and is its own inverse; sin' carries the rotation's sign per lane).
#pragma once
#include "kernel_operator.h"
#include "rotary_flash_attention_tiling.h"

namespace rfa {
namespace ascend {

using AscendC::GlobalTensor;
using AscendC::LocalTensor;
using AscendC::TPosition;

// Makes pipe DST wait for what pipe SRC has issued so far (E = SRC_DST).
template <AscendC::HardEvent E>
__aicore__ inline void SyncPipes(AscendC::TPipe *pipe) {
  const int32_t id = static_cast<int32_t>(pipe->FetchEventID(E));
  AscendC::SetFlag<E>(id);
  AscendC::WaitFlag<E>(id);
}

constexpr int64_t kLayoutTND = 3;

// Where each sequence's rows are: uniform for the batch layouts, actual_seq_qlen / actual_seq_kvlen
// (cumulative ends, int64 in GM) for TND; element offsets of a (sequence, head, row) in q and k/v.
class Sequences {
 public:
  __aicore__ inline void Init(const RfaTiling &t, GM_ADDR aq, GM_ADDR akv) {
    t_ = t;
    if (t.layout == kLayoutTND) {
      aq_.SetGlobalBuffer(reinterpret_cast<__gm__ int64_t *>(aq), t.batch);
      akv_.SetGlobalBuffer(reinterpret_cast<__gm__ int64_t *>(akv), t.batch);
    }
  }
  __aicore__ inline int64_t QStart(int64_t b) const { return t_.layout == kLayoutTND && b > 0 ? aq_.GetValue(b - 1) : 0; }
  __aicore__ inline int64_t KvStart(int64_t b) const {
    return t_.layout == kLayoutTND && b > 0 ? akv_.GetValue(b - 1) : 0;
  }
  __aicore__ inline int64_t QLen(int64_t b) const {
    return t_.layout == kLayoutTND ? aq_.GetValue(b) - QStart(b) : t_.q_len;
  }
  __aicore__ inline int64_t KvLen(int64_t b) const {
    return t_.layout == kLayoutTND ? akv_.GetValue(b) - KvStart(b) : t_.kv_len;
  }
  // The sequence holding key (kv) or query token `token`, searched from sequence `from` on (callers
  // walk tokens in ascending order and pass the last answer: no rescan from 0).
  __aicore__ inline int64_t SeqOf(bool kv, int64_t token, int64_t from) const {
    if (t_.layout != kLayoutTND) return token / (kv ? t_.kv_len : t_.q_len);
    const GlobalTensor<int64_t> &ends = kv ? akv_ : aq_;
    while (token >= ends.GetValue(from)) ++from;
    return from;
  }
  __aicore__ inline int64_t QRow(int64_t b, int64_t head, int64_t row) const {
    return b * t_.q_batch_stride + head * t_.q_head_stride + (QStart(b) + row) * t_.q_row_stride;
  }
  __aicore__ inline int64_t KvRow(int64_t b, int64_t head, int64_t row) const {
    return b * t_.kv_batch_stride + head * t_.kv_head_stride + (KvStart(b) + row) * t_.kv_row_stride;
  }
  __aicore__ inline int64_t LseAt(int64_t b, int64_t head, int64_t row) const {
    return b * t_.lse_batch_stride + head * t_.lse_head_stride + (QStart(b) + row) * t_.lse_row_stride;
  }

 private:
  RfaTiling t_;
  GlobalTensor<int64_t> aq_, akv_;
};

// T: query/key/value dtype; TT: cos/sin dtype.
template <typename T, typename TT>
class RotaryRows {
 public:
  __aicore__ inline void Init(AscendC::TPipe *pipe, const RfaTiling &t, GM_ADDR cos, GM_ADDR sin, const RowUbPlan &u) {
    pipe_ = pipe;
    head_dim_ = t.head_dim;
    head_pad_ = t.head_pad;
    rotary_dim_ = t.rotary_dim;
    cos_.SetGlobalBuffer(reinterpret_cast<__gm__ TT *>(cos), t.table_rows * t.rotary_dim);
    sin_.SetGlobalBuffer(reinterpret_cast<__gm__ TT *>(sin), t.table_rows * t.rotary_dim);
    pipe->InitBuffer(row_in_, 2, u.row_in);
    pipe->InitBuffer(table_in_, 2, u.table_in);
    pipe->InitBuffer(row_out_, 2, u.row_out);
    pipe->InitBuffer(x_buf_, u.f32_row);
    pipe->InitBuffer(perm_buf_, u.f32_row);
    pipe->InitBuffer(y_buf_, u.f32_row);
    pipe->InitBuffer(cos_buf_, u.f32_row);
    pipe->InitBuffer(sin_buf_, u.f32_row);
    pipe->InitBuffer(sign_buf_, u.f32_row);
    pipe->InitBuffer(offsets_buf_, u.f32_row);
    PrepareRotation(t.rotary_mode);
  }

  // Scratch rows (float32, head_pad lanes): x and y are the callers'; perm is the rotation's own
  // between calls and free for a caller's temporary otherwise.
  __aicore__ inline LocalTensor<float> X() { return x_buf_.Get<float>(); }
  __aicore__ inline LocalTensor<float> Y() { return y_buf_.Get<float>(); }
  __aicore__ inline LocalTensor<float> Perm() { return perm_buf_.Get<float>(); }

  // Loads table row `pos` into cos/sin (float32, first rotary_dim features) with sin's sign folded.
  __aicore__ inline void LoadTables(int64_t pos) {
    LocalTensor<float> cosf = cos_buf_.Get<float>(), sinf = sin_buf_.Get<float>();
    const int64_t rd = rotary_dim_;
    const AscendC::DataCopyExtParams copy{1, static_cast<uint32_t>(rd * sizeof(TT)), 0, 0, 0};
    for (int which = 0; which < 2; ++which) {
      LocalTensor<TT> raw = table_in_.template AllocTensor<TT>();
      AscendC::DataCopyPad(raw, (which == 0 ? cos_ : sin_)[pos * rd], copy, AscendC::DataCopyPadExtParams<TT>{});
      table_in_.EnQue(raw);
      raw = table_in_.template DeQue<TT>();
      LocalTensor<float> dst = which == 0 ? cosf : sinf;
      if constexpr (AscendC::IsSameType<TT, float>::value) {
        AscendC::Muls(dst, raw, 1.0f, static_cast<int32_t>(rd));
      } else {
        AscendC::Cast(dst, raw, AscendC::RoundMode::CAST_NONE, static_cast<int32_t>(rd));
      }
      table_in_.FreeTensor(raw);
    }
    AscendC::Mul(sinf, sinf, sign_buf_.Get<float>(), static_cast<int32_t>(rd));
  }

  // GM row (head_dim elements of T) -> float32 x.
  __aicore__ inline void LoadRow(const GlobalTensor<T> &src, LocalTensor<float> x) {
    LocalTensor<T> raw = row_in_.template AllocTensor<T>();
    AscendC::DataCopy(raw, src, static_cast<uint32_t>(head_dim_));
    row_in_.EnQue(raw);
    raw = row_in_.template DeQue<T>();
    if constexpr (AscendC::IsSameType<T, float>::value) {
      AscendC::Muls(x, raw, 1.0f, static_cast<int32_t>(head_dim_));
    } else {
      AscendC::Cast(x, raw, AscendC::RoundMode::CAST_NONE, static_cast<int32_t>(head_dim_));
    }
    row_in_.FreeTensor(raw);
  }

  // y = (x * cos + perm(x) * sin') * mul, at the position whose tables LoadTables fetched.
  __aicore__ inline void Rotate(LocalTensor<float> x, LocalTensor<float> y, float mul) {
    LocalTensor<float> perm = perm_buf_.Get<float>();
    const int32_t d = static_cast<int32_t>(head_dim_);
    AscendC::Gather(perm, x, offsets_buf_.Get<uint32_t>(), 0u, static_cast<uint32_t>(d));
    AscendC::Mul(y, x, cos_buf_.Get<float>(), d);
    AscendC::Mul(perm, perm, sin_buf_.Get<float>(), d);
    AscendC::Add(y, y, perm, d);
    if (mul != 1.0f) AscendC::Muls(y, y, mul, d);
  }

  // The rotation's transpose: dx = (dy * cos + perm(dy * sin')) * mul (dy is kept; perm is scratch).
  __aicore__ inline void Unrotate(LocalTensor<float> dy, LocalTensor<float> dx, float mul) {
    LocalTensor<float> scratch = perm_buf_.Get<float>();
    const int32_t d = static_cast<int32_t>(head_dim_);
    AscendC::Mul(scratch, dy, sin_buf_.Get<float>(), d);
    AscendC::Gather(dx, scratch, offsets_buf_.Get<uint32_t>(), 0u, static_cast<uint32_t>(d));
    AscendC::Mul(scratch, dy, cos_buf_.Get<float>(), d);
    AscendC::Add(dx, dx, scratch, d);
    if (mul != 1.0f) AscendC::Muls(dx, dx, mul, d);
  }

  // float32 row -> T row in GM (one or two destinations).
  __aicore__ inline void StoreRow(LocalTensor<float> y, const GlobalTensor<T> &dst, const GlobalTensor<T> *also) {
    LocalTensor<T> row = row_out_.template AllocTensor<T>();
    if constexpr (AscendC::IsSameType<T, float>::value) {
      AscendC::Muls(row, y, 1.0f, static_cast<int32_t>(head_dim_));
    } else {
      AscendC::Cast(row, y, AscendC::RoundMode::CAST_RINT, static_cast<int32_t>(head_dim_));
    }
    row_out_.EnQue(row);
    row = row_out_.template DeQue<T>();
    AscendC::DataCopy(dst, row, static_cast<uint32_t>(head_dim_));
    if (also != nullptr) AscendC::DataCopy(*also, row, static_cast<uint32_t>(head_dim_));
    row_out_.FreeTensor(row);
  }

  __aicore__ inline void ZeroRow(const GlobalTensor<T> &dst) {
    LocalTensor<float> y = y_buf_.Get<float>();
    AscendC::Duplicate(y, 0.0f, static_cast<int32_t>(head_pad_));
    StoreRow(y, dst, nullptr);
  }

 private:
  // perm(x)[i] = x[partner(i)] as Gather byte offsets; sign[i] is the rotation's sign, folded into
  // sin' per position; features past rotary_dim pass through (cos 1, sin 0).
  __aicore__ inline void PrepareRotation(int64_t mode) {
    LocalTensor<uint32_t> offsets = offsets_buf_.Get<uint32_t>();
    LocalTensor<float> cosf = cos_buf_.Get<float>(), sinf = sin_buf_.Get<float>(), sign = sign_buf_.Get<float>();
    const int64_t rd = rotary_dim_, h = rd / 2;
    for (int64_t i = 0; i < head_pad_; ++i) {
      int64_t partner = i;
      if (i < rd) partner = mode == 0 ? (i < h ? i + h : i - h) : (i ^ 1);
      offsets.SetValue(i, static_cast<uint32_t>(partner * sizeof(float)));
      cosf.SetValue(i, 1.0f);
      sinf.SetValue(i, 0.0f);
      const bool negate = mode == 0 ? i < h : (i % 2 == 0);  // rotate-half: first half; interleaved: even
      sign.SetValue(i, negate ? -1.0f : 1.0f);
    }
    SyncPipes<AscendC::HardEvent::S_V>(pipe_);
  }

  AscendC::TPipe *pipe_ = nullptr;
  int64_t head_dim_ = 0, head_pad_ = 0, rotary_dim_ = 0;
  AscendC::TQue<TPosition::VECIN, 2> row_in_, table_in_;
  AscendC::TQue<TPosition::VECOUT, 2> row_out_;
  AscendC::TBuf<TPosition::VECCALC> x_buf_, perm_buf_, y_buf_, cos_buf_, sin_buf_, sign_buf_, offsets_buf_;
  GlobalTensor<TT> cos_, sin_;
};

}  // namespace ascend
}  // namespace rfa
