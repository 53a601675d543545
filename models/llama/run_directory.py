"""Moved to ``models.llama.training.run_directory``; this path works for one release (a DeprecationWarning)."""
import sys
import warnings

from .training import run_directory

warnings.warn("models.llama.run_directory moved to models.llama.training.run_directory; this path goes in the "
              "next release", DeprecationWarning, stacklevel=2)
sys.modules[__name__] = run_directory  # one module under both names, so a test's monkeypatch reaches the one in use
