"""Training benchmark: forward + backward of RoPE + causal attention, fused vs unfused MindSpore and
PyTorch (RoPE + SDPA, and SDPA alone) when installed, side by side in one run; and a Llama-7B-dimension
training step (tokens/s), fused vs unfused.

Attention shape: B=1, 32 heads, D=128, causal, float32; the loss is sum(out * dO) with a fixed random
dO, so every competitor computes the same gradients (w.r.t. q, k, v). Each competitor runs in its own
child process (its own peak memory; a memory watchdog reports out of memory instead of crashing).
The "direct" series calls the fused forward and backward kernels without MindSpore, alternating in
one process with PyTorch's SDPA forward + backward: the same-process ratio is what machine noise
skews least. Writes JSON and a plot.

    python benchmarks/train.py --lengths 512 1024 2048 4096 8192 --repeats 3
    python benchmarks/train.py --lengths 16384 --competitors fused_direct --no-llama   # memory at 16K
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
from pathlib import Path

import numpy as np

from harness import alternate, machine_info, memory_total_bytes, run_isolated, timed


def _inputs(length, heads, head_dim, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((1, heads, length, head_dim), dtype=np.float32) for _ in range(4))


def run_mindspore(backend, length, heads, head_dim, repeats):
    """ms.grad of sum(RotaryFlashAttention(q, k, v) * dO) w.r.t. q, k, v, GRAPH_MODE."""
    import ms_rope_attention  # noqa: F401  before MindSpore, as users run it (docs/threads.md)
    import mindspore as ms
    from mindspore import Tensor, nn

    import ms_rope_attention as mra

    ms.set_device("CPU")
    ms.set_context(mode=ms.GRAPH_MODE)

    class Loss(nn.Cell):
        def __init__(self):
            super().__init__()
            self.attn = mra.RotaryFlashAttention(heads, head_dim, max_position_embeddings=length, backend=backend)

        def construct(self, q, k, v, d_out):
            return (self.attn(q, k, v) * d_out).sum()

    grad = ms.grad(Loss(), grad_position=(0, 1, 2))  # compiled as one graph in GRAPH_MODE
    q, k, v, d_out = (Tensor(x) for x in _inputs(length, heads, head_dim))
    return timed(lambda: [g.asnumpy() for g in grad(q, k, v, d_out)], repeats)[1]


def _torch_step(length, heads, head_dim, with_rope):
    """PyTorch forward + backward of (RoPE +) SDPA, Hugging Face style rotate-half."""
    import torch
    import torch.nn.functional as F

    from ms_rope_attention.rope import rope_tables

    torch.set_num_threads(os.cpu_count())
    q, k, v, d_out = (torch.from_numpy(x) for x in _inputs(length, heads, head_dim))
    for t in (q, k, v):
        t.requires_grad_(True)
    cos, sin = (torch.from_numpy(t) for t in rope_tables(head_dim, length))

    def rope(x):
        x1, x2 = x[..., : head_dim // 2], x[..., head_dim // 2:]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    def step():
        for t in (q, k, v):
            t.grad = None
        qq, kk = (rope(q), rope(k)) if with_rope else (q, k)
        F.scaled_dot_product_attention(qq, kk, v, is_causal=True).backward(d_out)

    return step


def run_torch(with_rope, length, heads, head_dim, repeats):
    return timed(_torch_step(length, heads, head_dim, with_rope), repeats)[1]


DIRECT_ROUNDS_MAX = 10
DIRECT_ROUNDS_SECONDS = 60.0


def run_direct(length, heads, head_dim, repeats):
    """The fused forward + backward kernels without MindSpore, alternating in one process with PyTorch's
    SDPA forward + backward (no RoPE) when installed; the order turns every round. {series: times}."""
    from ms_rope_attention.testing import cpu_direct
    from ms_rope_attention.cpu_kernel import last_error, library
    from ms_rope_attention.rope import rope_tables

    q, k, v, d_out = _inputs(length, heads, head_dim)
    cos, sin = rope_tables(head_dim, length)
    lib = library()
    args, (out, lse, _), keep = cpu_direct.prepare(q, k, v, cos, sin, with_lse=True, with_rotated_key=False)
    grad_args, _, grad_keep = cpu_direct.prepare_grad(q, k, v, cos, sin, None, None, out, lse, d_out)

    def fused():
        if cpu_direct.launch(args) != 0:
            raise RuntimeError(f"the forward kernel refused the call: {last_error()}")
        if lib.RotaryFlashAttentionGradRun(*grad_args, ctypes.c_int64(0), ctypes.c_int64(0), ctypes.c_int64(0)) != 0:
            raise RuntimeError(f"the backward kernel refused the call: {last_error()}")

    series = {"fused_direct": fused}
    try:
        series["torch_sdpa_same_process"] = _torch_step(length, heads, head_dim, False)
    except ImportError:
        pass
    times = alternate(series, repeats, DIRECT_ROUNDS_MAX, DIRECT_ROUNDS_SECONDS)
    del keep, grad_keep
    return times


def run_llama_step(backend, model, length, layers, repeats):
    """One AdamW training step of a Llama preset (``layers`` decoder layers), batch 1."""
    import ms_rope_attention  # noqa: F401  before MindSpore, as users run it (docs/threads.md)
    import mindspore as ms
    from mindspore import Tensor, nn

    from models.llama import LlamaForCausalLM, preset
    from models.llama.losses import LlamaForTraining

    ms.set_device("CPU")
    ms.set_context(mode=ms.GRAPH_MODE)
    ms.set_seed(0)
    config = preset(model, num_hidden_layers=layers)
    lm = LlamaForCausalLM(config, backend=backend, max_positions=max(length, config.max_position_embeddings))
    net = LlamaForTraining(lm)
    step = nn.TrainOneStepCell(net, nn.AdamWeightDecay(net.trainable_params(), learning_rate=1e-5))
    ids = Tensor(np.random.default_rng(0).integers(0, config.vocab_size, (1, length)).astype(np.int32))
    return timed(lambda: step(ids, ids).asnumpy(), repeats)[1]


COMPETITORS = {
    "fused": lambda a: run_mindspore("fused", *a),
    "unfused": lambda a: run_mindspore("unfused", *a),
    "fused_direct": lambda a: run_direct(*a),  # also torch_sdpa_same_process
    "torch_rope_sdpa": lambda a: run_torch(True, *a),
    "torch_sdpa": lambda a: run_torch(False, *a),
}


def competitor(name, args):
    """Child-process entry (see harness.run_isolated)."""
    if name.startswith("llama_"):
        return {"times": run_llama_step(name[len("llama_"):], *args)}
    times = COMPETITORS[name](args)
    if name == "fused_direct":
        return {"times": times.pop("fused_direct"), "same_process": times}
    return {"times": times}


def measure(name, args, memory_limit):
    """One competitor in its own process: {"status": "ok", "times": ...} or the failure's status and error."""
    return run_isolated("train", "competitor", {"name": name, "args": args}, memory_limit_bytes=memory_limit)


def summarize(result, flops=None, tokens=None):
    """min/median in ms (and GFLOP/s or tokens/s) of a measured result; an error result as it is."""
    if "times" not in result:
        return result
    times = result["times"]
    out = {**result, "min_ms": min(times) * 1e3, "median_ms": statistics.median(times) * 1e3}
    if flops:
        out["gflops"] = flops / min(times) / 1e9
    if tokens:
        out["tokens_per_s"] = tokens / min(times)
    return out


def ratio(row, faster, slower):
    """How many times ``faster`` beats ``slower`` (by min), or None where either did not run."""
    a, b = row.get(faster, {}), row.get(slower, {})
    return b["min_ms"] / a["min_ms"] if "min_ms" in a and "min_ms" in b else None


RATIOS = (("fused_vs_unfused", "fused", "unfused"), ("fused_vs_torch_rope_sdpa", "fused", "torch_rope_sdpa"),
          ("fused_vs_torch_sdpa", "fused", "torch_sdpa"),
          ("direct_vs_torch_sdpa_same_process", "fused_direct", "torch_sdpa_same_process"))


def format_row(row):
    parts = [f"S={row['length']}"]
    for name, res in row.items():
        if not isinstance(res, dict) or name == "ratios":
            continue
        if "min_ms" in res:
            rate = f"{res['gflops']:.0f} GF/s" if "gflops" in res else f"{res['tokens_per_s']:.0f} tok/s"
            parts.append(f"{name}: min {res['min_ms']:.1f} ms / med {res['median_ms']:.1f} ms ({rate}, "
                         f"{res.get('peak_rss_mb', 0):.0f} MB)")
        else:
            parts.append(f"{name}: {res.get('status')}: {res.get('error')}")
    for label, value in row.get("ratios", {}).items():
        parts.append(f"{label}: {value:.2f}x")
    return "\n  ".join(parts)


def plot(rows, llama_rows, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 2 if llama_rows else 1, figsize=(12 if llama_rows else 7, 4.5), squeeze=False)
    ax = axes[0][0]
    names = sorted({n for r in rows for n, v in r.items() if isinstance(v, dict) and "min_ms" in v})
    for name in names:
        pts = [(r["length"], r[name]["min_ms"]) for r in rows if "min_ms" in r.get(name, {})]
        ax.plot(*zip(*pts), marker="o", label=name)
    ax.set(xscale="log", yscale="log", xlabel="sequence length", ylabel="forward + backward (ms, min)",
           title="RoPE + causal attention fwd+bwd, B=1, 32 heads, D=128, float32")
    ax.set_xscale("log", base=2)
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    if llama_rows:
        ax = axes[0][1]
        for backend in ("fused", "unfused"):
            pts = [(r["length"], r[backend]["tokens_per_s"]) for r in llama_rows if "tokens_per_s" in r.get(backend, {})]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=backend)
        ax.set(xlabel="sequence length", ylabel="tokens / s", title="Llama: one AdamW training step, batch 1")
        ax.set_xscale("log", base=2)
        ax.legend()
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--competitors", nargs="+", default=list(COMPETITORS), choices=list(COMPETITORS))
    parser.add_argument("--llama-lengths", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--llama-layers", type=int, default=2)
    parser.add_argument("--llama-model", default="7b", help="Llama preset of the training-step sweep")
    parser.add_argument("--no-llama", action="store_true", help="skip the Llama training-step sweep")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--memory-limit-gb", type=float, default=0.85 * memory_total_bytes() / 2**30)
    args = parser.parse_args(argv)
    limit = int(args.memory_limit_gb * 2**30)
    rows = []
    for length in args.lengths:
        flops = 2.5 * 2 * args.heads * length * length * args.head_dim  # causal fwd (2 GEMMs) + bwd (5)
        row = {"length": length}
        for name in args.competitors:
            result = measure(name, (length, args.heads, args.head_dim, args.repeats), limit)
            row[name] = summarize(result, flops)
            for other, times in result.get("same_process", {}).items():
                row[other] = summarize({"times": times, "peak_rss_mb": result["peak_rss_mb"]}, flops)
            row[name].pop("same_process", None)
        row["ratios"] = {label: r for label, a, b in RATIOS if (r := ratio(row, a, b)) is not None}
        rows.append(row)
        print(format_row(row), flush=True)
    llama_rows = []
    for length in [] if args.no_llama else args.llama_lengths:
        row = {"length": length}
        for backend in ("fused", "unfused"):
            result = measure(f"llama_{backend}", (args.llama_model, length, args.llama_layers, args.repeats), limit)
            row[backend] = summarize(result, tokens=length)
        row["ratios"] = {label: r for label, a, b in (("fused_vs_unfused", "fused", "unfused"),)
                         if (r := ratio(row, a, b)) is not None}
        llama_rows.append(row)
        print(f"Llama {args.llama_model} training step, " + format_row(row), flush=True)
    results = {"machine": machine_info(), "config": vars(args), "attention": rows, "llama_step": llama_rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "train.json").write_text(json.dumps(results, indent=2))
    plot(rows, llama_rows, out / "train.png")
    print(f"wrote {out / 'train.json'} and {out / 'train.png'}")
    return results


if __name__ == "__main__":
    main()
