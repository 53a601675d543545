// ABI mirror of MindSpore 2.10's AotExtra (utils/custom_aot_extra.h), with no MindSpore includes.
//
// Why: the shipped header's Attr<T>() returns T() for every attribute, and it drags in MindSpore's
// internal headers and libmindspore_core. This mirror keeps the exact virtual order and data
// members, so the object MindSpore passes in can be read through it. Must be built with
// -D_GLIBCXX_USE_CXX11_ABI=0 (std::string crosses the vtable). A test reads every attr type, so
// drift in a future MindSpore version is caught.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

// MindSpore's TypeId (mindapi/base/type_id.h) as the C++ InferType entries receive and return it;
// only the value of float32 is needed here (the other outputs take an input's type).
enum TypeId : int {};
constexpr TypeId kFloat32TypeId = static_cast<TypeId>(43);  // kNumberTypeFloat32 in MindSpore 2.10

namespace mindspore {
class AotKernelData {
 public:
  virtual ~AotKernelData() = default;
};

class AotExtra {
 public:
  virtual ~AotExtra() = default;
  virtual bool HasAttr(std::string name) = 0;
  float GetFloat(const std::string &name) { return GetAttrFloat(name); }
  bool GetBool(const std::string &name) { return GetAttrBool(name); }
  int64_t GetInt(const std::string &name) { return GetAttrInt(name); }
  std::string GetStr(const std::string &name) { return GetAttrStr(name); }
  void SetWorkSpace(const std::vector<size_t> &workspace) { workspace_ = workspace; }
  void SetKernelData(AotKernelData *data) { kernel_data_ = data; }
  AotKernelData *KernelData() const { return kernel_data_; }

 private:
  virtual bool GetAttrBool(std::string name) = 0;
  virtual int64_t GetAttrInt(std::string name) = 0;
  virtual float GetAttrFloat(std::string name) = 0;
  virtual std::string GetAttrStr(std::string name) = 0;
  virtual std::vector<int64_t> GetAttrIntVec(std::string name) = 0;
  virtual std::vector<float> GetAttrFloatVec(std::string name) = 0;
  virtual std::vector<std::vector<int64_t>> GetAttrInt2DVec(std::string name) = 0;
  virtual std::vector<std::vector<float>> GetAttrFloat2DVec(std::string name) = 0;
  std::vector<size_t> workspace_;
  AotKernelData *kernel_data_{nullptr};
};
}  // namespace mindspore
