"""Llama2 in MindSpore on ``RotaryFlashAttention``: RMSNorm, SwiGLU, grouped-query attention, and a
KV cache that holds *rotated* keys.

Parameter names equal Hugging Face's (``model.layers.0.self_attn.q_proj.weight``, ...), so a
checkpoint maps onto ``parameters_dict()`` one to one. Two layouts:

- ``BSH`` (a batch of equal-length sequences): projections feed the op with no reshape at all.
- ``TND`` (variable-length batch, no padding): tokens of all sequences packed, with cumulative
  end offsets ``actual_seq_qlen`` / ``actual_seq_kvlen``.

Prefill rotates Q and K inside the fused op, which also returns the rotated K: that is what enters
the cache. A later step (decode, or a further chunk) rotates only its new keys, appends them, and
attends with ``key_rotated=True``: every key is rotated exactly once.
"""
from __future__ import annotations

import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops
from mindspore.common.initializer import Normal, initializer

from ms_rope_attention import RotaryFlashAttention
from ms_rope_attention.linear import linear_op
from ms_rope_attention.unfused import apply_rope

# Absolute imports: mindspore.rewrite (amp.auto_mixed_precision O1) regenerates this module's source
# outside the package, where relative imports fail.
from models.llama.config import LlamaConfig
from models.llama.rope_scaling import model_rope_tables

DTYPES = {"float32": ms.float32, "float16": ms.float16, "bfloat16": ms.bfloat16}
LAYOUTS = ("BSH", "TND")
PROJECTIONS = ("auto", "matmul")
IGNORE_INDEX = -100  # labels that take no part in the loss (as in Hugging Face)


def dtype_name(dtype) -> str:
    """'float32' | 'float16' | 'bfloat16' for a dtype given as that string or as a MindSpore dtype."""
    for name, ms_dtype in DTYPES.items():
        if dtype == name or dtype is ms_dtype or (not isinstance(dtype, str) and dtype == ms_dtype):
            return name
    raise ValueError(f"dtype: expected one of {list(DTYPES)} or the MindSpore dtypes "
                     f"ms.float32/ms.float16/ms.bfloat16, got {dtype!r}")


def check_device_dtype(dtype: str) -> None:
    """MindSpore 2.10 has no CPU kernels for bfloat16 Reshape, StridedSlice, Stack, Gather or MatMul,
    so a bfloat16 *model* cannot run on CPU (the fused attention op itself does take bfloat16)."""
    if dtype == "bfloat16" and ms.get_context("device_target") == "CPU":
        raise ValueError("dtype: 'bfloat16' needs a device with bfloat16 MatMul/Reshape/Gather kernels; "
                         "MindSpore 2.10's CPU backend has none: use 'float32' or 'float16' on CPU")


class Linear(nn.Cell):
    """y = x W^T, W stored (out, in) as in Hugging Face checkpoints; no bias (Llama has none).

    On the CPU, float32 activations go through OpenBLAS (``ms_rope_attention.linear``), faster there
    than MindSpore's MatMul; other devices and dtypes (amp's float16) take MatMul."""

    def __init__(self, in_features: int, out_features: int, dtype):
        super().__init__()
        self.weight = Parameter(initializer(Normal(0.02), (out_features, in_features), dtype), name="weight")
        self.in_features, self.out_features = in_features, out_features
        self.matmul = ops.MatMul(transpose_b=True)
        self.use_blas = ms.get_context("device_target") == "CPU"  # LlamaForCausalLM(projections="matmul") clears it
        self.blas = linear_op() if self.use_blas else None

    def construct(self, x):
        if self.use_blas and x.dtype == ms.float32 and self.weight.dtype == ms.float32:
            return self.blas(x, self.weight)
        # The static feature count (not -1) keeps the last dim static under dynamic batch/sequence
        # shapes, so the attention op still knows its head counts at compile time.
        # The weight in the activation's dtype: under mixed precision (amp O2/O3) activations are float16
        # while the master weights stay float32.
        y = self.matmul(x.reshape(-1, self.in_features), self.weight.astype(x.dtype))
        return y.reshape(x.shape[:-1] + (self.out_features,))


class Embedding(nn.Cell):
    def __init__(self, vocab_size: int, hidden_size: int, dtype):
        super().__init__()
        self.weight = Parameter(initializer(Normal(0.02), (vocab_size, hidden_size), dtype), name="weight")

    def construct(self, ids):
        return ops.gather(self.weight, ids, 0)


class RMSNorm(nn.Cell):
    """x / rms(x) * weight, the statistics in float32 whatever the activation dtype."""

    def __init__(self, hidden_size: int, eps: float, dtype):
        super().__init__()
        self.weight = Parameter(ops.ones((hidden_size,), dtype), name="weight")
        self.eps = eps

    def construct(self, x):
        # Both factors are expanded to x's shape first: MindSpore's CPU backend runs a broadcasting
        # multiply with several x-sized temporaries (measured at (4096, 4096): 0.65 GB for this norm
        # with broadcasting, about a third of that expanded).
        xf = x.astype(ms.float32)
        inverse_rms = ops.rsqrt((xf * xf).mean(-1, keep_dims=True) + self.eps)
        normed = (xf * inverse_rms.broadcast_to(xf.shape)).astype(x.dtype)
        return normed * self.weight.astype(x.dtype).broadcast_to(normed.shape)


class LlamaMLP(nn.Cell):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: LlamaConfig, dtype):
        super().__init__()
        self.gate_proj = Linear(config.hidden_size, config.intermediate_size, dtype)
        self.up_proj = Linear(config.hidden_size, config.intermediate_size, dtype)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, dtype)

    def construct(self, x):
        return self.down_proj(ops.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaAttention(nn.Cell):
    """Projections around the fused op; returns (output, keys, values) where keys/values are this
    layer's cache after the step (rotated keys)."""

    def __init__(self, config: LlamaConfig, cos_sin, layout: str, backend: str, dtype):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = (config.num_attention_heads, config.num_key_value_heads,
                                                    config.dim_per_head)
        self.q_proj = Linear(config.hidden_size, self.heads * self.head_dim, dtype)
        self.k_proj = Linear(config.hidden_size, self.kv_heads * self.head_dim, dtype)
        self.v_proj = Linear(config.hidden_size, self.kv_heads * self.head_dim, dtype)
        self.o_proj = Linear(self.heads * self.head_dim, config.hidden_size, dtype)
        self.layout = layout
        self.rotary_mode, self.rotary_dim = config.rotary_mode, config.rotary_dim
        self.cos, self.sin = cos_sin
        common = dict(head_num=self.heads, head_dim=self.head_dim, rotary_dim=self.rotary_dim,
                      rotary_mode=self.rotary_mode, input_layout=layout, backend=backend, cos_sin=cos_sin)
        self.prefill_attention = RotaryFlashAttention(return_rotated_key=True, **common)
        self.cached_attention = RotaryFlashAttention(key_rotated=True, **common)

    def _heads(self, x, heads):
        return x.reshape(x.shape[0], heads, self.head_dim) if self.layout == "TND" else x

    def construct(self, x, past_k, past_v, positions, cache_index, aq, akv):
        q = self._heads(self.q_proj(x), self.heads)
        k = self._heads(self.k_proj(x), self.kv_heads)
        v = self._heads(self.v_proj(x), self.kv_heads)
        if past_k is None:
            out, keys = self.prefill_attention(q, k, v, aq, akv)
            values = v
        else:
            keys = self._append(past_k, self._rotate_new_keys(k, positions), cache_index)
            values = self._append(past_v, v, cache_index)
            out = self.cached_attention(q, keys, values, aq, akv)
        if self.layout == "TND":
            out = out.reshape(out.shape[0], -1)
        return self.o_proj(out), keys, values

    def _rotate_new_keys(self, k, positions):
        """Standalone RoPE on the step's new keys only (a handful of rows), at their absolute positions."""
        kf = k.astype(ms.float32)
        if self.layout == "BSH":
            kf = kf.reshape(kf.shape[0], kf.shape[1], self.kv_heads, self.head_dim)
        c = ops.gather(self.cos.astype(ms.float32), positions, 0).expand_dims(-2)
        s = ops.gather(self.sin.astype(ms.float32), positions, 0).expand_dims(-2)
        rotated = apply_rope(kf, c, s, self.rotary_mode, self.rotary_dim)
        return rotated.reshape(k.shape).astype(k.dtype)

    def _append(self, past, new, cache_index):
        if self.layout == "BSH":
            return ops.concat((past, new), 1)
        return ops.gather(ops.concat((past, new), 0), cache_index, 0)


class LlamaDecoderLayer(nn.Cell):
    def __init__(self, config: LlamaConfig, cos_sin, layout, backend, dtype):
        super().__init__()
        self.self_attn = LlamaAttention(config, cos_sin, layout, backend, dtype)
        self.mlp = LlamaMLP(config, dtype)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def construct(self, x, past_k, past_v, positions, cache_index, aq, akv):
        attended, keys, values = self.self_attn(self.input_layernorm(x), past_k, past_v, positions, cache_index, aq,
                                                akv)
        x = x + attended
        return x + self.mlp(self.post_attention_layernorm(x)), keys, values


class LlamaModel(nn.Cell):
    def __init__(self, config: LlamaConfig, cos_sin, layout, backend, dtype):
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype)
        self.layers = nn.CellList([LlamaDecoderLayer(config, cos_sin, layout, backend, dtype)
                                   for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.num_layers = config.num_hidden_layers

    def construct(self, input_ids, past_keys, past_values, positions, cache_index, aq, akv):
        x = self.embed_tokens(input_ids)
        keys = ()
        values = ()
        for i in range(self.num_layers):
            past_k = None if past_keys is None else past_keys[i]
            past_v = None if past_values is None else past_values[i]
            x, k, v = self.layers[i](x, past_k, past_v, positions, cache_index, aq, akv)
            keys = keys + (k,)
            values = values + (v,)
        return self.norm(x), ops.stack(keys), ops.stack(values)


class LlamaForCausalLM(nn.Cell):
    """The causal LM. ``construct(input_ids, past_keys=None, past_values=None, positions=None,
    cache_index=None, actual_seq_qlen=None, actual_seq_kvlen=None)`` returns
    ``(logits float32, keys, values)``; keys/values are the whole cache after this step, stacked over
    layers: (L, B, S, Nkv*D) for BSH, (L, T, Nkv, D) for TND.

    - input_ids: (B, S) int32 for BSH; (T,) for TND with cumulative ends ``actual_seq_qlen`` of the
      new tokens and ``actual_seq_kvlen`` of the whole sequences (cache + new).
    - With a cache: ``positions`` gives each new token's absolute position ((S,) for BSH, (T,) for
      TND); for TND ``cache_index`` reorders concat(past, new) so each sequence's new rows follow
      its cached rows.
    - ``logits="last"`` computes logits only at each sequence's last new token (what generation
      needs; at 7B vocab and long prompts the full (S, vocab) logits would dominate the prefill).

    ``backend``: "auto" (fused where available, announced fallback otherwise), "fused" or "unfused",
    for the whole model, so both run on identical weights.

    ``projections``: "auto" (OpenBLAS for float32 on the CPU, MatMul otherwise) or "matmul" (MindSpore's
    MatMul everywhere: the benchmarks' A/B of the two GEMMs).
    """

    def __init__(self, config: LlamaConfig, *, dtype="float32", layout: str = "BSH", backend: str = "auto",
                 logits: str = "all", max_positions: int | None = None, projections: str = "auto"):
        super().__init__()
        dtype = dtype_name(dtype)
        if layout not in LAYOUTS:
            raise ValueError(f"layout: expected one of {list(LAYOUTS)}, got {layout!r}")
        if logits not in ("all", "last"):
            raise ValueError(f"logits: expected 'all' or 'last', got {logits!r}")
        if projections not in PROJECTIONS:
            raise ValueError(f"projections: expected one of {list(PROJECTIONS)}, got {projections!r}")
        check_device_dtype(dtype)
        self.config = config  # for Python callers; construct reads only the plain values below (GRAPH_MODE)
        self.hidden_size, self.vocab_size = config.hidden_size, config.vocab_size
        self.layout = layout
        self.max_positions = max_positions or config.max_position_embeddings
        ms_dtype = DTYPES[dtype]
        cos, sin = model_rope_tables(config, self.max_positions)
        cos_sin = (Tensor(cos), Tensor(sin))  # one pair for every layer
        self.model = LlamaModel(config, cos_sin, layout, backend, ms_dtype)
        self.tie_word_embeddings = config.tie_word_embeddings
        if not self.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, ms_dtype)
        self.matmul = ops.MatMul(transpose_b=True)
        self.last_only = logits == "last"
        if projections == "matmul":
            for _, cell in self.cells_and_names():
                if isinstance(cell, Linear):
                    cell.use_blas = False

    @property
    def backend(self) -> str:
        """The attention path every layer runs: 'fused:CPU' or 'unfused'."""
        return self.model.layers[0].self_attn.prefill_attention.backend

    def construct(self, input_ids, past_keys=None, past_values=None, positions=None, cache_index=None,
                  actual_seq_qlen=None, actual_seq_kvlen=None):
        hidden, keys, values = self.model(input_ids, past_keys, past_values, positions, cache_index, actual_seq_qlen,
                                          actual_seq_kvlen)
        if self.last_only:
            if self.layout == "TND":
                hidden = ops.gather(hidden, actual_seq_qlen - 1, 0)
            else:
                hidden = hidden[:, -1:, :]
        weight = self.model.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight
        logits = self.matmul(hidden.reshape(-1, self.hidden_size), weight.astype(hidden.dtype))
        return logits.astype(ms.float32).reshape(hidden.shape[:-1] + (self.vocab_size,)), keys, values


class LlamaForTraining(nn.Cell):
    """The training forward of a ``LlamaForCausalLM`` (built with ``logits="all"``): mean next-token
    cross-entropy in float32, no KV cache.

    ``construct(input_ids, labels, actual_seq_qlen=None)``: ``labels`` are aligned with
    ``input_ids`` (Hugging Face's convention: the logits at token i are scored against labels[i + 1]);
    ``IGNORE_INDEX`` marks labels that take no part. For a packed TND batch (input_ids (T,), cumulative
    ends ``actual_seq_qlen``) the first label of every sequence must be ``IGNORE_INDEX``, so no sequence
    is asked to predict the next one's start.
    """

    def __init__(self, lm: LlamaForCausalLM):
        super().__init__(auto_prefix=False)  # parameters keep their Hugging Face names
        self.lm = lm
        self.vocab_size = lm.vocab_size
        self.packed = lm.layout == "TND"
        self.ignore_index = IGNORE_INDEX  # an attribute: amp O1's rewrite drops module constants

    def construct(self, input_ids, labels, actual_seq_qlen=None):
        logits = self.lm(input_ids, None, None, None, None, actual_seq_qlen, actual_seq_qlen)[0]
        if self.packed:
            logits, labels = logits[:-1], labels[1:]
        else:
            logits, labels = logits[:, :-1], labels[:, 1:]
        return ops.cross_entropy(logits.reshape(-1, self.vocab_size), labels.reshape(-1).astype(ms.int32),
                                 ignore_index=self.ignore_index)
