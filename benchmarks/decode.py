"""Llama2 decode: TTFT, decode tokens/s and per-step time against the number of cached tokens, this
project's generator (fused and unfused, its in-place KV cache) against Hugging Face transformers'
``generate`` with its DynamicCache and its StaticCache, and the op's decode call against this
machine's memory read bandwidth, all in one run.

Every system loads the same seeded random checkpoint (``peers.write_checkpoint``; Llama2-7B dimensions,
``--layers`` layers, float32) and gets the same prompts; greedy tokens must be identical across
systems, or the run fails. Batches: ``1`` (one prompt of ``context`` tokens) and ``varlen8`` (eight
prompts whose lengths spread evenly over [context/8, context]: no padding here, left padding with an
attention mask for transformers). Each (context, batch, round, system) point runs in a fresh process,
in an order that turns every round (as the TTFT sweep does); a point first compiles / warms up on a
short prompt (reported, not timed), then generates ``--new-tokens`` tokens. TTFT is the prefill plus
the first token; a decode step is the time from one token to the next (transformers': its streamer's
time stamps); tokens/s is per sequence.

The op's point, in a process of its own in the same run: one decode call (q_len 1, 32 heads,
head_dim 128, a BSND cache of ``context`` rotated keys, float32 and float16) through ``cpu_direct``,
by every kernel build this CPU runs, against the read bandwidth of this machine
(``harness.read_bandwidth``: peaks.c's read loop on every core over at least 1 GiB and 4x the
last-level cache): the fraction of it the call reaches is bytes(K + V) / time / bandwidth.

    python benchmarks/decode.py                                  # 512..8192 batch 1, varlen8 at 512, 2048
    python benchmarks/decode.py --contexts 512 2048 --batches 1  # make bench's short run
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from harness import machine_info, memory_total_bytes, read_bandwidth, run_isolated, save, turned

SCHEMA_VERSION = 1
SYSTEMS = ("fused", "unfused", "hf-dynamic", "hf-static")
NAMES = {"fused": "fused (this project)", "unfused": "unfused (this project)",
         "hf-dynamic": "HF transformers, DynamicCache", "hf-static": "HF transformers, StaticCache"}
BATCHES = ("1", "varlen8")


# ---------------------------------------------------------------------------------------------
# The op's point (child process); the systems' points are peers.generation_point.

def bandwidth_point(contexts: list[int], repeats: int = 20) -> dict:
    """The op's decode call (q_len 1, 32 heads, D 128, BSND cache) against the read bandwidth, for
    every kernel build this CPU runs (the one the op picks first), their calls interleaved so that
    the machine's drift falls on all of them alike."""
    from ms_rope_attention.testing import cpu_direct
    from ms_rope_attention.cpu_kernel import isa_library
    from ms_rope_attention.cpu_runtime import built_libraries, select_library, usable_isas
    from ms_rope_attention.rope import rope_tables

    read = read_bandwidth()
    bandwidth = read["bytes_per_s"]
    builds = {isa: isa_library(isa) for isa in usable_isas() if isa in built_libraries()}
    rng = np.random.default_rng(0)
    calls = []
    for dtype in ("float32", "float16"):
        for context in contexts:
            q = rng.standard_normal((1, 1, 32, 128), dtype=np.float32)
            k, v = (rng.standard_normal((1, context, 32, 128), dtype=np.float32) for _ in range(2))
            cos, sin = rope_tables(128, context)
            args, _, keep = cpu_direct.prepare(q, k, v, cos, sin, input_layout="BSND", dtype=dtype, key_rotated=True,
                                               with_lse=False, with_rotated_key=False)
            times = {isa: [] for isa in builds}
            for _ in range(repeats):
                for isa, lib in builds.items():
                    start = time.perf_counter()
                    if cpu_direct.launch(args, kernel=lib) != 0:
                        raise RuntimeError(f"the {isa} kernel refused the call: {lib.RotaryFlashAttentionLastError().decode()}")
                    times[isa].append(time.perf_counter() - start)
            del keep
            nbytes = 2 * k.size * (4 if dtype == "float32" else 2)
            for isa, t in times.items():
                calls.append({"isa": isa, "dtype": dtype, "context": context, "min_ms": min(t) * 1e3,
                              "median_ms": statistics.median(t) * 1e3, "bytes": nbytes,
                              "gb_per_s": nbytes / min(t) / 1e9, "fraction_of_bandwidth": nbytes / min(t) / bandwidth})
    return {"read_bandwidth_gb_per_s": bandwidth / 1e9, "bandwidth_probe": read["probe"],
            "probes_gb_per_s": read["probes_gb_per_s"], "read_bandwidth": read, "selected_isa": select_library()[0],
            "calls": calls}


# ---------------------------------------------------------------------------------------------
# Pure parts (tested in tests/test_benchmarks.py).

def summarize(runs: list[dict]) -> list[dict]:
    """Per (context, batch, system): TTFT min/median over rounds, per-step ms min/median over every
    step of every round, decode tokens/s per sequence from the median step, and the growth of the
    step with context (ms per 1K cached tokens, least squares over the steps)."""
    rows = []
    keys = sorted({(r["context"], r["batch"], r["system"]) for r in runs},
                  key=lambda k: (k[0], BATCHES.index(k[1]), SYSTEMS.index(k[2])))
    for context, batch, system in keys:
        done = [r for r in runs if (r["context"], r["batch"], r["system"]) == (context, batch, system)
                and r.get("status") == "ok"]
        row = {"context": context, "batch": batch, "system": system, "runs": len(done)}
        if not done:
            failed = [r for r in runs if (r["context"], r["batch"], r["system"]) == (context, batch, system)]
            row.update(status=failed[0].get("status"), error=failed[0].get("error"))
            rows.append(row)
            continue
        steps = [s for r in done for s in r["step_ms"]]
        ttft = [r["ttft_s"] for r in done]
        row.update(status="ok", ttft_min_s=min(ttft), ttft_median_s=statistics.median(ttft),
                   step_min_ms=min(steps), step_median_ms=statistics.median(steps),
                   tokens_per_s=1e3 / statistics.median(steps))
        rows.append(row)
    for batch in BATCHES:
        for system in SYSTEMS:
            points = [(r["context"], r["step_median_ms"]) for r in rows
                      if (r["batch"], r["system"], r["status"]) == (batch, system, "ok")]
            slope = growth_ms_per_1k(points)
            for r in rows:
                if (r["batch"], r["system"]) == (batch, system) and r["status"] == "ok":
                    r["growth_ms_per_1k_tokens"] = slope
    return rows


def growth_ms_per_1k(points: list[tuple[int, float]]) -> float | None:
    """Slope of step ms against context, per 1000 cached tokens (None with fewer than 2 contexts)."""
    if len({c for c, _ in points}) < 2:
        return None
    x, y = np.array([c for c, _ in points], float), np.array([t for _, t in points], float)
    return float(np.polyfit(x, y, 1)[0] * 1000)


def ratios(rows: list[dict]) -> list[dict]:
    """fused tokens/s over the best transformers cache's, per (context, batch), and the growth ratio."""
    out = []
    for context, batch in sorted({(r["context"], r["batch"]) for r in rows}):
        by = {r["system"]: r for r in rows if (r["context"], r["batch"]) == (context, batch) and r["status"] == "ok"}
        peers = [by[s] for s in ("hf-dynamic", "hf-static") if s in by]
        if "fused" not in by or not peers:
            continue
        best = max(peers, key=lambda r: r["tokens_per_s"])
        out.append({"context": context, "batch": batch, "best_peer": best["system"],
                    "fused_over_best_peer": by["fused"]["tokens_per_s"] / best["tokens_per_s"],
                    "ttft_fused_over_best_peer": by["fused"]["ttft_median_s"] / best["ttft_median_s"]})
    return out


def tokens_disagree(runs: list[dict]) -> list[str]:
    """Points whose greedy tokens differ from the fused system's at the same context and batch."""
    reference = {(r["context"], r["batch"]): r["tokens"] for r in runs
                 if r["system"] == "fused" and r.get("status") == "ok"}
    return [f"{r['system']} context {r['context']} batch {r['batch']} round {r['round']}" for r in runs
            if r.get("status") == "ok" and (r["context"], r["batch"]) in reference
            and r["tokens"] != reference[(r["context"], r["batch"])]]


def table(results: dict) -> str:
    lines = ["| context | batch | " + " | ".join(NAMES[s] for s in SYSTEMS) + " | fused / best HF |",
             "|---|---|" + "---|" * (len(SYSTEMS) + 1)]
    rows, by_ratio = results["summary"], {(r["context"], r["batch"]): r for r in results["ratios"]}
    for context, batch in sorted({(r["context"], r["batch"]) for r in rows}, key=lambda k: (BATCHES.index(k[1]), k[0])):
        cells = []
        for system in SYSTEMS:
            r = next((r for r in rows if (r["context"], r["batch"], r["system"]) == (context, batch, system)), None)
            cells.append("-" if r is None else r.get("status") if r["status"] != "ok" else
                         f"{r['tokens_per_s']:.2f} tok/s ({r['step_median_ms']:.0f} ms), TTFT {r['ttft_median_s']:.1f} s")
        ratio = by_ratio.get((context, batch))
        lines.append(f"| {context} | {batch} | " + " | ".join(cells) +
                     (f" | {ratio['fused_over_best_peer']:.2f}x |" if ratio else " | - |"))
    bw = results.get("op")
    if bw:
        lines += ["", f"The op's decode call against the read bandwidth ({bw['read_bandwidth_gb_per_s']:.1f} GB/s; "
                      f"the op runs the {bw['selected_isa']} build here), min of the calls:", "",
                  "| build | dtype | cached keys | ms | GB/s | of bandwidth |", "|---|---|---|---|---|---|"]
        lines += [f"| {c['isa']} | {c['dtype']} | {c['context']} | {c['min_ms']:.2f} | {c['gb_per_s']:.1f} | "
                  f"{100 * c['fraction_of_bandwidth']:.0f}% |" for c in bw["calls"]]
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for system in SYSTEMS:
        for batch, style in (("1", "-o"), ("varlen8", "--s")):
            rows = [r for r in results["summary"] if (r["system"], r["batch"], r["status"]) == (system, batch, "ok")]
            if not rows:
                continue
            label = f"{NAMES[system]}, batch {batch}"
            axes[0].plot([r["context"] for r in rows], [r["tokens_per_s"] for r in rows], style, label=label)
            axes[1].plot([r["context"] for r in rows], [r["step_median_ms"] for r in rows], style, label=label)
    axes[0].set(xlabel="cached tokens (prompt length)", ylabel="decode tokens/s per sequence", xscale="log")
    axes[1].set(xlabel="cached tokens (prompt length)", ylabel="median decode step (ms)", xscale="log")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"Llama2 {results['settings']['model']} dims, {results['settings']['layers']} layers, float32, "
                 f"{results['machine']['cpus']} cores ({results['machine']['kernel_isa']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ---------------------------------------------------------------------------------------------

def sweep(args, progress=True) -> dict:
    from tqdm import tqdm

    limit = int(args.memory_limit_gb * 2**30)
    with tempfile.TemporaryDirectory(prefix="decode-weights-") as scratch:
        written = run_isolated("peers", "write_checkpoint", {"model": args.model, "layers": args.layers,
                                                              "seed": args.seed, "directory": scratch})
        if written["status"] != "ok":
            raise RuntimeError(f"could not write the shared weights: {written.get('error')}")
        contexts = {"1": args.contexts, "varlen8": args.varlen_contexts}
        points = [(context, batch, r, system) for batch in args.batches for context in contexts[batch]
                  for r in range(args.rounds) for system in turned(list(args.systems), r)]
        runs, skipped = [], {}
        bar = tqdm(points, desc="decode sweep", unit="process", disable=not progress)
        for context, batch, round_, system in bar:
            bar.set_postfix_str(f"{system} context {context} batch {batch} round {round_ + 1}/{args.rounds}")
            base = {"system": system, "context": context, "batch": batch, "round": round_}
            if system in skipped:
                runs.append({**base, **skipped[system]})
                continue
            result = run_isolated("peers", "generation_point", {"system": system, "checkpoint": scratch,
                                                                 "context": context, "batch": batch,
                                                                 "new_tokens": args.new_tokens, "seed": args.seed},
                                  memory_limit_bytes=limit, timeout_s=args.timeout)
            if result["status"] == "skipped":
                skipped[system] = result
            runs.append({**base, **result})
        op = run_isolated("decode", "bandwidth_point", {"contexts": [c for c in args.contexts if c >= 4096]
                                                        or list(args.contexts)}, memory_limit_bytes=limit)
    disagreeing = tokens_disagree(runs)
    summary = summarize(runs)
    results = {"schema_version": SCHEMA_VERSION, "machine": machine_info(), "settings": vars(args), "runs": runs,
               "summary": summary, "ratios": ratios(summary), "op": op if op.get("status") == "ok" else None,
               "op_status": op.get("status"), "tokens_disagree": disagreeing}
    if disagreeing:
        raise RuntimeError(f"greedy tokens differ between systems on the same weights and prompts: {disagreeing}")
    return results


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="7b", choices=["7b", "tiny"], help="the dimensions (tiny: the tests)")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers actually run (memory)")
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 4096, 8192])
    parser.add_argument("--batches", nargs="+", default=list(BATCHES), choices=BATCHES)
    parser.add_argument("--varlen-contexts", type=int, nargs="+", default=[512, 2048],
                        help="contexts of the varlen8 batch (eight prompts: the long ones take minutes to prefill)")
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--memory-limit-gb", type=float, default=round(0.85 * memory_total_bytes() / 2**30, 1))
    parser.add_argument("--timeout", type=float, default=2400.0, help="seconds per point")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    if min(args.layers, args.rounds, *args.contexts, *args.varlen_contexts) < 1 or args.new_tokens < 2:
        parser.error("--layers, --rounds and --contexts must be positive, --new-tokens at least 2")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    results = sweep(args)
    save(results, args.out, "decode.json", "decode.png", plot, table)
    return results


if __name__ == "__main__":
    main()
