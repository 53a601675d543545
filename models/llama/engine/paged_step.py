"""What a step of the paged engine ends with, once its graph has run: each sampled row drawn on its
own (``draw``), the ``StepRecord`` of what the step held, and the commit (``commit``).

A request whose row raises as it is drawn (``SamplingError``: NaN logits; any other ``Exception``:
a bug of the sampler) ends alone, with a last ``Token`` carrying the error, its blocks freed and
nothing it wrote registered; the graph ran for the others, whose written tokens enter their
contexts and whose new tokens become pending. A chunk's full blocks are registered when its step
has run, as a whole prompt's are; the block it fills partly stays its own and unregistered until a
later chunk fills it (or the request is aborted: then, as a finished sequence's partial last block,
it is registered with its keys final).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .block_pool import BlockPool
from .common import Token
from .paged_scheduler import PagedRequest, StepSequence


@dataclass(frozen=True)
class StepRecord:
    """What one ``step`` scheduled (``PagedGenerator.last_record``). ``kind``: 'prefill' (prompt
    tokens only), 'mixed' (prompt tokens and decode tokens in one call; chunked prefill only) or
    'decode'. ``decode_requests``: the ids that decoded one token, in the call's order;
    ``prefill_tokens``: (id, prompt tokens computed this step) in arrival order, a prompt split
    over steps appearing in each; ``first_tokens``: the ids whose first token this step sampled
    (those whose prompt's last token it computed), for a server's time to first token;
    ``cached_tokens``: (id, prompt tokens found in the prefix cache) of each request admitted this
    step, for its usage's cached tokens. ``graph``: the call that ran it, 'decode' (every sequence's
    new tokens attended over its blocks in place by the paged kernel: a decode step, or a step of at
    most ``STEP_TOKENS`` tokens) or 'prefill' (the cached context gathered for the fused op)."""
    kind: str
    decode_requests: tuple[int, ...] = ()
    prefill_tokens: tuple[tuple[int, int], ...] = ()
    first_tokens: tuple[int, ...] = ()
    cached_tokens: tuple[tuple[int, int], ...] = ()
    graph: str = field(kw_only=True)

    @classmethod
    def of(cls, work: list[StepSequence], drawn: list, graph: str) -> "StepRecord":
        """The record of a step that ran ``work`` in ``graph`` and drew ``drawn``, before its commit."""
        decode = tuple(w.request.id for w in work if w.decode)
        prefill = tuple((w.request.id, len(w.ids)) for w in work if not w.decode)
        first = tuple(w.request.id for w, token in zip(work, drawn) if not w.decode and isinstance(token, int))
        cached = tuple((w.request.id, w.request.seq.length) for w in work if w.joining)
        kind = "decode" if not prefill else "mixed" if decode else "prefill"
        return cls(kind, decode, prefill, first, cached, graph=graph)

    @property
    def prompt_tokens(self) -> int:
        return sum(n for _, n in self.prefill_tokens)

    @property
    def total_tokens(self) -> int:
        """The tokens of the model call: one per decoding request, plus the prompt tokens."""
        return len(self.decode_requests) + self.prompt_tokens


def draw(request: PagedRequest, row: np.ndarray):
    """The request's next token, or the exception drawing it raised (a ``SamplingError``: NaN
    logits; any other: a bug): the request ends alone, the graph having run for the others."""
    try:
        return int(request.sampling.draw(row[None])[0])
    except Exception as exc:  # noqa: BLE001  not BaseException: Ctrl-C still fails the step
        return exc


def commit(work: list[StepSequence], drawn: list, pool: BlockPool,
           finish: Callable[..., None]) -> list[Token]:
    """The step ran for every request: what it wrote enters their contexts, their new tokens
    become pending; a request whose row could not be drawn ends with its error (``finish``:
    ``Scheduler.finish``)."""
    pool.settle()
    tokens = []
    for item, token in zip(work, drawn):
        request = item.request
        if isinstance(token, Exception):
            finish(request, keep=False)
            tokens.append(Token(request.id, None, True, token))
            continue
        pool.commit(request.seq, item.ids)
        if token is None:  # a prompt chunk that is not its last: nothing sampled yet
            continue
        finished = request.took(token)
        tokens.append(Token(request.id, token, finished))
        if finished:
            finish(request)
    return tokens
