"""Deprecated, kept for one release: what the two engines share moved to
``models.llama.engine.common``; a name read here is that module's, with a DeprecationWarning."""
from .engine._moved import moved

__getattr__ = moved(__name__, "models.llama.engine.common")
