// Host side of the RotaryFlashAttention CANN custom op: OpDef (generated from op_info), shape and
// dtype inference, and tiling. Built by CANN (see ../build.sh); needs the CANN headers, so it is
// not compiled on machines without CANN. The decisions live in CANN-free headers that are tested on
// any machine: rfa_problem.h (validation, output shapes; shared with the CPU kernel) and
// rotary_flash_attention_plan.h (block sizes, UB budget, workspace, task order); what this file
// shares with the backward's (rotary_flash_attention_grad.cpp) is in rfa_host_common.h.
#include <string>
#include <vector>

#include "rfa_host_common.h"

namespace ge {

static graphStatus InferShape(gert::InferShapeContext *context) {
  std::string error;
  const rfa::Attrs a = rfa::host::ReadAttrs(context->GetAttrs(), &error);
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
  const char *op = "RotaryFlashAttention";
  std::string error;
  const rfa::Attrs a = rfa::host::ReadAttrs(context->GetAttrs(), &error);
  rfa::host::CallTensors t(rfa::kInputs + rfa::kOutputs);
  if (error.empty()) error = rfa::host::CollectTensors(context, rfa::kInputs, &t);
  rfa::Problem problem;
  if (error.empty())
    error = rfa::ValidateCall(a, t.ndims.data(), t.shapes.data(), t.dtypes.data(), t.params.data(), &problem);
  auto platform = platform_ascendc::PlatformAscendC(context->GetPlatformInfo());
  if (error.empty()) error = rfa::host::CheckSysWorkspace(platform);
  RotaryFlashAttentionTilingData *data = context->GetTilingData<RotaryFlashAttentionTilingData>();
  if (error.empty() && data == nullptr) error = "tiling: the context's tiling buffer is smaller than the tiling data";
  if (error.empty()) error = rfa::ascend::PlanTiling(problem, rfa::host::VectorPlatform(platform), &data->rfa);
  if (error.empty()) {
    const int64_t m = data->rfa.group * data->rfa.block_q;
    const rfa::DType dt = problem.qkv_dtype;
    if (!rfa::host::MatmulTiling(platform, dt, m, data->rfa.block_kv, data->rfa.head_pad, false, true, &data->qk) ||
        !rfa::host::MatmulTiling(platform, dt, m, data->rfa.head_pad, data->rfa.block_kv, false, false, &data->pv))
      error = "tiling: the Matmul API found no tiling for the QK^T / PV blocks";
  }
  if (!error.empty()) return rfa::host::Fail(op, error);
  return rfa::host::SetLaunch(context, platform, data->rfa.core_num,
                              rfa::ascend::WorkspaceBytes(data->rfa, rfa::ascend::ElemBytes(problem.qkv_dtype)), op);
}

}  // namespace optiling

namespace ops {

class RotaryFlashAttention : public OpDef {
 public:
  explicit RotaryFlashAttention(const char *name) : OpDef(name) {
#include "rotary_flash_attention_opdef.h"  // generated from op_info: inputs, outputs, attrs, dtypes
    this->SetInferShape(ge::InferShape).SetInferDataType(ge::InferDataType);
    rfa::host::DeclareAICore(this->AICore(), optiling::TilingFunc);
  }
};

OP_ADD(RotaryFlashAttention);

}  // namespace ops
