"""Deprecated, kept for one release: the two KV caches moved to
``models.llama.engine.kv_cache``; a name read here is that module's, with a DeprecationWarning."""
from .engine._moved import moved

__getattr__ = moved(__name__, "models.llama.engine.kv_cache")
