"""The projections' GEMM, side by side in one process: MindSpore's CPU MatMul against this project's
OpenBLAS op (``ms_rope_attention.linear``), the same op computing in bfloat16 on oneDNN
(``compute_dtype="bfloat16"``, W rounded to bfloat16, as stored and packed once by ``linear.pack_weight``;
where the CPU has bfloat16 instructions and the library has oneDNN), numpy's (OpenBLAS) and PyTorch's (MKL; and its bfloat16 linear) when installed, at
a decoder layer's projection shapes (Llama2-7B by default); then the whole prefill of that model
(2 layers) with each of the two MindSpore GEMMs (``projections="auto"`` vs ``"matmul"``, same
weights). Series alternate round by round (``harness.alternate``), so a noisy machine slows them
alike. Reports min and median, GFLOP/s and the ratios against MatMul, and each GFLOP/s as a fraction
of this CPU's float32 FMA and bfloat16 dot-product (and AMX, where present) peaks, probed at the start
of the same run (``harness.arithmetic_peaks``); writes JSON.

    python benchmarks/projections.py --lengths 512 2048 --out benchmarks/results
    python benchmarks/projections.py --lengths 512 --repeats 3 --model-repeats 2   # a short run
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from harness import alternate, arithmetic_peaks, machine_info, peak_fractions, stats


def layer_shapes(config) -> list[tuple[str, int, int, int]]:
    """(name, out_features, in_features, count per layer) of a decoder layer's projections."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q, kv = config.num_attention_heads * config.dim_per_head, config.num_key_value_heads * config.dim_per_head
    shapes = [("q_proj", q, hidden, 1), ("k/v_proj", kv, hidden, 2), ("o_proj", hidden, q, 1),
              ("gate/up_proj", inter, hidden, 2), ("down_proj", hidden, inter, 1)]
    merged = {}  # 7B's q/k/v/o share one shape: measure it once
    for name, n, k, count in shapes:
        if (n, k) in merged:
            old = merged[(n, k)]
            merged[(n, k)] = (f"{old[0]}, {name}", n, k, old[3] + count)
        else:
            merged[(n, k)] = (name, n, k, count)
    return list(merged.values())


def bfloat16_compute() -> str | None:
    """Why the bfloat16 series cannot run here, or None when it can."""
    from ms_rope_attention import linear
    from ms_rope_attention.compute import native_half_dtypes

    if "bfloat16" not in native_half_dtypes():
        return "this CPU has no bfloat16 instructions (avx512_bf16 / amx_bf16)"
    if not linear.onednn():
        return "the projection library was built without oneDNN"
    return None


def op_series(length: int, out_features: int, in_features: int) -> dict:
    """{competitor: callable} computing x W^T for x (length, in), W (out, in) float32 (bfloat16 for the
    bfloat16 series), each returning once the result is on the host."""
    import ml_dtypes
    from mindspore import Tensor, nn, ops

    from ms_rope_attention.linear import linear_op, pack_weight, packed_bytes

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
              "OpenBLAS op (this project)": lambda: blas(xt, wt).asnumpy()}
    if bfloat16_compute() is None:
        bf16, wt16 = Projection(linear_op("bfloat16")), Tensor(w.astype(ml_dtypes.bfloat16))
        # W as stored runs on this process's engine (machine.bf16_engine: oneDNN, or the float32 FMAs where
        # this CPU's vdpbf16ps is the slower unit); packed W always on oneDNN
        series["bfloat16 op (this project, W as stored)"] = lambda: bf16(xt, wt16).asnumpy()
        packed = Projection(linear_op("bfloat16", packed_out_features=out_features))
        wpacked = Tensor(np.zeros(packed_bytes(out_features, in_features), np.uint8))
        pack_weight(w.astype(ml_dtypes.bfloat16), out=wpacked.asnumpy())  # in the tensor's memory: its alignment
        series["bfloat16 op, packed W (oneDNN)"] = lambda: packed(xt, wpacked).asnumpy()
    series["numpy"] = lambda: x @ w.T
    try:
        import torch
        tx, tw = torch.from_numpy(x), torch.from_numpy(w)
        series["PyTorch linear"] = lambda: torch.nn.functional.linear(tx, tw).numpy()
        tx16, tw16 = tx.bfloat16(), tw.bfloat16()
        series["PyTorch linear bfloat16"] = lambda: torch.nn.functional.linear(tx16, tw16).float().numpy()
    except ImportError:
        pass
    return series


def model_series(config, length: int, seed: int) -> dict:
    """{projections: callable} running one prefill of the model, both models on the same weights."""
    import ms_rope_attention  # noqa: F401  before MindSpore, as users run it (docs/threads.md)
    import mindspore as ms

    from models.llama import LlamaForCausalLM
    from models.llama.engine import Generator
    from peers import prompt_ids

    models = {}
    for projections in ("matmul", "auto"):
        ms.set_seed(seed)  # the same random weights for both
        models[projections] = LlamaForCausalLM(config, backend="fused", logits="last", max_positions=length,
                                               projections=projections)
    prompts = prompt_ids(seed, 1, length, config.vocab_size)
    generators = {name: Generator(lm, slots=1) for name, lm in models.items()}
    return {"MindSpore MatMul": lambda: generators["matmul"].prefill_logits(prompts),
            "OpenBLAS op (this project)": lambda: generators["auto"].prefill_logits(prompts)}


def summarize(times: dict, flop: float, peaks: dict | None = None) -> dict:
    """Per series: min/median, GFLOP/s (from the min), the speedup over MatMul and the GFLOP/s as a
    fraction of each of ``peaks`` (``harness.arithmetic_peaks``; None where a peak is unavailable)."""
    base = min(times["MindSpore MatMul"])
    return {name: {**stats(t), "gflops": flop / min(t) / 1e9, "speedup_vs_matmul": base / min(t),
                   **peak_fractions(flop / min(t) / 1e9, peaks)}
            for name, t in times.items()}


def of_peaks(r: dict) -> str:
    """A series' share of the float32 / bfloat16 (/ AMX) peaks, for the printed table."""
    def pct(key):
        return "n/a" if r.get(key) is None else f"{100 * r[key]:.0f}%"
    text = f"{pct('fraction_of_float32_fma_peak')} fp32 / {pct('fraction_of_bfloat16_dot_peak')} bf16"
    if r.get("fraction_of_bfloat16_amx_peak") is not None:
        text += f" / {pct('fraction_of_bfloat16_amx_peak')} AMX"
    return text + " peak"


def peaks_line(peaks: dict) -> str:
    def gflops(key):
        value = peaks.get(f"{key}_gflops")
        return f"{value:.0f} GFLOP/s" if value else peaks["unavailable"].get(key, "not available")
    line = (f"peaks of this CPU, this run ({peaks['threads']} threads, best of {peaks['repeats']}): float32 FMA "
            f"{gflops('float32_fma')}, bfloat16 vdpbf16ps {gflops('bfloat16_dot')}")
    return line + (f", bfloat16 AMX {gflops('bfloat16_amx')}" if peaks.get("bfloat16_amx_gflops") else "")


def main(argv=None) -> dict:
    import ms_rope_attention  # noqa: F401  before MindSpore, as users run it (docs/threads.md)
    import mindspore as ms

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="7b", choices=["7b", "13b", "70b", "tiny"])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--layers", type=int, default=2, help="decoder layers of the model-level A/B")
    parser.add_argument("--repeats", type=int, default=5, help="rounds at least (more when they fit in 30 s)")
    parser.add_argument("--model-repeats", type=int, default=6, help="rounds of the model-level A/B")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--peak-seconds", type=float, default=0.5, help="duration of each peak probe's repeat")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    from models.llama import preset

    ms.set_device("CPU")
    ms.set_context(mode=ms.GRAPH_MODE)
    config = preset(args.model, num_hidden_layers=args.layers)
    shapes = layer_shapes(config)
    peaks = arithmetic_peaks(args.peak_seconds)  # first: nothing else on the cores yet
    print(peaks_line(peaks))
    if bfloat16_compute():
        print(f"no bfloat16 op series: {bfloat16_compute()}")
    from ms_rope_attention import linear

    report = {"machine": machine_info(), "peaks": peaks, "settings": vars(args), "ops": {}, "model": {},
              "onednn": linear.onednn(), "bfloat16_op": bfloat16_compute() or "measured"}
    for length in args.lengths:
        for name, n, k, _ in shapes:
            key = f"S={length} {name} ({length}x{k} @ {k}x{n})"
            report["ops"][key] = summarize(alternate(op_series(length, n, k), args.repeats), 2.0 * length * n * k,
                                           peaks)
            print(key)
            for who, r in report["ops"][key].items():
                print(f"  {who:28s} {r['min_s'] * 1e3:8.1f} / {r['median_s'] * 1e3:8.1f} ms  {r['gflops']:6.1f} GFLOP/s"
                      f"  x{r['speedup_vs_matmul']:.2f}  {of_peaks(r)}")
        times = alternate(model_series(config, length, args.seed), args.model_repeats, args.model_repeats, 0.0)
        flop = 2.0 * length * args.layers * sum(n * k * count for _, n, k, count in shapes)
        report["model"][str(length)] = summarize(times, flop, peaks)
        print(f"S={length} prefill, {args.layers} layers (GFLOP/s over the projections' {flop / 1e9:.0f} GFLOP)")
        for who, r in report["model"][str(length)].items():
            print(f"  {who:28s} {r['min_s']:8.3f} / {r['median_s']:8.3f} s  {r['gflops']:6.1f} GFLOP/s"
                  f"  x{r['speedup_vs_matmul']:.2f}  {of_peaks(r)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "projections.json").write_text(json.dumps(report, indent=2))
    print(f"wrote {out / 'projections.json'}")
    return report


if __name__ == "__main__":
    main()
