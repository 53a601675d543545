"""Reference Llama2 on the fused RoPE + FlashAttention op (see docs/llama.md)."""
from .config import PRESETS, LlamaConfig, preset
from .losses import IGNORE_INDEX, LlamaForTraining
from .model import LlamaForCausalLM

__all__ = ["IGNORE_INDEX", "LlamaConfig", "LlamaForCausalLM", "LlamaForTraining", "PRESETS", "preset"]
