"""Runs mindnlp 0.5.1 on MindSpore 2.10 (it declares MindSpore <= 2.7.0): ``install()`` before
``import mindnlp``.

Why a shim and not MindSpore 2.7: this project's kernels are built and tested on MindSpore 2.10's
custom-op interfaces only. The one incompatibility met on the path mindnlp's Llama runs: MindSpore
2.10's ``Generator`` primitive takes its seed and offset Parameters at construction
(``Generator(seed, offset)``), where mindtorch builds it bare and passes plain Tensors and a Python
int step to each call (``TypeError: Generator.__init__() missing 2 required positional arguments``
at ``import mindnlp``, then ``Invalid tensor input: Step``). The stand-in below builds the primitive
the 2.10 way and converts mindtorch's calls; nothing in site-packages is edited. What it covers is
what ``tests/thirdparty/test_mindnlp.py`` runs (tiny HF Llama/Mistral/Qwen2 forward and generate).
"""
from __future__ import annotations

import mindspore as ms
from mindspore import Parameter, Tensor

from .._compat import generator_primitive

_MindSporeGenerator, _replace_generator = generator_primitive()


class _Generator(_MindSporeGenerator):
    """MindSpore 2.10's Generator primitive, constructible as mindtorch constructs it."""

    def __init__(self, seed=None, offset=None):
        if seed is None:
            seed = Parameter(Tensor(0, ms.int64), requires_grad=False)
            offset = Parameter(Tensor(0, ms.int64), requires_grad=False)
        super().__init__(seed, offset)
        self.state = (seed, offset)

    def __call__(self, cmd, inputs):
        rest = tuple(Tensor(x, ms.int64) if isinstance(x, int) else x for x in inputs[2:])
        return super().__call__(cmd, self.state + rest)


def install() -> None:
    """Idempotent; must run before mindnlp (mindtorch) is imported."""
    _replace_generator(_Generator)
