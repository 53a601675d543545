"""Llama configuration: published presets, and parsing of Hugging Face / Meta config files."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The RoPE scaling rules this model computes, and the fields each one honours (Hugging Face names).
# A field outside its rule's set is an error: silently ignoring it would give wrong logits.
ROPE_SCALING_FIELDS = {
    "linear": {"factor"},
    "dynamic": {"factor", "original_max_position_embeddings"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
    "yarn": {"factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow", "mscale",
             "mscale_all_dim", "truncate"},
}
ROPE_SCALING_TYPES = tuple(ROPE_SCALING_FIELDS)
# Meta's reference apply_scaling constants for params.json "use_scaled_rope": true (Llama 3.1 / 3.2).
META_SCALED_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192}


def rope_settings(raw: dict[str, Any]) -> tuple[float, dict | None, float]:
    """(rope_theta, rope_scaling or None, partial_rotary_factor) from a Hugging Face config dict, in
    either spelling: transformers >= 5 ``rope_parameters`` {"rope_type", "rope_theta", scaling fields,
    "partial_rotary_factor"}, or the older top-level ``rope_theta`` / ``rope_scaling`` (whose kind is
    ``type`` or ``rope_type``) / ``partial_rotary_factor``. The scaling comes back normalised:
    {"rope_type": kind, fields...}, or None for plain RoPE."""
    theta = raw.get("rope_theta")
    partial = raw.get("partial_rotary_factor")
    scaling = raw.get("rope_scaling")
    params = raw.get("rope_parameters")
    if params is not None:
        if not isinstance(params, dict):
            raise ValueError(f"rope_parameters: expected a dict, got {params!r}")
        if any(isinstance(v, dict) for v in params.values()):
            raise ValueError("rope_parameters: per-layer-type RoPE settings (a dict of dicts) are not supported "
                             f"by this Llama; got keys {sorted(params)}")
        params = dict(params)
        for name, top in (("rope_theta", theta), ("partial_rotary_factor", partial)):
            if name in params and top is not None and params[name] != top:
                raise ValueError(f"{name}: {top!r} at the top level and {params[name]!r} in rope_parameters disagree")
        theta = params.pop("rope_theta", theta)
        partial = params.pop("partial_rotary_factor", partial)
        if scaling is not None and _normalise_scaling(scaling) != _normalise_scaling(params):
            raise ValueError(f"rope_scaling {scaling!r} and rope_parameters {params!r} disagree")
        scaling = params
    return (10000.0 if theta is None else float(theta), _normalise_scaling(scaling),
            1.0 if partial is None else float(partial))


def _normalise_scaling(scaling) -> dict | None:
    if scaling is None:
        return None
    if not isinstance(scaling, dict):
        raise ValueError(f"rope_scaling: expected a dict, got {scaling!r}")
    fields = dict(scaling)
    kinds = {fields.pop(key) for key in ("rope_type", "type") if key in fields}
    if len(kinds) > 1:
        raise ValueError(f"rope_scaling: 'type' and 'rope_type' disagree: {sorted(kinds)}")
    kind = kinds.pop() if kinds else None
    if kind in (None, "default"):
        if fields:
            raise ValueError(f"rope_scaling: plain RoPE (rope_type {kind!r}) takes no scaling fields, got "
                             f"{sorted(fields)}")
        return None
    return {"rope_type": kind, **fields}


# transformers' LlamaConfig defaults for the fields a config.json may leave out (num_key_value_heads
# defaults to num_attention_heads there).
HF_DEFAULTS = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
               "num_attention_heads": 32, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
               "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}
# config.json fields whose other values this model does not compute: field -> the values it supports
# (None, the field's absence, is always supported).
UNSUPPORTED_HF_FIELDS = {"hidden_act": ("silu",), "attention_bias": (False,), "mlp_bias": (False,),
                         "sliding_window": ()}


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
            unknown = set(self.rope_scaling) - {"rope_type", "type"} - ROPE_SCALING_FIELDS.get(kind, set())
            if unknown:
                raise ValueError(f"rope_scaling: {kind!r} scaling does not use {sorted(unknown)}; supported fields: "
                                 f"{sorted(ROPE_SCALING_FIELDS.get(kind, set()))}")
        if not 0 < self.partial_rotary_factor <= 1:
            raise ValueError(f"partial_rotary_factor: expected a float in (0, 1], got {self.partial_rotary_factor!r}")

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
        """From a Hugging Face ``config.json`` dict (unknown keys are kept in ``extra``). A field the
        file leaves out takes transformers' ``LlamaConfig`` default (``HF_DEFAULTS``), not this
        class's 7B-preset default: a file is read as transformers reads it. What this model does not
        compute (an activation other than SiLU, a sliding window) is refused, naming the field."""
        names = {f.name for f in dataclasses.fields(cls)} - {"extra", "rotary_mode"}
        for name, supported in UNSUPPORTED_HF_FIELDS.items():
            if raw.get(name) is not None and raw[name] not in supported:
                expected = " or ".join(map(repr, supported)) or "null (absent)"
                raise ValueError(f"{name}: {raw[name]!r} is not supported; this Llama computes {name} = {expected}")
        rope = dict(zip(("rope_theta", "rope_scaling", "partial_rotary_factor"), rope_settings(raw)))
        raw = {k: v for k, v in raw.items() if k not in ("rope_parameters", *rope)}
        known = {**HF_DEFAULTS, **{k: v for k, v in raw.items() if k in names and v is not None}}
        known.setdefault("num_key_value_heads", known.get("num_attention_heads", 32))
        known.update(rope)
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
                   rope_theta=params.get("rope_theta", 10000.0),
                   rope_scaling=dict(META_SCALED_ROPE) if params.get("use_scaled_rope") else None, rotary_mode=1)

    @classmethod
    def from_file(cls, path: str | Path) -> "LlamaConfig":
        return cls.from_hf(json.loads(Path(path).read_text()))

    def to_hf(self) -> dict[str, Any]:
        """The older (transformers < 5) spelling, which every version reads."""
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
