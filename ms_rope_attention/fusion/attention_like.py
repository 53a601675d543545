"""Which Cells (or mindtorch modules) compute attention themselves, read from their source: the
``construct`` / ``forward``, or a helper it calls (a module-level function, or a method of the same
class), calls a softmax and a product of two tensors (``@``, ``matmul``, ``bmm``, ``einsum``), or a
known attention op. ``fuse`` lists every such Cell as a site, so that a model whose attention no
family recognises is reported, never a silent zero. Nothing is run; a sub-Cell's call is not
followed (it is a site of its own).
"""
from __future__ import annotations

import ast
import functools
import inspect
import textwrap

KNOWN_OPS = frozenset({
    "flash_attention_score", "FlashAttentionScore", "PromptFlashAttention", "IncreFlashAttention",
    "fused_infer_attention_score", "speed_fusion_attention", "PagedAttention", "scaled_dot_product_attention",
    "multi_head_attention_forward", "rotary_flash_attention", "rotary_paged_attention"})
SOFTMAXES = frozenset({"softmax", "Softmax", "softmax_ext"})
PRODUCTS = frozenset({"matmul", "bmm", "BatchMatMul", "MatMul", "batch_matmul", "einsum", "baddbmm"})
_HELPER_DEPTH = 2  # construct -> helper -> helper's helper


def call_name(node) -> str | None:
    """The called name of ``f(...)`` / ``obj.f(...)`` (None for anything else)."""
    if isinstance(node, ast.Call):
        f = node.func
        return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
    return None


def _function_tree(function) -> ast.AST | None:
    try:
        return ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError, IndentationError):
        return None


def _helpers(tree, cls, globals_) -> list:
    """The Python functions a body calls: ``name(...)`` found in its module, ``self.name(...)`` a plain
    method of ``cls`` (not a sub-Cell, which is an attribute of the instance, not of the class)."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        target = None
        if isinstance(f, ast.Name):
            target = globals_.get(f.id)
        elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "self" \
                and cls is not None:
            target = inspect.getattr_static(cls, f.attr, None)
        if inspect.isfunction(target):
            found.append(target)
    return found


def _calls(function, cls) -> set:
    """Names of everything ``function`` and its helpers (to ``_HELPER_DEPTH``) call, ``@`` as "matmul"."""
    names, seen, frontier = set(), set(), [function]
    for _ in range(_HELPER_DEPTH + 1):
        following = []
        for fn in frontier:
            if fn in seen:
                continue
            seen.add(fn)
            tree = _function_tree(fn)
            if tree is None:
                continue
            for node in ast.walk(tree):
                if isinstance(node, ast.Call):
                    names.add(call_name(node))
                elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.MatMult):
                    names.add("matmul")
            following += _helpers(tree, cls, getattr(fn, "__globals__", {}))
        frontier = following
    return names


@functools.lru_cache(maxsize=None)
def _class_computes_attention(cls) -> bool:
    entry = inspect.getattr_static(cls, "construct", None) or inspect.getattr_static(cls, "forward", None)
    if not inspect.isfunction(entry):
        return False
    names = _calls(entry, cls)
    return bool(names & KNOWN_OPS) or bool(names & SOFTMAXES and names & PRODUCTS)


def computes_attention(obj) -> bool:
    """Whether ``obj``'s own code (not a sub-Cell's) computes attention (``obj``: a Cell or module, or
    its class)."""
    try:
        return _class_computes_attention(obj if isinstance(obj, type) else type(obj))
    except TypeError:  # an unhashable class
        return False
