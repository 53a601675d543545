"""The Ascend backward without an NPU: which backward the op builds when the dispatch is forced to
Ascend (MindSpore's FlashAttention by default, never the S x S path unless asked or unavoidable,
always announced; the fused backward kernel's primitive when asked for), and the numerics of the
default, with ``ops.flash_attention_score`` (no CPU kernel) replaced by an independent float32 model
of its documented semantics, against the fused CPU backward."""
import inspect
import logging

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, ops

import ms_rope_attention as mra
from ms_rope_attention import ascend_kernel, dispatch, flash_backward, functional, gradients
from ms_rope_attention.attrs import OpAttrs
from ms_rope_attention.op_info import load_contract


def model_flash_attention_score(query, key, value, head_num, real_shift=None, drop_mask=None, padding_mask=None,
                                attn_mask=None, prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None,
                                keep_prob=1.0, scalar_value=1.0, pre_tokens=2147483647, next_tokens=2147483647,
                                inner_precise=0, input_layout="BSH", sparse_mode=0):
    """``ops.flash_attention_score`` as its documentation states it, for what the backward passes:
    float16/bfloat16 only, layouts BSH/BNSD/BSND/TND, GQA (N1 a multiple of N2, a query head's KV
    head = head // (N1 / N2)), sparse_mode 0 (no mask) or 3 (rightDownCausal, per sequence in TND,
    with the compressed 2048 x 2048 mask)."""
    if query.dtype not in (ms.float16, ms.bfloat16):
        raise TypeError(f"flash_attention_score: query dtype {query.dtype} is not float16 or bfloat16")
    assert sparse_mode in (0, 3) and (sparse_mode == 0) == (attn_mask is None)
    assert sparse_mode == 0 or tuple(attn_mask.shape) == (2048, 2048)
    assert real_shift is None and drop_mask is None and padding_mask is None and keep_prob == 1.0

    def bnsd(x, heads):
        x = x.astype(ms.float32)
        if input_layout == "BNSD":
            return x
        if input_layout == "BSND":
            return x.transpose(0, 2, 1, 3)
        if input_layout == "BSH":
            return x.reshape(x.shape[0], x.shape[1], heads, -1).transpose(0, 2, 1, 3)
        return x.transpose(1, 0, 2).expand_dims(0)

    q = bnsd(query, head_num)
    kv_heads = key.shape[1] if input_layout in ("BNSD", "TND") else (
        key.shape[2] if input_layout == "BSND" else key.shape[2] // (query.shape[2] // head_num))
    k, v = bnsd(key, kv_heads), bnsd(value, kv_heads)
    group = head_num // kv_heads
    k, v = ops.repeat_interleave(k, group, 1), ops.repeat_interleave(v, group, 1)
    s1, s2 = q.shape[2], k.shape[2]
    qi = ops.arange(0, s1, dtype=ms.int64).expand_dims(1)
    ki = ops.arange(0, s2, dtype=ms.int64).expand_dims(0)
    if input_layout == "TND":
        q_ends, k_ends = actual_seq_qlen.astype(ms.int64), actual_seq_kvlen.astype(ms.int64)
        q_seq = (qi >= q_ends.expand_dims(0)).sum(1, keepdims=True)
        k_seq = (ki.expand_dims(-1) >= k_ends.reshape(1, 1, -1)).sum(-1)
        q_start = ops.concat([ops.zeros((1,), ms.int64), q_ends[:-1]])
        k_start = ops.concat([ops.zeros((1,), ms.int64), k_ends[:-1]])
        q_len, k_len = q_ends - q_start, k_ends - k_start
        q_local = qi - q_start[q_seq]
        k_local = ki - k_start[k_seq]
        hidden = q_seq != k_seq
        if sparse_mode == 3:
            hidden = hidden | (k_local > q_local + (k_len - q_len)[q_seq])
    else:
        hidden = ki > qi + (s2 - s1) if sparse_mode == 3 else ops.zeros((s1, s2), ms.bool_)
    scores = ops.matmul(q, k.swapaxes(-1, -2)) * scalar_value
    scores = ops.masked_fill(scores, hidden.broadcast_to(scores.shape), -1e30)
    out = ops.matmul(ops.softmax(scores, -1), v)
    if input_layout == "BSND":
        out = out.transpose(0, 2, 1, 3)
    elif input_layout == "BSH":
        out = out.transpose(0, 2, 1, 3).reshape(query.shape)
    elif input_layout == "TND":
        out = out.squeeze(0).transpose(1, 0, 2)
    return out.astype(query.dtype)


@pytest.fixture
def ascend_dispatch(monkeypatch, request):
    """The dispatch as on an Ascend machine with the op package installed (the forward's; the
    backward kernel's header is ``grad_package``'s)."""
    monkeypatch.setattr(dispatch, "device", lambda: "Ascend")
    monkeypatch.setattr(ascend_kernel, "package_status", lambda: None)
    dispatch.clear()  # and again after the test: its backends are the fake Ascend's
    request.addfinalizer(dispatch.clear)
    monkeypatch.setattr(gradients, "_announced", set())
    monkeypatch.setattr(ops, "flash_attention_score", model_flash_attention_score)
    monkeypatch.delenv(flash_backward.SWITCH, raising=False)
    monkeypatch.delenv("ASCEND_OPP_PATH", raising=False)
    ms.set_context(mode=ms.PYNATIVE_MODE)


def _vendor(root, *headers):
    """An installed op package's vendor directory holding ``headers``, on ASCEND_CUSTOM_OPP_PATH."""
    include = root / "vendors" / "rope_attention" / "op_api" / "include"
    include.mkdir(parents=True)
    for header in headers:
        (include / header).write_text("")
    return include.parent.parent


@pytest.fixture
def grad_package(ascend_dispatch, tmp_path, monkeypatch):
    """The package with the backward op installed, and RFA_ASCEND_BACKWARD=kernel."""
    vendor = _vendor(tmp_path, ascend_kernel.ACLNN_HEADER, ascend_kernel.GRAD_ACLNN_HEADER)
    monkeypatch.setenv("ASCEND_CUSTOM_OPP_PATH", str(vendor))
    monkeypatch.setenv(flash_backward.SWITCH, "kernel")


def _ascend_kernel(**attrs):
    return functional.backend_for(OpAttrs(**{"head_num": 4, **attrs})).kernel


def _ascend_op(**attrs):
    return _ascend_kernel(**attrs).forward


def _grad_primitive(op):
    """The backward kernel's primitive: the ``grad_op`` the op's bprop (gradients.fused_bprop) calls."""
    return inspect.getclosurevars(op.bprop).nonlocals["grad_op"]


def test_ascend_builds_the_flash_attention_backward_by_default(ascend_dispatch, monkeypatch):
    assert flash_backward.chosen_backward() == "flash_attention_score"
    assert _ascend_kernel().backward_name == "flash_attention_score"
    monkeypatch.setenv(flash_backward.SWITCH, "unfused")
    dispatch.clear()
    assert _ascend_kernel().backward_name == "unfused"


def test_an_unknown_backward_is_refused_naming_the_three(ascend_dispatch, monkeypatch):
    monkeypatch.setenv(flash_backward.SWITCH, "s_by_s")
    with pytest.raises(ValueError, match=r"RFA_ASCEND_BACKWARD: expected one of \['flash_attention_score', "
                                         r"'unfused', 'kernel'\], got 's_by_s'"):
        _ascend_op()


def test_llama_shaped_calls_never_take_the_s_by_s_path():
    """What Llama training passes (float16/bfloat16, D = 128, 32 heads, every layout, GQA): no refusal."""
    for dtype in (ms.float16, ms.bfloat16):
        for layout, q, k in (("BSH", (1, 4096, 4096), (1, 4096, 1024)), ("BNSD", (1, 32, 4096, 128), (1, 8, 4096, 128)),
                             ("BSND", (1, 4096, 32, 128), (1, 4096, 8, 128)), ("TND", (4096, 32, 128), (4096, 8, 128))):
            assert flash_backward.flash_attention_refusal(dtype, q, layout, 32, False) == ""


CASES = {  # layout, heads, kv_heads, q_len, kv_len, rotary_dim, rotary_mode, causal, key_rotated, rotated_key grad
    "bnsd-gqa-causal": ("BNSD", 4, 2, 24, 24, None, 0, True, False, False),
    "bsnd-partial-interleaved-q<kv": ("BSND", 4, 4, 9, 21, 16, 1, True, False, False),
    "bsh-noncausal-mqa": ("BSH", 4, 1, 17, 17, None, 0, False, False, False),
    "tnd-varlen-causal": ("TND", 4, 2, None, None, None, 0, True, False, False),
    "bnsd-rotated-key-gradient": ("BNSD", 4, 2, 16, 16, None, 0, True, False, True),
    "bnsd-key-rotated": ("BNSD", 4, 2, 8, 8, None, 0, True, True, False),
}


def _inputs(layout, heads, kv_heads, q_len, kv_len, rng, dim=32):
    if layout == "TND":
        q_lens, kv_lens = [5, 12, 1], [9, 12, 3]
        q_shape, k_shape = (sum(q_lens), heads, dim), (sum(kv_lens), kv_heads, dim)
        offsets = (Tensor(np.cumsum(q_lens), ms.int64), Tensor(np.cumsum(kv_lens), ms.int64))
    else:
        shapes = {"BNSD": lambda n, s: (2, n, s, dim), "BSND": lambda n, s: (2, s, n, dim),
                  "BSH": lambda n, s: (2, s, n * dim)}[layout]
        q_shape, k_shape, offsets = shapes(heads, q_len), shapes(kv_heads, kv_len), (None, None)
    q, k, v = (Tensor(rng.standard_normal(s).astype(np.float16)) for s in (q_shape, k_shape, k_shape))
    return q, k, v, offsets


@pytest.mark.parametrize("name", list(CASES))
def test_flash_attention_backward_equals_the_fused_cpu_backward(name, ascend_dispatch, monkeypatch, rng, caplog):
    """dq/dk/dv of the Ascend default backward (float16) within 5e-3 (relative to the largest
    gradient) of the fused CPU kernel's on the same inputs and upstream gradients, announced once."""
    layout, heads, kv_heads, q_len, kv_len, rotary_dim, mode, causal, key_rotated, rk_grad = CASES[name]
    q, k, v, (aq, akv) = _inputs(layout, heads, kv_heads, q_len, kv_len, rng)
    cos, sin = map(Tensor, mra.rope_tables(rotary_dim or 32, 64, rotary_mode=mode))
    attrs = dict(head_num=heads, input_layout=layout, rotary_mode=mode, rotary_dim=rotary_dim, causal=causal,
                 with_rotated_key=rk_grad, key_rotated=key_rotated)
    op = _ascend_op(**attrs)
    d_out = Tensor(rng.standard_normal(q.shape).astype(np.float16))
    d_rk = Tensor(rng.standard_normal(k.shape).astype(np.float16)) if rk_grad else ops.zeros((0,), k.dtype)
    out = (ops.zeros_like(q), ops.zeros((0,), ms.float32), ops.zeros_like(k) if rk_grad else ops.zeros((0,), k.dtype))
    with caplog.at_level(logging.WARNING, logger="ms_rope_attention"):
        got = op.bprop(q, k, v, cos, sin, aq, akv, out, (d_out, ops.zeros((0,), ms.float32), d_rk))[:3]
    said = [r.getMessage() for r in caplog.records if "rotary_fusion_fallback" in r.getMessage()]
    assert len(said) == 1 and "MindSpore's FlashAttention backward on the rotated q/k" in said[0], said

    monkeypatch.setattr(dispatch, "device", lambda: "CPU")
    dispatch.clear()

    def loss(q, k, v):
        result = mra.rotary_flash_attention(q, k, v, cos, sin, heads, input_layout=layout, rotary_mode=mode,
                                            rotary_dim=rotary_dim, causal=causal, actual_seq_qlen=aq,
                                            actual_seq_kvlen=akv, return_rotated_key=rk_grad, key_rotated=key_rotated,
                                            strict=True)
        if not rk_grad:
            return (result.astype(ms.float32) * d_out.astype(ms.float32)).sum()
        out, rotated = result
        return (out.astype(ms.float32) * d_out.astype(ms.float32)).sum() + (
            rotated.astype(ms.float32) * d_rk.astype(ms.float32)).sum()

    want = ms.grad(loss, grad_position=(0, 1, 2))(q, k, v)
    for label, g, w in zip(("dq", "dk", "dv"), got, want):
        g, w = g.asnumpy().astype(np.float64), w.asnumpy().astype(np.float64)
        assert np.abs(g - w).max() <= 5e-3 * max(1.0, np.abs(w).max()), (label, np.abs(g - w).max())


@pytest.mark.parametrize("why,attrs,dtype,dim,heads,lse", [
    ("float32 inputs", {}, np.float32, 32, 2, False),
    ("head size 8", {}, np.float16, 8, 2, False),
    ("258 query heads", {}, np.float16, 16, 258, False),
    ("softmax_lse output is used", {"with_softmax_lse": True}, np.float16, 32, 2, True),
])
def test_where_flash_attention_cannot_the_unfused_autodiff_runs_and_says_why(why, attrs, dtype, dim, heads, lse,
                                                                            ascend_dispatch, rng, caplog):
    q_len = 8
    op = _ascend_op(head_num=heads, **attrs)
    q = Tensor(rng.standard_normal((1, heads, q_len, dim)).astype(dtype))
    k = v = Tensor(rng.standard_normal((1, 2, 8, dim)).astype(dtype))
    cos, sin = map(Tensor, mra.rope_tables(dim, 16))
    d_out = Tensor(rng.standard_normal(q.shape).astype(dtype))
    d_lse = Tensor(rng.standard_normal((1, heads, q_len)).astype(np.float32)) if lse else ops.zeros((0,), ms.float32)
    out = (ops.zeros_like(q), ops.zeros((1, heads, q_len), ms.float32), ops.zeros((0,), q.dtype))
    with caplog.at_level(logging.WARNING, logger="ms_rope_attention"):
        got = op.bprop(q, k, v, cos, sin, None, None, out, (d_out, d_lse, ops.zeros((0,), q.dtype)))[:3]
    said = [r.getMessage() for r in caplog.records if "rotary_fusion_fallback" in r.getMessage()]
    assert len(said) == 1 and why in said[0] and "the unfused autodiff (S x S scores per head)" in said[0], said
    unfused = functional.autodiff_forwards(OpAttrs(head_num=heads, with_softmax_lse=lse)).unfused
    sens = (d_out, d_lse, ops.zeros((0,), q.dtype))
    want = ops.GradOperation(get_all=True, sens_param=True)(unfused)(q, k, v, cos, sin, None, None, sens)[:3]
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.asnumpy(), w.asnumpy(), rtol=1e-6, atol=1e-6)


def test_strict_refuses_both_stand_in_backwards(ascend_dispatch, rng):
    op = _ascend_op(strict=True)
    q = k = v = Tensor(rng.standard_normal((1, 4, 8, 32)).astype(np.float16))
    cos, sin = map(Tensor, mra.rope_tables(32, 16))
    empty = ops.zeros((0,), ms.float32)
    with pytest.raises(mra.RotaryFusionFallbackError, match="the fused backward kernel has not run on hardware"):
        op.bprop(q, k, v, cos, sin, None, None, (q, empty, empty.astype(q.dtype)), (q, empty, empty.astype(q.dtype)))


KERNEL_ATTRS = dict(head_num=4, input_layout="BSND", rotary_mode=1, rotary_dim=16, scale=0.125, causal=False,
                    with_rotated_key=True, key_rotated=False)


def test_kernel_choice_builds_the_grad_primitive_of_the_contract(grad_package):
    """RFA_ASCEND_BACKWARD=kernel: the bprop calls an aot Custom named by the contract's backward
    op, registered for Ascend with its inputs, outputs and the forward's attribute values (softmax_lse
    emitted, which it takes), shaped and typed as query, key, value."""
    kernel = _ascend_kernel(**KERNEL_ATTRS)
    op = kernel.forward
    assert kernel.backward_name == "kernel"
    grad, contract = _grad_primitive(op), load_contract().backward
    assert (grad.func, grad.func_type) == ("RotaryFlashAttentionGrad", "aot") and grad.func == contract.op_name
    info = grad.reg_info
    assert (grad.attrs["reg_op_name"], info["target"]) == (contract.op_name, "Ascend")
    assert [(i["name"], i["paramType"]) for i in info["inputs"]] == [
        (item["name"], "optional" if item.get("optional") else "required") for item in contract.inputs]
    assert len(info["inputs"]) == 12 and [o["name"] for o in info["outputs"]] == ["d_query", "d_key", "d_value"]
    forward_attrs = {a["name"]: a["value"] for a in op.reg_info["attr"]}
    assert {a["name"]: a["value"] for a in info["attr"]} == forward_attrs
    assert forward_attrs["with_softmax_lse"] is True and forward_attrs["rotary_dim"] == 16
    assert forward_attrs["scale"] == 0.125 and forward_attrs["input_layout"] == "BSND"
    shapes = [(2, 8, 4, 32), (2, 6, 2, 32), (2, 6, 2, 32), (64, 16), (64, 16), None, None,
              (2, 8, 4, 32), (2, 4, 8), (2, 8, 4, 32), None, (2, 6, 2, 32)]
    assert grad.out_shape(*shapes) == ((2, 8, 4, 32), (2, 6, 2, 32), (2, 6, 2, 32))
    dtypes = [ms.float16, ms.bfloat16, ms.float32] + [ms.float32] * 9
    assert grad.out_dtype(*dtypes) == (ms.float16, ms.bfloat16, ms.float32)


class _RecordingGrad:
    """Stands in for the backward kernel (which needs an NPU): records each call's inputs and
    returns distinct gradients."""

    def __init__(self):
        self.calls = []

    def __call__(self, *inputs):
        self.calls.append(inputs)
        query, key, value = inputs[:3]
        return ops.ones_like(query), ops.ones_like(key) * 2, ops.ones_like(value) * 3


@pytest.mark.parametrize("lse_used,rotated_key_used", [(False, False), (True, False), (False, True), (True, True)])
def test_kernel_bprop_passes_the_forward_outputs_and_only_used_gradients(lse_used, rotated_key_used, grad_package,
                                                                         rng, caplog):
    """The kernel gets the forward's inputs, attention_out, softmax_lse, d_attention_out, then
    d_softmax_lse / d_rotated_key when those outputs are used and None otherwise (as on the CPU);
    strict does not refuse it (not a fallback); announced once, not as a fallback."""
    op = _ascend_op(with_softmax_lse=lse_used, with_rotated_key=rotated_key_used, strict=True)
    recorder = _RecordingGrad()
    cells = dict(zip(op.bprop.__code__.co_freevars, op.bprop.__closure__))
    cells["grad_op"].cell_contents = recorder  # this test's own op (the fixture empties the cache)
    q, k, v = (Tensor(rng.standard_normal((1, 4, 8, 32)).astype(np.float16)) for _ in range(3))
    cos, sin = map(Tensor, mra.rope_tables(32, 16))
    out = (Tensor(rng.standard_normal(q.shape).astype(np.float16)),
           Tensor(rng.standard_normal((1, 4, 8)).astype(np.float32)), ops.zeros_like(k))
    dout = (Tensor(rng.standard_normal(q.shape).astype(np.float16)),
            Tensor(rng.standard_normal((1, 4, 8)).astype(np.float32)),
            Tensor(rng.standard_normal(k.shape).astype(np.float16)))
    with caplog.at_level(logging.WARNING, logger="ms_rope_attention"):
        for _ in range(2):
            got = op.bprop(q, k, v, cos, sin, None, None, out, dout)
    expected = (q, k, v, cos, sin, None, None, out[0], out[1], dout[0], dout[1] if lse_used else None,
                dout[2] if rotated_key_used else None)
    assert len(recorder.calls) == 2
    for inputs in recorder.calls:
        assert len(inputs) == 12 and all(a is b for a, b in zip(inputs, expected)), inputs
    assert [float(g.asnumpy().mean()) for g in got[:3]] == [1.0, 2.0, 3.0]
    assert not np.any(got[3].asnumpy()) and not np.any(got[4].asnumpy()) and got[5] is None and got[6] is None
    said = [r.getMessage() for r in caplog.records if "rotary_fusion" in r.getMessage()]
    assert said == ["rotary_fusion_backward: running the fused backward kernel RotaryFlashAttentionGrad "
                    "(verified on the CPU emulation only, not on hardware)"], said


def test_kernel_choice_without_the_grad_op_installed_is_refused_when_the_op_builds(ascend_dispatch, tmp_path,
                                                                                    monkeypatch, caplog):
    """A package built before the backward op: choosing the kernel fails naming its header and the
    build script, never a silent fallback to another backward."""
    monkeypatch.setenv("ASCEND_CUSTOM_OPP_PATH", str(_vendor(tmp_path, ascend_kernel.ACLNN_HEADER)))
    monkeypatch.setenv(flash_backward.SWITCH, "kernel")
    with caplog.at_level(logging.WARNING, logger="ms_rope_attention"):
        with pytest.raises(RuntimeError, match=r"RFA_ASCEND_BACKWARD=kernel: .*RotaryFlashAttentionGrad "
                                               r"\(aclnn_rotary_flash_attention_grad\.h not found; searched .*"
                                               r"rope_attention\).*ms_rope_attention/aclnn/build\.sh"):
            _ascend_op()
    assert not [r for r in caplog.records if "rotary_fusion" in r.getMessage()] and not dispatch._backends


def test_kernel_primitive_is_sharded_as_the_cpu_gradient_primitive(grad_package, monkeypatch):
    """semi_auto_shard: the backward kernel's primitive gets the layouts the CPU's gradient primitive
    gets for the same attributes (gradients.fused_bprop passes both the same inputs)."""
    def grad_layouts():
        op = mra.RotaryFlashAttentionOp(4, "BNSD", with_softmax_lse=True).semi_auto_shard(2, 2)
        grad = _grad_primitive(op.sharded)
        assert grad.attrs["self_define_shard"] is True
        return grad.attrs["in_layout"], grad.attrs["out_layout"]

    ascend = grad_layouts()
    monkeypatch.setattr(dispatch, "device", lambda: "CPU")
    assert ascend == grad_layouts() and len(ascend[0]) == 9
