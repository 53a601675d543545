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


class GatherChunks(nn.Cell):
    """Every rank's input concatenated along dim 0 in rank order. Its gradient is the sum over the
    ranks of the gathered tensor's gradient, the rank's own rows of it: ``ReduceScatter`` (what
    MindSpore's own AllGather gradient is) where ``native_backward`` (default: on any device but the
    CPU), else ``AllReduce`` and a slice."""

    def __init__(self, rank: int, size: int, group: str | None = None, native_backward: bool | None = None):
        super().__init__()
        kwargs = {} if group is None else {"group": group}
        self.rank, self.size = rank, size
        self.device = ms.get_context("device_target")
        self.native_backward = self.device != "CPU" if native_backward is None else native_backward
        self.gather = ops.AllGather(**kwargs)
        self.reduce = ops.AllReduce(**kwargs)
        self.reduce_scatter = ops.ReduceScatter(**kwargs)

    def construct(self, x):
        return self.gather(carried_dtype(x, self.device)).astype(x.dtype)

    def bprop(self, x, out, dout):
        dout = carried_dtype(dout, self.device)
        if self.native_backward:
            return (self.reduce_scatter(dout).astype(x.dtype),)
        rows = x.shape[0]
        return (self.reduce(dout)[self.rank * rows:(self.rank + 1) * rows].astype(x.dtype),)
