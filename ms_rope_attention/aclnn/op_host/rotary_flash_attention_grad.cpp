// Host side of the RotaryFlashAttentionGrad CANN custom op (the backward): OpDef (generated from
// op_info's backward section), shape and dtype inference, and tiling. Built by CANN with the
// forward's host side (see ../build.sh); the decisions live in the CANN-free headers it shares with
// the forward: rfa_problem.h (ValidateGradCall) and rotary_flash_attention_plan.h (PlanGradTiling).
#include <string>

#include "rfa_host_common.h"

namespace ge {

// d_query, d_key, d_value: the shapes and dtypes of query, key, value (inputs and outputs 0..2).
static graphStatus InferShape(gert::InferShapeContext *context) {
  for (size_t i = 0; i < 3; ++i) {
    const gert::Shape *in = context->GetInputShape(i);
    gert::Shape *out = context->GetOutputShape(i);
    if (in == nullptr || out == nullptr) return GRAPH_FAILED;
    out->SetDimNum(in->GetDimNum());
    for (size_t d = 0; d < in->GetDimNum(); ++d) out->SetDim(d, in->GetDim(d));
  }
  return GRAPH_SUCCESS;
}

static graphStatus InferDataType(gert::InferDataTypeContext *context) {
  for (size_t i = 0; i < 3; ++i) context->SetOutputDataType(i, context->GetInputDataType(i));
  return GRAPH_SUCCESS;
}

}  // namespace ge

namespace optiling {

static ge::graphStatus TilingFunc(gert::TilingContext *context) {
  const char *op = "RotaryFlashAttentionGrad";
  std::string error;
  const rfa::Attrs a = rfa::host::ReadAttrs(context->GetAttrs(), &error);
  rfa::host::CallTensors t(rfa::kGradInputs + rfa::kGradOutputs);
  if (error.empty()) error = rfa::host::CollectTensors(context, rfa::kGradInputs, &t);
  rfa::Problem problem;
  bool has_dlse = false, has_drk = false;
  if (error.empty())
    error = rfa::ValidateGradCall(a, t.ndims.data(), t.shapes.data(), t.dtypes.data(), t.params.data(), &problem,
                                  &has_dlse, &has_drk);
  auto platform = platform_ascendc::PlatformAscendC(context->GetPlatformInfo());
  if (error.empty()) error = rfa::host::CheckSysWorkspace(platform);
  RotaryFlashAttentionGradTilingData *data = context->GetTilingData<RotaryFlashAttentionGradTilingData>();
  if (error.empty() && data == nullptr) error = "tiling: the context's tiling buffer is smaller than the tiling data";
  if (error.empty())
    error = rfa::ascend::PlanGradTiling(problem, rfa::host::VectorPlatform(platform), has_dlse, has_drk, &data->rfa,
                                        &data->grad);
  if (error.empty()) {
    // Per head: S = Qs Kr^T and dP = dO V^T (nt); dV += P^T dO and dK += dS^T Qs, P and dS stored as
    // (block_q, block_kv) rows (tn); dQ += dS Kr (nn).
    const int64_t bq = data->grad.block_q, bkv = data->grad.block_kv, d = data->rfa.head_pad;
    const rfa::DType dt = problem.qkv_dtype;
    if (!rfa::host::MatmulTiling(platform, dt, bq, bkv, d, false, true, &data->nt) ||
        !rfa::host::MatmulTiling(platform, dt, bkv, d, bq, true, false, &data->tn) ||
        !rfa::host::MatmulTiling(platform, dt, bq, d, bkv, false, false, &data->nn))
      error = "tiling: the Matmul API found no tiling for the S / dP, dV / dK or dQ blocks";
  }
  if (!error.empty()) return rfa::host::Fail(op, error);
  return rfa::host::SetLaunch(context, platform, data->grad.core_num, rfa::ascend::GradWorkspaceBytes(data->grad), op);
}

}  // namespace optiling

namespace ops {

class RotaryFlashAttentionGrad : public OpDef {
 public:
  explicit RotaryFlashAttentionGrad(const char *name) : OpDef(name) {
#include "rotary_flash_attention_grad_opdef.h"  // generated from op_info: inputs, outputs, attrs, dtypes
    this->SetInferShape(ge::InferShape).SetInferDataType(ge::InferDataType);
    rfa::host::DeclareAICore(this->AICore(), optiling::TilingFunc);
  }
};

OP_ADD(RotaryFlashAttentionGrad);

}  // namespace ops
