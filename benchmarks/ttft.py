"""Llama2 time-to-first-token: fused RoPE+FlashAttention vs the unfused path, over prompt lengths.

Each (backend, length) point runs in a fresh process on identical weights (same seed; a checksum
proves it): the model is built (Llama2-7B dimensions, a few layers, random weights, or a real
checkpoint), the prefill graph is compiled once (reported as compile time, not in TTFT), then the
prefill + first-token choice is timed ``--repeats`` times. The same process also times one layer's
attention alone and the embedding/norm/LM-head part, which give the attention share of TTFT and the
extrapolation to the model's full depth: full = head + per_layer * full_layers, where
per_layer = (TTFT - head) / layers. A fitted exponent b of TTFT ~ S^b summarises growth per backend.
A point that runs out of memory is reported as such (the watchdog stops it first).

    python benchmarks/ttft.py                      # 7B dims, 2 layers, S = 512..4096, both backends
    python benchmarks/ttft.py --lengths 512 1024 2048 4096 8192 16384 --repeats 2
    python benchmarks/ttft.py --checkpoint /path/to/Llama-2-7b-hf --layers 32 --device Ascend
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from harness import machine_info, memory_total_bytes, run_isolated, stats, timed

SCHEMA_VERSION = 1
BACKENDS = ("fused", "unfused")


# ---------------------------------------------------------------------------------------------
# One measured point (child process).

def ttft_point(model: str, layers: int, dtype: str, batch: int, backend: str, length: int, repeats: int,
               checkpoint: str | None, seed: int, device: str) -> dict:
    import mindspore as ms
    from mindspore import Tensor, nn, ops

    ms.set_device(device)
    ms.set_context(mode=ms.GRAPH_MODE)
    from models.llama import LlamaForCausalLM, preset
    from models.llama.generate import Generator
    from models.llama.weights import load_checkpoint

    start = time.perf_counter()
    if checkpoint:
        lm = load_checkpoint(checkpoint, dtype=dtype, backend=backend, logits="last", num_layers=layers,
                             max_positions=length, progress=False)
    else:
        ms.set_seed(seed)
        config = preset(model, num_hidden_layers=layers)
        lm = LlamaForCausalLM(config, dtype=dtype, backend=backend, logits="last",
                              max_positions=max(config.max_position_embeddings, length))
    build_s = time.perf_counter() - start
    config = lm.config
    rng = np.random.default_rng(seed)
    prompts = rng.integers(0, config.vocab_size, (batch, length)).tolist()
    generator = Generator(lm)
    compile_s, ttft = timed(lambda: generator.prefill_logits(prompts)[0].argmax(-1), repeats)

    attention = lm.model.layers[0].self_attn.prefill_attention
    hidden_q = config.num_attention_heads * config.dim_per_head
    hidden_kv = config.num_key_value_heads * config.dim_per_head
    q, k, v = (Tensor(rng.standard_normal((batch, length, n), dtype=np.float32)).astype(lm.model.norm.weight.dtype)
               for n in (hidden_q, hidden_kv, hidden_kv))

    class Attention(nn.Cell):
        def __init__(self):
            super().__init__()
            self.attention = attention

        def construct(self, q, k, v):
            return self.attention(q, k, v)

    class Head(nn.Cell):
        """Everything outside the decoder layers: embedding, final norm, LM head on the last token."""

        def __init__(self):
            super().__init__()
            self.lm = lm
            self.matmul = ops.MatMul(transpose_b=True)  # as the model does (a .T would copy the whole head)

        def construct(self, ids):
            h = self.lm.model.norm(self.lm.model.embed_tokens(ids))[:, -1, :]
            weight = self.lm.model.embed_tokens.weight if self.lm.tie_word_embeddings else self.lm.lm_head.weight
            return self.matmul(h, weight)

    attention_net, head_net = Attention(), Head()
    ids = Tensor(np.array(prompts, np.int32))
    _, attention_times = timed(lambda: attention_net(q, k, v)[0].asnumpy(), repeats)
    _, head_times = timed(lambda: head_net(ids).asnumpy(), repeats)
    probe = lm.model.layers[0].self_attn.q_proj.weight.asnumpy()
    return {"backend_ran": lm.backend, "build_s": build_s, "compile_s": compile_s, "ttft": stats(ttft),
            "attention": stats(attention_times), "head": stats(head_times), "weights_checksum": float(probe[:8].astype(np.float64).sum())}


# ---------------------------------------------------------------------------------------------
# Pure parts (tested in tests/test_benchmarks.py).

def fit_exponent(lengths, times) -> float | None:
    """b in time ~ a * length^b, least squares in log-log; None with fewer than 2 points."""
    points = [(length, t) for length, t in zip(lengths, times) if t is not None and t > 0]
    if len({length for length, _ in points}) < 2:
        return None
    x, y = np.log([p[0] for p in points]), np.log([p[1] for p in points])
    return float(np.polyfit(x, y, 1)[0])


def extrapolate(ttft_s: float, head_s: float, layers: int, full_layers: int) -> tuple[float, float]:
    """(per-layer seconds, full-depth TTFT seconds) from a model of ``layers`` layers."""
    per_layer = max(ttft_s - head_s, 0.0) / layers
    return per_layer, head_s + per_layer * full_layers


def summarize(runs: list[dict], layers: int, full_layers: int) -> dict:
    """Per-length rows (both backends side by side, ratios) and the growth exponent per backend."""
    rows = []
    for length in sorted({r["length"] for r in runs}):
        row = {"length": length}
        for run in (r for r in runs if r["length"] == length):
            cell = {"status": run["status"]}
            if run["status"] == "ok":
                ttft, head = run["ttft"]["min_s"], run["head"]["min_s"]
                per_layer, full = extrapolate(ttft, head, layers, full_layers)
                cell.update({"ttft_min_s": ttft, "ttft_median_s": run["ttft"]["median_s"], "per_layer_s": per_layer,
                             "full_depth_s": full, "attention_share": min(1.0, run["attention"]["min_s"] * layers / ttft),
                             "compile_s": run["compile_s"], "peak_rss_mb": run["peak_rss_mb"]})
            else:
                cell["error"] = run.get("error", "")
            row[run["backend"]] = cell
        fused, unfused = row.get("fused", {}), row.get("unfused", {})
        if fused.get("status") == "ok" and unfused.get("status") == "ok":
            row["unfused_over_fused"] = unfused["ttft_min_s"] / fused["ttft_min_s"]
            row["unfused_over_fused_full_depth"] = unfused["full_depth_s"] / fused["full_depth_s"]
            row["fused_ttft_change"] = fused["full_depth_s"] / unfused["full_depth_s"] - 1
        rows.append(row)
    exponents = {}
    for backend in BACKENDS:
        ok = [(r["length"], r[backend]["full_depth_s"]) for r in rows if r.get(backend, {}).get("status") == "ok"]
        exponents[backend] = fit_exponent(*zip(*ok)) if ok else None
    return {"rows": rows, "exponents": exponents}


RESULT_KEYS = {"schema_version": int, "machine": dict, "settings": dict, "runs": list, "summary": dict}
RUN_KEYS = {"backend": str, "length": int, "status": str}
OK_RUN_KEYS = {"ttft": dict, "attention": dict, "head": dict, "compile_s": float, "peak_rss_mb": float,
               "weights_checksum": float, "backend_ran": str}


def validate(results: dict) -> None:
    """Raise ValueError unless ``results`` has the documented results.json shape."""
    def need(obj, keys, where):
        for key, kind in keys.items():
            if key not in obj:
                raise ValueError(f"{where}: missing {key!r}")
            if not isinstance(obj[key], kind) and not (kind is float and isinstance(obj[key], int)):
                raise ValueError(f"{where}.{key}: expected {kind.__name__}, got {type(obj[key]).__name__}")

    need(results, RESULT_KEYS, "results")
    for i, run in enumerate(results["runs"]):
        need(run, RUN_KEYS, f"runs[{i}]")
        if run["status"] == "ok":
            need(run, OK_RUN_KEYS, f"runs[{i}]")
            for part in ("ttft", "attention", "head"):
                need(run[part], {"times_s": list, "min_s": float, "median_s": float}, f"runs[{i}].{part}")
        elif "error" not in run:
            raise ValueError(f"runs[{i}]: status {run['status']!r} without an error message")
    need(results["summary"], {"rows": list, "exponents": dict}, "summary")


def same_weights(runs: list[dict]) -> bool:
    return len({r["weights_checksum"] for r in runs if r["status"] == "ok"}) <= 1


# ---------------------------------------------------------------------------------------------

def sweep(args, progress=True) -> dict:
    from tqdm import tqdm

    limit = int(args.memory_limit_gb * 2**30)
    backends = BACKENDS if args.backend == "both" else (args.backend,)
    points = [(length, backend) for length in args.lengths for backend in backends]
    runs, out_of_memory = [], set()
    bar = tqdm(points, desc="TTFT sweep", unit="point", disable=not progress)
    for length, backend in bar:
        bar.set_postfix_str(f"{backend} S={length}")
        base = {"backend": backend, "length": length}
        if backend in out_of_memory:  # a longer prompt needs at least as much memory
            runs.append({**base, "status": "oom", "error": "not run: a shorter length already ran out of memory"})
            continue
        kwargs = {"model": args.model, "layers": args.layers, "dtype": args.dtype, "batch": args.batch,
                  "backend": backend, "length": length, "repeats": args.repeats, "checkpoint": args.checkpoint,
                  "seed": args.seed, "device": args.device}
        result = run_isolated("ttft", "ttft_point", kwargs, memory_limit_bytes=limit, timeout_s=args.timeout)
        if result["status"] == "oom":
            out_of_memory.add(backend)
        runs.append({**base, **result})
    from models.llama import preset
    from models.llama.weights import read_config
    # Extrapolate to the depth of the model the layers come from.
    full_layers = (read_config(args.checkpoint)[0] if args.checkpoint else preset(args.model)).num_hidden_layers
    results = {"schema_version": SCHEMA_VERSION, "machine": machine_info(),
               "settings": {**vars(args), "full_layers": full_layers}, "runs": runs,
               "summary": summarize(runs, args.layers, full_layers)}
    if not same_weights(runs):
        raise RuntimeError("backends ran on different weights (checksums differ): the comparison is void")
    validate(results)
    return results


def table(results: dict) -> str:
    s = results["settings"]
    lines = [f"Llama2 {s['model']} dims, {s['layers']} layers (extrapolated to {s['full_layers']}), {s['dtype']}, "
             f"batch {s['batch']}, min/median of {s['repeats']}",
             "| S | fused TTFT min / median | unfused TTFT min / median | unfused / fused | fused TTFT change "
             f"| full depth ({s['full_layers']} layers) fused / unfused | attention share fused / unfused "
             "| peak RSS fused / unfused |",
             "|---|---|---|---|---|---|---|---|"]

    def ms(x):
        return f"{x * 1e3:.0f} ms" if x < 10 else f"{x:.1f} s"

    for row in results["summary"]["rows"]:
        f, u = row.get("fused", {}), row.get("unfused", {})

        def cell(c, fmt):
            if c.get("status") == "ok":
                return fmt(c)
            return c.get("status", "-") if c.get("status") != "oom" else "out of memory"
        ratio = f"{row['unfused_over_fused']:.2f}x" if "unfused_over_fused" in row else "-"
        change = f"{row['fused_ttft_change'] * 100:+.0f}%" if "fused_ttft_change" in row else "-"
        lines.append(" | ".join([
            f"| {row['length']}", cell(f, lambda c: f"{ms(c['ttft_min_s'])} / {ms(c['ttft_median_s'])}"),
            cell(u, lambda c: f"{ms(c['ttft_min_s'])} / {ms(c['ttft_median_s'])}"), ratio, change,
            f"{cell(f, lambda c: ms(c['full_depth_s']))} / {cell(u, lambda c: ms(c['full_depth_s']))}",
            f"{cell(f, lambda c: format(c['attention_share'], '.0%'))} / "
            f"{cell(u, lambda c: format(c['attention_share'], '.0%'))}",
            f"{cell(f, lambda c: format(c['peak_rss_mb'] / 1024, '.1f') + ' GB')} / "
            f"{cell(u, lambda c: format(c['peak_rss_mb'] / 1024, '.1f') + ' GB')} |"]))
    exps = results["summary"]["exponents"]
    lines.append("Fitted growth exponent b (full-depth TTFT ~ S^b): " + ", ".join(
        f"{k} {v:.2f}" if v is not None else f"{k} n/a" for k, v in exps.items()))
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["summary"]["rows"]
    exps = results["summary"]["exponents"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.3))
    for backend, color in zip(BACKENDS, ("tab:blue", "tab:red")):
        pts = [(r["length"], r[backend]["full_depth_s"]) for r in rows if r.get(backend, {}).get("status") == "ok"]
        if not pts:
            continue
        x, y = zip(*pts)
        label = backend + (f" (b = {exps[backend]:.2f})" if exps.get(backend) is not None else "")
        left.plot(x, y, "o", color=color, label=label)
        if exps.get(backend) is not None and len(x) > 1:
            slope, icpt = np.polyfit(np.log(x), np.log(y), 1)
            xs = np.geomspace(min(x), max(x), 50)
            left.plot(xs, np.exp(icpt) * xs ** slope, "-", color=color, alpha=0.6)
        oom = [r["length"] for r in rows if r.get(backend, {}).get("status") == "oom"]
        if oom:  # x marks at the bottom edge: measured nothing, ran out of memory
            left.plot(oom, [min(y)] * len(oom), "x", color=color, markersize=9,
                      label=f"{backend}: out of memory at S >= {min(oom)}")
    s = results["settings"]
    left.set(xscale="log", yscale="log", xlabel="prompt length (tokens)", ylabel="TTFT (s, min of repeats)",
             title=f"Llama2 {s['model']} TTFT, extrapolated to {s['full_layers']} layers")
    left.legend()
    left.grid(True, which="both", alpha=0.3)
    ratio = [(r["length"], r["unfused_over_fused"]) for r in rows if "unfused_over_fused" in r]
    if ratio:
        right.plot(*zip(*ratio), "o-", color="tab:green")
    right.axhline(1.0, color="gray", lw=0.8)
    lengths = [r["length"] for r in rows]
    right.set_xlim(min(lengths) / 1.2, max(lengths) * 1.2)
    right.set(xscale="log", xlabel="prompt length (tokens)", ylabel="unfused TTFT / fused TTFT",
              title="speed-up of the fused op (same weights)")
    right.grid(True, which="both", alpha=0.3)
    m = results["machine"]
    fig.suptitle(f"{m['cpu']} ({m['cpus']} cores), MindSpore {m['mindspore']}, {s['dtype']}, batch {s['batch']}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="7b", choices=["7b", "13b", "70b", "tiny"])
    parser.add_argument("--layers", type=int, default=2, help="decoder layers actually run (memory)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--backend", default="both", choices=["both", *BACKENDS])
    parser.add_argument("--device", default="CPU", help="CPU, or Ascend where the op package is installed")
    parser.add_argument("--checkpoint", help="real weights (Hugging Face or Meta directory) instead of random ones")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--memory-limit-gb", type=float, default=round(0.85 * memory_total_bytes() / 2**30, 1),
                        help="a point whose resident memory exceeds this is stopped and reported out of memory")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per point")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    if args.layers < 1 or args.batch < 1 or args.repeats < 1 or min(args.lengths) < 1:
        parser.error("--layers, --batch, --repeats and --lengths must be positive")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    results = sweep(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    plot(results, out / "ttft.png")
    print(table(results))
    print(f"wrote {out / 'results.json'} and {out / 'ttft.png'}")
    return results


if __name__ == "__main__":
    main()
