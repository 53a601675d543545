"""Every private interface of MindSpore, mindtorch (mindnlp) and transformers the package touches, in
one place: why it is used, the public fallback where one exists, and a test that pins it to the
supported versions (``tests/test_compat.py``; transformers' in ``tests/thirdparty/test_mindnlp.py``).
Supported: MindSpore 2.10.0; mindnlp 0.5.1 with transformers 4.57.1.
"""
from __future__ import annotations

import sys

import mindspore as ms

try:  # private: a fast read of the execution mode (0.6 us a call, ms.get_context("mode") 31 us)
    from mindspore.context import _get_mode as _mode
except ImportError:  # public fallback
    def _mode():
        return ms.get_context("mode")

try:  # private: whether a bytecode (PIJit) capture is tracing this call
    from mindspore.ops.primitive import jit_context as _jit_context
except ImportError:  # without it, no capture can be detected: every call counts as eager
    def _jit_context():
        return None


def launches_eagerly() -> bool:
    """True for a call that runs now (PyNative, not traced by a ``jit`` capture); False inside a graph
    being built. Called on every eager launch of the fused op, hence the private fast reads."""
    return _jit_context() is None and _mode() == ms.PYNATIVE_MODE


def copy_device_tag(outputs, like) -> None:
    """mindtorch tags its tensors with a device in the private ``_device`` attribute and refuses
    untagged ones (its KV cache reads ``key.device``): ``outputs`` get ``like``'s tag, if it has one.
    There is no public API for it."""
    device = getattr(like, "_device", None)
    if device is not None:
        for output in outputs:
            output._device = device


def drop_compiled_graphs(cell) -> bool:
    """Forgets the graphs GRAPH_MODE compiled for ``cell`` (MindSpore's private ``Cell.compile_cache``),
    so that its next call compiles its current ``construct``; True if there was one. There is no
    public API to drop a compiled graph."""
    cache = getattr(cell, "compile_cache", None)
    if cache:
        cache.clear()
        return True
    return False


def attention_implementation(config) -> str:
    """transformers' private ``config._attn_implementation`` ('eager', 'sdpa', ...): which attention
    a Hugging Face model runs, which decides its mask's form. A config without it runs 'eager'."""
    return getattr(config, "_attn_implementation", None) or "eager"


def generator_primitive():
    """MindSpore's private ``_inner_ops.Generator`` primitive class (mindtorch builds it; see
    ``fusion.mindnlp_compat``), and a function that replaces it for later importers."""
    from mindspore.ops.operations import _inner_ops

    def replace(cls) -> None:
        _inner_ops.Generator = cls

    return _inner_ops.Generator, replace


def has_forward_hooks(module) -> bool:
    """Whether a (mindtorch) ``nn.Module`` call would run forward hooks besides its ``forward``: its
    own (the private ``_forward_hooks`` / ``_forward_pre_hooks`` dicts, as PyTorch names them) or a
    global one (module-level dicts of ``nn.modules.module``). There is no public query; a module
    without the attributes counts as hooked, so its call is never bypassed."""
    own = [getattr(module, name, None) for name in ("_forward_hooks", "_forward_pre_hooks")]
    if any(hooks is None for hooks in own):
        return True
    registry = sys.modules.get(type(module).__module__.rsplit(".modules.", 1)[0] + ".modules.module")
    global_hooks = [getattr(registry, name, {}) for name in ("_global_forward_hooks", "_global_forward_pre_hooks")]
    return any(own) or any(global_hooks)
