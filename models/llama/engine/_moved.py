"""The old import paths of the engine's modules (``models.llama.generate``'s names, ``serving``,
``decoding``, ``block_pool``, ``kv_cache``), kept for one release: each is a module ``__getattr__``
that finds the name in its new home and warns (``DeprecationWarning``). Delete with them."""
from __future__ import annotations

import importlib
import warnings


def moved(old: str, *homes: str):
    """A module ``__getattr__`` for ``old``: a name is looked up in ``homes``, in order."""

    def __getattr__(name: str):
        if not name.startswith("__"):
            for home in homes:
                module = importlib.import_module(home)
                if hasattr(module, name):
                    warnings.warn(f"{old}.{name} moved to {home}.{name}; the old path "
                                  "works for one more release", DeprecationWarning, stacklevel=2)
                    return getattr(module, name)
        raise AttributeError(f"module {old!r} has no attribute {name!r}")

    return __getattr__
