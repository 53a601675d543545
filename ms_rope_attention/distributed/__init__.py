"""Past one device: context-parallel rotary attention on MindSpore's collectives (msrun; mccl on a
CPU, HCCL on Ascend).

- ``ContextParallelRotaryAttention``: each rank holds two chunks of every sequence (the load-balanced
  layout), gathers K/V across the group and runs the fused op once on its own queries.
- ``load_balanced_chunks`` / ``load_balanced_merge``: the layout, to split a sequence and put the
  ranks' parts back together.
- ``ParallelMesh`` / ``Axis``: the job's data x context x tensor grid and its process groups.
- ``GroupCollective``: a group's AllReduce/AllGather in dtypes the backend carries (on a CPU, a
  sub-group's gather as a padded AllReduce); ``GatherChunks``: its AllGather with a gradient that is
  correct where the backend has no ReduceScatter.
- ``ring_attention_blocks`` / ``merge_by_lse``: the per-block numerics of a ring (send/recv) schedule,
  for Ascend; checked against the one-call op on a single process.
- ``CopyToTensorParallel`` / ``ReduceFromTensorParallel`` / ``GatherFromTensorParallel``: Megatron's
  f and g, and the vocab-parallel logits' gather, for tensor-parallel blocks around the op.
- ``primitive_layouts`` / ``shard_primitive`` / ``check_shard_shapes`` / ``optional_inputs``: the
  semi-auto (Ascend) batch and head layouts of the fused op's primitives, read off the contract
  (``RotaryFlashAttentionOp.semi_auto_shard`` applies them).
- ``launch``: ``python -m ms_rope_attention.distributed.launch --workers N script.py``, msrun set up.
"""
from .collectives import GatherChunks, GroupCollective, group_geometry
from .context_parallel import ContextParallelRotaryAttention, load_balanced_chunks, load_balanced_merge
from .mesh import Axis, ParallelMesh
from .ring import merge_by_lse, ring_attention_blocks
from ..layouts import check_shard_shapes, optional_inputs, primitive_layouts, shard_primitive
from .tensor_parallel import CopyToTensorParallel, GatherFromTensorParallel, ReduceFromTensorParallel

__all__ = ["Axis", "ContextParallelRotaryAttention", "CopyToTensorParallel", "GatherChunks", "GatherFromTensorParallel",
           "GroupCollective", "ParallelMesh", "ReduceFromTensorParallel",
           "group_geometry", "load_balanced_chunks", "load_balanced_merge", "merge_by_lse", "ring_attention_blocks",
           "check_shard_shapes", "optional_inputs", "primitive_layouts", "shard_primitive"]
