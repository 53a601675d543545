"""One kernel call (any library with the ``RotaryFlashAttentionRun`` entry) checked against the
float64 reference: the CPU kernel's tests and the emulated Ascend kernel's tests share it."""
import numpy as np

from ms_rope_attention import cpu_direct
from conftest import tolerance
from reference import reference


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
