"""Deprecated, kept for one release: this module's three concepts have rooms of their own.

- ``TensorParallel``: ``models.llama.tensor_parallel``;
- ``IGNORE_INDEX``, ``ContextParallelTraining``, ``shifted_targets``, ``context_parallel_batch`` (and
  ``LlamaForTraining``, which was in ``models.llama.model``): ``models.llama.losses``;
- ``gathered_state``, ``scatter_state``: ``models.llama.weights``.

Nothing in the repository imports this module.
"""
from .losses import IGNORE_INDEX, ContextParallelTraining, context_parallel_batch, shifted_targets  # noqa: F401
from .tensor_parallel import TensorParallel  # noqa: F401
from .weights import gathered_state, scatter_state  # noqa: F401
