"""``python -m models.llama.train``: the training CLI (models/llama/training/cli.py documents it).

The names this module held before training became the package ``models.llama.training`` are read
from here for one release, with a DeprecationWarning naming their new module; ``main`` is the entry
point and stays without one.
"""
from __future__ import annotations

import importlib
import warnings

from .training.cli import main

__all__ = ["main"]
_MOVED = {
    **dict.fromkeys(("ByteTokenizer", "make_tokenizer", "read_documents", "batches", "data_parallel_share"), "data"),
    **dict.fromkeys(("TOKENIZER_FILES", "TRAINER_STATE", "REPLAY_ARGS", "learning_rates", "LossAndGrads",
                     "clip_by_global_norm", "Trainer", "trainer_state", "replay_state", "resume_problems"), "trainer"),
    "StopRequest": "signals", "build_model": "cli", "positive_int": "cli"}


def __getattr__(name: str):
    if name not in _MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = f"models.llama.training.{_MOVED[name]}"
    warnings.warn(f"models.llama.train.{name} moved to {module}.{name}; the old name goes in the next release",
                  DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module(module), name)


if __name__ == "__main__":
    main()
