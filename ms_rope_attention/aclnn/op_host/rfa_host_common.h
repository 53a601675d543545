// What the host sides of the two ops (rotary_flash_attention.cpp, rotary_flash_attention_grad.cpp)
// share: attributes, dtype names, the Matmul API tiling of one block product, the tensor descriptions
// in the aot form rfa_problem.h validates, the system-workspace check and the launch settings.
// The msopgen template compiles every op_host/*.cpp into the same libraries, so everything here is
// inline (one definition for both files) and in namespace rfa::host.
#pragma once
#include <cstdio>
#include <string>
#include <vector>

#include "register/op_def_registry.h"
#include "tiling/platform/platform_ascendc.h"
#include "tiling/tiling_api.h"

#include "rfa_problem.h"
#include "rotary_flash_attention_plan.h"

namespace rfa {
namespace host {

// Attribute indices in OpDef (= op_info) order, the same in both ops; tests/test_op_info.py checks the order.
enum AttrIndex {
  kHeadNum, kInputLayout, kRotaryMode, kRotaryDim, kScale, kCausal, kWithSoftmaxLse, kWithRotatedKey, kKeyRotated,
  kComputeDtype
};

inline Attrs ReadAttrs(const gert::RuntimeAttrs *attrs, std::string *error) {
  Attrs a;
  a.head_num = *attrs->GetAttrPointer<int64_t>(kHeadNum);
  const std::string layout = attrs->GetAttrPointer<char>(kInputLayout);
  if (!ParseLayout(layout, &a.layout)) *error = "input_layout: expected BNSD, BSND, BSH or TND, got " + layout;
  a.rotary_mode = *attrs->GetAttrPointer<int64_t>(kRotaryMode);
  a.rotary_dim = *attrs->GetAttrPointer<int64_t>(kRotaryDim);
  a.scale = *attrs->GetAttrPointer<float>(kScale);
  a.causal = *attrs->GetAttrPointer<bool>(kCausal);
  a.with_lse = *attrs->GetAttrPointer<bool>(kWithSoftmaxLse);
  a.with_rotated_key = *attrs->GetAttrPointer<bool>(kWithRotatedKey);
  a.key_rotated = *attrs->GetAttrPointer<bool>(kKeyRotated);
  // The cube units compute Q K^T and P V in the inputs' dtype with float32 accumulation: that is
  // "auto" here, and the only value (ascend_kernel.py refuses the others before a graph is built).
  const std::string compute = attrs->GetAttrPointer<char>(kComputeDtype);
  std::string err = ParseCompute(compute, &a.compute);
  if (err.empty() && a.compute != Compute::Auto)
    err = "compute_dtype: on Ascend the cube units compute in the inputs' dtype; only 'auto' is accepted, got " + compute;
  if (!err.empty() && error->empty()) *error = err;
  return a;
}

inline const char *DTypeName(ge::DataType dt) {
  switch (dt) {
    case ge::DT_FLOAT: return "float32";
    case ge::DT_FLOAT16: return "float16";
    case ge::DT_BF16: return "bfloat16";
    case ge::DT_INT64: return "int64";
    default: return "unsupported";
  }
}

inline matmul_tiling::DataType MatmulDType(DType dt) {
  return dt == DType::F32 ? matmul_tiling::DataType::DT_FLOAT
         : dt == DType::F16 ? matmul_tiling::DataType::DT_FLOAT16 : matmul_tiling::DataType::DT_BF16;
}

// One block product's Matmul API tiling: C (m x n) = A (m x k) B (k x n), A and B from GM in the
// input dtype, each stored transposed when its flag says so; C float32 to the vector core's UB
// (VECIN: on A2 C may be at GM, VECIN or CO1); no bias (its type set explicitly: it defaults to C's,
// and A2 allows a bias at GM or VECOUT only). The kernels declare the same types.
inline bool MatmulTiling(const platform_ascendc::PlatformAscendC &platform, DType dt, int64_t m, int64_t n, int64_t k,
                         bool transpose_a, bool transpose_b, AscendC::tiling::TCubeTiling *out) {
  matmul_tiling::MatmulApiTiling mm(platform);
  mm.SetAType(matmul_tiling::TPosition::GM, matmul_tiling::CubeFormat::ND, MatmulDType(dt), transpose_a);
  mm.SetBType(matmul_tiling::TPosition::GM, matmul_tiling::CubeFormat::ND, MatmulDType(dt), transpose_b);
  mm.SetCType(matmul_tiling::TPosition::VECIN, matmul_tiling::CubeFormat::ND, matmul_tiling::DataType::DT_FLOAT);
  mm.SetBiasType(matmul_tiling::TPosition::GM, matmul_tiling::CubeFormat::ND, matmul_tiling::DataType::DT_FLOAT);
  mm.SetShape(static_cast<int32_t>(m), static_cast<int32_t>(n), static_cast<int32_t>(k));
  mm.SetOrgShape(static_cast<int32_t>(m), static_cast<int32_t>(n), static_cast<int32_t>(k));
  mm.SetBias(false);
  mm.SetBufferSpace(-1, -1, -1);
  return mm.GetTiling(*out) != -1;
}

// A launch's tensors in the aot form rfa_problem.h validates (inputs, then outputs): ranks, shapes,
// dtype names and data pointers. An absent optional input keeps rank 0, dtype "none" and no data.
struct CallTensors {
  std::vector<std::vector<int64_t>> dims;
  std::vector<int> ndims;
  std::vector<int64_t *> shapes;
  std::vector<const char *> dtypes;
  std::vector<void *> params;
  explicit CallTensors(size_t n) : dims(n), ndims(n, 0), shapes(n, nullptr), dtypes(n, "none"), params(n, nullptr) {}
};

// The data pointer of a present tensor whose data stays on the device: the validation only needs to
// know it is there (ValidateGradCall refuses a null one); never dereferenced.
inline void *OnDevice() {
  static char marker;
  return &marker;
}

// Fills `t` (sized inputs + outputs) from the tiling context of an op with `inputs` inputs, the
// forward's 7 first: the TND offsets (5 and 6) are value-dependent, their data on the host.
// Returns "" or an error.
inline std::string CollectTensors(const gert::TilingContext *context, int inputs, CallTensors *t) {
  std::string error;
  const int count = static_cast<int>(t->ndims.size());
  for (int i = 0; i < count; ++i) {
    const bool input = i < inputs;
    const gert::StorageShape *shape = input ? context->GetOptionalInputShape(i) : context->GetOutputShape(i - inputs);
    if (shape == nullptr) continue;
    const gert::Shape &s = shape->GetStorageShape();
    for (size_t d = 0; d < s.GetDimNum(); ++d) t->dims[i].push_back(s.GetDim(d));
    t->ndims[i] = static_cast<int>(t->dims[i].size());
    t->shapes[i] = t->dims[i].data();
    const gert::CompileTimeTensorDesc *desc =
        input ? context->GetOptionalInputDesc(i) : context->GetOutputDesc(i - inputs);
    if (desc == nullptr) {  // a shape without a description: refuse rather than guess the dtype
      if (error.empty()) error = "tiling: tensor " + std::to_string(i) + " has a shape but no description";
      continue;
    }
    t->dtypes[i] = DTypeName(desc->GetDataType());
    t->params[i] = OnDevice();
  }
  for (int i = 5; i < kInputs; ++i) {
    const gert::Tensor *tensor = context->GetOptionalInputTensor(i);
    t->params[i] = tensor != nullptr ? const_cast<int64_t *>(tensor->GetData<int64_t>()) : nullptr;
  }
  return error;
}

// The kernels' user workspace starts kSysWorkspaceBytes past the system one (GetUserWorkspace on
// dav_c220: RESERVED_WORKSPACE, 16 MiB), so that is the system part they ask for; a Matmul API that
// needs more would overrun the user part: refused. Returns "" or the error.
inline std::string CheckSysWorkspace(const platform_ascendc::PlatformAscendC &platform) {
  if (platform.GetLibApiWorkSpaceSize() <= static_cast<uint32_t>(ascend::kSysWorkspaceBytes)) return "";
  return "tiling: the Matmul API asks for " + std::to_string(platform.GetLibApiWorkSpaceSize()) +
         " bytes of system workspace, more than the " + std::to_string(ascend::kSysWorkspaceBytes) +
         " the kernel reserves before its own";
}

// The vector cores and Unified Buffer the plans spread the work over.
inline ascend::Platform VectorPlatform(const platform_ascendc::PlatformAscendC &platform) {
  uint64_t ub = 0;
  platform.GetCoreMemSize(platform_ascendc::CoreMemType::UB, ub);
  return ascend::Platform(static_cast<int64_t>(platform.GetCoreNumAiv()), static_cast<int64_t>(ub));
}

inline ge::graphStatus Fail(const char *op, const std::string &error) {
  std::fprintf(stderr, "[%s] %s\n", op, error.c_str());
  return ge::GRAPH_FAILED;
}

// MIX mode (1 cube : 2 vector cores): the launch counts AI cores, the kernel spreads its tasks over
// `vector_cores` vector workers. SyncAll (after a kernel's pre stage) needs every core of the launch
// running at once: batch scheduling (mode 1). One workspace: the system part, then the kernel's.
inline ge::graphStatus SetLaunch(gert::TilingContext *context, const platform_ascendc::PlatformAscendC &platform,
                                 int64_t vector_cores, int64_t workspace_bytes, const char *op) {
  context->SetBlockDim(platform.CalcTschNumBlocks(static_cast<uint32_t>(vector_cores), platform.GetCoreNumAic(),
                                                  platform.GetCoreNumAiv()));
  context->SetScheduleMode(1);
  size_t *workspace = context->GetWorkspaceSizes(1);
  if (workspace == nullptr) return Fail(op, "tiling: the context has no workspace size slot");
  workspace[0] = static_cast<size_t>(workspace_bytes);
  return ge::GRAPH_SUCCESS;
}

// The AI-core side both OpDefs declare: their tiling function, on Atlas A2 and A3, dynamic shapes.
inline void DeclareAICore(ops::OpAICoreDef &core, gert::OpImplRegisterV2::TilingKernelFunc tiling) {
  core.SetTiling(tiling);
  ops::OpAICoreConfig config;
  config.DynamicCompileStaticFlag(true).DynamicRankSupportFlag(true).DynamicShapeSupportFlag(true);
  core.AddConfig("ascend910b", config);    // Atlas A2
  core.AddConfig("ascend910_93", config);  // Atlas A3
}

}  // namespace host
}  // namespace rfa
