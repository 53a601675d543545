"""Hugging Face ``LlamaAttention`` as mindnlp 0.5.1 runs it (transformers' own modeling file on
mindtorch, PyNative), and Mistral / Qwen2, whose attention differs only by a sliding window.

The instance's ``forward`` is replaced and HF's KV-cache contract kept: a prefill (empty cache)
rotates q and k inside the fused op and hands the op's rotated keys to ``past_key_values.update``;
a step against a non-empty cache rotates only its new keys (HF's own formula), updates the cache and
attends with ``key_rotated=True``. The cos/sin HF passes in (scaling already applied) are the tables.
Each call checks, on the data, what the fused op assumes (a mask that is None or exactly causal,
one set of positions for the whole batch); otherwise the original forward runs, announced once.
"""
from __future__ import annotations

import sys

import mindspore as ms
import numpy as np
from mindspore import ops

from .._compat import attention_implementation, copy_device_tag
from ..functional import rotary_flash_attention
from ..rope import apply_rope, rope_tables
from .family import Family, SiteAnnouncer, class_path, fingerprint
from .masks import additive_mask_is_causal, bool_mask_is_causal

MODELING = "transformers.models.{0}.modeling_{0}"
CLASSES = {f"{MODELING.format(m)}.{c}Attention": m for m, c in (("llama", "Llama"), ("mistral", "Mistral"),
                                                                  ("qwen2", "Qwen2"))}
# forward + apply_rotary_pos_emb + rotate_half of transformers 4.57.1 (mindnlp 0.5.1's pin), per model.
TESTED = {"llama": {"2f1b906b2e9479e7": "transformers 4.57.1"},
          "mistral": {"dcac61a47d34a957": "transformers 4.57.1"},
          "qwen2": {"81da11a5a4253cc9": "transformers 4.57.1"}}
IMPLEMENTATIONS = ("sdpa", "eager")
_DTYPES = (ms.float32, ms.float16, ms.bfloat16)


def _module_of(site):
    return sys.modules[type(site).__module__]


def site_fingerprint(site) -> str:
    module = _module_of(site)
    forward = type(site).forward
    return fingerprint(getattr(forward, "__wrapped__", forward), module.apply_rotary_pos_emb, module.rotate_half)


def _mask_is_causal(mask, implementation, q_len, past_len) -> bool:
    """Whether HF's attention with this mask is the op's bottom-right causal rule. Without a mask,
    sdpa is causal (top-left) for more than one query and attends everything for one; eager attends
    everything: the same rule for one query, or for an sdpa prefill."""
    if mask is None:
        return q_len == 1 or (implementation == "sdpa" and past_len == 0)
    # Every layer of one forward gets the same mask object: decide once (each decision waits for
    # the queued ops to finish, a PyNative synchronisation), and remember it on the mask.
    key = (implementation, q_len, past_len)
    known = getattr(mask, "rfa_causal", None)
    if known is not None and known[0] == key:
        return known[1]
    if mask.dtype == ms.bool_:  # sdpa reads True as "attend"; eager adds the mask to the scores
        causal = implementation == "sdpa" and bool(bool_mask_is_causal(mask))
    else:
        causal = bool(additive_mask_is_causal(mask))
    mask.rfa_causal = (key, causal)
    return causal


def _runtime_reason(site, hidden_states, cos, attention_mask, past_len, kwargs):
    """Why this call must run the original forward (None: the fused op computes the same)."""
    if site.training and site.attention_dropout > 0:
        return f"attention dropout {site.attention_dropout} while training"
    if kwargs.get("output_attentions"):
        return "output_attentions=True (the fused op returns no attention weights)"
    if hidden_states.dtype not in _DTYPES:
        return f"dtype {hidden_states.dtype} is not one of float32, float16, bfloat16"
    if cos.shape[-1] != site.head_dim:
        return f"partial rotary (cos has {cos.shape[-1]} of head_dim {site.head_dim} columns)"
    if cos.shape[0] > 1 and not bool(ops.all(ops.equal(cos, cos[:1]))):
        return "positions differ across the batch"
    if not _mask_is_causal(attention_mask, attention_implementation(site.config), hidden_states.shape[1], past_len):
        return "the mask is not exactly causal (padding, or a custom mask)"
    return None


def _fused_forward(self, hidden_states, position_embeddings, attention_mask, past_key_values=None,
                   cache_position=None, **kwargs):
    """LlamaAttention.forward with RoPE + attention fused (BSND: q/k/v straight from the projections).
    Every tensor made here by a MindSpore op gets mindtorch's device tag (``tag``) before any of its
    methods or operators run: mindtorch's versions refuse untagged tensors."""
    cos, sin = position_embeddings
    past_len = 0 if past_key_values is None else int(past_key_values.get_seq_length(self.layer_idx))
    reason = _runtime_reason(self, hidden_states, cos, attention_mask, past_len, kwargs)
    if reason is not None:
        self.rfa_announce(reason)
        return self.rfa_original_forward(hidden_states, position_embeddings, attention_mask,
                                         past_key_values=past_key_values, cache_position=cache_position, **kwargs)

    def tag(tensor):
        copy_device_tag((tensor,), hidden_states)
        return tensor

    batch, length = hidden_states.shape[0], hidden_states.shape[1]
    query, key, value = (tag(ops.reshape(proj(hidden_states), (batch, length, -1, self.head_dim)))
                         for proj in (self.q_proj, self.k_proj, self.v_proj))
    cache_kwargs = {"sin": sin, "cos": cos, "cache_position": cache_position}
    to_bnsd = (0, 2, 1, 3)
    cos0, sin0 = cos[0], sin[0]
    if past_len == 0:
        out, rotated_key = rotary_flash_attention(query, key, value, cos0, sin0, input_layout="BSND",
                                                  scale=self.scaling, return_rotated_key=True)
        if past_key_values is not None:
            past_key_values.update(tag(ops.transpose(rotated_key, to_bnsd)), tag(ops.transpose(value, to_bnsd)),
                                   self.layer_idx, cache_kwargs)
    else:
        key = tag(ops.transpose(key, to_bnsd))
        c, s = tag(ops.expand_dims(cos0, 0)), tag(ops.expand_dims(sin0, 0))
        new_keys = tag(ops.cast(apply_rope(key, c, s, 0, self.head_dim), key.dtype))
        keys, values = past_key_values.update(new_keys, tag(ops.transpose(value, to_bnsd)), self.layer_idx,
                                              cache_kwargs)
        # The op reads query i's rotation at table row kv_len - q_len + i: HF's rows go there.
        pad = ops.zeros((keys.shape[2] - length, cos.shape[-1]), cos.dtype)
        out = rotary_flash_attention(tag(ops.transpose(query, to_bnsd)), keys, values, ops.cat((pad, cos0)),
                                     ops.cat((pad, sin0)), scale=self.scaling, key_rotated=True)
        out = ops.transpose(out, to_bnsd)
    return self.o_proj(tag(ops.reshape(out, (batch, length, -1)))), None


class HuggingFaceLlama(Family):
    name = "hf-llama"

    def recognises(self, obj) -> bool:
        return class_path(obj) in CLASSES

    def reason_not_fused(self, site, name):
        model = CLASSES[class_path(site)]
        if "forward" in vars(site):
            return "its forward was replaced on the instance"
        printed = site_fingerprint(site)
        if printed not in TESTED[model]:
            return (f"its code differs from the tested {sorted(TESTED[model].values())} (fingerprint {printed})")
        implementation = attention_implementation(site.config)
        if implementation not in IMPLEMENTATIONS:
            return f"attn_implementation={implementation!r}: only {list(IMPLEMENTATIONS)} are covered"
        window = getattr(site, "sliding_window", None) if model == "qwen2" else \
            getattr(site.config, "sliding_window", None) if model == "mistral" else None
        if window is not None:
            return f"sliding_window={window}: not covered"
        return None

    def install(self, site, name):
        site.rfa_announce = SiteAnnouncer(name)
        site.rfa_original_forward = site.forward
        site.forward = _fused_forward.__get__(site)

    def uninstall(self, site):
        for attr in ("forward", "rfa_original_forward", "rfa_announce"):
            delattr(site, attr)

    def is_installed(self, site) -> bool:
        return "rfa_original_forward" in vars(site)

    def probe(self, site, seed):
        """A 5-token prefill then a 2-token step, through a DynamicCache, with the causal masks HF makes
        for the implementation (boolean for sdpa, additive for eager)."""
        # The site is a mindtorch module from transformers: both are loaded (this package needs neither).
        torch, cache_utils = sys.modules["mindtorch"], sys.modules["transformers.cache_utils"]
        rng = np.random.default_rng(seed)
        batch, hidden, dim = 2, site.config.hidden_size, site.head_dim
        dtype = site.q_proj.weight.dtype
        sdpa = attention_implementation(site.config) == "sdpa"
        cos_table, sin_table = rope_tables(dim, 7)
        cache, outputs = cache_utils.DynamicCache(), []
        for start, stop in ((0, 5), (5, 7)):
            x = torch.tensor(rng.standard_normal((batch, stop - start, hidden), dtype=np.float32)).to(dtype)
            cos, sin = (torch.tensor(np.repeat(t[None, start:stop], batch, 0)).to(dtype) for t in (cos_table, sin_table))
            keep = np.tril(np.ones((stop - start, stop), bool), start)[None, None].repeat(batch, 0)
            mask = torch.tensor(keep if sdpa else np.where(keep, 0.0, np.finfo(np.float32).min)).to(
                torch.bool if sdpa else dtype)
            with torch.no_grad():
                out, _ = site(x, (cos, sin), mask, past_key_values=cache, cache_position=torch.arange(start, stop))
            outputs.append(out.float().numpy().astype(np.float64).reshape(batch, -1))
        return np.concatenate(outputs, axis=1)

    def tolerance(self, site):
        return 1e-4 if site.q_proj.weight.dtype == ms.float32 else 2e-2
