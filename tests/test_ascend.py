"""The Ascend C kernel without an NPU: its tiling (UB budget, alignment, tails, core split, causal
balance, TND), and the kernel source itself run through the AscendC emulation against the float64
reference over a reduced version of the CPU kernel's correctness matrix."""
import numpy as np
import pytest

from ms_rope_attention.testing import ascend_emulated as emu
from cases import Case
from kernel_check import check_kernel

UB = 192 * 1024 - 256  # GetCoreMemSize(UB) on Atlas A2


def plan(case, rng, **kwargs):
    q, k, v, cos, sin, aq, ak = case.make(rng)
    code, tiling, work, workspace = emu.plan(q, k, v, cos, sin, aq, ak, **kwargs, **case.kwargs)
    assert code == 0, emu.last_error()
    return tiling, work, workspace


def expected_work(case, tiling):
    """Query rows x visible keys summed over every query block, computed here from the lengths."""
    total = 0
    pairs = zip(case.q_lens, case.kv_lens) if case.layout == "TND" else [(case.q_len, case.kv_len)] * case.batch
    for lq, lk in pairs:
        for q0 in range(0, lq, tiling["block_q"]):
            nq = min(tiling["block_q"], lq - q0)
            keys = lk - lq + q0 + nq if case.causal else lk
            total += nq * keys * case.heads
    return total


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("heads,kv_heads", [(32, 32), (32, 8), (32, 1)])
def test_tiling_fits_the_unified_buffer_and_is_aligned(dtype, head_dim, heads, kv_heads, rng):
    case = Case(heads=heads, kv_heads=kv_heads, head_dim=head_dim, q_len=1000, kv_len=1000, batch=1, layout="BSND")
    tiling, _, workspace = plan(case, rng, dtype=dtype)
    elem = 4 if dtype == "float32" else 2
    assert 0 < tiling["ub_bytes"] <= UB
    assert tiling["group"] * tiling["block_q"] <= 128 and tiling["block_kv"] in (64, 128)
    assert (tiling["head_pad"] * elem) % 32 == 0 and (tiling["block_kv"] * elem) % 32 == 0
    for key in ("ws_q", "ws_k", "ws_v", "ws_p", "ws_per_core"):
        assert tiling[key] % 512 == 0
    assert workspace == 16 * 2**20 + 48 * tiling["ws_per_core"]


def test_tiling_refuses_what_it_cannot_do(rng):
    q, k, v, cos, sin, _, _ = Case(head_dim=72, rotary_dim=72, q_len=8, kv_len=8).make(rng)
    code, *_ = emu.plan(q, k, v, cos, sin)
    assert code != 0 and "head_dim 72 is not a multiple of 16" in emu.last_error()
    q, k, v, cos, sin, _, _ = Case(head_dim=256, q_len=8, kv_len=8).make(rng)
    code, *_ = emu.plan(q, k, v, cos, sin, ub_bytes=16 * 1024)
    assert code != 0 and "does not fit" in emu.last_error()


@pytest.mark.parametrize("cores", [1, 7, 48, 1000])
@pytest.mark.parametrize("q_len,kv_len", [(1, 1), (63, 63), (65, 200), (1000, 1000)])
def test_every_query_row_is_covered_once_for_any_core_count(cores, q_len, kv_len, rng):
    case = Case(heads=8, kv_heads=2, head_dim=64, q_len=q_len, kv_len=kv_len, batch=2, layout="BNSD")
    tiling, work, _ = plan(case, rng, cores=cores)
    assert work.sum() == expected_work(case, tiling)
    assert (work >= 0).all()


@pytest.mark.parametrize("heads,kv_heads", [(32, 32), (32, 8), (64, 8)])
def test_causal_work_is_balanced_across_cores(heads, kv_heads, rng):
    """Llama2 7B/70B prefill shapes on 48 vector cores: the zigzag deal of heaviest-first tasks keeps
    every core within 10% of the mean work, though causal query blocks differ 64-fold in work."""
    case = Case(heads=heads, kv_heads=kv_heads, head_dim=128, q_len=4096, kv_len=4096, batch=1, layout="BSND")
    _, work, _ = plan(case, rng, dtype="float16", cores=48)
    assert work.max() / work.mean() < 1.10


def test_tnd_tiling_covers_mixed_lengths_and_balances(rng):
    q_lens = [1, 700, 37, 2, 129, 0, 511]
    kv_lens = [1, 700, 300, 2, 129, 5, 511]
    case = Case(layout="TND", heads=8, kv_heads=2, head_dim=64, q_lens=q_lens, kv_lens=kv_lens)
    tiling, work, _ = plan(case, rng, cores=8)
    assert work.sum() == expected_work(case, tiling)
    assert work.max() / work.mean() < 1.5


def check(case, rng, dtype="float32", table_dtype="float32", block_q=4, block_kv=16, key_rotated=False,
          with_rotated_key=True):
    # The cube takes rotated Q/K and P in the input dtype (float32 accumulation): one more rounding
    # of each than the CPU kernel, so half/bf16 get twice the CPU kernel's budget.
    low = dtype != "float32"
    check_kernel(case, rng, emu.run, emu.last_error, dtype=dtype, table_dtype=table_dtype, rows=block_q,
                 kv_block=block_kv, key_rotated=key_rotated, with_rotated_key=with_rotated_key,
                 out_factor=2 if low else 1, lse_tol=2e-2 if low else 1e-4)


@pytest.mark.parametrize("layout", ["BNSD", "BSND", "BSH", "TND"])
@pytest.mark.parametrize("mode", [0, 1])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("k_strategy", ["pre-pass", "per-tile"])
def test_emulated_kernel_layouts_modes(layout, mode, causal, k_strategy, rng):
    """Both K strategies: the pre-pass (rotated_key requested) and rotation per tile (not requested,
    at most 3 query blocks of 4 rows per sequence)."""
    case = Case(layout=layout, mode=mode, causal=causal, heads=4, kv_heads=2, q_len=9, kv_len=21, head_dim=32,
                rotary_dim=16, q_lens=[1, 9, 0, 6], kv_lens=[5, 9, 3, 40], random_tables=True)
    check(case, rng, with_rotated_key=k_strategy == "pre-pass")


@pytest.mark.parametrize("with_rk,key_rotated,q_len,prepass,own_keys", [
    (True, False, 64, 1, False), (False, False, 64, 0, False), (False, False, 1000, 1, True),
    (False, True, 1000, 0, False)])
def test_k_strategy_choice(with_rk, key_rotated, q_len, prepass, own_keys, rng):
    """K is rotated once up front when the rotated key is wanted anyway or when many query blocks
    would each re-rotate it; a workspace copy is reserved only when there is no rotated_key output."""
    case = Case(heads=8, kv_heads=8, head_dim=128, q_len=q_len, kv_len=1000, batch=1, layout="BSND")
    tiling, _, workspace = plan(case, rng, dtype="float16", with_rotated_key=with_rk, key_rotated=key_rotated)
    assert tiling["k_prepass"] == prepass
    assert (tiling["ws_keys"] >= 0) == own_keys
    keys = -(-1000 * 8 * 128 * 2 // 512) * 512 if own_keys else 0
    assert workspace == 16 * 2**20 + 48 * tiling["ws_per_core"] + keys


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("table_dtype", ["float32", "bfloat16"])
def test_emulated_kernel_low_precision(dtype, table_dtype, rng):
    check(Case(layout="BSND", heads=4, kv_heads=1, q_len=17, kv_len=33, head_dim=64, batch=1), rng, dtype, table_dtype)


@pytest.mark.parametrize("q_len,kv_len", [(1, 1), (1, 70), (17, 17), (33, 65)])
def test_emulated_kernel_lengths_and_tails(q_len, kv_len, rng):
    check(Case(heads=2, kv_heads=2, head_dim=64, q_len=q_len, kv_len=kv_len, batch=1), rng)


@pytest.mark.parametrize("head_dim", [80, 128])
def test_emulated_kernel_head_dims_and_default_tiling(head_dim, rng):
    check(Case(heads=8, kv_heads=1, head_dim=head_dim, q_len=40, kv_len=150, batch=1, layout="BSH"), rng, block_q=0,
          block_kv=0)


def test_emulated_kernel_key_rotated_tnd(rng):
    case = Case(layout="TND", mode=1, heads=4, kv_heads=2, head_dim=32, q_lens=[1, 2, 0], kv_lens=[30, 7, 4])
    check(case, rng, key_rotated=True)


def test_emulated_kernel_reports_instead_of_crashing(rng):
    q, k, v, cos, sin, _, _ = Case(q_len=20, kv_len=10).make(rng)
    code, *_ = emu.run(q, k, v, cos, sin)
    assert code != 0 and "q_len 20 must be <= kv_len 10" in emu.last_error()


# Each rule of the emulation fed the pattern it must refuse (emulator/rfa_ascend_emulated.cc,
# namespace violation), with the words its error must contain.
EMULATION_RULES = {
    0: "Unified Buffer overflow",
    15: "Unified Buffer overflow",                  # the real 196352 bytes, not 192 KiB
    1: "not a multiple of 32 bytes",
    2: "not 32-byte aligned",
    3: "buffers are in use",
    4: "GM access out of bounds",
    5: "read after write: DataCopy UB->GM on pipe MTE3",   # P tile through a TBuf with no V_MTE3
    6: "read after write: LocalTensor::GetValue",           # vector result read by the scalar unit
    7: "WaitFlag with no SetFlag",
    8: "write after read: Duplicate",                       # overwriting what MTE3 still copies out
    9: "64-byte line",                                      # scalar GM writes of two cores in one line
    10: "returned without reaching it",                     # SyncAll skipped by an idle core
    11: "float -> bfloat16 does not support CAST_NONE",
    12: "half/bfloat16 -> float takes CAST_NONE only",
    13: "SyncAll with this core's MTE3 GM writes",
    14: "on the cube core",                                 # vector work on the AIC
    20: "REGIST_MATMUL_OBJ",                                # registration inside Init
    21: "the cube reads GM this core's MTE3 wrote",
    22: "REGIST_MATMUL_OBJ",                                # InitBuffer before the registration
    23: "did not declare KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_MIX_AIC_1_2)",
    24: "has not called End()",
    25: "write after write: LocalTensor::SetValue on pipe S",  # a scalar mask on IterateAll's C, unfenced
    26: "SetTensorA: transpose differs from the MatmulType",   # A's flag contradicting its declared type
}


@pytest.mark.parametrize("which,rule", sorted(EMULATION_RULES.items()))
def test_emulation_refuses_what_hardware_would_not_do(which, rule):
    assert emu.library().RfaEmulatorViolation(which) == 1
    assert rule in emu.last_error()


@pytest.mark.parametrize("which", [-1, -2, -3])  # -3: C = A B from a transposed A, values checked
def test_emulation_accepts_the_same_patterns_synchronised(which):
    assert emu.library().RfaEmulatorViolation(which) == 0, emu.last_error()


@pytest.mark.parametrize("cores", [7, 3])
def test_emulated_kernel_idle_vector_cores_join_the_sync(cores, monkeypatch, rng):
    """An odd worker count leaves one of the 2 x blockDim vector cores without tasks: it must still
    reach the K pre-pass's SyncAll (the emulation fails the launch otherwise, as the NPU would hang)."""
    monkeypatch.setenv("RFA_EMULATED_CORES", str(cores))
    check(Case(layout="BSND", heads=4, kv_heads=2, q_len=13, kv_len=29, head_dim=32, batch=2), rng)


@pytest.mark.parametrize("poison", [np.nan, np.inf])
@pytest.mark.parametrize("layout", ["BSND", "TND"])
def test_emulated_kernel_keys_a_row_cannot_see_never_reach_it(layout, poison, rng):
    """NaN/Inf in keys and values a row cannot see (past its causal bound; another TND sequence)
    leave its output and lse bit-identical; rows that see them are not finite."""
    tnd = layout == "TND"
    case = Case(layout=layout, heads=4, kv_heads=2, q_len=50, kv_len=50, head_dim=32, batch=1,
                q_lens=[20, 13] if tnd else [], kv_lens=[37, 13] if tnd else [])
    q, k, v, cos, sin, aq, ak = case.make(rng)
    k2, v2 = k.copy(), v.copy()
    hidden = (slice(0, 20),) if tnd else (slice(None), slice(0, 37))
    seeing = (slice(20, None),) if tnd else (slice(None), slice(37, None))
    if tnd:
        k2[37:], v2[37:] = poison, poison
    else:
        k2[:, 37:], v2[:, 37:] = poison, poison
    runs = [emu.run(q, kk, vv, cos, sin, aq, ak, rows=4, kv_block=16, **case.kwargs) for kk, vv in ((k, v), (k2, v2))]
    (code0, out0, lse0, _), (code1, out1, lse1, _) = runs
    assert code0 == 0 and code1 == 0, emu.last_error()
    np.testing.assert_array_equal(out1[hidden], out0[hidden])
    lse_hidden = hidden if tnd else (slice(None), slice(None), slice(0, 37))
    np.testing.assert_array_equal(lse1[lse_hidden], lse0[lse_hidden])
    assert not np.isfinite(out1[seeing]).all()
