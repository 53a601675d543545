"""What every fuse family shares: the family interface, source fingerprints, the exact-causal mask
tests, and the runtime fallback announcement.

A family recognises one attention class of one library (the exact class, plus a fingerprint of the
code it replaces, for the versions tested), says why a site cannot be fused (a reason, or None),
installs a replacement forward/construct on the instance and removes it again, and runs the site
on a seeded probe so that ``fuse`` can compare the original with the fused code on the same weights.
"""
from __future__ import annotations

import hashlib
import inspect
import logging
import textwrap

logger = logging.getLogger("ms_rope_attention")
MASKED_BELOW = -1e4  # an additive mask entry at or below this hides its key (exp underflows to 0 in float32)


def fingerprint(*functions) -> str:
    """A short hash of the source of ``functions``: which code a family was tested against."""
    digest = hashlib.sha256()
    for function in functions:
        digest.update(textwrap.dedent(inspect.getsource(function)).encode())
    return digest.hexdigest()[:16]


class eager:
    """Probes run eagerly (PyNative) whatever the mode: one site, no graph to compile."""

    def __enter__(self):
        import mindspore as ms
        self.mode = ms.get_context("mode")
        ms.set_context(mode=ms.PYNATIVE_MODE)

    def __exit__(self, *exc):
        import mindspore as ms
        ms.set_context(mode=self.mode)


def class_path(obj) -> str:
    cls = obj if isinstance(obj, type) else type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


class SiteAnnouncer:
    """A fused site's ``rotary_fusion_fallback`` warning: once per reason for each time ``fuse``
    fused the site (a warning naming the site and why its original code runs)."""

    def __init__(self, site: str):
        self.site, self.said = site, set()

    def __call__(self, reason: str) -> None:
        if reason not in self.said:
            self.said.add(reason)
            logger.warning("rotary_fusion_fallback: %s: %s; running the original attention there", self.site, reason)


class Family:
    """One recognised attention implementation. Subclasses set ``name`` and implement the rest."""

    name = ""

    def recognises(self, obj) -> bool:
        """Whether ``obj`` is this family's attention class (exactly that class: no subclass)."""
        raise NotImplementedError

    def bind(self, net) -> None:
        """Called by ``fuse`` / ``unfuse`` with the whole network before its sites are visited: for a
        family that needs what the model around a site holds (its RoPE tables)."""

    def reason_not_fused(self, site, name: str) -> str | None:
        """Why this site cannot be fused (its config, an edited forward, an untested version), or None."""
        raise NotImplementedError

    def install(self, site, name: str) -> None:
        """Make the site run the fused op (the original code stays reachable for the fallback)."""
        raise NotImplementedError

    def uninstall(self, site) -> None:
        """Undo ``install``."""
        raise NotImplementedError

    def is_installed(self, site) -> bool:
        raise NotImplementedError

    def probe(self, site, seed: int):
        """The site's output (as a float64 numpy array) on seeded inputs, in the site's current state."""
        raise NotImplementedError

    def tolerance(self, site) -> float:
        """Relative error (to the probe output's largest magnitude) the fused site may differ by."""
        return 1e-4
