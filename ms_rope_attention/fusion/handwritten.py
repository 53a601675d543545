"""A MindSpore Cell whose attention is written by hand, as people port it from Hugging Face's eager
code, recognised from its ``construct``'s source and checked by what it computes:

    q, k = <rope>(q, k, cos, sin)        (or <rope>(q, k, freqs_cis), complex pairs) a function of its
                                         module, or a method or sub-Cell of the site:
                                         rotate-half or interleaved RoPE on a probe, whole
                                         heads or their first half (partial rotary)
    k = repeat_kv(k, n); v = ...         optional head repeats (a probe says they repeat heads)
    q = q * scale                        optional
    scores = q @ k^T * scale + mask      in one expression or several statements; ``masked_fill`` /
                                         ``where`` with a boolean mask; casts anywhere
    probs = softmax(scores, axis=-1)     any spelling of the last axis; casts around it; dropout after
    out = probs @ v                      or inside the next statement (``return o_proj(probs @ v ...)``)

on BNSD tensors, or (B * N, S, D) ones for ``bmm``. ``construct`` is rebuilt from its own syntax tree
with that block inside ``if <this call is the op's>: out = <fused op> else: <the block>`` (the check:
an exactly causal mask, one set of rotations for the batch, no dropout while training), compiled
from memory (no file: MindSpore's graph parser reads the source a file would hold from
``linecache``), and installed by a class swap on the instance. Refused, with the reason: any other
shape of code (where the reading stopped), a RoPE or head-repeat callee given by an expression (never
evaluated) or failing its probe, or names the block assigns read after it.
"""
from __future__ import annotations

import ast
import hashlib
import inspect
import linecache
import textwrap

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops

from ..functional import rotary_flash_attention
from ..rope import interleaved_permutation, rope_tables
from .attention_like import call_name
from .family import Family, eager
from .masks import additive_mask_is_causal, bool_mask_is_causal, fallback_announcer

_MATMULS = {"matmul", "bmm", "BatchMatMul"}


class _NotMatched(Exception):
    """The construct is not in the recognised style (the message says where)."""


class _Refused(Exception):
    """The construct is in the style, but is not fused: fusing it would change what it computes, or
    its RoPE function cannot be checked (the reason)."""


def _name(node) -> str:
    if not isinstance(node, ast.Name):
        raise _NotMatched(f"expected a plain name, got {ast.unparse(node)!r}")
    return node.id


def _transposed_last_two(node) -> str:
    """The name of k in ``k.swapaxes(-1, -2)`` / ``k.transpose(0, 1, 3, 2)`` / ``k.permute(0, 1, 3, 2)`` /
    ``ops.transpose(k, (0, 1, 3, 2))`` / ``ops.swapaxes(k, 2, 3)`` / ``ops.permute(k, (0, 1, 3, 2))``."""
    text = ast.unparse(node).replace(" ", "")
    swaps = ("(-1,-2)", "(-2,-1)", "(2,3)", "(3,2)", "(1,2)", "(2,1)")  # the last two: (B * N, S, D) tensors
    orders = ("(0,1,3,2)", "(0,2,1)")
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        method = node.func.attr
        if method == "swapaxes" and len(node.args) == 2 and text.endswith(swaps):
            return _name(node.func.value)
        if method in ("transpose", "permute") and len(node.args) in (3, 4) and text.endswith(orders):
            return _name(node.func.value)
        if method in ("transpose", "permute") and len(node.args) == 2 and text.endswith(
                tuple(f",{o})" for o in orders)):
            return _name(node.args[0])
        if method == "swapaxes" and len(node.args) == 3 and text.endswith(tuple(s.replace("(", ",") for s in swaps)):
            return _name(node.args[0])
    raise _NotMatched(f"expected key transposed on its last two axes, got {ast.unparse(node)!r}")


def _matmul_operands(node):
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.MatMult):
        return node.left, node.right
    if call_name(node) in _MATMULS and len(node.args) == 2:
        return node.args
    raise _NotMatched(f"expected a matmul, got {ast.unparse(node)!r}")


def _uncast(node):
    """x of ``x.astype(t)`` / ``x.to(t)`` / ``x.float()`` / ``ops.cast(x, t)`` (any nesting): a softmax
    in float32 cast back computes the same attention."""
    while isinstance(node, ast.Call):
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr in ("astype", "to", "float") and len(node.args) <= 1:
            node = f.value
        elif call_name(node) == "cast" and len(node.args) == 2:
            node = node.args[0]
        else:
            break
    return node


def _factor(op, scale) -> str:
    """The factor ``x * scale`` / ``x / scale`` applies, as source."""
    text = ast.unparse(scale)
    return text if isinstance(op, ast.Mult) else f"1.0 / ({text})"


def _score_terms(node, q, keys):
    """(scale factors as source, mask as (BinOp, side) or None) of ``matmul(q, key^T)`` scaled (``*``,
    ``/``, either side) and at most once masked (``+ mask``, either side); ``keys``: the names that
    hold the rotated key (repeated or not)."""
    node = _uncast(node)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        for product, side in ((node.left, "right"), (node.right, "left")):
            try:
                factors, mask = _score_terms(product, q, keys)
            except _NotMatched:
                continue
            if mask is None:
                return factors, (node, side, None, "additive")
        raise _NotMatched(f"expected 'scores + mask', got {ast.unparse(node)!r}")
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Mult, ast.Div)):
        sides = [(node.left, node.right)] + ([(node.right, node.left)] if isinstance(node.op, ast.Mult) else [])
        for product, scale in sides:
            try:
                factors, mask = _score_terms(product, q, keys)
            except _NotMatched:
                continue
            if mask is None:  # a scale applied after the mask would scale the mask too: not this form
                return factors + [_factor(node.op, scale)], None
        raise _NotMatched(f"expected 'scores * scale', got {ast.unparse(node)!r}")
    left, right = _matmul_operands(node)
    if _name(_uncast(left)) != q or _transposed_last_two(_uncast(right)) not in keys:
        raise _NotMatched(f"expected scores from q and key^T, got {ast.unparse(node)!r}")
    return [], None


def _boolean_mask(node, scores):
    """(call, "args", index, kind) of a boolean mask applied to the scores: ``scores.masked_fill(m, x)``
    or ``ops.masked_fill(scores, m, x)`` (True hides: kind "hide"), ``ops.where(m, scores, x)`` (True
    keeps: kind "keep"); None for anything else. The fill value is not read: the probe judges it."""
    if not isinstance(node, ast.Call) or node.keywords:
        return None
    name, args = call_name(node), [ast.unparse(a) for a in node.args]
    method = isinstance(node.func, ast.Attribute) and ast.unparse(node.func.value) == scores
    if name == "masked_fill" and method and len(args) == 2:
        return node, "args", 0, "hide"
    if name == "masked_fill" and len(args) == 3 and args[0] == scores:
        return node, "args", 1, "hide"
    if name == "where" and len(args) == 3 and args[1] == scores:
        return node, "args", 0, "keep"
    return None


def _targets(stmt) -> list:
    """(name, value) pairs of ``a = x`` or ``a, b = x, y``; a refusal for anything else."""
    if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
        target, value = stmt.targets[0], stmt.value
        if isinstance(target, ast.Name):
            return [(target.id, value)]
        if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) and len(target.elts) == len(value.elts) \
                and all(isinstance(e, ast.Name) for e in target.elts):
            return [(t.id, v) for t, v in zip(target.elts, value.elts)]
    raise _NotMatched(f"expected 'name = ...', got {ast.unparse(stmt)!r}")


def _is_softmax_last_axis(node) -> bool:
    axis = [k.value for k in node.keywords if k.arg in ("axis", "dim")] or node.args[1:2]
    return len(axis) == 1 and ast.unparse(axis[0]).replace(" ", "") == "-1" and \
        all(k.arg in ("axis", "dim", "dtype") for k in node.keywords)


_HOISTED = "rfa_attention_out"


def _inline_output(stmt, probs):
    """The ``matmul(probs, v)`` inside a larger expression of ``stmt`` (not a statement of its own)."""
    if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
        top = _uncast(stmt.value)
        try:
            _matmul_operands(top)
            return None  # 'out = matmul(probs, v)': the plain form
        except _NotMatched:
            pass
    for node in ast.walk(stmt):
        try:
            left, right = _matmul_operands(node)
        except _NotMatched:
            continue
        if isinstance(_uncast(left), ast.Name) and _uncast(left).id == probs and isinstance(_uncast(right), ast.Name):
            return node
    return None


def _match_block(stmts):
    """From a RoPE call ``q, k = rope(q, k, cos, sin)`` to the attention's output ``out = probs @ v``:
    the names, the scale (source), the mask's place, the head-repeat helpers it calls, whether the
    probabilities go through dropout, and how many statements the block spans. In between, in this
    order: head repeats of k and v (``k = repeat_kv(k, n)``, one or two per statement, checked on a
    probe later), a scale on q, the scores (scaled and masked in one expression or in statements of
    their own, casts anywhere), a softmax over the last axis (casts around it), dropout on it."""
    rope = stmts[0]
    if not (isinstance(rope, ast.Assign) and isinstance(rope.targets[0], ast.Tuple) and len(rope.targets[0].elts) == 2
            and isinstance(rope.value, ast.Call) and len(rope.value.args) in (3, 4) and not rope.value.keywords):
        raise _NotMatched("expected 'q, k = rope(q, k, cos, sin)' or 'q, k = rope(q, k, freqs_cis)'")
    q, k = (_name(e) for e in rope.targets[0].elts)
    args = [_name(a) for a in rope.value.args]
    if len(args) == 3:  # rope(q, k, freqs_cis): complex rotations, whose real and imaginary parts are the tables
        args = [q, k, f"self.rfa_cos_of({args[2]})", f"self.rfa_sin_of({args[2]})"]
    if args[:2] != [q, k]:
        raise _NotMatched("the RoPE call must rotate q and k in place: 'q, k = rope(q, k, cos, sin)'")
    keys, repeated, repeats = {k}, {}, []  # names holding the rotated key; repeated name -> its source
    q_factors, factors, mask, scores, probs, dropout = [], [], None, None, None, False

    def matched(out, value, count, **extra):
        """What was found, once the product of the probabilities with ``value`` (v) is reached."""
        if mask is None:
            raise _Refused("its scores have no mask: the attention is not causal")
        v = _name(value)
        return {"q": q, "k": k, "cos": args[2], "sin": args[3], "v": repeated.get(v, v), "mask": mask,
                "scale": " * ".join(q_factors + factors) or "1.0", "out": out, "count": count,
                "assigned": {q, k, scores, probs, *keys, *repeated}, "rope": rope.value.func,
                "complex": len(rope.value.args) == 3, "repeats": repeats, "dropout": dropout, **extra}

    for count, stmt in enumerate(stmts[1:], 2):
        if probs is not None:
            inline = _inline_output(stmt, probs)
            if inline is not None:  # 'return o_proj(matmul(probs, v) ...)': the product hoisted into a name
                return matched(_HOISTED, _uncast(_matmul_operands(inline)[1]), count - 1, inline=(stmt, inline))
        pairs = _targets(stmt)
        values = [_uncast(v) for _, v in pairs]
        # head repeats: 'k = repeat_kv(k, n)'
        if scores is None and all(isinstance(v, ast.Call) and len(v.args) == 2 and not v.keywords
                                  and isinstance(v.args[0], ast.Name) and v.args[0].id != q
                                  and call_name(v) not in _MATMULS for v in values):
            for (target, _), value in zip(pairs, values):
                source = value.args[0].id
                repeats.append(value.func)
                if source in keys:
                    keys.add(target)
                repeated[target] = repeated.get(source, source)
            continue
        if len(pairs) != 1:
            raise _NotMatched(f"expected one assignment, got {ast.unparse(stmt)!r}")
        (target, value), = pairs
        if scores is None and target == q and isinstance(value, ast.BinOp) \
                and isinstance(value.op, (ast.Mult, ast.Div)) and ast.unparse(value.left) == q:
            q_factors.append(_factor(value.op, value.right))  # a scale on q
            continue
        if scores is None:
            inner = _uncast(value)
            softmax = call_name(inner) == "softmax" and inner.args and _is_softmax_last_axis(inner)
            try:  # the scores, or a softmax of them in the same expression
                factors, mask = _score_terms(inner.args[0] if softmax else value, q, keys)
            except _NotMatched:
                raise _NotMatched(f"expected the scores from q and the key (scaled, plus one mask), got "
                                  f"{ast.unparse(stmt)!r}") from None
            scores = target
            probs = target if softmax else None
            continue
        if probs is None:
            inner = _uncast(value)
            if call_name(inner) == "softmax" and inner.args and not _is_softmax_last_axis(inner):
                raise _NotMatched(f"a softmax not over the last axis (the keys): {ast.unparse(stmt)!r}")
            if call_name(inner) == "softmax" and inner.args:
                if not (isinstance(_uncast(inner.args[0]), ast.Name) and _uncast(inner.args[0]).id == scores):
                    raise _NotMatched(f"expected a softmax of {scores}, got {ast.unparse(stmt)!r}")
                probs = target
                continue
            if target != scores:
                raise _NotMatched(f"expected '{scores} = ...' or a softmax over the last axis, got "
                                  f"{ast.unparse(stmt)!r}")
            if isinstance(inner, ast.Name) and inner.id == scores:  # a cast of the scores
                continue
            if isinstance(inner, ast.BinOp) and isinstance(inner.op, ast.Add) and mask is None:
                operands = [inner.left, inner.right]
                sides = [ast.unparse(o) for o in operands]
                if sides.count(scores) == 1:
                    mask = (inner, "right" if sides[0] == scores else "left", None, "additive")
                    continue
            boolean = _boolean_mask(inner, scores) if mask is None else None
            if boolean is not None:
                mask = boolean
                continue
            if isinstance(inner, ast.BinOp) and isinstance(inner.op, (ast.Mult, ast.Div)) and mask is None \
                    and ast.unparse(inner.left) == scores:
                factors.append(_factor(inner.op, inner.right))
                continue
            raise _NotMatched(f"expected the scores scaled or masked, got {ast.unparse(stmt)!r}")
        inner = _uncast(value)
        if isinstance(inner, ast.Name) and inner.id == probs and target == probs:
            continue  # the probabilities cast back
        if target == probs and "dropout" in (call_name(inner) or "").lower() \
                and inner.args and isinstance(inner.args[0], ast.Name) and inner.args[0].id == probs:
            dropout = True  # 'probs = dropout(probs, ...)' / 'probs = self.attn_dropout(probs)'
            continue
        left, right = _matmul_operands(inner)
        if not (isinstance(_uncast(left), ast.Name) and _uncast(left).id == probs):
            raise _NotMatched(f"expected '{target} = matmul({probs}, v)', got {ast.unparse(stmt)!r}")
        return matched(target, _uncast(right), count)
    raise _NotMatched("the block after the RoPE call ends before the attention's output")


def _reads(stmts, names) -> set:
    return {n.id for s in stmts for n in ast.walk(s) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)} & names


def _expression(source: str):
    return ast.parse(source, mode="eval").body


def _rebuild(function):
    """(new construct source, the matched names and expressions), or raise _NotMatched / _Refused."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    fn = tree.body[0]
    if not isinstance(fn, ast.FunctionDef) or fn.decorator_list:
        raise _NotMatched("construct is not a plain method")
    body = fn.body
    reason = "no 'q, k = rope(q, k, cos, sin)' followed by the scores, a softmax and its product with v"
    for i in range(len(body)):
        try:
            found = _match_block(body[i:])
        except _NotMatched as exc:
            if i and isinstance(body[i], ast.Assign) and isinstance(body[i].targets[0], ast.Tuple) \
                    and isinstance(body[i].value, ast.Call) and len(body[i].value.args) in (3, 4):
                reason = f"after its RoPE call: {exc}"  # the nearest miss says where reading stopped
            continue
        block, later = body[i:i + found["count"]], body[i + found["count"]:]
        if "inline" in found:  # the product becomes a statement of the block; its statement reads the name
            stmt, product = found["inline"]
            hoisted = ast.Assign(targets=[ast.Name(_HOISTED, ast.Store())], value=product)
            for parent in ast.walk(stmt):
                for field, child in ast.iter_fields(parent):
                    if child is product:
                        setattr(parent, field, ast.Name(_HOISTED, ast.Load()))
                    elif isinstance(child, list) and any(c is product for c in child):
                        setattr(parent, field, [ast.Name(_HOISTED, ast.Load()) if c is product else c for c in child])
            block = block + [hoisted]
        # the fused branch leaves q and k un-rotated, v un-repeated and computes no scores/probs: nothing
        # after may read a name the block assigned, but its output (unless it first assigns it again,
        # which this check does not follow: it refuses instead)
        used = _reads(later, found["assigned"] - {found["out"]})
        if used:
            raise _Refused(f"{sorted(used)} (rotated q/k, repeated k/v, scores or probabilities) are read after "
                           f"the attention")
        # Only self's methods and the block's own names: MindSpore's graph parser resolves every other
        # name in the user's module.
        attend = ast.parse(f"{found['out']} = self.rfa_attend({found['q']}, {found['k']}, {found['v']}, "
                           f"{found['cos']}, {found['sin']}, {found['scale']})").body
        masked, field, index, kind = found["mask"]
        operand = getattr(masked, field) if index is None else getattr(masked, field)[index]
        mask_source = ast.unparse(operand)
        # the fallback's announcement wraps the mask operand (the mask may be any expression)
        wrapped = _expression(f"self.rfa_fallback({mask_source}, {found['cos']})")
        if index is None:
            setattr(masked, field, wrapped)
        else:
            getattr(masked, field)[index] = wrapped
        fused = ast.If(test=_expression(f"self.rfa_applies({mask_source}, {found['cos']})"), body=attend,
                       orelse=block)
        fn.body = body[:i] + [fused] + later
        fn.name = "construct"
        return ast.unparse(ast.fix_missing_locations(tree)), dict(found, mask=mask_source, mask_kind=kind)
    raise _NotMatched(reason)


def _compile(source: str, globals_: dict):
    """The rebuilt construct, compiled from memory. MindSpore's graph parser reads a construct's
    source with ``inspect.getsourcelines``, which reads ``linecache``: the source is registered there
    under a ``<...>`` name, which linecache never looks up on disk (a file in a shared directory is
    one another user can plant or swap). The parser falls back to the function's ``source``
    attribute when linecache was cleared (IPython clears it)."""
    name = f"<ms_rope_attention fused construct {hashlib.sha256(source.encode()).hexdigest()[:16]}>"
    lines = source.splitlines(keepends=True)
    linecache.cache[name] = (len(source), None, lines, name)
    namespace = dict(globals_)
    exec(compile(source, name, "exec"), namespace)  # noqa: S102 (the user's own construct, rebuilt)
    construct = namespace["construct"]
    construct.source = (lines, 1)  # what getsourcelines returns for it: its lines, from line 1
    return construct


_PER_SITE = "decided per site"  # a helper that is the site's own method or sub-Cell


def _helper(expr, globals_, site=None):
    """The callee of a RoPE or head-repeat call, found without evaluating anything (a call expression
    could run the user's code): ``name`` or ``module.name`` in the construct's module, or ``self.name``,
    a method or sub-Cell of the site (``_PER_SITE`` while there is no site to read it from)."""
    if isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name) and expr.value.id == "self":
        if site is None:
            return _PER_SITE
        found = getattr(site, expr.attr, None)
        if not callable(found):
            raise _Refused(f"its helper {ast.unparse(expr)!r} is not callable")
        return found
    node, path = expr, []
    while isinstance(node, ast.Attribute):
        path.insert(0, node.attr)
        node = node.value
    found = globals_.get(node.id) if isinstance(node, ast.Name) else None
    for attr in path:
        found = vars(found).get(attr) if inspect.ismodule(found) else None
    if not callable(found):
        raise _Refused(f"its helper {ast.unparse(expr)!r} is not a function of its module (a name or module.name) "
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


def _complex_rotations(angles):
    return ops.polar(ops.ones_like(angles), angles)


def _complex_rope_mode(rope, q, k):
    """(1, None) when ``rope(q, k, freqs_cis)`` rotates each pair (2i, 2i + 1) of features as a complex
    number by ``freqs_cis`` ((S, D / 2) complex, Meta's Llama): interleaved RoPE with each table
    entry twice; (None, the reason) otherwise."""
    angles = np.random.default_rng(5).standard_normal((5, 4)).astype(np.float32)
    cos, sin = np.repeat(np.cos(angles), 2, -1), np.repeat(np.sin(angles), 2, -1)
    try:
        with eager():
            got = [g.asnumpy() for g in rope(Tensor(q), Tensor(k), _complex_rotations(Tensor(angles)))]
    except Exception as exc:  # noqa: BLE001
        return None, f"its RoPE function failed on a probe ({type(exc).__name__}: {exc})"
    every_two = _reference_rotation(1, q.shape[-1])
    if all(g.shape == x.shape and np.allclose(g, x * cos + every_two(x) * sin, atol=1e-5) for g, x in zip(got, (q, k))):
        return 1, None
    return None, "its RoPE function does not rotate feature pairs by freqs_cis (checked on a probe)"


def _cos_of(self, freqs):
    """The op's (.., S, D) interleaved cos table of complex rotations (.., S, D / 2)."""
    return ops.repeat_interleave(ops.real(freqs), 2, -1)


def _sin_of(self, freqs):
    return ops.repeat_interleave(ops.imag(freqs), 2, -1)


def _is_head_repeat(function) -> bool:
    """Whether ``function(x, n)`` repeats each of x's (B, N, S, D) heads n times in place (``repeat_kv``),
    on a probe."""
    x = np.random.default_rng(3).standard_normal((1, 2, 3, 4)).astype(np.float32)
    try:
        with eager():
            return all(np.array_equal(function(Tensor(x), n).asnumpy(), np.repeat(x, n, axis=1)) for n in (1, 2))
    except Exception:  # noqa: BLE001
        return False


FALLBACK_REASONS = ("the mask is not exactly causal", "the rotations differ across the batch",
                    "dropout runs while training")


def _causal(self, mask):
    if self.rfa_mask_kind == "additive":
        return additive_mask_is_causal(mask)
    return bool_mask_is_causal(ops.logical_not(mask) if self.rfa_mask_kind == "hide" else mask)


def _shared_rows(cos):
    rows = ops.reshape(cos, (-1, cos.shape[-2], cos.shape[-1]))
    return ops.all(ops.equal(rows, rows[:1]))


def _applies(self, mask, cos):
    """Whether this call is the fused op's: an exactly causal mask, one set of rotations for the whole
    batch, and no dropout while training."""
    if self.rfa_dropout and self.training:
        return Tensor(False)
    return ops.logical_and(_causal(self, mask), _shared_rows(cos))


def _fallback(self, mask, cos):
    """The mask, after the site's announcement of why this call runs the original code (bit i of the
    code: ``FALLBACK_REASONS[i]``; a dependency keeps the announcing op in the graph)."""
    code = ops.cast(ops.logical_not(_causal(self, mask)), ms.int32) + \
        2 * ops.cast(ops.logical_not(_shared_rows(cos)), ms.int32)
    if self.rfa_dropout and self.training:
        code = code + 4
    return ops.depend(mask, self.rfa_announce(ops.reshape(code, (1,))))


def _attend(self, query, key, value, cos, sin, scale):
    """The fused op on the block's BNSD q/k/v (k and v before any head repeat: the op's GQA), or on
    (B * N, S, D) ones (batch and heads merged, as for ``bmm``: one batch of B * N heads), with the
    tables as (S, D) (their first row set: ``_applies`` checked they are the batch's)."""
    cos = ops.reshape(cos, (-1, cos.shape[-2], cos.shape[-1]))[0]
    sin = ops.reshape(sin, (-1, sin.shape[-2], sin.shape[-1]))[0]
    mode, width = self.rfa_rotary_mode, cos.shape[-1]  # partial rotary: the tables' width
    if query.ndim == 3:
        out = rotary_flash_attention(ops.expand_dims(query, 0), ops.expand_dims(key, 0), ops.expand_dims(value, 0),
                                     cos, sin, scale=scale, rotary_mode=mode, rotary_dim=width)
        return ops.squeeze(out, 0)
    return rotary_flash_attention(query, key, value, cos, sin, scale=scale, rotary_mode=mode, rotary_dim=width)


def _check_helpers(found, globals_, site=None):
    """(rotary_mode, None) when the block's RoPE function and head-repeat helpers compute what the
    fused op assumes, on probes; (None, the reason) otherwise; (None, ``_PER_SITE``) when one is the
    site's own method or sub-Cell and no site is given."""
    rope = _helper(found["rope"], globals_, site)
    helpers = [_helper(expr, globals_, site) for expr in found["repeats"]]
    if rope is _PER_SITE or _PER_SITE in helpers:
        return None, _PER_SITE
    mode, reason = _rope_mode(rope, found["complex"])
    if reason:
        return None, reason
    for expr, helper in zip(found["repeats"], helpers):
        if not _is_head_repeat(helper):
            return None, (f"its helper {ast.unparse(expr)!r} before the scores is not a head repeat (repeat_kv) "
                          f"on a probe")
    return mode, None


class HandWrittenAttention(Family):
    name = "handwritten"
    _rebuilt: dict = {}
    _probe_shape: dict = {}  # id(site) -> the table shape its original ran with, until the fused probe
    _site_mode: dict = {}  # id(site) -> the rotary mode its own RoPE method computes, until it is installed

    def recognises(self, obj) -> bool:
        cls = getattr(type(obj), "rfa_original_class", type(obj))
        return isinstance(obj, nn.Cell) and self._plan(cls)[2]

    def _plan(self, cls):
        """(fused class or None, reason or None, whether the style was recognised, the matched block when
        its helpers are checked per site), once per class."""
        if cls not in self._rebuilt:
            try:
                source, found = _rebuild(cls.construct)
                mode, reason = _check_helpers(found, cls.construct.__globals__)
                per_site = found if reason is _PER_SITE else None
                reason = None if per_site else reason
                fused = None if reason else type(f"RotaryFused{cls.__name__}", (cls,), {
                    "construct": _compile(source, cls.construct.__globals__), "rfa_attend": _attend,
                    "rfa_applies": _applies, "rfa_fallback": _fallback, "rfa_original_class": cls,
                    "rfa_cos_of": _cos_of, "rfa_sin_of": _sin_of,
                    "rfa_dropout": found["dropout"], "rfa_mask_kind": found["mask_kind"], "rfa_rotary_mode": mode or 0})
                self._rebuilt[cls] = (fused, reason, True, per_site)
            except _Refused as exc:
                self._rebuilt[cls] = (None, str(exc), True, None)
            except (_NotMatched, OSError, TypeError, SyntaxError) as exc:
                self._rebuilt[cls] = (None, str(exc), False, None)
        return self._rebuilt[cls]

    def where_unrecognised(self, obj) -> str | None:
        """For a Cell this family does not recognise: where reading its construct stopped (None when
        there is no construct source to read)."""
        if not isinstance(obj, nn.Cell):
            return None
        _, reason, recognised, _ = self._plan(type(obj))
        return None if recognised else reason

    def reason_not_fused(self, site, name):
        if "construct" in vars(site):
            return "its construct was replaced on the instance"
        _, reason, _, per_site = self._plan(type(site))
        if per_site is None:
            return reason
        try:  # its RoPE or head repeat is its own method or sub-Cell: probed on this site
            mode, reason = _check_helpers(per_site, type(site).construct.__globals__, site)
        except _Refused as exc:
            return str(exc)
        if reason is None:
            self._site_mode[id(site)] = mode
        return reason

    def install(self, site, name):
        site.rfa_announce = fallback_announcer(name, *FALLBACK_REASONS)
        mode = self._site_mode.pop(id(site), None)
        site.__class__ = self._plan(type(site))[0]
        if mode is not None:
            site.rfa_rotary_mode = mode

    def uninstall(self, site):
        site.__class__ = site.rfa_original_class
        del site.rfa_announce
        if "rfa_rotary_mode" in vars(site):
            del site.rfa_rotary_mode

    def is_installed(self, site) -> bool:
        return hasattr(type(site), "rfa_original_class")

    def probe(self, site, seed):
        """The site on seeded inputs shaped from its construct's signature: (x, cos, sin, mask), the mask
        causal in the site's form (additive, or boolean hiding or keeping), the tables of its RoPE's
        mode, (S, W) or (1, S, W) for a site that expects a batch axis, W the head dim or half of it
        (partial rotary): the first shape its original code runs with, remembered for the fused run."""
        rng = np.random.default_rng(seed)
        params = list(inspect.signature(site.rfa_original_class.construct if self.is_installed(site)
                                        else type(site).construct).parameters)[1:]
        hidden, dim = _dims(site)
        length = 7
        x = Tensor(rng.standard_normal((2, length, hidden), dtype=np.float32))
        fused = self._plan(site.rfa_original_class if self.is_installed(site) else type(site))[0]
        kind = fused.rfa_mask_kind if fused is not None else "additive"
        mode = self._site_mode.get(id(site), getattr(site if self.is_installed(site) else fused, "rfa_rotary_mode", 0))
        keep = np.tril(np.ones((length, length), bool))
        mask = Tensor({"additive": np.where(keep, 0.0, -1e9).astype(np.float32), "hide": ~keep, "keep": keep}[kind])
        if len(params) not in (3, 4):
            raise TypeError(f"the probe calls construct(x, cos, sin, mask) or construct(x, freqs_cis, mask); "
                            f"this one takes {params}")
        if len(params) == 3:  # complex rotations, (S, D / 2)
            angles = np.outer(np.arange(length), 1.0 / 10000.0 ** (np.arange(0, dim, 2) / dim)).astype(np.float32)
            with eager():
                return site(x, _complex_rotations(Tensor(angles)), mask).asnumpy().astype(np.float64)
        known = self._probe_shape.pop(id(site), None) if self.is_installed(site) else None
        shapes = [known] if known else [(length, width) for width in (dim, dim // 2)] + \
            [(1, length, width) for width in (dim, dim // 2)]
        for i, shape in enumerate(shapes):
            tables = tuple(Tensor(t.reshape(shape)) for t in rope_tables(shape[-1], length, rotary_mode=mode))
            try:
                with eager():
                    out = site(x, *tables, mask).asnumpy().astype(np.float64)
            except Exception:  # noqa: BLE001
                if i == len(shapes) - 1:
                    raise
                continue
            if not self.is_installed(site):
                self._probe_shape[id(site)] = shape
            return out


def _dims(site) -> tuple[int, int]:
    """(hidden size, head_dim) from the Cell's attributes (the probe's input width and table width)."""
    dense = [c for _, c in site.cells_and_names() if isinstance(c, nn.Dense)]
    head_dim = getattr(site, "head_dim", None)
    if not dense or not isinstance(head_dim, int):
        raise TypeError("the probe needs nn.Dense projections and an int head_dim attribute")
    return dense[0].in_channels, head_dim

