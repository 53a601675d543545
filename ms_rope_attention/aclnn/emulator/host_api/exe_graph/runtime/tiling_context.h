// After metadef inc/external/exe_graph/runtime/{shape,storage_shape,tensor,runtime_attrs,
// tiling_data,extended_kernel_context,infer_shape_context,infer_datatype_context,tiling_context}.h:
// the members op_host calls, with the real signatures.
#pragma once
#include <stddef.h>
#include <stdint.h>

#include "graph/types.h"

namespace fe {
class PlatFormInfos;
}

namespace gert {

class Shape {
 public:
  size_t GetDimNum() const;
  void SetDimNum(const size_t dim_num);
  int64_t GetDim(const size_t idx) const;
  void SetDim(size_t idx, const int64_t dim_value);
};

class StorageShape {
 public:
  const Shape &GetStorageShape() const;
  const Shape &GetOriginShape() const;
};

class Tensor {
 public:
  template <class T>
  const T *GetData() const;
};

class RuntimeAttrs {
 public:
  template <typename T>
  const T *GetAttrPointer(size_t index) const;
};

class CompileTimeTensorDesc {
 public:
  ge::DataType GetDataType() const;
};

class TilingData {
 public:
  size_t GetCapacity() const;
  void SetDataSize(const size_t size);
  void *GetData();
};

class ExtendedKernelContext {
 public:
  const CompileTimeTensorDesc *GetInputDesc(const size_t index) const;
  const CompileTimeTensorDesc *GetOptionalInputDesc(const size_t ir_index) const;
  const CompileTimeTensorDesc *GetOutputDesc(const size_t index) const;
  const RuntimeAttrs *GetAttrs() const;
};

class InferShapeContext : public ExtendedKernelContext {
 public:
  const Shape *GetInputShape(const size_t index) const;
  const Shape *GetOptionalInputShape(const size_t ir_index) const;
  Shape *GetOutputShape(const size_t index);
};

class InferDataTypeContext : public ExtendedKernelContext {
 public:
  ge::DataType GetInputDataType(const size_t index) const;
  ge::graphStatus SetOutputDataType(const size_t index, const ge::DataType datatype);
};

class TilingContext : public ExtendedKernelContext {
 public:
  const StorageShape *GetInputShape(const size_t index) const;
  const StorageShape *GetOptionalInputShape(const size_t ir_index) const;
  const StorageShape *GetOutputShape(const size_t index) const;
  const Tensor *GetInputTensor(const size_t index) const;
  const Tensor *GetOptionalInputTensor(const size_t ir_index) const;
  template <typename T>
  auto GetTilingData() -> T *;
  TilingData *GetRawTilingData();
  size_t *GetWorkspaceSizes(const size_t workspace_count);
  fe::PlatFormInfos *GetPlatformInfo() const;
  ge::graphStatus SetBlockDim(const uint32_t block_dim);
  ge::graphStatus SetScheduleMode(const uint32_t schedule_mode);
  ge::graphStatus SetTilingKey(const uint64_t tiling_key);
};

}  // namespace gert
