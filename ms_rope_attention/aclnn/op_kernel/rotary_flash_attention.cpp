// Kernel entry of the RotaryFlashAttention custom op. The CANN build compiles this file once per
// dtype combination of the OpDef, with DTYPE_QUERY / DTYPE_COS naming the C++ types (float, half,
// bfloat16_t); the body is in rotary_flash_attention.h.
#include "kernel_operator.h"
#include "rotary_flash_attention.h"

extern "C" __global__ __aicore__ void rotary_flash_attention(GM_ADDR query, GM_ADDR key, GM_ADDR value, GM_ADDR cos,
                                                             GM_ADDR sin, GM_ADDR actual_seq_qlen,
                                                             GM_ADDR actual_seq_kvlen, GM_ADDR attention_out,
                                                             GM_ADDR softmax_lse, GM_ADDR rotated_key,
                                                             GM_ADDR workspace, GM_ADDR tiling) {
  REGISTER_TILING_DEFAULT(RotaryFlashAttentionTilingData);
  GET_TILING_DATA_WITH_STRUCT(RotaryFlashAttentionTilingData, tiling_data, tiling);
  rfa::ascend::RotaryFlashAttentionKernel<DTYPE_QUERY, DTYPE_COS> op;
  op.Init(query, key, value, cos, sin, actual_seq_qlen, actual_seq_kvlen, attention_out, softmax_lse, rotated_key,
          workspace, &tiling_data);
  op.Process();
}
