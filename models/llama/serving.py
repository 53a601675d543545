"""Serving on a block-paged KV cache with prefix caching: ``PagedGenerator``.

The contiguous ``Generator`` gives every slot a whole capacity bucket, sized for the longest
sequence a slot may reach; a server with requests of mixed lengths fits far fewer of them, and a
shared system prompt is computed again for each request. Here the cache is one pool of blocks
(``kv_cache.PagedKVCache``, MindFormers' and vLLM's layout): a request holds only the blocks its
tokens reach, allocated as it grows and released when it ends, and requests whose prompts share a
prefix share its blocks (``block_pool.BlockPool``: reference counts, copy-on-write, a SHA-256 chain
per block), so the shared part is computed once.

A server drives it with ``add_request`` (per-request sampling settings) / ``step`` / ``abort``;
``stream`` and ``generate`` are the same calls as the ``Generator``'s. Each ``step`` either
prefills the requests it admits (one packed call; the new keys rotated once and written by
``rotary_cache_write``, attention over cached prefix + new tokens by the fused op with
``key_rotated``) or decodes one token of every running request (one call of
``rotary_paged_attention`` per layer, reading the blocks in place). A request is admitted when the
blocks it can grow to (prompt + new tokens, less the full blocks it shares) fit beside what the
running requests can still take, so a step never runs out of blocks and nothing is preempted.

    python -m models.llama.generate --model tiny --ids 1,15,27 --ids 1,15,28 --paged
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import mindspore as ms
import numpy as np
from mindspore import Tensor

from .block_pool import SCRATCH_BLOCK, BlockPool, SequenceBlocks, blocks_for, prefix_keys
from .decoding import (CACHE_MEMORY_FRACTION, GIB, CacheGraph, Generation, Token, available_memory,
                       check_cache_dtype, check_prompts, check_sampling, dynamic_vector, sample,
                       timed_generation)
from .kv_cache import PagedKVCache, block_bytes, token_bucket
from .model import DTYPES, LlamaForCausalLM, dtype_name


class _PagedPrefill(CacheGraph):
    """Whole prompts' uncached tokens (packed, ending at ``aq``; their sequences, cached prefix
    included, ending at ``akv``) into their blocks; logits of each prompt's last token."""

    @ms.jit
    def construct(self, input_ids, aq, akv, slots, positions, context, copy_from, copy_to):
        self.count_compile()
        where = ("prefill", slots, positions, context, copy_from, copy_to)
        return self.lm(input_ids, aq, akv, (self.cache.keys, self.cache.values, where))


class _PagedDecode(CacheGraph):
    """One new token per sequence (padded to a power of two with filler sequences that write
    nothing), attended over the blocks in place; static shapes: one graph per token count."""

    @ms.jit
    def construct(self, input_ids, slots, positions, block_tables, context_lens, q_seq_lens):
        self.count_compile(input_ids.shape[0])
        where = ("decode", slots, positions, block_tables, context_lens, q_seq_lens)
        return self.lm(input_ids, None, None, (self.cache.keys, self.cache.values, where), positions)


@dataclass
class _Request:
    id: int
    prompt: list[int]
    max_new_tokens: int
    eos: frozenset
    temperature: float
    top_k: int
    top_p: float
    rng: np.random.Generator
    seq: SequenceBlocks | None = None
    reserved: int = 0      # blocks it may still allocate
    pending: int = -1      # the last sampled token, not yet in the cache
    generated: int = 0


class PagedGenerator:
    """Drives a ``LlamaForCausalLM`` over a block-paged KV cache (see the module's docstring).

    ``max_cache_bytes`` is the cache's budget (default: ``max_batch`` sequences of the model's
    positions, at most ``CACHE_MEMORY_FRACTION`` of the memory available), cut into blocks of
    ``block_size`` positions (a multiple of 16); ``max_batch`` bounds the sequences of one step.
    ``cache_dtype`` as the ``Generator``'s. ``prefix_caching=False`` computes every prompt whole.
    CPU only: the paged ops have no Ascend kernel (docs/serving.md)."""

    def __init__(self, model: LlamaForCausalLM, *, max_cache_bytes: int | None = None, block_size: int = 16,
                 max_batch: int = 8, cache_dtype=None, prefix_caching: bool = True):
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch: expected a positive int, got {max_batch!r}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 16 or block_size % 16:
            raise ValueError(f"block_size: expected a positive multiple of 16, got {block_size!r}")
        if model.parallel is not None:
            raise ValueError("model: the paged cache serves a model on one device; use Generator for tensor parallel")
        self.model, self.max_batch, self.block_size = model, max_batch, block_size
        self.cache_dtype = DTYPES[dtype_name(cache_dtype)] if cache_dtype is not None else model.cache_dtype
        check_cache_dtype(self.cache_dtype)
        per_block = block_bytes(model.cache_config, block_size, self.cache_dtype)
        limit = int(CACHE_MEMORY_FRACTION * available_memory())
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
        # ids, query ends, key ends, slots, positions, (block, offset) of each key, copy-on-write pairs
        self.prefill.set_inputs(*[dynamic_vector(t) for t in (ms.int32, ms.int64, ms.int64, ms.int32, ms.int32)],
                                Tensor(shape=[None, 2], dtype=ms.int32), *[dynamic_vector(ms.int32)] * 2)
        self.waiting: deque[_Request] = deque()
        self.running: list[_Request] = []
        self.reserved = 0  # blocks the running requests may still allocate
        self._next_id = 0
        self.compile_s = 0.0
        self.last_step = None  # what the last step() ran: 'prefill', 'decode' or None (nothing to do)
        self.last_logits = None  # its logits (float32, one row per token it returned, in that order)
        self.prefilled_tokens = self.cached_prompt_tokens = 0  # prompt tokens computed / found in the cache

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def compile_log(self) -> list[tuple[str, int | None]]:
        return self.prefill.compile_log + self.decode.compile_log

    @property
    def cached_tokens(self) -> int:
        """Tokens in the cache of the running requests (a shared block counted for each)."""
        return sum(r.seq.length for r in self.running)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- the server's calls ----
    def add_request(self, prompt, max_new_tokens: int = 32, *, temperature: float = 0.0, top_k: int = 0,
                    top_p: float = 1.0, seed: int = 0, eos_ids=None) -> int:
        """Queues a request; returns its id (``Token.request`` of its tokens). Refused here, naming
        the argument, when it could never run: bad ids or settings, or more blocks than the budget."""
        (count,) = check_prompts(self.model, [prompt], max_new_tokens, name="prompt")
        check_sampling(temperature, top_k, top_p)
        need = blocks_for(len(prompt) + count - 1, self.block_size)
        if need > self.pool.usable:
            raise ValueError(f"prompt: {len(prompt)} tokens + {count} new tokens need {need} blocks of "
                             f"{self.block_size} positions, the cache holds {self.pool.usable}; raise max_cache_bytes")
        eos = frozenset(self.model.config.eos_token_ids if eos_ids is None else eos_ids)
        request = _Request(self._next_id, [int(t) for t in prompt], count, eos, float(temperature), int(top_k),
                           float(top_p), np.random.default_rng(seed))
        self._next_id += 1
        self.waiting.append(request)
        return request.id

    def abort(self, request_id: int) -> bool:
        """Stops a request, waiting or running; its blocks go back to the pool (the cached ones stay
        findable). False if no such request is unfinished."""
        for request in self.waiting:
            if request.id == request_id:
                self.waiting.remove(request)
                return True
        for request in self.running:
            if request.id == request_id:
                self._finish(request)
                return True
        return False

    def step(self) -> list[Token]:
        """One call of the model: prefill of the requests that can be admitted, else one decode
        token of every running request. Returns the tokens sampled (``Token.request``: the id)."""
        joining = self._admit()
        if joining:
            self.last_step, requests, logits = "prefill", joining, self._run_prefill(joining)
        elif self.running:
            self.last_step, requests, logits = "decode", list(self.running), self._run_decode(self.running)
        else:
            self.last_step, self.last_logits = None, None
            return []
        self.last_logits = logits
        tokens = []
        for request, row in zip(requests, logits):
            token = int(sample(row[None], request.rng, request.temperature, request.top_k, request.top_p)[0])
            request.pending, request.generated = token, request.generated + 1
            finished = token in request.eos or request.generated >= request.max_new_tokens
            tokens.append(Token(request.id, token, finished))
            if finished:
                self._finish(request)
        return tokens

    # ---- scheduling ----
    def _admit(self) -> list[_Request]:
        """Waiting requests, in order, while a batch has room and their blocks fit; a request whose
        next uncached block a joining request is computing waits a step, then finds it cached."""
        joining, computing = [], set()
        bs = self.block_size
        while self.waiting and len(self.running) + len(joining) < self.max_batch:
            request = self.waiting[0]
            shared, matched = self.pool.match(request.prompt)
            full = matched // bs
            keys = prefix_keys(request.prompt, bs) if self.pool.prefix_caching else []
            if full < len(keys) and keys[full] in computing:
                break
            need = blocks_for(len(request.prompt) + request.max_new_tokens - 1, bs) - full
            idle_shared = sum(1 for b in set(shared) if self.pool.refs[b] == 0)
            if self.reserved + need > self.pool.available - idle_shared:
                break
            self.waiting.popleft()
            request.seq = self.pool.open(request.prompt, shared, matched)
            request.reserved = need
            self.reserved += need
            joining.append(request)
            computing.update(keys)
        self.running.extend(joining)
        return joining

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
        """A call raised: its requests end (their blocks freed, none registered as cached)."""
        self.pool.settle()
        for request in requests:
            self._finish(request, keep=False)

    # ---- the two calls ----
    def _run_prefill(self, joining: list[_Request]) -> np.ndarray:
        bs = self.block_size
        slots, positions, context, copies, ids, q_lens, kv_lens = [], [], [], [], [], [], []
        for request in joining:
            start, length = request.seq.length, len(request.prompt)
            growth = self._grow(request, length - start)
            slots.append(growth.slots)
            copies += growth.copies
            positions.append(np.arange(start, length))
            keys = np.arange(length)
            context.append(np.stack([np.asarray(request.seq.blocks)[keys // bs], keys % bs], 1))
            ids.append(request.prompt[start:])
            q_lens.append(length - start)
            kv_lens.append(length)
            self.prefilled_tokens += length - start
            self.cached_prompt_tokens += start
        copies = copies or [(SCRATCH_BLOCK, SCRATCH_BLOCK)]  # the graph's copy takes at least one pair
        args = (np.concatenate(ids).astype(np.int32), np.cumsum(q_lens).astype(np.int64),
                np.cumsum(kv_lens).astype(np.int64), np.concatenate(slots).astype(np.int32),
                np.concatenate(positions).astype(np.int32), np.concatenate(context).astype(np.int32),
                np.array([c[0] for c in copies], np.int32), np.array([c[1] for c in copies], np.int32))
        try:
            logits = self.prefill(*[Tensor(a) for a in args]).asnumpy()
        except BaseException:
            self._failed(joining)
            raise
        for request in joining:
            self.pool.commit(request.seq, request.prompt[request.seq.length:])
        return logits

    def _run_decode(self, running: list[_Request]) -> np.ndarray:
        count = len(running)
        tokens = token_bucket(count)  # filler sequences of one token each: read the scratch block, write nothing
        slots = np.full(tokens, -1, np.int32)
        positions = np.zeros(tokens, np.int32)
        ids = np.zeros(tokens, np.int32)
        tables = np.full((tokens, self.table_width), -1, np.int32)
        tables[count:, 0] = SCRATCH_BLOCK
        context = np.ones(tokens, np.int32)
        for i, request in enumerate(running):
            growth = self._grow(request, 1)
            slots[i], positions[i], ids[i] = growth.slots[0], request.seq.length, request.pending
            tables[i, :len(request.seq.blocks)] = request.seq.blocks
            context[i] = request.seq.length + 1
        try:
            logits = self.decode(Tensor(ids), Tensor(slots), Tensor(positions), Tensor(tables), Tensor(context),
                                 Tensor(np.ones(tokens, np.int32))).asnumpy()
        except BaseException:
            self._failed(running)
            raise
        for request in running:
            self.pool.commit(request.seq, [request.pending])
        return logits[:count]

    # ---- the Generator's calls ----
    def stream(self, prompts, max_new_tokens=32, *, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
               seed: int = 0, eos_ids=None, on_step=None):
        """Yields a ``Token`` per generated token (``request``: the prompt's index), as the
        ``Generator``'s ``stream`` (prompt i samples from its own stream, seeded ``seed + i``); the
        generator must have no other requests in flight."""
        counts = check_prompts(self.model, prompts, max_new_tokens)
        check_sampling(temperature, top_k, top_p)
        if self.has_unfinished:
            raise ValueError(f"stream: {len(self.waiting) + len(self.running)} requests of add_request are "
                             "unfinished; drive them with step()")
        index = {}
        try:
            for i, (prompt, count) in enumerate(zip(prompts, counts)):
                index[self.add_request(prompt, count, temperature=temperature, top_k=top_k, top_p=top_p,
                                       seed=seed + i, eos_ids=eos_ids)] = i
            while self.has_unfinished:
                t0 = time.perf_counter()
                tokens = self.step()
                if on_step is not None and self.last_step:
                    on_step(self.last_step, time.perf_counter() - t0)
                for token in tokens:
                    yield Token(index[token.request], token.token, token.finished)
        finally:  # an abandoned stream leaves nothing of its own running
            for request_id in index:
                self.abort(request_id)

    def warm_up(self, prompts, max_new_tokens=2) -> float:
        """Compiles and runs the graphs these prompts take (prefix caching off meanwhile, so they
        leave nothing cached); seconds spent."""
        check_prompts(self.model, prompts, max_new_tokens)
        caching, self.pool.prefix_caching = self.pool.prefix_caching, False
        t0 = time.perf_counter()
        try:
            for _ in self.stream(prompts, 2, eos_ids=()):
                pass
        finally:
            self.pool.prefix_caching = caching
        seconds = time.perf_counter() - t0
        self.compile_s += seconds
        return seconds

    def generate(self, prompts, max_new_tokens=32, *, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 seed: int = 0, eos_ids=None) -> Generation:
        """Every prompt's tokens, with TTFT, the decode rate and per-step times (the warm-up's
        compilation excluded), as the ``Generator``'s."""
        check_prompts(self.model, prompts, max_new_tokens)
        check_sampling(temperature, top_k, top_p)
        compile_s = self.warm_up(prompts)
        return timed_generation(
            lambda on_step: self.stream(prompts, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                        seed=seed, eos_ids=eos_ids, on_step=on_step),
            len(prompts), compile_s, lambda: self.cached_tokens)

