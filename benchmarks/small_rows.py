"""Decode-sized products (y = x W^T for M = 1..16 rows of x) against this machine's read bandwidth,
in one run: ms_rope_attention/csrc/weight_rows.h's products compiled now into one C++ program
(benchmarks/small_rows.cc, the projection library's AVX-512 flags) and timed side by side, W's rows
split across the threads as the projection library splits them:

- float32 W, float32 arithmetic (SmallRowsProduct<float>);
- float16 W converted to float32 in registers (F16C), float32 arithmetic;
- bfloat16 W converted to float32 in registers, float32 arithmetic;
- bfloat16 W by vdpbf16ps on x rounded to bfloat16 (FloatToBFloat16 + SmallRowsProductBF16, both
  timed), where the CPU has avx512_bf16.

GB/s is the bytes of W over the call's time. "% read" is that against a read-only pass over as many
bytes (a vector sum, same threads, same slices) timed in the same rotation, so a machine shared with
other work slows the reference as it slows the products; "% bw" against harness.read_bandwidth(),
measured in this run before and after the products (the larger of the two: the lower fraction).
Every call reads its W from a different place of a pool (--pool-mib, default 2 GiB) so W comes from
memory, as in a decode step. Calls alternate product by product, the order turning every round;
min and median over --rounds.

    python benchmarks/small_rows.py                       # Llama2-7B's shapes, M = 1 2 8 16, 2 threads
    python benchmarks/small_rows.py --shapes 4096x4096 --rows 1 --threads 1
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import tempfile

from harness import cpu_flags, read_bandwidth

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(HERE, "small_rows.cc")
CSRC = os.path.join(HERE, "..", "ms_rope_attention", "csrc")
# setup.py's flags for the AVX-512 build of the projection library (its -O3, not the sanitizer's).
FLAGS = ["-std=c++17", "-O3", "-fopenmp", "-Wall", "-Wextra", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
         "-mavx2", "-mfma", "-mf16c"]
SHAPES = {"11008x4096": "gate / up", "4096x4096": "q / k / v / o", "4096x11008": "down", "32000x4096": "LM head"}


def compile_program(out_dir: str) -> str:
    compiler = shlex.split(os.environ.get("CXX", "g++"))
    if not shutil.which(compiler[0]):
        raise SystemExit(f"no C++ compiler: {compiler[0]} is not found (set CXX)")
    out = os.path.join(out_dir, "small_rows")
    done = subprocess.run([*compiler, *FLAGS, f"-I{CSRC}", SOURCE, "-o", out], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(compiler)} failed:\n{done.stderr}")
    return out


def measure(program: str, shape: str, rows: list[int], threads: int, rounds: int, pool_mib: int) -> list[dict]:
    n, k = (int(v) for v in shape.split("x"))
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    done = subprocess.run([program, str(n), str(k), str(rounds), str(pool_mib), *map(str, rows)], env=env,
                          capture_output=True, text=True, check=True)
    points = [json.loads(line) for line in done.stdout.splitlines()]
    for point in points:
        for product in point["products"].values():
            product["min_s"] = min(product["times_s"])
            product["median_s"] = statistics.median(product["times_s"])
    return points


READ_ONLY = "read only (sum of the bytes)"


def table(results: dict) -> str:
    bandwidth = results["read_bandwidth_gb_per_s"]
    lines = [f"read bandwidth (harness.read_bandwidth): {bandwidth:.1f} GB/s (before "
             f"{results['read_bandwidth_before']['bytes_per_s'] / 1e9:.1f}, after "
             f"{results['read_bandwidth_after']['bytes_per_s'] / 1e9:.1f}); {results['threads']} threads, "
             f"{results['rounds']} rounds. % read: of the read-only pass in the same rotation (best to best, "
             "median to median); % bw: best of harness.read_bandwidth",
             f"{'W (N, K)':<12} {'M':>3}  {'product':<28} {'min ms':>8} {'med ms':>8} {'GB/s':>6} {'% read':>6} "
             f"{'% bw':>5} {'med GB/s':>8} {'med % read':>10}"]
    for point in results["points"]:
        read = point["products"][READ_ONLY]
        read_best, read_median = read["weight_bytes"] / read["min_s"], read["weight_bytes"] / read["median_s"]
        for name, p in point["products"].items():
            best, median = p["weight_bytes"] / p["min_s"], p["weight_bytes"] / p["median_s"]
            lines.append(f"{point['n']}x{point['k']:<7} {point['m']:>3}  {name:<28} {p['min_s'] * 1e3:8.2f} "
                         f"{p['median_s'] * 1e3:8.2f} {best / 1e9:6.1f} {100 * best / read_best:6.0f} "
                         f"{100 * best / 1e9 / bandwidth:5.0f} {median / 1e9:8.1f} {100 * median / read_median:10.0f}")
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), help="W's shapes, NxK (out x in features)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 8, 16], help="M, the rows of x")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--pool-mib", type=int, default=2048, help="the memory W is taken from in turn")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    if not {"avx512f", "avx512bw"} <= cpu_flags():
        raise SystemExit("needs an AVX-512 CPU (the program is the projection library's AVX-512 build)")
    before = read_bandwidth()
    with tempfile.TemporaryDirectory(prefix="small-rows-") as scratch:
        program = compile_program(scratch)
        points = [p for shape in args.shapes
                  for p in measure(program, shape, args.rows, args.threads, args.rounds, args.pool_mib)]
    after = read_bandwidth()
    results = {"read_bandwidth_before": before, "read_bandwidth_after": after,
               "read_bandwidth_gb_per_s": max(before["bytes_per_s"], after["bytes_per_s"]) / 1e9,
               "avx512_bf16": "avx512_bf16" in cpu_flags(), **vars(args), "points": points}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "small_rows.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    print(table(results))
    print(f"wrote {path}")
    return results


if __name__ == "__main__":
    main()
