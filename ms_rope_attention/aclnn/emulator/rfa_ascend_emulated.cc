// Runs op_kernel/ on the CPU through the AscendC emulation, behind the same C entry as the CPU
// kernel (RotaryFlashAttentionRun), so ms_rope_attention.cpu_direct and the float64 reference can
// drive it; and exposes the tiling (RfaAscendPlan) to the tiling unit tests.
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>

#include "kernel_operator.h"
#include "rotary_flash_attention_plan.h"

// What the CANN build provides around the kernel entry (new-style tiling data: a plain struct).
#define REGISTER_TILING_DEFAULT(type)
#define GET_TILING_DATA_WITH_STRUCT(type, name, ptr) const type &name = *reinterpret_cast<const type *>(ptr)

// The real entry file compiles here too (one dtype combination, renamed): the other combinations
// are instantiated directly below, as the CANN build does with its DTYPE_* macros.
#define DTYPE_QUERY float
#define DTYPE_COS float
#define rotary_flash_attention rotary_flash_attention_f32_f32
#include "rotary_flash_attention.cpp"
#undef rotary_flash_attention
#undef DTYPE_QUERY
#undef DTYPE_COS

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

template <typename T, typename TT>
void Entry(GM_ADDR q, GM_ADDR k, GM_ADDR v, GM_ADDR c, GM_ADDR s, GM_ADDR aq, GM_ADDR akv, GM_ADDR out, GM_ADDR lse,
           GM_ADDR rk, GM_ADDR ws, GM_ADDR tiling) {
  rfa::ascend::RotaryFlashAttentionKernel<T, TT> op;
  op.Init(q, k, v, c, s, aq, akv, out, lse, rk, ws, reinterpret_cast<const RotaryFlashAttentionTilingData *>(tiling));
  op.Process();
}

template <typename T>
Kernel ForTable(rfa::DType table) {
  switch (table) {
    case rfa::DType::F32: return Entry<T, float>;
    case rfa::DType::F16: return Entry<T, half>;
    default: return Entry<T, bfloat16_t>;
  }
}

Kernel Select(rfa::DType qkv, rfa::DType table) {
  switch (qkv) {
    case rfa::DType::F32: return ForTable<float>(table);
    case rfa::DType::F16: return ForTable<half>(table);
    default: return ForTable<bfloat16_t>(table);
  }
}

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
    static uint8_t empty[64];
    auto out_or_empty = [&](int i, bool on) { return on ? gm(i) : empty; };
    EmuRunKernel(Select(problem.qkv_dtype, problem.cos_dtype), tiling.rfa.core_num, gm(0), gm(1), gm(2), gm(3), gm(4),
                 params[5] ? gm(5) : empty, params[6] ? gm(6) : empty, gm(7), out_or_empty(8, attrs->with_lse),
                 out_or_empty(9, attrs->with_rotated_key), workspace.data(), reinterpret_cast<GM_ADDR>(&tiling));
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

// Breaks one hardware rule on purpose (tests: the emulation must refuse, naming the rule).
RFA_EXPORT int RfaEmulatorViolation(int which) {
  using namespace AscendC;
  try {
    Core().ub_used = 0;
    TPipe pipe;
    TQue<TPosition::VECIN, 1> que;
    TBuf<TPosition::VECCALC> buf;
    std::vector<float> gm_data(64);
    GlobalTensor<float> gm;
    gm.SetGlobalBuffer(gm_data.data(), gm_data.size());
    switch (which) {
      case 0: pipe.InitBuffer(buf, 200 * 1024); break;  // beyond the 192 KiB Unified Buffer
      case 1: {                                          // DataCopy of 7 floats (28 bytes)
        pipe.InitBuffer(buf, 1024);
        DataCopy(buf.Get<float>(), gm, 7);
        break;
      }
      case 2: {  // vector op on a tensor starting 4 bytes into a block
        pipe.InitBuffer(buf, 1024);
        LocalTensor<float> t = buf.Get<float>();
        Add(t[1], t[1], t[1], 8);
        break;
      }
      case 3: {  // a second AllocTensor from a one-buffer queue
        pipe.InitBuffer(que, 1, 256);
        que.AllocTensor<float>();
        que.AllocTensor<float>();
        break;
      }
      default: {  // read past the end of a GM buffer
        pipe.InitBuffer(buf, 1024);
        DataCopy(buf.Get<float>(), gm[32], 64);
        break;
      }
    }
    return Fail("no violation detected");
  } catch (const std::exception &e) {
    Fail(e.what());
    return 1;
  }
}
