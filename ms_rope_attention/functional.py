"""``rotary_flash_attention``: the functional op, and the graph-safe glue every entry shares.

The op runs eagerly (PyNative), inside a Cell's ``construct`` under GRAPH_MODE and inside ``@ms.jit``
(AST and bytecode capture): arguments are checked and the backend chosen by ``ops.constexpr``
helpers, which run when a graph is compiled, or at the call when eager. The fused kernel is
preferred; a fallback to the unfused path is never silent: it logs a one-time warning containing
``rotary_fusion_fallback`` and the reason, and ``strict=True`` raises instead.
The Cells (``nn.RotaryFlashAttentionOp``, ``nn.RotaryFlashAttention``) call the glue below with
their fixed attributes; the backend registry is ``dispatch``, the attributes ``attrs.OpAttrs``.
"""
from __future__ import annotations

import logging

import mindspore as ms
import numpy as np
from mindspore import Tensor, ops

from . import checks, dispatch
from .attrs import OpAttrs
from .checks import Geometry
from .flash_backward import rotary_flash_attention_score
from .gradients import AutodiffForwards, RotaryFusionFallbackError, announce_fallback  # noqa: F401 (re-exported)
from .unfused import unfused_rotary_flash_attention

logger = logging.getLogger("ms_rope_attention")
_EMPTY_LSE = Tensor(np.zeros((0,), np.float32))  # softmax_lse when it was not asked for


def backend_for(attrs: OpAttrs) -> dispatch.Backend:
    """The dispatch's ``Backend`` for ``attrs`` (a plain tuple of its fields, inside a graph)."""
    return dispatch.backend_for(OpAttrs.of(attrs), autodiff_forwards)


def autodiff_forwards(attrs: OpAttrs) -> AutodiffForwards:
    """The op rebuilt from MindSpore ops with fixed attributes, for a fused kernel whose backward is
    an autodiff."""
    return AutodiffForwards(_unfused_forward(attrs), _flash_attention_forward(attrs))


@ops.constexpr(reuse_result=False)
def _fused_primitive(attrs):
    """``backend_for(attrs).fused`` as a graph constant (None: the unfused path). Not reused by value:
    constexpr's own result cache would take causal=1 for causal=True."""
    return backend_for(attrs).fused


@ops.constexpr(check=False)
def _check_call(attrs, shapes, dtypes, offsets):
    """Compile-time (GRAPH_MODE) or eager (PyNative) argument check; returns the ``Geometry``'s
    values. ``shapes``/``dtypes``: of query, key, value, cos, sin; ``offsets``: None or (dtype, rank)
    of each TND offsets tensor.

    With dynamic shapes a graph's ``x.shape`` holds ``None`` for each dynamic dimension: a value not
    known when the graph compiles, which makes constexpr's own check warn that its arguments are not
    all constant. That is expected here (``check=False``): every known dimension is checked now, and the
    dynamic ones by the kernel when it launches, before it reads any memory."""
    return tuple(checks.check_inputs(OpAttrs.of(attrs), tuple(zip(shapes, dtypes)), offsets))


@ops.constexpr
def _table_needs_cast(dtype) -> bool:
    """Tables outside the kernel's dtypes (e.g. float64) are cast to float32: exact, and announced."""
    name = checks.dtype_name(dtype)
    if name in checks.TABLE_DTYPES:
        return False
    logger.info("ms_rope_attention: casting a %s cos/sin table to float32 (compute is float32)", name)
    return True


@ops.constexpr
def _require_static(q_heads, kv_heads, head_dim):
    if q_heads is None or kv_heads is None or head_dim is None:
        raise ValueError("query/key: the unfused path needs static head counts and head_dim "
                         "(only batch and sequence dimensions may be dynamic)")
    return True


def checked_geometry(query, key, value, cos, sin, actual_seq_qlen, actual_seq_kvlen, attrs) -> Geometry:
    """The static check of one call (inside a graph: when it compiles)."""
    _check_tensors(query, key, value, cos, sin, actual_seq_qlen, actual_seq_kvlen)
    offsets = tuple(None if t is None else (t.dtype, t.ndim) for t in (actual_seq_qlen, actual_seq_kvlen))
    return Geometry(*_check_call(attrs, (query.shape, key.shape, value.shape, cos.shape, sin.shape),
                                 (query.dtype, key.dtype, value.dtype, cos.dtype, sin.dtype), offsets))


@ops.constexpr(check=False, reuse_result=False)
def _check_tensors(query, key, value, cos, sin, actual_seq_qlen, actual_seq_kvlen):
    """Every input is a Tensor (the offsets may be None): anything else is named, eagerly or when the
    graph compiles, before any attribute of it is read."""
    named = (("query", query), ("key", key), ("value", value), ("cos", cos), ("sin", sin),
             ("actual_seq_qlen", actual_seq_qlen), ("actual_seq_kvlen", actual_seq_kvlen))
    for name, tensor in named:
        if not isinstance(tensor, Tensor) and not (name.startswith("actual") and tensor is None):
            raise TypeError(f"{name}: expected a mindspore Tensor, got {type(tensor).__name__}")
    return True


def _table(table):
    return table.astype(ms.float32) if _table_needs_cast(table.dtype) else table


def _unfused(query, key, value, cos, sin, actual_seq_qlen, actual_seq_kvlen, geometry, attrs):
    _require_static(geometry.q_heads, geometry.kv_heads, geometry.head_dim)
    return unfused_rotary_flash_attention(
        query, key, value, _table(cos), _table(sin), actual_seq_qlen, actual_seq_kvlen, head_num=geometry.q_heads,
        kv_head_num=geometry.kv_heads, head_dim=geometry.head_dim, input_layout=attrs.input_layout,
        rotary_mode=attrs.rotary_mode, rotary_dim=geometry.rotary_dim, scale=geometry.scale, causal=attrs.causal,
        with_softmax_lse=attrs.with_softmax_lse, with_rotated_key=attrs.with_rotated_key,
        key_rotated=attrs.key_rotated)


def _unfused_forward(attrs: OpAttrs):
    """The unfused path with fixed attributes: the gradient of a fused forward on a device without a
    fused backward is its autodiff."""

    def forward(query, key, value, cos, sin, actual_seq_qlen, actual_seq_kvlen):
        geometry = checked_geometry(query, key, value, cos, sin, actual_seq_qlen, actual_seq_kvlen, attrs)
        return _unfused(query, key, value, cos, sin, actual_seq_qlen, actual_seq_kvlen, geometry, attrs)

    return forward


def _flash_attention_forward(attrs: OpAttrs):
    """(attention_out, rotated_key) from RoPE + MindSpore's FlashAttention with fixed attributes:
    the Ascend backward until the fused one has run on hardware is its autodiff (``flash_backward``)."""

    def forward(query, key, value, cos, sin, actual_seq_qlen, actual_seq_kvlen):
        geometry = checked_geometry(query, key, value, cos, sin, actual_seq_qlen, actual_seq_kvlen, attrs)
        return rotary_flash_attention_score(
            query, key, value, _table(cos), _table(sin), actual_seq_qlen, actual_seq_kvlen, head_num=geometry.q_heads,
            kv_head_num=geometry.kv_heads, head_dim=geometry.head_dim, input_layout=attrs.input_layout,
            rotary_mode=attrs.rotary_mode, rotary_dim=geometry.rotary_dim, scale=geometry.scale, causal=attrs.causal,
            key_rotated=attrs.key_rotated)

    return forward


def attend(query, key, value, cos, sin, actual_seq_qlen, actual_seq_kvlen, geometry, attrs):
    """(attention_out, softmax_lse, rotated_key), disabled outputs empty, on checked arguments."""
    fused = _fused_primitive(attrs)
    if fused is None:
        return _unfused(query, key, value, cos, sin, actual_seq_qlen, actual_seq_kvlen, geometry, attrs)
    return call_fused(fused, query, key, value, cos, sin, actual_seq_qlen, actual_seq_kvlen, attrs.with_softmax_lse)


def call_fused(fused, query, key, value, cos, sin, actual_seq_qlen, actual_seq_kvlen, with_softmax_lse):
    out, lse, rotated_key = fused(query, key, value, _table(cos), _table(sin), actual_seq_qlen, actual_seq_kvlen)
    if not with_softmax_lse:
        lse = _EMPTY_LSE
    return out, lse, rotated_key


@ops.constexpr(reuse_result=False)
def _check_return_flags(return_softmax_lse, return_rotated_key):
    checks.check_flags(return_softmax_lse=return_softmax_lse, return_rotated_key=return_rotated_key)
    return True


def _eager_marker():
    """Passed to a constexpr: it arrives as itself when the call is eager, as None inside a graph."""


@ops.constexpr(check=False, reuse_result=False)
def _check_offsets_when_eager(marker, actual_seq_qlen, actual_seq_kvlen, total_q, total_kv, table_rows):
    """The TND offsets' values, eagerly (inside a graph the tensors are placeholders: the kernel
    checks the values when it launches, before reading any memory)."""
    if marker is not None:
        checks.check_actual_seq(actual_seq_qlen.asnumpy(), actual_seq_kvlen.asnumpy(), total_q, total_kv,
                                table_rows)
    return True


@ops.constexpr(reuse_result=False)
def _offsets_constant(name, value):
    """Offsets given as a Python or numpy sequence of integers, as an int64 Tensor; anything else
    (floats, which would be truncated, bools, strings) is refused."""
    try:
        items = None if isinstance(value, (str, bytes)) else list(np.asarray(value, dtype=object).reshape(-1))
    except (TypeError, ValueError):
        items = None
    if items is None or any(isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) for v in items):
        raise TypeError(f"{name}: expected integer cumulative end offsets (a sequence of ints or an int64 Tensor), "
                        f"got {value!r}")
    return Tensor(np.asarray(items, np.int64).reshape(np.shape(value)), ms.int64)


def rotary_flash_attention(query, key, value, cos, sin, head_num=None, *, input_layout="BNSD", rotary_mode=0,
                           rotary_dim=None, scale=None, causal=True, actual_seq_qlen=None, actual_seq_kvlen=None,
                           return_softmax_lse=False, return_rotated_key=False, key_rotated=False, backend="auto",
                           strict=False, compute_dtype="auto"):
    """RoPE(query), RoPE(key) and attention in one fused pass; returns the output in query's layout/dtype.

    See the semantics table in docs/semantics.md (generated from ``op_info``). With ``return_softmax_lse`` /
    ``return_rotated_key`` a tuple ``(out, lse?, rotated_key?)`` is returned. ``key_rotated=True``
    says key already carries RoPE (a KV cache of earlier ``rotated_key`` outputs): only query is
    rotated. ``compute_dtype`` ('auto', 'float32', 'bfloat16') is the arithmetic of Q·Kᵀ and P·V
    (the contract's rule). Works eagerly, inside ``construct`` under GRAPH_MODE and inside ``@ms.jit``; eagerly,
    the TND offsets' values are checked here, inside a graph by the kernel when it launches.
    """
    _check_return_flags(return_softmax_lse, return_rotated_key)
    if actual_seq_qlen is not None and not isinstance(actual_seq_qlen, Tensor):
        actual_seq_qlen = _offsets_constant("actual_seq_qlen", actual_seq_qlen)
    if actual_seq_kvlen is not None and not isinstance(actual_seq_kvlen, Tensor):
        actual_seq_kvlen = _offsets_constant("actual_seq_kvlen", actual_seq_kvlen)
    attrs = OpAttrs(head_num=head_num, input_layout=input_layout, rotary_mode=rotary_mode, rotary_dim=rotary_dim,
                    scale=scale, causal=causal, with_softmax_lse=return_softmax_lse,
                    with_rotated_key=return_rotated_key, key_rotated=key_rotated, compute_dtype=compute_dtype,
                    backend=backend, strict=strict)
    geometry = checked_geometry(query, key, value, cos, sin, actual_seq_qlen, actual_seq_kvlen, attrs)
    if input_layout == "TND":
        _check_offsets_when_eager(_eager_marker, actual_seq_qlen, actual_seq_kvlen, query.shape[0], key.shape[0],
                                  cos.shape[0])
    out, lse, rotated_key = attend(query, key, value, cos, sin, actual_seq_qlen, actual_seq_kvlen, geometry, attrs)
    return requested_outputs(out, lse, rotated_key, return_softmax_lse, return_rotated_key)


def requested_outputs(out, lse, rotated_key, with_softmax_lse, with_rotated_key):
    """out, or the tuple (out, lse?, rotated_key?) of the outputs asked for."""
    if with_softmax_lse and with_rotated_key:
        return out, lse, rotated_key
    if with_softmax_lse:
        return out, lse
    if with_rotated_key:
        return out, rotated_key
    return out
