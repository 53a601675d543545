// Kernel entry of the RotaryFlashAttentionGrad custom op (the backward; one binary per dtype
// combination of its OpDef, DTYPE_QUERY / DTYPE_COS naming the C++ types); the body is in
// rotary_flash_attention_grad.h. MIX 1:2 with the TPipe and the Matmul registration here, before
// Init, as in the forward's entry (rotary_flash_attention.cpp says why).
#include "kernel_operator.h"
#include "lib/matmul_intf.h"
#include "rotary_flash_attention_grad.h"

extern "C" __global__ __aicore__ void rotary_flash_attention_grad(
    GM_ADDR query, GM_ADDR key, GM_ADDR value, GM_ADDR cos, GM_ADDR sin, GM_ADDR actual_seq_qlen,
    GM_ADDR actual_seq_kvlen, GM_ADDR attention_out, GM_ADDR softmax_lse, GM_ADDR d_attention_out,
    GM_ADDR d_softmax_lse, GM_ADDR d_rotated_key, GM_ADDR d_query, GM_ADDR d_key, GM_ADDR d_value, GM_ADDR workspace,
    GM_ADDR tiling) {
  KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_MIX_AIC_1_2);
  REGISTER_TILING_DEFAULT(RotaryFlashAttentionGradTilingData);
  GET_TILING_DATA_WITH_STRUCT(RotaryFlashAttentionGradTilingData, tiling_data, tiling);
  AscendC::TPipe pipe;
  rfa::ascend::RotaryFlashAttentionGradKernel<DTYPE_QUERY, DTYPE_COS> op;
  REGIST_MATMUL_OBJ(&pipe, GetSysWorkSpacePtr(), op.mm_nt, &tiling_data.nt, op.mm_tn, &tiling_data.tn, op.mm_nn,
                    &tiling_data.nn);
  op.Init(query, key, value, cos, sin, actual_seq_qlen, actual_seq_kvlen, attention_out, softmax_lse, d_attention_out,
          d_softmax_lse, d_rotated_key, d_query, d_key, d_value, workspace, &tiling_data, &pipe);
  op.Process();
}
