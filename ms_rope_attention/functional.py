"""``rotary_flash_attention``: the functional op, and the backend dispatch behind it (its one place).

The op runs eagerly (PyNative), inside a Cell's ``construct`` under GRAPH_MODE and inside ``@ms.jit``
(AST and bytecode capture): arguments are checked and the backend chosen by ``ops.constexpr``
helpers, which run when a graph is compiled, or at the call when eager. The fused kernel is
preferred; a fallback to the unfused path is never silent: it logs a one-time warning containing
``rotary_fusion_fallback`` and the reason, and ``strict=True`` raises instead.
``RotaryFlashAttentionOp`` is the same op as a Cell with fixed attributes.
"""
from __future__ import annotations

import logging
from typing import NamedTuple

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops

from . import checks
from .flash_backward import rotary_flash_attention_score
from .gradients import AutodiffForwards, RotaryFusionFallbackError, announce_fallback  # noqa: F401 (re-exported)
from .unfused import unfused_rotary_flash_attention

logger = logging.getLogger("ms_rope_attention")
BACKENDS = ("auto", "fused", "unfused")
_EMPTY_LSE = Tensor(np.zeros((0,), np.float32))  # softmax_lse when it was not asked for


def _device() -> str:
    return ms.get_context("device_target")


def _fused_factory(device: str):
    """(factory, None) for the fused kernel of this device, or (None, reason it is unavailable)."""
    if device == "CPU":
        try:
            from .cpu_kernel import make_cpu_op, select_library
            select_library()
            return make_cpu_op, None
        except (RuntimeError, OSError) as exc:
            return None, f"CPU kernel unavailable ({exc})"
    if device == "Ascend":
        from .ascend_kernel import make_ascend_op, package_status
        reason = package_status()
        return (None, reason) if reason else (make_ascend_op, None)
    return None, f"no fused kernel registered for device {device!r}"


class OpAttrs(NamedTuple):
    """The op's attributes, one value from the Cell or the call down to the kernel factories.
    Inside a graph it is a plain tuple where it reaches an ``ops.constexpr`` helper: those rebuild
    it (``OpAttrs(*attrs)``); graph code itself reads the fields by name."""
    head_num: int | None = None
    input_layout: str = "BNSD"
    rotary_mode: int = 0
    rotary_dim: int | None = None
    scale: float | None = None
    causal: bool = True
    with_softmax_lse: bool = False
    with_rotated_key: bool = False
    key_rotated: bool = False
    backend: str = "auto"
    strict: bool = False

    def kernel_attrs(self) -> dict:
        """The primitives' attributes (the contract's names; 0 for "from the inputs"). The fused
        forward always emits softmax_lse: the backward needs it (a float per row); the op returns an
        empty lse when it was not asked for."""
        return {"head_num": self.head_num or 0, "input_layout": self.input_layout, "rotary_mode": self.rotary_mode,
                "rotary_dim": self.rotary_dim or 0, "scale": float(self.scale or 0.0), "causal": self.causal,
                "with_softmax_lse": True, "with_rotated_key": self.with_rotated_key, "key_rotated": self.key_rotated}


class Backend:
    """The kernels of one attribute set: ``fused`` (the primitive, or None when the unfused path runs),
    ``name`` ('fused:CPU', 'fused:Ascend' or 'unfused') and ``fallback_reason``."""

    def __init__(self, fused, name: str, fallback_reason: str | None):
        self.fused, self.name, self.fallback_reason = fused, name, fallback_reason


_backends: dict = {}


def backend_for(attrs: OpAttrs) -> Backend:
    """The dispatch: one ``Backend`` per attribute set and device, built (attributes validated,
    a fallback announced) the first time it is asked for. Keyed by type and value: 1 == True == 1.0,
    but they are not the same argument."""
    attrs = OpAttrs(*attrs)
    key = tuple((type(a).__name__, a) for a in attrs) + (_device(),)
    found = _backends.get(key)
    if found is not None:
        return found
    checks.check_attrs(attrs.head_num, attrs.input_layout, attrs.rotary_mode, attrs.rotary_dim, attrs.scale,
                       attrs.causal)
    checks.check_flags(with_softmax_lse=attrs.with_softmax_lse, with_rotated_key=attrs.with_rotated_key,
                       key_rotated=attrs.key_rotated, strict=attrs.strict)
    if attrs.backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {list(BACKENDS)}, got {attrs.backend!r}")
    fused, reason = _make_fused(attrs)
    if reason is not None:
        announce_fallback(reason, attrs.strict or attrs.backend == "fused")
    found = _backends[key] = Backend(fused, f"fused:{_device()}" if fused is not None else "unfused", reason)
    return found


def _make_fused(attrs: OpAttrs, parallel=None):
    """(a new fused primitive, None) for checked attributes, or (None, why the fused kernel is
    unavailable); (None, None) for backend='unfused'. ``parallel=(dp, tp)``: with semi-auto layouts."""
    if attrs.backend == "unfused":
        return None, None
    factory, reason = _fused_factory(_device())
    if factory is None:
        return None, reason
    return factory(attrs.kernel_attrs(), (attrs.with_softmax_lse, attrs.with_rotated_key),
                   AutodiffForwards(_unfused_forward(attrs), _flash_attention_forward(attrs)),
                   attrs.strict or attrs.backend == "fused", parallel), None


@ops.constexpr(reuse_result=False)
def _fused_primitive(attrs):
    """``backend_for(attrs).fused`` as a graph constant (None: the unfused path). Not reused by value:
    constexpr's own result cache would take causal=1 for causal=True."""
    return backend_for(OpAttrs(*attrs)).fused


@ops.constexpr(check=False)
def _check_call(q_shape, k_shape, v_shape, cos_shape, sin_shape, q_dtype, k_dtype, v_dtype, cos_dtype, sin_dtype,
                attrs, aq_meta, akv_meta):
    """Compile-time (GRAPH_MODE) or eager (PyNative) argument check; returns the static geometry.

    With dynamic shapes a graph's ``x.shape`` holds ``None`` for each dynamic dimension: a value not
    known when the graph compiles, which makes constexpr's own check warn that its arguments are not
    all constant. That is expected here (``check=False``): every known dimension is checked now, and the
    dynamic ones by the kernel when it launches, before it reads any memory."""
    a = OpAttrs(*attrs)
    geo = checks.check_inputs(q_shape, k_shape, v_shape, cos_shape, sin_shape, q_dtype, k_dtype, v_dtype, cos_dtype,
                              sin_dtype, a.head_num, a.input_layout, a.rotary_mode, a.rotary_dim, a.scale, a.causal,
                              aq_meta, akv_meta)
    return geo.q_heads, geo.kv_heads, geo.head_dim, geo.rotary_dim, geo.scale


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


def _geometry(query, key, value, cos, sin, actual_seq_qlen, actual_seq_kvlen, attrs):
    """The static check of one call: (q_heads, kv_heads, head_dim, rotary_dim, scale)."""
    _check_tensors(query, key, value, cos, sin, actual_seq_qlen, actual_seq_kvlen)
    return _check_call(query.shape, key.shape, value.shape, cos.shape, sin.shape, query.dtype, key.dtype, value.dtype,
                       cos.dtype, sin.dtype, attrs,
                       None if actual_seq_qlen is None else (actual_seq_qlen.dtype, actual_seq_qlen.ndim),
                       None if actual_seq_kvlen is None else (actual_seq_kvlen.dtype, actual_seq_kvlen.ndim))


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
    q_heads, kv_heads, head_dim, rotary_dim, scale = geometry
    _require_static(q_heads, kv_heads, head_dim)
    return unfused_rotary_flash_attention(
        query, key, value, _table(cos), _table(sin), actual_seq_qlen, actual_seq_kvlen, head_num=q_heads,
        kv_head_num=kv_heads, head_dim=head_dim, input_layout=attrs.input_layout, rotary_mode=attrs.rotary_mode,
        rotary_dim=rotary_dim, scale=scale, causal=attrs.causal, with_softmax_lse=attrs.with_softmax_lse,
        with_rotated_key=attrs.with_rotated_key, key_rotated=attrs.key_rotated)


def _unfused_forward(attrs: OpAttrs):
    """The unfused path with fixed attributes: the gradient of a fused forward on a device without a
    fused backward is its autodiff."""

    def forward(query, key, value, cos, sin, actual_seq_qlen, actual_seq_kvlen):
        geometry = _geometry(query, key, value, cos, sin, actual_seq_qlen, actual_seq_kvlen, attrs)
        return _unfused(query, key, value, cos, sin, actual_seq_qlen, actual_seq_kvlen, geometry, attrs)

    return forward


def _flash_attention_forward(attrs: OpAttrs):
    """(attention_out, rotated_key) from RoPE + MindSpore's FlashAttention with fixed attributes:
    the Ascend backward until the fused one has run on hardware is its autodiff (``flash_backward``)."""

    def forward(query, key, value, cos, sin, actual_seq_qlen, actual_seq_kvlen):
        q_heads, kv_heads, head_dim, rotary, softmax_scale = _geometry(
            query, key, value, cos, sin, actual_seq_qlen, actual_seq_kvlen, attrs)
        return rotary_flash_attention_score(
            query, key, value, _table(cos), _table(sin), actual_seq_qlen, actual_seq_kvlen, head_num=q_heads,
            kv_head_num=kv_heads, head_dim=head_dim, input_layout=attrs.input_layout, rotary_mode=attrs.rotary_mode,
            rotary_dim=rotary, scale=softmax_scale, causal=attrs.causal, key_rotated=attrs.key_rotated)

    return forward


def _attention(query, key, value, cos, sin, actual_seq_qlen, actual_seq_kvlen, geometry, attrs):
    """(attention_out, softmax_lse, rotated_key), disabled outputs empty, on checked arguments."""
    fused = _fused_primitive(attrs)
    if fused is None:
        return _unfused(query, key, value, cos, sin, actual_seq_qlen, actual_seq_kvlen, geometry, attrs)
    return _call_fused(fused, query, key, value, cos, sin, actual_seq_qlen, actual_seq_kvlen, attrs.with_softmax_lse)


def _call_fused(fused, query, key, value, cos, sin, actual_seq_qlen, actual_seq_kvlen, with_softmax_lse):
    out, lse, rotated_key = fused(query, key, value, _table(cos), _table(sin), actual_seq_qlen, actual_seq_kvlen)
    if not with_softmax_lse:
        lse = _EMPTY_LSE
    return out, lse, rotated_key


@ops.constexpr(check=False)
def _check_shard_shapes(input_layout, parallel, query_shape, key_shape, head_num):
    """The (dp, tp) split's divisibility on the global shapes: a graph's are global when it compiles
    (dynamic dimensions, unknown then, are skipped as in ``_check_call``)."""
    from .distributed.sharding import check_shard_shapes

    check_shard_shapes(input_layout, *parallel, query_shape, key_shape, head_num)
    return True


class RotaryFlashAttentionOp(nn.Cell):
    """The op with fixed attributes; ``construct(query, key, value, cos, sin, actual_seq_qlen=None,
    actual_seq_kvlen=None)`` returns ``(attention_out, softmax_lse, rotated_key)`` (disabled
    outputs are empty). ``backend_name`` tells which backend runs."""

    def __init__(self, head_num=None, input_layout="BNSD", rotary_mode=0, rotary_dim=None, scale=None, causal=True,
                 with_softmax_lse=False, with_rotated_key=False, backend="auto", strict=False, key_rotated=False):
        super().__init__()
        self.attrs = OpAttrs(head_num, input_layout, rotary_mode, rotary_dim, scale, causal, with_softmax_lse,
                             with_rotated_key, key_rotated, backend, strict)
        chosen = backend_for(self.attrs)
        self.backend_name, self.fallback_reason = chosen.name, chosen.fallback_reason
        self.parallel, self.sharded = None, None

    def semi_auto_shard(self, dp: int = 1, tp: int = 1) -> "RotaryFlashAttentionOp":
        """Splits the op by batch (``dp``) and heads (``tp``) on a (dp, tp) device matrix when it runs
        in a semi-auto parallel graph (Ascend): the Cell gets primitives of its own, forward and
        backward, carrying ``self_define_shard`` layouts (docs/semi_auto_parallel.md); elsewhere they
        run as the unsharded op. Global shapes must divide: dp the batch, tp the query and KV heads
        (checked at the call). Refused for BSH with tp > 1, TND with dp > 1, and the unfused path."""
        if self.backend_name == "unfused":
            raise ValueError(f"semi_auto_shard: the unfused path runs ({self.fallback_reason or 'backend=unfused'}); "
                             "only the fused op's primitives take layouts")
        self.sharded, _ = _make_fused(self.attrs, parallel=(dp, tp))
        self.parallel = (dp, tp)
        return self

    def construct(self, query, key, value, cos, sin, actual_seq_qlen=None, actual_seq_kvlen=None):
        attrs = self.attrs
        geometry = _geometry(query, key, value, cos, sin, actual_seq_qlen, actual_seq_kvlen, attrs)
        if self.sharded is None:
            return _attention(query, key, value, cos, sin, actual_seq_qlen, actual_seq_kvlen, geometry, attrs)
        _check_shard_shapes(attrs.input_layout, self.parallel, query.shape, key.shape, attrs.head_num)
        return _call_fused(self.sharded, query, key, value, cos, sin, actual_seq_qlen, actual_seq_kvlen,
                           attrs.with_softmax_lse)


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
                           strict=False):
    """RoPE(query), RoPE(key) and attention in one fused pass; returns the output in query's layout/dtype.

    See the semantics table in docs/semantics.md (generated from ``op_info``). With ``return_softmax_lse`` /
    ``return_rotated_key`` a tuple ``(out, lse?, rotated_key?)`` is returned. ``key_rotated=True``
    says key already carries RoPE (a KV cache of earlier ``rotated_key`` outputs): only query is
    rotated. Works eagerly, inside ``construct`` under GRAPH_MODE and inside ``@ms.jit``; eagerly,
    the TND offsets' values are checked here, inside a graph by the kernel when it launches.
    """
    _check_return_flags(return_softmax_lse, return_rotated_key)
    if actual_seq_qlen is not None and not isinstance(actual_seq_qlen, Tensor):
        actual_seq_qlen = _offsets_constant("actual_seq_qlen", actual_seq_qlen)
    if actual_seq_kvlen is not None and not isinstance(actual_seq_kvlen, Tensor):
        actual_seq_kvlen = _offsets_constant("actual_seq_kvlen", actual_seq_kvlen)
    attrs = OpAttrs(head_num, input_layout, rotary_mode, rotary_dim, scale, causal, return_softmax_lse,
                    return_rotated_key, key_rotated, backend, strict)
    geometry = _geometry(query, key, value, cos, sin, actual_seq_qlen, actual_seq_kvlen, attrs)
    if input_layout == "TND":
        _check_offsets_when_eager(_eager_marker, actual_seq_qlen, actual_seq_kvlen, query.shape[0], key.shape[0],
                                  cos.shape[0])
    out, lse, rotated_key = _attention(query, key, value, cos, sin, actual_seq_qlen, actual_seq_kvlen, geometry,
                                       attrs)
    if return_softmax_lse and return_rotated_key:
        return out, lse, rotated_key
    if return_softmax_lse:
        return out, lse
    if return_rotated_key:
        return out, rotated_key
    return out
