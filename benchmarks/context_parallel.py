"""Context parallelism's point: per-rank peak memory of a Llama training step (forward + backward)
with each sequence split over 2 ranks (CP=2, ``--context-parallel 2``), against one process holding
the whole sequence, side by side in one run at the same lengths.

Model: Llama2's structure at a width that trains on 2 cores in minutes (hidden 1024, 8 heads of 128
like 7B's, MLP 2816, 32000-token vocabulary, 2 layers, float32), batch 1, causal, fused op. Every
point is a fresh process (CP: 2 msrun ranks); a watchdog stops any process whose resident memory
passes ``--memory-limit-gb`` per rank (default: 43% of this machine, so two CP ranks and the
launcher fit beside each other) and reports it as out of memory. Both ranks share this machine's
cores, so CP's step time is not what two devices would give; memory is the point. The CP ranks' losses summed are checked against the one
process's at each length that both finish. Writes JSON and a plot.

    python benchmarks/context_parallel.py                       # S = 2048, 4096, 8192
    python benchmarks/context_parallel.py --lengths 4096 8192 --memory-limit-gb 6
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from harness import machine_info, memory_total_bytes, run_isolated, save  # noqa: E402

CONFIG = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=2,
              num_attention_heads=8, num_key_value_heads=8)


def _batch(length: int):
    import numpy as np

    ids = np.random.default_rng(0).integers(0, CONFIG["vocab_size"], (1, length)).astype(np.int32)
    return ids, ids.copy()


def _model(length: int, mesh=None):
    import mindspore as ms

    from models.llama import LlamaForCausalLM, preset

    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_seed(0)  # the same weights in every process
    return LlamaForCausalLM(preset("7b", max_position_embeddings=length, **CONFIG), parallel=mesh)


def _step(net, *inputs) -> tuple[float, float]:
    """(loss, seconds) of one forward + backward (compiled first, so the time is of the second call)."""
    import mindspore as ms

    step = ms.value_and_grad(net, None, net.trainable_params())
    step(*inputs)
    start = time.perf_counter()
    loss, _ = step(*inputs)
    return float(loss.asnumpy()), time.perf_counter() - start


def one_process(length: int) -> dict:
    """A training step on the whole sequence (run by ``harness.run_isolated``, which adds the peak)."""
    import mindspore as ms

    from models.llama.losses import LlamaForTraining

    ms.set_device("CPU")
    ids, labels = _batch(length)
    loss, seconds = _step(LlamaForTraining(_model(length)), ms.Tensor(ids), ms.Tensor(labels))
    return {"loss": loss, "step_s": seconds}


def _watch_memory(limit_bytes: int) -> None:
    """Exit this rank (the others follow) once its resident memory passes the limit."""
    page = os.sysconf("SC_PAGE_SIZE")
    while True:
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * page
        if rss > limit_bytes:
            print(f"RESULT cp oom {rss / 2**20:.0f}", flush=True)
            os._exit(3)
        time.sleep(0.05)


def context_parallel_rank(length: int, limit_bytes: int) -> None:
    """One CP rank (under msrun): its part of the step; prints ``RESULT cp ok <loss> <s> <peak MB>``."""
    import mindspore as ms
    from mindspore.communication import init

    ms.set_device("CPU")
    init()
    threading.Thread(target=_watch_memory, args=(limit_bytes,), daemon=True).start()
    from ms_rope_attention.distributed import ParallelMesh
    from models.llama.losses import ContextParallelTraining, context_parallel_batch

    mesh = ParallelMesh.create(context=2)
    ids, labels = _batch(length)
    part_ids, part_targets, scored = context_parallel_batch(ids, labels, mesh.context.rank, mesh.context.size)
    net = ContextParallelTraining(_model(length, mesh))
    loss, seconds = _step(net, ms.Tensor(part_ids), ms.Tensor(part_targets), ms.Tensor(scored, ms.int32))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"RESULT cp ok {loss!r} {seconds!r} {peak!r}", flush=True)


def context_parallel(length: int, limit_bytes: int) -> dict:
    from ms_rope_attention.distributed.launch import launch

    run = launch(str(HERE / "context_parallel.py"), ["--rank", str(length), str(limit_bytes)], workers=2, timeout=3600)
    lines = [next((line.split() for line in lines if line.startswith("RESULT cp")), None) for lines in run.results()]
    if any(line and line[2] == "oom" for line in lines):
        return {"status": "oom", "peak_rss_mb": max(float(line[3]) for line in lines if line and line[2] == "oom")}
    if run.returncode or not all(lines):
        return {"status": "error", "log_tail": "\n".join(log[-2000:] for log in run.logs)}
    return {"status": "ok", "loss": sum(float(line[3]) for line in lines),
            "step_s": max(float(line[4]) for line in lines),
            "peak_rss_mb": max(float(line[5]) for line in lines), "rank_peaks_mb": [float(line[5]) for line in lines]}


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, label in (("one_process", "one process"), ("context_parallel", "CP=2, per rank")):
        points = [(row["length"], row[name]["peak_rss_mb"] / 1024) for row in results["rows"]
                  if row[name]["status"] == "ok"]
        if points:
            ax.plot(*zip(*points), marker="o", label=label)
    ax.axhline(results["memory_limit_gb"], color="grey", linestyle="--", label="per-rank limit")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length S")
    ax.set_ylabel("peak resident memory (GiB)")
    ax.set_title("Llama training step (hidden 1024, 2 layers, float32)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def table(results: dict) -> str:
    lines = ["| S | one process: peak GiB, step s | CP=2: peak GiB per rank, step s | peak ratio | loss diff |",
             "|---|---|---|---|---|"]
    for row in results["rows"]:
        one, cp = row["one_process"], row["context_parallel"]
        cell = lambda r: (f"{r['peak_rss_mb'] / 1024:.2f}, {r['step_s']:.1f}" if r["status"] == "ok"  # noqa: E731
                          else r["status"])
        both = one["status"] == cp["status"] == "ok"
        ratio = f"{cp['peak_rss_mb'] / one['peak_rss_mb']:.2f}" if both else "-"
        diff = f"{abs(cp['loss'] - one['loss']):.1e}" if both else "-"
        lines.append(f"| {row['length']} | {cell(one)} | {cell(cp)} | {ratio} | {diff} |")
    for name in ("one_process", "context_parallel"):
        fits = [row["length"] for row in results["rows"] if row[name]["status"] == "ok"]
        lines.append(f"longest S within {results['memory_limit_gb']:.1f} GiB, {name}: {max(fits) if fits else '-'}")
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--memory-limit-gb", type=float, default=round(0.43 * memory_total_bytes() / 2**30, 1))
    parser.add_argument("--out", default=str(HERE / "results"))
    args = parser.parse_args(argv)
    limit = int(args.memory_limit_gb * 2**30)
    results = {"machine": machine_info(), "config": CONFIG, "memory_limit_gb": args.memory_limit_gb, "rows": []}
    for length in args.lengths:
        row = {"length": length, "one_process": run_isolated("context_parallel", "one_process", {"length": length},
                                                             memory_limit_bytes=limit),
               "context_parallel": context_parallel(length, limit)}
        results["rows"].append(row)
        print(f"S={length}: one process {row['one_process']['status']}, CP=2 {row['context_parallel']['status']}",
              flush=True)
    save(results, args.out, "context_parallel.json", "context_parallel.png", plot, table)
    return results


if __name__ == "__main__":
    if sys.argv[1:2] == ["--rank"]:  # a CP rank, launched by context_parallel()
        context_parallel_rank(int(sys.argv[2]), int(sys.argv[3]))
    else:
        main()
