// After CANN's kernel_tiling/kernel_tiling.h: the plain-struct tiling of the Matmul API, in
// AscendC::tiling, as the kernel and the host tiling both see it. Only the fields this project
// reads are named here; the host fills it with MatmulApiTiling::GetTiling on a real device, and
// the emulated Matmul does not interpret it.
#pragma once
#include <stdint.h>

namespace AscendC {
namespace tiling {
struct TCubeTiling {
  int32_t usedCoreNum;
  int32_t M, N, Ka, Kb;
  int32_t singleCoreM, singleCoreN, singleCoreK;
  int32_t baseM, baseN, baseK;
  int32_t depthA1, depthB1, stepM, stepN, stepKa, stepKb, isBias, transLength, iterateOrder;
  int32_t shareMode, shareL1Size, shareL0CSize, shareUbSize, batchM, batchN, singleBatchM, singleBatchN;
  int32_t dbL0A, dbL0B, dbL0C;
};
}  // namespace tiling
}  // namespace AscendC
