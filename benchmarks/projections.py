"""The projections' GEMM, side by side in one process: MindSpore's CPU MatMul against this project's
OpenBLAS op (``ms_rope_attention.linear``), numpy's (OpenBLAS) and PyTorch's (MKL) when installed, at
Llama2-7B's projection shapes; then the whole prefill of a Llama2-7B-dimension model with each of
the two MindSpore GEMMs (``projections="auto"`` vs ``"matmul"``, same weights). Series alternate
round by round (``harness.alternate``), so a noisy machine slows them alike. Reports min and median,
GFLOP/s and the ratios against MatMul; writes JSON.

    python benchmarks/projections.py --lengths 512 2048 --out benchmarks/results
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from harness import alternate, machine_info, stats

# (name, out_features, in_features) of one Llama2-7B layer; q/k/v/o share a shape.
SHAPES = [("q/k/v/o_proj", 4096, 4096), ("gate/up_proj", 11008, 4096), ("down_proj", 4096, 11008)]


def op_series(length: int, out_features: int, in_features: int) -> dict:
    """{competitor: callable} computing x W^T for x (length, in), W (out, in) float32, each returning
    once the result is on the host."""
    from mindspore import Tensor, nn, ops

    from ms_rope_attention.linear import linear_op

    rng = np.random.default_rng(0)
    x = rng.standard_normal((length, in_features), dtype=np.float32)
    w = rng.standard_normal((out_features, in_features), dtype=np.float32)
    xt, wt = Tensor(x), Tensor(w)

    class Projection(nn.Cell):
        def __init__(self, op):
            super().__init__()
            self.op = op

        def construct(self, x, w):
            return self.op(x, w)

    matmul, blas = Projection(ops.MatMul(transpose_b=True)), Projection(linear_op())
    series = {"MindSpore MatMul": lambda: matmul(xt, wt).asnumpy(),
              "OpenBLAS op (this project)": lambda: blas(xt, wt).asnumpy(),
              "numpy": lambda: x @ w.T}
    try:
        import torch
        tx, tw = torch.from_numpy(x), torch.from_numpy(w)
        series["PyTorch linear"] = lambda: torch.nn.functional.linear(tx, tw).numpy()
    except ImportError:
        pass
    return series


def model_series(length: int, layers: int, seed: int) -> dict:
    """{projections: callable} running one prefill of a Llama2-7B-dimension model, both models on
    the same weights."""
    import mindspore as ms

    from models.llama import LlamaForCausalLM, preset
    from models.llama.generate import Generator
    from ttft import prompt_ids

    config = preset("7b", num_hidden_layers=layers)
    models = {}
    for projections in ("matmul", "auto"):
        ms.set_seed(seed)  # the same random weights for both
        models[projections] = LlamaForCausalLM(config, backend="fused", logits="last", max_positions=length,
                                               projections=projections)
    prompts = prompt_ids(seed, 1, length, config.vocab_size)
    generators = {name: Generator(lm) for name, lm in models.items()}
    return {"MindSpore MatMul": lambda: generators["matmul"].prefill_logits(prompts),
            "OpenBLAS op (this project)": lambda: generators["auto"].prefill_logits(prompts)}


def summarize(times: dict, flop: float) -> dict:
    base = min(times["MindSpore MatMul"])
    return {name: {**stats(t), "gflops": flop / min(t) / 1e9, "speedup_vs_matmul": base / min(t)}
            for name, t in times.items()}


def main(argv=None) -> dict:
    import mindspore as ms

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--layers", type=int, default=2, help="decoder layers of the model-level A/B")
    parser.add_argument("--repeats", type=int, default=5, help="rounds at least (more when they fit in 30 s)")
    parser.add_argument("--model-repeats", type=int, default=6, help="rounds of the model-level A/B")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    ms.set_device("CPU")
    ms.set_context(mode=ms.GRAPH_MODE)
    report = {"machine": machine_info(), "settings": vars(args), "ops": {}, "model": {}}
    for length in args.lengths:
        for name, n, k in SHAPES:
            key = f"S={length} {name} ({length}x{k} @ {k}x{n})"
            report["ops"][key] = summarize(alternate(op_series(length, n, k), args.repeats), 2.0 * length * n * k)
            print(key)
            for who, r in report["ops"][key].items():
                print(f"  {who:28s} {r['min_s'] * 1e3:8.1f} / {r['median_s'] * 1e3:8.1f} ms  {r['gflops']:6.1f} GFLOP/s"
                      f"  x{r['speedup_vs_matmul']:.2f}")
        times = alternate(model_series(length, args.layers, args.seed), args.model_repeats, args.model_repeats, 0.0)
        flop = 2.0 * length * args.layers * sum(n * k * (4 if "q/k" in s else 2 if "gate" in s else 1)
                                                for s, n, k in SHAPES)
        report["model"][str(length)] = summarize(times, flop)
        print(f"S={length} prefill, {args.layers} layers (GFLOP/s over the projections' {flop / 1e9:.0f} GFLOP)")
        for who, r in report["model"][str(length)].items():
            print(f"  {who:28s} {r['min_s']:8.3f} / {r['median_s']:8.3f} s  {r['gflops']:6.1f} GFLOP/s"
                  f"  x{r['speedup_vs_matmul']:.2f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "projections.json").write_text(json.dumps(report, indent=2))
    print(f"wrote {out / 'projections.json'}")
    return report


if __name__ == "__main__":
    main()
