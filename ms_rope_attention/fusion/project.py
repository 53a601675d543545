"""This project's own attention: ``models.llama``'s ``LlamaAttention`` and any
``RotaryFlashAttention`` / ``RotaryFlashAttentionOp`` in a user's network already run the fused op."""
from __future__ import annotations

from .family import Family, class_path

OWN_CLASSES = {"models.llama.model.LlamaAttention", "ms_rope_attention.nn.RotaryFlashAttention",
               "ms_rope_attention.functional.RotaryFlashAttentionOp"}


class ProjectAttention(Family):
    name = "ms_rope_attention"

    def recognises(self, obj) -> bool:
        return class_path(obj) in OWN_CLASSES

    def is_installed(self, site) -> bool:
        return True
