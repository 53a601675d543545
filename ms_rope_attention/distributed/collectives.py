"""The collective the context-parallel attention needs, with a gradient that works on every backend.

MindSpore's ``ops.AllGather`` differentiates to ``ReduceScatter``, which has no CPU kernel
("Unsupported op [ReduceScatter] on CPU"). ``GatherChunks`` keeps the native pair where the device
has it (Ascend, GPU) and otherwise differentiates the gather as what it is: every rank's gradient of
the gathered tensor summed (``AllReduce``, which CPUs have), then the rank's own rows taken.
CPU collectives carry float32 and float16 only: other dtypes (bfloat16) travel as float32.
"""
from __future__ import annotations

import mindspore as ms
from mindspore import nn, ops

# dtypes each backend's collectives carry; anything else is cast to float32 around them.
_COLLECTIVE_DTYPES = {"CPU": (ms.float32, ms.float16)}


def group_geometry(group: str | None = None) -> tuple[int, int]:
    """(rank, size) of ``group`` (default: the world); a clear error when ``init()`` was not called
    (MindSpore itself then answers rank 0 of 1, and the first collective fails)."""
    from mindspore.communication import GlobalComm, get_group_size, get_rank

    if not GlobalComm.INITED:
        raise RuntimeError("distributed: MindSpore's collectives are not initialised: call "
                           "mindspore.communication.init() first, in a job launched with msrun (e.g. "
                           "`python -m ms_rope_attention.distributed.launch --workers 2 script.py`)")
    kwargs = {} if group is None else {"group": group}
    return get_rank(**kwargs), get_group_size(**kwargs)


@ops.constexpr
def _needs_float32(dtype, device: str) -> bool:
    carried = _COLLECTIVE_DTYPES.get(device)
    return carried is not None and dtype not in carried


def carried_dtype(x, device: str):
    """x in a dtype the collectives of ``device`` carry (itself, or float32)."""
    return x.astype(ms.float32) if _needs_float32(x.dtype, device) else x


class GroupCollective(nn.Cell):
    """The collectives of one process group, in dtypes the backend carries: the base of every
    communicating Cell here. ``rank``/``size`` default to the group's.

    ``all_gather`` concatenates dim 0 in rank order. MindSpore's CPU AllGather runs on the world
    group only ("AllGather only support mccl_world_group on CPU"), so on a CPU a sub-group gathers
    by summing zero-padded copies (each rank's rows at its offset): AllReduce works on any group."""

    def __init__(self, rank: int | None = None, size: int | None = None, group: str | None = None):
        super().__init__()
        if rank is None or size is None:
            rank, size = group_geometry(group)
        if not (isinstance(size, int) and size >= 1 and isinstance(rank, int) and 0 <= rank < size):
            raise ValueError(f"rank, size: expected 0 <= rank < size, got rank {rank!r}, size {size!r}")
        self.rank, self.size, self.group = rank, size, group
        self.device = ms.get_context("device_target")
        self.group_kwargs = {} if group is None else {"group": group}
        self.reduce = ops.AllReduce(**self.group_kwargs)
        self.native_gather = group is None or self.device != "CPU"
        if self.native_gather:
            self.gather = ops.AllGather(**self.group_kwargs)

    def all_reduce(self, x):
        """Sum over the group."""
        return self.reduce(carried_dtype(x, self.device)).astype(x.dtype)

    def all_gather(self, x):
        """The group's ``x`` concatenated along dim 0, in rank order."""
        carried = carried_dtype(x, self.device)
        if self.native_gather:
            return self.gather(carried).astype(x.dtype)
        rows = x.shape[0]
        before = ops.zeros((self.rank * rows,) + x.shape[1:], carried.dtype)
        after = ops.zeros(((self.size - 1 - self.rank) * rows,) + x.shape[1:], carried.dtype)
        return self.reduce(ops.cat((before, carried, after), 0)).astype(x.dtype)

    def own_rows(self, x):
        """This rank's 1/size of dim 0 (the inverse of ``all_gather``)."""
        rows = x.shape[0] // self.size
        return x[self.rank * rows:(self.rank + 1) * rows]


class GatherChunks(GroupCollective):
    """Every rank's input concatenated along dim 0 in rank order. Its gradient is the sum over the
    ranks of the gathered tensor's gradient, the rank's own rows of it: ``ReduceScatter`` (what
    MindSpore's own AllGather gradient is) where ``native_backward`` (default: on any device but the
    CPU), else ``AllReduce`` and a slice."""

    def __init__(self, rank: int | None = None, size: int | None = None, group: str | None = None,
                 native_backward: bool | None = None):
        super().__init__(rank, size, group)
        self.native_backward = self.device != "CPU" if native_backward is None else native_backward
        if self.native_backward:
            self.reduce_scatter = ops.ReduceScatter(**self.group_kwargs)

    def construct(self, x):
        return self.all_gather(x)

    def bprop(self, x, out, dout):
        if self.native_backward:
            return (self.reduce_scatter(carried_dtype(dout, self.device)).astype(x.dtype),)
        return (self.own_rows(self.all_reduce(dout)),)
