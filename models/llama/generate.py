"""Text generation from the command line: ``python -m models.llama.generate`` runs either engine of
``models.llama.engine`` on a checkpoint or a preset (``engine/cli.py`` documents the options).

    python -m models.llama.generate --checkpoint DIR --prompt "The capital of France is"
    python -m models.llama.generate --model tiny --ids 1,15,27 --ids 1,15,28 --paged

``main`` is the entry point's, as ``models.llama.train.main``. The other names this module held
(``Generator``, ``Sequence``, ``sample``, ``Token``, ...) are read from their new homes with a
DeprecationWarning, for one release: import them from ``models.llama.engine``.
"""
from .engine._moved import moved
from .engine.cli import main

__getattr__ = moved(__name__, "models.llama.engine.contiguous", "models.llama.engine.common",
                    "models.llama.engine.paged", "models.llama.engine.kv_cache", "models.llama.model")

if __name__ == "__main__":
    main()
