"""One kernel call (any library with the ``RotaryFlashAttentionRun`` / ``RotaryFlashAttentionGradRun``
entries) checked against the float64 reference: the CPU kernel's tests and the emulated Ascend
kernel's tests share it."""
import numpy as np

from ms_rope_attention.testing import cpu_direct
from ms_rope_attention.cpu_kernel import last_error as cpu_last_error
from conftest import EPS, tolerance
from reference import reference, reference_grad

GRAD_ULPS = 8


def rounded(x, dtype):
    return cpu_direct.decode(cpu_direct.encode(x, dtype), dtype)


def check_kernel(case, rng, run, last_error, *, dtype="float32", table_dtype="float32", scale=None,
                 key_rotated=False, with_rotated_key=True, out_factor=1, lse_tol=1e-4, **tiling):
    """``run`` is ``cpu_direct.run`` or a twin; ``out_factor`` scales the output tolerance; ``tiling``
    (rows, kv_block, ...) goes to ``run`` as it is."""
    q, k, v, cos, sin, aq, ak = case.make(rng)
    q, k, v = (rounded(t, dtype) for t in (q, k, v))
    cos, sin = rounded(cos, table_dtype), rounded(sin, table_dtype)
    ro, rl, rk = reference(q, k, v, cos, sin, case.heads, case.layout, case.mode, case.rotary_dim, scale,
                           case.causal, aq, ak, key_rotated)
    code, out, lse, rot = run(q, k, v, cos, sin, aq, ak, dtype=dtype, table_dtype=table_dtype, scale=scale,
                              key_rotated=key_rotated, with_rotated_key=with_rotated_key, **tiling, **case.kwargs)
    assert code == 0, last_error()
    assert np.abs(out - ro).max(initial=0) <= out_factor * tolerance(dtype, ro)
    finite = np.isfinite(rl)
    assert (np.isfinite(lse) == finite).all()
    assert np.abs(lse[finite] - rl[finite]).max(initial=0) <= lse_tol
    if with_rotated_key:
        assert np.abs(rot - rk).max(initial=0) <= tolerance(dtype, rk)


def grad_tolerance(dtype, reference_grad_, factor=1):
    """float32 2e-5, float16 / bfloat16 GRAD_ULPS ulp of the dtype, times max(1, |reference|) and
    ``factor``."""
    magnitude = max(float(np.abs(reference_grad_).max(initial=0)), 1.0)
    return factor * (2e-5 if dtype == "float32" else GRAD_ULPS * EPS[dtype]) * magnitude


def check_grad(case, rng, dtype="float32", key_rotated=False, with_dlse=True, with_drk=True, scale=None, *,
               run_grad=cpu_direct.run_grad, last_error=cpu_last_error, factor=1, table_dtype="float32", **tiling):
    """The backward ``run_grad`` (``cpu_direct.run_grad`` or a twin) on the CPU kernel's forward
    outputs, against the float64 gradients of the same dtype-rounded inputs, within
    ``grad_tolerance(dtype, ..., factor)``; returns (d_query, d_key, d_value)."""
    q, k, v, cos, sin, aq, ak = case.make(rng)
    q, k, v = (rounded(t, dtype) for t in (q, k, v))
    cos, sin = rounded(cos, table_dtype), rounded(sin, table_dtype)
    code, out, lse, _ = cpu_direct.run(q, k, v, cos, sin, aq, ak, dtype=dtype, table_dtype=table_dtype,
                                       key_rotated=key_rotated, scale=scale, with_rotated_key=False, **case.kwargs)
    assert code == 0, cpu_last_error()
    d_out = rounded(rng.standard_normal(out.shape), dtype)
    d_lse = np.where(np.isfinite(lse), rng.standard_normal(lse.shape), 0.0) if with_dlse else None
    d_rk = rounded(rng.standard_normal(k.shape), dtype) if with_drk else None
    expected = reference_grad(q, k, v, cos, sin, d_out, d_lse, d_rk, key_rotated=key_rotated, scale=scale,
                              actual_seq_qlen=aq, actual_seq_kvlen=ak, **case.kwargs)
    code, *grads = run_grad(q, k, v, cos, sin, aq, ak, out, lse, d_out, d_lse, d_rk, dtype=dtype,
                            table_dtype=table_dtype, key_rotated=key_rotated, scale=scale, **tiling, **case.kwargs)
    assert code == 0, last_error()
    for name, got, want in zip(("d_query", "d_key", "d_value"), grads, expected):
        assert got.shape == want.shape
        err = np.abs(got - want).max(initial=0)
        assert err <= grad_tolerance(dtype, want, factor), f"{name}: max error {err}"
    return grads
