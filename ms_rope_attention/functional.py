"""``rotary_flash_attention``: the functional op, and the backend dispatch behind it.

``RotaryFlashAttentionOp`` fixes the attributes, picks a backend once (at construction, where the
device is known) and is usable in GRAPH_MODE and PyNative. The fused kernel is preferred; a
fallback to the unfused path is never silent: it logs a one-time warning containing
``rotary_fusion_fallback`` and the reason, and ``strict=True`` raises instead.
"""
from __future__ import annotations

import logging

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops

from . import checks
from .gradients import RotaryFusionFallbackError, announce_fallback
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


@ops.constexpr
def _check_call(q_shape, k_shape, v_shape, cos_shape, sin_shape, q_dtype, k_dtype, v_dtype, cos_dtype, sin_dtype,
                head_num, input_layout, rotary_mode, rotary_dim, scale, causal, aq_meta, akv_meta):
    """Compile-time (GRAPH_MODE) or eager (PyNative) argument check; returns the static geometry."""
    geo = checks.check_inputs(q_shape, k_shape, v_shape, cos_shape, sin_shape, q_dtype, k_dtype, v_dtype, cos_dtype,
                              sin_dtype, head_num, input_layout, rotary_mode, rotary_dim, scale, causal, aq_meta,
                              akv_meta)
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


class RotaryFlashAttentionOp(nn.Cell):
    """The op with fixed attributes; ``construct(query, key, value, cos, sin, actual_seq_qlen=None,
    actual_seq_kvlen=None)`` returns ``(attention_out, softmax_lse, rotated_key)`` (disabled
    outputs are empty). ``backend_name`` tells which backend runs."""

    def __init__(self, head_num=None, input_layout="BNSD", rotary_mode=0, rotary_dim=None, scale=None, causal=True,
                 with_softmax_lse=False, with_rotated_key=False, backend="auto", strict=False, key_rotated=False):
        super().__init__()
        checks.check_attrs(head_num, input_layout, rotary_mode, rotary_dim, scale, causal)
        if backend not in BACKENDS:
            raise ValueError(f"backend: expected one of {list(BACKENDS)}, got {backend!r}")
        self.head_num = head_num
        self.input_layout = input_layout
        self.rotary_mode = rotary_mode
        self.rotary_dim = rotary_dim
        self.scale = scale
        self.causal = causal
        checks.check_flags(with_softmax_lse=with_softmax_lse, with_rotated_key=with_rotated_key,
                           key_rotated=key_rotated, strict=strict)
        self.with_softmax_lse = with_softmax_lse
        self.with_rotated_key = with_rotated_key
        self.key_rotated = key_rotated
        self.fused = None
        self.fallback_reason = None
        if backend != "unfused":
            factory, reason = _fused_factory(_device())
            if factory is None:
                announce_fallback(reason, strict or backend == "fused")
                self.fallback_reason = reason
            else:
                # The fused forward always emits softmax_lse: the backward needs it (a few bytes per
                # row); the Cell returns an empty lse when it was not asked for.
                self.fused = factory({
                    "head_num": head_num or 0, "input_layout": input_layout, "rotary_mode": rotary_mode,
                    "rotary_dim": rotary_dim or 0, "scale": float(scale or 0.0), "causal": causal,
                    "with_softmax_lse": True, "with_rotated_key": self.with_rotated_key,
                    "key_rotated": key_rotated}, (self.with_softmax_lse, self.with_rotated_key), self.unfused,
                    strict or backend == "fused")
        self.use_fused = self.fused is not None
        self.backend_name = f"fused:{_device()}" if self.use_fused else "unfused"

    def construct(self, query, key, value, cos, sin, actual_seq_qlen=None, actual_seq_kvlen=None):
        geometry = self._geometry(query, key, value, cos, sin, actual_seq_qlen, actual_seq_kvlen)
        return self.run_checked(query, key, value, cos, sin, actual_seq_qlen, actual_seq_kvlen, geometry)

    def run_checked(self, query, key, value, cos, sin, actual_seq_qlen, actual_seq_kvlen, geometry):
        """The op on arguments ``_geometry`` has checked (it returned ``geometry``): the functional op
        checks once, the offsets' values too, then calls this."""
        if not self.use_fused:
            return self._unfused(query, key, value, cos, sin, actual_seq_qlen, actual_seq_kvlen, geometry)
        out, lse, rotated_key = self.fused(query, key, value, self._table(cos), self._table(sin), actual_seq_qlen,
                                           actual_seq_kvlen)
        if not self.with_softmax_lse:
            lse = _EMPTY_LSE
        return out, lse, rotated_key

    def _geometry(self, query, key, value, cos, sin, actual_seq_qlen, actual_seq_kvlen):
        """The static argument check of one call; returns (q_heads, kv_heads, head_dim, rotary_dim, scale)."""
        return _check_call(
            query.shape, key.shape, value.shape, cos.shape, sin.shape, query.dtype, key.dtype, value.dtype, cos.dtype,
            sin.dtype, self.head_num, self.input_layout, self.rotary_mode, self.rotary_dim, self.scale, self.causal,
            None if actual_seq_qlen is None else (actual_seq_qlen.dtype, actual_seq_qlen.ndim),
            None if actual_seq_kvlen is None else (actual_seq_kvlen.dtype, actual_seq_kvlen.ndim))

    def _table(self, table):
        return table.astype(ms.float32) if _table_needs_cast(table.dtype) else table

    def unfused(self, query, key, value, cos, sin, actual_seq_qlen=None, actual_seq_kvlen=None):
        """The unfused path with this op's attributes: the gradient of a fused forward on a device
        without a fused backward is its autodiff."""
        return self._unfused(query, key, value, cos, sin, actual_seq_qlen, actual_seq_kvlen,
                             self._geometry(query, key, value, cos, sin, actual_seq_qlen, actual_seq_kvlen))

    def _unfused(self, query, key, value, cos, sin, actual_seq_qlen, actual_seq_kvlen, geometry):
        q_heads, kv_heads, head_dim, rotary_dim, scale = geometry
        _require_static(q_heads, kv_heads, head_dim)
        cos, sin = self._table(cos), self._table(sin)
        return unfused_rotary_flash_attention(
            query, key, value, cos, sin, actual_seq_qlen, actual_seq_kvlen, head_num=q_heads, kv_head_num=kv_heads,
            head_dim=head_dim, input_layout=self.input_layout, rotary_mode=self.rotary_mode, rotary_dim=rotary_dim,
            scale=scale, causal=self.causal, with_softmax_lse=self.with_softmax_lse,
            with_rotated_key=self.with_rotated_key, key_rotated=self.key_rotated)


_ops_cache: dict = {}


def _as_offsets(name, value):
    """Offsets given as a Python or numpy sequence of integers become an int64 Tensor; anything else
    (floats, which would be truncated, bools, strings) is refused."""
    if value is None or isinstance(value, Tensor):
        return value
    try:
        items = list(np.asarray(value, dtype=object).reshape(-1)) if not isinstance(value, (str, bytes)) else None
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

    See the README's semantics table (generated from ``op_info``). With ``return_softmax_lse`` /
    ``return_rotated_key`` a tuple ``(out, lse?, rotated_key?)`` is returned. ``key_rotated=True``
    says key already carries RoPE (a KV cache of earlier ``rotated_key`` outputs): only query is rotated. For PyNative use; in
    GRAPH_MODE hold a ``RotaryFlashAttentionOp`` or ``RotaryFlashAttention`` Cell instead.
    """
    for name, tensor in (("query", query), ("key", key), ("value", value), ("cos", cos), ("sin", sin)):
        if not isinstance(tensor, Tensor):
            raise TypeError(f"{name}: expected a mindspore Tensor, got {type(tensor).__name__}")
    actual_seq_qlen = _as_offsets("actual_seq_qlen", actual_seq_qlen)
    actual_seq_kvlen = _as_offsets("actual_seq_kvlen", actual_seq_kvlen)
    # Keyed by type and value (1 == True == 1.0, but they are not the same argument): the attributes
    # are validated once, when their op is built.
    key_attrs = tuple((type(a).__name__, a) for a in (head_num, input_layout, rotary_mode, rotary_dim, scale, causal,
                                                      return_softmax_lse, return_rotated_key, key_rotated, backend,
                                                      strict)) + (_device(),)
    op = _ops_cache.get(key_attrs)
    if op is None:
        checks.check_flags(return_softmax_lse=return_softmax_lse, return_rotated_key=return_rotated_key)
        op = RotaryFlashAttentionOp(head_num, input_layout, rotary_mode, rotary_dim, scale, causal,
                                    return_softmax_lse, return_rotated_key, backend, strict, key_rotated)
        _ops_cache[key_attrs] = op
    # One check per call: the static one (shapes, dtypes, ranks), then the offsets' values.
    geometry = op._geometry(query, key, value, cos, sin, actual_seq_qlen, actual_seq_kvlen)
    if input_layout == "TND":
        checks.check_actual_seq(actual_seq_qlen.asnumpy(), actual_seq_kvlen.asnumpy(), query.shape[0], key.shape[0],
                                cos.shape[0])
    out, lse, rotated_key = op.run_checked(query, key, value, cos, sin, actual_seq_qlen, actual_seq_kvlen, geometry)
    extra = ((lse,) if return_softmax_lse else ()) + ((rotated_key,) if return_rotated_key else ())
    return (out,) + extra if extra else out
