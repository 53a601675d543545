"""Deprecated: the semi-auto layouts moved to ``ms_rope_attention.layouts`` (the op's floor); this
module re-exports them for one release. ``shard_fused`` became ``layouts.shard``."""
from ..layouts import check_shard_shapes, optional_inputs, primitive_layouts, shard_primitive  # noqa: F401
