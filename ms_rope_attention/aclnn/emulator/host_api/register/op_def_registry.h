// After metadef inc/external/asc/register/op_def.h, op_def_registry.h and op_impl_registry.h: the
// OpDef builder calls op_host and the generated rotary_flash_attention_opdef.h make.
#pragma once
#include <stdint.h>

#include <vector>

#include "exe_graph/runtime/tiling_context.h"
#include "graph/types.h"

namespace gert {
class InferShapeRangeContext;
class TilingParseContext;
// What OP_ADD's expansions call on the implementation registry (metadef register/op_impl_registry.h).
class OpImplRegisterV2 {
 public:
  using InferShapeKernelFunc = ge::graphStatus (*)(InferShapeContext *);
  using InferShapeRangeKernelFunc = ge::graphStatus (*)(InferShapeRangeContext *);
  using InferDataTypeKernelFunc = ge::graphStatus (*)(InferDataTypeContext *);
  using TilingKernelFunc = ge::graphStatus (*)(TilingContext *);
  using TilingParseFunc = ge::graphStatus (*)(TilingParseContext *);
  explicit OpImplRegisterV2(const char *op_type);
  OpImplRegisterV2(const OpImplRegisterV2 &register_data);
  OpImplRegisterV2 &InferShape(InferShapeKernelFunc infer_shape_func);
  OpImplRegisterV2 &InferShapeRange(InferShapeRangeKernelFunc infer_shape_range_func);
  OpImplRegisterV2 &InferDataType(InferDataTypeKernelFunc infer_datatype_func);
  OpImplRegisterV2 &Tiling(TilingKernelFunc tiling_func);
  template <typename CompileInfo>
  OpImplRegisterV2 &TilingParse(TilingParseFunc tiling_parse_func);
};
}  // namespace gert

namespace optiling {
// The op-check hooks OP_ADD registers under OP_TILING_LIB (metadef register/op_check.h).
enum CheckFunc { FUNC_CHECK_SUPPORTED, FUNC_OP_SELECT_FORMAT, FUNC_GET_OP_SUPPORT_INFO, FUNC_GET_SPECIFIC_INFO };
using OpCheckFunc = int (*)(const void *, const void *, void *);
using ParamGeneralizeFunc = int (*)(const void *, const void *, void *);
class OpCheckFuncHelper {
 public:
  OpCheckFuncHelper(CheckFunc check_type, const char *op_type, OpCheckFunc func);
  OpCheckFuncHelper(const char *op_type, ParamGeneralizeFunc func);
};
}  // namespace optiling

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
  gert::OpImplRegisterV2::TilingKernelFunc &GetTiling(void);
  optiling::OpCheckFunc &GetCheckSupport(void);
  optiling::OpCheckFunc &GetOpSelectFormat(void);
  optiling::OpCheckFunc &GetOpSupportInfo(void);
  optiling::OpCheckFunc &GetOpSpecInfo(void);
  optiling::ParamGeneralizeFunc &GetParamGeneralize(void);
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
  gert::OpImplRegisterV2::InferShapeKernelFunc &GetInferShape(void);
  gert::OpImplRegisterV2::InferShapeRangeKernelFunc &GetInferShapeRange(void);
  gert::OpImplRegisterV2::InferDataTypeKernelFunc &GetInferDataType(void);
  OpAICoreDef &AICore(void);
};

// The registry OP_ADD's default expansion adds to (metadef register/op_def_factory.h): a factory
// that builds the op's OpDef *by value* from its name.
using OpDefCreator = OpDef (*)(const char *);
class OpDefFactory {
 public:
  static int OpDefRegister(const char *name, OpDefCreator func);
};

}  // namespace ops

// OP_ADD as the real header defines it, in its three builds: the op proto library (OP_PROTO_LIB)
// registers InferShape/InferShapeRange/InferDataType, the tiling library (OP_TILING_LIB) the
// tiling function, a TilingParse for a placeholder compile-info type and the op-check hooks, and
// any other build a factory returning the op as an ops::OpDef by value. Like the real one it expands
// to lambdas with a parameter it does not use: this header, as CANN's, is compiled as a system one.
#if defined(OP_PROTO_LIB)
#define OP_ADD(opType, ...)                                                          \
  static int g_##opType##_added = [](const char *name) {                             \
    opType op(#opType);                                                              \
    gert::OpImplRegisterV2 impl(#opType);                                            \
    impl.InferShape(op.GetInferShape())                                              \
        .InferShapeRange(op.GetInferShapeRange())                                    \
        .InferDataType(op.GetInferDataType());                                       \
    gert::OpImplRegisterV2 registered(impl);                                         \
    return 0;                                                                        \
  }(#opType)
#elif defined(OP_TILING_LIB)
#define OP_ADD(opType, ...)                                                                          \
  struct OpAddCompileInfo##opType {};                                                                \
  static ge::graphStatus TilingPrepare##opType(gert::TilingParseContext *context) {                  \
    return ge::GRAPH_SUCCESS;                                                                        \
  }                                                                                                  \
  static int g_##opType##_added = [](const char *name) {                                             \
    opType op(#opType);                                                                              \
    gert::OpImplRegisterV2 impl(#opType);                                                            \
    impl.Tiling(op.AICore().GetTiling());                                                            \
    impl.TilingParse<OpAddCompileInfo##opType>(TilingPrepare##opType);                               \
    optiling::OpCheckFuncHelper(optiling::FUNC_CHECK_SUPPORTED, #opType, op.AICore().GetCheckSupport()); \
    optiling::OpCheckFuncHelper(optiling::FUNC_OP_SELECT_FORMAT, #opType, op.AICore().GetOpSelectFormat()); \
    optiling::OpCheckFuncHelper(optiling::FUNC_GET_OP_SUPPORT_INFO, #opType, op.AICore().GetOpSupportInfo()); \
    optiling::OpCheckFuncHelper(optiling::FUNC_GET_SPECIFIC_INFO, #opType, op.AICore().GetOpSpecInfo()); \
    optiling::OpCheckFuncHelper(#opType, op.AICore().GetParamGeneralize());                          \
    gert::OpImplRegisterV2 registered(impl);                                                         \
    return 0;                                                                                        \
  }(#opType)
#else
#define OP_ADD(opType, ...) \
  static int g_##opType##_added = ops::OpDefFactory::OpDefRegister(#opType, [](const char *name) -> ops::OpDef { return opType(name); })
#endif
