"""The op's Cells: ``RotaryFlashAttentionOp`` (the op with fixed attributes, tables passed in) and
``RotaryFlashAttention``, the drop-in Cell that owns the shared cos/sin cache.

Give it un-rotated q/k/v; it rotates and attends in one fused pass. The cos/sin tables are built
once per (rotary_dim, max_position_embeddings, rope_theta, rotary_mode) and shared by every layer
and every batch in the process. Works in GRAPH_MODE (call ``set_dynamic_sequence_inputs`` or
``set_inputs`` with ``None`` dims to compile once for all sequence lengths) and in PyNative.
"""
from __future__ import annotations

from mindspore import Tensor, nn, ops

from . import checks, dispatch
from .attrs import OpAttrs
from .functional import attend, autodiff_forwards, backend_for, call_fused, checked_geometry, requested_outputs
from .layouts import check_shard_shapes
from .rope import shared_rope_tables


@ops.constexpr(check=False)
def _check_shard_shapes(input_layout, parallel, query_shape, key_shape, head_num):
    """The (dp, tp) split's divisibility on the global shapes: a graph's are global when it compiles
    (dynamic dimensions, unknown then, are skipped as in the argument checks)."""
    check_shard_shapes(input_layout, *parallel, query_shape, key_shape, head_num)
    return True


class RotaryFlashAttentionOp(nn.Cell):
    """The op with fixed attributes; ``construct(query, key, value, cos, sin, actual_seq_qlen=None,
    actual_seq_kvlen=None)`` returns ``(attention_out, softmax_lse, rotated_key)`` (disabled
    outputs are empty). ``backend_name`` tells which backend runs, ``arithmetic(dtype)`` in what
    it computes for inputs of that dtype."""

    fused_site = True  # fuse() leaves it alone: it already runs the fused op

    def __init__(self, head_num=None, input_layout="BNSD", rotary_mode=0, rotary_dim=None, scale=None, causal=True,
                 with_softmax_lse=False, with_rotated_key=False, backend="auto", strict=False, key_rotated=False,
                 compute_dtype="auto"):
        super().__init__()
        self.attrs = OpAttrs(head_num=head_num, input_layout=input_layout, rotary_mode=rotary_mode,
                             rotary_dim=rotary_dim, scale=scale, causal=causal, with_softmax_lse=with_softmax_lse,
                             with_rotated_key=with_rotated_key, key_rotated=key_rotated, compute_dtype=compute_dtype,
                             backend=backend, strict=strict)
        chosen = backend_for(self.attrs)
        self.backend_name, self.fallback_reason = chosen.name, chosen.fallback_reason
        self.parallel, self.sharded = None, None

    def arithmetic(self, input_dtype) -> str:
        """What Q·Kᵀ and P·V compute in for inputs of ``input_dtype`` (a name or a mindspore dtype):
        'float32' or 'bfloat16' (``dispatch.arithmetic``)."""
        return dispatch.arithmetic(backend_for(self.attrs), self.attrs, checks.dtype_name(input_dtype))

    def semi_auto_shard(self, dp: int = 1, tp: int = 1) -> "RotaryFlashAttentionOp":
        """Splits the op by batch (``dp``) and heads (``tp``) on a (dp, tp) device matrix when it runs
        in a semi-auto parallel graph (Ascend): the Cell gets primitives of its own, forward and
        backward, carrying ``self_define_shard`` layouts (docs/semi_auto_parallel.md); elsewhere they
        run as the unsharded op. Global shapes must divide: dp the batch, tp the query and KV heads
        (checked at the call). Refused for BSH with tp > 1, TND with dp > 1, and the unfused path."""
        if self.backend_name == "unfused":
            raise ValueError(f"semi_auto_shard: the unfused path runs ({self.fallback_reason or 'backend=unfused'}); "
                             "only the fused op's primitives take layouts")
        kernel, _ = dispatch.make_kernel(self.attrs, autodiff_forwards, parallel=(dp, tp))
        self.sharded, self.parallel = kernel.forward, (dp, tp)
        return self

    def construct(self, query, key, value, cos, sin, actual_seq_qlen=None, actual_seq_kvlen=None):
        attrs = self.attrs
        geometry = checked_geometry(query, key, value, cos, sin, actual_seq_qlen, actual_seq_kvlen, attrs)
        if self.sharded is None:
            return attend(query, key, value, cos, sin, actual_seq_qlen, actual_seq_kvlen, geometry, attrs)
        _check_shard_shapes(attrs.input_layout, self.parallel, query.shape, key.shape, attrs.head_num)
        return call_fused(self.sharded, query, key, value, cos, sin, actual_seq_qlen, actual_seq_kvlen,
                          attrs.with_softmax_lse)


class RotaryFlashAttention(nn.Cell):
    """Fused RoPE + FlashAttention with Llama2 defaults (theta 10000, 4096 positions, rotate-half).

    ``construct(query, key, value, actual_seq_qlen=None, actual_seq_kvlen=None)`` returns the
    attention output in query's layout and dtype, or a tuple ``(out, lse?, rotated_key?)`` when
    ``return_softmax_lse`` / ``return_rotated_key`` are set. ``backend`` says which path runs.
    ``key_rotated=True`` is for decoding against a KV cache of rotated keys: only query is rotated.
    ``compute_dtype`` ('auto', 'float32' or 'bfloat16': the contract's rule) is the arithmetic of
    Q·Kᵀ and P·V; ``arithmetic(dtype)`` says what it resolves to for inputs of that dtype.
    """

    fused_site = True

    def __init__(self, head_num: int, head_dim: int, *, rotary_dim: int | None = None, rope_theta: float = 10000.0,
                 max_position_embeddings: int = 4096, rotary_mode: int = 0, input_layout: str = "BNSD",
                 scale: float | None = None, causal: bool = True, return_softmax_lse: bool = False,
                 return_rotated_key: bool = False, key_rotated: bool = False, backend: str = "auto",
                 strict: bool = False, cos_sin: tuple[Tensor, Tensor] | None = None, compute_dtype: str = "auto"):
        super().__init__()
        if not isinstance(head_dim, int) or head_dim < 2 or head_dim % 2:
            raise ValueError(f"head_dim: expected a positive even int, got {head_dim!r}")
        rd = rotary_dim if rotary_dim is not None else head_dim
        checks.check_attrs(OpAttrs(head_num=head_num, input_layout=input_layout, rotary_mode=rotary_mode,
                                   rotary_dim=rd, scale=scale, causal=causal))
        if rd > head_dim:
            raise ValueError(f"rotary_dim: {rd} exceeds head_dim {head_dim}")
        self.head_num = head_num
        self.head_dim = head_dim
        self.return_softmax_lse = return_softmax_lse
        self.return_rotated_key = return_rotated_key
        if cos_sin is None:
            cos_sin = shared_rope_tables(rd, max_position_embeddings, float(rope_theta), rotary_mode)
        self.cos, self.sin = cos_sin
        self.op = RotaryFlashAttentionOp(head_num=head_num, input_layout=input_layout, rotary_mode=rotary_mode,
                                         rotary_dim=rd, scale=scale, causal=causal,
                                         with_softmax_lse=return_softmax_lse, with_rotated_key=return_rotated_key,
                                         backend=backend, strict=strict, key_rotated=key_rotated,
                                         compute_dtype=compute_dtype)

    @property
    def backend(self) -> str:
        """'fused:CPU', 'fused:Ascend' or 'unfused': the path this Cell runs."""
        return self.op.backend_name

    @property
    def compute_dtype(self) -> str:
        """The compute_dtype setting: 'auto', 'float32' or 'bfloat16'."""
        return self.op.attrs.compute_dtype

    def arithmetic(self, input_dtype) -> str:
        """What Q·Kᵀ and P·V compute in for inputs of ``input_dtype``: 'float32' or 'bfloat16'."""
        return self.op.arithmetic(input_dtype)

    def construct(self, query, key, value, actual_seq_qlen=None, actual_seq_kvlen=None):
        out, lse, rotated_key = self.op(query, key, value, self.cos, self.sin, actual_seq_qlen, actual_seq_kvlen)
        return requested_outputs(out, lse, rotated_key, self.return_softmax_lse, self.return_rotated_key)
