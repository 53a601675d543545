"""The helpers a block calls (its RoPE function, its head repeats), found without evaluating the
user's expressions and checked on small probes: what they compute decides the op's rotary mode, or
why the block is not fused."""
from __future__ import annotations

import ast
import inspect

import numpy as np
from mindspore import Tensor, ops

from ...rope import interleaved_permutation
from ..family import eager
from .match import Refused


PER_SITE = "decided per site"  # a helper that is the site's own method or sub-Cell


def _helper(expr, globals_, site=None):
    """The callee of a RoPE or head-repeat call, found without evaluating anything (a call expression
    could run the user's code): ``name`` or ``module.name`` in the construct's module, or ``self.name``,
    a method or sub-Cell of the site (``PER_SITE`` while there is no site to read it from)."""
    if isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name) and expr.value.id == "self":
        if site is None:
            return PER_SITE
        found = getattr(site, expr.attr, None)
        if not callable(found):
            raise Refused(f"its helper {ast.unparse(expr)!r} is not callable")
        return found
    node, path = expr, []
    while isinstance(node, ast.Attribute):
        path.insert(0, node.attr)
        node = node.value
    found = globals_.get(node.id) if isinstance(node, ast.Name) else None
    for attr in path:
        found = vars(found).get(attr) if inspect.ismodule(found) else None
    if not callable(found):
        raise Refused(f"its helper {ast.unparse(expr)!r} is not a function of its module (a name or module.name) "
                       f"nor a method or sub-Cell (self.name)")
    return found


def _reference_rotation(mode: int, width: int):
    """rot(x) of the op's rotary mode over ``width`` features, in numpy (the probes' reference)."""
    if mode == 0:
        return lambda x: np.concatenate([-x[..., width // 2:], x[..., :width // 2]], -1)
    index, sign = interleaved_permutation(width)
    return lambda x: x[..., index] * sign


def _rope_mode(rope, complex_rotations=False):
    """(rotary_mode, None) when ``rope(q, k, cos, sin)`` computes rotate-half (mode 0) or interleaved
    (mode 1, GPT-J's rotate-every-two) RoPE on a probe, over the whole head or, with tables half its
    width, over its first half (partial rotary: the rest passes through), with (S, W) tables or, for a
    function that expects a batch axis, (1, S, W); (None, the reason) otherwise."""
    rng = np.random.default_rng(7)
    q, k = (rng.standard_normal((1, 2, 5, 8)).astype(np.float32) for _ in range(2))
    if complex_rotations:
        return _complex_rope_mode(rope, q, k)

    def rotated(x, cos, sin, rotate):
        width = cos.shape[-1]
        part = x[..., :width]
        return np.concatenate([part * cos + rotate(part) * sin, x[..., width:]], -1)

    failure = None
    for width in (8, 4):
        cos, sin = (rng.standard_normal((5, width)).astype(np.float32) for _ in range(2))
        for tables in ((cos, sin), (cos[None], sin[None])):
            try:
                with eager():
                    got = [g.asnumpy() for g in rope(*(Tensor(a) for a in (q, k, *tables)))]
            except Exception as exc:  # noqa: BLE001
                failure = failure or f"its RoPE function failed on a probe ({type(exc).__name__}: {exc})"
                continue
            for mode in (0, 1):
                rotate = _reference_rotation(mode, width)
                if all(g.shape == x.shape and np.allclose(g, rotated(x, cos, sin, rotate), atol=1e-5)
                       for g, x in zip(got, (q, k))):
                    return mode, None
            return None, "its RoPE function is neither rotate-half nor interleaved RoPE (checked on a probe)"
    return None, failure


def polar_rotations(angles):
    """Unit complex numbers at ``angles``: the ``freqs_cis`` a complex-pair RoPE expects."""
    return ops.polar(ops.ones_like(angles), angles)


def _complex_rope_mode(rope, q, k):
    """(1, None) when ``rope(q, k, freqs_cis)`` rotates each pair (2i, 2i + 1) of features as a complex
    number by ``freqs_cis`` ((S, D / 2) complex, Meta's Llama): interleaved RoPE with each table
    entry twice; (None, the reason) otherwise."""
    angles = np.random.default_rng(5).standard_normal((5, 4)).astype(np.float32)
    cos, sin = np.repeat(np.cos(angles), 2, -1), np.repeat(np.sin(angles), 2, -1)
    try:
        with eager():
            got = [g.asnumpy() for g in rope(Tensor(q), Tensor(k), polar_rotations(Tensor(angles)))]
    except Exception as exc:  # noqa: BLE001
        return None, f"its RoPE function failed on a probe ({type(exc).__name__}: {exc})"
    every_two = _reference_rotation(1, q.shape[-1])
    if all(g.shape == x.shape and np.allclose(g, x * cos + every_two(x) * sin, atol=1e-5) for g, x in zip(got, (q, k))):
        return 1, None
    return None, "its RoPE function does not rotate feature pairs by freqs_cis (checked on a probe)"


def _is_head_repeat(function) -> bool:
    """Whether ``function(x, n)`` repeats each of x's (B, N, S, D) heads n times in place (``repeat_kv``),
    on a probe."""
    x = np.random.default_rng(3).standard_normal((1, 2, 3, 4)).astype(np.float32)
    try:
        with eager():
            return all(np.array_equal(function(Tensor(x), n).asnumpy(), np.repeat(x, n, axis=1)) for n in (1, 2))
    except Exception:  # noqa: BLE001
        return False


def check_helpers(found, globals_, site=None):
    """(rotary_mode, None) when the block's RoPE function and head-repeat helpers compute what the
    fused op assumes, on probes; (None, the reason) otherwise; (None, ``PER_SITE``) when one is the
    site's own method or sub-Cell and no site is given."""
    rope = _helper(found["rope"], globals_, site)
    helpers = [_helper(expr, globals_, site) for expr in found["repeats"]]
    if rope is PER_SITE or PER_SITE in helpers:
        return None, PER_SITE
    mode, reason = _rope_mode(rope, found["complex"])
    if reason:
        return None, reason
    for expr, helper in zip(found["repeats"], helpers):
        if not _is_head_repeat(helper):
            return None, (f"its helper {ast.unparse(expr)!r} before the scores is not a head repeat (repeat_kv) "
                          f"on a probe")
    return mode, None


