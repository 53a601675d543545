// Row-level helpers shared by the forward and backward CPU kernels: dtype conversion of one row,
// the rotation (and its transpose, for gradients) in the kernel's feature order, the log-sum-exp
// merge of a row split over KV ranges (forward and decode), and scratch memory.
//
// Kernel feature order: rotated features first, mode 1 (interleaved) de-interleaved to [even | odd]
// pairs, so both rotary modes share the rotate-half arithmetic; then the pass-through features.
// Q K^T (and every gradient GEMM) is invariant under that common permutation.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>

#include "rfa_problem.h"
#include "simd.h"

namespace rfa {
namespace cpu {

inline int64_t RoundUp(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Row r of an item whose KV range was split over `nsplit` tasks, merged by log-sum-exp (base 2):
// `o` (Dp floats) gets the splits' unnormalised O rows, each weighted by 2^(m_s - m), and (*m, *l)
// the merged running max and sum. A split that saw no key (sum exactly 0) takes no part; a row no
// split saw comes out as zeros with (-inf, 0). A split whose scores were NaN (NaN in the row's query
// or its table row, or in a key it sees) has a NaN sum, and NaN then reaches o and l whatever the
// maxima are (its max may be -inf: NaN never wins a comparison). `partials` has O/M/L(item, split)
// as the forward's and decode's partial results do.
template <class Partials>
inline void MergeSplitRow(Partials &partials, int64_t item, int64_t nsplit, int64_t r, int64_t Dp, float *o,
                          float *m, float *l) {
  *m = kNegInf;
  *l = 0.f;
  bool seen = false;
  for (int64_t s = 0; s < nsplit; ++s)
    if (partials.L(item, s)[r] != 0.f) {
      seen = true;
      *m = std::max(*m, partials.M(item, s)[r]);
    }
  std::memset(o, 0, Dp * sizeof(float));
  if (!seen) return;
  for (int64_t s = 0; s < nsplit; ++s) {
    const float ls = partials.L(item, s)[r];
    if (ls == 0.f) continue;
    const float ms = partials.M(item, s)[r];
    const float w = ms == *m ? 1.0f : std::exp2(ms - *m);  // -inf - -inf would be NaN: a NaN split's max
    *l += ls * w;
    const float *po = partials.O(item, s) + r * Dp;
    for (int64_t d = 0; d < Dp; ++d) o[d] += po[d] * w;
  }
}

// Inside an OpenMP parallel region (every thread calls it: an orphaned worksharing loop), after the
// tasks' barrier: the task of split 0 of each item merges that item's splits (worker.MergeItem, which
// calls MergeSplitRow per row). A thread without scratch (`bound` false) takes no item.
template <class Worker, class Plan>
inline void MergeSplitItems(Worker &worker, const Plan &plan, bool bound) {
  const int64_t ntasks = static_cast<int64_t>(plan.tasks.size());
#pragma omp for schedule(dynamic, 1)
  for (int64_t i = 0; i < ntasks; ++i)
    if (bound && plan.tasks[i].split == 0) worker.MergeItem(plan.tasks[i]);
}

// 1 / l for a finished row: 0 for a row that saw no key (its output is 0, never NaN); NaN stays NaN.
inline float InverseSum(float l) { return l == 0.f ? 0.f : 1.0f / l; }

// A finished row's log-sum-exp in natural-log units from its base-2 max and sum: -inf for a row
// that saw no key; NaN for a NaN row, as the reference's.
inline float RowLse(float m, float l) {
  return l == 0.f ? kNegInf : (m + std::log2(l)) * 0.6931471805599453f;
}

// n elements of dtype t at element offset `off` of `base`, as float32.
inline void LoadRow(DType t, const void *base, int64_t off, int64_t n, float *dst) {
  switch (t) {
    case DType::F32:
      std::memcpy(dst, static_cast<const float *>(base) + off, n * sizeof(float));
      break;
    case DType::F16:
      simd::HalfToFloat(static_cast<const simd::Half *>(base) + off, dst, n);
      break;
    case DType::BF16:
      simd::BFloat16ToFloat(static_cast<const uint16_t *>(base) + off, dst, n);
      break;
  }
}

// The same row as float32, read in place when it already is (no copy), else converted into `tmp`.
inline const float *RowAsFloat(DType t, const void *base, int64_t off, int64_t n, float *tmp) {
  if (t == DType::F32) return static_cast<const float *>(base) + off;
  LoadRow(t, base, off, n, tmp);
  return tmp;
}

inline void StoreRow(DType t, const float *src, int64_t n, void *base, int64_t off) {
  switch (t) {
    case DType::F32:
      std::memcpy(static_cast<float *>(base) + off, src, n * sizeof(float));
      break;
    case DType::F16:
      simd::FloatToHalf(src, static_cast<simd::Half *>(base) + off, n);
      break;
    case DType::BF16:
      simd::FloatToBFloat16(src, static_cast<uint16_t *>(base) + off, n);
      break;
  }
}

// Float32 cos/sin rows at a position.
struct Tables {
  const Problem *p;
  const void *cos, *sin;
  const float *Row(const void *table, DType t, int64_t pos, float *tmp) const {
    return RowAsFloat(t, table, pos * p->rotary_dim, p->rotary_dim, tmp);
  }
};

// x (original feature order) -> y in kernel order, times `mul`: y = (x*cos + rot(x)*sin) * mul on
// the rotated features, x * mul on the rest.
inline void Rotate(const float *__restrict x, const float *__restrict c, const float *__restrict s, int64_t rd,
                   int64_t d, int64_t mode, float mul, float *__restrict y) {
  const int64_t h = rd / 2;
  if (mode == 0) {
    for (int64_t i = 0; i < h; ++i) {
      const float a = x[i], b = x[i + h];
      y[i] = (a * c[i] - b * s[i]) * mul;
      y[i + h] = (b * c[i + h] + a * s[i + h]) * mul;
    }
  } else {
    for (int64_t i = 0; i < h; ++i) {
      const float a = x[2 * i], b = x[2 * i + 1];
      y[i] = (a * c[2 * i] - b * s[2 * i]) * mul;
      y[i + h] = (b * c[2 * i + 1] + a * s[2 * i + 1]) * mul;
    }
  }
  for (int64_t i = rd; i < d; ++i) y[i] = x[i] * mul;
}

// The transpose of Rotate, for gradients: dy (kernel order) -> dx (original order), times `mul`.
// RoPE is a rotation, so dx = cos*dy - rot(sin*dy) un-rotates the gradient of a rotated row.
inline void RotateTransposed(const float *__restrict dy, const float *__restrict c, const float *__restrict s,
                             int64_t rd, int64_t d, int64_t mode, float mul, float *__restrict dx) {
  const int64_t h = rd / 2;
  if (mode == 0) {
    for (int64_t i = 0; i < h; ++i) {
      const float a = dy[i], b = dy[i + h];
      dx[i] = (a * c[i] + b * s[i + h]) * mul;
      dx[i + h] = (b * c[i + h] - a * s[i]) * mul;
    }
  } else {
    for (int64_t i = 0; i < h; ++i) {
      const float a = dy[i], b = dy[i + h];
      dx[2 * i] = (a * c[2 * i] + b * s[2 * i + 1]) * mul;
      dx[2 * i + 1] = (b * c[2 * i + 1] - a * s[2 * i]) * mul;
    }
  }
  for (int64_t i = rd; i < d; ++i) dx[i] = dy[i] * mul;
}

// Original order -> kernel order without rotating (only mode 1 differs): an already-rotated key
// (attrs.key_rotated) must meet Q in the same de-interleaved feature order.
inline void ToKernelOrder(const float *x, int64_t rd, int64_t d, int64_t mode, float *y) {
  if (mode == 0) {
    std::memcpy(y, x, d * sizeof(float));
    return;
  }
  const int64_t h = rd / 2;
  for (int64_t i = 0; i < h; ++i) {
    y[i] = x[2 * i];
    y[i + h] = x[2 * i + 1];
  }
  std::memcpy(y + rd, x + rd, (d - rd) * sizeof(float));
}

// Kernel order -> original order (only mode 1 differs).
inline void ToOriginalOrder(const float *y, int64_t rd, int64_t d, int64_t mode, float *x) {
  if (mode == 0) {
    std::memcpy(x, y, d * sizeof(float));
    return;
  }
  const int64_t h = rd / 2;
  for (int64_t i = 0; i < h; ++i) {
    x[2 * i] = y[i];
    x[2 * i + 1] = y[i + h];
  }
  std::memcpy(x + rd, y + rd, (d - rd) * sizeof(float));
}

struct AlignedFree {
  void operator()(float *p) const { std::free(p); }
};

// 64-byte aligned float scratch grown on demand and kept across calls (OpenMP keeps its threads,
// so a thread_local one is reused by every launch). Builds with RFA_EXACT_SCRATCH (the sanitizer
// builds) allocate exactly what each call asks for, so an earlier, larger call cannot hide a later
// call's overrun from AddressSanitizer.
struct Scratch {
  std::unique_ptr<float, AlignedFree> mem;
  size_t capacity = 0;
  float *Get(size_t floats) {
    floats = floats < 16 ? 16 : floats;  // never a zero-byte request: empty problems get a valid pointer
#ifdef RFA_EXACT_SCRATCH
    const bool grow = floats != capacity;
#else
    const bool grow = floats > capacity;
#endif
    if (grow) {
      mem.reset();
      capacity = 0;
      if (floats > std::numeric_limits<size_t>::max() / sizeof(float)) return nullptr;
      void *p = nullptr;
      if (posix_memalign(&p, 64, floats * sizeof(float)) != 0) return nullptr;
      mem.reset(static_cast<float *>(p));
      capacity = floats;
    }
    return mem.get();
  }
};

// The regions a worker carves from one scratch block, listed once: the block's size and every
// region's offset come from the same list, so a region added or resized can never run past the end
// (each region starts 64-byte aligned). Fixed capacity: no allocation inside an OpenMP region.
class ScratchRegions {
 public:
  // `*region` will point at `floats` floats of the block; false when the list is full or the size
  // is negative or overflows (Carve then refuses).
  ScratchRegions &Add(float **region, int64_t floats) {
    if (count_ == kMax || floats < 0 || floats > kMaxFloats - total_) {
      bad_ = true;
      return *this;
    }
    regions_[count_++] = {region, floats};
    total_ += RoundUp(floats, kAlign);
    return *this;
  }
  int64_t Floats() const { return total_; }
  // Points every region into `scratch` (grown to Floats()); false when the list was refused or the
  // allocation failed (no region is set then).
  bool Carve(Scratch *scratch) const {
    if (bad_) return false;
    float *base = scratch->Get(static_cast<size_t>(total_));
    if (!base) return false;
    const float *end = base + total_;
    for (int i = 0; i < count_; ++i) {
      *regions_[i].ptr = base;
      base += RoundUp(regions_[i].floats, kAlign);
    }
#ifdef RFA_EXACT_SCRATCH
    if (base > end) std::abort();  // cannot happen by construction; the sanitizer builds make sure
#endif
    (void)end;
    return true;
  }

 private:
  static constexpr int kMax = 16;
  static constexpr int64_t kAlign = 16;  // floats: 64 bytes
  static constexpr int64_t kMaxFloats = std::numeric_limits<int64_t>::max() / 8;
  struct Region {
    float **ptr;
    int64_t floats;
  };
  Region regions_[kMax] = {};
  int count_ = 0;
  int64_t total_ = 0;
  bool bad_ = false;
};

}  // namespace cpu
}  // namespace rfa
