"""The functional op inside graph code: a GRAPH_MODE Cell's construct and ``@ms.jit`` functions (AST
and bytecode capture), equal to PyNative, compiled once for every sequence length, with the same
dispatch, checks and fallback rule.

Bytecode capture runs with fullgraph=False: MindSpore 2.10's bytecode capture with fullgraph=True
refuses to call any function imported from another module ("Unsupported function"; measured with a
module holding only ``def ident(t): return t``), so no library's functional op can be called there."""
import logging
import types

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, nn

import ms_rope_attention as mra
from ms_rope_attention import dispatch, functional, gradients
from cases import Case
from reference import reference


def rope_attention(q, k, v, cos, sin):
    return mra.rotary_flash_attention(q, k, v, cos, sin, input_layout="BSND", return_softmax_lse=True,
                                      return_rotated_key=True)


class FunctionalInConstruct(nn.Cell):
    def construct(self, q, k, v, cos, sin):
        return rope_attention(q, k, v, cos, sin)


@ms.jit
def jit_ast(q, k, v, cos, sin):
    return rope_attention(q, k, v, cos, sin)


@ms.jit(capture_mode="bytecode")
def jit_bytecode(q, k, v, cos, sin):
    return rope_attention(q, k, v, cos, sin)


def inputs(rng, length=11):
    q, k, v, cos, sin, _, _ = Case(layout="BSND", heads=4, kv_heads=2, q_len=length, kv_len=length, batch=2,
                                   head_dim=16, table_rows=40).make(rng)
    return [Tensor(x.astype(np.float32)) for x in (q, k, v, cos, sin)]


@pytest.mark.parametrize("where", ["construct", "jit_ast", "jit_bytecode"])
def test_functional_in_graph_code_equals_pynative(where, rng):
    args = inputs(rng)
    ms.set_context(mode=ms.PYNATIVE_MODE)
    eager = rope_attention(*args)
    if where == "construct":
        ms.set_context(mode=ms.GRAPH_MODE)
        graph = FunctionalInConstruct()(*args)
    else:
        graph = {"jit_ast": jit_ast, "jit_bytecode": jit_bytecode}[where](*args)
    for a, b in zip(graph, eager):
        np.testing.assert_array_equal(a.asnumpy(), b.asnumpy())
    q, k, v, cos, sin = (x.asnumpy().astype(np.float64) for x in args)
    expected = reference(q, k, v, cos, sin, input_layout="BSND")[0]
    assert np.abs(graph[0].asnumpy() - expected).max() < 1e-5


def test_functional_in_graph_mode_compiles_once_for_every_length(rng):
    ms.set_context(mode=ms.GRAPH_MODE)
    cell = FunctionalInConstruct()
    cell.set_inputs(Tensor(shape=[2, None, 4, 16], dtype=ms.float32), Tensor(shape=[2, None, 2, 16], dtype=ms.float32),
                    Tensor(shape=[2, None, 2, 16], dtype=ms.float32), Tensor(shape=[40, 16], dtype=ms.float32),
                    Tensor(shape=[40, 16], dtype=ms.float32))
    for length in (5, 17, 9):
        args = inputs(rng, length)
        out = cell(*args)[0].asnumpy()
        q, k, v, cos, sin = (x.asnumpy().astype(np.float64) for x in args)
        assert np.abs(out - reference(q, k, v, cos, sin, input_layout="BSND")[0]).max() < 1e-5
    assert len(cell.compile_cache) == 1


def test_functional_gradient_in_graph_mode(rng):
    ms.set_context(mode=ms.GRAPH_MODE)
    args = inputs(rng)

    class Loss(nn.Cell):
        def construct(self, q, k, v, cos, sin):
            return mra.rotary_flash_attention(q, k, v, cos, sin, input_layout="BSND").sum()

    graph = ms.grad(Loss(), grad_position=(0, 1, 2))(*args)
    ms.set_context(mode=ms.PYNATIVE_MODE)
    eager = ms.grad(lambda q, k, v: mra.rotary_flash_attention(q, k, v, *args[3:], input_layout="BSND").sum(),
                    grad_position=(0, 1, 2))(*args[:3])
    for a, b in zip(graph, eager):
        np.testing.assert_allclose(a.asnumpy(), b.asnumpy(), atol=1e-6)


def test_bad_input_is_a_compile_time_error_in_graph_code(rng):
    ms.set_context(mode=ms.GRAPH_MODE)
    q, k, v, cos, sin = inputs(rng)

    class Bad(nn.Cell):
        def construct(self, q, k, v, cos, sin):
            return mra.rotary_flash_attention(q, k, v, cos, sin, input_layout="BSND", causal=1)

    with pytest.raises(ValueError, match="causal: expected a bool, got 1"):
        Bad()(q, k, v, cos, sin)


def test_fallback_rule_holds_in_graph_code(monkeypatch, caplog, rng, request):
    ms.set_context(mode=ms.GRAPH_MODE)
    monkeypatch.setitem(dispatch.FACTORIES, "CPU", types.SimpleNamespace(unavailable=lambda: "test: kernel missing"))
    dispatch.clear()  # and again after the test: its backends are the fallback's
    request.addfinalizer(dispatch.clear)
    monkeypatch.setattr(gradients, "_announced", set())
    args = inputs(rng)

    class Strict(nn.Cell):
        def construct(self, q, k, v, cos, sin):
            return mra.rotary_flash_attention(q, k, v, cos, sin, input_layout="BSND", strict=True)

    with pytest.raises(mra.RotaryFusionFallbackError, match="kernel missing"):
        Strict()(*args)
    with caplog.at_level(logging.WARNING, logger="ms_rope_attention"):
        out = FunctionalInConstruct()(*args)[0]
    assert any("rotary_fusion_fallback" in r.getMessage() for r in caplog.records)
    q, k, v, cos, sin = (x.asnumpy().astype(np.float64) for x in args)
    assert np.abs(out.asnumpy() - reference(q, k, v, cos, sin, input_layout="BSND")[0]).max() < 1e-5
