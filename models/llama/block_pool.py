"""Deprecated, kept for one release: the paged cache's block pool moved to
``models.llama.engine.block_pool``; a name read here is that module's, with a DeprecationWarning."""
from .engine._moved import moved

__getattr__ = moved(__name__, "models.llama.engine.block_pool")
