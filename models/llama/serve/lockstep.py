"""Tensor-parallel serving: rank 0 serves HTTP and schedules, and every rank runs its share of each step.

Every rank holds a ``PagedGenerator`` over its part of the model (its heads, its KV heads' blocks). A step
runs collectives inside the model on every rank at once, so the ranks must make the same engine calls in the
same order. Rank 0's engine is wrapped in ``Leader``: each call that changes the engine (``add_request`` once
accepted, ``abort``, ``warm_up``, ``step``) is also sent to the other ranks, which replay them in order
(``follow``). Given its calls the engine is deterministic (scheduling, admission, and sampling: the logits
come back whole and equal on every rank, and each request's sampler is seeded), so every rank's step holds the
same requests; a follower checks each request id against rank 0's and stops on a mismatch instead of
computing something else.

The calls travel as JSON over one authenticated connection per follower (``multiprocessing.connection``,
on loopback unless ``host`` says otherwise), not through the model's collectives: a follower waits in an
ordinary read between steps for as long as the server is idle, with no collective timeout to meet. Rank 0
hands out the port, a random key and its cache's block count with one all-reduce when the channel opens. A
step's calls go in one message, before the step; ``Leader.close`` sends the last one, which stops the others.
"""
from __future__ import annotations

import json
import logging
import secrets
from multiprocessing.connection import Client, Listener

import mindspore as ms
import numpy as np

log = logging.getLogger("models.llama.serve")

_KEY_BYTES = 16


class Channel:
    """Rank 0's connections to the other ranks (``send``), or a follower's to rank 0 (``receive``)."""

    def __init__(self, rank: int, connections: list, leader_blocks: int):
        self.rank, self._connections = rank, connections
        self.leader_blocks = leader_blocks  # rank 0's KV cache blocks: every rank must have as many

    @classmethod
    def open(cls, rank: int, size: int, num_blocks: int, group: str | None = None,
             host: str = "127.0.0.1") -> "Channel":
        """Called by every rank of the tensor-parallel group (``rank`` of ``size``) at once."""
        from ms_rope_attention.distributed import GroupCollective

        listener = None
        shared = np.zeros(2 + _KEY_BYTES, np.int32)
        if rank == 0:
            key = secrets.token_bytes(_KEY_BYTES)
            listener = Listener((host, 0), authkey=key)
            shared[:] = [listener.address[1], num_blocks, *key]
        previous = ms.get_context("mode")
        ms.set_context(mode=ms.PYNATIVE_MODE)  # one eager all-reduce: rank 0's values reach every rank
        try:
            shared = GroupCollective(rank, size, group).all_reduce(ms.Tensor(shared)).asnumpy().astype(np.int64)
        finally:
            ms.set_context(mode=previous)
        port, blocks, key = int(shared[0]), int(shared[1]), bytes(int(b) for b in shared[2:])
        if listener is not None:
            try:
                connections = [listener.accept() for _ in range(size - 1)]
            finally:
                listener.close()
        else:
            connections = [Client((host, port), authkey=key)]
        return cls(rank, connections, blocks)

    def send(self, calls: list) -> None:
        message = json.dumps(calls).encode()
        for connection in self._connections:
            connection.send_bytes(message)

    def receive(self) -> list:
        try:
            return json.loads(self._connections[0].recv_bytes())
        except EOFError:
            raise RuntimeError(f"rank {self.rank}: rank 0 closed the channel without stopping this rank") from None

    def close(self) -> None:
        for connection in self._connections:
            connection.close()
        self._connections = []


class Leader:
    """Rank 0's engine: ``PagedGenerator``'s calls, each one that changes the engine also sent to the other
    ranks (before the next step, or with a warm-up); everything else read from the generator itself."""

    def __init__(self, generator, channel: Channel):
        self.generator, self._channel = generator, channel
        self._calls: list = []  # since the last message; only the engine thread calls these

    def __getattr__(self, name):
        return getattr(self.generator, name)

    def add_request(self, prompt, max_new_tokens: int = 32, **settings) -> int:
        """A refusal raises here and is never sent: every rank would refuse it, and nothing changed."""
        request_id = self.generator.add_request(prompt, max_new_tokens, **settings)
        eos = settings.get("eos_ids")
        self._calls.append(["add", request_id, [int(t) for t in prompt], max_new_tokens,
                            {**settings, "eos_ids": None if eos is None else [int(t) for t in eos]}])
        return request_id

    def abort(self, request_id: int) -> bool:
        self._calls.append(["abort", request_id])
        return self.generator.abort(request_id)

    def warm_up(self, prompts, max_new_tokens: int = 2) -> float:
        self._flush(["warm_up", [[int(t) for t in p] for p in prompts], max_new_tokens])
        return self.generator.warm_up(prompts, max_new_tokens)

    def step(self):
        self._flush(["step"])
        return self.generator.step()

    def close(self) -> None:
        """Stops the other ranks (after the engine thread ended: no step is in flight)."""
        if self._channel is not None:
            self._flush(["stop"])
            self._channel.close()
            self._channel = None

    def _flush(self, last: list) -> None:
        calls, self._calls = self._calls + [last], []
        self._channel.send(calls)


def follow(generator, channel: Channel) -> None:
    """A follower's engine loop: rank 0's calls replayed in order until it stops this rank."""
    if generator.num_blocks != channel.leader_blocks:
        raise SystemExit(f"rank {channel.rank}: {generator.num_blocks} KV cache blocks where rank 0 has "
                         f"{channel.leader_blocks} (the default budget follows each rank's free memory): give "
                         "--cache-gib")
    log.info("rank %d: following rank 0's engine", channel.rank)
    while True:
        for kind, *args in channel.receive():
            if kind == "add":
                want, prompt, max_new_tokens, settings = args
                if settings.get("eos_ids") is not None:
                    settings["eos_ids"] = tuple(settings["eos_ids"])
                got = generator.add_request(prompt, max_new_tokens, **settings)
                if got != want:
                    raise RuntimeError(f"rank {channel.rank}: request {got} where rank 0 has {want}: the ranks' "
                                       "engines diverged")
            elif kind == "abort":
                generator.abort(args[0])
            elif kind == "warm_up":
                generator.warm_up(*args)
            elif kind == "step":
                try:
                    generator.step()
                except Exception:  # noqa: BLE001  as on rank 0: the step's requests end, the engine carries on
                    log.exception("rank %d: an engine step failed (as on rank 0)", channel.rank)
            elif kind == "stop":
                log.info("rank %d: stopped by rank 0", channel.rank)
                channel.close()
                return
            else:
                raise RuntimeError(f"rank {channel.rank}: unknown engine call {kind!r} from rank 0")
