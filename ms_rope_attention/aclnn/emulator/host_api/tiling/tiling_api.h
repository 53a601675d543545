// After asc-devkit include/adv_api/tiling_api.h -> matmul/matmul_tiling_base.h, matmul_tiling.h:
// the Matmul API tiling calls of op_host, for the plain-struct TCubeTiling of kernel_tiling.h.
#pragma once
#include <stdint.h>

#include "kernel_tiling/kernel_tiling.h"
#include "tiling/platform/platform_ascendc.h"

namespace matmul_tiling {

enum class DataType : int32_t { DT_FLOAT = 0, DT_FLOAT16 = 1, DT_BF16 = 27 };
enum class TPosition : int32_t { GM, A1, A2, B1, B2, C1, C2, CO1, CO2, VECIN, VECOUT, VECCALC, LCM = VECCALC };
enum class CubeFormat : int32_t { ND = 0, NZ, ZN, ZZ, NN, ND_ALIGN };

class MatmulApiTilingBase {
 public:
  MatmulApiTilingBase();
  explicit MatmulApiTilingBase(const platform_ascendc::PlatformAscendC &ascendcPlatform);
  virtual ~MatmulApiTilingBase();
  int32_t SetAType(TPosition pos, CubeFormat type, DataType dataType, bool isTrans = false);
  int32_t SetBType(TPosition pos, CubeFormat type, DataType dataType, bool isTrans = false);
  int32_t SetCType(TPosition pos, CubeFormat type, DataType dataType);
  int32_t SetBiasType(TPosition pos, CubeFormat type, DataType dataType);
  virtual int32_t SetShape(int32_t m, int32_t n, int32_t k);
  int32_t SetOrgShape(int32_t orgMIn, int32_t orgNIn, int32_t orgKIn);
  int32_t SetBias(bool isBiasIn = false);
  int32_t SetBufferSpace(int32_t l1Size = -1, int32_t l0CSize = -1, int32_t ubSize = -1, int32_t btSize = -1);
  virtual int64_t GetTiling(AscendC::tiling::TCubeTiling &tiling) = 0;
};

class MatmulApiTiling : public MatmulApiTilingBase {
 public:
  MatmulApiTiling() {}
  explicit MatmulApiTiling(const platform_ascendc::PlatformAscendC &ascendcPlatform)
      : MatmulApiTilingBase(ascendcPlatform) {}
  ~MatmulApiTiling() override = default;
  int64_t GetTiling(AscendC::tiling::TCubeTiling &tiling) override;
};

}  // namespace matmul_tiling
