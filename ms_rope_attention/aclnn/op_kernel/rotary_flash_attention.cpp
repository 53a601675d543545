// Kernel entry of the RotaryFlashAttention custom op. The CANN build compiles this file once per
// dtype combination of the OpDef, with DTYPE_QUERY / DTYPE_COS naming the C++ types (float, half,
// bfloat16_t); the body is in rotary_flash_attention.h.
//
// MIX 1:2: the entry runs on each AI core's cube core and its two vector cores. The TPipe and the
// Matmul registration live here, before Init: REGIST_MATMUL_OBJ keeps the cube core in its matmul
// server until both vector cores' clients (local objects of this scope) are destroyed at the end of
// the entry, then returns; it must come before any InitBuffer.
#include "kernel_operator.h"
#include "lib/matmul_intf.h"
#include "rotary_flash_attention.h"

extern "C" __global__ __aicore__ void rotary_flash_attention(GM_ADDR query, GM_ADDR key, GM_ADDR value, GM_ADDR cos,
                                                             GM_ADDR sin, GM_ADDR actual_seq_qlen,
                                                             GM_ADDR actual_seq_kvlen, GM_ADDR attention_out,
                                                             GM_ADDR softmax_lse, GM_ADDR rotated_key,
                                                             GM_ADDR workspace, GM_ADDR tiling) {
  KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_MIX_AIC_1_2);
  REGISTER_TILING_DEFAULT(RotaryFlashAttentionTilingData);
  GET_TILING_DATA_WITH_STRUCT(RotaryFlashAttentionTilingData, tiling_data, tiling);
  AscendC::TPipe pipe;
  rfa::ascend::RotaryFlashAttentionKernel<DTYPE_QUERY, DTYPE_COS> op;
  REGIST_MATMUL_OBJ(&pipe, GetSysWorkSpacePtr(), op.mm_qk, &tiling_data.qk, op.mm_pv, &tiling_data.pv);
  op.Init(query, key, value, cos, sin, actual_seq_qlen, actual_seq_kvlen, attention_out, softmax_lse, rotated_key,
          workspace, &tiling_data, &pipe);
  op.Process();
}
