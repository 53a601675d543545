"""Where the unfused path's time goes: each step of ``ms_rope_attention/unfused.py`` timed alone in
GRAPH_MODE at the TTFT benchmark's attention shape (B=1, 32 heads, D=128, causal, float32), beside
the fused op on the same inputs, so docs/benchmarks.md can say which MindSpore ops make the baseline slower.
Each step is its own compiled Cell fed with the previous step's real output; min and median of
repeats, and the share of the unfused total. Writes JSON.

    python benchmarks/unfused_ops.py --lengths 2048 --out benchmarks/results
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from harness import machine_info, stats, timed


def steps(length: int, heads: int, head_dim: int, repeats: int) -> dict:
    import ms_rope_attention  # noqa: F401  before MindSpore, as users run it (docs/threads.md)
    import mindspore as ms
    from mindspore import Tensor, nn, ops

    import ms_rope_attention as mra
    from ms_rope_attention.rope import apply_rope, rope_tables
    from ms_rope_attention.unfused import _BMM, _BMM_TRANSPOSED, _NEG, _mask, _non_finite_keys, _rows_seeing, _visible_count

    ms.set_device("CPU")
    ms.set_context(mode=ms.GRAPH_MODE)
    rng = np.random.default_rng(0)
    q, k, v = (Tensor(rng.standard_normal((1, heads, length, head_dim), dtype=np.float32)) for _ in range(3))
    cos_np, sin_np = rope_tables(head_dim, length)
    cos, sin = Tensor(cos_np), Tensor(sin_np)  # (S, D): broadcast over batch and heads, as unfused.py does
    hidden = Tensor(np.triu(np.ones((length, length), bool), 1))

    class Step(nn.Cell):
        def __init__(self, fn):
            super().__init__()
            self.fn = fn

        def construct(self, *args):
            return self.fn(*args)

    positions = ops.arange(0, length, dtype=ms.int64)

    def visible_keys():  # each row's run of keys, and the (Sq, Skv) mask built from it
        first, count = ops.zeros_like(positions), _visible_count(positions, ops.full_like(positions, length), True)
        return first, count, _mask(first, count, length)

    first, count, _ = Step(visible_keys)()

    def non_finite_rule(k, v):  # hidden keys never reach a row, NaN/Inf included
        poison = ops.logical_or(_rows_seeing(_non_finite_keys(k), first, count),
                                _rows_seeing(_non_finite_keys(v), first, count))
        return (ops.where(ops.isfinite(k), k, ops.zeros_like(k)), ops.where(ops.isfinite(v), v, ops.zeros_like(v)),
                poison)

    def rope_qk(q, k):  # the softmax scale rides on Q's tables, as in unfused.py
        scale = head_dim ** -0.5
        return apply_rope(q, cos * scale, sin * scale, 0, head_dim), apply_rope(k, cos, sin, 0, head_dim)

    def scores(qr, kr):
        return _BMM_TRANSPOSED(qr, kr)

    def mask(s):
        return ops.masked_fill(s, ops.tile(hidden, (1, heads, 1, 1)), _NEG)

    def softmax(s):
        return ops.softmax(s, axis=-1)

    def weighted_sum(p, v):
        return _BMM(p, v)

    results = {}
    qr, kr = Step(rope_qk)(q, k)
    s = Step(scores)(qr, kr)
    sm = Step(mask)(s)
    p = Step(softmax)(sm)
    plan = [("visible keys and mask", visible_keys, ()), ("non-finite K/V rule", non_finite_rule, (k, v)),
            ("RoPE on Q and K (standalone)", rope_qk, (q, k)), ("Q K^T (BatchMatMul)", scores, (qr, kr)),
            ("causal mask (masked_fill)", mask, (s,)), ("softmax", softmax, (sm,)),
            ("P V (BatchMatMul)", weighted_sum, (p, v))]
    for name, fn, inputs in plan:
        cell = Step(fn)
        results[name] = stats(timed(lambda: _sync(cell(*inputs)), repeats)[1])

    class Whole(nn.Cell):
        def __init__(self, backend):
            super().__init__()
            self.attn = mra.RotaryFlashAttention(heads, head_dim, max_position_embeddings=length, backend=backend)

        def construct(self, q, k, v):
            return self.attn(q, k, v)

    for backend in ("unfused", "fused"):
        net = Whole(backend)
        results[f"whole op, {backend}"] = stats(timed(lambda: net(q, k, v).asnumpy(), repeats)[1])
    return results


def _sync(out):
    """Waits for a step's result (a tensor or a tuple of them) without timing a copy of it."""
    first = out[0] if isinstance(out, tuple) else out
    first[..., :1].asnumpy()
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048])
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    report = {"machine": machine_info(), "settings": vars(args), "lengths": {}}
    for length in args.lengths:
        timings = steps(length, args.heads, args.head_dim, args.repeats)
        step_total = sum(t["min_s"] for name, t in timings.items() if not name.startswith("whole"))
        report["lengths"][str(length)] = timings
        print(f"S={length} (B=1, {args.heads} heads, D={args.head_dim}, causal, float32; min / median of "
              f"{args.repeats}):")
        for name, t in timings.items():
            share = "" if name.startswith("whole") else f"  {t['min_s'] / step_total:5.0%} of the steps"
            print(f"  {name:32s} {t['min_s'] * 1e3:8.1f} / {t['median_s'] * 1e3:8.1f} ms{share}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "unfused_ops.json").write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
