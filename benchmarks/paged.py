"""The paged decode call against the contiguous one, and against the machine's read bandwidth, in one
run: Llama2-7B's attention (32 heads, D 128), one query token, a cache of rotated keys, batch 1.

The same keys are laid out twice: as one TND array (the contiguous op's decode path, what the
Generator's slot cache runs today) and as a paged cache whose block table is shuffled (blocks of 16,
MindFormers' default, and 128, vLLM-MindSpore's), so that no two neighbouring blocks of a sequence
are neighbours in memory. The calls are the kernels' C entries (``cpu_direct``), every build this
CPU runs, interleaved round by round so the machine's drift falls on all of them alike.

    python benchmarks/paged.py [--contexts 512 4096 8192] [--repeats 20] [--out benchmarks/results]

writes ``paged.json`` and ``paged.png`` (GB/s per call, the read bandwidth as a line).
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from harness import machine_info, read_bandwidth, save

HEADS, HEAD_DIM = 32, 128
BLOCK_SIZES = (16, 128)


def layouts(context: int, dtype: str, rng) -> dict:
    """{name: (launch, bytes read)} for one context: the contiguous call and one per block size."""
    from ms_rope_attention.testing import cpu_direct
    from ms_rope_attention.rope import rope_tables

    q = rng.standard_normal((1, HEADS, HEAD_DIM), dtype=np.float32)
    k, v = (rng.standard_normal((context, HEADS, HEAD_DIM), dtype=np.float32) for _ in range(2))
    cos, sin = (np.asarray(t) for t in rope_tables(HEAD_DIM, context))
    found = {}
    args, _, keep = cpu_direct.prepare(q, k, v, cos, sin, np.array([1]), np.array([context]), input_layout="TND",
                                       head_num=HEADS, dtype=dtype, key_rotated=True, with_lse=False,
                                       with_rotated_key=False)
    found["contiguous"] = (lambda lib, args=args, keep=keep: cpu_direct.launch(args, kernel=lib), keep)
    for block in BLOCK_SIZES:
        blocks = -(-context // block)
        order = rng.permutation(blocks).astype(np.int32)
        kc = np.zeros((blocks * block, HEADS, HEAD_DIM), np.float32)
        vc = np.zeros_like(kc)
        rows = (order[np.arange(context) // block] * block + np.arange(context) % block)
        kc[rows], vc[rows] = k, v
        paged = cpu_direct.paged_arguments(q, kc.reshape(blocks, block, HEADS, HEAD_DIM),
                                           vc.reshape(blocks, block, HEADS, HEAD_DIM), cos, sin, order[None],
                                           np.array([context]), np.array([1]), dtype=dtype, with_lse=False)
        found[f"paged, block {block}"] = (lambda lib, paged=paged: cpu_direct.paged_launch(paged, lib), paged)
    return found


def measure(contexts: list[int], repeats: int) -> dict:
    from ms_rope_attention.cpu_kernel import isa_library
    from ms_rope_attention.cpu_runtime import built_libraries, select_library, usable_isas

    read = read_bandwidth()
    builds = {isa: isa_library(isa) for isa in usable_isas() if isa in built_libraries()}
    rng = np.random.default_rng(0)
    calls = []
    for dtype in ("float32", "float16"):
        for context in contexts:
            series = layouts(context, dtype, rng)
            times = {(isa, name): [] for isa in builds for name in series}
            for _ in range(repeats):
                for (isa, name) in times:
                    launch = series[name][0]
                    start = time.perf_counter()
                    if launch(builds[isa]) != 0:
                        raise RuntimeError(f"{isa} {name}: the kernel refused the call")
                    times[isa, name].append(time.perf_counter() - start)
            nbytes = 2 * context * HEADS * HEAD_DIM * (4 if dtype == "float32" else 2)
            for (isa, name), t in times.items():
                contiguous = min(times[isa, "contiguous"])
                calls.append({"isa": isa, "dtype": dtype, "context": context, "layout": name, "min_ms": min(t) * 1e3,
                              "median_ms": statistics.median(t) * 1e3, "bytes": nbytes,
                              "gb_per_s": nbytes / min(t) / 1e9,
                              "fraction_of_bandwidth": nbytes / min(t) / read["bytes_per_s"],
                              "vs_contiguous": min(t) / contiguous})
    return {"machine": machine_info(), "read_bandwidth_gb_per_s": read["bytes_per_s"] / 1e9,
            "bandwidth_probe": read["probe"], "read_bandwidth": read, "selected_isa": select_library()[0],
            "repeats": repeats, "calls": calls}


def table(results: dict) -> str:
    lines = [f"read bandwidth {results['read_bandwidth_gb_per_s']:.1f} GB/s ({results['bandwidth_probe']})",
             "| build | cache | keys | layout | min ms | median ms | GB/s | of bandwidth | time vs contiguous |",
             "|---|---|---|---|---|---|---|---|---|"]
    for c in results["calls"]:
        lines.append(f"| {c['isa']} | {c['dtype']} | {c['context']} | {c['layout']} | {c['min_ms']:.3f} | "
                     f"{c['median_ms']:.3f} | {c['gb_per_s']:.1f} | {c['fraction_of_bandwidth']:.0%} | "
                     f"{c['vs_contiguous']:.2f}x |")
    return "\n".join(lines)


def plot(results: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    selected = [c for c in results["calls"] if c["isa"] == results["selected_isa"]]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, dtype in zip(axes, ("float32", "float16")):
        for layout in dict.fromkeys(c["layout"] for c in selected):
            points = [c for c in selected if c["dtype"] == dtype and c["layout"] == layout]
            ax.plot([c["context"] for c in points], [c["gb_per_s"] for c in points], marker="o", label=layout)
        ax.axhline(results["read_bandwidth_gb_per_s"], color="gray", linestyle="--", label="read bandwidth")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{dtype} cache, {results['selected_isa']} build")
        ax.set_xlabel("cached keys")
    axes[0].set_ylabel("GB/s read (min of the run)")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 4096, 8192])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    results = measure(args.contexts, args.repeats)
    save(results, args.out, "paged.json", "paged.png", plot, table)
    return results


if __name__ == "__main__":
    main()
