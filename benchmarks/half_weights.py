"""Half weights (a checkpoint's own float16 / bfloat16, float32 arithmetic) against float32 weights,
in one run: the projection GEMM against this machine's read bandwidth, then Llama2-7B-dimension
generation (``--layers`` layers) with this project's generator on float32 and on float16 weights of the
same float16 checkpoint, against Hugging Face transformers on the same half weights and llama.cpp on
them written as bf16 and f16 GGUF files (``llama_cpp_peer``, in its own environment: ``make llama-cpp``).

GEMM: W (11008, 4096), the gate/up projection, by every build of the projection library this CPU
runs and every weight dtype; M = 1, 8, 16 rows (decode steps: the fraction of the read bandwidth the
product reaches, bytes(W) / time / bandwidth) and M = 512 (a prefill: GFLOP/s, ratio to float32).
Calls alternate round by round; min and median.

Generation: each (context, round, system) point in a fresh process (``peers.generation_point``; llama.cpp's
``llama_cpp_peer.generation_point`` under its environment's interpreter): TTFT, decode
tokens/s per sequence (median step), peak RSS, and the time of one full decoder layer of the prefill.
Every system times ``--prefills`` prefills of the whole prompt after its warm-up and before the
generation whose TTFT is reported, so every TTFT and full layer comes from the same warm state. A full
layer: llama.cpp's prefill one layer deeper minus its prefill (min of each), as llama.cpp prunes the
last layer to the token whose logits it returns; the others' fastest prefill / layers, the embedding
and LM head included (they prune nothing). Greedy
tokens of this project's two systems must agree (the same arithmetic on the same values). transformers
and llama.cpp run in the half dtype they are given (their own arithmetic in it, so their tokens may
differ; reported, not required).

    python benchmarks/half_weights.py                     # contexts 512 2048, 2 layers
    python benchmarks/half_weights.py --layers 32 --contexts 512 --rounds 1 --systems fused-half
    python benchmarks/half_weights.py --contexts 512 2048 --no-gemm --systems fused-half llama.cpp-bf16 llama.cpp-f16
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import numpy as np

import llama_cpp_peer
from harness import (arithmetic_peaks, machine_info, memory_total_bytes, peak_fractions, read_bandwidth,
                     run_isolated, save, turned)

SYSTEMS = {  # name -> (peers.generation_point system, extra kwargs)
    "fused-float32": ("fused", {"weight_dtype": "float32", "compute_dtype": "float32"}),
    "fused-half": ("fused", {"weight_dtype": "auto", "compute_dtype": "float32"}),
    # the float16 weights rounded to bfloat16 at load and packed for oneDNN; bfloat16 arithmetic
    "fused-bfloat16": ("fused", {"weight_dtype": "auto", "compute_dtype": "bfloat16"}),
    "hf-static-float16": ("hf-static", {"dtype": "float16"}),
    "hf-static-bfloat16": ("hf-static", {"dtype": "bfloat16"}),
}
LLAMA_CPP_SYSTEMS = {"llama.cpp-bf16": "bf16", "llama.cpp-f16": "f16"}  # name -> GGUF tensor type
GEMM_ROWS = (1, 8, 16, 512)


def gemm_point(out_features: int = 11008, in_features: int = 4096, repeats: int = 20) -> dict:
    """The projection GEMM per build, weight dtype and M (child process: nothing else on the cores)."""
    import ml_dtypes

    from ms_rope_attention import linear
    from ms_rope_attention.cpu_runtime import built_libraries, usable_isas

    read = read_bandwidth()
    rng = np.random.default_rng(0)
    w32 = rng.standard_normal((out_features, in_features), dtype=np.float32)
    one = {"float32": w32, "float16": w32.astype(np.float16), "bfloat16": w32.astype(ml_dtypes.bfloat16)}
    # Copies of W, at least 1 GiB of them per dtype, taken in turn: one W fits this machine's last
    # level cache (480 MB measured on the Xeon this was written on), and a decode step's weights do not.
    weights = {d: [w.copy() for _ in range(max(1, min(64, -(-2**30 // w.nbytes))))] for d, w in one.items()}
    isas = [isa for isa in usable_isas() if isa in built_libraries(linear.STEM)]
    rows = []
    for m in GEMM_ROWS:
        x = rng.standard_normal((m, in_features), dtype=np.float32)
        times = {(isa, d): [] for isa in isas for d in weights}
        for i in range(repeats if m <= 16 else max(3, repeats // 4)):
            for isa, d in times:
                w = weights[d][i % len(weights[d])]
                start = time.perf_counter()
                linear.multiply(x, w, isa=isa)
                times[(isa, d)].append(time.perf_counter() - start)
        for (isa, d), t in times.items():
            nbytes = one[d].nbytes
            rows.append({"isa": isa, "weight_dtype": d, "m": m, "min_ms": min(t) * 1e3,
                         "median_ms": statistics.median(t) * 1e3, "weight_gb_per_s": nbytes / min(t) / 1e9,
                         "fraction_of_bandwidth": nbytes / min(t) / read["bytes_per_s"],
                         "gflops": 2.0 * m * out_features * in_features / min(t) / 1e9,
                         "speedup_vs_float32": min(times[(isa, "float32")]) / min(t)})
    return {"read_bandwidth_gb_per_s": read["bytes_per_s"] / 1e9, "bandwidth_probe": read["probe"],
            "read_bandwidth": read, "shape": [out_features, in_features], "rows": rows}


def paired_point(checkpoint: str, context: int, new_tokens: int, seed: int, prefills: int = 3) -> dict:
    """This project's float32 and half weights of one checkpoint in one process, their graph calls
    alternating one at a time (which goes first turns each call): the host's drift (its read bandwidth
    moved between 16.7 and 30.7 GB/s from one run to the next here) falls on both alike, and each
    ratio is taken within a pair of neighbouring calls. ``prefills`` alternated prefills (TTFT's graph
    call), then one generation of ``new_tokens`` each, step against step."""
    import ms_rope_attention  # noqa: F401  before MindSpore, as users run it (docs/threads.md)
    import mindspore as ms

    ms.set_device("CPU")
    ms.set_context(mode=ms.GRAPH_MODE)
    from peers import WARM_UP_TOKENS, prompts_for
    from models.llama.engine import Generator
    from models.llama.engine.kv_cache import bucket_capacity
    from models.llama.weights import load_checkpoint

    gens = {}
    for system, weight_dtype in (("fused-float32", "float32"), ("fused-half", "auto")):
        lm = load_checkpoint(checkpoint, max_positions=context + new_tokens, progress=False, weight_dtype=weight_dtype,
                             compute_dtype="float32")  # the float32 arithmetic of both weights: equal tokens
        gens[system] = Generator(lm, slots=1, capacity=bucket_capacity(context + new_tokens, lm.max_positions))
    prompt = prompts_for("1", context, lm.vocab_size, seed)[0]
    for gen in gens.values():
        gen.warm_up([prompt[:WARM_UP_TOKENS]])
    prefill_s = {system: [] for system in gens}
    for i in range(prefills):
        for system in turned(list(gens), i):
            start = time.perf_counter()
            gens[system].prefill_logits([prompt])
            prefill_s[system].append(time.perf_counter() - start)
    calls = {system: [] for system in gens}  # seconds of each graph call: the prefill, then each step
    streams = {system: gen.stream([prompt], new_tokens, eos_ids=(), on_step=lambda _, s, c=calls[system]: c.append(s))
               for system, gen in gens.items()}
    tokens = {system: [] for system in gens}
    for i in range(new_tokens):
        for system in turned(list(gens), i):
            tokens[system].append(next(streams[system]).token)
    steps = {system: [1e3 * s for s in c[1:]] for system, c in calls.items()}
    pairs = [f / h for f, h in zip(steps["fused-float32"], steps["fused-half"])]
    prefill_pairs = [h / f for f, h in zip(prefill_s["fused-float32"], prefill_s["fused-half"])]
    return {"context": context, "prefill_s": prefill_s, "step_ms": steps, "tokens": tokens,
            "decode_speedup_median": statistics.median(pairs), "decode_speedup_pairs": pairs,
            "prefill_ratio_median": statistics.median(prefill_pairs), "prefill_ratio_pairs": prefill_pairs}


def summarize(runs: list[dict], layers: int) -> list[dict]:
    """One row per (system, context): TTFT min / median over its processes, the median decode step's
    min / median, peak RSS, the time of one full layer (see the module docstring)."""
    rows = []
    for key in sorted({(r["system"], r["context"]) for r in runs}, key=lambda k: (k[1], k[0])):
        ok = [r for r in runs if (r["system"], r["context"]) == key and r.get("status") == "ok"]
        if not ok:
            bad = [r for r in runs if (r["system"], r["context"]) == key]
            rows.append({"system": key[0], "context": key[1], "status": bad[0].get("status"),
                         "error": bad[0].get("error")})
            continue
        steps = [statistics.median(r["step_ms"]) for r in ok]
        rows.append({"system": key[0], "context": key[1], "status": "ok",
                     "ttft_min_s": min(r["ttft_s"] for r in ok),
                     "ttft_median_s": statistics.median(r["ttft_s"] for r in ok),
                     "step_min_ms": min(steps), "step_median_ms": statistics.median(steps),
                     "tokens_per_s": 1e3 / min(steps), "peak_rss_gb": max(r["peak_rss_mb"] for r in ok) / 1024,
                     "backend_ran": ok[0]["backend_ran"], "tokens": ok[0]["tokens"]})
        if "per_full_layer_s" in ok[0]:  # llama.cpp: the deeper file's fastest prefill minus the model's, over its runs
            depth = ok[0]["layers"]
            fastest = {n: min(t for r in ok for t in r["prefill_s"][str(n)]) for n in (depth, depth + 1)}
            rows[-1].update({"per_full_layer_s": fastest[depth + 1] - fastest[depth],
                             **{field: ok[0][field] for field in ("system_info", "threads", "versions", "method")}})
        else:  # the fastest whole prefill over the processes, the embedding and LM head included
            rows[-1]["per_full_layer_s"] = min(t for r in ok for t in r["prefill_s"]) / layers
    return rows


def ratios(rows: list[dict]) -> list[dict]:
    """Per context: half-weight decode, TTFT and full layer against float32 weights and each peer."""
    out = []
    for context in sorted({r["context"] for r in rows}):
        at = {r["system"]: r for r in rows if r["context"] == context and r["status"] == "ok"}
        half = at.get("fused-half")
        if half is None:
            continue
        for other, r in at.items():
            if other != "fused-half":
                out.append({"context": context, "against": other,
                            "decode_speedup": half["tokens_per_s"] / r["tokens_per_s"],
                            "ttft_ratio": half["ttft_min_s"] / r["ttft_min_s"],
                            "full_layer_ratio": half["per_full_layer_s"] / r["per_full_layer_s"]})
    return out


def table(results: dict) -> str:
    g = results["gemm"]
    peaks = results.get("peaks") or {}

    def pct(x):
        return "n/a" if x is None else f"{100 * x:.0f}%"

    def gflops(key):
        return "n/a" if not peaks.get(f"{key}_gflops") else f"{peaks[f'{key}_gflops']:.0f}"

    lines = [f"GEMM W {tuple(g['shape'])}, read bandwidth {g['read_bandwidth_gb_per_s']:.1f} GB/s "
             f"({g['bandwidth_probe']}); "
             f"peaks this run: float32 FMA {gflops('float32_fma')}, bfloat16 vdpbf16ps {gflops('bfloat16_dot')}, "
             f"bfloat16 AMX {gflops('bfloat16_amx')} GFLOP/s",
             "| build | W dtype | M | min ms | median ms | W GB/s | of bandwidth | GFLOP/s | vs float32 | "
             "of float32 / bfloat16 peak |", "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['isa']} | {r['weight_dtype']} | {r['m']} | {r['min_ms']:.2f} | {r['median_ms']:.2f} | "
              f"{r['weight_gb_per_s']:.1f} | {100 * r['fraction_of_bandwidth']:.0f}% | {r['gflops']:.0f} | "
              f"x{r['speedup_vs_float32']:.2f} | "
              + (f"{pct(r.get('fraction_of_float32_fma_peak'))} / {pct(r.get('fraction_of_bfloat16_dot_peak'))} |"
                 if r["m"] >= 512 else "|") for r in g["rows"]]
    s = results["settings"]
    lines += ["", f"Llama2 {s['model']} dims, {s['layers']} layers, float16 checkpoint ({results['checkpoint_gb']:.1f} GB), "
              f"{s['new_tokens']} new tokens, {s['rounds']} round(s)",
              "| system | context | TTFT min / median s | per full layer s | decode tokens/s | step median ms | "
              "peak RSS GB |", "|---|---|---|---|---|---|---|"]
    for r in results["summary"]:
        if r["status"] != "ok":
            lines.append(f"| {r['system']} | {r['context']} | {r['status']}: {r.get('error')} | | | | |")
            continue
        lines.append(f"| {r['system']} | {r['context']} | {r['ttft_min_s']:.2f} / {r['ttft_median_s']:.2f} | "
                     f"{r['per_full_layer_s']:.3f} | {r['tokens_per_s']:.1f} | {r['step_median_ms']:.1f} | "
                     f"{r['peak_rss_gb']:.1f} |")
    lines.append("Per full layer: llama.cpp's prefill one layer deeper minus its prefill (min of each over its "
                 f"processes); the others' fastest prefill / layers (the embedding and LM head included); "
                 f"{results['settings']['prefills']} prefills per process, after the warm-up.")
    llama = [r for r in results["summary"] if r["status"] == "ok" and "system_info" in r]
    if llama:
        lines.append(f"llama.cpp: {llama[0]['threads']} threads, system info: {llama[0]['system_info'].strip()}")
    lines += ["", "| context | fused-half against | decode speedup | TTFT ratio | full layer ratio |",
              "|---|---|---|---|---|"]
    lines += [f"| {r['context']} | {r['against']} | x{r['decode_speedup']:.2f} | {r['ttft_ratio']:.2f} | "
              f"{r['full_layer_ratio']:.2f} |" for r in results["ratios"]]
    if results["paired"]:
        lines += ["", "Paired, one process per context (float32 and half weights alternating call by call):",
                  "| context | float32 / half step, median of pairs (min..max) | half / float32 prefill, median of pairs "
                  "| step median ms float32 / half |", "|---|---|---|---|"]
        for p in results["paired"]:
            steps = p["step_ms"]
            lines.append(f"| {p['context']} | x{p['decode_speedup_median']:.2f} ({min(p['decode_speedup_pairs']):.2f}.."
                         f"{max(p['decode_speedup_pairs']):.2f}) | {p['prefill_ratio_median']:.2f} | "
                         f"{statistics.median(steps['fused-float32']):.1f} / {statistics.median(steps['fused-half']):.1f} |")
    return "\n".join(lines)


def plot(results: dict, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    rows = [r for r in results["summary"] if r["status"] == "ok"]
    for system in dict.fromkeys(r["system"] for r in rows):
        mine = [r for r in rows if r["system"] == system]
        ax.plot([r["context"] for r in mine], [r["tokens_per_s"] for r in mine], "o-", label=system)
    ax.set(xlabel="cached tokens", ylabel="decode tokens/s", xscale="log")
    ax.legend(fontsize=8)
    s = results["settings"]
    fig.suptitle(f"Llama2 {s['model']} dims, {s['layers']} layers: half weights vs float32, {results['machine']['cpus']} cores")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def write_gguf_files(args, checkpoint: str, directory: str, memory_limit: int) -> dict:
    """For each GGUF tensor type the chosen llama.cpp systems need, its pair of files in ``directory``
    (``llama_cpp_peer.write_gguf_pair``), or the record every point of it gets instead: skipped where
    llama.cpp's environment is not installed."""
    types = sorted({LLAMA_CPP_SYSTEMS[s] for s in args.systems if s in LLAMA_CPP_SYSTEMS})
    if types and not os.path.exists(args.llama_cpp_python):
        missing = {"status": "skipped", "error": f"not installed: no llama.cpp interpreter at {args.llama_cpp_python} "
                                                 "(make llama-cpp installs it)"}
        return {t: missing for t in types}
    files = {}
    for tensor_type in types:
        written = run_isolated("llama_cpp_peer", "write_gguf_pair",
                               {"checkpoint": checkpoint, "directory": directory, "tensor_type": tensor_type},
                               python=args.llama_cpp_python, memory_limit_bytes=memory_limit)
        if written["status"] != "ok":
            raise RuntimeError(f"could not write the {tensor_type} GGUF files: {written.get('error')}\n"
                               f"{written.get('log_tail', '')}")
        files[tensor_type] = written
    return files


def main(argv=None) -> dict:
    from tqdm import tqdm

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="7b", choices=["7b", "tiny"])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--systems", nargs="+", default=[*SYSTEMS, *LLAMA_CPP_SYSTEMS],
                        choices=[*SYSTEMS, *LLAMA_CPP_SYSTEMS])
    parser.add_argument("--llama-cpp-python", default=str(llama_cpp_peer.PYTHON),
                        help="the interpreter of llama.cpp's own virtual environment (make llama-cpp)")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prefills", type=int, default=3,
                        help="whole-prompt prefills each process times after its warm-up (the full layer's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-gemm", action="store_true", help="skip the GEMM section")
    parser.add_argument("--peak-seconds", type=float, default=0.5,
                        help="duration of each repeat of the CPU's peak probes (harness.arithmetic_peaks)")
    parser.add_argument("--memory-limit-gb", type=float, default=round(0.9 * memory_total_bytes() / 2**30, 1))
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    if args.prefills < 1:
        parser.error(f"--prefills: expected at least 1 (a full layer is the fastest of them), got {args.prefills}")
    limit = int(args.memory_limit_gb * 2**30)
    peaks = arithmetic_peaks(args.peak_seconds)  # this CPU's peaks, before anything else runs
    gemm = {"read_bandwidth_gb_per_s": float("nan"), "bandwidth_probe": "skipped", "shape": [0, 0], "rows": []}
    if not args.no_gemm:
        gemm = run_isolated("half_weights", "gemm_point", {})
        if gemm["status"] != "ok":
            raise RuntimeError(f"GEMM point failed: {gemm.get('error')}\n{gemm.get('log_tail', '')}")
        for row in gemm["rows"]:  # GFLOP/s against the peaks of this run
            row.update(peak_fractions(row["gflops"], peaks))
    with (tempfile.TemporaryDirectory(prefix="half-weights-") as scratch,
          tempfile.TemporaryDirectory(prefix="half-weights-gguf-") as gguf_directory):
        written = run_isolated("peers", "write_half_checkpoint",
                               {"model": args.model, "layers": args.layers, "seed": args.seed, "directory": scratch},
                               memory_limit_bytes=limit)
        if written["status"] != "ok":
            raise RuntimeError(f"could not write the weights: {written.get('error')}\n{written.get('log_tail', '')}")
        gguf = write_gguf_files(args, scratch, gguf_directory, limit)
        points = [(c, r, s) for c in args.contexts for r in range(args.rounds) for s in turned(list(args.systems), r)]
        runs = []
        for context, round_, system in tqdm(points, desc="half weights", unit="process"):
            if system in LLAMA_CPP_SYSTEMS:
                files = gguf[LLAMA_CPP_SYSTEMS[system]]
                result = files if files["status"] != "ok" else run_isolated(
                    "llama_cpp_peer", "generation_point",
                    {"model": files["model"], "deeper_model": files["deeper_model"], "context": context,
                     "new_tokens": args.new_tokens, "seed": args.seed, "repeats": args.prefills},
                    python=args.llama_cpp_python, memory_limit_bytes=limit, timeout_s=7200)
            else:
                kind, extra = SYSTEMS[system]
                result = run_isolated("peers", "generation_point",
                                      {"system": kind, "checkpoint": scratch, "context": context, "batch": "1",
                                       "new_tokens": args.new_tokens, "seed": args.seed,
                                       "prefills": args.prefills, **extra},
                                      memory_limit_bytes=limit, timeout_s=7200)
            runs.append({"system": system, "context": context, "round": round_, **result})
        paired = []
        if {"fused-float32", "fused-half"} <= set(args.systems):
            for context in tqdm(args.contexts, desc="paired float32 / half", unit="process"):
                result = run_isolated("half_weights", "paired_point",
                                      {"checkpoint": scratch, "context": context, "new_tokens": args.new_tokens,
                                       "seed": args.seed, "prefills": args.prefills},
                                      memory_limit_bytes=limit, timeout_s=7200)
                if result["status"] != "ok":
                    raise RuntimeError(f"paired point at {context} failed: {result.get('error')}\n"
                                       f"{result.get('log_tail', '')}")
                paired.append(result)
    summary = summarize(runs, args.layers)
    ours = {r["context"]: {} for r in summary}
    for r in summary:
        if r["status"] == "ok" and r["system"].startswith("fused"):
            ours[r["context"]][r["system"]] = r["tokens"]
    disagree = sorted({c for c, t in ours.items() if {"fused-half", "fused-float32"} <= set(t)
                       and t["fused-half"] != t["fused-float32"]}
                      | {p["context"] for p in paired if p["tokens"]["fused-half"] != p["tokens"]["fused-float32"]})
    results = {"machine": machine_info(), "peaks": peaks, "settings": vars(args), "gemm": gemm,
               "checkpoint_gb": written["bytes"] / 1e9, "runs": runs, "summary": summary,
               "ratios": ratios(summary), "paired": paired, "tokens_disagree": disagree}
    save(results, args.out, "half_weights.json", "half_weights.png", plot, table)
    if disagree:
        raise RuntimeError(f"half and float32 weights gave different greedy tokens at contexts {disagree}")
    return results


if __name__ == "__main__":
    main()
