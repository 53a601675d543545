"""``RotaryFlashAttention``: the drop-in Cell that owns the shared cos/sin cache.

Give it un-rotated q/k/v; it rotates and attends in one fused pass. The cos/sin tables are built
once per (rotary_dim, max_position_embeddings, rope_theta, rotary_mode) and shared by every layer
and every batch in the process. Works in GRAPH_MODE (call ``set_dynamic_sequence_inputs`` or
``set_inputs`` with ``None`` dims to compile once for all sequence lengths) and in PyNative.
"""
from __future__ import annotations

from mindspore import Tensor, nn

from . import checks
from .functional import RotaryFlashAttentionOp
from .rope import shared_rope_tables


class RotaryFlashAttention(nn.Cell):
    """Fused RoPE + FlashAttention with Llama2 defaults (theta 10000, 4096 positions, rotate-half).

    ``construct(query, key, value, actual_seq_qlen=None, actual_seq_kvlen=None)`` returns the
    attention output in query's layout and dtype, or a tuple ``(out, lse?, rotated_key?)`` when
    ``return_softmax_lse`` / ``return_rotated_key`` are set. ``backend`` says which path runs.
    ``key_rotated=True`` is for decoding against a KV cache of rotated keys: only query is rotated.
    """

    def __init__(self, head_num: int, head_dim: int, *, rotary_dim: int | None = None, rope_theta: float = 10000.0,
                 max_position_embeddings: int = 4096, rotary_mode: int = 0, input_layout: str = "BNSD",
                 scale: float | None = None, causal: bool = True, return_softmax_lse: bool = False,
                 return_rotated_key: bool = False, key_rotated: bool = False, backend: str = "auto",
                 strict: bool = False, cos_sin: tuple[Tensor, Tensor] | None = None):
        super().__init__()
        if not isinstance(head_dim, int) or head_dim < 2 or head_dim % 2:
            raise ValueError(f"head_dim: expected a positive even int, got {head_dim!r}")
        rd = rotary_dim if rotary_dim is not None else head_dim
        checks.check_attrs(head_num, input_layout, rotary_mode, rd, scale, causal)
        if rd > head_dim:
            raise ValueError(f"rotary_dim: {rd} exceeds head_dim {head_dim}")
        self.head_num = head_num
        self.head_dim = head_dim
        self.return_softmax_lse = return_softmax_lse
        self.return_rotated_key = return_rotated_key
        if cos_sin is None:
            cos_sin = shared_rope_tables(rd, max_position_embeddings, float(rope_theta), rotary_mode)
        self.cos, self.sin = cos_sin
        self.op = RotaryFlashAttentionOp(head_num, input_layout, rotary_mode, rd, scale, causal,
                                         return_softmax_lse, return_rotated_key, backend, strict, key_rotated)

    @property
    def backend(self) -> str:
        """'fused:CPU', 'fused:Ascend' or 'unfused': the path this Cell runs."""
        return self.op.backend_name

    def construct(self, query, key, value, actual_seq_qlen=None, actual_seq_kvlen=None):
        out, lse, rotated_key = self.op(query, key, value, self.cos, self.sin, actual_seq_qlen, actual_seq_kvlen)
        if self.return_softmax_lse and self.return_rotated_key:
            return out, lse, rotated_key
        if self.return_softmax_lse:
            return out, lse
        if self.return_rotated_key:
            return out, rotated_key
        return out
