"""This project's own attention: ``models.llama``'s ``LlamaAttention`` and any
``RotaryFlashAttention`` / ``RotaryFlashAttentionOp`` in a user's network already run the fused op.
A Cell says so with the class attribute ``fused_site = True`` (the op package names no class of
the layers above it)."""
from __future__ import annotations

from .family import Family



class ProjectAttention(Family):
    name = "ms_rope_attention"

    def recognises(self, obj) -> bool:
        return getattr(type(obj), "fused_site", False) is True

    def is_installed(self, site) -> bool:
        return True
