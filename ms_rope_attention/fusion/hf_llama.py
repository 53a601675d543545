"""Hugging Face ``LlamaAttention`` as mindnlp 0.5.1 runs it (transformers' own modeling file on
mindtorch, PyNative), and Mistral / Qwen2, whose attention differs only by a sliding window.

The instance's ``forward`` is replaced and HF's KV-cache contract kept: a prefill (empty cache)
rotates q and k inside the fused op and hands the op's rotated keys to ``past_key_values.update``;
a step against a non-empty cache rotates only its new keys (HF's own formula), updates the cache and
attends with ``key_rotated=True``. The cos/sin HF passes in (scaling already applied) are the tables.
Each call checks, on the data, what the fused op assumes: a mask that is causal per sequence, after
left padding (``padded_batch``: a padded batch runs in the op's TND layout), and HF's rotations at
the positions that mask implies; otherwise the original forward runs, announced once. The four
projections run on the project's GEMM where it computes the same (``_project``).
"""
from __future__ import annotations

import functools
import sys

import mindspore as ms
import numpy as np
from mindspore import ops

from .._compat import attention_implementation, copy_device_tag, has_forward_hooks
from ..functional import rotary_flash_attention
from ..linear import linear_op
from ..rope import apply_rope, rope_tables
from .family import Family, SiteAnnouncer, class_path, fingerprint
from . import padded_batch

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


def _band(mask, implementation, batch, q_len, past_len) -> padded_batch.Band | str:
    """Which keys each sequence's queries attend, as a ``padded_batch.Band``, or why HF's attention
    with this mask is not one. Without a mask, sdpa is causal (top-left) for more than one query and
    attends everything for one; eager attends everything: the same rule for one query, or for an
    sdpa prefill."""
    if mask is None:
        if q_len == 1 or (implementation == "sdpa" and past_len == 0):
            return padded_batch.Band(np.zeros(batch, np.int64), past_len, q_len)
        return "no mask, and the attention is not causal without one"
    # Every layer of one forward gets the same mask object: decide once (reading it waits for the
    # queued ops to finish, a PyNative synchronisation), and remember it on the mask.
    key = (implementation, q_len, past_len)
    known = getattr(mask, "rfa_band", None)
    if known is not None and known[0] == key:
        return known[1]
    boolean = mask.dtype == ms.bool_
    if boolean and implementation != "sdpa":  # sdpa reads True as "attend"; eager adds the mask
        decided = f"a boolean mask with attn_implementation={implementation!r}"
    else:
        keep = padded_batch.attended(mask.numpy() if boolean else mask.float().numpy(), boolean)
        decided = keep if isinstance(keep, str) else padded_batch.band(keep, past_len)
    mask.rfa_band = (key, decided)
    return decided


def _tables(cos, sin, the_band) -> tuple | str:
    """The cos/sin tables (rows by position, in cos's dtype and with its device tag) HF's per-query
    rows fill, or why there are none; made once per forward and remembered on ``cos`` (every layer of
    one forward gets the same)."""
    key = (tuple(the_band.starts.tolist()), the_band.past, the_band.q_len)
    known = getattr(cos, "rfa_tables", None)
    if known is not None and known[0] == key:
        return known[1]
    rows = tuple(padded_batch.position_table(t.float().numpy(), the_band) for t in (cos, sin))
    if any(table is None for table in rows):
        tables = "positions do not follow the mask (two queries at one position with different rotations)"
    else:
        tables = tuple(ops.cast(ms.Tensor(table), cos.dtype) for table in rows)
        copy_device_tag(tables, cos)
    cos.rfa_tables = (key, tables)
    return tables


def _runtime_plan(site, hidden_states, cos, sin, attention_mask, past_len, kwargs):
    """(band, tables) the fused op computes this call with, or the reason it must run the original
    forward."""
    if site.training and site.attention_dropout > 0:
        return f"attention dropout {site.attention_dropout} while training"
    if kwargs.get("output_attentions"):
        return "output_attentions=True (the fused op returns no attention weights)"
    if hidden_states.dtype not in _DTYPES:
        return f"dtype {hidden_states.dtype} is not one of float32, float16, bfloat16"
    if cos.shape[-1] != site.head_dim:
        return f"partial rotary (cos has {cos.shape[-1]} of head_dim {site.head_dim} columns)"
    batch, q_len = hidden_states.shape[0], hidden_states.shape[1]
    the_band = _band(attention_mask, attention_implementation(site.config), batch, q_len, past_len)
    if isinstance(the_band, str):
        return the_band
    tables = _tables(cos, sin, the_band)
    return tables if isinstance(tables, str) else (the_band, tables)


def _project(linear, x, tag):
    """``linear(x)``, on the project's GEMM (``ms_rope_attention.linear``, the product the project's
    own Llama runs) when that computes the same: a plain ``nn.Linear`` without hooks, float32
    activations, on the CPU, outside autograd. MindSpore 2.10's CPU Dense, which mindtorch's
    ``nn.Linear`` runs, spends ~0.3 s on one decode-sized product (docs/fuse.md)."""
    torch = sys.modules["mindtorch"]
    if (type(linear) is not torch.nn.Linear or has_forward_hooks(linear) or x.dtype != ms.float32
            or linear.weight.dtype not in _DTYPES or torch.is_grad_enabled()
            or ms.get_context("device_target") != "CPU"):
        return linear(x)
    out = tag(_blas()(x, linear.weight))
    return out if linear.bias is None else tag(ops.add(out, linear.bias))


@functools.lru_cache(maxsize=None)
def _blas():
    return linear_op()


def _fused_forward(self, hidden_states, position_embeddings, attention_mask, past_key_values=None,
                   cache_position=None, **kwargs):
    """LlamaAttention.forward with RoPE + attention fused. A batch at one set of positions runs BSND
    (q/k/v straight from the projections); a left-padded batch runs TND, each sequence's padding a
    segment of its own (``padded_batch``). Every tensor made here by a MindSpore op gets mindtorch's
    device tag (``tag``) before any of its methods or operators run: mindtorch's versions refuse
    untagged tensors."""
    cos, sin = position_embeddings
    past_len = 0 if past_key_values is None else int(past_key_values.get_seq_length(self.layer_idx))
    plan = _runtime_plan(self, hidden_states, cos, sin, attention_mask, past_len, kwargs)
    if isinstance(plan, str):
        self.rfa_announce(plan)
        return self.rfa_original_forward(hidden_states, position_embeddings, attention_mask,
                                         past_key_values=past_key_values, cache_position=cache_position, **kwargs)
    the_band, (cos_table, sin_table) = plan

    def tag(tensor):
        copy_device_tag((tensor,), hidden_states)
        return tensor

    batch, length = hidden_states.shape[0], hidden_states.shape[1]
    query, key, value = (tag(ops.reshape(_project(proj, hidden_states, tag), (batch, length, -1, self.head_dim)))
                         for proj in (self.q_proj, self.k_proj, self.v_proj))
    cache_kwargs = {"sin": sin, "cos": cos, "cache_position": cache_position}
    to_bnsd = (0, 2, 1, 3)
    packed = {}
    if not the_band.uniform:
        q_offsets, kv_offsets = the_band.offsets()
        packed = {"input_layout": "TND", "actual_seq_qlen": tag(ms.Tensor(q_offsets)),
                  "actual_seq_kvlen": tag(ms.Tensor(kv_offsets))}

    def tokens(x):  # (B, S, N, D) -> (B * S, N, D): a batch's TND form
        return tag(ops.reshape(x, (-1,) + tuple(x.shape[2:])))

    if past_len == 0:
        if packed:
            out, rotated_key = rotary_flash_attention(tokens(query), tokens(key), tokens(value), cos_table, sin_table,
                                                      scale=self.scaling, return_rotated_key=True, **packed)
            rotated_key = tag(ops.reshape(rotated_key, key.shape))
        else:
            out, rotated_key = rotary_flash_attention(query, key, value, cos_table, sin_table, input_layout="BSND",
                                                      scale=self.scaling, return_rotated_key=True)
        if past_key_values is not None:
            past_key_values.update(tag(ops.transpose(rotated_key, to_bnsd)), tag(ops.transpose(value, to_bnsd)),
                                   self.layer_idx, cache_kwargs)
    else:
        # The new keys rotated once, by HF's formula on HF's rows (one per sequence and query).
        key = tag(ops.transpose(key, to_bnsd))
        c, s = tag(ops.expand_dims(cos, 1)), tag(ops.expand_dims(sin, 1))
        new_keys = tag(ops.cast(apply_rope(key, c, s, 0, self.head_dim), key.dtype))
        keys, values = past_key_values.update(new_keys, tag(ops.transpose(value, to_bnsd)), self.layer_idx,
                                              cache_kwargs)
        if packed:  # the cache's (B, Nkv, S, D) copied token-major: each sequence's rows its segments
            keys, values = (tokens(tag(ops.transpose(x, to_bnsd))) for x in (keys, values))
            out = rotary_flash_attention(tokens(query), keys, values, cos_table, sin_table, scale=self.scaling,
                                         key_rotated=True, **packed)
        else:
            out = rotary_flash_attention(tag(ops.transpose(query, to_bnsd)), keys, values, cos_table, sin_table,
                                         scale=self.scaling, key_rotated=True)
            out = ops.transpose(out, to_bnsd)
    return _project(self.o_proj, tag(ops.reshape(out, (batch, length, -1))), tag), None


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
