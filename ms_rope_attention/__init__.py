"""ms_rope_attention: rotary position embedding fused into FlashAttention, for MindSpore.

Public API:
- ``rotary_flash_attention(query, key, value, cos, sin, ...)``: the functional op (PyNative, and
  inside GRAPH_MODE ``construct`` or ``@ms.jit``).
- ``RotaryFlashAttention``: the Cell with its shared cos/sin cache (GRAPH_MODE and PyNative).
- ``RotaryFlashAttentionOp``: the op as a Cell with explicit cos/sin inputs.
- ``rope_tables`` / ``shared_rope_tables``: cos/sin tables.
- ``fuse(net)`` / ``unfuse(net)``: the fused op inside existing MindFormers, Hugging Face (mindnlp)
  models (``ms_rope_attention.fusion``), with a ``FuseReport``.
- The paged KV cache's ops ``rotary_paged_attention`` / ``rotary_cache_write``, the CPU projection,
  MLP (gate, up and SwiGLU in one), embedding and RMSNorm primitives ``linear_op()`` / ``swiglu_op()`` /
  ``embedding_op()`` / ``rms_norm_op(eps)`` (a bfloat16 weight packed once for the projections:
  ``pack_weight`` / ``packed_bytes``), and RoPE's pieces (``apply_rope``,
  ``inverse_frequencies``, ``tables_from_inverse_frequencies``): what models build on, so that no
  user imports a module below this face (``ms_rope_attention.distributed`` has its own).
- ``COMPUTE_DTYPES`` / ``resolve_compute_dtype`` / ``native_half_dtypes``: which arithmetic a model
  of a checkpoint's dtype computes in on this CPU (``ms_rope_attention.compute``).
"""
import os as _os

# The kernels' OpenMP threads sleep between calls instead of spinning: spinning, libgomp's default,
# kept a core busy for milliseconds after each call, which MindSpore's own threads then waited for
# (docs/threads.md). libgomp reads this once, when it loads, which `import mindspore` does: it takes
# effect when this package (or `models`) is imported first; a value already set is kept.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# OpenBLAS's worker threads (the prefill projections' SGEMM) likewise: by default they spin for 2^28
# clock ticks (~0.1 s) after each call, through the attention and the ops between the GEMMs and into
# the first decode step after a prefill (docs/threads.md). OpenBLAS reads this when linear.py loads it.
_os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

from .compute import COMPUTE_DTYPES, native_half_dtypes, resolve_compute_dtype
from .embedding import embedding_op
from .functional import RotaryFusionFallbackError, rotary_flash_attention
from .fusion import FuseError, FuseReport, fuse, unfuse
from .linear import linear_op, pack_weight, packed_bytes, swiglu_op
from .norm import rms_norm_op
from .nn import RotaryFlashAttention, RotaryFlashAttentionOp
from .paged import rotary_cache_write, rotary_paged_attention
from .rope import apply_rope, inverse_frequencies, rope_tables, shared_rope_tables, tables_from_inverse_frequencies

__all__ = ["rotary_flash_attention", "RotaryFlashAttention", "RotaryFlashAttentionOp", "RotaryFusionFallbackError",
           "rope_tables", "shared_rope_tables", "fuse", "unfuse", "FuseReport", "FuseError",
           "rotary_paged_attention", "rotary_cache_write", "linear_op", "swiglu_op", "rms_norm_op", "pack_weight", "packed_bytes", "embedding_op", "apply_rope",
           "inverse_frequencies", "tables_from_inverse_frequencies", "COMPUTE_DTYPES", "native_half_dtypes",
           "resolve_compute_dtype"]
__version__ = "0.1.0"
