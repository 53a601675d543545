"""Independent float64 numpy Llama forward from a Hugging Face-named state dict (rotate-half RoPE on
HF-permuted weights), written the plainest way: no cache, no tiling, one sequence at a time."""
from __future__ import annotations

import numpy as np


def rms_norm(x, weight, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * weight


def forward(state: dict, config, ids, inv_freq=None, attention_scaling=1.0) -> np.ndarray:
    """Logits (S, vocab) in float64 for one sequence of token ids."""
    w = {k: np.asarray(v, np.float64) for k, v in state.items()}
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    d = config.head_dim or config.hidden_size // heads  # Llama 3 style configs may give head_dim
    rd = int(d * config.partial_rotary_factor)
    if inv_freq is None:
        inv_freq = 1.0 / config.rope_theta ** (np.arange(0, rd, 2) / rd)
    s = len(ids)
    angles = np.arange(s)[:, None] * inv_freq[None, :]
    cos = np.cos(np.concatenate([angles, angles], 1)) * attention_scaling
    sin = np.sin(np.concatenate([angles, angles], 1)) * attention_scaling

    def rope(x):  # x (S, H, d), HF rotate_half on the first rd features
        part, rest = x[..., :rd], x[..., rd:]
        rotated = np.concatenate([-part[..., rd // 2:], part[..., :rd // 2]], -1)
        return np.concatenate([part * cos[:, None] + rotated * sin[:, None], rest], -1)

    x = w["model.embed_tokens.weight"][np.asarray(ids)]
    causal = np.tril(np.ones((s, s), bool))
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        h = rms_norm(x, w[p + "input_layernorm.weight"], config.rms_norm_eps)
        q = rope((h @ w[p + "self_attn.q_proj.weight"].T).reshape(s, heads, d))
        k = rope((h @ w[p + "self_attn.k_proj.weight"].T).reshape(s, kv_heads, d))
        v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(s, kv_heads, d)
        out = np.zeros((s, heads, d))
        for head in range(heads):
            kv = head // (heads // kv_heads)
            scores = q[:, head] @ k[:, kv].T / np.sqrt(d)
            scores = np.where(causal, scores, -np.inf)
            probs = np.exp(scores - scores.max(-1, keepdims=True))
            out[:, head] = probs / probs.sum(-1, keepdims=True) @ v[:, kv]
        x = x + out.reshape(s, -1) @ w[p + "self_attn.o_proj.weight"].T
        h = rms_norm(x, w[p + "post_attention_layernorm.weight"], config.rms_norm_eps)
        gate = h @ w[p + "mlp.gate_proj.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * (h @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    x = rms_norm(x, w["model.norm.weight"], config.rms_norm_eps)
    head = w["model.embed_tokens.weight"] if config.tie_word_embeddings else w["lm_head.weight"]
    return x @ head.T


def hf_to_meta_qk(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undo Hugging Face's conversion permutation of wq/wk: rotate-half order -> Meta's interleaved."""
    out_dim, in_dim = weight.shape
    return weight.reshape(heads, 2, out_dim // heads // 2, in_dim).transpose(0, 2, 1, 3).reshape(out_dim, in_dim)
