// See onednn_matmul.h. Compiled into every instruction-set build of the projection library: oneDNN
// picks its own kernels for the running CPU (brg:avx512_core_amx, brg:avx512_core_bf16, ...).
#include "onednn_matmul.h"

#ifdef RFA_WITH_ONEDNN
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <new>
#include <unordered_map>

#include <oneapi/dnnl/dnnl.hpp>
#endif

namespace rfa {
namespace onednn {

#ifndef RFA_WITH_ONEDNN

bool Built() { return false; }
std::string BoundLibrary() { return ""; }
std::string BoundLibraryProblem() { return ""; }
std::string NativeBf16Problem() { return ""; }
bool UsesAmx() { return false; }
void MultiplyBf16(int64_t, int64_t, int64_t, const float *, const uint16_t *, float *) {}
int64_t PackedBytes(int64_t, int64_t) { return 0; }
void Pack(int64_t, int64_t, const uint16_t *, void *) {}
std::string PackedProblem(int64_t, int64_t, const void *, const std::string &) { return ""; }
void MultiplyBf16Packed(int64_t, int64_t, int64_t, const float *, const void *, float *) {}
void SwiGluBf16(int64_t, int64_t, int64_t, const float *, const uint16_t *, const uint16_t *, float *) {}
void SwiGluBf16Packed(int64_t, int64_t, int64_t, const float *, const void *, const void *, float *) {}

#else

namespace {

using dnnl::memory;

// The version setup.py copied from the onednn-cpu-gomp wheel (its major.minor; any patch).
constexpr int kMajor = 3, kMinor = 2;

const char *RuntimeName(unsigned runtime) {
  switch (runtime) {
    case DNNL_RUNTIME_NONE: return "no";
    case DNNL_RUNTIME_SEQ: return "sequential";
    case DNNL_RUNTIME_OMP: return "OpenMP";
    case DNNL_RUNTIME_TBB: return "TBB";
    case DNNL_RUNTIME_THREADPOOL: return "threadpool";
    default: return "unknown";
  }
}

const char *IsaName(dnnl::cpu_isa isa) {
  switch (isa) {
    case dnnl::cpu_isa::sse41: return "sse41";
    case dnnl::cpu_isa::avx: return "avx";
    case dnnl::cpu_isa::avx2: return "avx2";
    case dnnl::cpu_isa::avx2_vnni: return "avx2_vnni";
    case dnnl::cpu_isa::avx2_vnni_2: return "avx2_vnni_2";
    case dnnl::cpu_isa::avx512_core: return "avx512_core";
    case dnnl::cpu_isa::avx512_core_vnni: return "avx512_core_vnni";
    default: return "unknown";
  }
}

// float32 -> bfloat16 bits, round to nearest even; a NaN stays a (quiet) NaN of the same sign
// (rounding its bits could carry into the exponent and give an infinity).
inline uint16_t RoundToBf16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((bits >> 16) | 0x0040u);
  return static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

void RoundRows(int64_t count, const float *x, uint16_t *out) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < count; ++i) out[i] = RoundToBf16(x[i]);
}

const dnnl::engine &Engine() {
  static const dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

}  // namespace

bool Built() { return true; }

std::string BoundLibrary() {
  const dnnl_version_t *v = dnnl_version();
  return "oneDNN " + std::to_string(v->major) + "." + std::to_string(v->minor) + "." + std::to_string(v->patch) + " (" +
         RuntimeName(v->cpu_runtime) + " runtime)";
}

std::string BoundLibraryProblem() {
  const dnnl_version_t *v = dnnl_version();
  if (v->major == kMajor && v->minor == kMinor && v->cpu_runtime == DNNL_RUNTIME_OMP) return "";
  return "the projection library is bound to " + BoundLibrary() + ", expected its private copy of oneDNN " +
         std::to_string(kMajor) + "." + std::to_string(kMinor) +
         " (OpenMP runtime, _onednn/libdnnl_rfa.so.3 beside it): another oneDNN (MindSpore's?) was loaded in its "
         "place; reinstall the package";
}

std::string NativeBf16Problem() {
  const dnnl::cpu_isa isa = dnnl::get_effective_cpu_isa();
  for (dnnl::cpu_isa native : {dnnl::cpu_isa::avx512_core_bf16, dnnl::cpu_isa::avx512_core_fp16,
                               dnnl::cpu_isa::avx512_core_amx, dnnl::cpu_isa::avx512_core_amx_fp16})
    if (isa == native) return "";
  return std::string("needs bfloat16 instructions (AVX512-BF16 or AMX-BF16), which oneDNN does not find on this CPU "
                     "(its best: ") + IsaName(isa) + ", within ONEDNN_MAX_CPU_ISA if set); use 'float32'";
}

bool UsesAmx() {
  const dnnl::cpu_isa isa = dnnl::get_effective_cpu_isa();
  return isa == dnnl::cpu_isa::avx512_core_amx || isa == dnnl::cpu_isa::avx512_core_amx_fp16;
}

namespace {

memory::desc PlainWeights(int64_t n, int64_t k) {
  // W (n, k) row-major is oneDNN's (k, n) weights in the `ba` layout.
  return memory::desc({k, n}, memory::data_type::bf16, memory::format_tag::ba);
}

// The blocked layout oneDNN's matmul picks for (k, n) bfloat16 weights (`any`). It did not change
// with M (checked for M = 1..8192 and N/K from 1 to 32000 on AMX), so one packed copy serves every
// call; a call whose M prefers another layout still runs, on the kernel that takes this one.
memory::desc PackedWeights(int64_t n, int64_t k) {
  constexpr int64_t kAnyM = 512;
  const dnnl::matmul::primitive_desc pd(Engine(), memory::desc({kAnyM, k}, memory::data_type::bf16, memory::format_tag::ab),
                                        memory::desc({k, n}, memory::data_type::bf16, memory::format_tag::any),
                                        memory::desc({kAnyM, n}, memory::data_type::f32, memory::format_tag::ab));
  return pd.weights_desc();
}

// A packed buffer: up to 63 bytes of slack, oneDNN's layout from the first 64-byte boundary (a
// payload 16 bytes off it ran 1.3-2x slower on AMX; large MindSpore and numpy buffers start 16 bytes
// off), then at a fixed place a trailer of what it was packed for, so a buffer used with another
// shape (an N within the same padding block has the same size), or packed on another CPU, is
// refused instead of read as a wrong W. The payload's offset is the one chosen when packing: a
// buffer copied to another alignment stays right, only slower.
struct PackedTrailer {
  char magic[8];
  int64_t n, k;
  uint64_t layout;  // LayoutHash of the blocked layout
  int64_t offset;   // of the payload from the buffer's start
  char reserved[24];
};
static_assert(sizeof(PackedTrailer) == kPackedTrailerBytes, "the trailer's size");
constexpr char kMagic[8] = {'R', 'F', 'A', 'P', 'A', 'C', 'K', '1'};

uint64_t LayoutHash(const memory::desc &md) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a over the layout's numbers
  auto mix = [&h](int64_t v) {
    for (int i = 0; i < 8; ++i) h = (h ^ static_cast<uint64_t>((v >> (8 * i)) & 0xFF)) * 1099511628211ull;
  };
  for (auto v : md.get_dims()) mix(v);
  for (auto v : md.get_strides()) mix(v);
  for (auto v : md.get_inner_blks()) mix(v);
  for (auto v : md.get_inner_idxs()) mix(v);
  mix(static_cast<int64_t>(md.get_size()));
  return h;
}

// A growing buffer of this thread, 64-byte aligned (the AMX kernels read x from it: a packed W 16
// bytes off that boundary ran 1.3-2x slower). The sanitizer build (RFA_EXACT_SCRATCH) sizes it exactly
// at each call, so that an overrun by the library's own code is caught whatever an earlier call needed.
class AlignedBuffer {
 public:
  ~AlignedBuffer() { std::free(data_); }
  void *Get(size_t bytes) {
#ifdef RFA_EXACT_SCRATCH
    const bool grow = bytes != capacity_;
    const size_t size = bytes;
#else
    const bool grow = bytes > capacity_;
    const size_t size = (bytes + 63) / 64 * 64;
#endif
    if (grow) {
      std::free(data_);
      data_ = nullptr;
      capacity_ = 0;
      if (posix_memalign(&data_, 64, std::max<size_t>(size, 1)) != 0) {
        data_ = nullptr;
        throw std::bad_alloc();
      }
      capacity_ = size;
    }
    return data_;
  }

 private:
  void *data_ = nullptr;
  size_t capacity_ = 0;
};

// x (m, k) rounded once into this thread's buffer (MindSpore may launch on several threads at once).
const uint16_t *RoundedX(int64_t m, int64_t k, const float *x) {
  thread_local AlignedBuffer x_buffer;
  auto *x_bf16 = static_cast<uint16_t *>(x_buffer.Get(static_cast<size_t>(m * k) * sizeof(uint16_t)));
  RoundRows(m * k, x, x_bf16);
  return x_bf16;
}

// y = x_bf16 W^T; with `up` (m x n float32), y = swish(x_bf16 W^T) * up, the epilogue as the matmul's
// post-ops (eltwise swish with alpha 1: s / (1 + exp(-s)), then binary mul with `up` as src1).
void Product(int64_t m, int64_t n, int64_t k, const uint16_t *x_bf16, const memory::desc &weights, const void *w,
             float *y, const float *up) {
  // The scratchpad is this thread's, so concurrent launches of one cached primitive never share one.
  const memory::desc src({m, k}, memory::data_type::bf16, memory::format_tag::ab);
  const memory::desc dst({m, n}, memory::data_type::f32, memory::format_tag::ab);
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  if (up) {
    dnnl::post_ops epilogue;
    epilogue.append_eltwise(dnnl::algorithm::eltwise_swish, 1.0f, 0.0f);
    epilogue.append_binary(dnnl::algorithm::binary_mul, dst);
    attr.set_post_ops(epilogue);
  }
  const dnnl::matmul::primitive_desc pd(Engine(), src, weights, dst, attr);
  const dnnl::matmul matmul(pd);  // from oneDNN's primitive cache after the first call of a shape (and post-ops)

  thread_local AlignedBuffer scratch_buffer;
  void *scratch = scratch_buffer.Get(std::max<size_t>(1, pd.scratchpad_desc().get_size()));
  std::unordered_map<int, memory> args = {{DNNL_ARG_SRC, memory(src, Engine(), const_cast<uint16_t *>(x_bf16))},
                                          {DNNL_ARG_WEIGHTS, memory(weights, Engine(), const_cast<void *>(w))},
                                          {DNNL_ARG_DST, memory(dst, Engine(), y)},
                                          {DNNL_ARG_SCRATCHPAD, memory(pd.scratchpad_desc(), Engine(), scratch)}};
  if (up)  // the binary mul is post-op 1 (the swish is 0)
    args.insert({DNNL_ARG_ATTR_MULTIPLE_POST_OP(1) | DNNL_ARG_SRC_1, memory(dst, Engine(), const_cast<float *>(up))});
  dnnl::stream stream(Engine());
  matmul.execute(stream, args);
  stream.wait();
}

void Multiply(int64_t m, int64_t n, int64_t k, const float *x, const memory::desc &weights, const void *w, float *y) {
  Product(m, n, k, RoundedX(m, k, x), weights, w, y, nullptr);
}

// The up product into this thread's buffer, then the gate product with the SwiGLU post-ops; x rounded once.
void SwiGlu(int64_t m, int64_t n, int64_t k, const float *x, const memory::desc &weights, const void *gate,
            const void *up, float *y) {
  const uint16_t *x_bf16 = RoundedX(m, k, x);
  thread_local AlignedBuffer up_buffer;
  auto *u = static_cast<float *>(up_buffer.Get(static_cast<size_t>(m * n) * sizeof(float)));
  Product(m, n, k, x_bf16, weights, up, u, nullptr);
  Product(m, n, k, x_bf16, weights, gate, y, u);
}

}  // namespace

void MultiplyBf16(int64_t m, int64_t n, int64_t k, const float *x, const uint16_t *w, float *y) {
  Multiply(m, n, k, x, PlainWeights(n, k), w, y);
}

int64_t PackedBytes(int64_t n, int64_t k) {
  return kPackedSlackBytes + static_cast<int64_t>(PackedWeights(n, k).get_size()) + kPackedTrailerBytes;
}

namespace {

// The trailer's place: after the slack and the payload, whatever the offset.
const char *Trailer(const void *packed, const memory::desc &blocked) {
  return static_cast<const char *>(packed) + kPackedSlackBytes + blocked.get_size();
}

}  // namespace

void Pack(int64_t n, int64_t k, const uint16_t *w, void *packed) {
  const memory::desc blocked_md = PackedWeights(n, k);
  PackedTrailer trailer{};
  std::memcpy(trailer.magic, kMagic, sizeof(kMagic));
  trailer.n = n;
  trailer.k = k;
  trailer.layout = LayoutHash(blocked_md);
  trailer.offset = static_cast<int64_t>((64 - reinterpret_cast<uintptr_t>(packed) % 64) % 64);
  std::memcpy(const_cast<char *>(Trailer(packed, blocked_md)), &trailer, sizeof(trailer));
  memory plain(PlainWeights(n, k), Engine(), const_cast<uint16_t *>(w));
  memory blocked(blocked_md, Engine(), static_cast<char *>(packed) + trailer.offset);
  dnnl::stream stream(Engine());
  dnnl::reorder(plain, blocked).execute(stream, plain, blocked);
  stream.wait();
}

std::string PackedProblem(int64_t n, int64_t k, const void *packed, const std::string &name) {
  PackedTrailer trailer;
  std::memcpy(&trailer, Trailer(packed, PackedWeights(n, k)), sizeof(trailer));
  if (std::memcmp(trailer.magic, kMagic, sizeof(kMagic)) != 0 || trailer.offset < 0 || trailer.offset >= 64)
    return name + ": expected a buffer RfaLinearPack wrote (its trailer is missing)";
  if (trailer.n != n || trailer.k != k)
    return name + ": packed for (" + std::to_string(trailer.n) + ", " + std::to_string(trailer.k) +
           "), used as (packed_out_features, in_features) = (" + std::to_string(n) + ", " + std::to_string(k) + ")";
  if (trailer.layout != LayoutHash(PackedWeights(n, k)))
    return name + ": packed in another layout than this CPU's oneDNN picks (packed on another machine, or under "
           "another ONEDNN_MAX_CPU_ISA?): pack it again in this process";
  return "";
}

namespace {

// The payload of a buffer PackedProblem accepted.
const void *PackedPayload(const void *packed, const memory::desc &blocked) {
  PackedTrailer trailer;
  std::memcpy(&trailer, Trailer(packed, blocked), sizeof(trailer));
  return static_cast<const char *>(packed) + trailer.offset;
}

}  // namespace

void MultiplyBf16Packed(int64_t m, int64_t n, int64_t k, const float *x, const void *packed, float *y) {
  const memory::desc blocked = PackedWeights(n, k);
  Multiply(m, n, k, x, blocked, PackedPayload(packed, blocked), y);
}

void SwiGluBf16(int64_t m, int64_t n, int64_t k, const float *x, const uint16_t *gate, const uint16_t *up, float *y) {
  SwiGlu(m, n, k, x, PlainWeights(n, k), gate, up, y);
}

void SwiGluBf16Packed(int64_t m, int64_t n, int64_t k, const float *x, const void *gate, const void *up, float *y) {
  const memory::desc blocked = PackedWeights(n, k);
  SwiGlu(m, n, k, x, blocked, PackedPayload(gate, blocked), PackedPayload(up, blocked), y);
}

#endif  // RFA_WITH_ONEDNN

}  // namespace onednn
}  // namespace rfa
