"""Reference Llama2 on the fused RoPE + FlashAttention op (see docs/llama.md)."""
from .config import PRESETS, LlamaConfig, preset
from .model import LlamaForCausalLM

__all__ = ["LlamaConfig", "LlamaForCausalLM", "PRESETS", "preset"]
