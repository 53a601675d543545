"""Reading a hand-written attention block from a construct's syntax tree: where it starts (the RoPE
call), what it names (q, k, v, the scores, the probabilities, the output), its scale, its mask and
the helpers it calls. Nothing is evaluated here; the helpers are judged on probes (probes.py)."""
from __future__ import annotations

import ast

from ..attention_like import call_name

_MATMULS = {"matmul", "bmm", "BatchMatMul"}


class NotMatched(Exception):
    """The construct is not in the recognised style (the message says where)."""


class Refused(Exception):
    """The construct is in the style, but is not fused: fusing it would change what it computes, or
    its RoPE function cannot be checked (the reason)."""


def _name(node) -> str:
    if not isinstance(node, ast.Name):
        raise NotMatched(f"expected a plain name, got {ast.unparse(node)!r}")
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
    raise NotMatched(f"expected key transposed on its last two axes, got {ast.unparse(node)!r}")


def _matmul_operands(node):
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.MatMult):
        return node.left, node.right
    if call_name(node) in _MATMULS and len(node.args) == 2:
        return node.args
    raise NotMatched(f"expected a matmul, got {ast.unparse(node)!r}")


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
            except NotMatched:
                continue
            if mask is None:
                return factors, (node, side, None, "additive")
        raise NotMatched(f"expected 'scores + mask', got {ast.unparse(node)!r}")
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Mult, ast.Div)):
        sides = [(node.left, node.right)] + ([(node.right, node.left)] if isinstance(node.op, ast.Mult) else [])
        for product, scale in sides:
            try:
                factors, mask = _score_terms(product, q, keys)
            except NotMatched:
                continue
            if mask is None:  # a scale applied after the mask would scale the mask too: not this form
                return factors + [_factor(node.op, scale)], None
        raise NotMatched(f"expected 'scores * scale', got {ast.unparse(node)!r}")
    left, right = _matmul_operands(node)
    if _name(_uncast(left)) != q or _transposed_last_two(_uncast(right)) not in keys:
        raise NotMatched(f"expected scores from q and key^T, got {ast.unparse(node)!r}")
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
    raise NotMatched(f"expected 'name = ...', got {ast.unparse(stmt)!r}")


def _is_softmax_last_axis(node) -> bool:
    axis = [k.value for k in node.keywords if k.arg in ("axis", "dim")] or node.args[1:2]
    return len(axis) == 1 and ast.unparse(axis[0]).replace(" ", "") == "-1" and \
        all(k.arg in ("axis", "dim", "dtype") for k in node.keywords)


HOISTED = "rfa_attention_out"


def _inline_output(stmt, probs):
    """The ``matmul(probs, v)`` inside a larger expression of ``stmt`` (not a statement of its own)."""
    if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
        top = _uncast(stmt.value)
        try:
            _matmul_operands(top)
            return None  # 'out = matmul(probs, v)': the plain form
        except NotMatched:
            pass
    for node in ast.walk(stmt):
        try:
            left, right = _matmul_operands(node)
        except NotMatched:
            continue
        if isinstance(_uncast(left), ast.Name) and _uncast(left).id == probs and isinstance(_uncast(right), ast.Name):
            return node
    return None


def match_block(stmts):
    """From a RoPE call ``q, k = rope(q, k, cos, sin)`` to the attention's output ``out = probs @ v``:
    the names, the scale (source), the mask's place, the head-repeat helpers it calls, whether the
    probabilities go through dropout, and how many statements the block spans. In between, in this
    order: head repeats of k and v (``k = repeat_kv(k, n)``, one or two per statement, checked on a
    probe later), a scale on q, the scores (scaled and masked in one expression or in statements of
    their own, casts anywhere), a softmax over the last axis (casts around it), dropout on it."""
    rope = stmts[0]
    if not (isinstance(rope, ast.Assign) and isinstance(rope.targets[0], ast.Tuple) and len(rope.targets[0].elts) == 2
            and isinstance(rope.value, ast.Call) and len(rope.value.args) in (3, 4) and not rope.value.keywords):
        raise NotMatched("expected 'q, k = rope(q, k, cos, sin)' or 'q, k = rope(q, k, freqs_cis)'")
    q, k = (_name(e) for e in rope.targets[0].elts)
    args = [_name(a) for a in rope.value.args]
    if len(args) == 3:  # rope(q, k, freqs_cis): complex rotations, whose real and imaginary parts are the tables
        args = [q, k, f"self.rfa_cos_of({args[2]})", f"self.rfa_sin_of({args[2]})"]
    if args[:2] != [q, k]:
        raise NotMatched("the RoPE call must rotate q and k in place: 'q, k = rope(q, k, cos, sin)'")
    keys, repeated, repeats = {k}, {}, []  # names holding the rotated key; repeated name -> its source
    q_factors, factors, mask, scores, probs, dropout = [], [], None, None, None, False

    def matched(out, value, count, **extra):
        """What was found, once the product of the probabilities with ``value`` (v) is reached."""
        if mask is None:
            raise Refused("its scores have no mask: the attention is not causal")
        v = _name(value)
        return {"q": q, "k": k, "cos": args[2], "sin": args[3], "v": repeated.get(v, v), "mask": mask,
                "scale": " * ".join(q_factors + factors) or "1.0", "out": out, "count": count,
                "assigned": {q, k, scores, probs, *keys, *repeated}, "rope": rope.value.func,
                "complex": len(rope.value.args) == 3, "repeats": repeats, "dropout": dropout, **extra}

    for count, stmt in enumerate(stmts[1:], 2):
        if probs is not None:
            inline = _inline_output(stmt, probs)
            if inline is not None:  # 'return o_proj(matmul(probs, v) ...)': the product hoisted into a name
                return matched(HOISTED, _uncast(_matmul_operands(inline)[1]), count - 1, inline=(stmt, inline))
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
            raise NotMatched(f"expected one assignment, got {ast.unparse(stmt)!r}")
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
            except NotMatched:
                raise NotMatched(f"expected the scores from q and the key (scaled, plus one mask), got "
                                  f"{ast.unparse(stmt)!r}") from None
            scores = target
            probs = target if softmax else None
            continue
        if probs is None:
            inner = _uncast(value)
            if call_name(inner) == "softmax" and inner.args and not _is_softmax_last_axis(inner):
                raise NotMatched(f"a softmax not over the last axis (the keys): {ast.unparse(stmt)!r}")
            if call_name(inner) == "softmax" and inner.args:
                if not (isinstance(_uncast(inner.args[0]), ast.Name) and _uncast(inner.args[0]).id == scores):
                    raise NotMatched(f"expected a softmax of {scores}, got {ast.unparse(stmt)!r}")
                probs = target
                continue
            if target != scores:
                raise NotMatched(f"expected '{scores} = ...' or a softmax over the last axis, got "
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
            raise NotMatched(f"expected the scores scaled or masked, got {ast.unparse(stmt)!r}")
        inner = _uncast(value)
        if isinstance(inner, ast.Name) and inner.id == probs and target == probs:
            continue  # the probabilities cast back
        if target == probs and "dropout" in (call_name(inner) or "").lower() \
                and inner.args and isinstance(inner.args[0], ast.Name) and inner.args[0].id == probs:
            dropout = True  # 'probs = dropout(probs, ...)' / 'probs = self.attn_dropout(probs)'
            continue
        left, right = _matmul_operands(inner)
        if not (isinstance(_uncast(left), ast.Name) and _uncast(left).id == probs):
            raise NotMatched(f"expected '{target} = matmul({probs}, v)', got {ast.unparse(stmt)!r}")
        return matched(target, _uncast(right), count)
    raise NotMatched("the block after the RoPE call ends before the attention's output")
