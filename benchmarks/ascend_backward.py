"""Training on Ascend with each backward the op can build there, side by side (run by
ms_rope_attention/aclnn/verify_on_ascend.sh; needs an NPU with the op package installed).

1. Forward + backward of RoPE + causal attention (B = 1, 32 heads, D = 128, float16, BSND) at
   S = 2048..16384: this op with ``RFA_ASCEND_BACKWARD=flash_attention_score`` (the default:
   MindSpore's FlashAttention backward on the rotated q/k), ``=unfused`` (S x S autodiff) and
   ``=kernel`` (the fused backward kernel RotaryFlashAttentionGrad, verified on the CPU emulation
   only), against ``ops.rotary_position_embedding`` + ``ops.flash_attention_score``, what a
   MindSpore user would write instead. Min and median time and peak device memory
   (``mindspore.runtime.max_memory_allocated``), each system in a fresh process; out of memory is
   reported as such.
2. The tiny Llama (float16) trained 20 AdamW steps on one fixed batch with each backward: the
   losses side by side (they should agree to float16 rounding).

Writes JSON and a plot. Not run on hardware yet (no NPU was available to this project).

    python benchmarks/ascend_backward.py --lengths 2048 4096 8192 16384
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from harness import machine_info, run_isolated, save, stats, timed  # noqa: E402

SYSTEMS = {"fused forward, FlashAttention backward": ("op", "flash_attention_score"),
           "fused forward, unfused backward": ("op", "unfused"),
           "fused forward, fused backward kernel": ("op", "kernel"),
           "rotary_position_embedding + flash_attention_score": ("mindspore", None)}
BACKWARDS = [backward for kind, backward in SYSTEMS.values() if kind == "op"]  # each trains the tiny Llama
HEADS, HEAD_DIM = 32, 128


def _ascend(backward: str | None):
    """Ascend, GRAPH_MODE at O0 (what aclnn custom ops run under); the backward switch set before
    the op builds its primitive."""
    if backward is not None:
        os.environ["RFA_ASCEND_BACKWARD"] = backward
    import mindspore as ms

    ms.set_device("Ascend")
    ms.set_context(mode=ms.GRAPH_MODE, jit_config={"jit_level": "O0"})
    return ms


def attention_step(kind: str, backward: str | None, length: int, repeats: int) -> dict:
    """Times of ``ms.grad`` of sum(attention(q, k, v) * dO) w.r.t. q, k, v, and the peak memory."""
    ms = _ascend(backward)
    import numpy as np
    from mindspore import Tensor, nn, ops

    import ms_rope_attention as mra

    rng = np.random.default_rng(0)
    q, k, v, d_out = (Tensor(rng.standard_normal((1, length, HEADS, HEAD_DIM)).astype(np.float16)) for _ in range(4))
    cos, sin = (Tensor(t) for t in mra.rope_tables(HEAD_DIM, length))
    mask = Tensor(np.triu(np.ones((2048, 2048), np.bool_), 1))

    class Loss(nn.Cell):
        def construct(self, q, k, v, d_out):
            if kind == "op":
                out = mra.rotary_flash_attention(q, k, v, cos, sin, HEADS, input_layout="BSND")
            else:
                c, s = cos.astype(q.dtype).reshape(1, length, 1, HEAD_DIM), sin.astype(q.dtype).reshape(1, length, 1,
                                                                                                          HEAD_DIM)
                out = ops.flash_attention_score(ops.rotary_position_embedding(q, c, s, 0),
                                                ops.rotary_position_embedding(k, c, s, 0), v, HEADS, attn_mask=mask,
                                                scalar_value=HEAD_DIM ** -0.5, input_layout="BSND", sparse_mode=3)
            return (out.astype(ms.float32) * d_out.astype(ms.float32)).sum()

    grad = ms.grad(Loss(), grad_position=(0, 1, 2))
    ms.runtime.reset_peak_memory_stats()
    first, times = timed(lambda: [g.asnumpy() for g in grad(q, k, v, d_out)], repeats)
    return {"first_s": first, **stats(times), "peak_device_mb": ms.runtime.max_memory_allocated() / 2**20}


def llama_losses(backward: str, steps: int) -> dict:
    """The tiny Llama in float16 trained ``steps`` AdamW steps on one fixed batch: the losses."""
    ms = _ascend(backward)
    import numpy as np
    from mindspore import Tensor, nn

    from models.llama import LlamaForCausalLM, preset
    from models.llama.losses import LlamaForTraining

    ms.set_seed(0)
    net = LlamaForTraining(LlamaForCausalLM(preset("tiny"), dtype="float16"))
    optimizer = nn.AdamWeightDecay(net.trainable_params(), learning_rate=1e-3)
    step = ms.value_and_grad(net, None, optimizer.parameters)
    ids = Tensor(np.random.default_rng(0).integers(0, 256, (2, 256)).astype(np.int32))
    losses = []
    for _ in range(steps):
        loss, grads = step(ids, ids)
        optimizer(grads)
        losses.append(float(loss.asnumpy()))
    return {"losses": losses}


def table(results: dict) -> str:
    names = list(SYSTEMS)
    lines = ["| S | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for row in results["attention"]:
        cells = []
        for name in names:
            point = row[name]
            cells.append(f"{point['min_s'] * 1e3:.1f} ms (median {point['median_s'] * 1e3:.1f}), "
                         f"{point['peak_device_mb']:.0f} MB" if point["status"] == "ok" else point["status"])
        lines.append(f"| {row['length']} | " + " | ".join(cells) + " |")
    for backward, result in results["llama"].items():
        shown = ", ".join(f"{x:.4f}" for x in result.get("losses", [])[::5]) or result.get("status", "")
        lines.append(f"tiny Llama, {backward} backward, losses at steps 1, 6, 11, 16: {shown}")
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for name in SYSTEMS:
        points = [(row["length"], row[name]) for row in results["attention"] if row[name]["status"] == "ok"]
        if points:
            axes[0].plot([s for s, _ in points], [p["min_s"] for _, p in points], marker="o", label=name)
            axes[1].plot([s for s, _ in points], [p["peak_device_mb"] / 1024 for _, p in points], marker="o")
    axes[0].set_ylabel("forward + backward (s)")
    axes[1].set_ylabel("peak device memory (GiB)")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length S")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default=str(HERE / "results" / "ascend"))
    args = parser.parse_args(argv)
    results = {"machine": machine_info(), "attention": [], "llama": {}}
    for length in args.lengths:
        row = {"length": length}
        for name, (kind, backward) in SYSTEMS.items():
            row[name] = run_isolated("ascend_backward", "attention_step",
                                     {"kind": kind, "backward": backward, "length": length, "repeats": args.repeats})
        results["attention"].append(row)
        print(f"S={length}: " + ", ".join(f"{name} {row[name]['status']}" for name in SYSTEMS), flush=True)
    for backward in BACKWARDS:
        results["llama"][backward] = run_isolated("ascend_backward", "llama_losses",
                                                  {"backward": backward, "steps": args.steps})
    save(results, args.out, "ascend_backward.json", "ascend_backward.png", plot, table)
    return results


if __name__ == "__main__":
    main()
