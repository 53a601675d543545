"""A run stops between steps, never inside one, when asked by a signal; under msrun every rank
stops after the same step."""
from __future__ import annotations

import signal
import threading

import numpy as np
from mindspore import Tensor


class StopRequest:
    """SIGINT, SIGTERM and SIGHUP (a closed terminal, a dropped ssh) ask the run to stop: a handler
    sets a flag, read at the next step boundary, so a signal never cuts a step in half (weights,
    optimizer state and step counter stay one state); a second signal aborts at once
    (KeyboardInterrupt; the checkpoints stay whole). Under msrun the ranks agree through a
    one-element all-reduce over the world at every boundary, so all stop after the same step, even
    when the signal reached only some of them. (All are handled alike: once a graph has run,
    MindSpore's own SIGINT handler re-raises SIGINT as SIGTERM.)
    A signal the caller ignores stays ignored: ``nohup`` keeps a run going when its terminal closes."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self, distributed: bool):
        from ms_rope_attention.distributed import GroupCollective

        self.world = GroupCollective() if distributed else None
        self.received = False
        self.previous = {}

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():  # where Python runs signal handlers
            self.previous = {number: signal.signal(number, self._handle) for number in self.SIGNALS
                             if signal.getsignal(number) is not signal.SIG_IGN}
        return self

    def __exit__(self, *exc) -> None:
        for number, handler in self.previous.items():
            signal.signal(number, handler)

    def _handle(self, number, frame) -> None:
        if self.received:
            raise KeyboardInterrupt
        self.received = True

    def _sum(self, value: float) -> float:
        return float(self.world.all_reduce(Tensor(np.float32(value))).asnumpy())

    def agreed(self) -> bool:
        """Whether any rank received a signal (every rank calls this at the same step)."""
        return self.received if self.world is None else self._sum(self.received) > 0

    def barrier(self) -> None:
        """Every rank waits here until all arrive (rank 0 has written what it saved before)."""
        if self.world is not None:
            self._sum(0.0)
