// After metadef inc/external/asc/register/op_def.h, op_def_registry.h and op_impl_registry.h: the
// OpDef builder calls op_host and the generated rotary_flash_attention_opdef.h make.
#pragma once
#include <stdint.h>

#include <vector>

#include "exe_graph/runtime/tiling_context.h"
#include "graph/types.h"

namespace gert {
class OpImplRegisterV2 {
 public:
  using InferShapeKernelFunc = ge::graphStatus (*)(InferShapeContext *);
  using InferDataTypeKernelFunc = ge::graphStatus (*)(InferDataTypeContext *);
  using TilingKernelFunc = ge::graphStatus (*)(TilingContext *);
};
}  // namespace gert

namespace ops {

enum Option { IGNORE = 0, OPTIONAL = 1, REQUIRED = 2, DYNAMIC = 3, VIRTUAL = 4 };

class OpParamDef {
 public:
  explicit OpParamDef(const char *name);
  OpParamDef &ParamType(Option param_type);
  OpParamDef &DataType(std::vector<ge::DataType> types);
  OpParamDef &Format(std::vector<ge::Format> formats);
  OpParamDef &ValueDepend(Option value_depend);
  OpParamDef &AutoContiguous();
};

class OpAttrDef {
 public:
  explicit OpAttrDef(const char *name);
  OpAttrDef &AttrType(Option attr_type);
  OpAttrDef &Bool(bool value);
  OpAttrDef &Float(float value);
  OpAttrDef &Int(int64_t value);
  OpAttrDef &String(const char *value);
};

class OpAICoreConfig {
 public:
  OpAICoreConfig();
  OpAICoreConfig &DynamicCompileStaticFlag(bool flag);
  OpAICoreConfig &DynamicRankSupportFlag(bool flag);
  OpAICoreConfig &DynamicShapeSupportFlag(bool flag);
};

class OpAICoreDef {
 public:
  OpAICoreDef &SetTiling(gert::OpImplRegisterV2::TilingKernelFunc func);
  OpAICoreDef &AddConfig(const char *soc);
  OpAICoreDef &AddConfig(const char *soc, OpAICoreConfig &aicore_config);
};

class OpDef {
 public:
  explicit OpDef(const char *type);
  OpParamDef &Input(const char *name);
  OpParamDef &Output(const char *name);
  OpAttrDef &Attr(const char *name);
  OpDef &SetInferShape(gert::OpImplRegisterV2::InferShapeKernelFunc func);
  OpDef &SetInferDataType(gert::OpImplRegisterV2::InferDataTypeKernelFunc func);
  OpAICoreDef &AICore(void);
};

}  // namespace ops

// The registration object (the real macro also builds OpImplRegisterV2 entries from it).
#define OP_ADD(opType, ...)                                                          \
  static int g_##opType##_added __attribute__((unused)) = [](const char *name) { \
    opType op(name);                                                                 \
    return 0;                                                                        \
  }(#opType)
