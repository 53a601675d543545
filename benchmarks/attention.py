"""Kernel-level benchmark: fused RoPE+attention vs the unfused MindSpore path (and PyTorch when
installed), side by side in one run.

Reference shape: B=1, 32 query heads, D=128, causal, float32. Each competitor runs in its own child
process (so peak memory is its own, and an out-of-memory kill is reported, not crashed on).
Reports min and median of repeats, GFLOP/s (2*B*H*S^2*D for causal), % of a float32 GEMM peak
measured in the same run, the fused/unfused ratio, and the in-kernel RoPE cost (same kernel with the
rotation switched off). The kernel-direct series (with and without rotation, and PyTorch's SDPA in
the same process) take up to 10 rounds when they fit in about 30 s, and never fewer than --repeats.
``--compute-dtype`` sets the op's compute_dtype (several: the kernel-direct series of each run side by
side in one process, ``fused_direct`` the first, ``fused_direct_<dtype>`` the others; bfloat16 on the
units this process chose (machine.bf16_attention_units), and on each other unit this CPU runs too, as
``..._vdpbf16ps`` and ``..._fma`` (RFA_BF16_ATTENTION: csrc/bf16.h ChosenUnits)), and the GFLOP/s are
also given as fractions of the float32 FMA / bfloat16 dot-product / AMX peaks measured in the same run
(harness.arithmetic_peaks). Writes JSON and a plot.

    python benchmarks/attention.py --lengths 1024 2048 --repeats 3 --out benchmarks/results
    python benchmarks/attention.py --lengths 2048 8192 --compute-dtype float32 bfloat16 --competitors fused_direct
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
from pathlib import Path

import numpy as np

from harness import alternate, arithmetic_peaks, machine_info, memory_total_bytes, peak_fractions, run_isolated, timed


def _inputs(length, heads, kv_heads, head_dim, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, heads, length, head_dim), dtype=np.float32)
    k = rng.standard_normal((1, kv_heads, length, head_dim), dtype=np.float32)
    v = rng.standard_normal((1, kv_heads, length, head_dim), dtype=np.float32)
    return q, k, v


def run_mindspore(backend, length, heads, kv_heads, head_dim, dtype, repeats, compute_dtypes):
    import ms_rope_attention  # noqa: F401  before MindSpore, as users run it (docs/threads.md)
    import mindspore as ms
    from mindspore import Tensor, nn

    import ms_rope_attention as mra

    ms.set_device("CPU")
    ms.set_context(mode=ms.GRAPH_MODE)
    ms_dtype = {"float32": ms.float32, "float16": ms.float16, "bfloat16": ms.bfloat16}[dtype]

    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.attn = mra.RotaryFlashAttention(heads, head_dim, max_position_embeddings=length, backend=backend,
                                                 compute_dtype=compute_dtypes[0] if backend == "fused" else "auto")

        def construct(self, q, k, v):
            return self.attn(q, k, v)

    net = Net()
    q, k, v = (Tensor(x).astype(ms_dtype) for x in _inputs(length, heads, kv_heads, head_dim))
    return timed(lambda: net(q, k, v).asnumpy(), repeats)[1]


DIRECT_ROUNDS_MAX = 10        # rounds of the same-process series, at most ...
DIRECT_ROUNDS_SECONDS = 30.0  # ... and as many as fit in about this long (at least `repeats`)


def run_direct(length, heads, kv_heads, head_dim, dtype, repeats, compute_dtypes):
    """The fused kernel without MindSpore, with and without the rotation (the first of
    ``compute_dtypes``), in each other compute dtype, and PyTorch's SDPA when it is installed,
    alternating in one process on prepared buffers: ratios taken side by side rather than between
    processes run at different moments of a noisy machine. A round costs no graph compile, so these
    series take more rounds than `repeats` when they are short (the RoPE cost is a ratio of two of
    them, a few percent wide). Returns {series name: times}."""
    from ms_rope_attention import cpu_kernel
    from ms_rope_attention.testing import cpu_direct
    from ms_rope_attention.cpu_kernel import last_error
    from ms_rope_attention.rope import rope_tables

    q, k, v = _inputs(length, heads, kv_heads, head_dim)
    cos, sin = rope_tables(head_dim, length)
    keep = []
    # The units the process chose for bfloat16 (csrc/bf16.h ChosenUnits), and the others this CPU runs,
    # each its own series: AMX wins the automatic choice wherever it runs.
    os.environ.pop("RFA_BF16_ATTENTION", None)
    chosen = cpu_kernel.bfloat16_tiles() if "bfloat16" in compute_dtypes else None
    others = [u for u in ("avx512_bf16", "fma") if chosen and u != chosen]

    def kernel(rotate, compute_dtype, units=None):
        args, _, buffers = cpu_direct.prepare(q, k, v, cos, sin, head_num=heads, dtype=dtype, with_lse=False,
                                              with_rotated_key=False, compute_dtype=compute_dtype)
        keep.append(buffers)

        def call():
            if chosen:  # process-wide switches, read at each launch: set before every call
                if units:
                    os.environ["RFA_BF16_ATTENTION"] = "fma" if units == "fma" else "dot"
                else:
                    os.environ.pop("RFA_BF16_ATTENTION", None)
                cpu_kernel.bfloat16_tiles(units in (None, "amx"))
            if cpu_direct.launch(args, rotate=rotate) != 0:
                raise RuntimeError(f"the kernel refused the call: {last_error()}")
        return call

    series = {"fused_direct": kernel(1, compute_dtypes[0]), "fused_direct_no_rope": kernel(0, compute_dtypes[0])}
    series.update({f"fused_direct_{c}": kernel(1, c) for c in compute_dtypes[1:]})
    series.update({f"fused_direct_bfloat16_{'vdpbf16ps' if u == 'avx512_bf16' else u}": kernel(1, "bfloat16", u)
                   for u in others})
    try:
        import torch
        import torch.nn.functional as F

        torch.set_num_threads(os.cpu_count())
        tq, tk, tv = (torch.from_numpy(x).to(getattr(torch, dtype)) for x in (q, k, v))

        def sdpa():
            with torch.no_grad():
                F.scaled_dot_product_attention(tq, tk, tv, is_causal=True, enable_gqa=kv_heads != heads)
        series["torch_sdpa_same_process"] = sdpa
    except ImportError:
        pass
    times = alternate(series, repeats, DIRECT_ROUNDS_MAX, DIRECT_ROUNDS_SECONDS)
    del keep
    return times


def run_torch(with_rope, length, heads, kv_heads, head_dim, dtype, repeats):
    import torch
    import torch.nn.functional as F

    from ms_rope_attention.rope import rope_tables

    torch.set_num_threads(os.cpu_count())
    tdtype = getattr(torch, dtype)
    q, k, v = (torch.from_numpy(x).to(tdtype) for x in _inputs(length, heads, kv_heads, head_dim))
    cos, sin = (torch.from_numpy(t).to(tdtype) for t in rope_tables(head_dim, length))

    def rope(x):  # Hugging Face style rotate-half
        x1, x2 = x[..., : head_dim // 2], x[..., head_dim // 2:]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    def step():
        with torch.no_grad():
            qq, kk = (rope(q), rope(k)) if with_rope else (q, k)
            return F.scaled_dot_product_attention(qq, kk, v, is_causal=True, enable_gqa=kv_heads != heads)

    return timed(step, repeats)[1]


def run_gemm_peak(repeats, n=4096):
    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    return timed(lambda: a @ a, repeats)[1]


COMPETITORS = {
    "fused": lambda a: run_mindspore("fused", *a),
    "unfused": lambda a: run_mindspore("unfused", *a),
    "fused_direct": lambda a: run_direct(*a),  # also fused_direct_no_rope, _<compute dtype>, torch_sdpa_same_process
    "torch_rope_sdpa": lambda a: run_torch(True, *a[:-1]),
    "torch_sdpa": lambda a: run_torch(False, *a[:-1]),
    "gemm": lambda a: run_gemm_peak(a[0]),
}


def competitor(name, args):
    """Child-process entry (see harness.run_isolated)."""
    times = COMPETITORS[name](tuple(args))
    if name == "fused_direct":
        return {"times": times.pop("fused_direct"), "same_process": times}
    return {"times": times}


def measure(name, args, memory_limit):
    result = run_isolated("attention", "competitor", {"name": name, "args": args}, memory_limit_bytes=memory_limit)
    if result["status"] != "ok":
        return {"skipped" if result["status"] == "skipped" else "error": result["error"],
                **({"peak_rss_mb": result["peak_rss_mb"]} if "peak_rss_mb" in result else {})}
    return result


def summarize(result, flops):
    if "times" not in result:
        return result
    times = result["times"]
    return {**result, "min_ms": min(times) * 1e3, "median_ms": statistics.median(times) * 1e3,
            "gflops": flops / min(times) / 1e9}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, nargs="+", default=[32], help="several values sweep GQA on/off")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtypes", nargs="+", default=["float32"], choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--compute-dtype", nargs="+", default=["auto"], choices=["auto", "float32", "bfloat16"],
                        help="the fused op's compute_dtype; several: each as a kernel-direct series side by side")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--competitors", nargs="+", default=[n for n in COMPETITORS if n != "gemm"])
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--memory-limit-gb", type=float, default=0.85 * memory_total_bytes() / 2**30)
    args = parser.parse_args(argv)
    limit = int(args.memory_limit_gb * 2**30)

    gemm = summarize(measure("gemm", (args.repeats,), limit), 2 * 4096 ** 3)
    peak = gemm.get("gflops")
    print(f"float32 GEMM peak (numpy 4096^3, same run): {peak:.1f} GFLOP/s (machine shared with other work: "
          "timings are noisy; ratios come from series alternated in one process)")
    peaks = arithmetic_peaks()
    print("arithmetic peaks (same run, every core): " + ", ".join(
        f"{key} {peaks[f'{key}_gflops']:.1f} GFLOP/s" for key in ("float32_fma", "bfloat16_dot", "bfloat16_amx")
        if peaks.get(f"{key}_gflops")))
    rows = []
    for dtype, kv_heads, length in itertools.product(args.dtypes, args.kv_heads, args.lengths):
        flops = 2 * args.heads * length * length * args.head_dim
        run_args = (length, args.heads, kv_heads, args.head_dim, dtype, args.repeats, args.compute_dtype)
        row = {"length": length, "dtype": dtype, "kv_heads": kv_heads}
        for name in args.competitors:
            result = measure(name, run_args, limit)
            row[name] = summarize(result, flops)
            for other, times in result.get("same_process", {}).items():  # alternated with fused_direct
                row[other] = summarize({"times": times, "peak_rss_mb": result["peak_rss_mb"]}, flops)
            row[name].pop("same_process", None)
        for entry in row.values():
            if peak and isinstance(entry, dict) and "gflops" in entry:
                entry["pct_of_gemm_peak"] = 100 * entry["gflops"] / peak
                entry.update(peak_fractions(entry["gflops"], peaks))
        rows.append(row)
        print(format_row(row))
    results = {"machine": machine_info(), "config": vars(args), "gemm_peak": gemm, "arithmetic_peaks": peaks,
               "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "attention.json").write_text(json.dumps(results, indent=2))
    plot(rows, out / "attention.png")
    print(f"wrote {out / 'attention.json'} and {out / 'attention.png'}")


def _ratio(row, a, b):
    if "min_ms" in row.get(a, {}) and "min_ms" in row.get(b, {}):
        return row[b]["min_ms"] / row[a]["min_ms"]
    return None


def format_row(row):
    parts = [f"S={row['length']} {row['dtype']} kv_heads={row['kv_heads']}"]
    for name, res in row.items():
        if not isinstance(res, dict):
            continue
        if "min_ms" in res:
            pct = f" {res['pct_of_gemm_peak']:.0f}%pk" if "pct_of_gemm_peak" in res else ""
            peaks = [f"{100 * res[f'fraction_of_{key}_peak']:.0f}% {label}" for key, label in
                     (("float32_fma", "fp32 FMA"), ("bfloat16_dot", "bf16 dot"), ("bfloat16_amx", "AMX"))
                     if res.get(f"fraction_of_{key}_peak")]
            pct += f"; {' / '.join(peaks)} peak" if peaks else ""
            parts.append(f"{name}: min {res['min_ms']:.1f} ms / med {res['median_ms']:.1f} ms "
                         f"({res['gflops']:.0f} GF/s{pct}, {res['peak_rss_mb']:.0f} MB)")
        else:
            parts.append(f"{name}: {res.get('skipped') or res.get('error')}")
    speedups = (("fused vs unfused speedup", "fused", "unfused"),
                ("fused vs torch SDPA (no RoPE) speedup", "fused", "torch_sdpa"),
                ("fused kernel vs torch SDPA (no RoPE), same process", "fused_direct", "torch_sdpa_same_process"),
                *((f"fused kernel compute_dtype {name[len('fused_direct_'):]} vs the first, same process",
                   name, "fused_direct") for name in row if name.startswith("fused_direct_")
                  and name != "fused_direct_no_rope"))
    for label, a, b in speedups:
        r = _ratio(row, a, b)
        if r is not None:
            parts.append(f"{label}: {r:.2f}x")
    rope_cost = _ratio(row, "fused_direct_no_rope", "fused_direct")
    if rope_cost is not None:
        parts.append(f"RoPE cost in kernel: {(rope_cost - 1) * 100:+.1f}%")
    return "\n  ".join(parts)


def plot(rows, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    names = [n for n, v in rows[0].items() if isinstance(v, dict) and n != "gemm"]
    for (dtype, kv_heads), group in itertools.groupby(rows, key=lambda r: (r["dtype"], r["kv_heads"])):
        group = list(group)
        for name in names:
            pts = [(r["length"], r[name]["min_ms"]) for r in group if "min_ms" in r.get(name, {})]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=f"{name} {dtype} kv{kv_heads}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length")
    ax.set_ylabel("time (ms, min of repeats)")
    ax.set_title("RoPE + causal attention, B=1, D=128")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
