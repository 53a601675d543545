"""``FuseReport``: what ``fuse`` found and did, one row per attention site; a value a script can
assert on, and a table a person can read."""
from __future__ import annotations

from dataclasses import dataclass, field

FUSED, NOT_FUSED, ALREADY_FUSED = "fused", "not fused", "already fused"


@dataclass(frozen=True)
class FuseSite:
    """One attention site: its name in the network, the family recognised (None: no family), the
    status (``fused``, ``not fused``, ``already fused``), the reason when not fused, and the probe's
    largest error relative to the probe output's largest magnitude (None when no probe ran)."""

    name: str
    family: str | None
    status: str
    reason: str | None = None
    probe_error: float | None = None

    @property
    def outcome(self) -> str:
        return f"{NOT_FUSED}: {self.reason}" if self.status == NOT_FUSED else self.status


@dataclass(frozen=True)
class FuseReport:
    """The rows, in network order, and notes about the network as a whole (e.g. a compiled graph
    that was dropped so that the next call recompiles with the fused sites)."""

    sites: tuple[FuseSite, ...]
    dry_run: bool = False
    notes: tuple[str, ...] = field(default_factory=tuple)

    def __iter__(self):
        return iter(self.sites)

    def __len__(self):
        return len(self.sites)

    def __getitem__(self, name: str) -> FuseSite:
        for site in self.sites:
            if site.name == name:
                return site
        raise KeyError(name)

    @property
    def fused(self) -> list[str]:
        return [s.name for s in self.sites if s.status == FUSED]

    @property
    def not_fused(self) -> list[str]:
        return [s.name for s in self.sites if s.status == NOT_FUSED]

    @property
    def all_fused(self) -> bool:
        """Every site runs the fused op (``fused`` or ``already fused``), and there is at least one."""
        return bool(self.sites) and not self.not_fused

    def __str__(self) -> str:
        head = ("site", "family", "outcome", "probe error")
        rows = [(s.name or "(root)", s.family or "-", s.outcome,
                 "-" if s.probe_error is None else f"{s.probe_error:.2e}") for s in self.sites]
        widths = [max(len(r[i]) for r in [head, *rows]) for i in range(3)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r[:3], widths)) + "  " + r[3] for r in [head, *rows]]
        lines.insert(1, "  ".join("-" * w for w in widths) + "  " + "-" * len(head[3]))
        title = "fuse (dry run): " if self.dry_run else "fuse: "
        summary = f"{title}{len(self.fused)} fused, {len(self.not_fused)} not fused, " \
                  f"{sum(s.status == ALREADY_FUSED for s in self.sites)} already fused"
        return "\n".join([summary, *lines, *(f"note: {n}" for n in self.notes)])
