// CPU emulation of the Ascend C high-level Matmul API subset the kernel uses (Matmul-Kernel侧接口:
// MatmulType, REGIST_MATMUL_OBJ, SetOrgShape.md, SetTensorA.md, SetTensorB.md, SetTail.md,
// IterateAll.md, End.md). Semantics assumed, for ND row-major matrices:
//   C[m, n] = sum_k A[m, k] * B[k, n]  (B given transposed, i.e. as (N, K) rows, when isTransposeB),
//   computed in float32 from A/B of type half, bfloat16_t or float (the cube accumulates in fp32 in L0C).
//   SetOrgShape(M, N, K) gives the full matrices: A is M x K (row stride K), B is K x N or N x K
//   (row stride N or K), C is M x N with row stride N. SetTail(m, n, k) shrinks the computed block to
//   the top-left m x n over the first k. IterateAll writes C to a UB LocalTensor (VECCALC) or GM.
// The TCubeTiling argument is accepted and not interpreted (the host fills it with
// matmul_tiling::MatmulApiTiling on a real device).
#pragma once
#include "../kernel_operator.h"

struct TCubeTiling {
  int32_t usedCoreNum = 1, M = 0, N = 0, Ka = 0, Kb = 0;
};

enum class CubeFormat { ND, NZ };

namespace matmul {

template <AscendC::TPosition POS, CubeFormat FORMAT, typename T, bool TRANSPOSE = false>
struct MatmulType {
  using Type = T;
  static constexpr bool kTranspose = TRANSPOSE;
};

template <typename A, typename B, typename C>
class Matmul {
  using TA = typename A::Type;
  using TB = typename B::Type;
  using TC = typename C::Type;

 public:
  void Init(const TCubeTiling *) {}
  void SetOrgShape(int m, int n, int k) {
    org_m_ = m;
    org_n_ = n;
    org_k_ = k;
    SetTail(m, n, k);
  }
  void SetTensorA(const AscendC::GlobalTensor<TA> &a, bool transpose = false) {
    if (transpose) AscendC::EmuFail("Matmul: transposed A is not used by this kernel");
    a_ = a;
  }
  void SetTensorB(const AscendC::GlobalTensor<TB> &b, bool transpose = false) {
    b_ = b;
    trans_b_ = transpose;
  }
  void SetTail(int m = -1, int n = -1, int k = -1) {
    m_ = m < 0 ? org_m_ : m;
    n_ = n < 0 ? org_n_ : n;
    k_ = k < 0 ? org_k_ : k;
    if (m_ > org_m_ || n_ > org_n_ || k_ > org_k_) AscendC::EmuFail("Matmul::SetTail beyond SetOrgShape");
  }
  template <bool sync = true>
  void IterateAll(const AscendC::LocalTensor<TC> &c, uint8_t = 0) {
    if (!c.Aligned()) AscendC::EmuFail("Matmul::IterateAll: C not 32-byte aligned in the UB");
    Compute([&](int64_t i, int64_t j, float v) { c.SetValue(i * org_n_ + j, static_cast<TC>(v)); });
  }
  template <bool sync = true>
  void IterateAll(const AscendC::GlobalTensor<TC> &c, uint8_t = 0, bool = false, bool = false, bool = false) {
    AscendC::GlobalTensor<TC> out = c;
    Compute([&](int64_t i, int64_t j, float v) { out.SetValue(i * org_n_ + j, static_cast<TC>(v)); });
  }
  void End() {}

 private:
  template <typename Store>
  void Compute(Store store) {
    ++AscendC::Core().barriers;
    for (int64_t i = 0; i < m_; ++i)
      for (int64_t j = 0; j < n_; ++j) {
        float acc = 0.f;
        for (int64_t k = 0; k < k_; ++k) {
          const float a = AscendC::ToFloat(a_.GetValue(i * org_k_ + k));
          const float b = AscendC::ToFloat(trans_b_ ? b_.GetValue(j * org_k_ + k) : b_.GetValue(k * org_n_ + j));
          acc += a * b;
        }
        store(i, j, acc);
      }
  }
  AscendC::GlobalTensor<TA> a_;
  AscendC::GlobalTensor<TB> b_;
  bool trans_b_ = false;
  int64_t org_m_ = 0, org_n_ = 0, org_k_ = 0, m_ = 0, n_ = 0, k_ = 0;
};

}  // namespace matmul

// REGIST_MATMUL_OBJ(pipe, workspace, mm1, tiling1, mm2, tiling2, ...): binds matmul objects to the
// pipe and the system workspace (MIX mode: the vector core drives the cube through messages).
inline void EmuRegisterMatmul(AscendC::TPipe *, GM_ADDR) {}
template <typename M, typename... Rest>
inline void EmuRegisterMatmul(AscendC::TPipe *pipe, GM_ADDR ws, M &mm, const TCubeTiling *tiling, Rest &&...rest) {
  mm.Init(tiling);
  EmuRegisterMatmul(pipe, ws, rest...);
}
#define REGIST_MATMUL_OBJ(pipe, workspace, ...) EmuRegisterMatmul(pipe, workspace, __VA_ARGS__)
