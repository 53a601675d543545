"""Which requests a step of the paged engine holds, and the blocks they hold and may still take:
``Scheduler``, the waiting queue and the running requests of a ``paged.PagedGenerator``.

By default (``max_num_batched_tokens=None``) each step either prefills the requests it admits,
whole prompts, or decodes one token of every running request. A request is admitted when the
blocks it can grow to (prompt + new tokens, less the full blocks it shares) fit beside what the
running requests can still take, so a step never runs out of blocks and nothing is preempted;
admission is first come, first served, and a request the cache can hold alone is admitted at the
latest when nothing else runs.

**Chunked prefill** (``max_num_batched_tokens=N``, vLLM's name): a long prompt no longer stops the
running requests. Each step is one call holding one decode token of every running request whose
prompt is done, then prompt tokens while the N - (decode tokens) left last (beside 1..15 decode
tokens, at most 16 tokens in all: ``paged_graphs`` says why): first of the requests already
mid-prompt, then of those admitted now, in arrival order; a prompt is split over as many steps as
it needs (its cached prefix counts as computed) and samples its first token in the step that
computes its last token. Decode tokens are never held back: they all run, and when they alone fill
N the step holds only them and the prompts wait until a decoding request ends (with N >=
``max_batch`` that never happens while a prompt is unfinished: a request mid-prompt leaves at most
``max_batch - 1`` decoding). They cannot pass N: a step completes at most as many prompts as it
holds prompt tokens, at most N less its decode tokens. A request whose next uncached block another
request is computing (admitted this step, or mid-prompt) waits until that block is registered, then
shares it, or until the other request ends.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .block_pool import BlockPool, Growth, Match, SequenceBlocks, blocks_for, prefix_keys
from .common import Request, is_int
from .kv_cache import STEP_TOKENS


@dataclass
class PagedRequest(Request):
    root: bytes = field(kw_only=True)  # its cache salt's chain root
    seq: SequenceBlocks | None = None
    reserved: int = 0      # blocks it may still allocate
    keys: list[bytes] | None = None  # the chain digests of its prompt's full blocks (none without prefix caching)

    @property
    def prefilling(self) -> bool:
        """Admitted, and part of its prompt not yet computed (chunked prefill only, between steps)."""
        return self.seq.length < len(self.prompt)


@dataclass
class StepSequence:
    """One sequence of a step: the tokens it writes (a prompt chunk, or a decoding request's pending
    token) and whether its row is sampled (a decode token, or its prompt's last chunk)."""
    request: PagedRequest
    ids: list[int]
    decode: bool
    samples: bool
    joining: bool = False  # admitted this step: its cached prefix is counted when the step commits

    @classmethod
    def chunk(cls, request: PagedRequest, tokens: int, joining: bool = False) -> "StepSequence":
        """The next ``tokens`` tokens of the request's prompt."""
        start = request.seq.length
        return cls(request, request.prompt[start:start + tokens], False, start + tokens == len(request.prompt),
                   joining)

    @classmethod
    def decoding(cls, request: PagedRequest) -> "StepSequence":
        return cls(request, [request.pending], True, True)


def check_batched_tokens(value):
    if value is not None and (not is_int(value) or value < 1):
        raise ValueError("max_num_batched_tokens: expected an int >= 1 (the tokens of one step: chunked prefill) "
                         f"or None (whole prompts, then decode steps), got {value!r}")
    return None if value is None else int(value)


class Scheduler:
    """The waiting requests (in arrival order), the running ones (admitted, their blocks held) and
    the blocks the running ones may still allocate (``reserved``), over one ``BlockPool``; see the
    module's docstring. ``batched_tokens``: the tokens of one step (chunked prefill), or None."""

    def __init__(self, pool: BlockPool, max_batch: int, batched_tokens: int | None):
        self.pool, self.max_batch, self.batched_tokens = pool, max_batch, batched_tokens
        self.block_size = pool.block_size
        self.waiting: deque[PagedRequest] = deque()
        self.running: list[PagedRequest] = []
        self.reserved = 0

    def schedule(self) -> list[StepSequence]:
        """This step's sequences. Without a token budget: the requests admitted now, whole prompts,
        else one decode token of every running request. With one (chunked prefill): one decode
        token of every request past its prompt, then prompt tokens in arrival order (the requests
        mid-prompt, then those admitted now) while the budget lasts. The decode tokens all run
        even when they alone fill the budget; the prompts then wait for a step with room."""
        if self.batched_tokens is None:
            joining = self._admit(None)
            if joining:
                return [StepSequence.chunk(request, len(request.prompt) - request.seq.length, joining=True)
                        for request in joining]
            return [StepSequence.decoding(request) for request in self.running]
        work = [StepSequence.decoding(request) for request in self.running if not request.prefilling]
        room = self.batched_tokens - len(work)
        if 0 < len(work) < STEP_TOKENS:  # beside decode tokens, a step stays in the decode graph (paged_graphs)
            room = min(room, STEP_TOKENS - len(work))
        for request in self.running:
            if request.prefilling and room > 0:
                tokens = min(room, len(request.prompt) - request.seq.length)
                work.append(StepSequence.chunk(request, tokens))
                room -= tokens
        if room > 0:
            for request in self._admit(room):  # the same split as _admit's
                tokens = min(room, len(request.prompt) - request.seq.length)
                work.append(StepSequence.chunk(request, tokens, joining=True))
                room -= tokens
        return work

    def grow(self, request: PagedRequest, count: int) -> Growth:
        """The blocks of the request's next ``count`` positions (copy-on-write included), out of its
        reservation."""
        before = len(request.seq.blocks)
        growth = self.pool.grow(request.seq, count)
        taken = len(request.seq.blocks) - before + len(growth.copies)
        request.reserved -= taken
        self.reserved -= taken
        return growth

    def finish(self, request: PagedRequest, keep: bool = True) -> None:
        """A running request ends: its blocks go back (``keep``: what it computed stays cached)."""
        self.pool.close(request.seq, keep)
        self.reserved -= request.reserved
        request.reserved = 0
        self.running.remove(request)

    def end(self, requests) -> None:
        """A step raised: its requests end (their blocks freed, none registered as cached)."""
        self.pool.settle()
        for request in requests:
            if request in self.running:
                self.finish(request, keep=False)

    def drop(self, request_id: int) -> bool:
        """Stops a request, waiting or running; False if no such request is unfinished."""
        for request in self.waiting:
            if request.id == request_id:
                self.waiting.remove(request)
                return True
        for request in self.running:
            if request.id == request_id:
                self.finish(request)
                return True
        return False

    def _keys(self, request: PagedRequest) -> list[bytes]:
        if request.keys is None:
            request.keys = prefix_keys(request.prompt, self.block_size, request.root) if self.pool.prefix_caching \
                else []
        return request.keys

    def _computing(self) -> set[bytes]:
        """The chain digests of the full prompt blocks the running requests have still to compute
        (mid-prompt under chunked prefill; registered once a step completes them)."""
        computing, bs = set(), self.block_size
        for request in self.running:
            if request.prefilling and request.seq.epoch == self.pool.epoch:
                computing.update(self._keys(request)[request.seq.length // bs:])
        return computing

    def _admit(self, room: int | None) -> list[PagedRequest]:
        """Waiting requests, in order, while a batch has room, their blocks fit and (chunked
        prefill) ``room`` prompt tokens of the step remain. A request whose next uncached block a
        running or joining request is computing waits (a step, or until a chunked prompt has
        reached past that block), then finds it cached."""
        joining, computing = [], self._computing()
        bs = self.block_size
        while self.waiting and len(self.running) < self.max_batch and (room is None or room > 0):
            request = self.waiting[0]
            match = self.pool.match(request.prompt, request.root)
            keys = self._keys(request)
            if match.tokens // bs < len(keys) and keys[match.tokens // bs] in computing:
                break
            if not self._fits(request, match):
                # a partial block is held while the step copies it: it may be the one block too many
                match = match.whole_blocks(bs)
                if not self._fits(request, match):
                    break
            self.waiting.popleft()
            request.seq = self.pool.open(request.prompt, match.blocks, match.tokens, request.root)
            request.reserved = self._growth_blocks(request, match)
            self.reserved += request.reserved
            self.running.append(request)
            if room is not None:
                room -= min(room, len(request.prompt) - match.tokens)
            joining.append(request)
            computing.update(keys)
        return joining

    def _growth_blocks(self, request: PagedRequest, match: Match) -> int:
        """Blocks the request may still allocate on ``match``: all its positions' less the full
        blocks it shares (a partial one is replaced by a copy, which counts)."""
        return blocks_for(len(request.prompt) + request.max_new_tokens - 1, self.block_size) - \
            match.tokens // self.block_size

    def _fits(self, request: PagedRequest, match: Match) -> bool:
        """Its growth fits beside the running requests' reservations, less the cached blocks it
        takes out of the eviction order by holding them (each counted once)."""
        idle = sum(1 for b in set(match.blocks) if self.pool.refs[b] == 0)
        return self.reserved + self._growth_blocks(request, match) <= self.pool.available - idle
