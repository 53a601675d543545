"""Llama configuration: published presets, and parsing of Hugging Face / Meta config files."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROPE_SCALING_TYPES = ("linear", "dynamic", "llama3", "yarn")


@dataclass(frozen=True)
class LlamaConfig:
    """Model dimensions and RoPE settings (names follow Hugging Face's ``LlamaConfig``)."""

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    head_dim: int | None = None          # None = hidden_size // num_attention_heads
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None     # as in HF config.json: {"rope_type": "linear"|"dynamic"|"llama3"|"yarn", ...}
    partial_rotary_factor: float = 1.0
    tie_word_embeddings: bool = False
    bos_token_id: int = 1
    eos_token_id: int | tuple = 2
    rotary_mode: int = 0                 # 0 rotate-half (HF weights), 1 interleaved (Meta's original weights)
    extra: dict = field(default_factory=dict, compare=False)  # unrecognised config.json keys, kept for reference

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_key_value_heads: {self.num_key_value_heads} must divide num_attention_heads "
                             f"{self.num_attention_heads}")
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size: {self.hidden_size} is not a multiple of num_attention_heads "
                             f"{self.num_attention_heads} (give head_dim explicitly)")
        if self.rotary_dim < 2 or self.rotary_dim % 2:
            raise ValueError(f"partial_rotary_factor: gives rotary_dim {self.rotary_dim}, expected a positive even int")
        if self.rotary_mode not in (0, 1):
            raise ValueError(f"rotary_mode: expected 0 or 1, got {self.rotary_mode!r}")
        if self.rope_scaling is not None:
            kind = self.rope_scaling_type
            if kind not in ROPE_SCALING_TYPES + ("default",):
                raise ValueError(f"rope_scaling: rope_type expected one of {list(ROPE_SCALING_TYPES)}, got {kind!r}")

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def rotary_dim(self) -> int:
        return int(self.dim_per_head * self.partial_rotary_factor)

    @property
    def rope_scaling_type(self) -> str | None:
        if not self.rope_scaling:
            return None
        return self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))

    @property
    def eos_token_ids(self) -> tuple:
        return tuple(self.eos_token_id) if isinstance(self.eos_token_id, (list, tuple)) else (self.eos_token_id,)

    def replace(self, **changes) -> "LlamaConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> "LlamaConfig":
        """From a Hugging Face ``config.json`` dict (unknown keys are kept in ``extra``)."""
        names = {f.name for f in dataclasses.fields(cls)} - {"extra", "rotary_mode"}
        known = {k: v for k, v in raw.items() if k in names and v is not None}
        if isinstance(known.get("eos_token_id"), list):
            known["eos_token_id"] = tuple(known["eos_token_id"])
        return cls(**known, extra={k: v for k, v in raw.items() if k not in names})

    @classmethod
    def from_meta(cls, params: dict[str, Any], vocab_size: int | None = None) -> "LlamaConfig":
        """From Meta's original ``params.json`` (interleaved RoPE, so ``rotary_mode=1``)."""
        dim = params["dim"]
        hidden = int(2 * 4 * dim / 3)
        if params.get("ffn_dim_multiplier") is not None:
            hidden = int(params["ffn_dim_multiplier"] * hidden)
        multiple = params.get("multiple_of", 256)
        hidden = multiple * ((hidden + multiple - 1) // multiple)
        vocab = params.get("vocab_size", -1)
        if vocab is None or vocab < 1:
            if vocab_size is None:
                raise ValueError("params.json: vocab_size is -1 and no embedding tensor gives it")
            vocab = vocab_size
        return cls(vocab_size=vocab, hidden_size=dim, intermediate_size=hidden, num_hidden_layers=params["n_layers"],
                   num_attention_heads=params["n_heads"],
                   num_key_value_heads=params.get("n_kv_heads") or params["n_heads"],
                   max_position_embeddings=params.get("max_seq_len", 4096), rms_norm_eps=params.get("norm_eps", 1e-5),
                   rope_theta=params.get("rope_theta", 10000.0), rotary_mode=1)

    @classmethod
    def from_file(cls, path: str | Path) -> "LlamaConfig":
        return cls.from_hf(json.loads(Path(path).read_text()))

    def to_hf(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("extra", "rotary_mode")}
        out.update({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in out.items() if v is not None}


# Published dimensions (Touvron et al. 2023, "Llama 2", Table 1 and the released params.json files).
PRESETS: dict[str, LlamaConfig] = {
    "7b": LlamaConfig(),
    "13b": LlamaConfig(hidden_size=5120, intermediate_size=13824, num_hidden_layers=40, num_attention_heads=40,
                       num_key_value_heads=40),
    "70b": LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                       num_key_value_heads=8),
    # Small shapes for tests and quick runs (GQA 4/2 so the grouped path always runs).
    "tiny": LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512),
}


def preset(name: str, **changes) -> LlamaConfig:
    if name not in PRESETS:
        raise ValueError(f"model: expected one of {sorted(PRESETS)}, got {name!r}")
    return PRESETS[name].replace(**changes) if changes else PRESETS[name]
