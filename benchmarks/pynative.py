"""The functional op eagerly (PyNative, MindSpore's default mode) against the same call inside a
GRAPH_MODE Cell, forward and forward+backward, alternated in one process; and the fixed cost of a
small call (S=16) in both modes.

Why: PyNative's Python thread waits for its dispatch queue in a busy loop, which on a CPU took a
core from the kernel (1.5x slower at S=2048 before eager calls were launched through a one-op graph,
``cpu_runtime.GraphLaunchedCustom``). Shape: 1x32xSx128, causal, float32, BNSD. Reports min and
median per series and the PyNative/graph ratio of medians; writes JSON.

    python benchmarks/pynative.py --lengths 2048 4096 --repeats 5 --out benchmarks/results
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np

from harness import alternate, machine_info


def measure(length: int, heads: int, head_dim: int, repeats: int, with_backward: bool) -> dict:
    """{series: times} for the eager call and the GRAPH_MODE Cell at one length."""
    import ms_rope_attention  # noqa: F401  before MindSpore, as users run it (docs/threads.md)
    import mindspore as ms
    from mindspore import Tensor, nn

    from ms_rope_attention import rope_tables, rotary_flash_attention

    rng = np.random.default_rng(0)
    q, k, v = (Tensor(rng.standard_normal((1, heads, length, head_dim), dtype=np.float32)) for _ in range(3))
    cos, sin = (Tensor(t) for t in rope_tables(head_dim, length))

    def attend(q, k, v, cos, sin):
        return rotary_flash_attention(q, k, v, cos, sin)

    class Forward(nn.Cell):
        def construct(self, q, k, v, cos, sin):
            return attend(q, k, v, cos, sin)

    class Backward(nn.Cell):
        def __init__(self):
            super().__init__()
            self.grad = ms.grad(Forward(), grad_position=(0, 1, 2))

        def construct(self, q, k, v, cos, sin):
            return self.grad(q, k, v, cos, sin)

    def in_graph(cell):
        def run():
            ms.set_context(mode=ms.GRAPH_MODE)
            try:
                return cell(q, k, v, cos, sin)
            finally:
                ms.set_context(mode=ms.PYNATIVE_MODE)
        return run

    def synced(fn):
        def run():
            out = fn()
            (out[0] if isinstance(out, tuple) else out).asnumpy()
        return run

    series = {"pynative forward": synced(lambda: attend(q, k, v, cos, sin)),
              "graph forward": synced(in_graph(Forward()))}
    if with_backward:
        eager_grad = ms.grad(attend, grad_position=(0, 1, 2))
        series["pynative forward+backward"] = synced(lambda: eager_grad(q, k, v, cos, sin))
        series["graph forward+backward"] = synced(in_graph(Backward()))
    ms.set_context(mode=ms.PYNATIVE_MODE)
    return alternate(series, repeats)


def summarise(length: int, times: dict) -> list[dict]:
    rows = []
    for part in ("forward", "forward+backward"):
        eager, graph = times.get(f"pynative {part}"), times.get(f"graph {part}")
        if eager is None:
            continue
        rows.append({"S": length, "part": part,
                     "pynative_min_ms": min(eager) * 1e3, "pynative_median_ms": statistics.median(eager) * 1e3,
                     "graph_min_ms": min(graph) * 1e3, "graph_median_ms": statistics.median(graph) * 1e3,
                     "pynative_over_graph": statistics.median(eager) / statistics.median(graph)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--small-length", type=int, default=16, help="the small call whose fixed cost is measured")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    import ms_rope_attention  # noqa: F401  before MindSpore, as users run it (docs/threads.md)
    import mindspore as ms
    ms.set_device("CPU")
    rows = []
    for length in [args.small_length, *args.lengths]:
        small = length == args.small_length
        repeats = 200 if small else args.repeats
        rows += summarise(length, measure(length, 8 if small else args.heads, 64 if small else args.head_dim,
                                          repeats, with_backward=not small))
    print(f"{'S':>6} {'part':<17} {'PyNative min/median ms':>24} {'GRAPH Cell min/median ms':>26} {'ratio':>6}")
    for r in rows:
        print(f"{r['S']:>6} {r['part']:<17} {r['pynative_min_ms']:>11.2f} / {r['pynative_median_ms']:<10.2f}"
              f" {r['graph_min_ms']:>12.2f} / {r['graph_median_ms']:<11.2f} {r['pynative_over_graph']:>6.2f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"benchmark": "pynative", "shape": f"1x{args.heads}xSx{args.head_dim} causal float32 BNSD "
              f"(small call: 1x8x{args.small_length}x64)", "machine": machine_info(), "rows": rows}
    (out / "pynative.json").write_text(json.dumps(result, indent=2))
    print(f"wrote {out / 'pynative.json'}")


if __name__ == "__main__":
    main()
