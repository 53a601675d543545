"""``fuse(net)``: the fused op inside models users already have, without editing their sources.

``fuse`` walks a network (``cells_and_names()`` for MindSpore Cells, ``named_modules()`` for
mindtorch / mindnlp modules) and hands each attention site to the family that recognises its exact
class and code (``mindformers``, ``hf_llama``, ``project``), or its construct's style
(``handwritten``). A site is fused only when its
configuration is covered and, unless ``dry_run``, when the fused code matches the original on a
seeded probe with the site's own weights; every other site keeps its code and gets its reason in
the report. At run time a fused site whose mask is not exactly causal runs its original code and
says so once (``rotary_fusion_fallback``). ``unfuse`` restores the originals.

    report = fuse(model)          # or fuse(model, strict=True) to refuse anything less than all
    print(report)
"""
from __future__ import annotations

import numpy as np

from .._compat import drop_compiled_graphs
from .attention_like import computes_attention
from .family import class_path
from .handwritten import HandWrittenAttention
from .hf_llama import HuggingFaceLlama
from .mindformers import MindFormersLlama
from .mindformers_infer import MindFormersLlamaInfer
from .project import ProjectAttention
from .report import ALREADY_FUSED, FUSED, NOT_FUSED, FuseReport, FuseSite

__all__ = ["fuse", "unfuse", "FuseReport", "FuseSite", "FuseError", "FAMILIES"]
HANDWRITTEN = HandWrittenAttention()
FAMILIES = (ProjectAttention(), MindFormersLlama(), MindFormersLlamaInfer(), HuggingFaceLlama(), HANDWRITTEN)
NO_ATTENTION = ("no attention found: no Cell is a recognised attention class, none is named ...Attention, and "
                "none computes a softmax and a product of tensors or calls a known attention op")


class FuseError(RuntimeError):
    """``strict=True`` and a site is not fused (the network is left as it was)."""


def _modules(net):
    from mindspore import nn
    if isinstance(net, nn.Cell):
        return list(net.cells_and_names())
    if callable(getattr(net, "named_modules", None)):
        return list(net.named_modules())
    raise TypeError(f"net: expected a mindspore.nn.Cell or a module with named_modules() (mindtorch / mindnlp), "
                    f"got {type(net).__name__}")


def _sites(net):
    """(name, object, family or None) per attention site, outermost first; nothing inside a site. A
    site is what a family recognises, a class named ``...Attention``, or a Cell whose own code
    computes attention (``attention_like``)."""
    claimed = []
    for name, obj in _modules(net):
        if any(name == c or name.startswith(c + ".") or c == "" for c in claimed):
            continue
        family = next((f for f in FAMILIES if f.recognises(obj)), None)
        if family is not None or type(obj).__name__.endswith("Attention") or computes_attention(obj):
            claimed.append(name)
            yield name, obj, family


def _unrecognised(site) -> str:
    """The reason of a site no family recognises: its class, and where the hand-written reading of its
    code stopped."""
    reason = f"no fuse family recognises {class_path(site)}"
    detail = HANDWRITTEN.where_unrecognised(site) if computes_attention(site) else None
    return f"{reason} (hand-written style: {detail})" if detail else reason


def _relative_error(got, want) -> float:
    scale = float(np.max(np.abs(want))) if want.size else 0.0
    err = float(np.max(np.abs(got - want))) if want.size else 0.0
    return err / scale if scale > 0 else err


def _fuse_site(family, site, name, dry_run, seed) -> FuseSite:
    if family.is_installed(site):
        return FuseSite(name, family.name, ALREADY_FUSED)
    reason = family.reason_not_fused(site, name)
    if reason is not None or dry_run:
        return FuseSite(name, family.name, NOT_FUSED if reason else FUSED, reason)
    try:
        want = family.probe(site, seed)
    except Exception as exc:  # noqa: BLE001 (any failure of the user's code is a reason, not a crash)
        return FuseSite(name, family.name, NOT_FUSED, f"the probe could not run the original code "
                                                      f"({type(exc).__name__}: {exc})")
    family.install(site, name)
    try:
        got = family.probe(site, seed)
    except Exception as exc:  # noqa: BLE001
        family.uninstall(site)
        return FuseSite(name, family.name, NOT_FUSED, f"the fused code failed on the probe "
                                                      f"({type(exc).__name__}: {exc})")
    error, tolerance = _relative_error(got, want), family.tolerance(site)
    if got.shape != want.shape or not np.isfinite(got).all() or not error <= tolerance:
        family.uninstall(site)
        return FuseSite(name, family.name, NOT_FUSED,
                        f"the probe's outputs differ by {error:.2e} relative (tolerance {tolerance:.0e})", error)
    return FuseSite(name, family.name, FUSED, probe_error=error)


def _drop_compiled_graphs(net) -> bool:
    """GRAPH_MODE keeps a compiled network's graph: drop it so that the next call compiles the
    current code (a fused or restored construct). True if there was one."""
    dropped = False
    for _, cell in _modules(net):
        dropped = drop_compiled_graphs(cell) or dropped
    return dropped


def fuse(net, *, dry_run: bool = False, strict: bool = False, seed: int = 0) -> FuseReport:
    """Fuse every recognised attention site of ``net`` in place; returns the ``FuseReport``.

    ``dry_run``: only report (no probe, nothing changed). ``strict``: raise ``FuseError`` if any
    site is not fused (or none was found), leaving ``net`` as it was. ``seed``: the probe's inputs."""
    rows, installed = [], []
    for family in FAMILIES:
        family.bind(net)
    for name, site, family in _sites(net):
        if family is None:
            rows.append(FuseSite(name, None, NOT_FUSED, _unrecognised(site)))
            continue
        row = _fuse_site(family, site, name, dry_run, seed)
        rows.append(row)
        if row.status == FUSED and not dry_run:
            installed.append((family, site))
    notes = [] if rows else [NO_ATTENTION]
    if installed and _drop_compiled_graphs(net):
        notes.append("the network had been compiled in GRAPH_MODE: that graph was dropped, the next call "
                     "compiles the fused sites")
    report = FuseReport(tuple(rows), dry_run, tuple(notes))
    if strict and not report.all_fused:
        for family, site in installed:
            family.uninstall(site)
        found = "no attention site found" if not rows else f"{len(report.not_fused)} site(s) not fused"
        raise FuseError(f"fuse(strict=True): {found}; the network is unchanged\n{report}")
    return report


def unfuse(net) -> list[str]:
    """Restore the original code of every site ``fuse`` fused; returns their names."""
    restored = []
    for family in FAMILIES:
        family.bind(net)
    for name, site, family in _sites(net):
        if family is not None and not isinstance(family, ProjectAttention) and family.is_installed(site):
            family.uninstall(site)
            restored.append(name)
    if restored:
        _drop_compiled_graphs(net)
    return restored
