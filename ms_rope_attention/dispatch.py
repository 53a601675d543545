"""Which kernel runs an attribute set on this device: the backend registry, its one place.

``FACTORIES`` maps a device target to its kernel module, which answers ``unavailable()`` (None, or
why the fused op cannot run here) and ``make_kernel(attrs, forwards)`` (a ``gradients.FusedKernel``).
``backend_for`` builds one ``Backend`` per attribute set and device the first time it is asked for
(attributes validated, a fallback announced: never silent, ``strict`` raises) and caches it;
``clear()`` empties the cache (tests that change the registry or the environment call it).
The paged cache's two ops are chosen the same way (``PAGED_FACTORIES``, ``paged_primitive``), with
no fallback: a device without their kernel is refused with their contract's ``ascend`` rule.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import mindspore as ms

from . import ascend_kernel, checks, cpu_kernel, paged_kernel
from .attrs import OpAttrs, check_attention_compute_dtype
from .gradients import AutodiffForwards, FusedKernel, announce_fallback
from .layouts import shard
from .op_info import attr_values

BACKENDS = ("auto", "fused", "unfused")
FACTORIES = {"CPU": cpu_kernel, "Ascend": ascend_kernel}
PAGED_FACTORIES = {"CPU": paged_kernel}  # device -> module answering make_op(op_name, values)


class Backend(NamedTuple):
    """The kernels of one attribute set: ``kernel`` (None when the unfused path runs), ``name``
    ('fused:CPU', 'fused:Ascend' or 'unfused') and ``fallback_reason``."""
    kernel: FusedKernel | None
    name: str
    fallback_reason: str | None

    @property
    def fused(self):
        """The fused forward primitive, or None."""
        return None if self.kernel is None else self.kernel.forward


_backends: dict = {}


def device() -> str:
    return ms.get_context("device_target")


def clear() -> None:
    """Forget every Backend built so far: the next call builds its kernels again."""
    _backends.clear()


def backend_for(attrs: OpAttrs, forwards: Callable[[OpAttrs], AutodiffForwards]) -> Backend:
    """The cached ``Backend`` of ``attrs`` on this device. Keyed by type and value: 1 == True ==
    1.0, but they are not the same argument. ``forwards(attrs)``: the autodiff forwards a kernel
    without a fused backward differentiates (built only when a kernel is)."""
    key = tuple((type(a).__name__, a) for a in attrs) + (device(),)
    found = _backends.get(key)
    if found is not None:
        return found
    checks.check_attrs(attrs)
    checks.check_flags(with_softmax_lse=attrs.with_softmax_lse, with_rotated_key=attrs.with_rotated_key,
                       key_rotated=attrs.key_rotated, strict=attrs.strict)
    if attrs.backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {list(BACKENDS)}, got {attrs.backend!r}")
    check_attention_compute_dtype(attrs.compute_dtype)
    kernel, reason = make_kernel(attrs, forwards)
    if reason is not None:
        announce_fallback(reason, attrs.strict or attrs.backend == "fused")
    if kernel is None and attrs.compute_dtype == "bfloat16":
        announce_fallback(UNFUSED_FLOAT32, attrs.strict)
    found = _backends[key] = Backend(kernel, f"fused:{device()}" if kernel is not None else "unfused", reason)
    return found


# Why an explicit compute_dtype='bfloat16' is not what the unfused path runs.
UNFUSED_FLOAT32 = ("compute_dtype='bfloat16': the unfused path computes float32 (MindSpore 2.10's CPU backend has no "
                   "bfloat16 MatMul or Reshape)")


def arithmetic(backend: Backend, attrs: OpAttrs, input_dtype: str) -> str:
    """What Q K^T and P V of ``backend`` compute in for inputs of ``input_dtype`` ('float32',
    'float16' or 'bfloat16'): the CPU kernel's resolution of ``attrs.compute_dtype``
    (``cpu_kernel.compute_dtype_for``), the inputs' own dtype on Ascend (its cube units, float32
    accumulation), float32 on the unfused path."""
    if backend.name == "fused:CPU":
        return cpu_kernel.compute_dtype_for(attrs.compute_dtype, input_dtype)
    return input_dtype if backend.name == "fused:Ascend" else "float32"


def make_kernel(attrs: OpAttrs, forwards: Callable[[OpAttrs], AutodiffForwards],
                parallel: tuple[int, int] | None = None) -> tuple[FusedKernel | None, str | None]:
    """(a new fused kernel, None) for checked attributes, or (None, why the fused kernel is
    unavailable); (None, None) for backend='unfused'. Not cached. ``parallel=(dp, tp)``: its
    primitives carry the semi-auto layouts of ``layouts``."""
    if attrs.backend == "unfused":
        return None, None
    factory = FACTORIES.get(device())
    reason = f"no fused kernel registered for device {device()!r}" if factory is None else factory.unavailable()
    if reason is not None:
        return None, reason
    kernel = factory.make_kernel(attrs, forwards(attrs))
    if parallel is not None:
        shard(kernel, attrs, *parallel)
    return kernel, None


def paged_primitive(op_name: str, items: tuple):
    """The cached primitive of a paged-cache op (``RotaryPagedAttention`` or ``RotaryCacheWrite``)
    for its attributes ``items`` ((name, value) pairs over the contract's defaults, checked first) on
    this device. Where it has no kernel the contract's ``ascend`` rule says what runs instead."""
    contract = paged_kernel.contract(op_name)
    values = attr_values(contract, dict(items))
    key = (op_name, tuple(values.items()), device())
    found = _backends.get(key)
    if found is not None:
        return found
    factory = PAGED_FACTORIES.get(device())
    if factory is None:
        raise RuntimeError(f"{op_name}: no kernel for device {device()!r}; {contract.semantics['ascend']} "
                           "(docs/serving.md)")
    found = _backends[key] = factory.make_op(op_name, values)
    return found
