// The bfloat16 projection's design choices on oneDNN, measured side by side in one process: W as the
// checkpoint stores it ((N, K) row-major, oneDNN's `ba` weights, what csrc/onednn_matmul.cc uses) against
// W reordered once into the primitive's own blocked layout (`format_tag::any`), and a primitive per M
// against one with a run-time M (DNNL_RUNTIME_DIM_VAL). Variants alternate call by call, min and median
// of the repeats; prints the kernel oneDNN dispatched (brg:avx512_core_amx, brg:avx512_core_bf16 ...).
//
// Built against the package's private copy and the onednn-devel-cpu-gomp wheel's headers (in .venv
// after `make sanitize`, or `pip install onednn-devel-cpu-gomp==2023.2.0`):
//   INC=$(python -c "import importlib.metadata as m; d = m.distribution('onednn-devel-cpu-gomp'); print(next(str(d.locate_file(f).resolve()) for f in d.files if str(f).endswith('oneapi/dnnl/dnnl.hpp')).rsplit('/oneapi/', 1)[0])")
//   g++ -O2 -std=c++17 benchmarks/onednn_layout.cc -I$INC ms_rope_attention/_onednn/libdnnl_rfa.so.3 -Wl,-rpath,$PWD/ms_rope_attention/_onednn -o /tmp/onednn_layout
//   /tmp/onednn_layout 512 11008 4096 10    # M N K repeats
#include <oneapi/dnnl/dnnl.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

using dnnl::memory;

namespace {

double Now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

}  // namespace

int main(int argc, char **argv) {
  if (argc != 5) {
    std::fprintf(stderr, "usage: %s M N K repeats\n", argv[0]);
    return 2;
  }
  const long m = std::atol(argv[1]), n = std::atol(argv[2]), k = std::atol(argv[3]);
  const int repeats = std::atoi(argv[4]);
  dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  dnnl::stream stream(engine);
  std::vector<uint16_t> x(m * k), w(n * k);
  std::vector<float> y(m * n);
  for (size_t i = 0; i < w.size(); ++i) w[i] = 0x3c00 + i % 7;  // small bfloat16 values
  for (size_t i = 0; i < x.size(); ++i) x[i] = 0x3f80 + i % 5;
  const auto bf16 = memory::data_type::bf16;
  const memory::desc src({m, k}, bf16, memory::format_tag::ab), dst({m, n}, memory::data_type::f32, memory::format_tag::ab);
  const memory::desc plain({k, n}, bf16, memory::format_tag::ba);
  const memory::desc src_any_m({DNNL_RUNTIME_DIM_VAL, k}, bf16, memory::format_tag::ab);
  const memory::desc dst_any_m({DNNL_RUNTIME_DIM_VAL, n}, memory::data_type::f32, memory::format_tag::ab);
  memory x_mem(src, engine, x.data()), y_mem(dst, engine, y.data()), w_plain(plain, engine, w.data());

  struct Variant {
    const char *name;
    dnnl::matmul::primitive_desc pd;
    memory weights;
    std::vector<double> seconds;
  };
  const dnnl::matmul::primitive_desc plain_pd(engine, src, plain, dst);
  const dnnl::matmul::primitive_desc packed_pd(engine, src, memory::desc({k, n}, bf16, memory::format_tag::any), dst);
  memory w_packed(packed_pd.weights_desc(), engine);
  dnnl::reorder(w_plain, w_packed).execute(stream, w_plain, w_packed);
  stream.wait();
  std::vector<Variant> variants = {{"plain (ba)", plain_pd, w_plain, {}},
                                   {"reordered once (any)", packed_pd, w_packed, {}},
                                   {"plain, run-time M", dnnl::matmul::primitive_desc(engine, src_any_m, plain, dst_any_m),
                                    w_plain, {}}};
  std::vector<dnnl::matmul> primitives;
  for (auto &v : variants) primitives.emplace_back(v.pd);
  for (int r = 0; r <= repeats; ++r)
    for (size_t i = 0; i < variants.size(); ++i) {
      const double t0 = Now();
      primitives[i].execute(stream, {{DNNL_ARG_SRC, x_mem}, {DNNL_ARG_WEIGHTS, variants[i].weights}, {DNNL_ARG_DST, y_mem}});
      stream.wait();
      if (r > 0) variants[i].seconds.push_back(Now() - t0);  // the first call of each: warm-up
    }
  const double flop = 2.0 * m * n * k;
  std::printf("M %ld N %ld K %ld, %d repeats, kernel %s; packed W %zu bytes (plain %ld)\n", m, n, k, repeats,
              plain_pd.impl_info_str(), packed_pd.weights_desc().get_size(), n * k * 2);
  const double base = *std::min_element(variants[1].seconds.begin(), variants[1].seconds.end());
  for (auto &v : variants) {
    std::sort(v.seconds.begin(), v.seconds.end());
    std::printf("  %-22s min %9.3f ms  median %9.3f ms  %7.1f GFLOP/s  time / reordered's %.3f\n", v.name,
                v.seconds[0] * 1e3, v.seconds[v.seconds.size() / 2] * 1e3, flop / v.seconds[0] * 1e-9, v.seconds[0] / base);
  }
  return 0;
}
