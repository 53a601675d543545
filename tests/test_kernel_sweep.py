"""A seeded sweep of the CPU kernels over the shapes the tile-sized tests miss, on every kernel build
this CPU runs: head dims 8..256 in steps of 8 (those not multiples of 16 included), partial rotary,
GQA groups 1..8, q_len 1..40 (the decode path for q_len <= 16 included), float32/float16/bfloat16
with float32 and float16 tables, every layout, forward and backward, against the float64 reference.

Its first purpose is memory safety: ``make sanitize`` runs it against AddressSanitizer + UBSan
builds whose scratch is allocated exactly per call (``RFA_EXACT_SCRATCH``, csrc/rows.h), so a call
that writes past its own scratch aborts there, however large an earlier call's scratch was. The
sweep found the forward's and decode's undercounted scratch (36 of 104 cases of a first sweep);
the first cases below are two of them and the decode case of the review.
"""
import functools

import numpy as np
import pytest

from ms_rope_attention.testing import cpu_direct
from ms_rope_attention.cpu_runtime import built_libraries, usable_isas
from cases import Case
from kernel_check import check_grad, check_kernel

ISAS = [isa for isa in usable_isas() if isa in built_libraries()]
HEAD_DIMS = list(range(8, 257, 8))
LAYOUTS = ("BNSD", "BSND", "BSH", "TND")

# (case, dtype, table_dtype, tiling): overruns seen under ASan before the scratch was sized by its
# own list of regions (csrc/rows.h ScratchRegions).
KNOWN = [
    (Case("BNSD", 1, 7, 1, 37, 37, 72, rotary_dim=36), "float32", "float32", {}),
    (Case("BNSD", 1, 28, 4, 4, 202, 24, rotary_dim=22), "float32", "float32", {}),
    (Case("BNSD", 1, 1, 1, 1, 64, 40, rotary_dim=20), "float32", "float16", {}),
]


def _even(rng, low, high):
    return 2 * int(rng.integers(low // 2, high // 2 + 1))


def sampled_case(rng, *, max_q=40):
    """One random problem of the sweep's space; TND with 1..3 sequences of mixed lengths."""
    head_dim = int(rng.choice(HEAD_DIMS))
    rotary_dim = [None, head_dim // 2 // 2 * 2 or 2, _even(rng, 2, head_dim)][int(rng.integers(3))]
    group, kv_heads = int(rng.integers(1, 9)), int(rng.integers(1, 3))
    layout = LAYOUTS[int(rng.integers(len(LAYOUTS)))]
    q_len = int(rng.integers(1, max_q + 1))
    kv_len = q_len + int(rng.integers(0, 60))
    case = Case(layout, int(rng.integers(1, 3)), group * kv_heads, kv_heads, q_len, kv_len, head_dim,
                rotary_dim=rotary_dim, mode=int(rng.integers(2)), causal=bool(rng.integers(4)))
    if layout == "TND":
        n = int(rng.integers(1, 4))
        case.q_lens = [int(rng.integers(0, max_q + 1)) for _ in range(n)]
        case.q_lens[0] = max(case.q_lens[0], 1)
        case.kv_lens = [lq + int(rng.integers(0, 40)) for lq in case.q_lens]
    return case


def sweep(seed, count, **kwargs):
    """``count`` (case, dtype, table_dtype, tiling) of the sweep, reproducible from ``seed``. A third
    of the calls shrink the tiles (every tail and split path), a sixth keep short queries off the
    decode path."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        case = sampled_case(rng, **kwargs)
        dtype = ("float32", "float16", "bfloat16")[int(rng.integers(3))]
        table_dtype = ("float32", "float16")[int(rng.integers(2))]
        tiling = {}
        if rng.integers(3) == 0:
            tiling = {"rows": int(rng.integers(1, 40)), "kv_block": int(rng.integers(1, 80))}
        if rng.integers(6) == 0:
            tiling["stream_q_max"] = -1
        out.append((case, dtype, table_dtype, tiling))
    return out


def _ids(cases):
    return [f"{c.layout}-hd{c.head_dim}-rd{c.rotary_dim}-g{c.heads // c.kv_heads}-q{c.q_len}-{d}-{t}-{i}"
            for i, (c, d, t, _) in enumerate(cases)]


FORWARD = KNOWN + sweep(37, 90)
BACKWARD = sweep(38, 24, max_q=24)


def _last_error(isa):
    return cpu_direct.cpu_library(isa).RotaryFlashAttentionLastError().decode()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("case,dtype,table_dtype,tiling", FORWARD, ids=_ids(FORWARD))
def test_forward_sweep(isa, case, dtype, table_dtype, tiling):
    run = functools.partial(cpu_direct.run, isa=isa)
    check_kernel(case, np.random.default_rng(case.head_dim), run, lambda: _last_error(isa), dtype=dtype,
                 table_dtype=table_dtype, lse_tol=1e-4 if dtype == "float32" else 1e-2, **tiling)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("case,dtype,table_dtype,tiling", BACKWARD, ids=_ids(BACKWARD))
def test_backward_sweep(isa, case, dtype, table_dtype, tiling):
    grad_tiling = {"block_q": tiling.get("rows", 0), "block_k": tiling.get("kv_block", 0)}
    check_grad(case, np.random.default_rng(case.head_dim), dtype, table_dtype=table_dtype,
               run_grad=functools.partial(cpu_direct.run_grad, isa=isa), last_error=lambda: _last_error(isa),
               factor=2, **grad_tiling)
