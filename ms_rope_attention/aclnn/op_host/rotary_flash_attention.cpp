// Host side of the RotaryFlashAttention CANN custom op: OpDef (generated from op_info), shape and
// dtype inference, and tiling. Built by CANN (see ../build.sh); needs the CANN headers, so it is
// not compiled on machines without CANN. The decisions live in CANN-free headers that are tested on
// any machine: rfa_problem.h (validation, output shapes; shared with the CPU kernel) and
// rotary_flash_attention_plan.h (block sizes, UB budget, workspace, task order).
#include <cstdio>
#include <string>
#include <vector>

#include "register/op_def_registry.h"
#include "tiling/platform/platform_ascendc.h"
#include "tiling/tiling_api.h"

#include "rfa_problem.h"
#include "rotary_flash_attention_plan.h"

namespace {

// Attribute indices in OpDef (= op_info) order; tests/test_op_info.py checks the order.
enum AttrIndex {
  kHeadNum, kInputLayout, kRotaryMode, kRotaryDim, kScale, kCausal, kWithSoftmaxLse, kWithRotatedKey, kKeyRotated
};

rfa::Attrs ReadAttrs(const gert::RuntimeAttrs *attrs, std::string *error) {
  rfa::Attrs a;
  a.head_num = *attrs->GetAttrPointer<int64_t>(kHeadNum);
  const std::string layout = attrs->GetAttrPointer<char>(kInputLayout);
  if (!rfa::ParseLayout(layout, &a.layout)) *error = "input_layout: expected BNSD, BSND, BSH or TND, got " + layout;
  a.rotary_mode = *attrs->GetAttrPointer<int64_t>(kRotaryMode);
  a.rotary_dim = *attrs->GetAttrPointer<int64_t>(kRotaryDim);
  a.scale = *attrs->GetAttrPointer<float>(kScale);
  a.causal = *attrs->GetAttrPointer<bool>(kCausal);
  a.with_lse = *attrs->GetAttrPointer<bool>(kWithSoftmaxLse);
  a.with_rotated_key = *attrs->GetAttrPointer<bool>(kWithRotatedKey);
  a.key_rotated = *attrs->GetAttrPointer<bool>(kKeyRotated);
  return a;
}

const char *DTypeName(ge::DataType dt) {
  switch (dt) {
    case ge::DT_FLOAT: return "float32";
    case ge::DT_FLOAT16: return "float16";
    case ge::DT_BF16: return "bfloat16";
    case ge::DT_INT64: return "int64";
    default: return "unsupported";
  }
}

matmul_tiling::DataType MatmulDType(rfa::DType dt) {
  return dt == rfa::DType::F32 ? matmul_tiling::DataType::DT_FLOAT
         : dt == rfa::DType::F16 ? matmul_tiling::DataType::DT_FLOAT16 : matmul_tiling::DataType::DT_BF16;
}

// One matmul's API tiling: A (m x k) and B from GM in the input dtype, C float32 to the vector
// core's UB (VECIN: on A2 C may be at GM, VECIN or CO1), no bias (its type set explicitly: it
// defaults to C's, and A2 allows a bias at GM or VECOUT only). The kernel declares the same types.
bool MatmulTiling(const platform_ascendc::PlatformAscendC &platform, rfa::DType dt, int64_t m, int64_t n, int64_t k,
                  bool transpose_b, AscendC::tiling::TCubeTiling *out) {
  matmul_tiling::MatmulApiTiling mm(platform);
  mm.SetAType(matmul_tiling::TPosition::GM, matmul_tiling::CubeFormat::ND, MatmulDType(dt));
  mm.SetBType(matmul_tiling::TPosition::GM, matmul_tiling::CubeFormat::ND, MatmulDType(dt), transpose_b);
  mm.SetCType(matmul_tiling::TPosition::VECIN, matmul_tiling::CubeFormat::ND, matmul_tiling::DataType::DT_FLOAT);
  mm.SetBiasType(matmul_tiling::TPosition::GM, matmul_tiling::CubeFormat::ND, matmul_tiling::DataType::DT_FLOAT);
  mm.SetShape(static_cast<int32_t>(m), static_cast<int32_t>(n), static_cast<int32_t>(k));
  mm.SetOrgShape(static_cast<int32_t>(m), static_cast<int32_t>(n), static_cast<int32_t>(k));
  mm.SetBias(false);
  mm.SetBufferSpace(-1, -1, -1);
  return mm.GetTiling(*out) != -1;
}

}  // namespace

namespace ge {

static graphStatus InferShape(gert::InferShapeContext *context) {
  std::string error;
  const rfa::Attrs a = ReadAttrs(context->GetAttrs(), &error);
  if (!error.empty()) return GRAPH_FAILED;
  const gert::Shape *q = context->GetInputShape(0), *k = context->GetInputShape(1);
  std::vector<int64_t> qs(q->GetDimNum()), ks(k->GetDimNum());
  for (size_t i = 0; i < qs.size(); ++i) qs[i] = q->GetDim(i);
  for (size_t i = 0; i < ks.size(); ++i) ks[i] = k->GetDim(i);
  const auto shapes = rfa::InferShapes(a, static_cast<int>(qs.size()), qs.data(), static_cast<int>(ks.size()), ks.data());
  for (size_t o = 0; o < shapes.size(); ++o) {
    gert::Shape *out = context->GetOutputShape(o);
    out->SetDimNum(shapes[o].size());
    for (size_t i = 0; i < shapes[o].size(); ++i) out->SetDim(i, shapes[o][i]);
  }
  return GRAPH_SUCCESS;
}

static graphStatus InferDataType(gert::InferDataTypeContext *context) {
  context->SetOutputDataType(0, context->GetInputDataType(0));  // attention_out: query's dtype
  context->SetOutputDataType(1, DT_FLOAT);                        // softmax_lse
  context->SetOutputDataType(2, context->GetInputDataType(1));  // rotated_key: key's dtype
  return GRAPH_SUCCESS;
}

}  // namespace ge

namespace optiling {

static ge::graphStatus TilingFunc(gert::TilingContext *context) {
  std::string error;
  const rfa::Attrs a = ReadAttrs(context->GetAttrs(), &error);
  // Tensor descriptions in the same form the CPU kernel validates (inputs, then outputs).
  std::vector<std::vector<int64_t>> dims(rfa::kInputs + rfa::kOutputs);
  std::vector<int> ndims(dims.size(), 0);
  std::vector<int64_t *> shapes(dims.size(), nullptr);
  std::vector<const char *> dtypes(dims.size(), "none");
  std::vector<void *> params(dims.size(), nullptr);
  for (int i = 0; i < rfa::kInputs + rfa::kOutputs; ++i) {
    const bool input = i < rfa::kInputs;
    const gert::StorageShape *shape = input ? context->GetOptionalInputShape(i)
                                            : context->GetOutputShape(i - rfa::kInputs);
    if (shape == nullptr) continue;
    const gert::Shape &s = shape->GetStorageShape();
    for (size_t d = 0; d < s.GetDimNum(); ++d) dims[i].push_back(s.GetDim(d));
    ndims[i] = static_cast<int>(dims[i].size());
    shapes[i] = dims[i].data();
    const auto *desc = input ? context->GetOptionalInputDesc(i) : context->GetOutputDesc(i - rfa::kInputs);
    if (desc == nullptr) {  // a shape without a description: refuse rather than guess the dtype
      if (error.empty()) error = std::string("tiling: tensor ") + std::to_string(i) + " has a shape but no description";
      continue;
    }
    dtypes[i] = DTypeName(desc->GetDataType());
  }
  for (int i = 5; i < rfa::kInputs; ++i) {  // actual_seq_qlen / kvlen are value-dependent: data on the host
    const gert::Tensor *t = context->GetOptionalInputTensor(i);
    if (t != nullptr) params[i] = const_cast<int64_t *>(t->GetData<int64_t>());
  }
  rfa::Problem problem;
  if (error.empty()) error = rfa::ValidateCall(a, ndims.data(), shapes.data(), dtypes.data(), params.data(), &problem);
  auto platform = platform_ascendc::PlatformAscendC(context->GetPlatformInfo());
  // The kernel's user workspace starts kSysWorkspaceBytes past the system one (GetUserWorkspace on
  // dav_c220: RESERVED_WORKSPACE, 16 MiB), so that is the system part asked for; a Matmul API that
  // needs more would overrun the user part: refused.
  if (error.empty() && platform.GetLibApiWorkSpaceSize() > static_cast<uint32_t>(rfa::ascend::kSysWorkspaceBytes))
    error = "tiling: the Matmul API asks for " + std::to_string(platform.GetLibApiWorkSpaceSize()) +
            " bytes of system workspace, more than the " + std::to_string(rfa::ascend::kSysWorkspaceBytes) +
            " the kernel reserves before its own";
  uint64_t ub = 0;
  platform.GetCoreMemSize(platform_ascendc::CoreMemType::UB, ub);
  const rfa::ascend::Platform pf(static_cast<int64_t>(platform.GetCoreNumAiv()), static_cast<int64_t>(ub));
  RotaryFlashAttentionTilingData *data = context->GetTilingData<RotaryFlashAttentionTilingData>();
  if (error.empty() && data == nullptr) error = "tiling: the context's tiling buffer is smaller than the tiling data";
  if (error.empty()) error = rfa::ascend::PlanTiling(problem, pf, &data->rfa);
  if (error.empty()) {
    const int64_t m = data->rfa.group * data->rfa.block_q;
    if (!MatmulTiling(platform, problem.qkv_dtype, m, data->rfa.block_kv, data->rfa.head_pad, true, &data->qk) ||
        !MatmulTiling(platform, problem.qkv_dtype, m, data->rfa.head_pad, data->rfa.block_kv, false, &data->pv))
      error = "tiling: the Matmul API found no tiling for the QK^T / PV blocks";
  }
  if (!error.empty()) {
    std::fprintf(stderr, "[RotaryFlashAttention] %s\n", error.c_str());
    return ge::GRAPH_FAILED;
  }
  // MIX mode (1 cube : 2 vector cores): the launch counts AI cores, the kernel spreads its tasks
  // over data->rfa.core_num vector workers. SyncAll (the K pre-pass) needs every core of the launch
  // running at once: batch scheduling (mode 1).
  context->SetBlockDim(platform.CalcTschNumBlocks(static_cast<uint32_t>(data->rfa.core_num), platform.GetCoreNumAic(),
                                                  platform.GetCoreNumAiv()));
  context->SetScheduleMode(1);
  size_t *workspace = context->GetWorkspaceSizes(1);
  if (workspace == nullptr) {
    std::fprintf(stderr, "[RotaryFlashAttention] tiling: the context has no workspace size slot\n");
    return ge::GRAPH_FAILED;
  }
  workspace[0] = static_cast<size_t>(rfa::ascend::WorkspaceBytes(data->rfa, rfa::ascend::ElemBytes(problem.qkv_dtype)));
  return ge::GRAPH_SUCCESS;
}

}  // namespace optiling

namespace ops {

class RotaryFlashAttention : public OpDef {
 public:
  explicit RotaryFlashAttention(const char *name) : OpDef(name) {
#include "rotary_flash_attention_opdef.h"  // generated from op_info: inputs, outputs, attrs, dtypes
    this->SetInferShape(ge::InferShape).SetInferDataType(ge::InferDataType);
    this->AICore().SetTiling(optiling::TilingFunc);
    OpAICoreConfig config;
    config.DynamicCompileStaticFlag(true).DynamicRankSupportFlag(true).DynamicShapeSupportFlag(true);
    this->AICore().AddConfig("ascend910b", config);     // Atlas A2
    this->AICore().AddConfig("ascend910_93", config);   // Atlas A3
  }
};

OP_ADD(RotaryFlashAttention);

}  // namespace ops
