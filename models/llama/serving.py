"""Deprecated, kept for one release: the paged engine (``PagedGenerator``) moved to
``models.llama.engine.paged``; a name read here is that module's, with a DeprecationWarning."""
from .engine._moved import moved

__getattr__ = moved(__name__, "models.llama.engine.paged")
