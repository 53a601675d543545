"""Makes MindFormers 2.0.0 importable where its hard dependency ``hyper-parallel`` cannot be installed.

MindFormers 2.0.0 (the release built for MindSpore 2.10) requires ``hyper-parallel~=1.0.0``, which is
not on PyPI, and imports it at package import time from its PyNative distributed models (DTensor,
DeviceMesh, ...; some of them call it at module level). The graph-mode Llama the TTFT benchmark runs
never uses any of it. Importing this module first stands in placeholder names for every
``hyper_parallel`` import, so those modules load. That the Llama path does not touch them is checked
by the benchmark, not assumed: MindFormers' logits must equal this project's on the same weights and
prompt (``benchmarks/ttft.py`` compares them).
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import importlib.machinery
import sys
import types

PACKAGE = "hyper_parallel"


class _Placeholder(type):
    """A name imported from hyper_parallel: a class that can be subclassed, instantiated and called,
    whose every attribute and call result is another placeholder."""

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _placeholder(f"{cls.__qualname__}.{name}")


def _placeholder(qualname: str) -> type:
    def instance_getattr(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _placeholder(f"{qualname}.{name}")

    return _Placeholder(qualname.rsplit(".", 1)[-1], (), {
        "__qualname__": qualname, "__init__": lambda self, *args, **kwargs: None,
        "__call__": lambda self, *args, **kwargs: _placeholder(f"{qualname}()"), "__getattr__": instance_getattr})


class _Module(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        value = _placeholder(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name == PACKAGE or name.startswith(PACKAGE + "."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _Module(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


def install() -> None:
    """Stand in placeholders for hyper_parallel unless the real package is installed."""
    if importlib.util.find_spec(PACKAGE) is None and not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.append(_Finder())
