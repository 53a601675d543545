// The CPU kernel's forward against a float64 reference written here, without Python: what runs on a
// machine where only a C++ toolchain (and perhaps an emulator) is available, such as an aarch64
// build under qemu (tests/test_cross_builds.py). Links the kernel sources directly and calls the same
// C entry as ms_rope_attention.cpu_direct. BNSD; float32/float16/bfloat16; rotate-half and
// interleaved; full and partial rotary; GQA; causal and not; q_len < kv_len; S = 1; lengths that
// are not a multiple of any tile. Exit status 0 when every case is within tolerance.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "rfa_problem.h"

extern "C" int RotaryFlashAttentionRun(const rfa::Attrs *attrs, int *ndims, int64_t **shapes, const char **dtypes,
                                       void **params, int64_t rows, int64_t kv_block, int64_t pack_bytes, int rotate,
                                       int64_t stream_q_max);
extern "C" const char *RotaryFlashAttentionLastError();

namespace {

struct Case {
  const char *dtype;
  int64_t heads, kv_heads, q_len, kv_len, head_dim, rotary_dim, mode;
  bool causal;
};

// Element storage of one dtype (float16 as IEEE binary16 bits, bfloat16 as the top half of a float).
uint16_t ToHalfBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const int32_t exp = static_cast<int32_t>((u >> 23) & 0xff) - 127 + 15;
  uint32_t mant = u & 0x7fffffu;
  if (exp <= 0) return static_cast<uint16_t>(sign);  // inputs here are far from the subnormal range
  if (exp >= 31) return static_cast<uint16_t>(sign | 0x7c00u);
  uint32_t h = sign | (static_cast<uint32_t>(exp) << 10) | (mant >> 13);
  const uint32_t rest = mant & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;  // to nearest even
  return static_cast<uint16_t>(h);
}
float FromHalfBits(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ffu;
  uint32_t u = sign;
  if (exp != 0) u |= ((exp - 15 + 127) << 23) | (mant << 13);
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
uint16_t ToBf16Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
float FromBf16Bits(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// A tensor held in its dtype's bytes, plus the values those bytes mean (what the reference reads).
struct Tensor {
  std::string dtype;
  std::vector<uint8_t> bytes;
  std::vector<double> values;
  Tensor(const std::string &dt, const std::vector<float> &v) : dtype(dt), values(v.begin(), v.end()) {
    const size_t elem = dt == "float32" ? 4 : 2;
    bytes.resize(v.size() * elem);
    for (size_t i = 0; i < v.size(); ++i) {
      if (dt == "float32") {
        std::memcpy(&bytes[i * 4], &v[i], 4);
        continue;
      }
      const uint16_t b = dt == "float16" ? ToHalfBits(v[i]) : ToBf16Bits(v[i]);
      std::memcpy(&bytes[i * 2], &b, 2);
      values[i] = dt == "float16" ? FromHalfBits(b) : FromBf16Bits(b);
    }
  }
  double At(size_t i) const {
    if (dtype == "float32") {
      float f;
      std::memcpy(&f, &bytes[i * 4], 4);
      return f;
    }
    uint16_t b;
    std::memcpy(&b, &bytes[i * 2], 2);
    return dtype == "float16" ? FromHalfBits(b) : FromBf16Bits(b);
  }
};

// x (head_dim values) rotated at table row `pos` (tables are (rows, rotary_dim)).
std::vector<double> Rotate(const double *x, const std::vector<float> &cos, const std::vector<float> &sin, int64_t pos,
                           const Case &c) {
  std::vector<double> y(x, x + c.head_dim);
  const int64_t rd = c.rotary_dim, h = rd / 2;
  for (int64_t i = 0; i < rd; ++i) {
    double partner;
    if (c.mode == 0) partner = i < h ? -x[i + h] : x[i - h];
    else partner = i % 2 == 0 ? -x[i + 1] : x[i - 1];
    y[i] = x[i] * cos[pos * rd + i] + partner * sin[pos * rd + i];
  }
  return y;
}

bool RunCase(const Case &c, std::mt19937 &gen) {
  std::normal_distribution<float> normal;
  const int64_t b = 1, d = c.head_dim, rd = c.rotary_dim, group = c.heads / c.kv_heads;
  std::vector<float> q(b * c.heads * c.q_len * d), k(b * c.kv_heads * c.kv_len * d), v(k.size());
  for (auto *t : {&q, &k, &v})
    for (float &x : *t) x = normal(gen);
  std::vector<float> cos(c.kv_len * rd), sin(c.kv_len * rd);
  for (int64_t p = 0; p < c.kv_len; ++p)
    for (int64_t i = 0; i < rd; ++i) {
      const double angle = p * std::pow(10000.0, -2.0 * (i % (rd / 2)) / rd);
      cos[p * rd + i] = static_cast<float>(std::cos(angle));
      sin[p * rd + i] = static_cast<float>(std::sin(angle));
    }
  const Tensor tq(c.dtype, q), tk(c.dtype, k), tv(c.dtype, v);
  Tensor out(c.dtype, std::vector<float>(q.size())), rk(c.dtype, std::vector<float>(k.size()));
  std::vector<float> lse(b * c.heads * c.q_len);

  rfa::Attrs attrs;
  attrs.rotary_mode = c.mode;
  attrs.rotary_dim = rd;
  attrs.causal = c.causal;
  attrs.with_lse = true;
  attrs.with_rotated_key = true;
  std::vector<int64_t> qs{b, c.heads, c.q_len, d}, ks{b, c.kv_heads, c.kv_len, d}, ts{c.kv_len, rd}, none{0},
      ls{b, c.heads, c.q_len};
  int ndims[10] = {4, 4, 4, 2, 2, 0, 0, 4, 3, 4};
  int64_t *shapes[10] = {qs.data(), ks.data(), ks.data(), ts.data(), ts.data(), none.data(), none.data(), qs.data(),
                         ls.data(), ks.data()};
  const char *dtypes[10] = {c.dtype, c.dtype, c.dtype, "float32", "float32", "none", "none", c.dtype, "float32",
                            c.dtype};
  void *params[10] = {const_cast<uint8_t *>(tq.bytes.data()), const_cast<uint8_t *>(tk.bytes.data()),
                      const_cast<uint8_t *>(tv.bytes.data()), cos.data(), sin.data(), nullptr, nullptr,
                      out.bytes.data(), lse.data(), rk.bytes.data()};
  if (RotaryFlashAttentionRun(&attrs, ndims, shapes, dtypes, params, 0, 0, 0, 1, 0) != 0) {
    std::printf("FAIL %s: kernel error: %s\n", c.dtype, RotaryFlashAttentionLastError());
    return false;
  }

  const bool f32 = std::string(c.dtype) == "float32";
  const double ulp = std::string(c.dtype) == "float16" ? 1.0 / 1024 : 1.0 / 128;
  double out_err = 0, lse_err = 0, rk_err = 0;  // output and rotated key in units of their tolerance
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  for (int64_t h = 0; h < c.heads; ++h) {
    const int64_t g = h / group;
    std::vector<std::vector<double>> keys(c.kv_len);
    for (int64_t j = 0; j < c.kv_len; ++j) {
      keys[j] = Rotate(&tk.values[(g * c.kv_len + j) * d], cos, sin, j, c);
      if (h % group == 0)
        for (int64_t i = 0; i < d; ++i)
          rk_err = std::fmax(rk_err, std::fabs(rk.At((g * c.kv_len + j) * d + i) - keys[j][i]) /
                                         (f32 ? 1.0 : ulp * 2 * std::fmax(1.0, std::fabs(keys[j][i]))));
    }
    for (int64_t r = 0; r < c.q_len; ++r) {
      const int64_t pos = r + c.kv_len - c.q_len, seen = c.causal ? pos + 1 : c.kv_len;
      const std::vector<double> qr = Rotate(&tq.values[(h * c.q_len + r) * d], cos, sin, pos, c);
      std::vector<double> s(seen);
      double m = -INFINITY;
      for (int64_t j = 0; j < seen; ++j) {
        double dot = 0;
        for (int64_t i = 0; i < d; ++i) dot += qr[i] * keys[j][i];
        s[j] = dot * scale;
        m = std::fmax(m, s[j]);
      }
      double l = 0;
      for (double &x : s) l += (x = std::exp(x - m));
      lse_err = std::fmax(lse_err, std::fabs(lse[h * c.q_len + r] - (m + std::log(l))));
      for (int64_t i = 0; i < d; ++i) {
        double o = 0;
        for (int64_t j = 0; j < seen; ++j) o += s[j] / l * tv.values[(g * c.kv_len + j) * d + i];
        const size_t at = (h * c.q_len + r) * d + i;
        const double tol = f32 ? 2e-5 : 4 * ulp * std::fmax(1.0, std::fabs(o));
        out_err = std::fmax(out_err, std::fabs(out.At(at) - o) / tol);
      }
    }
  }
  const bool ok = out_err <= 1.0 && lse_err <= (f32 ? 1e-4 : 2e-2) && rk_err <= (f32 ? 1e-5 : 1.0);
  std::printf("%s %s heads %lld/%lld q %lld kv %lld d %lld rotary %lld mode %lld %s: out %.2f of tol, lse %.1e, "
              "rotated key %.2g\n", ok ? "ok  " : "FAIL", c.dtype, static_cast<long long>(c.heads),
              static_cast<long long>(c.kv_heads), static_cast<long long>(c.q_len), static_cast<long long>(c.kv_len),
              static_cast<long long>(d), static_cast<long long>(rd), static_cast<long long>(c.mode),
              c.causal ? "causal" : "full", out_err, lse_err, rk_err);
  return ok;
}

}  // namespace

int main() {
  std::mt19937 gen(7);
  const Case cases[] = {
      {"float32", 4, 2, 37, 37, 64, 64, 0, true},  {"float32", 4, 2, 1, 1, 64, 64, 1, true},
      {"float32", 2, 2, 1, 70, 64, 32, 0, true},   {"float32", 8, 1, 20, 53, 128, 128, 1, false},
      {"float32", 2, 1, 130, 131, 80, 80, 0, true}, {"float16", 4, 2, 33, 65, 64, 64, 0, true},
      {"float16", 4, 4, 17, 17, 128, 64, 1, false}, {"bfloat16", 4, 2, 29, 40, 64, 64, 1, true},
      // the decode path (q_len <= 16): split KV range, half caches read in place
      {"float32", 8, 2, 1, 1500, 64, 64, 0, true}, {"float16", 4, 1, 16, 700, 128, 128, 0, true},
      {"bfloat16", 4, 4, 3, 300, 64, 32, 1, false},
  };
  int failed = 0;
  for (const Case &c : cases) failed += RunCase(c, gen) ? 0 : 1;
  std::printf("%d of %zu cases failed\n", failed, sizeof(cases) / sizeof(cases[0]));
  return failed == 0 ? 0 : 1;
}
