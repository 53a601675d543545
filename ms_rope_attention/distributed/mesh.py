"""Which ranks talk to which: the data x context x tensor grid of a job, and its process groups.

A world of ``data * context * tensor`` ranks is laid out with the tensor axis fastest (Megatron's
order: tensor-parallel ranks are neighbours, on one machine they share its fastest links):

    rank = (d * context + c) * tensor + t

Each ``Axis`` is this rank's coordinate along one dimension, the size of that dimension and the
process group of the ranks that differ only there. ``replicas`` is the group of ranks holding the
same weights (the same ``t``: the data x context ranks), over which gradients are summed.
An axis that spans the whole world uses the world group (``group`` None); an axis of size 1 needs
no collective at all. Groups are created once per process (every rank builds only the groups it
belongs to, in the same order), so building the mesh or a model twice is harmless.
"""
from __future__ import annotations

from dataclasses import dataclass

from .collectives import group_geometry

_CREATED: set[str] = set()


@dataclass(frozen=True)
class Axis:
    """This rank's place along one mesh dimension: ``rank`` of ``size``, over ``ranks`` (world ranks,
    in order) in process group ``group`` (None: the world group, or no group for size 1)."""
    rank: int
    size: int
    ranks: tuple[int, ...]
    group: str | None

    @classmethod
    def of(cls, ranks, me: int, world: int) -> "Axis":
        ranks = tuple(ranks)
        return cls(ranks.index(me), len(ranks), ranks, _group(ranks, world))

    @classmethod
    def single(cls, me: int) -> "Axis":
        return cls(0, 1, (me,), None)

    def block(self, width: int) -> "Axis":
        """The sub-axis of ``width`` consecutive ranks of this axis that holds this rank (e.g. the
        tensor-parallel ranks that share one replicated KV head)."""
        if width < 1 or self.size % width:
            raise ValueError(f"width: expected a divisor of the axis size {self.size}, got {width}")
        if width == self.size:
            return self
        start = self.rank // width * width
        ranks = self.ranks[start:start + width]
        return Axis(self.rank - start, width, ranks, _group(ranks))


def _group(ranks: tuple[int, ...], world: int | None = None) -> str | None:
    """The process group of ``ranks``: None for one rank or the whole ``world``, else created once."""
    if len(ranks) == 1 or len(ranks) == world:
        return None
    name = "rfa_" + "_".join(map(str, ranks))
    if name not in _CREATED:
        from mindspore.communication import create_group

        create_group(name, list(ranks))
        _CREATED.add(name)
    return name


@dataclass(frozen=True)
class ParallelMesh:
    """The job's data, context and tensor axes for this rank, and the gradient-sharing ``replicas``."""
    data: Axis
    context: Axis
    tensor: Axis
    replicas: Axis

    @classmethod
    def create(cls, *, tensor: int = 1, context: int = 1, data: int | None = None) -> "ParallelMesh":
        """This rank's mesh (``mindspore.communication.init()`` first). ``data`` defaults to what the
        world leaves: world size / (tensor * context)."""
        me, world = group_geometry()
        ranks = mesh_ranks(me, world, tensor=tensor, context=context, data=data)
        return cls(**{name: Axis.of(members, me, world) for name, members in ranks.items()})

    @classmethod
    def single(cls) -> "ParallelMesh":
        """One process: every axis of size 1."""
        one = Axis.single(0)
        return cls(one, one, one, one)

    @property
    def world_rank(self) -> int:
        return self.tensor.ranks[self.tensor.rank]


def mesh_ranks(me: int, world: int, *, tensor: int = 1, context: int = 1, data: int | None = None):
    """The world ranks along each axis through rank ``me``: {"data", "context", "tensor",
    "replicas"} -> tuple, for a world of data x context x tensor ranks, tensor fastest."""
    for name, value in (("tensor", tensor), ("context", context)) + ((("data", data),) if data is not None else ()):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: expected a positive int, got {value!r}")
    if data is None:
        if world % (tensor * context):
            raise ValueError(f"tensor x context = {tensor} x {context}: expected a divisor of the world size {world}")
        data = world // (tensor * context)
    if data * context * tensor != world:
        raise ValueError(f"data x context x tensor = {data} x {context} x {tensor} = {data * context * tensor}: "
                         f"expected the world size {world}")
    t, c, d = me % tensor, me // tensor % context, me // (tensor * context)
    at = lambda dd, cc, tt: (dd * context + cc) * tensor + tt  # noqa: E731
    return {"data": tuple(at(i, c, t) for i in range(data)),
            "context": tuple(at(d, i, t) for i in range(context)),
            "tensor": tuple(at(d, c, i) for i in range(tensor)),
            "replicas": tuple(at(i, j, t) for i in range(data) for j in range(context))}
