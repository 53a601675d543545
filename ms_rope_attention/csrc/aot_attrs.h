// The one reader of an aot op's attributes (the contracts' names, op_info/*.yaml) into rfa::Attrs,
// shared by the attention's entries (rfa_cpu_aot.cc) and the paged cache's (rfa_cpu_paged.cc); and
// of the projection's (rfa_cpu_linear.cc) and the norm's (rfa_cpu_norm.cc).
//
// Why one: the attributes are read by name, and two readers were two lists of names to keep equal
// to the contracts. An attribute an op does not have keeps the caller's default: the paged ops have
// no input_layout (TND) or causal, the cache write no head_num, scale or with_softmax_lse.
#pragma once
#include <string>

#include "aot_abi.h"
#include "rfa_problem.h"

namespace rfa {

// Every attribute `extra` has, over `*a`; "" or the message naming an invalid value.
inline std::string ReadAttrs(mindspore::AotExtra *extra, Attrs *a) {
  if (extra->HasAttr("head_num")) a->head_num = extra->GetInt("head_num");
  if (extra->HasAttr("input_layout")) {
    const std::string layout = extra->GetStr("input_layout");
    if (!ParseLayout(layout, &a->layout))
      return "input_layout: expected one of BNSD, BSND, BSH, TND, got '" + layout + "'";
  }
  if (extra->HasAttr("rotary_mode")) a->rotary_mode = extra->GetInt("rotary_mode");
  if (extra->HasAttr("rotary_dim")) a->rotary_dim = extra->GetInt("rotary_dim");
  if (extra->HasAttr("scale")) a->scale = extra->GetFloat("scale");
  if (extra->HasAttr("causal")) a->causal = extra->GetBool("causal");
  if (extra->HasAttr("with_softmax_lse")) a->with_lse = extra->GetBool("with_softmax_lse");
  if (extra->HasAttr("with_rotated_key")) a->with_rotated_key = extra->GetBool("with_rotated_key");
  if (extra->HasAttr("key_rotated")) a->key_rotated = extra->GetBool("key_rotated");
  if (extra->HasAttr("compute_dtype")) return ParseCompute(extra->GetStr("compute_dtype"), &a->compute);
  return "";
}

// RfaLinear's attributes (rfa_cpu_linear.cc), read here with the others over the caller's defaults;
// the linear library checks them at launch.
inline void ReadLinearAttrs(mindspore::AotExtra *extra, std::string *compute_dtype, int64_t *packed_out_features) {
  if (extra->HasAttr("compute_dtype")) *compute_dtype = extra->GetStr("compute_dtype");
  if (extra->HasAttr("packed_out_features")) *packed_out_features = extra->GetInt("packed_out_features");
}

// RfaRMSNorm's eps (rfa_cpu_norm.cc), over the caller's default; the norm checks it at launch.
inline void ReadNormAttrs(mindspore::AotExtra *extra, float *eps) {
  if (extra->HasAttr("eps")) *eps = extra->GetFloat("eps");
}

// What an entry's Init keeps for its launches: the attributes, and an error found reading them
// (reported at launch, where the message reaches the caller).
struct AotAttrs : mindspore::AotKernelData {
  Attrs attrs;
  std::string error;
};

// An entry's Init: the attributes read once per kernel instance, over `defaults`.
inline int InitAttrs(mindspore::AotExtra *extra, const Attrs &defaults) {
  auto *data = new AotAttrs;
  data->attrs = defaults;
  data->error = ReadAttrs(extra, &data->attrs);
  extra->SetKernelData(data);
  return 0;
}

// A launch's attributes as Init read them; null with `*error` set when Init did not run or failed.
inline const Attrs *AttrsOf(void *extra, std::string *error) {
  auto *data = static_cast<AotAttrs *>(static_cast<mindspore::AotExtra *>(extra)->KernelData());
  if (!data) *error = "kernel attributes missing (Init did not run)";
  else if (!data->error.empty()) *error = data->error;
  return data && data->error.empty() ? &data->attrs : nullptr;
}

// A launch's attributes of an entry that keeps its own AotKernelData (RfaLinear's, RfaSwiGLU's, RfaRMSNorm's):
// as its Init kept them, or `defaults` for a direct call (a null `extra`: the aot convention without
// MindSpore, as the tests and the Python wrappers call it); null when Init did not run.
template <typename Kept>
const Kept *LaunchAttrs(void *extra, const Kept &defaults) {
  if (!extra) return &defaults;
  return static_cast<const Kept *>(static_cast<mindspore::AotExtra *>(extra)->KernelData());
}

}  // namespace rfa
