"""The paged engine: serving on a block-paged KV cache with prefix caching, ``PagedGenerator``.

The contiguous ``Generator`` gives every slot a whole capacity bucket, sized for the longest
sequence a slot may reach; a server with requests of mixed lengths fits far fewer of them, and a
shared system prompt is computed again for each request. Here the cache is one pool of blocks
(``kv_cache.PagedKVCache``, MindFormers' and vLLM's layout): a request holds only the blocks its
tokens reach, allocated as it grows and released when it ends, and requests whose prompts share a
prefix share its blocks (``block_pool.BlockPool``: reference counts, copy-on-write, a SHA-256 chain
per block), so the shared part is computed once.

A server drives it with ``add_request`` (per-request sampling settings and cache salt) / ``step`` /
``abort``; ``stream`` and ``generate`` are the ``Generator``'s own calls (``common.Engine``). By
default (``max_num_batched_tokens=None``) each ``step`` either prefills the requests it admits,
whole prompts (one packed call; the new keys rotated once and written by ``rotary_cache_write``,
attention over cached prefix + new tokens by the fused op with ``key_rotated``), or decodes one
token of every running request (one call of ``rotary_paged_attention`` per layer, reading the
blocks in place). A request is admitted when the blocks it can grow to (prompt + new tokens, less
the full blocks it shares) fit beside what the running requests can still take, so a step never
runs out of blocks and nothing is preempted; admission is first come, first served, and a request
the cache can hold alone is admitted at the latest when nothing else runs.

**Chunked prefill** (``max_num_batched_tokens=N``, vLLM's name): a long prompt no longer stops the
running requests. Each step is one call holding one decode token of every running request whose
prompt is done, then prompt tokens while the N - (decode tokens) left last (beside 1..15 decode
tokens, at most 16 tokens in all: see below): first of the requests already mid-prompt, then of
those admitted now, in arrival order; a prompt is split over as many
steps as it needs (its cached prefix counts as computed) and samples its first token in the step
that computes its last token. Decode tokens are never held back: they all run, and when they alone
fill N the step holds only them and the prompts wait until a decoding request ends (with N >=
``max_batch`` that never happens while a prompt is unfinished: a request mid-prompt leaves at most
``max_batch - 1`` decoding). They cannot pass N: a step completes at most as many prompts as it
holds prompt tokens, at most N less its decode tokens.

Which graph a step runs: decode tokens only, or at most 16 tokens in all (``STEP_TOKENS``, the
paged kernel's queries per sequence), run the decode graph: each sequence's new tokens attended
over its blocks in place, the projections on the few-row path that streams the weights as stored.
Other steps run the prefill graph (each sequence's context gathered for the fused op, each decoding
request a sequence of one new token). That is why decode tokens leave a step only up to 16 tokens:
on 2 cores with Llama2-7B's dimensions (2 layers, half weights) such a step took 159-168 ms beside
a 60 ms decode step, where a 128-token chunk's prefill graph step took 1.07 s (docs/serving.md). With
16 or more decode tokens, prompts take N as above. A block a step's prompt shares and must write
into is copied before the step, whichever graph runs (``PagedKVCache.copy_blocks``). A chunk's full
blocks are registered when its step has run, as a whole prompt's are; the block it fills partly
stays its own and unregistered until a later chunk
fills it (or the request is aborted: then, as a finished sequence's partial last block, it is
registered with its keys final). A request whose next uncached block another request is computing
(admitted this step, or mid-prompt) waits until that block is registered, then shares it, or until
the other request ends. ``last_record`` (a ``StepRecord``) says what each step held.

**A step is all or nothing.** The blocks it grows, the graph call and the sampling of every row
happen first; if any of them raises, every request of the step ends (its blocks freed, nothing it
wrote registered as cached; under chunked prefill, every request with tokens in the call, the
blocks its earlier chunks completed staying cached) and the exception propagates. Only after all of
them succeeded does the step commit: each request's written tokens enter its context and its new
token becomes pending. A request whose own row cannot be sampled (``SamplingError``: NaN logits)
ends alone, with a last ``Token`` carrying the error; the others carry on.

**Threads.** Every public call takes the generator's lock, so a server may ``abort`` or
``add_request`` from a request's thread while its engine thread runs ``step``: the call waits for
the step to end, and never sees a request half stepped.

    python -m models.llama.generate --model tiny --ids 1,15,27 --ids 1,15,28 --paged
"""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field

import mindspore as ms
import numpy as np
from mindspore import Tensor

from ..cache_views import PagedDecode, PagedPrefill
from ..model import LlamaForCausalLM
from .block_pool import SCRATCH_BLOCK, BlockPool, Match, SequenceBlocks, blocks_for, cache_root, prefix_keys
from .common import (CACHE_MEMORY_FRACTION, GIB, CacheGraph, Engine, Request, Sampling, SamplingError, Token,
                     cache_memory_budget, check_eos, check_prompts, check_sampling, dynamic_vector, is_int)
from .kv_cache import STEP_TOKENS, PagedKVCache, block_bytes, token_bucket


class _PagedPrefill(CacheGraph):
    """Whole prompts' uncached tokens (packed, ending at ``aq``; their sequences, cached prefix
    included, ending at ``akv``) into their blocks; logits of each prompt's last token."""

    @ms.jit
    def construct(self, input_ids, aq, akv, slots, positions, blocks, context):
        self.count_compile()
        view = PagedPrefill.build(self.cache.keys, self.cache.values, slots, positions, blocks, context)
        return self.lm(input_ids, aq, akv, view)


class _PagedDecode(CacheGraph):
    """1..16 new tokens per sequence (a decode token, or a prompt's chunk; padded to a power of two
    with filler sequences that write nothing), attended over the blocks in place; static shapes: one
    graph per token count."""

    @ms.jit
    def construct(self, input_ids, slots, positions, block_tables, context_lens, q_seq_lens):
        self.count_compile(input_ids.shape[0])
        view = PagedDecode.build(self.cache.keys, self.cache.values, slots, positions, block_tables, context_lens,
                                 q_seq_lens)
        return self.lm(input_ids, None, None, view)


@dataclass
class _Request(Request):
    root: bytes = field(kw_only=True)  # its cache salt's chain root
    seq: SequenceBlocks | None = None
    reserved: int = 0      # blocks it may still allocate
    keys: list[bytes] | None = None  # the chain digests of its prompt's full blocks (none without prefix caching)

    @property
    def prefilling(self) -> bool:
        """Admitted, and part of its prompt not yet computed (chunked prefill only, between steps)."""
        return self.seq.length < len(self.prompt)


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

    @property
    def prompt_tokens(self) -> int:
        return sum(n for _, n in self.prefill_tokens)

    @property
    def total_tokens(self) -> int:
        """The tokens of the model call: one per decoding request, plus the prompt tokens."""
        return len(self.decode_requests) + self.prompt_tokens


@dataclass
class _Work:
    """One sequence of a step: the tokens it writes (a prompt chunk, or a decoding request's pending
    token) and whether its row is sampled (a decode token, or its prompt's last chunk)."""
    request: _Request
    ids: list[int]
    decode: bool
    samples: bool
    joining: bool = False  # admitted this step: its cached prefix is counted when the step commits

    @classmethod
    def chunk(cls, request: _Request, tokens: int, joining: bool = False) -> "_Work":
        """The next ``tokens`` tokens of the request's prompt."""
        start = request.seq.length
        return cls(request, request.prompt[start:start + tokens], False, start + tokens == len(request.prompt),
                   joining)

    @classmethod
    def decoding(cls, request: _Request) -> "_Work":
        return cls(request, [request.pending], True, True)


def _check_batched_tokens(value):
    if value is not None and (not is_int(value) or value < 1):
        raise ValueError("max_num_batched_tokens: expected an int >= 1 (the tokens of one step: chunked prefill) "
                         f"or None (whole prompts, then decode steps), got {value!r}")
    return None if value is None else int(value)


class PagedGenerator(Engine):
    """Drives a ``LlamaForCausalLM`` over a block-paged KV cache (see the module's docstring).

    ``max_cache_bytes`` is the cache's budget (default: ``max_batch`` sequences of the model's
    positions, at most ``CACHE_MEMORY_FRACTION`` of the memory available), cut into blocks of
    ``block_size`` positions (a multiple of 16); ``max_batch`` bounds the sequences of one step.
    ``cache_dtype`` as the ``Generator``'s. ``prefix_caching=False`` computes every prompt whole.
    ``max_num_batched_tokens`` (vLLM's name): None, a step prefills whole prompts or decodes; an
    int turns on chunked prefill, each step's call holding at most that many tokens (see the
    module's docstring). CPU only: the paged ops have no Ascend kernel (docs/serving.md). A tensor-parallel
    model (``parallel`` of tensor ranks only) runs the same engine on every rank, each rank's cache holding its
    KV heads: every rank must make the same calls in the same order with the same ``max_cache_bytes``
    (``models.llama.serve.lockstep`` does it for the server)."""

    def __init__(self, model: LlamaForCausalLM, *, max_cache_bytes: int | None = None, block_size: int = 16,
                 max_batch: int = 8, cache_dtype=None, prefix_caching: bool = True,
                 max_num_batched_tokens: int | None = None):
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch: expected a positive int, got {max_batch!r}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 16 or block_size % 16:
            raise ValueError(f"block_size: expected a positive multiple of 16, got {block_size!r}")
        self._batched_tokens = _check_batched_tokens(max_num_batched_tokens)
        self._room = None  # prompt tokens the step being scheduled has left (chunked prefill; _admit reads it)
        if model.parallel is not None and (model.parallel.context.size > 1 or model.parallel.data.size > 1):
            raise ValueError("model: the paged cache serves a model on one device or tensor-parallel ranks (each "
                             "holds its KV heads' blocks); this one is context- or data-parallel")
        super().__init__(model, cache_dtype)
        self.max_batch, self.block_size = max_batch, block_size
        per_block = block_bytes(model.cache_config, block_size, self.cache_dtype)
        limit = cache_memory_budget()
        if max_cache_bytes is None:
            max_cache_bytes = min(limit, (max_batch * blocks_for(model.max_positions, block_size) + 1) * per_block)
        elif isinstance(max_cache_bytes, bool) or not isinstance(max_cache_bytes, int) or max_cache_bytes < 1:
            raise ValueError(f"max_cache_bytes: expected a positive int of bytes, got {max_cache_bytes!r}")
        elif max_cache_bytes > limit:
            raise ValueError(f"max_cache_bytes: {max_cache_bytes / GIB:.2f} GiB is over {CACHE_MEMORY_FRACTION:.0%} of "
                             f"the memory available ({limit / GIB:.2f} GiB)")
        num_blocks = max_cache_bytes // per_block
        if num_blocks < 2:
            raise ValueError(f"max_cache_bytes: {max_cache_bytes} bytes hold {num_blocks} block(s) of {per_block} "
                             "bytes; at least 2 are needed (one is the padding's)")
        self.pool = BlockPool(int(num_blocks), block_size, prefix_caching)
        self.cache = PagedKVCache(model.cache_config, int(num_blocks), block_size, self.cache_dtype)
        self.table_width = blocks_for(model.max_positions, block_size)
        self.prefill, self.decode = _PagedPrefill(model, self.cache), _PagedDecode(model, self.cache)
        self.graphs = (self.prefill, self.decode)
        # ids, query ends, key ends, slots, positions, the sequences' blocks, each key's row among theirs
        self.prefill.set_inputs(*[dynamic_vector(t) for t in (ms.int32, ms.int64, ms.int64, ms.int32, ms.int32,
                                                              ms.int32, ms.int32)])
        self._lock = threading.RLock()  # every public call holds it: see the module's docstring
        self.waiting: deque[_Request] = deque()
        self.running: list[_Request] = []
        self.reserved = 0  # blocks the running requests may still allocate
        self._next_id = 0
        self.compile_s = 0.0
        # what the last step() ran: 'prefill' (any prompt tokens, decode tokens beside them or not), 'decode'
        # or None (nothing to do); last_record says exactly what (a StepRecord)
        self.last_step, self.last_record = None, None
        self.last_logits = None  # its logits (float32, one row per token it returned, in that order)
        # prompt tokens computed / found in the cache, counted when the step that computed / used them ran
        self.prefilled_tokens = self.cached_prompt_tokens = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def max_num_batched_tokens(self) -> int | None:
        """The tokens one step may hold (chunked prefill), or None: whole-prompt prefill steps."""
        return self._batched_tokens

    @max_num_batched_tokens.setter
    def max_num_batched_tokens(self, value: int | None) -> None:
        """Changed only while no request is unfinished (a prompt half prefilled needs chunked steps)."""
        value = _check_batched_tokens(value)
        with self._lock:
            if self.has_unfinished:
                raise ValueError(f"max_num_batched_tokens: {len(self.waiting) + len(self.running)} requests are "
                                 "unfinished; change it when none is")
            self._batched_tokens = value

    @property
    def cached_tokens(self) -> int:
        """Tokens in the cache of the running requests (a shared block counted for each)."""
        return sum(r.seq.length for r in self.running)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- the server's calls ----
    def add_request(self, prompt, max_new_tokens: int = 32, *, temperature: float = 0.0, top_k: int = 0,
                    top_p: float = 1.0, seed: int = 0, eos_ids=None, cache_salt: str | bytes | None = None) -> int:
        """Queues a request; returns its id (``Token.request`` of its tokens). Refused here, naming
        the argument, when it could never run: bad ids or settings, or more blocks than the budget.
        Requests share cached blocks only with requests of the same ``cache_salt`` (None: unsalted)."""
        (count,) = check_prompts(self.model, [prompt], max_new_tokens, name="prompt")
        check_sampling(temperature, top_k, top_p)
        if not is_int(seed) or seed < 0:
            raise ValueError(f"seed: expected an int >= 0, got {seed!r}")
        eos = check_eos(eos_ids, self.model)
        root = cache_root(cache_salt)
        need = blocks_for(len(prompt) + count - 1, self.block_size)
        if need > self.pool.usable:
            raise ValueError(f"prompt: {len(prompt)} tokens + {count} new tokens need {need} blocks of "
                             f"{self.block_size} positions, the cache holds {self.pool.usable}; raise max_cache_bytes")
        with self._lock:
            sampling = Sampling(float(temperature), int(top_k), float(top_p), np.random.default_rng(int(seed)))
            request = _Request(self._next_id, [int(t) for t in prompt], count, eos, sampling, root=root)
            self._next_id += 1
            self.waiting.append(request)
            return request.id

    def abort(self, request_id: int) -> bool:
        """Stops a request, waiting or running; its blocks go back to the pool (the cached ones stay
        findable). False if no such request is unfinished."""
        with self._lock:
            for request in self.waiting:
                if request.id == request_id:
                    self.waiting.remove(request)
                    return True
            for request in self.running:
                if request.id == request_id:
                    self._finish(request)
                    return True
            return False

    def reset_prefix_cache(self) -> None:
        """Forgets every cached prefix: call it after changing the model's weights, so that no
        request is served keys the old weights computed (running requests finish as they are)."""
        with self._lock:
            self.pool.reset()

    def step(self) -> list[Token]:
        """One call of the model: what ``_schedule`` gives this step (see the module's docstring).
        Returns the tokens sampled (``Token.request``: the id), all or nothing; ``last_record`` says
        what the step held."""
        with self._lock:
            work = self._schedule()
            if not work:
                self.last_step, self.last_record, self.last_logits = None, None, None
                return []
            requests = [w.request for w in work]
            graph = "decode" if self._in_place(work) else "prefill"
            try:
                logits = self._run_decode(work) if graph == "decode" else self._run_prefill(work)
                drawn = [self._draw(w.request, row) if w.samples else None for w, row in zip(work, logits)]
            except BaseException:
                self._failed(requests)
                raise
            self.last_logits = logits[[w.samples for w in work]]
            self.last_record = self._record(work, drawn, graph)
            self.last_step = "decode" if self.last_record.kind == "decode" else "prefill"
            return self._commit(work, drawn)

    @staticmethod
    def _in_place(work: list[_Work]) -> bool:
        """The step runs the decode graph (the module's docstring says when, and why)."""
        return all(w.decode for w in work) or sum(len(w.ids) for w in work) <= STEP_TOKENS

    @staticmethod
    def _record(work: list[_Work], drawn: list, graph: str) -> StepRecord:
        decode = tuple(w.request.id for w in work if w.decode)
        prefill = tuple((w.request.id, len(w.ids)) for w in work if not w.decode)
        first = tuple(w.request.id for w, token in zip(work, drawn) if not w.decode and isinstance(token, int))
        cached = tuple((w.request.id, w.request.seq.length) for w in work if w.joining)  # before the commit
        kind = "decode" if not prefill else "mixed" if decode else "prefill"
        return StepRecord(kind, decode, prefill, first, cached, graph=graph)

    def _draw(self, request: _Request, row: np.ndarray):
        """The request's next token, or the ``SamplingError`` its row raised (it ends alone)."""
        try:
            return int(request.sampling.draw(row[None])[0])
        except SamplingError as exc:
            return exc

    def _commit(self, work: list[_Work], drawn: list) -> list[Token]:
        """The step ran for every request: what it wrote enters their contexts, their new tokens
        become pending; a request whose row could not be sampled ends with its error."""
        self.pool.settle()
        tokens = []
        for item, token in zip(work, drawn):
            request = item.request
            if not item.decode:
                self.prefilled_tokens += len(item.ids)
                self.cached_prompt_tokens += request.seq.length if item.joining else 0
            if isinstance(token, Exception):
                self._finish(request, keep=False)
                tokens.append(Token(request.id, None, True, token))
                continue
            self.pool.commit(request.seq, item.ids)
            if token is None:  # a prompt chunk that is not its last: nothing sampled yet
                continue
            finished = request.took(token)
            tokens.append(Token(request.id, token, finished))
            if finished:
                self._finish(request)
        return tokens

    # ---- scheduling ----
    def _schedule(self) -> list[_Work]:
        """This step's sequences. Without a token budget: the requests admitted now, whole prompts,
        else one decode token of every running request. With one (chunked prefill): one decode
        token of every request past its prompt, then prompt tokens in arrival order (the requests
        mid-prompt, then those admitted now) while the budget lasts. The decode tokens all run
        even when they alone fill the budget; the prompts then wait for a step with room."""
        if self._batched_tokens is None:
            self._room = None
            joining = self._admit()
            if joining:
                return [_Work.chunk(request, len(request.prompt) - request.seq.length, joining=True)
                        for request in joining]
            return [_Work.decoding(request) for request in self.running]
        work = [_Work.decoding(request) for request in self.running if not request.prefilling]
        room = self._batched_tokens - len(work)
        if 0 < len(work) < STEP_TOKENS:  # beside decode tokens, a step stays in the decode graph (_in_place)
            room = min(room, STEP_TOKENS - len(work))
        for request in self.running:
            if request.prefilling and room > 0:
                tokens = min(room, len(request.prompt) - request.seq.length)
                work.append(_Work.chunk(request, tokens))
                room -= tokens
        if room > 0:
            self._room = room
            for request in self._admit():  # the same split as _admit's
                tokens = min(room, len(request.prompt) - request.seq.length)
                work.append(_Work.chunk(request, tokens, joining=True))
                room -= tokens
        return work

    def _keys(self, request: _Request) -> list[bytes]:
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

    def _admit(self) -> list[_Request]:
        """Waiting requests, in order, while a batch has room, their blocks fit and (chunked
        prefill) prompt tokens of the step remain (``_room``, set by ``_schedule``: an argument
        would change the signature models.llama.serve wraps). A request whose next uncached block
        a running or joining request is computing waits (a step, or until a chunked prompt has
        reached past that block), then finds it cached."""
        joining, computing = [], self._computing()
        bs, room = self.block_size, self._room
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

    def _growth_blocks(self, request: _Request, match: Match) -> int:
        """Blocks the request may still allocate on ``match``: all its positions' less the full
        blocks it shares (a partial one is replaced by a copy, which counts)."""
        return blocks_for(len(request.prompt) + request.max_new_tokens - 1, self.block_size) - \
            match.tokens // self.block_size

    def _fits(self, request: _Request, match: Match) -> bool:
        """Its growth fits beside the running requests' reservations, less the cached blocks it
        takes out of the eviction order by holding them (each counted once)."""
        idle = sum(1 for b in set(match.blocks) if self.pool.refs[b] == 0)
        return self.reserved + self._growth_blocks(request, match) <= self.pool.available - idle

    def _grow(self, request: _Request, count: int):
        before = len(request.seq.blocks)
        growth = self.pool.grow(request.seq, count)
        taken = len(request.seq.blocks) - before + len(growth.copies)
        request.reserved -= taken
        self.reserved -= taken
        return growth

    def _finish(self, request: _Request, keep: bool = True) -> None:
        self.pool.close(request.seq, keep)
        self.reserved -= request.reserved
        request.reserved = 0
        self.running.remove(request)

    def _failed(self, requests) -> None:
        """A step raised: its requests end (their blocks freed, none registered as cached)."""
        self.pool.settle()
        for request in requests:
            if request in self.running:
                self._finish(request, keep=False)

    # ---- the two calls ----
    def _check_pending(self, requests) -> None:
        vocab = self.model.vocab_size
        for request in requests:  # an id out of range would read a zero row of a float32 embedding, silently
            if not 0 <= request.pending < vocab:
                raise RuntimeError(f"PagedGenerator: request {request.id} would decode token id {request.pending}, "
                                   f"outside [0, {vocab}) (a bug of the engine: please report it)")

    def _run_prefill(self, work: list[_Work]) -> np.ndarray:
        """The prefill graph over the step's sequences: prompt chunks (a whole prompt is one chunk)
        and, under chunked prefill, decoding requests as sequences of one new token."""
        self._check_pending([w.request for w in work if w.decode])
        bs = self.block_size
        slots, positions, blocks, context, copies, ids, q_lens, kv_lens = [], [], [], [], [], [], [], []
        first_row = 0  # of this sequence's blocks among the step's
        for item in work:
            request = item.request
            start, length = request.seq.length, request.seq.length + len(item.ids)
            growth = self._grow(request, length - start)
            slots.append(growth.slots)
            copies += growth.copies
            positions.append(np.arange(start, length))
            held = request.seq.blocks[:blocks_for(length, bs)]
            blocks.append(held)
            context.append(first_row + np.arange(length))
            first_row += len(held) * bs
            ids.append(item.ids)
            q_lens.append(length - start)
            kv_lens.append(length)
        self.cache.copy_blocks(copies)
        args = (np.concatenate(ids).astype(np.int32), np.cumsum(q_lens).astype(np.int64),
                np.cumsum(kv_lens).astype(np.int64), np.concatenate(slots).astype(np.int32),
                np.concatenate(positions).astype(np.int32), np.concatenate(blocks).astype(np.int32),
                np.concatenate(context).astype(np.int32))
        return self.prefill(*[Tensor(a) for a in args]).asnumpy()

    def _run_decode(self, work: list[_Work]) -> np.ndarray:
        """The decode graph over the step's sequences, each its new tokens (a decode token, or a
        prompt chunk: ``q_seq_lens``) attended over its blocks in place; the logits of each one's
        last token. Padded to a power of two with filler sequences of one token that read the
        scratch block and write nothing, then sequences of no token."""
        self._check_pending([w.request for w in work if w.decode])
        lengths = [len(w.ids) for w in work]
        tokens = token_bucket(sum(lengths))
        fillers = tokens - sum(lengths)
        slots = np.full(tokens, -1, np.int32)
        positions = np.zeros(tokens, np.int32)
        ids = np.zeros(tokens, np.int32)
        tables = np.full((tokens, self.table_width), -1, np.int32)
        context, q_lens = np.zeros(tokens, np.int32), np.zeros(tokens, np.int32)
        fill = slice(len(work), len(work) + fillers)
        tables[fill, 0], context[fill], q_lens[fill] = SCRATCH_BLOCK, 1, 1
        row, copies = 0, []
        for i, (item, n) in enumerate(zip(work, lengths)):
            request = item.request
            start = request.seq.length
            growth = self._grow(request, n)
            copies += growth.copies
            rows = slice(row, row + n)
            slots[rows], positions[rows], ids[rows] = growth.slots, np.arange(start, start + n), item.ids
            tables[i, :len(request.seq.blocks)] = request.seq.blocks
            context[i], q_lens[i] = start + n, n
            row += n
        self.cache.copy_blocks(copies)
        logits = self.decode(Tensor(ids), Tensor(slots), Tensor(positions), Tensor(tables), Tensor(context),
                             Tensor(q_lens)).asnumpy()
        return logits[np.cumsum(lengths) - 1]

    # ---- the spine's calls (common.Engine: stream, generate, warm_up) ----
    def _prepare(self, prompts, counts) -> None:
        """A stream has the engine to itself: its requests' tokens are told apart by their index."""
        if self.has_unfinished:
            raise ValueError(f"stream: {len(self.waiting) + len(self.running)} requests of add_request are "
                             "unfinished; drive them with step()")

    def _steps(self, prompts, counts, settings: dict, seed: int, eos: frozenset):
        """A stream's requests through ``add_request`` / ``step`` (prompt i samples from its own
        random stream, seeded ``seed + i``); closing it aborts what is left of them."""
        index = {}
        try:
            for i, (prompt, count) in enumerate(zip(prompts, counts)):
                index[self.add_request(prompt, count, **settings, seed=seed + i, eos_ids=eos)] = i
            while self.has_unfinished:
                tokens = self.step()
                yield self.last_step, [Token(index[t.request], t.token, t.finished, t.error) for t in tokens]
        finally:
            for request_id in index:
                self.abort(request_id)

    def warm_up(self, prompts, max_new_tokens=2) -> float:
        """As the ``Generator``'s, with prefix caching off meanwhile, so that it leaves nothing cached."""
        caching, self.pool.prefix_caching = self.pool.prefix_caching, False
        try:
            return super().warm_up(prompts, max_new_tokens)
        finally:
            self.pool.prefix_caching = caching

    def _record_warm_up(self, seconds: float) -> None:
        self.compile_s += seconds
