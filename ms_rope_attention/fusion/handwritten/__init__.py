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

The parts: ``match`` reads the block, ``probes`` checks its helpers, ``rebuild`` makes and compiles the
new construct, ``runtime`` holds the methods the fused class gains; the family is here.
"""
from __future__ import annotations

import inspect
import weakref

import numpy as np
from mindspore import Tensor, nn

from ...rope import rope_tables
from ..family import Family, eager
from ..masks import fallback_announcer
from .match import NotMatched, Refused
from .probes import PER_SITE, check_helpers, polar_rotations
from .rebuild import compile_construct, rebuild_construct
from .runtime import FALLBACK_REASONS, METHODS


class HandWrittenAttention(Family):
    name = "handwritten"
    _rebuilt: dict = {}
    # What is learnt about one site lives as long as the site (an id would be reused after collection):
    _probe_shape = weakref.WeakKeyDictionary()  # the table shape its original ran with, until the fused probe
    _site_mode = weakref.WeakKeyDictionary()  # the rotary mode its own RoPE method computes, until installed

    def recognises(self, obj) -> bool:
        cls = getattr(type(obj), "rfa_original_class", type(obj))
        return isinstance(obj, nn.Cell) and self._plan(cls)[2]

    def _plan(self, cls):
        """(fused class or None, reason or None, whether the style was recognised, the matched block when
        its helpers are checked per site), once per class."""
        if cls not in self._rebuilt:
            try:
                source, found = rebuild_construct(cls.construct)
                mode, reason = check_helpers(found, cls.construct.__globals__)
                per_site = found if reason is PER_SITE else None
                reason = None if per_site else reason
                fused = None if reason else type(f"RotaryFused{cls.__name__}", (cls,), {
                    **METHODS, "construct": compile_construct(source, cls.construct.__globals__),
                    "rfa_original_class": cls, "rfa_dropout": found["dropout"], "rfa_mask_kind": found["mask_kind"],
                    "rfa_rotary_mode": mode or 0})
                self._rebuilt[cls] = (fused, reason, True, per_site)
            except Refused as exc:
                self._rebuilt[cls] = (None, str(exc), True, None)
            except (NotMatched, OSError, TypeError, SyntaxError) as exc:
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
            mode, reason = check_helpers(per_site, type(site).construct.__globals__, site)
        except Refused as exc:
            return str(exc)
        if reason is None:
            self._site_mode[site] = mode
        return reason

    def install(self, site, name):
        site.rfa_announce = fallback_announcer(name, *FALLBACK_REASONS)
        mode = self._site_mode.pop(site, None)
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
        mode = self._site_mode.get(site, getattr(site if self.is_installed(site) else fused, "rfa_rotary_mode", 0))
        keep = np.tril(np.ones((length, length), bool))
        mask = Tensor({"additive": np.where(keep, 0.0, -1e9).astype(np.float32), "hide": ~keep, "keep": keep}[kind])
        if len(params) not in (3, 4):
            raise TypeError(f"the probe calls construct(x, cos, sin, mask) or construct(x, freqs_cis, mask); "
                            f"this one takes {params}")
        if len(params) == 3:  # complex rotations, (S, D / 2)
            angles = np.outer(np.arange(length), 1.0 / 10000.0 ** (np.arange(0, dim, 2) / dim)).astype(np.float32)
            with eager():
                return site(x, polar_rotations(Tensor(angles)), mask).asnumpy().astype(np.float64)
        known = self._probe_shape.pop(site, None) if self.is_installed(site) else None
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
                self._probe_shape[site] = shape
            return out


def _dims(site) -> tuple[int, int]:
    """(hidden size, head_dim) from the Cell's attributes (the probe's input width and table width)."""
    dense = [c for _, c in site.cells_and_names() if isinstance(c, nn.Dense)]
    head_dim = getattr(site, "head_dim", None)
    if not dense or not isinstance(head_dim, int):
        raise TypeError("the probe needs nn.Dense projections and an int head_dim attribute")
    return dense[0].in_channels, head_dim

