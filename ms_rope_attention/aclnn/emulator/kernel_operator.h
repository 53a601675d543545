// A CPU emulation of the subset of the Ascend C API that op_kernel/ uses, so the kernel source is
// compiled and run on a machine without an NPU (tests/test_ascend.py). It is not CANN's CPU debug
// library (that ships with CANN, not on PyPI). It is meant to be at least as strict as the hardware
// on every rule the kernel can break, and to fail loudly (an exception naming the rule, never a hang
// of the test run) where the hardware would hang, race or compute garbage:
//
//   - declarations where the real headers put them: pipe_t / PIPE_* / event ids and
//     GetSysWorkSpacePtr in the global namespace, everything else in AscendC;
//   - a MIX 1:2 launch: per AI core one cube (AIC) thread runs the kernel entry beside two vector
//     (AIV) threads; REGIST_MATMUL_OBJ has the real scoping (lib/matmul_intf.h); vector
//     instructions, UB buffers and SyncAll on the cube core fail;
//   - per-32-byte-block pipe-hazard tracking of the Unified Buffer: a read by one pipe (S, V, MTE2,
//     MTE3) of bytes another pipe wrote fails unless a SetFlag/WaitFlag pair of that direction, a
//     queue hand-off (EnQue/DeQue) or PipeBarrier<PIPE_ALL> came in between;
//   - scalar GM writes (GlobalTensor::SetValue) go through a per-core cache written back in
//     64-byte lines: a line that a scalar write and another core both write fails;
//   - SyncAll waits for every launched vector core: one that returned instead fails the others;
//   - the real UB size (GetCoreMemSize(UB) on Atlas A2: 192 KiB - 256), 32-byte alignment of UB
//     addresses and DataCopy lengths, queue depths, bounds of every GM and UB access, and the
//     Cast round modes the A2 vector unit accepts.
// Each function names the CANN documentation page whose semantics it assumes (cannmirror/asc-devkit,
// docs/api/context/<page>.md); ../README.md ("What the emulation enforces") lists the rules, their
// sources and the tests that feed each one its faulty pattern.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#define __aicore__
#define __global__
#define __gm__
using GM_ADDR = uint8_t *;

// ------------------------------------------------------------------------------------------------
// Global-namespace declarations, as in the real headers (kernel_operator_utils_intf.h,
// kernel_operator_swap_mem_intf.h, kernel_type.h): compiler built-in pipe ids, and the kernel types
// of KERNEL_TASK_TYPE_DEFAULT.
enum pipe_t { PIPE_S = 0, PIPE_V, PIPE_M, PIPE_MTE1, PIPE_MTE2, PIPE_MTE3, PIPE_ALL, PIPE_FIX };
enum KernelMetaType {
  KERNEL_TYPE_AIV_ONLY,
  KERNEL_TYPE_AIC_ONLY,
  KERNEL_TYPE_MIX_AIV_1_0,
  KERNEL_TYPE_MIX_AIC_1_0,
  KERNEL_TYPE_MIX_AIC_1_1,
  KERNEL_TYPE_MIX_AIC_1_2,
  KERNEL_TYPE_UNDECLARED,
};

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

enum class TPosition { GM, A1, A2, B1, B2, C1, C2, CO1, CO2, VECIN, VECOUT, VECCALC };
using QuePosition = TPosition;
// kernel_event.h: src_dst of a synchronisation event (the vector-core subset; cube events fail).
enum class HardEvent {
  MTE2_V, V_MTE2, MTE3_V, V_MTE3, S_V, V_S, S_MTE2, MTE2_S, S_MTE3, MTE3_S, MTE3_MTE2, MTE2_MTE3, M_V, V_M,
};
using TEventID = int8_t;
enum class RoundMode { CAST_NONE, CAST_RINT, CAST_FLOOR, CAST_CEIL, CAST_ROUND, CAST_TRUNC, CAST_ODD };

constexpr int64_t kUbBytes = 192 * 1024 - 256;  // GetCoreMemSize(UB) on Atlas A2
constexpr int64_t kBlock = 32;
constexpr int64_t kCacheLine = 64;              // scalar GM writes are written back in these lines

// The pipes whose ordering the emulation tracks on a vector core.
enum Pipe { kS, kV, kMTE2, kMTE3, kPipes, kNoPipe = kPipes };
inline const char *PipeName(int p) {
  static const char *names[] = {"S (scalar)", "V (vector)", "MTE2 (GM->UB)", "MTE3 (UB->GM)", "none"};
  return names[p];
}
inline std::pair<Pipe, Pipe> EventPipes(HardEvent e) {
  switch (e) {
    case HardEvent::MTE2_V: return {kMTE2, kV};
    case HardEvent::V_MTE2: return {kV, kMTE2};
    case HardEvent::MTE3_V: return {kMTE3, kV};
    case HardEvent::V_MTE3: return {kV, kMTE3};
    case HardEvent::S_V: return {kS, kV};
    case HardEvent::V_S: return {kV, kS};
    case HardEvent::S_MTE2: return {kS, kMTE2};
    case HardEvent::MTE2_S: return {kMTE2, kS};
    case HardEvent::S_MTE3: return {kS, kMTE3};
    case HardEvent::MTE3_S: return {kMTE3, kS};
    case HardEvent::MTE3_MTE2: return {kMTE3, kMTE2};
    case HardEvent::MTE2_MTE3: return {kMTE2, kMTE3};
    default: EmuFail("SetFlag/WaitFlag: a cube-pipe event on a vector core");
  }
}

// ------------------------------------------------------------------------------------------------
// Per-core machine state and the launch.
struct BlockWrite {  // per 32-byte UB block: its last writer, and the last read of each pipe since
  int pipe = kNoPipe;
  uint64_t seq = 0;
  const char *op = "";
  uint64_t read[kPipes] = {};
  const char *read_op[kPipes] = {};
};
struct GmWrite {
  uintptr_t lo, hi;
  uint64_t seq;
};
class MatmulBase;

struct CoreState {
  bool aic = false;
  int64_t block_idx = 0, block_num = 1, sub_block = 0, ai_core = 0;
  KernelMetaType kernel_type = KERNEL_TYPE_UNDECLARED;
  bool registered = false;  // this vector core built its KFC client (REGIST_MATMUL_OBJ)
  std::vector<uint8_t> ub;
  int64_t ub_used = 0;
  uint64_t seq[kPipes] = {};
  uint64_t known[kPipes][kPipes] = {};  // known[x][y]: pipe x has waited for pipe y's instructions up to seq
  std::vector<BlockWrite> ub_writer;
  std::map<std::pair<int, int>, uint64_t> flags;  // (event, id) -> seq of the source pipe at SetFlag
  std::vector<GmWrite> gm_unsynced;               // MTE3 GM writes the scalar pipe has not waited for
  const MatmulBase *active_matmul = nullptr;      // IterateAll without End() yet
  GM_ADDR sys_workspace = nullptr;
  int8_t next_event = 0;
};

// One AI core's cube server and the two vector cores that message it (lib/matmul_intf.h).
struct Mailbox {
  std::mutex m;
  std::condition_variable cv;
  std::deque<std::function<void()> *> requests;
  int quits = 0;          // clients that went out of scope
  int never_clients = 0;  // vector cores that ended without ever building a client
  bool serving = false, server_gone = false;
};

struct Launch {
  std::mutex m;
  std::condition_variable cv;
  int64_t vector_cores = 0, arrived = 0, finished = 0, generation = 0;
  bool broken = false;
  std::vector<std::unique_ptr<Mailbox>> mailboxes;
  std::mutex gm_mutex;
  struct Line {
    int64_t first_core;
    bool scalar, shared;
  };
  std::unordered_map<uintptr_t, Line> gm_lines;
  double timeout_s = 60.0;
};
inline Launch &TheLaunch() {
  static Launch launch;
  return launch;
}

inline CoreState *&CorePtr() {
  static thread_local CoreState *core = nullptr;
  return core;
}
inline CoreState &Core() {
  if (CorePtr() == nullptr) EmuFail("AscendC call outside an emulated kernel launch");
  return *CorePtr();
}
inline std::string CoreName() {
  const CoreState &c = Core();
  return (c.aic ? "cube core " : "vector core ") + std::to_string(c.block_idx);
}
// Vector instructions, UB buffers and DMA between GM and UB exist on the vector cores only.
inline CoreState &VectorCore(const char *what) {
  CoreState &c = Core();
  if (c.aic)
    EmuFail(std::string(what) + " on the cube core: in a MIX kernel the cube core must leave the kernel inside "
                                "REGIST_MATMUL_OBJ (put it in the kernel entry, before Init)");
  return c;
}

// ------------------------------------------------------------------------------------------------
// Pipe-hazard tracking. Every vector-core instruction belongs to one pipe and reads and writes UB
// byte ranges; V, MTE2 and MTE3 run asynchronously, the scalar unit's own accesses complete in
// program order. So: reading bytes another pipe wrote (RAW), writing bytes another asynchronous pipe
// wrote (WAW) or still reads (WAR) needs that access to be known to the pipe, through
// SetFlag/WaitFlag of that direction, a TQue hand-off or PipeBarrier<PIPE_ALL>.
inline uint64_t Issue(int pipe) { return ++Core().seq[pipe]; }

[[noreturn]] inline void Hazard(const char *kind, const char *op, int pipe, int64_t b, const char *other_op,
                                int other_pipe) {
  EmuFail(std::string(kind) + ": " + op + " on pipe " + PipeName(pipe) + " touches UB bytes [" +
          std::to_string(b * kBlock) + ", " + std::to_string(b * kBlock + kBlock) + ") that " + other_op +
          " on pipe " + PipeName(other_pipe) + " " + (std::strcmp(kind, "write after read") == 0 ? "reads" : "wrote") +
          ", with no synchronisation in between: SetFlag/WaitFlag<" + PipeName(other_pipe) + " -> " + PipeName(pipe) +
          ">, a TQue EnQue/DeQue hand-off, or PipeBarrier<PIPE_ALL> (SetFlag.md: only queues insert it for you)");
}
inline void CheckRead(int pipe, int64_t byte, int64_t bytes, const char *op) {
  CoreState &c = Core();
  if (bytes <= 0) return;
  for (int64_t b = byte / kBlock; b <= (byte + bytes - 1) / kBlock; ++b) {
    BlockWrite &w = c.ub_writer[b];
    if (w.pipe != kNoPipe && w.pipe != pipe && w.seq > c.known[pipe][w.pipe])
      Hazard("read after write", op, pipe, b, w.op, w.pipe);
    if (pipe != kS) {
      w.read[pipe] = c.seq[pipe];
      w.read_op[pipe] = op;
    }
  }
}
inline void RecordWrite(int pipe, uint64_t seq, int64_t byte, int64_t bytes, const char *op) {
  CoreState &c = Core();
  if (bytes <= 0) return;
  for (int64_t b = byte / kBlock; b <= (byte + bytes - 1) / kBlock; ++b) {
    BlockWrite &w = c.ub_writer[b];
    if (pipe != kNoPipe) {
      if (w.pipe != kNoPipe && w.pipe != kS && w.pipe != pipe && w.seq > c.known[pipe][w.pipe])
        Hazard("write after write", op, pipe, b, w.op, w.pipe);
      for (int y = kV; y < kPipes; ++y)
        if (y != pipe && w.read[y] > c.known[pipe][y]) Hazard("write after read", op, pipe, b, w.read_op[y], y);
    }
    w = BlockWrite();
    w.pipe = pipe;
    w.seq = seq;
    w.op = op;
  }
}
inline void Publish(int dst, int src, uint64_t seq) {
  uint64_t &k = Core().known[dst][src];
  if (seq > k) k = seq;
}

// GetBlockIdx.md / GetBlockNum.md / GetSubBlockIdx.md / GetTaskRation.md: in MIX 1:2 a vector core's
// index is ai_core * 2 + sub_block; blockDim counts AI cores.
inline int64_t GetBlockIdx() { return Core().block_idx; }
inline int64_t GetBlockNum() { return Core().block_num; }
inline int64_t GetSubBlockIdx() { return Core().sub_block; }
inline int64_t GetTaskRation() { return 2; }

// PipeBarrier.md: PIPE_ALL waits for every pipe; a single-pipe barrier orders that pipe with itself
// (instructions of one pipe already complete in order here).
template <pipe_t pipe>
inline void PipeBarrier() {
  CoreState &c = VectorCore("PipeBarrier");
  if (pipe == PIPE_ALL) {
    for (int x = 0; x < kPipes; ++x)
      for (int y = 0; y < kPipes; ++y) c.known[x][y] = c.seq[y];
    c.gm_unsynced.clear();
  }
}
// SetFlag.md / WaitFlag.md: SetFlag<SRC_DST>(id) marks the point in SRC's stream that the matching
// WaitFlag makes DST wait for. A WaitFlag with no SetFlag before it never returns on hardware.
template <HardEvent event>
inline void SetFlag(int32_t id) {
  CoreState &c = VectorCore("SetFlag");
  const auto pipes = EventPipes(event);
  c.flags[{static_cast<int>(event), id}] = c.seq[pipes.first];
}
template <HardEvent event>
inline void WaitFlag(int32_t id) {
  CoreState &c = VectorCore("WaitFlag");
  const auto pipes = EventPipes(event);
  auto it = c.flags.find({static_cast<int>(event), id});
  if (it == c.flags.end()) EmuFail("WaitFlag with no SetFlag of the same event and id before it: hangs on hardware");
  Publish(pipes.second, pipes.first, it->second);
  c.flags.erase(it);
  if (pipes.second == kS && pipes.first == kMTE3) {  // the scalar pipe now knows these GM writes landed
    const uint64_t seen = c.known[kS][kMTE3];
    std::vector<GmWrite> left;
    for (const GmWrite &w : c.gm_unsynced)
      if (w.seq > seen) left.push_back(w);
    c.gm_unsynced.swap(left);
  }
}

// ------------------------------------------------------------------------------------------------
// GlobalTensor.md: a typed view of global memory. SetGlobalBuffer(ptr, size) fixes the extent;
// operator[](offset) is the view starting `offset` elements later. Every access is bounds-checked.
// SetValue.md: a scalar write goes through the core's data cache and is written back in 64-byte
// lines, so two cores writing within one line overwrite each other: refused here.
inline void TrackGmWrite(uintptr_t lo, uintptr_t hi, bool scalar) {
  Launch &l = TheLaunch();
  const int64_t me = Core().block_idx;
  std::lock_guard<std::mutex> lock(l.gm_mutex);
  for (uintptr_t line = lo / kCacheLine; line <= (hi - 1) / kCacheLine; ++line) {
    auto it = l.gm_lines.find(line);
    if (it == l.gm_lines.end()) {
      l.gm_lines.emplace(line, Launch::Line{me, scalar, false});
      continue;
    }
    Launch::Line &info = it->second;
    if (info.first_core != me) info.shared = true;
    info.scalar = info.scalar || scalar;
    if (info.scalar && info.shared)
      EmuFail("GlobalTensor::SetValue into a 64-byte line that another core also writes: scalar GM writes are "
              "written back by whole cache lines and race (SetValue.md); stage the values in the UB and store "
              "them with DataCopyPad");
  }
}

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
  void SetValue(int64_t i, T v) const {
    T *p = At(i, 1);
    TrackGmWrite(reinterpret_cast<uintptr_t>(p), reinterpret_cast<uintptr_t>(p + 1), true);
    *p = v;
  }
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
// GetValue / SetValue are scalar-pipe accesses.
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
  T GetValue(int64_t i) const {
    const T *p = At(i, 1);
    Issue(kS);
    CheckRead(kS, Byte(i), sizeof(T), "LocalTensor::GetValue");
    return *p;
  }
  void SetValue(int64_t i, T v) const {
    T *p = At(i, 1);
    RecordWrite(kS, Issue(kS), Byte(i), sizeof(T), "LocalTensor::SetValue");
    *p = v;
  }
  int64_t GetSize() const { return size_; }
  int64_t ByteOffset() const { return byte_; }
  int64_t Byte(int64_t i) const { return byte_ + i * static_cast<int64_t>(sizeof(T)); }
  TPosition Position() const { return pos_; }
  bool Aligned() const { return byte_ % kBlock == 0; }
  T *At(int64_t i, int64_t count) const {
    CoreState &c = VectorCore("a Unified Buffer access");
    if (size_ < 0 || i < 0 || i + count > size_)
      EmuFail("UB access out of bounds: elements [" + std::to_string(i) + ", " + std::to_string(i + count) +
              ") of a " + std::to_string(size_) + "-element tensor");
    return reinterpret_cast<T *>(c.ub.data() + byte_) + i;
  }

 private:
  int64_t byte_ = 0, size_ = -1;
  TPosition pos_ = TPosition::VECCALC;
};

// ------------------------------------------------------------------------------------------------
// TPipe / TQue / TBuf (InitBuffer.md, AllocTensor.md, EnQue.md, DeQue.md, FreeTensor.md, TBuf.md,
// FetchEventID.md): InitBuffer carves `num` buffers of `len` bytes (rounded up to 32) out of the
// UB; beyond the capacity aborts. A TQue hands out at most `num` tensors and holds at most `depth`
// queued. EnQue/DeQue synchronise the producer and consumer pipes of the queue's position: VECIN
// MTE2 -> V, VECOUT V -> MTE3 (a TBuf synchronises nothing).
template <TPosition pos, int32_t depth>
class TQue;
template <TPosition pos>
class TBuf;

class TPipe {
 public:
  TPipe() { Core().ub_used = 0; }
  // The real signatures (kernel_tpipe.h): a queue's depth is a uint8_t, lengths are uint32_t.
  template <TPosition pos, int32_t depth>
  bool InitBuffer(TQue<pos, depth> &que, uint8_t num, uint32_t len) {
    que.Init(Reserve(static_cast<int64_t>(num) * RoundUp(len)), num, RoundUp(len));
    return true;
  }
  template <TPosition pos>
  bool InitBuffer(TBuf<pos> &buf, uint32_t len) {
    buf.Init(Reserve(RoundUp(len)), RoundUp(len));
    return true;
  }
  TEventID FetchEventID(HardEvent) {
    VectorCore("TPipe::FetchEventID");
    return static_cast<TEventID>(Core().next_event++ % 8);
  }

 private:
  static int64_t RoundUp(int64_t n) { return (n + kBlock - 1) / kBlock * kBlock; }
  static int64_t Reserve(int64_t bytes) {
    CoreState &c = VectorCore("TPipe::InitBuffer");
    const int64_t at = c.ub_used;
    if (at + bytes > kUbBytes)
      EmuFail("Unified Buffer overflow: " + std::to_string(at + bytes) + " bytes requested, capacity " +
              std::to_string(kUbBytes));
    c.ub_used = at + bytes;
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
    freed_.assign(num, 0);
  }
  // The producer may overwrite a buffer once its consumer's reads of the previous contents are done:
  // FreeTensor marks that point in the consumer's stream, AllocTensor waits for it.
  template <typename T>
  LocalTensor<T> AllocTensor() {
    for (int32_t i = 0; i < num_; ++i)
      if (!in_use_[i]) {
        in_use_[i] = true;
        if (pos == TPosition::VECIN) Publish(kMTE2, kV, freed_[i]);
        if (pos == TPosition::VECOUT) Publish(kV, kMTE3, freed_[i]);
        return LocalTensor<T>(base_ + i * len_, len_ / static_cast<int64_t>(sizeof(T)), pos);
      }
    EmuFail("TQue::AllocTensor: all " + std::to_string(num_) + " buffers are in use (missing FreeTensor?)");
  }
  template <typename T>
  void EnQue(const LocalTensor<T> &t) {
    if (static_cast<int32_t>(queued_.size()) >= depth) EmuFail("TQue::EnQue beyond the queue depth");
    const int producer = pos == TPosition::VECIN ? kMTE2 : pos == TPosition::VECOUT ? kV : kNoPipe;
    queued_.push_back({t.ByteOffset(), producer == kNoPipe ? 0 : Core().seq[producer]});
  }
  template <typename T>
  LocalTensor<T> DeQue() {
    if (queued_.empty()) EmuFail("TQue::DeQue on an empty queue");
    const auto entry = queued_.front();
    queued_.erase(queued_.begin());
    if (pos == TPosition::VECIN) Publish(kV, kMTE2, entry.second);
    if (pos == TPosition::VECOUT) Publish(kMTE3, kV, entry.second);
    return LocalTensor<T>(entry.first, len_ / static_cast<int64_t>(sizeof(T)), pos);
  }
  template <typename T>
  void FreeTensor(const LocalTensor<T> &t) {
    const int64_t i = (t.ByteOffset() - base_) / len_;
    if (i < 0 || i >= num_ || !in_use_[i]) EmuFail("TQue::FreeTensor of a tensor this queue did not allocate");
    in_use_[i] = false;
    const int consumer = pos == TPosition::VECIN ? kV : pos == TPosition::VECOUT ? kMTE3 : kNoPipe;
    freed_[i] = consumer == kNoPipe ? 0 : Core().seq[consumer];
  }

 private:
  int64_t base_ = 0, len_ = 0;
  int32_t num_ = 0;
  std::vector<bool> in_use_;
  std::vector<uint64_t> freed_;
  std::vector<std::pair<int64_t, uint64_t>> queued_;
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
// Data movement: GM -> UB on MTE2, UB -> GM on MTE3.
// DataCopy.md (contiguous form): copies `count` elements; count * sizeof(T) must be a multiple of
// 32 bytes and the UB address 32-byte aligned.
template <typename T>
inline void CheckCopy(const LocalTensor<T> &local, uint32_t count, const char *what) {
  VectorCore(what);
  if (!local.Aligned()) EmuFail(std::string(what) + ": UB address not 32-byte aligned");
  if ((count * sizeof(T)) % kBlock) EmuFail(std::string(what) + ": length not a multiple of 32 bytes");
}
template <typename T>
inline void StoreToGm(T *dst, const LocalTensor<T> &src, int64_t u, int64_t n, const char *what) {
  const T *from = src.At(u, n);
  CheckRead(kMTE3, src.Byte(u), n * static_cast<int64_t>(sizeof(T)), what);
  TrackGmWrite(reinterpret_cast<uintptr_t>(dst), reinterpret_cast<uintptr_t>(dst + n), false);
  Core().gm_unsynced.push_back({reinterpret_cast<uintptr_t>(dst), reinterpret_cast<uintptr_t>(dst + n),
                                Core().seq[kMTE3]});
  std::memcpy(dst, from, n * sizeof(T));
}
template <typename T>
inline void DataCopy(const LocalTensor<T> &dst, const GlobalTensor<T> &src, uint32_t count) {
  CheckCopy(dst, count, "DataCopy GM->UB");
  RecordWrite(kMTE2, Issue(kMTE2), dst.Byte(0), count * sizeof(T), "DataCopy GM->UB");
  std::memcpy(dst.At(0, count), src.At(0, count), count * sizeof(T));
}
template <typename T>
inline void DataCopy(const GlobalTensor<T> &dst, const LocalTensor<T> &src, uint32_t count) {
  CheckCopy(src, count, "DataCopy UB->GM");
  Issue(kMTE3);
  StoreToGm(dst.At(0, count), src, 0, count, "DataCopy UB->GM");
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
  VectorCore("DataCopyPad GM->UB");
  if (!dst.Aligned()) EmuFail("DataCopyPad GM->UB: UB address not 32-byte aligned");
  if (p.blockLen % sizeof(T)) EmuFail("DataCopyPad GM->UB: blockLen not a multiple of the element size");
  const int64_t n = p.blockLen / sizeof(T), ub_block = (p.blockLen + kBlock - 1) / kBlock * kBlock;
  const uint64_t seq = Issue(kMTE2);
  for (int64_t b = 0; b < p.blockCount; ++b) {
    const int64_t g = b * (n + p.srcStride / static_cast<int64_t>(sizeof(T)));
    const int64_t u = b * (ub_block + p.dstStride * kBlock) / static_cast<int64_t>(sizeof(T));
    std::memcpy(dst.At(u, n), src.At(g, n), p.blockLen);
    RecordWrite(kMTE2, seq, dst.Byte(u), p.blockLen, "DataCopyPad GM->UB");
  }
}
template <typename T>
inline void DataCopyPad(const GlobalTensor<T> &dst, const LocalTensor<T> &src, const DataCopyExtParams &p) {
  VectorCore("DataCopyPad UB->GM");
  if (!src.Aligned()) EmuFail("DataCopyPad UB->GM: UB address not 32-byte aligned");
  if (p.blockLen % sizeof(T)) EmuFail("DataCopyPad UB->GM: blockLen not a multiple of the element size");
  const int64_t n = p.blockLen / sizeof(T), ub_block = (p.blockLen + kBlock - 1) / kBlock * kBlock;
  Issue(kMTE3);
  for (int64_t b = 0; b < p.blockCount; ++b) {
    const int64_t u = b * (ub_block + p.srcStride * kBlock) / static_cast<int64_t>(sizeof(T));
    const int64_t g = b * (n + p.dstStride / static_cast<int64_t>(sizeof(T)));
    StoreToGm(dst.At(g, n), src, u, n, "DataCopyPad UB->GM");
  }
}

// ------------------------------------------------------------------------------------------------
// Vector instructions, "first count elements" forms (Add.md, Sub.md, Mul.md, Max.md, Adds.md,
// Muls.md, Exp.md, Ln.md, Duplicate.md, Cast.md, ReduceMax.md, ReduceSum.md, Gather.md): V pipe,
// operands in the UB with 32-byte aligned start addresses.
struct VecOp {  // one vector instruction: checks its operands, then records its destination
  const char *name;
  uint64_t seq;
  explicit VecOp(const char *op) : name(op), seq(0) {
    VectorCore(op);
    seq = Issue(kV);
  }
  template <typename T>
  void In(const LocalTensor<T> &t, int64_t count) const {
    if (!t.Aligned()) EmuFail(std::string(name) + ": operand not 32-byte aligned in the UB");
    t.At(0, count);
    CheckRead(kV, t.Byte(0), count * static_cast<int64_t>(sizeof(T)), name);
  }
  template <typename T>
  T *Out(const LocalTensor<T> &t, int64_t count) const {
    if (!t.Aligned()) EmuFail(std::string(name) + ": operand not 32-byte aligned in the UB");
    T *p = t.At(0, count);
    RecordWrite(kV, seq, t.Byte(0), count * static_cast<int64_t>(sizeof(T)), name);
    return p;
  }
};
template <typename T>
inline const T *Raw(const LocalTensor<T> &t, int64_t count) { return t.At(0, count); }

#define RFA_EMU_BINARY(NAME, EXPR)                                                                    \
  template <typename T>                                                                                \
  inline void NAME(const LocalTensor<T> &dst, const LocalTensor<T> &a, const LocalTensor<T> &b, int32_t count) { \
    VecOp op(#NAME);                                                                                   \
    if (count < 0) EmuFail(#NAME ": negative count");                                                  \
    op.In(a, count);                                                                                   \
    op.In(b, count);                                                                                   \
    std::vector<T> r(count);                                                                           \
    const T *x = Raw(a, count), *y = Raw(b, count);                                                    \
    for (int32_t i = 0; i < count; ++i) r[i] = (EXPR);                                                  \
    T *d = op.Out(dst, count);                                                                         \
    std::copy(r.begin(), r.end(), d);                                                                  \
  }
RFA_EMU_BINARY(Add, x[i] + y[i])
RFA_EMU_BINARY(Sub, x[i] - y[i])
RFA_EMU_BINARY(Mul, x[i] * y[i])
RFA_EMU_BINARY(Max, x[i] > y[i] ? x[i] : y[i])
#undef RFA_EMU_BINARY

template <typename T, typename F>
inline void EmuUnary(const char *name, const LocalTensor<T> &dst, const LocalTensor<T> &src, int32_t count, F f) {
  VecOp op(name);
  if (count < 0) EmuFail(std::string(name) + ": negative count");
  op.In(src, count);
  std::vector<T> r(count);
  const T *x = Raw(src, count);
  for (int32_t i = 0; i < count; ++i) r[i] = f(x[i]);
  T *d = op.Out(dst, count);
  std::copy(r.begin(), r.end(), d);
}
template <typename T>
inline void Adds(const LocalTensor<T> &dst, const LocalTensor<T> &src, T scalar, int32_t count) {
  EmuUnary("Adds", dst, src, count, [&](T v) { return v + scalar; });
}
template <typename T>
inline void Muls(const LocalTensor<T> &dst, const LocalTensor<T> &src, T scalar, int32_t count) {
  EmuUnary("Muls", dst, src, count, [&](T v) { return v * scalar; });
}
template <typename T>
inline void Exp(const LocalTensor<T> &dst, const LocalTensor<T> &src, int32_t count) {
  EmuUnary("Exp", dst, src, count, [](T v) { return std::exp(v); });
}
template <typename T>
inline void Ln(const LocalTensor<T> &dst, const LocalTensor<T> &src, int32_t count) {
  EmuUnary("Ln", dst, src, count, [](T v) { return std::log(v); });
}
template <typename T>
inline void Duplicate(const LocalTensor<T> &dst, const T &scalar, int32_t count) {
  VecOp op("Duplicate");
  T *d = op.Out(dst, count);
  for (int32_t i = 0; i < count; ++i) d[i] = scalar;
}

// Cast.md, and the A2 vector unit's conversions (impl/basic_api/dav_c220/kernel_operator_vec_vconv_impl.h):
// half/bfloat16 -> float accept CAST_NONE only; float -> half accepts every mode (CAST_NONE rounds
// like CAST_RINT); float -> bfloat16 accepts RINT/FLOOR/CEIL/ROUND/TRUNC, not NONE or ODD. Modes the
// hardware accepts but this kernel does not use are refused as "not emulated".
inline const char *RoundName(RoundMode m) {
  static const char *names[] = {"CAST_NONE", "CAST_RINT", "CAST_FLOOR", "CAST_CEIL", "CAST_ROUND", "CAST_TRUNC",
                                "CAST_ODD"};
  return names[static_cast<int>(m)];
}
template <typename D, typename S>
inline void CheckCastMode(RoundMode mode) {
  const bool widen = std::is_same<D, float>::value && (std::is_same<S, half>::value || std::is_same<S, bfloat16_t>::value);
  const bool to_half = std::is_same<D, half>::value && std::is_same<S, float>::value;
  const bool to_bf16 = std::is_same<D, bfloat16_t>::value && std::is_same<S, float>::value;
  std::string illegal;
  if (widen && mode != RoundMode::CAST_NONE) illegal = "half/bfloat16 -> float takes CAST_NONE only";
  else if (to_bf16 && (mode == RoundMode::CAST_NONE || mode == RoundMode::CAST_ODD))
    illegal = "float -> bfloat16 does not support CAST_NONE or CAST_ODD";
  else if (!widen && !to_half && !to_bf16) illegal = "this type pair is not a conversion the kernel may use";
  if (!illegal.empty()) EmuFail(std::string("Cast with ") + RoundName(mode) + ": " + illegal + " on Atlas A2");
  if (!widen && mode != RoundMode::CAST_RINT && mode != RoundMode::CAST_NONE)
    EmuFail(std::string("Cast with ") + RoundName(mode) + ": legal on Atlas A2 but not emulated");
}
template <typename D, typename S>
inline void Cast(const LocalTensor<D> &dst, const LocalTensor<S> &src, RoundMode mode, int32_t count) {
  VecOp op("Cast");
  CheckCastMode<D, S>(mode);
  op.In(src, count);
  std::vector<D> r(count);
  const S *x = Raw(src, count);
  for (int32_t i = 0; i < count; ++i) r[i] = FromFloat<D>(ToFloat(x[i]));
  D *d = op.Out(dst, count);
  std::copy(r.begin(), r.end(), d);
}
// ReduceMax.md / ReduceSum.md (count form): dst[0] = max / sum of src[0, count). The shared
// temporary buffer must be 32-byte aligned (its contents are not modelled).
template <typename T>
inline void ReduceMax(const LocalTensor<T> &dst, const LocalTensor<T> &src, const LocalTensor<T> &tmp, int32_t count,
                      bool = false) {
  VecOp op("ReduceMax");
  op.In(src, count);
  if (!tmp.Aligned()) EmuFail("ReduceMax: temporary buffer not 32-byte aligned");
  const T *x = Raw(src, count);
  T m = x[0];
  for (int32_t i = 1; i < count; ++i) m = std::max(m, x[i]);
  op.Out(dst, 2)[0] = m;
}
template <typename T>
inline void ReduceSum(const LocalTensor<T> &dst, const LocalTensor<T> &src, const LocalTensor<T> &tmp, int32_t count) {
  VecOp op("ReduceSum");
  op.In(src, count);
  if (!tmp.Aligned()) EmuFail("ReduceSum: temporary buffer not 32-byte aligned");
  double s = 0;  // the hardware sums in a tree of float adds; a double sum is within its rounding
  const T *x = Raw(src, count);
  for (int32_t i = 0; i < count; ++i) s += x[i];
  op.Out(dst, 2)[0] = static_cast<T>(s);
}
// Gather.md: dst[i] = the element of src at byte offset offsets[i] (+ srcBaseAddr). Offsets are
// bytes and must be multiples of sizeof(T).
template <typename T>
inline void Gather(const LocalTensor<T> &dst, const LocalTensor<T> &src, const LocalTensor<uint32_t> &offsets,
                   uint32_t src_base, uint32_t count) {
  VecOp op("Gather");
  op.In(offsets, count);
  std::vector<T> r(count);
  for (uint32_t i = 0; i < count; ++i) {
    const uint32_t off = Raw(offsets, count)[i];
    if ((off + src_base) % sizeof(T)) EmuFail("Gather: offset not a multiple of the element size");
    const int64_t at = static_cast<int64_t>((off + src_base) / sizeof(T));
    op.In(src[0], at + 1);
    r[i] = Raw(src, at + 1)[at];
  }
  std::copy(r.begin(), r.end(), op.Out(dst, count));
}

// ------------------------------------------------------------------------------------------------
// SyncAll.md (hard sync, isAIVOnly): every vector core of the launch waits until all of them
// arrive. A core that returned instead never arrives: the hardware deadlocks, the emulation fails.
inline void FailLaunch() {
  Launch &l = TheLaunch();
  {
    std::lock_guard<std::mutex> lock(l.m);
    l.broken = true;
  }
  l.cv.notify_all();
  for (auto &mb : l.mailboxes) {
    std::lock_guard<std::mutex> lock(mb->m);
    mb->cv.notify_all();
  }
}
template <bool isAIVOnly = true>
inline void SyncAll() {
  CoreState &c = VectorCore("SyncAll<true> (vector cores only)");
  for (const GmWrite &w : c.gm_unsynced)
    if (w.seq > c.known[kS][kMTE3])
      EmuFail("SyncAll with this core's MTE3 GM writes (DataCopy UB->GM) not waited for: other cores may read them "
              "stale after the barrier; PipeBarrier<PIPE_ALL> (or SetFlag/WaitFlag<HardEvent::MTE3_S>) first");
  Launch &l = TheLaunch();
  std::unique_lock<std::mutex> lock(l.m);
  const int64_t gen = l.generation;
  if (++l.arrived == l.vector_cores) {
    l.arrived = 0;
    ++l.generation;
    l.cv.notify_all();
    return;
  }
  l.cv.notify_all();
  while (l.generation == gen) {
    if (l.broken) EmuFail("SyncAll: another core failed");
    if (l.arrived + l.finished >= l.vector_cores)
      EmuFail("SyncAll: " + std::to_string(l.finished) + " of " + std::to_string(l.vector_cores) +
              " vector cores returned without reaching it: on hardware every core waits forever (SyncAll.md: call "
              "it on idle cores too)");
    l.cv.wait_for(lock, std::chrono::milliseconds(50));
  }
}

// GetUserWorkspace.md: the workspace argument starts with the system part (the Matmul API's);
// the operator's own part follows it.
inline GM_ADDR GetUserWorkspace(GM_ADDR workspace) { return workspace + 16 * 1024 * 1024; }

}  // namespace AscendC

// kernel_operator_swap_mem_intf.h: a global function returning the system workspace the framework
// passed with the launch.
inline GM_ADDR GetSysWorkSpacePtr() { return AscendC::Core().sys_workspace; }

// KERNEL_TASK_TYPE_DEFAULT(type): the kernel's core mix. The emulation launches MIX 1:2 and records
// the declaration; REGIST_MATMUL_OBJ refuses a kernel that did not declare KERNEL_TYPE_MIX_AIC_1_2.
inline void EmuDeclareKernelType(KernelMetaType type) { AscendC::Core().kernel_type = type; }
#define KERNEL_TASK_TYPE_DEFAULT(type) EmuDeclareKernelType(type)

// REGISTER_TILING_DEFAULT.md / GET_TILING_DATA_WITH_STRUCT: the kernel's view of the host's tiling
// data (a plain struct).
#define REGISTER_TILING_DEFAULT(type)
#define GET_TILING_DATA_WITH_STRUCT(type, name, ptr) const type &name = *reinterpret_cast<const type *>(ptr)

// Kernel launch after ICPU_RUN_KF(kernel, blockDim, args...) for a MIX 1:2 kernel: blockDim AI
// cores, each a cube thread and two vector threads with their own UB; the first failure is rethrown
// after all joined.
template <typename... Args>
inline void EmuRunKernel(void (*kernel)(Args...), int64_t block_dim, GM_ADDR sys_workspace, Args... args) {
  using namespace AscendC;
  Launch &l = TheLaunch();
  l.vector_cores = 2 * block_dim;
  l.arrived = l.finished = l.generation = 0;
  l.broken = false;
  l.gm_lines.clear();
  l.mailboxes.clear();
  for (int64_t b = 0; b < block_dim; ++b) l.mailboxes.emplace_back(new Mailbox());
  std::mutex error_mutex;
  std::string error;
  std::vector<std::unique_ptr<CoreState>> cores;
  for (int64_t b = 0; b < block_dim; ++b)
    for (int64_t k = 0; k < 3; ++k) {
      std::unique_ptr<CoreState> c(new CoreState());
      c->aic = k == 0;
      c->ai_core = b;
      c->sub_block = k == 0 ? 0 : k - 1;
      c->block_idx = k == 0 ? b : 2 * b + (k - 1);
      c->block_num = block_dim;
      c->sys_workspace = sys_workspace;
      if (!c->aic) {
        c->ub.assign(kUbBytes, 0);
        c->ub_writer.assign(kUbBytes / kBlock + 1, BlockWrite());
      }
      cores.push_back(std::move(c));
    }
  std::vector<std::thread> threads;
  for (auto &c : cores) {
    CoreState *core = c.get();
    threads.emplace_back([&, core] {
      CorePtr() = core;
      try {
        kernel(args...);
      } catch (const std::exception &e) {
        {
          std::lock_guard<std::mutex> lock(error_mutex);
          if (error.empty()) error = (core->aic ? "cube core " : "vector core ") + std::to_string(core->block_idx) +
                                     ": " + e.what();
        }
        FailLaunch();
      }
      if (!core->aic) {
        Mailbox &mb = *l.mailboxes[core->ai_core];
        {
          std::lock_guard<std::mutex> lock(mb.m);
          if (!core->registered) ++mb.never_clients;
        }
        mb.cv.notify_all();
        {
          std::lock_guard<std::mutex> lock(l.m);
          ++l.finished;
        }
        l.cv.notify_all();
      }
      CorePtr() = nullptr;
    });
  }
  for (auto &t : threads) t.join();
  if (!error.empty()) throw std::runtime_error(error);
}
