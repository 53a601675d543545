// A CPU emulation of the subset of the Ascend C API that op_kernel/ uses, so the kernel source can
// be compiled and run on a machine without an NPU (tests/test_ascend_emulated.py).
//
// It is not CANN's CPU debug library (that one ships with CANN and is not on PyPI); it mirrors its
// calling convention (kernel entry with GM_ADDR arguments, GetBlockIdx, ICPU_RUN_KF-style launch)
// and it enforces the hardware limits the kernel must respect, failing loudly when they are broken:
//   - Unified Buffer capacity per core (TPipe::InitBuffer beyond it aborts),
//   - 32-byte alignment of UB tensor start addresses for vector instructions and of DataCopy lengths,
//   - queue depth (AllocTensor beyond the buffers a TQue owns, EnQue beyond its depth),
//   - bounds of every GM and UB access (an out-of-range read or write aborts with its location).
// Each function states the semantics it assumes and the CANN documentation page it follows
// (cannmirror/asc-devkit, docs/api/context/<page>.md), so a divergence from hardware is easy to locate.
// Cores run one after another (no concurrency): synchronisation calls are recorded, not simulated.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#define __aicore__
#define __global__
#define __gm__
using GM_ADDR = uint8_t *;

// ------------------------------------------------------------------------------------------------
// Data types. half = IEEE binary16 (GCC _Float16); bfloat16_t rounds to nearest even like the
// hardware's Cast with CAST_RINT.
using half = _Float16;

struct bfloat16_t {
  uint16_t bits = 0;
  bfloat16_t() = default;
  explicit bfloat16_t(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) bits = 0x7fc0;  // NaN
    else bits = static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
  explicit operator float() const {
    const uint32_t u = static_cast<uint32_t>(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};

namespace AscendC {

[[noreturn]] inline void EmuFail(const std::string &what) { throw std::runtime_error("[AscendC emulation] " + what); }

template <typename A, typename B>
struct IsSameType : std::is_same<A, B> {};

template <typename T>
inline float ToFloat(T v) { return static_cast<float>(v); }
template <typename T>
inline T FromFloat(float f) { return static_cast<T>(f); }
template <>
inline bfloat16_t FromFloat<bfloat16_t>(float f) { return bfloat16_t(f); }

// ------------------------------------------------------------------------------------------------
// Positions and the per-core machine state.
enum class TPosition { GM, VECIN, VECOUT, VECCALC, A1, B1, C1, A2, B2, CO1, CO2 };
using QuePosition = TPosition;
enum class HardEvent { MTE2_V, V_MTE2, V_MTE3, MTE3_V, MTE3_MTE2, MTE2_MTE3, S_V, V_S, MTE3_S, MTE2_S };
enum pipe_t { PIPE_S, PIPE_V, PIPE_MTE2, PIPE_MTE3, PIPE_M, PIPE_ALL };
enum class RoundMode { CAST_NONE, CAST_RINT, CAST_FLOOR, CAST_CEIL, CAST_ROUND, CAST_TRUNC, CAST_ODD };

constexpr int64_t kUbBytes = 192 * 1024;  // Atlas A2 vector core Unified Buffer
constexpr int64_t kBlock = 32;

struct CoreState {
  int64_t block_idx = 0, block_num = 1;
  std::vector<uint8_t> ub = std::vector<uint8_t>(kUbBytes);
  int64_t ub_used = 0;
  int64_t barriers = 0;
  GM_ADDR sys_workspace = nullptr;
};
inline CoreState &Core() {
  static thread_local CoreState state;
  return state;
}

// GetBlockIdx.md / GetBlockNum.md: index of this core in [0, blockDim), and blockDim.
inline int64_t GetBlockIdx() { return Core().block_idx; }
inline int64_t GetBlockNum() { return Core().block_num; }

// PipeBarrier.md, SetFlag/WaitFlag.md: ordering between pipes. Emulated instructions complete in
// program order, so these only count (the kernel's placement is reviewed, not simulated).
template <pipe_t pipe>
inline void PipeBarrier() { ++Core().barriers; }
template <HardEvent event>
inline void SetFlag(int32_t) { ++Core().barriers; }
template <HardEvent event>
inline void WaitFlag(int32_t) { ++Core().barriers; }

// ------------------------------------------------------------------------------------------------
// GlobalTensor.md: a typed view of global memory. SetGlobalBuffer(ptr, size) fixes the extent;
// operator[](offset) is the view starting `offset` elements later. Every access is bounds-checked.
template <typename T>
class GlobalTensor {
 public:
  void SetGlobalBuffer(__gm__ T *buffer, uint64_t size) {
    base_ = buffer;
    size_ = static_cast<int64_t>(size);
    offset_ = 0;
  }
  GlobalTensor operator[](int64_t offset) const {
    GlobalTensor g = *this;
    g.offset_ += offset;
    return g;
  }
  T GetValue(int64_t i) const { return *At(i, 1); }
  void SetValue(int64_t i, T v) const { *At(i, 1) = v; }
  T *At(int64_t i, int64_t count) const {
    if (base_ == nullptr) EmuFail("GlobalTensor used before SetGlobalBuffer");
    if (offset_ + i < 0 || offset_ + i + count > size_)
      EmuFail("GM access out of bounds: elements [" + std::to_string(offset_ + i) + ", " +
              std::to_string(offset_ + i + count) + ") of a " + std::to_string(size_) + "-element buffer");
    return base_ + offset_ + i;
  }
  T *GetPhyAddr() const { return At(0, 0); }

 private:
  T *base_ = nullptr;
  int64_t size_ = 0, offset_ = 0;
};

// LocalTensor.md: a typed view of the Unified Buffer. operator[](offset) views `offset` elements on.
template <typename T>
class LocalTensor {
 public:
  LocalTensor() = default;
  LocalTensor(int64_t byte_offset, int64_t elements, TPosition pos) : byte_(byte_offset), size_(elements), pos_(pos) {}
  LocalTensor operator[](int64_t offset) const {
    if (offset < 0 || offset > size_) EmuFail("LocalTensor offset " + std::to_string(offset) + " beyond its size");
    return LocalTensor(byte_ + offset * static_cast<int64_t>(sizeof(T)), size_ - offset, pos_);
  }
  template <typename U>
  LocalTensor<U> ReinterpretCast() const {
    return LocalTensor<U>(byte_, size_ * static_cast<int64_t>(sizeof(T)) / static_cast<int64_t>(sizeof(U)), pos_);
  }
  T GetValue(int64_t i) const { return *At(i, 1); }
  void SetValue(int64_t i, T v) const { *At(i, 1) = v; }
  int64_t GetSize() const { return size_; }
  int64_t ByteOffset() const { return byte_; }
  bool Aligned() const { return byte_ % kBlock == 0; }
  T *At(int64_t i, int64_t count) const {
    if (size_ < 0 || i < 0 || i + count > size_)
      EmuFail("UB access out of bounds: elements [" + std::to_string(i) + ", " + std::to_string(i + count) +
              ") of a " + std::to_string(size_) + "-element tensor");
    return reinterpret_cast<T *>(Core().ub.data() + byte_) + i;
  }

 private:
  int64_t byte_ = 0, size_ = -1;
  TPosition pos_ = TPosition::VECCALC;
};

// ------------------------------------------------------------------------------------------------
// TPipe / TQue / TBuf (InitBuffer.md, AllocTensor.md, EnQue.md, DeQue.md, FreeTensor.md, TBuf.md):
// InitBuffer carves `num` buffers of `len` bytes (rounded up to 32) out of the UB; exceeding the UB
// capacity aborts. A TQue hands out at most `num` tensors at a time and holds at most `depth` queued.
template <TPosition pos, int32_t depth>
class TQue;
template <TPosition pos>
class TBuf;

class TPipe {
 public:
  TPipe() { Core().ub_used = 0; }
  template <TPosition pos, int32_t depth>
  void InitBuffer(TQue<pos, depth> &que, int32_t num, int32_t len) {
    que.Init(Reserve(static_cast<int64_t>(num) * RoundUp(len)), num, RoundUp(len));
  }
  template <TPosition pos>
  void InitBuffer(TBuf<pos> &buf, uint32_t len) {
    buf.Init(Reserve(RoundUp(len)), RoundUp(len));
  }

 private:
  static int64_t RoundUp(int64_t n) { return (n + kBlock - 1) / kBlock * kBlock; }
  static int64_t Reserve(int64_t bytes) {
    const int64_t at = Core().ub_used;
    if (at + bytes > kUbBytes)
      EmuFail("Unified Buffer overflow: " + std::to_string(at + bytes) + " bytes requested, capacity " +
              std::to_string(kUbBytes));
    Core().ub_used = at + bytes;
    return at;
  }
};

template <TPosition pos, int32_t depth>
class TQue {
 public:
  void Init(int64_t base, int32_t num, int64_t len) {
    base_ = base;
    num_ = num;
    len_ = len;
    in_use_.assign(num, false);
  }
  template <typename T>
  LocalTensor<T> AllocTensor() {
    for (int32_t i = 0; i < num_; ++i)
      if (!in_use_[i]) {
        in_use_[i] = true;
        return LocalTensor<T>(base_ + i * len_, len_ / static_cast<int64_t>(sizeof(T)), pos);
      }
    EmuFail("TQue::AllocTensor: all " + std::to_string(num_) + " buffers are in use (missing FreeTensor?)");
  }
  template <typename T>
  void EnQue(const LocalTensor<T> &t) {
    if (static_cast<int32_t>(queued_.size()) >= depth) EmuFail("TQue::EnQue beyond the queue depth");
    queued_.push_back(t.ByteOffset());
  }
  template <typename T>
  LocalTensor<T> DeQue() {
    if (queued_.empty()) EmuFail("TQue::DeQue on an empty queue");
    const int64_t at = queued_.front();
    queued_.erase(queued_.begin());
    return LocalTensor<T>(at, len_ / static_cast<int64_t>(sizeof(T)), pos);
  }
  template <typename T>
  void FreeTensor(const LocalTensor<T> &t) {
    const int64_t i = (t.ByteOffset() - base_) / len_;
    if (i < 0 || i >= num_ || !in_use_[i]) EmuFail("TQue::FreeTensor of a tensor this queue did not allocate");
    in_use_[i] = false;
  }

 private:
  int64_t base_ = 0, len_ = 0;
  int32_t num_ = 0;
  std::vector<bool> in_use_;
  std::vector<int64_t> queued_;
};

template <TPosition pos>
class TBuf {
 public:
  void Init(int64_t base, int64_t len) {
    base_ = base;
    len_ = len;
  }
  template <typename T>
  LocalTensor<T> Get() const {
    return LocalTensor<T>(base_, len_ / static_cast<int64_t>(sizeof(T)), pos);
  }

 private:
  int64_t base_ = 0, len_ = 0;
};

// ------------------------------------------------------------------------------------------------
// Data movement.
// DataCopy.md (contiguous form): copies `count` elements; count * sizeof(T) must be a multiple of
// 32 bytes and the UB address 32-byte aligned.
template <typename T>
inline void CheckCopy(const LocalTensor<T> &local, uint32_t count, const char *what) {
  if (!local.Aligned()) EmuFail(std::string(what) + ": UB address not 32-byte aligned");
  if ((count * sizeof(T)) % kBlock) EmuFail(std::string(what) + ": length not a multiple of 32 bytes");
}
template <typename T>
inline void DataCopy(const LocalTensor<T> &dst, const GlobalTensor<T> &src, uint32_t count) {
  CheckCopy(dst, count, "DataCopy GM->UB");
  std::memcpy(dst.At(0, count), src.At(0, count), count * sizeof(T));
}
template <typename T>
inline void DataCopy(const GlobalTensor<T> &dst, const LocalTensor<T> &src, uint32_t count) {
  CheckCopy(src, count, "DataCopy UB->GM");
  std::memcpy(dst.At(0, count), src.At(0, count), count * sizeof(T));
}

// DataCopyPad.md: blockCount blocks of blockLen *bytes* (any length that is a multiple of the
// element size). GM->UB: srcStride is the gap between blocks in GM in bytes, dstStride the gap in UB
// in 32-byte blocks, each UB block starting 32-byte aligned. UB->GM: srcStride in 32-byte blocks,
// dstStride in bytes. Padding values are not emulated (the kernel never reads the pad).
struct DataCopyExtParams {
  uint16_t blockCount = 1;
  uint32_t blockLen = 0;
  uint32_t srcStride = 0;
  uint32_t dstStride = 0;
  uint32_t rsv = 0;
};
template <typename T>
struct DataCopyPadExtParams {
  bool isPad = false;
  uint8_t leftPadding = 0, rightPadding = 0;
  T paddingValue{};
};
template <typename T>
inline void DataCopyPad(const LocalTensor<T> &dst, const GlobalTensor<T> &src, const DataCopyExtParams &p,
                        const DataCopyPadExtParams<T> &) {
  if (!dst.Aligned()) EmuFail("DataCopyPad GM->UB: UB address not 32-byte aligned");
  if (p.blockLen % sizeof(T)) EmuFail("DataCopyPad GM->UB: blockLen not a multiple of the element size");
  const int64_t n = p.blockLen / sizeof(T), ub_block = (p.blockLen + kBlock - 1) / kBlock * kBlock;
  for (int64_t b = 0; b < p.blockCount; ++b) {
    const int64_t g = b * (n + p.srcStride / static_cast<int64_t>(sizeof(T)));
    const int64_t u = b * (ub_block + p.dstStride * kBlock) / static_cast<int64_t>(sizeof(T));
    std::memcpy(dst.At(u, n), src.At(g, n), p.blockLen);
  }
}
template <typename T>
inline void DataCopyPad(const GlobalTensor<T> &dst, const LocalTensor<T> &src, const DataCopyExtParams &p) {
  if (!src.Aligned()) EmuFail("DataCopyPad UB->GM: UB address not 32-byte aligned");
  if (p.blockLen % sizeof(T)) EmuFail("DataCopyPad UB->GM: blockLen not a multiple of the element size");
  const int64_t n = p.blockLen / sizeof(T), ub_block = (p.blockLen + kBlock - 1) / kBlock * kBlock;
  for (int64_t b = 0; b < p.blockCount; ++b) {
    const int64_t u = b * (ub_block + p.srcStride * kBlock) / static_cast<int64_t>(sizeof(T));
    const int64_t g = b * (n + p.dstStride / static_cast<int64_t>(sizeof(T)));
    std::memcpy(dst.At(g, n), src.At(u, n), p.blockLen);
  }
}

// ------------------------------------------------------------------------------------------------
// Vector instructions, "first count elements" forms (Add.md, Sub.md, Mul.md, Max.md, Adds.md,
// Muls.md, Exp.md, Ln.md, Duplicate.md, Cast.md, ReduceMax.md, ReduceSum.md, Gather.md). Operands
// live in the UB with 32-byte aligned start addresses; results are computed in the operand type
// (float32 for every arithmetic call in this kernel).
template <typename T>
inline void CheckVec(const char *op, std::initializer_list<const LocalTensor<T> *> tensors, int32_t count) {
  if (count < 0) EmuFail(std::string(op) + ": negative count");
  for (const auto *t : tensors)
    if (!t->Aligned()) EmuFail(std::string(op) + ": operand not 32-byte aligned in the UB");
}
#define RFA_EMU_BINARY(NAME, EXPR)                                                                    \
  template <typename T>                                                                                \
  inline void NAME(const LocalTensor<T> &dst, const LocalTensor<T> &a, const LocalTensor<T> &b, int32_t count) { \
    CheckVec<T>(#NAME, {&dst, &a, &b}, count);                                                         \
    T *d = dst.At(0, count);                                                                           \
    const T *x = a.At(0, count), *y = b.At(0, count);                                                  \
    for (int32_t i = 0; i < count; ++i) d[i] = (EXPR);                                                  \
  }
RFA_EMU_BINARY(Add, x[i] + y[i])
RFA_EMU_BINARY(Sub, x[i] - y[i])
RFA_EMU_BINARY(Mul, x[i] * y[i])
RFA_EMU_BINARY(Max, x[i] > y[i] ? x[i] : y[i])
#undef RFA_EMU_BINARY

template <typename T>
inline void Adds(const LocalTensor<T> &dst, const LocalTensor<T> &src, T scalar, int32_t count) {
  CheckVec<T>("Adds", {&dst, &src}, count);
  for (int32_t i = 0; i < count; ++i) *dst.At(i, 1) = *src.At(i, 1) + scalar;
}
template <typename T>
inline void Muls(const LocalTensor<T> &dst, const LocalTensor<T> &src, T scalar, int32_t count) {
  CheckVec<T>("Muls", {&dst, &src}, count);
  for (int32_t i = 0; i < count; ++i) *dst.At(i, 1) = *src.At(i, 1) * scalar;
}
template <typename T>
inline void Exp(const LocalTensor<T> &dst, const LocalTensor<T> &src, int32_t count) {
  CheckVec<T>("Exp", {&dst, &src}, count);
  for (int32_t i = 0; i < count; ++i) *dst.At(i, 1) = std::exp(*src.At(i, 1));
}
template <typename T>
inline void Ln(const LocalTensor<T> &dst, const LocalTensor<T> &src, int32_t count) {
  CheckVec<T>("Ln", {&dst, &src}, count);
  for (int32_t i = 0; i < count; ++i) *dst.At(i, 1) = std::log(*src.At(i, 1));
}
template <typename T>
inline void Duplicate(const LocalTensor<T> &dst, const T &scalar, int32_t count) {
  CheckVec<T>("Duplicate", {&dst}, count);
  for (int32_t i = 0; i < count; ++i) *dst.At(i, 1) = scalar;
}
// Cast.md: element-wise conversion; CAST_RINT rounds to nearest even (what float->half/bf16 uses),
// CAST_NONE for exact widenings (half/bf16 -> float).
template <typename D, typename S>
inline void Cast(const LocalTensor<D> &dst, const LocalTensor<S> &src, RoundMode, int32_t count) {
  if (!dst.Aligned() || !src.Aligned()) EmuFail("Cast: operand not 32-byte aligned in the UB");
  for (int32_t i = 0; i < count; ++i) *dst.At(i, 1) = FromFloat<D>(ToFloat(*src.At(i, 1)));
}
// ReduceMax.md / ReduceSum.md (count form): dst[0] = max / sum of src[0, count). The shared
// temporary buffer must be 32-byte aligned (its contents are not modelled).
template <typename T>
inline void ReduceMax(const LocalTensor<T> &dst, const LocalTensor<T> &src, const LocalTensor<T> &tmp, int32_t count,
                      bool = false) {
  CheckVec<T>("ReduceMax", {&src, &tmp}, count);
  if (dst.ByteOffset() % (2 * sizeof(T))) EmuFail("ReduceMax: dst not aligned to 2 elements");
  T m = *src.At(0, 1);
  for (int32_t i = 1; i < count; ++i) m = std::max(m, *src.At(i, 1));
  dst.SetValue(0, m);
}
template <typename T>
inline void ReduceSum(const LocalTensor<T> &dst, const LocalTensor<T> &src, const LocalTensor<T> &tmp, int32_t count) {
  CheckVec<T>("ReduceSum", {&src, &tmp}, count);
  if (dst.ByteOffset() % (2 * sizeof(T))) EmuFail("ReduceSum: dst not aligned to 2 elements");
  double s = 0;  // the hardware sums in a tree of float adds; a double sum is within its rounding
  for (int32_t i = 0; i < count; ++i) s += *src.At(i, 1);
  dst.SetValue(0, static_cast<T>(s));
}
// Gather.md: dst[i] = the element of src at byte offset offsets[i] (+ srcBaseAddr; this kernel
// passes 0). Offsets are bytes and must be multiples of sizeof(T).
template <typename T>
inline void Gather(const LocalTensor<T> &dst, const LocalTensor<T> &src, const LocalTensor<uint32_t> &offsets,
                   uint32_t src_base, uint32_t count) {
  if (!dst.Aligned() || !src.Aligned() || !offsets.Aligned()) EmuFail("Gather: operand not 32-byte aligned");
  for (uint32_t i = 0; i < count; ++i) {
    const uint32_t off = *offsets.At(i, 1);
    if ((off + src_base) % sizeof(T)) EmuFail("Gather: offset not a multiple of the element size");
    *dst.At(i, 1) = *src.At(static_cast<int64_t>((off + src_base) / sizeof(T)), 1);
  }
}

// SyncAll.md (hard sync): every core waits until all cores of the launch arrive. The emulated
// cores are threads, so this is a real barrier; a core that failed releases the others (they fail).
struct Barrier {
  std::mutex mutex;
  std::condition_variable cv;
  int64_t expected = 1, arrived = 0, generation = 0;
  bool broken = false;
};
inline Barrier &LaunchBarrier() {
  static Barrier barrier;
  return barrier;
}
template <bool isAIVOnly = true>
inline void SyncAll() {
  Barrier &b = LaunchBarrier();
  std::unique_lock<std::mutex> lock(b.mutex);
  const int64_t gen = b.generation;
  if (++b.arrived == b.expected) {
    b.arrived = 0;
    ++b.generation;
    b.cv.notify_all();
  } else {
    b.cv.wait(lock, [&] { return b.generation != gen || b.broken; });
  }
  if (b.broken) EmuFail("SyncAll: another core failed");
}

// GetUserWorkspace.md / SetSysWorkspace.md: the workspace argument starts with the system part
// (used by the Matmul API); the operator's own part follows it.
inline void SetSysWorkspace(GM_ADDR workspace) { Core().sys_workspace = workspace; }
inline GM_ADDR GetSysWorkSpacePtr() { return Core().sys_workspace; }
inline GM_ADDR GetUserWorkspace(GM_ADDR workspace) { return workspace + 16 * 1024 * 1024; }

}  // namespace AscendC

// Kernel launch on the emulated cores, after ICPU_RUN_KF(kernel, blockDim, args...): one thread per
// core index, each with its own Unified Buffer; the first failure is rethrown after all joined.
template <typename... Args>
inline void EmuRunKernel(void (*kernel)(Args...), int64_t block_dim, Args... args) {
  AscendC::Barrier &barrier = AscendC::LaunchBarrier();
  {
    std::lock_guard<std::mutex> lock(barrier.mutex);
    barrier.expected = block_dim;
    barrier.arrived = 0;
    barrier.broken = false;
  }
  std::mutex error_mutex;
  std::string error;
  std::vector<std::thread> cores;
  for (int64_t i = 0; i < block_dim; ++i) {
    cores.emplace_back([&, i] {
      AscendC::Core().block_idx = i;
      AscendC::Core().block_num = block_dim;
      AscendC::Core().ub_used = 0;
      try {
        kernel(args...);
      } catch (const std::exception &e) {
        {
          std::lock_guard<std::mutex> lock(error_mutex);
          if (error.empty()) error = "core " + std::to_string(i) + ": " + e.what();
        }
        std::lock_guard<std::mutex> lock(barrier.mutex);
        barrier.broken = true;
        barrier.cv.notify_all();
      }
    });
  }
  for (auto &t : cores) t.join();
  if (!error.empty()) throw std::runtime_error(error);
}
