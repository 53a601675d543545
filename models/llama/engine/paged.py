"""The paged engine: serving on a block-paged KV cache with prefix caching, ``PagedGenerator``.

The contiguous ``Generator`` gives every slot a whole capacity bucket, sized for the longest
sequence a slot may reach; a server with requests of mixed lengths fits far fewer of them, and a
shared system prompt is computed again for each request. Here the cache is one pool of blocks
(``kv_cache.PagedKVCache``, MindFormers' and vLLM's layout): a request holds only the blocks its
tokens reach, allocated as it grows and released when it ends, and requests whose prompts share a
prefix share its blocks (``block_pool.BlockPool``: reference counts, copy-on-write, a SHA-256 chain
per block), so the shared part is computed once.

A server drives it with ``add_request`` (per-request sampling settings and cache salt) / ``step`` /
``abort``; ``stream`` and ``generate`` are the ``Generator``'s own calls (``common.Engine``). Each
``step`` is one call of the model: ``paged_scheduler`` says which requests it holds and when a
request is admitted (whole prompts or decode tokens by default; both, split to a token budget,
under chunked prefill: ``max_num_batched_tokens``), ``paged_graphs`` which of the two graphs runs
them and what it is given, ``paged_step`` what the step ends with. ``last_record`` (a
``StepRecord``) says what each step held.

**A step's graph call is all or nothing.** The blocks it grows and the graph call happen first; if
any of them raises, every request of the step ends (its blocks freed, nothing it wrote registered
as cached; under chunked prefill, every request with tokens in the call, the blocks its earlier
chunks completed staying cached) and the exception propagates. Once the graph has run, each row is
drawn on its own (``paged_step``): a request whose row raises (``SamplingError``: NaN logits; any
other ``Exception``: a bug of the sampler) ends alone, with a last ``Token`` carrying the error,
and the step commits the others; a ``BaseException`` (Ctrl-C) still ends the whole step.

**Threads.** Every public call takes the generator's lock, so a server may ``abort`` or
``add_request`` from a request's thread while its engine thread runs ``step``: the call waits for
the step to end, and never sees a request half stepped.

    python -m models.llama.generate --model tiny --ids 1,15,27 --ids 1,15,28 --paged
"""
from __future__ import annotations

import threading
from collections import deque

import numpy as np

from ..model import LlamaForCausalLM
from .block_pool import BlockPool, blocks_for, cache_root
from .common import (CACHE_MEMORY_FRACTION, GIB, Engine, Sampling, Token, cache_memory_budget, check_eos,
                     check_prompts, check_sampling, is_int)
from .kv_cache import PagedKVCache, block_bytes
from .paged_graphs import check_decode_ids, paged_graphs, run_decode, run_prefill, runs_in_place
from .paged_scheduler import PagedRequest, Scheduler, StepSequence, check_batched_tokens
from .paged_step import StepRecord, commit, draw


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
        batched_tokens = check_batched_tokens(max_num_batched_tokens)
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
        self.prefill, self.decode = paged_graphs(model, self.cache)
        self.graphs = (self.prefill, self.decode)
        self.scheduler = Scheduler(self.pool, max_batch, batched_tokens)
        self._lock = threading.RLock()  # every public call holds it: see the module's docstring
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
        return self.scheduler.batched_tokens

    @max_num_batched_tokens.setter
    def max_num_batched_tokens(self, value: int | None) -> None:
        """Changed only while no request is unfinished (a prompt half prefilled needs chunked steps)."""
        value = check_batched_tokens(value)
        with self._lock:
            if self.has_unfinished:
                raise ValueError(f"max_num_batched_tokens: {len(self.waiting) + len(self.running)} requests are "
                                 "unfinished; change it when none is")
            self.scheduler.batched_tokens = value

    @property
    def waiting(self) -> deque[PagedRequest]:
        """The requests not yet admitted, in arrival order (``Scheduler.waiting``)."""
        return self.scheduler.waiting

    @property
    def running(self) -> list[PagedRequest]:
        """The requests admitted and unfinished, their blocks held (``Scheduler.running``)."""
        return self.scheduler.running

    @property
    def reserved(self) -> int:
        """Blocks the running requests may still allocate."""
        return self.scheduler.reserved

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
            request = PagedRequest(self._next_id, [int(t) for t in prompt], count, eos, sampling, root=root)
            self._next_id += 1
            self.waiting.append(request)
            return request.id

    def abort(self, request_id: int) -> bool:
        """Stops a request, waiting or running; its blocks go back to the pool (the cached ones stay
        findable). False if no such request is unfinished."""
        with self._lock:
            return self.scheduler.drop(request_id)

    def reset_prefix_cache(self) -> None:
        """Forgets every cached prefix: call it after changing the model's weights, so that no
        request is served keys the old weights computed (running requests finish as they are)."""
        with self._lock:
            self.pool.reset()

    def step(self) -> list[Token]:
        """One call of the model: what ``Scheduler.schedule`` gives this step (see the module's
        docstring). Returns the tokens sampled (``Token.request``: the id), the graph call all or
        nothing, each row's draw on its own; ``last_record`` says what the step held."""
        with self._lock:
            work = self.scheduler.schedule()
            if not work:
                self.last_step, self.last_record, self.last_logits = None, None, None
                return []
            graph = "decode" if runs_in_place(work) else "prefill"
            try:
                check_decode_ids(work, self.model.vocab_size)
                logits = self._run_decode(work) if graph == "decode" else self._run_prefill(work)
                drawn = [self._draw(w.request, row) if w.samples else None for w, row in zip(work, logits)]
            except BaseException:
                self.scheduler.end([w.request for w in work])
                raise
            self.last_logits = logits[[w.samples for w in work]]
            self.last_record = record = StepRecord.of(work, drawn, graph)
            self.last_step = "decode" if record.kind == "decode" else "prefill"
            self.prefilled_tokens += record.prompt_tokens
            self.cached_prompt_tokens += sum(n for _, n in record.cached_tokens)
            return commit(work, drawn, self.pool, self.scheduler.finish)

    # ---- the step's graph calls and its draw, one method each: a test may make one fail ----
    def _run_prefill(self, work: list[StepSequence]) -> np.ndarray:
        return run_prefill(self.prefill, self.cache, work, self.scheduler.grow)

    def _run_decode(self, work: list[StepSequence]) -> np.ndarray:
        return run_decode(self.decode, self.cache, work, self.scheduler.grow, self.table_width)

    _draw = staticmethod(draw)

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
