"""Llama2 in MindSpore on ``RotaryFlashAttention``: RMSNorm, SwiGLU, grouped-query attention, and an
in-place KV cache (``engine.kv_cache``) that holds *rotated* keys.

Parameter names equal Hugging Face's (``model.layers.0.self_attn.q_proj.weight``, ...), so a
checkpoint maps onto ``parameters_dict()`` one to one. Two layouts:

- ``BSH`` (a batch of equal-length sequences): projections feed the op with no reshape at all.
- ``TND`` (variable-length batch, no padding): tokens of all sequences packed, with cumulative
  end offsets ``actual_seq_qlen`` / ``actual_seq_kvlen``.

Prefill rotates Q and K inside the fused op, which also returns the rotated K: that is what is
written to the cache. A decode step rotates only its new keys, writes them in place, and attends
over the cache with ``key_rotated=True``: every key is rotated exactly once.
"""
from __future__ import annotations

import mindspore as ms
from mindspore import Tensor, nn, ops

from ms_rope_attention import (COMPUTE_DTYPES, RotaryFlashAttention, apply_rope, linear_op, resolve_compute_dtype,
                               rotary_cache_write, rotary_paged_attention, swiglu_op)

# Absolute imports: mindspore.rewrite (amp.auto_mixed_precision O1) regenerates this module's source
# outside the package, where relative imports fail.
from models.llama.cache_views import CacheView, ContiguousDecode, ContiguousPrefill, PagedDecode, PagedPrefill
from models.llama.config import LlamaConfig
from models.llama.layers import Embedding, Linear, Precision, RMSNorm
from models.llama.rope_scaling import model_rope_tables
from models.llama.tensor_parallel import TensorParallel

DTYPES = {"float32": ms.float32, "float16": ms.float16, "bfloat16": ms.bfloat16}
MODEL_LAYOUTS = ("BSH", "TND")  # the op takes four; the model feeds it two
PROJECTIONS = ("auto", "matmul")


def dtype_name(dtype) -> str:
    """'float32' | 'float16' | 'bfloat16' for a dtype given as that string or as a MindSpore dtype."""
    for name, ms_dtype in DTYPES.items():
        if dtype == name or dtype is ms_dtype or (not isinstance(dtype, str) and dtype == ms_dtype):
            return name
    raise ValueError(f"dtype: expected one of {list(DTYPES)} or the MindSpore dtypes "
                     f"ms.float32/ms.float16/ms.bfloat16, got {dtype!r}")


def check_device_dtype(dtype: str) -> None:
    """MindSpore 2.10 has no CPU kernels for bfloat16 Reshape, StridedSlice, Stack, Gather or MatMul,
    so bfloat16 *activations* cannot run on CPU (the fused attention op itself does take bfloat16);
    bfloat16 *weights* can, since the projection and embedding ops convert them."""
    if dtype == "bfloat16" and ms.get_context("device_target") == "CPU":
        raise ValueError("dtype: 'bfloat16' activations need a device with bfloat16 MatMul/Reshape/Gather kernels; "
                         "MindSpore 2.10's CPU backend has none: on CPU keep dtype='float32' (or 'float16') and "
                         "weight_dtype='bfloat16' to hold a bfloat16 checkpoint in its own precision")


def model_compute_dtype(requested: str, weight_dtype: str, dtype: str) -> str:
    """The model's arithmetic (``LlamaForCausalLM(compute_dtype=...)``) for its weights' and
    activations' dtypes: half arithmetic is what the CPU ops do with float32 activations; elsewhere
    (another device, amp's float16 activations) the model computes in its activations' dtype, and only
    "auto" or "float32" are accepted."""
    if ms.get_context("device_target") == "CPU" and dtype == "float32":
        return resolve_compute_dtype(requested, weight_dtype)
    if requested not in COMPUTE_DTYPES:
        resolve_compute_dtype(requested, weight_dtype)  # refuses it by name
    if requested not in ("auto", "float32"):
        raise ValueError(f"compute_dtype: {requested!r} is the arithmetic of the CPU ops with float32 activations; "
                         f"this model runs on {ms.get_context('device_target')} with {dtype} activations: use 'auto'")
    return "float32"


class _Identity(nn.Cell):
    def construct(self, x):
        return x


def _tensor_parallel_pair(tp):
    """Megatron's (f, g) for a block of a tensor-parallel model; identities on one process."""
    if tp is None:
        return _Identity(), _Identity()
    from ms_rope_attention.distributed import CopyToTensorParallel, ReduceFromTensorParallel
    return CopyToTensorParallel(tp.rank, tp.size, tp.group), ReduceFromTensorParallel(tp.rank, tp.size, tp.group)


def _replica_gradient_sum(tp):
    """Megatron's "f" over the ranks that share a replicated KV head (None when heads are split):
    applied to the k/v weights, it sums their gradients, each rank's covering its own query heads."""
    if tp is None or tp.kv_share is None:
        return None
    from ms_rope_attention.distributed import CopyToTensorParallel
    share = tp.kv_share
    return CopyToTensorParallel(share.rank, share.size, share.group)


class LlamaMLP(nn.Cell):
    """SwiGLU: down(silu(gate(x)) * up(x)); with ``tp`` the rank's share of the features, between
    Megatron's f and g.

    Computing in bfloat16 on the CPU (one process), gate, up and SwiGLU are one op (``swiglu_op``) on
    the two Linear cells' weights: x rounded to bfloat16 once for both products, and the epilogue as
    oneDNN's post-ops of the gate product, instead of two projections and MindSpore's Sigmoid, Mul and
    Mul. The cells and their parameters stay (Hugging Face's names); ``pack()`` packs both weights and
    switches the op to them. ``fused`` says whether the op runs. Float32 arithmetic, other devices and
    the tensor-parallel MLP (not yet tested with bfloat16 arithmetic) keep the separate ops."""

    def __init__(self, config: LlamaConfig, precision: Precision, tp=None):
        super().__init__()
        features = config.intermediate_size // tp.size if tp else config.intermediate_size
        self.gate_proj = Linear(config.hidden_size, features, precision)
        self.up_proj = Linear(config.hidden_size, features, precision)
        self.down_proj = Linear(features, config.hidden_size, precision)
        self.f, self.g = _tensor_parallel_pair(tp)
        self.fused = self.gate_proj.use_blas and precision.compute == "bfloat16" and tp is None
        self.swiglu = swiglu_op(compute_dtype="bfloat16") if self.fused else None

    def pack(self) -> None:
        """Both weights packed for oneDNN (``Linear.pack``), and the op switched to them."""
        self.gate_proj.pack()
        self.up_proj.pack()
        if self.fused and self.gate_proj.packed and self.up_proj.packed:
            self.swiglu = swiglu_op(compute_dtype="bfloat16", packed_out_features=self.gate_proj.out_features)

    def construct(self, x):
        x = self.f(x)
        if self.fused and x.dtype == ms.float32:
            hidden = self.swiglu(x, self.gate_proj.weight, self.up_proj.weight)
        else:
            hidden = ops.silu(self.gate_proj(x)) * self.up_proj(x)
        return self.g(self.down_proj(hidden))


class LlamaAttention(nn.Cell):
    """Projections around the fused op.

    ``cache`` is None (a plain forward in the model's layout) or this layer's view of a step over a
    KV cache (``cache_views``: one class and one method here per attention variant). With a cache
    the tokens are packed (TND) whatever the model's layout, and every key is rotated exactly once:
    a prefill's by the fused op, which returns them, a decode step's alone at their positions. No
    step copies the cache."""

    fused_site = True  # fuse() leaves it alone: it already runs the fused op

    def __init__(self, config: LlamaConfig, cos_sin, layout: str, backend: str, precision: Precision, cp=None,
                 tp=None):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = (config.num_attention_heads, config.num_key_value_heads,
                                                    config.dim_per_head)
        if tp:  # the rank's heads (Megatron: q/k/v column-parallel, o row-parallel)
            self.heads, self.kv_heads = tp.heads(config), tp.kv_heads(config)
        self.f, self.g = _tensor_parallel_pair(tp)
        self.q_proj = Linear(config.hidden_size, self.heads * self.head_dim, precision)
        self.k_proj = Linear(config.hidden_size, self.kv_heads * self.head_dim, precision, _replica_gradient_sum(tp))
        self.v_proj = Linear(config.hidden_size, self.kv_heads * self.head_dim, precision, _replica_gradient_sum(tp))
        self.o_proj = Linear(self.heads * self.head_dim, config.hidden_size, precision)
        self.layout = layout
        self.rotary_mode, self.rotary_dim = config.rotary_mode, config.rotary_dim
        self.cos, self.sin = cos_sin
        common = dict(head_num=self.heads, head_dim=self.head_dim, rotary_dim=self.rotary_dim,
                      rotary_mode=self.rotary_mode, backend=backend, cos_sin=cos_sin,
                      compute_dtype=precision.compute)
        self.compute_dtype = precision.compute
        self.prefill_attention = RotaryFlashAttention(input_layout=layout, **common)
        self.cache_prefill = RotaryFlashAttention(input_layout="TND", return_rotated_key=True, **common)
        self.cached_attention = RotaryFlashAttention(input_layout="TND", key_rotated=True, **common)
        self.write = ops.ScatterUpdate()
        self.context_parallel = cp is not None
        if cp is not None:  # the rank's part of every sequence (load-balanced chunks), K/V gathered
            from ms_rope_attention.distributed import ContextParallelRotaryAttention
            self.cp_attention = ContextParallelRotaryAttention(self.heads, rotary_mode=self.rotary_mode,
                                                               rotary_dim=self.rotary_dim, group=cp.group,
                                                               rank=cp.rank, size=cp.size)

    def _heads(self, x, heads):
        return x.reshape(x.shape[0], heads, self.head_dim)

    def construct(self, x, aq, akv, cache):
        x = self.f(x)
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if cache is None and self.context_parallel:
            b, s = q.shape[0], q.shape[1]
            out = self.cp_attention(q.reshape(b, s, self.heads, self.head_dim),
                                    k.reshape(b, s, self.kv_heads, self.head_dim),
                                    v.reshape(b, s, self.kv_heads, self.head_dim), self.cos, self.sin)
            return self.g(self.o_proj(out.reshape(b, s, -1)))
        if cache is None and self.layout == "BSH":
            return self.g(self.o_proj(self.prefill_attention(q, k, v)))
        q, k, v = self._heads(q, self.heads), self._heads(k, self.kv_heads), self._heads(v, self.kv_heads)
        if cache is None:
            out = self.prefill_attention(q, k, v, aq, akv)
        elif CacheView.variant(cache) is ContiguousPrefill:
            out = self.contiguous_prefill(q, k, v, aq, cache)
        elif CacheView.variant(cache) is ContiguousDecode:
            out = self.contiguous_decode(q, k, v, aq, akv, cache)
        elif CacheView.variant(cache) is PagedPrefill:
            out = self.paged_prefill(q, k, v, aq, akv, cache)
        elif CacheView.variant(cache) is PagedDecode:
            out = self.paged_decode(q, k, v, cache)
        else:
            raise TypeError("cache: a view of models.llama.cache_views with a method of LlamaAttention")
        return self.g(self.o_proj(out.reshape(out.shape[0], -1)))

    def contiguous_prefill(self, q, k, v, ends, view):
        out, keys = self.cache_prefill(q, k, v, ends, ends)
        self._write(view, ContiguousPrefill.rows(view), keys, v)
        return out

    def contiguous_decode(self, q, k, v, aq, akv, view):
        self._write(view, ContiguousDecode.rows(view), self._rotate_new_keys(k, ContiguousDecode.positions(view)), v)
        # A cache in another dtype than the activations (a float16 cache of a float32 model: half the bytes
        # to read) meets a query of its own dtype, as the op requires; it accumulates in float32 either way.
        keys, values = CacheView.keys(view), CacheView.values(view)
        return self.cached_attention(q.astype(keys.dtype), keys, values, aq, akv).astype(q.dtype)

    def paged_prefill(self, q, k, v, aq, akv, view):
        key_cache, value_cache = self._write_paged(k, v, PagedPrefill.positions(view), PagedPrefill.slots(view),
                                                   CacheView.keys(view), CacheView.values(view))
        # The step's blocks gathered whole along the cache's first axis, then each key's row among them.
        # Not GatherNd over (block, offset) pairs: MindSpore 2.10's CPU kernel copied 1035 rows of 32 x 128
        # float16 in 28-37 ms (an axis-0 gather: 1-2 ms); nor the cache reshaped to rows: that copied it whole.
        blocks, context = PagedPrefill.blocks(view), PagedPrefill.context(view)
        rows = (-1,) + key_cache.shape[2:]
        keys = ops.gather(ops.gather(key_cache, blocks, 0).reshape(rows), context, 0)
        values = ops.gather(ops.gather(value_cache, blocks, 0).reshape(rows), context, 0)
        query = q.astype(key_cache.dtype)  # the op's dtype rule; it accumulates in float32 either way
        return self.cached_attention(query, keys, values, aq, akv).astype(q.dtype)

    def paged_decode(self, q, k, v, view):
        key_cache, value_cache = self._write_paged(k, v, PagedDecode.positions(view), PagedDecode.slots(view),
                                                   CacheView.keys(view), CacheView.values(view))
        return rotary_paged_attention(q.astype(key_cache.dtype), key_cache, value_cache, self.cos, self.sin,
                                      PagedDecode.block_tables(view), PagedDecode.context_lens(view),
                                      PagedDecode.q_seq_lens(view), head_num=self.heads, rotary_mode=self.rotary_mode,
                                      rotary_dim=self.rotary_dim, compute_dtype=self.compute_dtype).astype(q.dtype)

    def _write(self, view, rows, keys, values):
        """A contiguous cache's rows written in place: rotated keys and values, in the cache's dtype."""
        cache_keys, cache_values = CacheView.keys(view), CacheView.values(view)
        self.write(cache_keys, rows, keys.astype(cache_keys.dtype))
        self.write(cache_values, rows, values.astype(cache_values.dtype))

    def _write_paged(self, k, v, positions, slots, key_cache, value_cache):
        """The new keys rotated once and written with the values at their slots (one pass); the
        caches returned depend on the write, so that what reads them next sees it."""
        written = rotary_cache_write(k, v, self.cos, self.sin, positions, slots, key_cache, value_cache,
                                     rotary_mode=self.rotary_mode, rotary_dim=self.rotary_dim)
        return ops.depend(key_cache, written), ops.depend(value_cache, written)

    def _rotate_new_keys(self, k, positions):
        """Standalone RoPE on the step's new keys only (one row per sequence), at their positions."""
        kf = k.astype(ms.float32)
        c = ops.gather(self.cos.astype(ms.float32), positions, 0).expand_dims(-2)
        s = ops.gather(self.sin.astype(ms.float32), positions, 0).expand_dims(-2)
        return apply_rope(kf, c, s, self.rotary_mode, self.rotary_dim).astype(k.dtype)


class LlamaDecoderLayer(nn.Cell):
    def __init__(self, config: LlamaConfig, cos_sin, layout, backend, precision: Precision, cp=None, tp=None):
        super().__init__()
        self.self_attn = LlamaAttention(config, cos_sin, layout, backend, precision, cp, tp)
        self.mlp = LlamaMLP(config, precision, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, precision)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, precision)

    def construct(self, x, aq, akv, cache):
        x = x + self.self_attn(self.input_layernorm(x), aq, akv, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Cell):
    def __init__(self, config: LlamaConfig, cos_sin, layout, backend, precision: Precision, cp=None, tp=None):
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, precision, tp)
        self.layers = nn.CellList([LlamaDecoderLayer(config, cos_sin, layout, backend, precision, cp, tp)
                                   for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, precision)
        self.num_layers = config.num_hidden_layers

    def construct(self, input_ids, aq, akv, cache):
        x = self.embed_tokens(input_ids)
        for i in range(self.num_layers):
            x = self.layers[i](x, aq, akv, None if cache is None else CacheView.layer(cache, i))
        return self.norm(x)


class LlamaForCausalLM(nn.Cell):
    """The causal LM. ``construct(input_ids, actual_seq_qlen=None, actual_seq_kvlen=None, cache=None)``
    returns float32 logits.

    Without a cache (training, evaluation): input_ids (B, S) int32 for BSH; (T,) for TND with
    cumulative ends ``actual_seq_qlen`` (= ``actual_seq_kvlen``). ``logits="last"`` computes logits
    only at each sequence's last token (at 7B vocab and long prompts the full (S, vocab) logits would
    dominate a prefill).

    With ``cache``, a step's view of a KV cache (``cache_views``; the engines in ``models.llama.engine``
    build them): input_ids (T,) packed, whatever the layout; logits at each sequence's last new token
    for a prefill's view, at every token for a decode step's.

    ``backend``: "auto" (fused where available, announced fallback otherwise), "fused" or "unfused",
    for the whole model, so both run on identical weights.

    ``projections``: "auto" (OpenBLAS for float32 on the CPU, MatMul otherwise) or "matmul" (MindSpore's
    MatMul everywhere: the benchmarks' A/B of the two GEMMs).

    ``weight_dtype``: the projections', embedding's and LM head's dtype, ``dtype``'s by default. A
    float16 / bfloat16 ``weight_dtype`` with float32 ``dtype`` keeps a half checkpoint as it is on the
    CPU: float32 activations and arithmetic on exactly its weights, in half the memory (what
    ``weights.load_checkpoint`` does by default). Training wants float32 master weights.

    ``compute_dtype``: the arithmetic of the CPU ops (``ms_rope_attention.compute``): "auto" computes a
    bfloat16 checkpoint in bfloat16 where this CPU has native instructions for it and in float32
    otherwise; "float32" is the float32 model of the weights, bit for bit as before; "bfloat16" asks
    for it (refused on a CPU without the instructions; other weights are then rounded to it once, at
    load); "float16" is refused (docs/compute-dtype.md says why). Either way accumulation, RMSNorm, softmax statistics, RoPE
    angles and the residual stream are float32; ``compute_dtype`` (the attribute) says what runs.

    ``parallel``: this rank's ``ms_rope_attention.distributed.ParallelMesh`` (``mindspore.communication
    .init()`` first), or None for one process. Along its context axis each rank runs its load-balanced
    part of every sequence (``ms_rope_attention.distributed.load_balanced_chunks``, BSH, no cache) and
    attention gathers K/V across the group (``models.llama.losses.ContextParallelTraining`` trains it). Along its tensor
    axis each rank holds its share of the heads, MLP features and vocabulary
    (``models.llama.tensor_parallel.TensorParallel``); the logits come back whole on every rank, and
    training, generation with the KV cache and ``weights.load_weights`` (the rank's slices only)
    work as on one process. The data axis is the trainer's (each rank its share of a batch).
    """

    def __init__(self, config: LlamaConfig, *, dtype="float32", layout: str = "BSH", backend: str = "auto",
                 logits: str = "all", max_positions: int | None = None, projections: str = "auto",
                 parallel=None, weight_dtype=None, compute_dtype: str = "auto"):
        super().__init__()
        dtype = dtype_name(dtype)
        weight_dtype = dtype if weight_dtype is None else dtype_name(weight_dtype)
        if layout not in MODEL_LAYOUTS:
            raise ValueError(f"layout: expected one of {list(MODEL_LAYOUTS)}, got {layout!r}")
        if logits not in ("all", "last"):
            raise ValueError(f"logits: expected 'all' or 'last', got {logits!r}")
        if projections not in PROJECTIONS:
            raise ValueError(f"projections: expected one of {list(PROJECTIONS)}, got {projections!r}")
        check_device_dtype(dtype)
        cp = parallel.context if parallel is not None and parallel.context.size > 1 else None
        if cp is not None and (layout != "BSH" or logits != "all"):
            raise ValueError(f"parallel: a context-parallel model needs layout='BSH' and logits='all' (each rank holds "
                             f"two chunks of every sequence), got layout={layout!r}, logits={logits!r}")
        self.config = config  # for Python callers; construct reads only the plain values below (GRAPH_MODE)
        self.parallel = parallel
        tp = None
        if parallel is not None and parallel.tensor.size > 1:
            tp = TensorParallel.of_mesh(config, parallel)
        self.tensor_parallel = tp  # None without a tensor-parallel axis
        # What this rank's KV cache holds per layer (its KV heads).
        self.cache_config = config.replace(num_key_value_heads=tp.kv_heads(config)) if tp else config
        self.hidden_size, self.vocab_size = config.hidden_size, config.vocab_size
        self.layout = layout
        self.max_positions = max_positions or config.max_position_embeddings
        # MindSpore's MatMul (projections="matmul", the benchmarks' A/B) computes in float32: "auto" takes that.
        compute = model_compute_dtype("float32" if projections == "matmul" and compute_dtype == "auto" else compute_dtype,
                                      weight_dtype, dtype)
        if compute != "float32" and weight_dtype != compute:
            weight_dtype = compute  # asked for explicitly: the weights are rounded to it once, at load
        if compute != "float32" and projections == "matmul":
            raise ValueError(f"compute_dtype: {compute!r} arithmetic runs in the CPU projection op; "
                             "projections='matmul' computes in float32: use compute_dtype='float32'")
        self.compute_dtype = compute
        precision = Precision(DTYPES[dtype], DTYPES[weight_dtype], compute)
        cos, sin = model_rope_tables(config, self.max_positions)
        cos_sin = (Tensor(cos), Tensor(sin))  # one pair for every layer
        self.model = LlamaModel(config, cos_sin, layout, backend, precision, cp, tp)
        self.tie_word_embeddings = config.tie_word_embeddings
        self.local_vocab = config.vocab_size // tp.size if tp else config.vocab_size
        if not self.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, self.local_vocab, precision)
        self.f, _ = _tensor_parallel_pair(tp)
        self.vocab_parallel = tp is not None
        if tp:
            from ms_rope_attention.distributed import GatherFromTensorParallel
            self.gather_vocab = GatherFromTensorParallel(tp.rank, tp.size, tp.group)
        self.matmul = ops.MatMul(transpose_b=True)
        # A tied LM head reads the embedding table through the projection op (any weight dtype).
        self.tied_blas = (linear_op(compute_dtype=compute) if ms.get_context("device_target") == "CPU"
                          and projections == "auto" else None)
        self.last_only = logits == "last"
        if projections == "matmul":
            for _, cell in self.cells_and_names():
                if isinstance(cell, Linear):
                    cell.use_blas = False

    def pack_weights(self) -> None:
        """Opt-in, for prefill-heavy inference: every projection computing in bfloat16 takes its weight
        reordered once into oneDNN's layout for this CPU, in place of the weight (``Linear.pack``), after
        the weights are loaded and before the first call. Measured on an AMX Xeon (2 layers of Llama2-7B
        dims, 512 tokens, docs/compute-dtype.md): TTFT 0.48 s against 0.51 s, but a decode step 53.0 ms
        against 44.1 ms (oneDNN reads a packed W at M = 1 slower than the streaming product reads it as
        stored) and a peak RSS of 2.9 GB against 1.9 GB (not yet explained). The packed weights are no
        longer a checkpoint's tensors and have no gradient. A fused MLP (``LlamaMLP``) runs its op on its
        packed gate and up weights."""
        for _, cell in self.cells_and_names():
            if isinstance(cell, (Linear, LlamaMLP)):
                cell.pack()

    @property
    def backend(self) -> str:
        """The attention path every layer runs: 'fused:CPU' or 'unfused'."""
        return self.model.layers[0].self_attn.prefill_attention.backend

    @property
    def dtype(self):
        """The activations' (and norms') MindSpore dtype."""
        return self.model.norm.weight.dtype

    @property
    def weight_dtype(self):
        """The projections', embedding's and LM head's MindSpore dtype (``dtype`` unless a half
        checkpoint is kept in its own precision)."""
        return self.model.embed_tokens.weight.dtype

    @property
    def cache_dtype(self):
        """The KV cache's dtype a ``Generator`` takes by default: the activations', or float16 with
        half weights (half the bytes a decode step reads; the op accumulates in float32)."""
        return self.dtype if self.weight_dtype == self.dtype else ms.float16

    def construct(self, input_ids, actual_seq_qlen=None, actual_seq_kvlen=None, cache=None):
        hidden = self.model(input_ids, actual_seq_qlen, actual_seq_kvlen, cache)
        if cache is not None:
            if CacheView.variant(cache).last_token_logits:
                hidden = ops.gather(hidden, actual_seq_qlen - 1, 0)
        elif self.last_only:
            if self.layout == "TND":
                hidden = ops.gather(hidden, actual_seq_qlen - 1, 0)
            else:
                hidden = hidden[:, -1:, :]
        hidden = self.f(hidden)
        if self.tie_word_embeddings and self.tied_blas is not None and hidden.dtype == ms.float32:
            logits = self.tied_blas(hidden, self.model.embed_tokens.weight)
        elif self.tie_word_embeddings:
            logits = self.matmul(hidden.reshape(-1, self.hidden_size), self.model.embed_tokens.weight.astype(hidden.dtype))
            logits = logits.reshape(hidden.shape[:-1] + (self.local_vocab,))
        else:
            logits = self.lm_head(hidden)  # a Linear: OpenBLAS (or the decode-sized product) on the CPU
        if self.vocab_parallel:
            logits = self.gather_vocab(logits)
        return logits.astype(ms.float32)
