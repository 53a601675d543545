"""The fused op on a real Ascend NPU (run by ms_rope_attention/aclnn/verify_on_ascend.sh with
RFA_TEST_DEVICE=Ascend): the installed CANN op against the unfused path and the float64 reference.
Skipped everywhere else."""
import os

import numpy as np
import pytest

pytestmark = pytest.mark.skipif(os.environ.get("RFA_TEST_DEVICE") != "Ascend",
                                reason="needs an Ascend NPU with the op package (set RFA_TEST_DEVICE=Ascend)")


@pytest.fixture(scope="module", autouse=True)
def ascend():
    import mindspore as ms

    ms.set_device("Ascend")
    ms.set_context(jit_config={"jit_level": "O0"})
    yield
    ms.set_device("CPU")


@pytest.mark.parametrize("mode_name", ["pynative", "graph"])
@pytest.mark.parametrize("layout", ["BNSD", "BSND", "BSH", "TND"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_fused_on_npu_matches_unfused_and_reference(mode_name, layout, dtype, rng):
    import mindspore as ms
    from mindspore import Tensor

    import ms_rope_attention as mra
    from cases import Case
    from conftest import round_to, to_numpy, to_tensor, tolerance
    from reference import reference

    ms.set_context(mode=ms.GRAPH_MODE if mode_name == "graph" else ms.PYNATIVE_MODE)
    case = Case(layout=layout, heads=8, kv_heads=2, head_dim=128, q_len=300, kv_len=300, q_lens=[1, 300, 77],
                kv_lens=[1, 300, 500])
    q, k, v, cos, sin, aq, ak = case.make(rng)
    q, k, v = (round_to(t, dtype) for t in (q, k, v))
    ro, _, _ = reference(q, k, v, cos, sin, case.heads, layout, 0, None, None, True, aq, ak)
    outs = {}
    for backend in ("fused", "unfused"):
        op = mra.RotaryFlashAttentionOp(case.heads, layout, backend=backend)
        offsets = (Tensor(np.array(aq, np.int64)), Tensor(np.array(ak, np.int64))) if aq is not None else ()
        out, _, _ = op(*(to_tensor(t, dtype) for t in (q, k, v)), Tensor(cos.astype(np.float32)),
                       Tensor(sin.astype(np.float32)), *offsets)
        outs[backend] = to_numpy(out)
    assert np.abs(outs["fused"] - ro).max() <= 2 * tolerance(dtype, ro)
    assert np.abs(outs["fused"] - outs["unfused"]).max() <= 4 * tolerance(dtype, ro)


@pytest.mark.parametrize("mode_name", ["pynative", "graph"])
@pytest.mark.parametrize("layout", ["BNSD", "BSND", "BSH", "TND"])
@pytest.mark.parametrize("backward", ["flash_attention_score", "unfused", "kernel"])
def test_backward_on_npu_matches_the_cpu_kernel(mode_name, layout, backward, rng, monkeypatch, request):
    """dq/dk/dv of each Ascend backward (``RFA_ASCEND_BACKWARD``, the fused backward kernel
    RotaryFlashAttentionGrad included; float16, GQA 8/2, D = 128, TND with a 1-token sequence)
    against the CPU kernel's fused backward on the same inputs and upstream gradient, within 4x the
    float16 tolerance."""
    import mindspore as ms
    from mindspore import Tensor

    import ms_rope_attention as mra
    from ms_rope_attention import dispatch, functional
    from cases import Case
    from conftest import round_to, to_numpy, to_tensor, tolerance

    monkeypatch.setenv("RFA_ASCEND_BACKWARD", backward)
    dispatch.clear()  # and again after the test: its backends follow RFA_ASCEND_BACKWARD
    request.addfinalizer(dispatch.clear)
    ms.set_context(mode=ms.GRAPH_MODE if mode_name == "graph" else ms.PYNATIVE_MODE)
    dtype = "float16"
    case = Case(layout=layout, heads=8, kv_heads=2, head_dim=128, q_len=300, kv_len=300, q_lens=[1, 300, 77],
                kv_lens=[1, 300, 500])
    q, k, v, cos, sin, aq, ak = case.make(rng)
    q, k, v = (round_to(t, dtype) for t in (q, k, v))
    d_out = round_to(rng.standard_normal(q.shape), dtype)
    want = cpu_kernel_gradients(q, k, v, cos, sin, aq, ak, d_out, case.heads, layout, dtype)

    op = mra.RotaryFlashAttentionOp(case.heads, layout)
    assert op.backend_name == "fused:Ascend", op.fallback_reason
    assert functional.backend_for(op.attrs).kernel.backward_name == backward

    class Loss(ms.nn.Cell):
        def __init__(self):
            super().__init__()
            self.op = op

        def construct(self, q, k, v, cos, sin, d_out, *offsets):
            out, _, _ = self.op(q, k, v, cos, sin, *offsets)
            return (out.astype(ms.float32) * d_out).sum()

    offsets = (Tensor(np.array(aq, np.int64)), Tensor(np.array(ak, np.int64))) if aq is not None else ()
    got = ms.grad(Loss(), grad_position=(0, 1, 2))(*(to_tensor(t, dtype) for t in (q, k, v)),
                                                   Tensor(cos.astype(np.float32)), Tensor(sin.astype(np.float32)),
                                                   Tensor(d_out.astype(np.float32)), *offsets)
    for label, g, w in zip(("d_query", "d_key", "d_value"), got, want):
        assert np.abs(to_numpy(g) - w).max() <= 4 * tolerance(dtype, w), label


def cpu_kernel_gradients(q, k, v, cos, sin, aq, ak, d_out, heads, layout, dtype):
    """(d_query, d_key, d_value) of the CPU kernel's forward then fused backward, through ctypes
    (no MindSpore device involved), on the same values the NPU gets."""
    from ms_rope_attention.testing import cpu_direct

    offsets = (None, None) if aq is None else (np.array(aq, np.int64), np.array(ak, np.int64))
    code, out, lse, _ = cpu_direct.run(q, k, v, cos, sin, *offsets, head_num=heads, input_layout=layout, dtype=dtype)
    assert code == 0, "CPU forward failed"
    code, *grads = cpu_direct.run_grad(q, k, v, cos, sin, *offsets, out, lse, d_out, head_num=heads,
                                       input_layout=layout, dtype=dtype)
    assert code == 0, "CPU backward failed"
    return grads
