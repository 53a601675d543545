// Runs op_kernel/ on the CPU through the AscendC emulation, behind the same C entries as the CPU
// kernel (RotaryFlashAttentionRun, RotaryFlashAttentionGradRun), so ms_rope_attention.cpu_direct and
// the float64 reference can drive them; and exposes the tilings (RfaAscendPlan, RfaAscendGradPlan) to
// the tiling unit tests.
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>

#include "kernel_operator.h"
#include "rotary_flash_attention_plan.h"

// The real entry files (forward and backward) compile here once per dtype combination, renamed, as
// the CANN build compiles them with their DTYPE_* macros: every emulated launch runs the entry itself
// (registration included).
#define DTYPE_QUERY float
#define DTYPE_COS float
#define rotary_flash_attention rfa_entry_f32_f32
#define rotary_flash_attention_grad rfa_grad_entry_f32_f32
#include "rotary_flash_attention.cpp"
#include "rotary_flash_attention_grad.cpp"
#undef rotary_flash_attention_grad
#undef rotary_flash_attention
#undef DTYPE_COS
#undef DTYPE_QUERY
#define DTYPE_QUERY float
#define DTYPE_COS half
#define rotary_flash_attention rfa_entry_f32_f16
#define rotary_flash_attention_grad rfa_grad_entry_f32_f16
#include "rotary_flash_attention.cpp"
#include "rotary_flash_attention_grad.cpp"
#undef rotary_flash_attention_grad
#undef rotary_flash_attention
#undef DTYPE_COS
#undef DTYPE_QUERY
#define DTYPE_QUERY float
#define DTYPE_COS bfloat16_t
#define rotary_flash_attention rfa_entry_f32_bf16
#define rotary_flash_attention_grad rfa_grad_entry_f32_bf16
#include "rotary_flash_attention.cpp"
#include "rotary_flash_attention_grad.cpp"
#undef rotary_flash_attention_grad
#undef rotary_flash_attention
#undef DTYPE_COS
#undef DTYPE_QUERY
#define DTYPE_QUERY half
#define DTYPE_COS float
#define rotary_flash_attention rfa_entry_f16_f32
#define rotary_flash_attention_grad rfa_grad_entry_f16_f32
#include "rotary_flash_attention.cpp"
#include "rotary_flash_attention_grad.cpp"
#undef rotary_flash_attention_grad
#undef rotary_flash_attention
#undef DTYPE_COS
#undef DTYPE_QUERY
#define DTYPE_QUERY half
#define DTYPE_COS half
#define rotary_flash_attention rfa_entry_f16_f16
#define rotary_flash_attention_grad rfa_grad_entry_f16_f16
#include "rotary_flash_attention.cpp"
#include "rotary_flash_attention_grad.cpp"
#undef rotary_flash_attention_grad
#undef rotary_flash_attention
#undef DTYPE_COS
#undef DTYPE_QUERY
#define DTYPE_QUERY half
#define DTYPE_COS bfloat16_t
#define rotary_flash_attention rfa_entry_f16_bf16
#define rotary_flash_attention_grad rfa_grad_entry_f16_bf16
#include "rotary_flash_attention.cpp"
#include "rotary_flash_attention_grad.cpp"
#undef rotary_flash_attention_grad
#undef rotary_flash_attention
#undef DTYPE_COS
#undef DTYPE_QUERY
#define DTYPE_QUERY bfloat16_t
#define DTYPE_COS float
#define rotary_flash_attention rfa_entry_bf16_f32
#define rotary_flash_attention_grad rfa_grad_entry_bf16_f32
#include "rotary_flash_attention.cpp"
#include "rotary_flash_attention_grad.cpp"
#undef rotary_flash_attention_grad
#undef rotary_flash_attention
#undef DTYPE_COS
#undef DTYPE_QUERY
#define DTYPE_QUERY bfloat16_t
#define DTYPE_COS half
#define rotary_flash_attention rfa_entry_bf16_f16
#define rotary_flash_attention_grad rfa_grad_entry_bf16_f16
#include "rotary_flash_attention.cpp"
#include "rotary_flash_attention_grad.cpp"
#undef rotary_flash_attention_grad
#undef rotary_flash_attention
#undef DTYPE_COS
#undef DTYPE_QUERY
#define DTYPE_QUERY bfloat16_t
#define DTYPE_COS bfloat16_t
#define rotary_flash_attention rfa_entry_bf16_bf16
#define rotary_flash_attention_grad rfa_grad_entry_bf16_bf16
#include "rotary_flash_attention.cpp"
#include "rotary_flash_attention_grad.cpp"
#undef rotary_flash_attention_grad
#undef rotary_flash_attention
#undef DTYPE_COS
#undef DTYPE_QUERY

#define RFA_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

std::mutex g_mutex;
std::string g_error;

int Fail(const std::string &message) {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_error = message;
  return 1;
}

using Kernel = void (*)(GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR,
                        GM_ADDR, GM_ADDR);

// The entries by dtype: rows query/key/value float32, float16, bfloat16; columns the table dtype.
const Kernel kEntries[3][3] = {{rfa_entry_f32_f32, rfa_entry_f32_f16, rfa_entry_f32_bf16},
                               {rfa_entry_f16_f32, rfa_entry_f16_f16, rfa_entry_f16_bf16},
                               {rfa_entry_bf16_f32, rfa_entry_bf16_f16, rfa_entry_bf16_bf16}};

Kernel Select(rfa::DType qkv, rfa::DType table) {
  return kEntries[static_cast<int>(qkv)][static_cast<int>(table)];
}

using GradKernel = void (*)(GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR,
                            GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR, GM_ADDR);

const GradKernel kGradEntries[3][3] = {
    {rfa_grad_entry_f32_f32, rfa_grad_entry_f32_f16, rfa_grad_entry_f32_bf16},
    {rfa_grad_entry_f16_f32, rfa_grad_entry_f16_f16, rfa_grad_entry_f16_bf16},
    {rfa_grad_entry_bf16_f32, rfa_grad_entry_bf16_f16, rfa_grad_entry_bf16_bf16}};

// An absent optional tensor (or an empty output) arrives as a valid pointer to nothing, as a launch
// would pass it; the kernels read only what the tiling says is there.
uint8_t g_empty[64];
GM_ADDR OrEmpty(void *p) { return p ? static_cast<GM_ADDR>(p) : g_empty; }

int64_t Cores() {
  const char *env = std::getenv("RFA_EMULATED_CORES");
  return env ? std::atoll(env) : 8;  // a few cores: every core-split path runs, in test time
}

}  // namespace

RFA_EXPORT const char *RotaryFlashAttentionLastError() { return g_error.c_str(); }

// Same signature as the CPU kernel's entry. rows/kv_block override the planned block sizes (> 0);
// pack_bytes is the CPU kernel's and must be <= 0; `rotate` must be 1 (the emulated kernel
// always applies RoPE).
RFA_EXPORT int RotaryFlashAttentionRun(const rfa::Attrs *attrs, int *ndims, int64_t **shapes, const char **dtypes,
                                       void **params, int64_t rows, int64_t kv_block, int64_t pack_bytes,
                                       int rotate) {
  try {
    if (!attrs) return Fail("attrs: null pointer");
    if (!rotate) return Fail("rotate: the emulated Ascend kernel always rotates");
    if (pack_bytes > 0) return Fail("pack_bytes: a CPU kernel tiling knob, not the Ascend kernel's");
    rfa::Problem problem;
    std::string err = rfa::ValidateCall(*attrs, ndims, shapes, dtypes, params, &problem);
    if (!err.empty()) return Fail(err);
    rfa::ascend::Platform platform;
    platform.vector_cores = Cores();
    RotaryFlashAttentionTilingData tiling{};
    err = rfa::ascend::PlanTiling(problem, platform, &tiling.rfa, rows, kv_block);
    if (!err.empty()) return Fail(err);
    std::vector<uint8_t> workspace(rfa::ascend::WorkspaceBytes(tiling.rfa, rfa::ascend::ElemBytes(problem.qkv_dtype)));
    auto gm = [&](int i) { return static_cast<GM_ADDR>(params[i]); };
    auto out_or_empty = [&](int i, bool on) { return on ? gm(i) : g_empty; };
    // MIX 1:2: blockDim AI cores carry 2 x blockDim vector cores for the tiling's core_num workers.
    const int64_t block_dim = (tiling.rfa.core_num + 1) / 2;
    EmuRunKernel(Select(problem.qkv_dtype, problem.cos_dtype), block_dim, workspace.data(), gm(0), gm(1), gm(2), gm(3), gm(4),
                 OrEmpty(params[5]), OrEmpty(params[6]), gm(7), out_or_empty(8, attrs->with_lse),
                 out_or_empty(9, attrs->with_rotated_key), workspace.data(), reinterpret_cast<GM_ADDR>(&tiling));
    return 0;
  } catch (const std::exception &e) {
    return Fail(e.what());
  }
}

// The backward, same signature as the CPU kernel's: block_q/block_k override the planned block sizes
// (> 0); splits is the CPU kernel's KV split and must be <= 0.
RFA_EXPORT int RotaryFlashAttentionGradRun(const rfa::Attrs *attrs, int *ndims, int64_t **shapes, const char **dtypes,
                                           void **params, int64_t block_q, int64_t block_k, int64_t splits) {
  try {
    if (!attrs) return Fail("attrs: null pointer");
    if (splits > 0) return Fail("splits: a CPU kernel tiling knob, not the Ascend kernel's");
    rfa::Problem problem;
    bool has_dlse = false, has_drk = false;
    std::string err = rfa::ValidateGradCall(*attrs, ndims, shapes, dtypes, params, &problem, &has_dlse, &has_drk);
    if (!err.empty()) return Fail(err);
    rfa::ascend::Platform platform;
    platform.vector_cores = Cores();
    RotaryFlashAttentionGradTilingData tiling{};
    err = rfa::ascend::PlanGradTiling(problem, platform, has_dlse, has_drk, &tiling.rfa, &tiling.grad, block_q, block_k);
    if (!err.empty()) return Fail(err);
    std::vector<uint8_t> workspace(rfa::ascend::GradWorkspaceBytes(tiling.grad));
    GM_ADDR gm[rfa::kGradInputs + rfa::kGradOutputs];
    for (int i = 0; i < rfa::kGradInputs + rfa::kGradOutputs; ++i) gm[i] = OrEmpty(params[i]);
    const int64_t block_dim = (tiling.grad.core_num + 1) / 2;
    EmuRunKernel(kGradEntries[static_cast<int>(problem.qkv_dtype)][static_cast<int>(problem.cos_dtype)], block_dim,
                 workspace.data(), gm[0], gm[1], gm[2], gm[3], gm[4], gm[5], gm[6], gm[7], gm[8], gm[9], gm[10], gm[11],
                 gm[12], gm[13], gm[14], workspace.data(), reinterpret_cast<GM_ADDR>(&tiling));
    return 0;
  } catch (const std::exception &e) {
    return Fail(e.what());
  }
}

// The backward's tiling and, per core, the (query row, visible key) pairs of its KV and Q tasks, for
// the tiling tests.
RFA_EXPORT int RfaAscendGradPlan(const rfa::Attrs *attrs, int *ndims, int64_t **shapes, const char **dtypes,
                                 void **params, int64_t cores, int64_t ub_bytes, int64_t block_q, int64_t block_kv,
                                 rfa::ascend::RfaTiling *out, rfa::ascend::RfaGradPlan *grad, int64_t *core_work,
                                 int64_t *workspace_bytes) {
  try {
    rfa::Problem p;
    std::string err = rfa::ValidateCall(*attrs, ndims, shapes, dtypes, params, &p);
    if (!err.empty()) return Fail(err);
    rfa::ascend::Platform platform{cores, ub_bytes};
    err = rfa::ascend::PlanGradTiling(p, platform, true, true, out, grad, block_q, block_kv);
    if (!err.empty()) return Fail(err);
    for (int64_t c = 0; c < cores; ++c) core_work[c] = 0;
    const bool causal = out->causal;
    rfa::ascend::ForEachGradTask(
        *out, *grad, [&](int64_t b, bool kv) { return kv ? p.kv_lens[b] : p.q_lens[b]; },
        [&](int64_t index, const rfa::ascend::GradTask &t) {
          const int64_t lq = p.q_lens[t.seq], lk = p.kv_lens[t.seq], q_off = lk - lq;
          int64_t pairs = 0;  // (query row, key it sees) pairs of the task's block, every head of it
          for (int64_t r = t.first; r < t.first + t.count; ++r) {
            if (t.kind == 0)  // key r: the queries at or past it
              pairs += out->group * (causal ? lq - std::min(lq, std::max<int64_t>(0, r - q_off)) : lq);
            else  // query r: the keys up to it
              pairs += causal ? q_off + r + 1 : lk;
          }
          core_work[rfa::ascend::CoreOfTask(index, cores)] += pairs;
          return true;
        });
    *workspace_bytes = rfa::ascend::GradWorkspaceBytes(*grad);
    return 0;
  } catch (const std::exception &e) {
    return Fail(e.what());
  }
}

// The tiling and, per core, the work it gets (query rows x keys visited), for the tiling tests.
RFA_EXPORT int RfaAscendPlan(const rfa::Attrs *attrs, int *ndims, int64_t **shapes, const char **dtypes,
                             void **params, int64_t cores, int64_t ub_bytes, int64_t block_q, int64_t block_kv,
                             rfa::ascend::RfaTiling *out, int64_t *core_work, int64_t *workspace_bytes) {
  try {
    rfa::Problem p;
    std::string err = rfa::ValidateCall(*attrs, ndims, shapes, dtypes, params, &p);
    if (!err.empty()) return Fail(err);
    rfa::ascend::Platform platform{cores, ub_bytes};
    err = rfa::ascend::PlanTiling(p, platform, out, block_q, block_kv);
    if (!err.empty()) return Fail(err);
    for (int64_t c = 0; c < cores; ++c) core_work[c] = 0;
    rfa::ascend::ForEachTask(*out, [&](int64_t b) { return p.q_lens[b]; },
                             [&](int64_t index, const rfa::ascend::Task &t) {
                               const int64_t lq = p.q_lens[t.seq], lk = p.kv_lens[t.seq];
                               const int64_t keys = out->causal ? lk - lq + t.q0 + t.nq : lk;
                               core_work[rfa::ascend::CoreOfTask(index, cores)] += t.nq * keys * out->group;
                               return true;
                             });
    *workspace_bytes = rfa::ascend::WorkspaceBytes(*out, rfa::ascend::ElemBytes(p.qkv_dtype));
    return 0;
  } catch (const std::exception &e) {
    return Fail(e.what());
  }
}

// ------------------------------------------------------------------------------------------------
// The emulation's rules, each fed the faulty pattern it must refuse (tests/test_ascend.py). Case -1
// runs the same patterns written correctly and must pass: the rules are not refusing everything.
namespace violation {

using namespace AscendC;
using Mm = matmul::Matmul<matmul::MatmulType<TPosition::GM, CubeFormat::ND, float>,
                          matmul::MatmulType<TPosition::GM, CubeFormat::ND, float>,
                          matmul::MatmulType<TPosition::VECIN, CubeFormat::ND, float>,
                          matmul::MatmulType<TPosition::GM, CubeFormat::ND, float>>;
using MmTransposedA = matmul::Matmul<matmul::MatmulType<TPosition::GM, CubeFormat::ND, float, true>,
                                     matmul::MatmulType<TPosition::GM, CubeFormat::ND, float>,
                                     matmul::MatmulType<TPosition::VECIN, CubeFormat::ND, float>,
                                     matmul::MatmulType<TPosition::GM, CubeFormat::ND, float>>;

int g_case = 0;
std::vector<float> g_gm(4096);
AscendC::tiling::TCubeTiling g_tiling{};

// One vector core (0) runs single-core patterns; the cube core and vector core 1 stay out.
bool OnlyVector0() { return !Core().aic && GetBlockIdx() == 0; }

void SingleCore(int which) {
  TPipe pipe;
  TBuf<TPosition::VECCALC> buf;
  TQue<TPosition::VECIN, 1> que;
  GlobalTensor<float> gm;
  gm.SetGlobalBuffer(g_gm.data(), g_gm.size());
  if (which == 0) pipe.InitBuffer(buf, 200 * 1024);  // beyond the UB
  if (which == 15) pipe.InitBuffer(buf, 192 * 1024);  // 256 bytes more than an A2 vector core has
  pipe.InitBuffer(buf, 4096);
  LocalTensor<float> t = buf.Get<float>();
  switch (which) {
    case 1: DataCopy(t, gm, 7); break;                           // 28 bytes
    case 2: Add(t[1], t[1], t[1], 8); break;                     // 4 bytes into a block
    case 3: {                                                    // a second AllocTensor from a one-buffer queue
      pipe.InitBuffer(que, 1, 256);
      que.AllocTensor<float>();
      que.AllocTensor<float>();
      break;
    }
    case 4: DataCopy(t, gm[4064], 64); break;                    // past the end of GM
    case 5: Duplicate(t, 1.0f, 64); DataCopy(gm, t, 64); break;  // V -> MTE3 through a TBuf, no V_MTE3
    case 6: Duplicate(t, 1.0f, 64); (void)t.GetValue(3); break;  // V -> S, no V_S
    case 7: WaitFlag<HardEvent::V_S>(0); break;                  // no SetFlag: hangs
    case 8: {                                                    // MTE3 still reading while V overwrites
      Duplicate(t, 1.0f, 64);
      SetFlag<HardEvent::V_MTE3>(0);
      WaitFlag<HardEvent::V_MTE3>(0);
      DataCopy(gm, t, 64);
      Duplicate(t, 2.0f, 64);
      break;
    }
    case 11: {  // float -> bfloat16 with CAST_NONE
      LocalTensor<bfloat16_t> h = t[512].ReinterpretCast<bfloat16_t>();
      Cast(h, t, RoundMode::CAST_NONE, 16);
      break;
    }
    case 12: {  // half -> float with CAST_RINT
      LocalTensor<half> h = t[512].ReinterpretCast<half>();
      Cast(t, h, RoundMode::CAST_RINT, 16);
      break;
    }
    case -1: {  // the same data flows, synchronised
      Duplicate(t, 1.0f, 64);
      SetFlag<HardEvent::V_MTE3>(0);
      WaitFlag<HardEvent::V_MTE3>(0);
      DataCopy(gm, t, 64);
      SetFlag<HardEvent::MTE3_V>(1);
      WaitFlag<HardEvent::MTE3_V>(1);
      Duplicate(t, 2.0f, 64);
      SetFlag<HardEvent::V_S>(2);
      WaitFlag<HardEvent::V_S>(2);
      if (t.GetValue(3) != 2.0f) EmuFail("control case computed the wrong value");
      pipe.InitBuffer(que, 1, 256);
      LocalTensor<float> in = que.AllocTensor<float>();
      DataCopy(in, gm, 64);
      que.EnQue(in);
      in = que.DeQue<float>();
      Add(t, in, in, 64);
      que.FreeTensor(in);
      Cast(t[512].ReinterpretCast<half>(), t, RoundMode::CAST_RINT, 16);
      break;
    }
    default: break;
  }
}

// Matmul / MIX patterns: the kernel entry of a one-AI-core launch.
struct Op {
  Mm mm, mm2;
  TBuf<TPosition::VECIN> c_buf;
  GlobalTensor<float> a, b;
  void Init(TPipe *pipe) {
    pipe->InitBuffer(c_buf, 1024);
    a.SetGlobalBuffer(g_gm.data(), 64);
    b.SetGlobalBuffer(g_gm.data() + 64, 64);
    mm.SetOrgShape(8, 8, 8);
    mm2.SetOrgShape(8, 8, 8);
  }
  void InitRegistering(TPipe *pipe) {  // registration inside Init: the old kernel's pattern
    REGIST_MATMUL_OBJ(pipe, GetSysWorkSpacePtr(), mm, &g_tiling, mm2, &g_tiling);
    Init(pipe);
  }
  void Multiply(Mm &m) {
    m.SetTensorA(a);
    m.SetTensorB(b);
    m.IterateAll(c_buf.Get<float>());
  }
};

void Mix(int which) {
  if (which != 23) KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_MIX_AIC_1_2);
  TPipe pipe;
  Op op;
  if (which == 20) {  // registration inside Init
    op.InitRegistering(&pipe);
    op.Multiply(op.mm);
    return;
  }
  if (which == -3 || which == 26) {  // C = A B with A given transposed, as (K, M) rows
    MmTransposedA mm;
    REGIST_MATMUL_OBJ(&pipe, GetSysWorkSpacePtr(), mm, &g_tiling);
    TBuf<TPosition::VECIN> c_buf;
    pipe.InitBuffer(c_buf, 256);
    for (int i = 0; i < 6; ++i) g_gm[i] = static_cast<float>(i + 1);       // A^T = [[1, 2, 3], [4, 5, 6]]
    for (int i = 0; i < 4; ++i) g_gm[64 + i] = static_cast<float>(i + 1);  // B = [[1, 2], [3, 4]]
    GlobalTensor<float> a, b;
    a.SetGlobalBuffer(g_gm.data(), 6);
    b.SetGlobalBuffer(g_gm.data() + 64, 4);
    mm.SetOrgShape(3, 2, 2);
    mm.SetTensorA(a, which == -3);  // 26: the flag contradicts the MatmulType
    mm.SetTensorB(b);
    LocalTensor<float> c = c_buf.Get<float>();
    mm.IterateAll(c);
    mm.End();
    PipeBarrier<PIPE_ALL>();
    // A = [[1, 4], [2, 5], [3, 6]]: C = [[13, 18], [17, 24], [21, 30]].
    if (c.GetValue(0) != 13.0f || c.GetValue(1) != 18.0f || c.GetValue(2) != 17.0f || c.GetValue(5) != 30.0f)
      EmuFail("control case computed the wrong value");
    return;
  }
  if (which == 22) {  // InitBuffer before the registration
    op.Init(&pipe);
    REGIST_MATMUL_OBJ(&pipe, GetSysWorkSpacePtr(), op.mm, &g_tiling, op.mm2, &g_tiling);
    return;
  }
  REGIST_MATMUL_OBJ(&pipe, GetSysWorkSpacePtr(), op.mm, &g_tiling, op.mm2, &g_tiling);
  op.Init(&pipe);
  GlobalTensor<float> gm;
  gm.SetGlobalBuffer(g_gm.data(), g_gm.size());
  switch (which) {
    case 21: {  // the cube reads A this core just wrote, unfenced
      TBuf<TPosition::VECCALC> buf;
      pipe.InitBuffer(buf, 256);
      Duplicate(buf.Get<float>(), 1.0f, 64);
      SetFlag<HardEvent::V_MTE3>(0);
      WaitFlag<HardEvent::V_MTE3>(0);
      DataCopy(gm, buf.Get<float>(), 64);
      op.Multiply(op.mm);
      break;
    }
    case 24:  // two objects alternating without End()
      op.Multiply(op.mm);
      op.Multiply(op.mm2);
      break;
    case -2:  // control: registered in the entry, End() between objects, C fenced before the scalar
      op.Multiply(op.mm);
      op.mm.End();
      op.Multiply(op.mm2);
      op.mm2.End();
      PipeBarrier<PIPE_ALL>();
      op.c_buf.Get<float>().SetValue(0, 0.0f);
      break;
    case 25:  // the scalar unit writes C (a mask) right after IterateAll, unfenced
      op.Multiply(op.mm);
      op.mm.End();
      op.c_buf.Get<float>().SetValue(0, 0.0f);
      break;
    default: break;
  }
}

void Kernel(GM_ADDR) {
  const int which = g_case;
  if (which >= 20 || which == -2 || which == -3) return Mix(which);
  if (which == 9) {  // neighbouring floats of one 64-byte line, scalar-written by two cores
    if (Core().aic) return;
    GlobalTensor<float> gm;
    gm.SetGlobalBuffer(g_gm.data(), g_gm.size());
    gm.SetValue(GetBlockIdx(), 1.0f);
    return;
  }
  if (which == 10 || which == 13) {  // SyncAll that vector core 1 never reaches; one with MTE3 in flight
    if (Core().aic) return;
    if (which == 10 && GetBlockIdx() == 1) return;
    if (which == 13) {
      TPipe pipe;
      TBuf<TPosition::VECCALC> buf;
      pipe.InitBuffer(buf, 256);
      Duplicate(buf.Get<float>(), 1.0f, 64);
      SetFlag<HardEvent::V_MTE3>(0);
      WaitFlag<HardEvent::V_MTE3>(0);
      GlobalTensor<float> gm;
      gm.SetGlobalBuffer(g_gm.data() + 128 * GetBlockIdx(), 64);
      DataCopy(gm, buf.Get<float>(), 64);
    }
    SyncAll();
    return;
  }
  if (which == 14) {  // a vector instruction on the cube core
    TPipe pipe;
    TBuf<TPosition::VECCALC> buf;
    pipe.InitBuffer(buf, 256);
    return;
  }
  if (OnlyVector0()) SingleCore(which);
}

}  // namespace violation

RFA_EXPORT int RfaEmulatorViolation(int which) {
  try {
    violation::g_case = which;
    std::vector<uint8_t> sys(64);
    EmuRunKernel(violation::Kernel, 1, sys.data(), sys.data());
    return which < 0 ? 0 : Fail("no violation detected");
  } catch (const std::exception &e) {
    Fail(e.what());
    return 1;
  }
}
