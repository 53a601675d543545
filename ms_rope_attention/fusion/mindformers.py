"""MindFormers 2.0.0 ``LLamaAttention`` (``mindformers.models.llama.llama_transformer``), its
training / prefill path (``use_past=False``), in GRAPH_MODE and PyNative.

The site's class is swapped, on that instance only, for a subclass whose ``construct`` runs the
same projections, then the fused op in BSND on the RotaryEmbedding's own cos/sin, then ``wo``. It
takes that path only when the mask is exactly causal (MindFormers' mask also hides pad tokens) and
one position table serves the whole batch; otherwise it runs the original ``construct`` and
announces it (``rotary_fusion_fallback``). The mask test is a tensor ``if``: in GRAPH_MODE it is
decided in the graph, per call, and the announcement is a ``pyfunc`` op in the fallback branch.
"""
from __future__ import annotations

import math
import sys

import mindspore as ms
import numpy as np
from mindspore import Tensor, ops

from ..functional import rotary_flash_attention
from ..rope import rope_tables
from .family import Family, class_path, eager, fingerprint
from .masks import additive_mask_is_causal, fallback_announcer

ATTENTION = "mindformers.models.llama.llama_transformer.LLamaAttention"
ROTARY = "mindformers.modules.layers.RotaryEmbedding"
# LLamaAttention.construct/_attn/_repeat_kv/_merge_heads/_cat_prefix, and RotaryEmbedding.construct/
# rotate_half/slice_half, as MindFormers 2.0.0 ships them.
TESTED = {("36119d64d23b64dc", "98e30d4dc9cbcafc"): "mindformers 2.0.0"}
_DTYPES = (ms.float32, ms.float16, ms.bfloat16)


def _fingerprints(attention_class, rotary_class) -> tuple[str, str]:
    a, r = attention_class, rotary_class
    return (fingerprint(a.construct, a._attn, a._repeat_kv, a._merge_heads, a._cat_prefix),
            fingerprint(r.construct, r.rotate_half, r.slice_half))


def _fused_construct(self, x, freqs_cis, mask=None, batch_valid_length=None, block_tables=None, slot_mapping=None,
                     prefix_keys_values=None, q_seq_lens=None, kv_mask=None, seq_chunk=None, actual_seq_len=None):
    """LLamaAttention.construct with RoPE + attention fused; the original where they differ."""
    if prefix_keys_values is None and mask is not None and freqs_cis[0].shape[0] == 1:
        if additive_mask_is_causal(mask):
            return self.rfa_fused_attention(x, freqs_cis)
        x = ops.depend(x, self.rfa_announce(ops.ones((1,), ms.int32)))
    return self.rfa_original_construct(x, freqs_cis, mask, batch_valid_length, block_tables, slot_mapping,
                                       prefix_keys_values, q_seq_lens, kv_mask, seq_chunk, actual_seq_len)


def _fused_attention(self, x, freqs_cis):
    """The projections as MindFormers computes them, then one fused call in BSND, then ``wo``."""
    ori_dtype = x.dtype
    bs, seq_len, _ = self.shape(x)
    query = self.reshape(self.cast(self.wq(x), self.dtype), (bs, seq_len, self.n_head, self.head_dim))
    key = self.reshape(self.cast(self.wk(x), self.dtype), (bs, seq_len, self.n_kv_head, self.head_dim))
    value = self.reshape(self.cast(self.wv(x), self.dtype), (bs, seq_len, self.n_kv_head, self.head_dim))
    freqs_cos, freqs_sin, _ = freqs_cis
    cos = self.reshape(freqs_cos, (seq_len, self.head_dim))
    sin = self.reshape(freqs_sin, (seq_len, self.head_dim))
    context = rotary_flash_attention(query, key, value, cos, sin, input_layout="BSND", scale=self.rfa_scale)
    output = self.wo(self.reshape(context, (bs, seq_len, self.hidden_size)))
    return self.cast(output, ori_dtype)


class MindFormersLlama(Family):
    name = "mindformers-llama"
    _fused_classes: dict = {}

    def recognises(self, obj) -> bool:
        """The training / prefill path; ``use_past=True`` is ``mindformers_infer``'s."""
        return class_path(self._original_class(obj)) == ATTENTION and not getattr(obj, "use_past", False)

    @staticmethod
    def _original_class(obj):
        return getattr(type(obj), "rfa_original_class", type(obj))

    def reason_not_fused(self, site, name):
        cls = self._original_class(site)
        rotary = getattr(site, "apply_rotary_emb", None)
        if "construct" in vars(site):
            return "its construct was replaced on the instance"
        if site.use_flash_attention:
            return "use_flash_attention=True: MindFormers' FlashAttention path (Ascend); not covered"
        if site.context_parallel > 1 or site.seq_pipe:
            return f"context_parallel={site.context_parallel}, seq_pipe={site.seq_pipe}: not covered"
        if site.input_layout == "TND":
            return "input_layout='TND' (eod mask compression): not covered"
        if site.qkv_concat:
            return "qkv_concat=True: not covered"
        if site.rmsnorm_compute_2d:
            return "rmsnorm_compute_2d=True (2-D activations): not covered"
        if rotary is None or class_path(rotary) != ROTARY:
            return f"its RoPE is {class_path(rotary) if rotary is not None else 'missing'}, not {ROTARY}"
        if site.dtype not in _DTYPES:
            return f"compute dtype {site.dtype} is not one of float32, float16, bfloat16"
        prints = _fingerprints(cls, type(rotary))
        if prints not in TESTED:
            return (f"its code differs from the tested release(s) {sorted(TESTED.values())} "
                    f"(fingerprints {prints[0]}, {prints[1]})")
        return None

    def install(self, site, name):
        cls = type(site)
        fused = self._fused_classes.get(cls)
        if fused is None:
            fused = self._fused_classes[cls] = type(f"RotaryFused{cls.__name__}", (cls,), {
                "construct": _fused_construct, "rfa_fused_attention": _fused_attention,
                "rfa_original_construct": cls.construct, "rfa_original_class": cls})
        site.rfa_scale = 1.0 / math.sqrt(site.head_dim)
        site.rfa_announce = fallback_announcer(name, "the mask is not exactly causal (a pad token or a custom "
                                                     "mask) or positions differ across the batch")
        site.__class__ = fused

    def uninstall(self, site):
        site.__class__ = site.rfa_original_class
        for attr in ("rfa_scale", "rfa_announce"):
            delattr(site, attr)

    def is_installed(self, site) -> bool:
        return hasattr(type(site), "rfa_original_class")

    def probe(self, site, seed):
        rng = np.random.default_rng(seed)
        batch, length, dim = 2, 7, site.head_dim
        x = Tensor(rng.standard_normal((batch, length, site.hidden_size), dtype=np.float32)).astype(site.dtype)
        cos, sin = (Tensor(t.reshape(1, 1, length, dim)).astype(site.apply_rotary_emb.dtype)
                    for t in rope_tables(dim, length))
        layers = sys.modules[type(site.apply_rotary_emb).__module__]
        swap = Tensor(layers.FreqsMgr.get_swap_mask(dim)).astype(site.apply_rotary_emb.dtype)
        mask = Tensor(np.triu(np.full((length, length), -10000.0, np.float32), 1)[None, None].repeat(batch, 0))
        with eager():
            return site(x, (cos, sin, swap), mask.astype(site.dtype)).astype(ms.float32).asnumpy().astype(np.float64)

    def tolerance(self, site):
        return 1e-4 if site.dtype == ms.float32 else 2e-2
