"""The private MindSpore interfaces ms_rope_attention/_compat.py reads exist and behave as it
assumes on the supported MindSpore (2.10): each is the private one, not its fallback, and agrees with
the public spelling where there is one. transformers' and mindtorch's are pinned in
tests/thirdparty/test_mindnlp.py, in their own environment."""
import inspect

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops

from ms_rope_attention import _compat


def test_the_supported_mindspore():
    assert ms.__version__ == "2.10.0"


def test_the_mode_is_read_through_the_private_fast_path():
    from mindspore.context import _get_mode

    assert _compat._mode is _get_mode
    previous = ms.get_context("mode")
    try:
        for mode in (ms.PYNATIVE_MODE, ms.GRAPH_MODE):
            ms.set_context(mode=mode)
            assert _compat._mode() == ms.get_context("mode") == mode
            assert _compat.launches_eagerly() is (mode == ms.PYNATIVE_MODE)
    finally:
        ms.set_context(mode=previous)


def test_the_jit_capture_probe_is_the_private_one():
    """``jit_context()`` is None outside a capture; that the fused op becomes a node of a bytecode
    capture through it is tests/test_functional_graph.py's jit_bytecode case."""
    from mindspore.ops.primitive import jit_context

    assert _compat._jit_context is jit_context and jit_context() is None


def test_compiled_graphs_can_be_dropped():
    previous = ms.get_context("mode")
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        class Double(nn.Cell):
            def construct(self, x):
                return x * 2

        cell = Double()
        cell(Tensor(np.ones(2, np.float32)))
        assert len(cell.compile_cache) == 1
        assert _compat.drop_compiled_graphs(cell) is True and not cell.compile_cache
        assert _compat.drop_compiled_graphs(cell) is False
    finally:
        ms.set_context(mode=previous)


def test_the_generator_primitive_takes_seed_and_offset():
    from mindspore.ops.operations import _inner_ops

    generator, replace = _compat.generator_primitive()
    assert generator is _inner_ops.Generator
    assert list(inspect.signature(generator.__init__).parameters)[1:3] == ["seed", "offset"]
    replace(generator)  # the same class back: nothing changes
    assert _inner_ops.Generator is generator


def test_device_tags_and_attention_implementation_on_plain_objects():
    class Config:
        pass

    assert _compat.attention_implementation(Config()) == "eager"
    config = Config()
    config._attn_implementation = "sdpa"
    assert _compat.attention_implementation(config) == "sdpa"
    out = ops.ones(2)
    _compat.copy_device_tag([out], object())  # untagged: nothing set
    assert not hasattr(out, "_device")
