"""The Llama net's building blocks besides attention: the projections, the embedding table, RMSNorm,
and the dtypes and arithmetic (``Precision``) they are built in. Parameter names are Hugging Face's.
"""
from __future__ import annotations

from dataclasses import dataclass

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops
from mindspore.common.initializer import Normal, initializer

from ms_rope_attention import embedding_op, linear_op, pack_weight, packed_bytes, rms_norm_op


@dataclass(frozen=True)
class Precision:
    """The model's two dtypes, its activations' (and norms') and its projection / embedding / LM-head
    weights', and the arithmetic of its CPU ops. The dtypes differ for a half checkpoint kept in its
    own precision on the CPU (float32 activations, float16 / bfloat16 weights). ``compute``
    (``ms_rope_attention.compute``): 'float32' is the float32 model of those weights; 'bfloat16'
    rounds each op's float32 operands once inside the op (projections and attention) and accumulates
    in float32, while the activations between the ops (norms, residual stream) stay float32."""

    activations: object
    weights: object
    compute: str = "float32"


class Linear(nn.Cell):
    """y = x W^T, W stored (out, in) as in Hugging Face checkpoints; no bias (Llama has none).

    On the CPU, float32 activations go through ``ms_rope_attention.linear`` in ``precision.compute``
    (float32: OpenBLAS, and its own product for decode-sized inputs, faster there than MindSpore's
    MatMul, the weight in float32 or kept in the checkpoint's float16 / bfloat16; bfloat16: oneDNN and
    bfloat16 dot products), with the weight in ``precision.weights``; other devices and dtypes (amp's
    float16) take MatMul. ``weight_hook``: a Cell the weight passes through first (a replicated
    tensor-parallel weight's gradient sum)."""

    def __init__(self, in_features: int, out_features: int, precision: Precision, weight_hook: nn.Cell | None = None):
        super().__init__()
        self.weight = Parameter(initializer(Normal(0.02), (out_features, in_features), precision.weights),
                                name="weight")
        self.in_features, self.out_features = in_features, out_features
        self.matmul = ops.MatMul(transpose_b=True)
        self.use_blas = ms.get_context("device_target") == "CPU"  # LlamaForCausalLM(projections="matmul") clears it
        self.compute_dtype = precision.compute
        self.blas = linear_op(compute_dtype=precision.compute) if self.use_blas else None
        self.weight_hook = weight_hook
        self.packed = False

    def pack(self) -> None:
        """The bfloat16 weight reordered once into oneDNN's blocked layout for this CPU, in place of the
        weight (``LlamaForCausalLM.pack_weights`` says when that pays). Inference only: the packed bytes
        have no gradient and are not a checkpoint's tensor."""
        if self.packed or not self.use_blas or self.compute_dtype != "bfloat16" or self.weight_hook is not None:
            return
        out_features, in_features = self.weight.shape
        packed = Parameter(Tensor(np.zeros(packed_bytes(out_features, in_features), np.uint8)), name=self.weight.name,
                           requires_grad=False)
        weight = self.weight.asnumpy()
        pack_weight(weight, out=packed.asnumpy())  # a CPU tensor's asnumpy() is a view: packed where it runs
        self.weight = packed
        self.blas = linear_op(compute_dtype="bfloat16", packed_out_features=out_features)
        self.packed = True

    def construct(self, x):
        weight = self.weight if self.weight_hook is None else self.weight_hook(self.weight)
        if self.use_blas and x.dtype == ms.float32:
            return self.blas(x, weight)
        # The static feature count (not -1) keeps the last dim static under dynamic batch/sequence
        # shapes, so the attention op still knows its head counts at compile time.
        # The weight in the activation's dtype: under mixed precision (amp O2/O3) activations are float16
        # while the master weights stay float32.
        y = self.matmul(x.reshape(-1, self.in_features), weight.astype(x.dtype))
        return y.reshape(x.shape[:-1] + (self.out_features,))


class Embedding(nn.Cell):
    """Token embeddings; with ``tp`` (vocab-parallel) the rank holds a slice of the vocabulary, looks
    up the ids that fall in it (zeros elsewhere) and the ranks' rows are summed. A table in another
    dtype than the float32 activations (a half checkpoint kept as it is) is read on the CPU by
    ``ms_rope_attention.embedding``, which converts the rows it copies."""

    def __init__(self, vocab_size: int, hidden_size: int, precision: Precision, tp=None):
        super().__init__()
        rows = vocab_size // tp.size if tp else vocab_size
        dtype, weight_dtype = precision.activations, precision.weights
        self.weight = Parameter(initializer(Normal(0.02), (rows, hidden_size), weight_dtype), name="weight")
        self.parallel, self.rows, self.start = tp is not None, rows, tp.rank * rows if tp else 0
        self.lookup = None
        if weight_dtype != dtype:
            self.lookup = (embedding_op() if ms.get_context("device_target") == "CPU" and dtype == ms.float32
                           else _GatherAs(dtype))
        if tp:
            from ms_rope_attention.distributed import ReduceFromTensorParallel
            self.g = ReduceFromTensorParallel(tp.rank, tp.size, tp.group)

    def _rows(self, ids):
        return ops.gather(self.weight, ids, 0) if self.lookup is None else self.lookup(ids, self.weight)

    def construct(self, ids):
        if not self.parallel:
            return self._rows(ids)
        local = ids - self.start
        inside = (local >= 0) & (local < self.rows)
        x = self._rows(ops.where(inside, local, ops.zeros_like(local)))
        return self.g(x * inside.expand_dims(-1).astype(x.dtype))


class _GatherAs(nn.Cell):
    """The embedding rows cast to the activations' dtype (devices other than the CPU)."""

    def __init__(self, dtype):
        super().__init__()
        self.dtype = dtype

    def construct(self, ids, table):
        return ops.gather(table, ids, 0).astype(self.dtype)


class RMSNorm(nn.Cell):
    """x / rms(x) * weight, the statistics in float32 whatever the activation dtype.

    On the CPU, a model computing in bfloat16 (``precision.compute``) with float32 activations runs it
    as one fused op (``ms_rope_attention.rms_norm_op``: float32 arithmetic, multithreaded), because
    there MindSpore's single-threaded Cast/Mul/ReduceMean/Rsqrt/BroadcastTo ops were about a tenth of
    a prefill. Every other case keeps MindSpore's ops below, so a float32-compute model is bit for
    bit what it was (the fused op sums in another order)."""

    def __init__(self, hidden_size: int, eps: float, precision: Precision):
        super().__init__()
        dtype = precision.activations
        self.weight = Parameter(ops.ones((hidden_size,), dtype), name="weight")
        self.eps = eps
        # Read in construct as a constant; tests clear it before the first call to compare the two forms.
        self.use_op = (ms.get_context("device_target") == "CPU" and precision.compute == "bfloat16"
                       and dtype == ms.float32)
        self.op = rms_norm_op(eps) if self.use_op else None

    def construct(self, x):
        if self.use_op and x.dtype == ms.float32:
            return self.op(x, self.weight)
        # Both factors are expanded to x's shape first: MindSpore's CPU backend runs a broadcasting
        # multiply with several x-sized temporaries (measured at (4096, 4096): 0.65 GB for this norm
        # with broadcasting, about a third of that expanded).
        xf = x.astype(ms.float32)
        inverse_rms = ops.rsqrt((xf * xf).mean(-1, keep_dims=True) + self.eps)
        normed = (xf * inverse_rms.broadcast_to(xf.shape)).astype(x.dtype)
        return normed * self.weight.astype(x.dtype).broadcast_to(normed.shape)
