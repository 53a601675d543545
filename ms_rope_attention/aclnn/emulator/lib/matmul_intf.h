// CPU emulation of the Ascend C high-level Matmul API subset the kernel uses (Matmul-Kernel侧接口:
// MatmulType, REGIST_MATMUL_OBJ, SetOrgShape.md, SetTensorA.md, SetTensorB.md, SetTail.md,
// IterateAll.md, End.md), with the MIX-mode structure of the real one:
//   - REGIST_MATMUL_OBJ (asc-devkit impl/adv_api/detail/kfc/kfc_register_obj.h) on the cube core
//     runs the matmul server until both of its vector cores' clients quit, then `return`s from the
//     enclosing function; on a vector core it declares a *local* KFC client whose destructor tells
//     the server to quit. So it belongs in the kernel entry, before Init / InitBuffer: inside Init,
//     the client dies when Init returns (the next IterateAll fails here, hangs on hardware) and the
//     cube core goes on into Process (its first vector instruction fails here).
//   - IterateAll on a vector core sends the request to its cube core's server thread and waits
//     (with a timeout instead of a hang); the cube reads A and B from GM and writes C into the
//     vector core's UB (C at VECIN) or GM.
//   - A2 positions: C at GM, VECIN or CO1; bias (type defaults to C's) at GM or VECOUT (compile-time).
//   - End(): an object's IterateAll must be ended before another object of the core iterates.
// Semantics, for ND row-major matrices: C[m, n] = sum_k A[m, k] * B[k, n] (A given as (K, M) rows,
// B as (N, K) rows when transposed: SetTensorA/SetTensorB's flag must match the MatmulType), in
// float32 from half / bfloat16_t / float inputs (the cube accumulates in fp32).
// SetOrgShape(M, N, K) gives the full matrices (row strides K, N or K, and N); SetTail(m, n, k)
// shrinks the computed block to the top-left m x n over the first k.
#pragma once
#include "../kernel_operator.h"
#include "kernel_tiling/kernel_tiling.h"

enum class CubeFormat { ND, NZ };

namespace matmul {

template <AscendC::TPosition POS, CubeFormat FORMAT, typename T, bool TRANSPOSE = false>
struct MatmulType {
  using Type = T;
  static constexpr AscendC::TPosition kPos = POS;
  static constexpr bool kTranspose = TRANSPOSE;
};

}  // namespace matmul

namespace AscendC {

// What a vector core's Matmul objects are bound to: the client REGIST_MATMUL_OBJ declared.
struct KfcLink {
  bool alive = true;
  Mailbox *mailbox = nullptr;
};

class MatmulBase {
 public:
  void BindClient(const std::shared_ptr<KfcLink> &link) { link_ = link; }

 protected:
  // Runs `work` on this vector core's cube core and waits for it.
  void OnCube(std::function<void()> work) const {
    if (!link_) EmuFail("Matmul used without REGIST_MATMUL_OBJ");
    if (!link_->alive)
      EmuFail("Matmul IterateAll after the KFC client declared by REGIST_MATMUL_OBJ went out of scope (it is a local "
              "object: REGIST_MATMUL_OBJ must be in the kernel entry, not in Init); on hardware this hangs");
    Mailbox &mb = *link_->mailbox;
    std::string error;
    bool done = false;
    std::function<void()> request = [&] {
      try {
        work();
      } catch (const std::exception &e) {
        error = e.what();
      }
      done = true;
    };
    std::unique_lock<std::mutex> lock(mb.m);
    if (mb.server_gone) EmuFail("Matmul IterateAll after the cube core's server quit; on hardware this hangs");
    mb.requests.push_back(&request);
    mb.cv.notify_all();
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(TheLaunch().timeout_s);
    while (!done) {
      if (TheLaunch().broken) EmuFail("Matmul: another core failed");
      if (std::chrono::steady_clock::now() > deadline)
        EmuFail("Matmul IterateAll: the cube core did not answer (a hang on hardware)");
      mb.cv.wait_for(lock, std::chrono::milliseconds(20));
    }
    if (!error.empty()) EmuFail("cube core: " + error);
  }
  std::shared_ptr<KfcLink> link_;
};

}  // namespace AscendC

namespace matmul {

template <typename A, typename B, typename C, typename BIAS = MatmulType<C::kPos, CubeFormat::ND, typename C::Type>>
class Matmul : public AscendC::MatmulBase {
  using TA = typename A::Type;
  using TB = typename B::Type;
  using TC = typename C::Type;
  static_assert(C::kPos == AscendC::TPosition::GM || C::kPos == AscendC::TPosition::VECIN ||
                    C::kPos == AscendC::TPosition::CO1,
                "Matmul C: Atlas A2 puts C at GM, VECIN or CO1 (Matmul使用说明, MatmulType)");
  static_assert(BIAS::kPos == AscendC::TPosition::GM || BIAS::kPos == AscendC::TPosition::VECOUT,
                "Matmul bias: its type defaults to C's; Atlas A2 takes a bias at GM or VECOUT only: declare it");

 public:
  void Init(const AscendC::tiling::TCubeTiling *) {}
  void SetOrgShape(int m, int n, int k) {
    org_m_ = m;
    org_n_ = n;
    org_k_ = k;
    SetTail(m, n, k);
  }
  void SetTensorA(const AscendC::GlobalTensor<TA> &a, bool transpose = false) {
    if (transpose != A::kTranspose) AscendC::EmuFail("Matmul::SetTensorA: transpose differs from the MatmulType");
    a_ = a;
  }
  void SetTensorB(const AscendC::GlobalTensor<TB> &b, bool transpose = false) {
    if (transpose != B::kTranspose) AscendC::EmuFail("Matmul::SetTensorB: transpose differs from the MatmulType");
    b_ = b;
  }
  void SetTail(int m = -1, int n = -1, int k = -1) {
    m_ = m < 0 ? org_m_ : m;
    n_ = n < 0 ? org_n_ : n;
    k_ = k < 0 ? org_k_ : k;
    if (m_ > org_m_ || n_ > org_n_ || k_ > org_k_) AscendC::EmuFail("Matmul::SetTail beyond SetOrgShape");
  }
  template <bool sync = true>
  void IterateAll(const AscendC::LocalTensor<TC> &c, uint8_t = 0) {
    static_assert(sync, "the emulation models the synchronous IterateAll only");
    AscendC::CoreState &core = Begin();
    if (c.Position() != C::kPos) AscendC::EmuFail("Matmul::IterateAll: C tensor's position differs from the MatmulType");
    if (!c.Aligned()) AscendC::EmuFail("Matmul::IterateAll: C not 32-byte aligned in the UB");
    TC *out = c.At(0, static_cast<int64_t>(m_) * org_n_);  // resolved on the vector core: the cube writes its UB
    OnCube([&] { Compute([&](int64_t i, int64_t j, float v) { out[i * org_n_ + j] = static_cast<TC>(v); }); });
    // IterateAll<true> returns once the cube has answered, but no document says C is then visible
    // to this core's scalar unit or vector pipe: the client's copy of C into the UB is modelled as
    // an asynchronous MTE2 write, so touching C needs a fence (PipeBarrier<PIPE_ALL>, or
    // SetFlag/WaitFlag MTE2 -> S / MTE2 -> V).
    AscendC::RecordWrite(AscendC::kMTE2, AscendC::Issue(AscendC::kMTE2), c.Byte(0),
                         static_cast<int64_t>(m_) * org_n_ * sizeof(TC), "Matmul::IterateAll (C into the UB)");
    (void)core;
  }
  void End() {
    AscendC::CoreState &core = AscendC::Core();
    if (core.active_matmul == this) core.active_matmul = nullptr;
  }

 private:
  // The request is sent by the scalar unit: the GM it makes the cube read must be written already.
  AscendC::CoreState &Begin() {
    AscendC::CoreState &core = AscendC::VectorCore("Matmul::IterateAll");
    if (core.active_matmul != nullptr && core.active_matmul != this)
      AscendC::EmuFail("Matmul::IterateAll while another Matmul object of this core has not called End() (End.md)");
    core.active_matmul = this;
    const uintptr_t a_lo = reinterpret_cast<uintptr_t>(a_.At(0, 0));
    const uintptr_t a_hi = a_lo + static_cast<uintptr_t>(A::kTranspose ? k_ * org_m_ : m_ * org_k_) * sizeof(TA);
    const uintptr_t b_lo = reinterpret_cast<uintptr_t>(b_.At(0, 0));
    const uintptr_t b_hi = b_lo + static_cast<uintptr_t>(org_n_) * org_k_ * sizeof(TB);
    for (const AscendC::GmWrite &w : core.gm_unsynced)
      if (w.seq > core.known[AscendC::kS][AscendC::kMTE3] &&
          ((w.lo < a_hi && a_lo < w.hi) || (w.lo < b_hi && b_lo < w.hi)))
        AscendC::EmuFail("Matmul::IterateAll: the cube reads GM this core's MTE3 wrote (DataCopy UB->GM) before the "
                         "scalar pipe waited for it (PipeBarrier<PIPE_ALL> or SetFlag/WaitFlag<HardEvent::MTE3_S>)");
    return core;
  }
  template <typename Store>
  void Compute(Store store) {
    for (int64_t i = 0; i < m_; ++i)
      for (int64_t j = 0; j < n_; ++j) {
        float acc = 0.f;
        for (int64_t k = 0; k < k_; ++k) {
          const float a = AscendC::ToFloat(A::kTranspose ? a_.GetValue(k * org_m_ + i) : a_.GetValue(i * org_k_ + k));
          const float b = AscendC::ToFloat(B::kTranspose ? b_.GetValue(j * org_k_ + k) : b_.GetValue(k * org_n_ + j));
          acc += a * b;
        }
        store(i, j, acc);
      }
  }
  AscendC::GlobalTensor<TA> a_;
  AscendC::GlobalTensor<TB> b_;
  int64_t org_m_ = 0, org_n_ = 0, org_k_ = 0, m_ = 0, n_ = 0, k_ = 0;
};

}  // namespace matmul

// ------------------------------------------------------------------------------------------------
// REGIST_MATMUL_OBJ(pipe, workspace, mm1, tiling1, mm2, tiling2, ...).
inline void EmuBind(const std::shared_ptr<AscendC::KfcLink> &) {}
template <typename M, typename... Rest>
inline void EmuBind(const std::shared_ptr<AscendC::KfcLink> &link, M &mm, const AscendC::tiling::TCubeTiling *tiling,
                    Rest &&...rest) {
  mm.Init(tiling);
  mm.BindClient(link);
  EmuBind(link, rest...);
}

// Checks common to both core types, then (cube core) serves its vector cores' requests until both
// clients quit; the macro then returns from the enclosing function.
inline void EmuRegisterCheck(AscendC::TPipe *pipe, GM_ADDR workspace) {
  AscendC::CoreState &core = AscendC::Core();
  if (core.kernel_type != KERNEL_TYPE_MIX_AIC_1_2)
    AscendC::EmuFail("REGIST_MATMUL_OBJ in a kernel that did not declare KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_MIX_AIC_1_2) "
                     "(the Matmul API and SyncAll in this kernel assume 1 cube : 2 vector cores)");
  if (pipe == nullptr || workspace == nullptr) AscendC::EmuFail("REGIST_MATMUL_OBJ: null TPipe or system workspace");
  if (!core.aic && core.ub_used != 0)
    AscendC::EmuFail("REGIST_MATMUL_OBJ after TPipe::InitBuffer: register the Matmul objects first "
                     "(REGIST_MATMUL_OBJ.md), in the kernel entry");
}
inline void EmuServeCube() {
  using namespace AscendC;
  Mailbox &mb = *TheLaunch().mailboxes[Core().ai_core];
  std::unique_lock<std::mutex> lock(mb.m);
  mb.serving = true;
  auto idle_since = std::chrono::steady_clock::now();
  for (;;) {
    if (TheLaunch().broken) return;
    if (!mb.requests.empty()) {
      std::function<void()> *request = mb.requests.front();
      mb.requests.pop_front();
      (*request)();
      mb.cv.notify_all();
      idle_since = std::chrono::steady_clock::now();
      continue;
    }
    if (mb.quits + mb.never_clients >= 2) {
      mb.server_gone = true;
      mb.cv.notify_all();
      if (mb.never_clients > 0)
        EmuFail("cube server: a vector core ended without a KFC client, so the server never gets its quit "
                "message (a hang on hardware): REGIST_MATMUL_OBJ must run on every vector core");
      return;
    }
    if (std::chrono::steady_clock::now() - idle_since > std::chrono::duration<double>(TheLaunch().timeout_s))
      EmuFail("cube server: no request and no quit for the launch timeout (a hang on hardware)");
    mb.cv.wait_for(lock, std::chrono::milliseconds(20));
  }
}

// The vector core's client: a local object; its end of scope is the quit message.
class EmuKfcClient {
 public:
  template <typename... Objs>
  explicit EmuKfcClient(Objs &&...objs) : link_(new AscendC::KfcLink()) {
    AscendC::CoreState &core = AscendC::Core();
    link_->mailbox = AscendC::TheLaunch().mailboxes[core.ai_core].get();
    core.registered = true;
    EmuBind(link_, objs...);
  }
  ~EmuKfcClient() {
    link_->alive = false;
    AscendC::Mailbox &mb = *link_->mailbox;
    std::lock_guard<std::mutex> lock(mb.m);
    ++mb.quits;
    mb.cv.notify_all();
  }
  EmuKfcClient(const EmuKfcClient &) = delete;
  EmuKfcClient &operator=(const EmuKfcClient &) = delete;

 private:
  std::shared_ptr<AscendC::KfcLink> link_;
};

#define REGIST_MATMUL_OBJ(tpipe, workspace, ...) \
  EmuRegisterCheck(tpipe, workspace);            \
  if (AscendC::Core().aic) {                     \
    EmuServeCube();                              \
    return;                                      \
  }                                              \
  EmuKfcClient emu_kfc_client_(__VA_ARGS__)
