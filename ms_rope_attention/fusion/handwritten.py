"""A MindSpore Cell written in the common hand-written style, recognised from its ``construct``'s
source: ``q, k = <rope>(q, k, cos, sin)`` with a rotate-half RoPE function, then, in order,

    scores = ops.matmul(q, <k transposed on its last two axes>) * SCALE   (or / SCALE, or @)
    scores = scores + mask                                                (additive, causal)
    probs = ops.softmax(scores, axis=-1)                                  (or ops.softmax(scores, -1))
    out = ops.matmul(probs, v)                                            (or probs @ v)

on BNSD tensors. ``construct`` is rebuilt from its own syntax tree with those five statements inside
``if <mask is exactly causal>: out = <fused op> else: <the five statements>``, compiled from memory
(no file: MindSpore's graph parser reads the source a file would hold from ``linecache``), and
installed by a class swap on the instance. Refused, with the reason: any other shape of code, a RoPE
function that is not a module-level function or not rotate-half on the probe, or rotated q/k, scores
or probabilities read after the block.
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
from ..rope import rope_tables
from .family import Family, eager
from .masks import additive_mask_is_causal, fallback_announcer

_MATMULS = {"matmul", "bmm", "BatchMatMul"}


class _NotMatched(Exception):
    """The construct is not in the recognised style (the message says where)."""


class _Refused(Exception):
    """The construct is in the style, but is not fused: fusing it would change what it computes, or
    its RoPE function cannot be checked (the reason)."""


def _call_name(node) -> str | None:
    if isinstance(node, ast.Call):
        f = node.func
        return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
    return None


def _name(node) -> str:
    if not isinstance(node, ast.Name):
        raise _NotMatched(f"expected a plain name, got {ast.unparse(node)!r}")
    return node.id


def _transposed_last_two(node) -> str:
    """The name of k in ``k.swapaxes(-1, -2)`` / ``k.transpose(0, 1, 3, 2)`` / ``ops.transpose(k, (0, 1, 3, 2))``."""
    text = ast.unparse(node).replace(" ", "")
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        if node.func.attr == "swapaxes" and text.endswith((".swapaxes(-1,-2)", ".swapaxes(-2,-1)", ".swapaxes(2,3)",
                                                           ".swapaxes(3,2)")):
            return _name(node.func.value)
        if node.func.attr == "transpose" and text.endswith(".transpose(0,1,3,2)"):
            return _name(node.func.value)
        if node.func.attr == "transpose" and len(node.args) == 2 and text.endswith(",(0,1,3,2))"):
            return _name(node.args[0])
    raise _NotMatched(f"expected key transposed on its last two axes, got {ast.unparse(node)!r}")


def _matmul_operands(node):
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.MatMult):
        return node.left, node.right
    if _call_name(node) in _MATMULS and len(node.args) == 2:
        return node.args
    raise _NotMatched(f"expected a matmul, got {ast.unparse(node)!r}")


def _assigned(stmt) -> str:
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)):
        raise _NotMatched(f"expected 'name = ...', got {ast.unparse(stmt)!r}")
    return stmt.targets[0].id


def _match_block(stmts):
    """The five statements from the RoPE call on: names and the scale expression (as source)."""
    rope, s1, s2, s3, s4 = stmts
    if not (isinstance(rope, ast.Assign) and isinstance(rope.targets[0], ast.Tuple) and len(rope.targets[0].elts) == 2
            and isinstance(rope.value, ast.Call) and len(rope.value.args) == 4 and not rope.value.keywords):
        raise _NotMatched("expected 'q, k = rope(q, k, cos, sin)'")
    q, k = (_name(e) for e in rope.targets[0].elts)
    args = [_name(a) for a in rope.value.args]
    if args[:2] != [q, k]:
        raise _NotMatched("the RoPE call must rotate q and k in place: 'q, k = rope(q, k, cos, sin)'")
    scores = _assigned(s1)
    product, scale = s1.value, "1.0"
    if isinstance(product, ast.BinOp) and isinstance(product.op, (ast.Mult, ast.Div)):
        scale = ast.unparse(product.right)
        scale = f"1.0 / ({scale})" if isinstance(product.op, ast.Div) else scale
        product = product.left
    left, right = _matmul_operands(product)
    if _name(left) != q or _transposed_last_two(right) != k:
        raise _NotMatched(f"expected scores from q and key^T, got {ast.unparse(s1.value)!r}")
    if _assigned(s2) != scores or not (isinstance(s2.value, ast.BinOp) and isinstance(s2.value.op, ast.Add)):
        raise _NotMatched(f"expected '{scores} = {scores} + mask', got {ast.unparse(s2)!r}")
    operands = {ast.unparse(s2.value.left), ast.unparse(s2.value.right)}
    if scores not in operands or len(operands) != 2:
        raise _NotMatched(f"expected '{scores} = {scores} + mask', got {ast.unparse(s2)!r}")
    mask = (operands - {scores}).pop()
    probs = _assigned(s3)
    softmax = ast.unparse(s3.value).replace(" ", "")
    if _call_name(s3.value) != "softmax" or softmax not in (f"ops.softmax({scores},axis=-1)", f"ops.softmax({scores},-1)"):
        raise _NotMatched(f"expected '{probs} = ops.softmax({scores}, axis=-1)', got {ast.unparse(s3)!r}")
    out = _assigned(s4)
    left, right = _matmul_operands(s4.value)
    if _name(left) != probs:
        raise _NotMatched(f"expected '{out} = matmul({probs}, v)', got {ast.unparse(s4)!r}")
    return {"q": q, "k": k, "cos": args[2], "sin": args[3], "v": _name(right), "mask": mask, "scale": scale,
            "scores": scores, "probs": probs, "out": out, "rope": rope.value.func}


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
    for i in range(len(body) - 4):
        try:
            found = _match_block(body[i:i + 5])
        except _NotMatched:
            continue
        later = body[i + 5:]
        # the fused branch leaves q and k un-rotated and computes no scores/probs: nothing after may read them
        # (unless it first assigns them again, which this check does not follow: it refuses instead)
        used = _reads(later, {found["q"], found["k"], found["scores"], found["probs"]})
        if used:
            raise _Refused(f"{sorted(used)} (rotated q/k, scores or probabilities) are read after the attention")
        # Only self's methods and the block's own names: MindSpore's graph parser resolves every other
        # name in the user's module.
        attend = ast.parse(f"{found['out']} = self.rfa_attend({found['q']}, {found['k']}, {found['v']}, "
                           f"{found['cos']}, {found['sin']}, {found['scale']})").body
        # the fallback's announcement wraps the mask operand of 'scores = scores + mask' (the mask may be
        # any expression: it is never assigned to)
        masked = body[i + 2].value
        side = "left" if ast.unparse(masked.left) == found["mask"] else "right"
        setattr(masked, side, _expression(f"self.rfa_fallback({found['mask']})"))
        fused = ast.If(test=_expression(f"self.rfa_mask_is_causal({found['mask']})"), body=attend,
                       orelse=body[i:i + 5])
        fn.body = body[:i] + [fused] + later
        fn.name = "construct"
        return ast.unparse(ast.fix_missing_locations(tree)), found
    raise _NotMatched("no 'q, k = rope(q, k, cos, sin)' followed by matmul, + mask, softmax, matmul")


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


def _rope_function(expr, globals_):
    """The RoPE callee ``name`` or ``module.name``, looked up in the construct's module without
    evaluating anything (a method or a call could run the user's code, or need the instance)."""
    node, path = expr, []
    while isinstance(node, ast.Attribute):
        path.insert(0, node.attr)
        node = node.value
    found = globals_.get(node.id) if isinstance(node, ast.Name) else None
    for attr in path:
        found = vars(found).get(attr) if inspect.ismodule(found) else None
    if not callable(found):
        raise _Refused(f"its RoPE function {ast.unparse(expr)!r} is not a module-level function (a name or "
                       f"module.name)")
    return found


def _is_rotate_half_rope(rope) -> str | None:
    """Whether ``rope(q, k, cos, sin)`` computes rotate-half RoPE (on a probe); the reason if not."""
    rng = np.random.default_rng(7)
    q, k = (rng.standard_normal((1, 2, 5, 8)).astype(np.float32) for _ in range(2))
    cos, sin = (rng.standard_normal((5, 8)).astype(np.float32) for _ in range(2))

    def expected(x):
        return x * cos + np.concatenate([-x[..., 4:], x[..., :4]], -1) * sin

    try:
        with eager():
            got = rope(*(Tensor(a) for a in (q, k, cos, sin)))
        ok = all(np.allclose(g.asnumpy(), expected(x), atol=1e-5) for g, x in zip(got, (q, k)))
    except Exception as exc:  # noqa: BLE001
        return f"its RoPE function failed on a probe ({type(exc).__name__}: {exc})"
    return None if ok else "its RoPE function is not rotate-half RoPE (checked on a probe)"


def _mask_is_causal(self, mask):
    return additive_mask_is_causal(mask)


def _fallback(self, mask):
    """The mask, after the site's announcement (a dependency keeps the announcing op in the graph)."""
    return ops.depend(mask, self.rfa_announce(ops.ones((1,), ms.int32)))


def _attend(self, query, key, value, cos, sin, scale):
    """The fused op on the block's BNSD q/k/v, with the tables as (S, D)."""
    cos = ops.reshape(cos, (cos.shape[-2], cos.shape[-1]))
    sin = ops.reshape(sin, (sin.shape[-2], sin.shape[-1]))
    return rotary_flash_attention(query, key, value, cos, sin, scale=scale)


class HandWrittenAttention(Family):
    name = "handwritten"
    _rebuilt: dict = {}

    def recognises(self, obj) -> bool:
        cls = getattr(type(obj), "rfa_original_class", type(obj))
        return isinstance(obj, nn.Cell) and self._plan(cls)[2]

    def _plan(self, cls):
        """(fused class or None, reason or None, whether the style was recognised), once per class."""
        if cls not in self._rebuilt:
            try:
                source, found = _rebuild(cls.construct)
                reason = _is_rotate_half_rope(_rope_function(found["rope"], cls.construct.__globals__))
                fused = None if reason else type(f"RotaryFused{cls.__name__}", (cls,), {
                    "construct": _compile(source, cls.construct.__globals__), "rfa_attend": _attend,
                    "rfa_mask_is_causal": _mask_is_causal, "rfa_fallback": _fallback, "rfa_original_class": cls})
                self._rebuilt[cls] = (fused, reason, True)
            except _Refused as exc:
                self._rebuilt[cls] = (None, str(exc), True)
            except (_NotMatched, OSError, TypeError, SyntaxError) as exc:
                self._rebuilt[cls] = (None, str(exc), False)
        return self._rebuilt[cls]

    def where_unrecognised(self, obj) -> str | None:
        """For a Cell this family does not recognise: where reading its construct stopped (None when
        there is no construct source to read)."""
        if not isinstance(obj, nn.Cell):
            return None
        _, reason, recognised = self._plan(type(obj))
        return None if recognised else reason

    def reason_not_fused(self, site, name):
        if "construct" in vars(site):
            return "its construct was replaced on the instance"
        return self._plan(type(site))[1]

    def install(self, site, name):
        site.rfa_announce = fallback_announcer(name, "the mask is not exactly causal")
        site.__class__ = self._plan(type(site))[0]

    def uninstall(self, site):
        site.__class__ = site.rfa_original_class
        del site.rfa_announce

    def is_installed(self, site) -> bool:
        return hasattr(type(site), "rfa_original_class")

    def probe(self, site, seed):
        """The site on seeded inputs shaped from its construct's signature: (x, cos, sin, mask)."""
        rng = np.random.default_rng(seed)
        params = list(inspect.signature(site.rfa_original_class.construct if self.is_installed(site)
                                        else type(site).construct).parameters)[1:]
        hidden, dim = _dims(site)
        length = 7
        x = Tensor(rng.standard_normal((2, length, hidden), dtype=np.float32))
        tables = tuple(Tensor(t) for t in rope_tables(dim, length))
        mask = Tensor(np.triu(np.full((length, length), -1e9, np.float32), 1))
        if len(params) != 4:
            raise TypeError(f"the probe calls construct(x, cos, sin, mask); this one takes {params}")
        with eager():
            return site(x, *tables, mask).asnumpy().astype(np.float64)


def _dims(site) -> tuple[int, int]:
    """(hidden size, head_dim) from the Cell's attributes (the probe's input width and table width)."""
    dense = [c for _, c in site.cells_and_names() if isinstance(c, nn.Dense)]
    head_dim = getattr(site, "head_dim", None)
    if not dense or not isinstance(head_dim, int):
        raise TypeError("the probe needs nn.Dense projections and an int head_dim attribute")
    return dense[0].in_channels, head_dim

