"""The fused op in a semi-auto parallel graph on 2 NPUs, split by batch (dp=2) and by heads (tp=2)
through its ``self_define_shard`` layouts, forward and gradients, against the same op on one device.

Run by ms_rope_attention/aclnn/verify_on_ascend.sh (msrun, 2 workers). Each rank prints a PASS or
FAIL line per case and quantity, then ``PASS semi-auto parallel`` or exits with status 1. Not run
on hardware yet (no NPU was available): whether a rank's outputs come back as its slices or whole
is taken from their shapes, and either is accepted when the values match.
"""
import sys

import numpy as np
import mindspore as ms
from mindspore.communication import get_rank, init

ms.set_device("Ascend")
ms.set_context(mode=ms.GRAPH_MODE, jit_config={"jit_level": "O0"})  # aclnn custom ops: O0/O1, not GE
init()  # before anything else: msrun's scheduler runs the script up to here

from mindspore import Tensor, nn, ops  # noqa: E402
from mindspore.parallel.auto_parallel import AutoParallel  # noqa: E402

import ms_rope_attention as mra  # noqa: E402

HEADS, KV_HEADS, DIM, BATCH, SEQ = 4, 2, 128, 2, 128
TND_LENGTHS = (50, 78)  # two sequences, T = SEQ
# (input_layout, dp, tp, axis of query/key/value/output that the split cuts, axis of softmax_lse)
CASES = [("BNSD", 2, 1, 0, 0), ("BNSD", 1, 2, 1, 1), ("BSND", 2, 1, 0, 0), ("BSND", 1, 2, 2, 1),
         ("BSH", 2, 1, 0, 0), ("TND", 1, 2, 1, 1)]


class Forward(nn.Cell):
    def __init__(self, op, with_lse=True):
        super().__init__()
        self.op, self.with_lse = op, with_lse

    def construct(self, q, k, v, cos, sin, *offsets):
        out, lse, _ = self.op(q, k, v, cos, sin, *offsets)
        if self.with_lse:
            return out, lse
        return out


class Backward(nn.Cell):
    """d_query, d_key, d_value at a fixed upstream gradient of the output (the last input)."""

    def __init__(self, op):
        super().__init__()
        self.forward = Forward(op, with_lse=False)
        self.grad = ops.GradOperation(get_all=True, sens_param=True)

    def construct(self, q, k, v, cos, sin, *offsets_and_sens):
        grads = self.grad(self.forward)(q, k, v, cos, sin, *offsets_and_sens)
        return grads[0], grads[1], grads[2]


def inputs(layout, rng):
    shapes = {"BNSD": lambda n: (BATCH, n, SEQ, DIM), "BSND": lambda n: (BATCH, SEQ, n, DIM),
              "BSH": lambda n: (BATCH, SEQ, n * DIM), "TND": lambda n: (SEQ, n, DIM)}[layout]
    q, k, v = (rng.standard_normal(shapes(n)).astype(np.float16) for n in (HEADS, KV_HEADS, KV_HEADS))
    sens = rng.standard_normal(q.shape).astype(np.float16)
    ends = Tensor(np.cumsum(TND_LENGTHS).astype(np.int64))
    offsets = (ends, ends) if layout == "TND" else ()
    cos, sin = mra.shared_rope_tables(DIM, SEQ)
    return [Tensor(q), Tensor(k), Tensor(v), cos, sin, *offsets], Tensor(sens)


def compare(name, full, got, axis, rank, parts):
    """(passed, line): ``got`` against ``full`` or against this rank's slice of it along ``axis``."""
    full, got = full.astype(np.float32), got.asnumpy().astype(np.float32)
    if got.shape == full.shape:
        part, which = full, "whole"
    elif parts > 1 and full.shape[axis] % parts == 0 and got.shape == np.split(full, parts, axis)[rank].shape:
        part, which = np.split(full, parts, axis)[rank], "rank's slice"
    else:
        return False, f"{name}: shape {got.shape}, expected {full.shape} or its slice {parts} ways along axis {axis}"
    finite = np.isfinite(part)
    error = float(np.abs(np.where(finite, got - part, 0)).max())
    tolerance = 2e-3 * max(1.0, float(np.abs(part[finite]).max()))
    passed = error <= tolerance and bool((np.isfinite(got) == finite).all())
    return passed, f"{name} ({which}): max error {error:.2e}, tolerance {tolerance:.2e}"


def main():
    rank = get_rank()
    rng = np.random.default_rng(0)  # every rank draws the same full batch
    cases = [(case, *inputs(case[0], rng)) for case in CASES]
    # One device first: the plain op, compiled before any parallel graph. backend "auto", not
    # "fused": the Ascend backward is the announced unfused autodiff, which "fused" would refuse.
    references = []
    for (layout, *_), args, sens in cases:
        op = mra.RotaryFlashAttentionOp(HEADS, layout, with_softmax_lse=True)
        if op.backend_name != "fused:Ascend":
            print(f"FAIL semi-auto parallel: the fused op does not run ({op.fallback_reason})", flush=True)
            return 1
        out, lse = (t.asnumpy() for t in Forward(op)(*args))
        references.append((out, lse, [g.asnumpy() for g in Backward(op)(*args, sens)]))
    failed = 0
    for ((layout, dp, tp, axis, lse_axis), args, sens), (out, lse, grads) in zip(cases, references):
        parts = dp * tp
        op = mra.RotaryFlashAttentionOp(HEADS, layout, with_softmax_lse=True).semi_auto_shard(dp=dp, tp=tp)
        results = []
        for net, call in ((Forward(op), args), (Backward(op), [*args, sens])):
            parallel = AutoParallel(net, parallel_mode="semi_auto")
            parallel.dataset_strategy("full_batch")  # every rank is given the whole inputs
            results.append(parallel(*call))
        (got_out, got_lse), got_grads = results
        checks = [compare("attention_out", out, got_out, axis, rank, parts),
                  compare("softmax_lse", lse, got_lse, lse_axis, rank, parts)]
        checks += [compare(name, want, got, axis, rank, parts)
                   for name, want, got in zip(("d_query", "d_key", "d_value"), grads, got_grads)]
        for passed, line in checks:
            failed += not passed
            print(f"{'PASS' if passed else 'FAIL'} {layout} dp={dp} tp={tp} {line}", flush=True)
    print("PASS semi-auto parallel" if not failed else f"FAIL semi-auto parallel: {failed} check(s)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
