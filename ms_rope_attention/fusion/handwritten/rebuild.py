"""The construct rebuilt around the matched block (``if <the op applies>: <fused> else: <block>``)
and compiled from memory, never from a file."""
from __future__ import annotations

import ast
import hashlib
import inspect
import linecache
import textwrap

from .match import HOISTED, NotMatched, Refused, match_block


def _reads(stmts, names) -> set:
    return {n.id for s in stmts for n in ast.walk(s) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)} & names


def _expression(source: str):
    return ast.parse(source, mode="eval").body


def rebuild_construct(function):
    """(new construct source, the matched names and expressions), or raise NotMatched / Refused."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    fn = tree.body[0]
    if not isinstance(fn, ast.FunctionDef) or fn.decorator_list:
        raise NotMatched("construct is not a plain method")
    body = fn.body
    reason = "no 'q, k = rope(q, k, cos, sin)' followed by the scores, a softmax and its product with v"
    for i in range(len(body)):
        try:
            found = match_block(body[i:])
        except NotMatched as exc:
            if i and isinstance(body[i], ast.Assign) and isinstance(body[i].targets[0], ast.Tuple) \
                    and isinstance(body[i].value, ast.Call) and len(body[i].value.args) in (3, 4):
                reason = f"after its RoPE call: {exc}"  # the nearest miss says where reading stopped
            continue
        block, later = body[i:i + found["count"]], body[i + found["count"]:]
        if "inline" in found:  # the product becomes a statement of the block; its statement reads the name
            stmt, product = found["inline"]
            hoisted = ast.Assign(targets=[ast.Name(HOISTED, ast.Store())], value=product)
            for parent in ast.walk(stmt):
                for field, child in ast.iter_fields(parent):
                    if child is product:
                        setattr(parent, field, ast.Name(HOISTED, ast.Load()))
                    elif isinstance(child, list) and any(c is product for c in child):
                        setattr(parent, field, [ast.Name(HOISTED, ast.Load()) if c is product else c for c in child])
            block = block + [hoisted]
        # the fused branch leaves q and k un-rotated, v un-repeated and computes no scores/probs: nothing
        # after may read a name the block assigned, but its output (unless it first assigns it again,
        # which this check does not follow: it refuses instead)
        used = _reads(later, found["assigned"] - {found["out"]})
        if used:
            raise Refused(f"{sorted(used)} (rotated q/k, repeated k/v, scores or probabilities) are read after "
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
    raise NotMatched(reason)


def compile_construct(source: str, globals_: dict):
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

