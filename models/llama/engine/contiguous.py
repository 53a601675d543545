"""The contiguous engine: text generation on an in-place KV cache of rotated keys (``kv_cache.KVCache``):
prefill through the fused op (which emits the rotated keys the cache stores), then decode steps that
write one new row per sequence and attend over the cache with ``key_rotated``.

Prefill is one graph per cache capacity for any prompt length and any number of sequences (dynamic
shapes); a decode step is padded to a power-of-two token count (``KVCache.padded_tokens``) and runs
a static graph per capacity and token count. Prompts of different lengths are packed with no
padding, and up to ``slots`` sequences run at once: continuous batching, a finished sequence's slot
going to the next prompt. ``Generator.stream`` yields each token as it is sampled.
"""
from __future__ import annotations

from dataclasses import dataclass

import mindspore as ms
import numpy as np
from mindspore import Tensor

from ..cache_views import ContiguousDecode, ContiguousPrefill
from ..model import LlamaForCausalLM
from .common import GIB, CacheGraph, Engine, Request, Sampling, Token, cache_memory_budget, dynamic_vector
from .kv_cache import STEP_TOKENS, KVCache, Slots, bucket_capacity, cache_bytes


class _Prefill(CacheGraph):
    """Whole prompts (packed, ending at ``ends``) into their cache rows; logits of each last token."""

    @ms.jit
    def construct(self, input_ids, ends, write_rows):
        self.count_compile()  # a dynamic shape is no constant: no argument
        return self.lm(input_ids, ends, ends, ContiguousPrefill.build(self.cache.keys, self.cache.values, write_rows))


class _Decode(CacheGraph):
    """New tokens of cached sequences (one per sequence when decoding), written in place and
    attended against the whole cache; static shapes, so one graph per padded token count."""

    @ms.jit
    def construct(self, input_ids, aq, akv, write_rows, positions):
        self.count_compile(input_ids.shape[0])
        view = ContiguousDecode.build(self.cache.keys, self.cache.values, write_rows, positions)
        return self.lm(input_ids, aq, akv, view)


@dataclass
class _Request(Request):
    slot: int = -1


class Sequence:
    """One prompt held in a ``Generator``'s cache (``Generator.open``). ``logits`` are its last token's;
    ``append`` feeds it 1..16 more tokens (a decode step, a speculative block, a prompt's next chunk)
    and returns the logits at each. ``close`` (or leaving its ``with`` block) frees the slot."""

    def __init__(self, generator: "Generator", request: _Request, logits: np.ndarray):
        self._generator, self._request, self.logits = generator, request, logits

    @property
    def length(self) -> int:
        """Tokens cached so far (0 once closed)."""
        return 0 if self.closed else int(self._generator.slots.lengths[self._request.slot])

    @property
    def closed(self) -> bool:
        return self._request.slot < 0

    def append(self, tokens) -> np.ndarray:
        """(len(tokens), vocab) logits, row i at ``tokens[i]``."""
        if self.closed:
            raise ValueError("append: the sequence is closed")
        generator = self._generator
        ids = np.asarray(tokens)
        if ids.ndim != 1 or not 1 <= len(ids) <= STEP_TOKENS or ids.dtype.kind not in "iu":
            raise ValueError(f"tokens: expected 1..{STEP_TOKENS} token ids, got {tokens!r:.80}")
        if ids.min() < 0 or ids.max() >= generator.model.vocab_size:
            raise ValueError(f"tokens: expected token ids in [0, {generator.model.vocab_size}), got {tokens!r:.80}")
        if self.length + len(ids) > generator.capacity:
            raise ValueError(f"tokens: {self.length} cached + {len(ids)} new tokens pass the cache's "
                             f"{generator.capacity} positions; open with max_positions= the longest")
        return generator._append([self._request], [[int(t) for t in ids]])

    def close(self) -> None:
        if not self.closed:
            self._generator.slots.release(self._request.slot)
            self._request.slot = -1

    def __enter__(self) -> "Sequence":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Generator(Engine):
    """Drives a ``LlamaForCausalLM`` through prefill and decode on an in-place ``KVCache``.

    ``slots`` sequences are in flight at once (continuous batching): more prompts wait, and a
    sequence that finishes frees its slot for the next. ``capacity`` fixes the tokens per slot;
    by default it is the smallest bucket (512 * 2^k, up to the model's positions) that the prompts
    need, and it only grows, so each graph compiles at most once per bucket. ``cache_dtype``
    (default: the model's ``cache_dtype``: its activations', float16 with half weights) may be
    float16 for a float32 model: half the bytes read per step.
    ``cache_memory_limit`` (bytes; default ``CACHE_MEMORY_FRACTION`` of the memory available when
    the generator is made) bounds every cache it allocates: a larger one is a ValueError before
    anything is allocated, instead of a failure inside MindSpore or the OOM killer."""

    def __init__(self, model: LlamaForCausalLM, *, slots: int = 8, capacity: int | None = None, cache_dtype=None,
                 cache_memory_limit: int | None = None):
        if not isinstance(slots, int) or slots < 1:
            raise ValueError(f"slots: expected a positive int, got {slots!r}")
        if cache_memory_limit is not None and (isinstance(cache_memory_limit, bool)
                                               or not isinstance(cache_memory_limit, int) or cache_memory_limit < 1):
            raise ValueError(f"cache_memory_limit: expected a positive int of bytes, got {cache_memory_limit!r}")
        if capacity is not None and (not isinstance(capacity, int) or not 0 < capacity <= model.max_positions):
            raise ValueError(f"capacity: expected an int in [1, {model.max_positions}] (the model's cos/sin "
                             f"positions), got {capacity!r}")
        super().__init__(model, cache_dtype)
        self.slots_count, self.fixed_capacity = slots, capacity
        self.cache_memory_limit = cache_memory_budget() if cache_memory_limit is None else cache_memory_limit
        self.cache = self.prefill = self.step = None
        self.slots = Slots(slots)
        self.compile_s = {}  # capacity -> seconds of its first call (compile + warm-up)

    @property
    def capacity(self) -> int:
        return 0 if self.cache is None else self.cache.capacity

    @property
    def graphs(self) -> tuple:
        return () if self.cache is None else (self.prefill, self.step)

    @property
    def compile_key(self) -> tuple:
        return (self.capacity,)

    @property
    def cached_tokens(self) -> int:
        """Tokens in the cache's slots."""
        return int(self.slots.lengths.sum())

    def reserve(self, needed: int) -> None:
        """Allocates the cache for sequences of ``needed`` positions now (a larger bucket replaces a
        smaller one; nothing is compiled). Refused while a ``Sequence`` is open: growing drops the
        cache it lives in."""
        if self.fixed_capacity is not None:
            if needed > self.fixed_capacity:
                raise ValueError(f"capacity: a prompt and its new tokens need {needed} cache positions, the "
                                 f"generator's capacity is {self.fixed_capacity}")
            capacity = self.fixed_capacity
        else:
            capacity = bucket_capacity(needed, self.model.max_positions)
        if capacity <= self.capacity:
            return
        if self.slots.busy.any():
            raise ValueError(f"capacity: {needed} positions need a larger cache than the {self.capacity} of the "
                             f"{int(self.slots.busy.sum())} open sequence(s); open the first with max_positions= "
                             "the longest, or close them first")
        need = cache_bytes(self.model.cache_config, self.slots_count, capacity, self.cache_dtype)
        if need > self.cache_memory_limit:
            raise ValueError(f"cache_memory_limit: the KV cache of slots={self.slots_count} x capacity={capacity} "
                             f"positions ({needed} needed) would take {need / GIB:.2f} GiB, over the limit of "
                             f"{self.cache_memory_limit / GIB:.2f} GiB; use fewer slots or new tokens, a float16 "
                             "cache_dtype, or a larger cache_memory_limit (CLI: --cache-memory-limit GIB)")
        self._earlier_compiles = self.compile_log
        # The smaller cache (and the graphs holding it) is released before the larger one is allocated.
        self.cache = self.prefill = self.step = None
        self.cache = KVCache(self.model.cache_config, self.slots_count, capacity, self.cache_dtype)
        self.prefill, self.step = _Prefill(self.model, self.cache), _Decode(self.model, self.cache)
        self.prefill.set_inputs(dynamic_vector(ms.int32), dynamic_vector(ms.int64), dynamic_vector(ms.int32))

    def _prepare(self, prompts, counts) -> None:
        """The capacity the prompts and their new tokens need (the last new token is never cached)."""
        self.reserve(max(len(p) + n - 1 for p, n in zip(prompts, counts)))

    def _warmed_up(self) -> bool:
        return self.capacity in self.compile_s

    def _record_warm_up(self, seconds: float) -> None:
        self.compile_s[self.capacity] = seconds

    def _prefill(self, joining: list[_Request]) -> np.ndarray:
        """Prompts into their slots; last-token logits (one row per request)."""
        rows = np.concatenate([self.cache.rows(r.slot, 0, len(r.prompt)) for r in joining])
        ids = np.concatenate([r.prompt for r in joining]).astype(np.int32)
        ends = np.cumsum([len(r.prompt) for r in joining])
        logits = self.prefill(Tensor(ids), Tensor(ends, ms.int64), Tensor(rows.astype(np.int32))).asnumpy()
        for r in joining:
            self.slots.lengths[r.slot] = len(r.prompt)
        return logits

    def _append(self, requests: list[_Request], tokens: list[list[int]]) -> np.ndarray:
        """``tokens[i]`` (1..16 per request: a decode step, a speculative block or a prompt's next
        chunk) appended to each request's cached sequence; logits at every appended token, in
        ``requests`` order (which this sorts by slot: the packed queries follow the cache's order)."""
        order = sorted(range(len(requests)), key=lambda i: requests[i].slot)
        requests[:], tokens = [requests[i] for i in order], [tokens[i] for i in order]
        counts = np.array([len(t) for t in tokens])
        slots = np.array([r.slot for r in requests])
        starts = self.slots.lengths[slots]
        if (starts + counts > self.cache.capacity).any():
            raise ValueError(f"capacity: appending would pass the cache's {self.cache.capacity} positions per slot")
        positions = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, counts)])
        rows = np.concatenate([self.cache.rows(slot, s, n) for slot, s, n in zip(slots, starts, counts)])
        new_tokens = np.zeros(self.slots_count, np.int64)
        new_tokens[slots] = counts
        total = int(counts.sum())
        padding = self.cache.padded_tokens(total) - total  # token 0 at position 0, into scratch rows
        aq, akv = self.cache.step_offsets(self.slots.lengths + new_tokens, new_tokens, padding)
        ids = np.concatenate([*tokens, np.zeros(padding, np.int64)]).astype(np.int32)
        rows = np.append(rows, self.cache.padding_rows(padding)).astype(np.int32)
        positions = np.append(positions, np.zeros(padding, np.int64))
        logits = self.step(Tensor(ids), aq, akv, Tensor(rows), Tensor(positions)).asnumpy()
        self.slots.lengths[slots] += counts
        return logits[:total]

    def _steps(self, prompts, counts, settings: dict, seed: int, eos: frozenset):
        """The stream's scheduler: prompts join free slots (one prefill call), else every active
        request decodes one token; the stream's requests draw from one random stream."""
        sampling = Sampling(**settings, rng=np.random.default_rng(seed))
        waiting = [_Request(i, list(p), n, eos, sampling) for i, (p, n) in enumerate(zip(prompts, counts))]
        waiting.reverse()
        active: list[_Request] = []
        joining: list[_Request] = []
        try:
            while waiting or active:
                joining = []
                for slot in self.slots.free():
                    if not waiting:
                        break
                    request = waiting.pop()
                    request.slot = slot
                    self.slots.take(slot)
                    joining.append(request)
                if joining:
                    kind, requests, logits = "prefill", joining, self._prefill(joining)
                elif not active:
                    raise ValueError(f"stream: all {self.slots_count} slots hold open sequences; close one first")
                else:
                    kind, requests = "decode", list(active)
                    logits = self._append(active, [[r.pending] for r in active])
                tokens = []
                for request, token in zip(requests, sampling.draw(logits)):
                    finished = request.took(int(token))
                    tokens.append(Token(request.id, request.pending, finished))
                    if finished:
                        self.slots.release(request.slot)
                        if request in active:
                            active.remove(request)
                    elif request not in active:
                        active.append(request)
                yield kind, tokens
        finally:  # an abandoned or failed stream leaves no slot of its own taken (rows past a length are never read)
            for request in active + joining:
                self.slots.release(request.slot)

    def prefill_logits(self, prompts) -> np.ndarray:
        """Last-token logits (B, vocab) of a prefill of the prompts into the cache (slots freed after)."""
        self._check(prompts, 1)
        if len(prompts) > self.slots_count:
            raise ValueError(f"prompts: {len(prompts)} prompts in one prefill, the generator has "
                             f"{self.slots_count} slots")
        self.reserve(max(len(p) for p in prompts))
        free = self.slots.free()
        if len(prompts) > len(free):
            raise ValueError(f"prompts: {len(prompts)} prompts in one prefill, {len(free)} slots are free "
                             f"({self.slots_count - len(free)} hold open sequences)")
        requests = [_Request(i, list(p), 1, frozenset(), None, slot=slot)
                    for (i, p), slot in zip(enumerate(prompts), free)]
        for r in requests:
            self.slots.take(r.slot)
        try:
            return self._prefill(requests)
        finally:
            for r in requests:
                self.slots.release(r.slot)

    def open(self, prompt, *, max_positions: int | None = None) -> "Sequence":
        """Prefills ``prompt`` into a free slot and returns it as a ``Sequence`` that ``append`` extends
        (the scoring / speculative-decoding primitive under ``stream``); ``max_positions`` (default:
        the prompt's length) sizes the cache for what it will grow to."""
        self._check([prompt], 1)
        self.reserve(max(len(prompt), max_positions or 0))
        free = self.slots.free()
        if not free:
            raise ValueError(f"open: all {self.slots_count} slots hold open sequences or a stream; close one first")
        request = _Request(0, list(prompt), 1, frozenset(), None, slot=free[0])
        self.slots.take(request.slot)
        try:
            logits = self._prefill([request])
        except BaseException:
            self.slots.release(request.slot)
            raise
        return Sequence(self, request, logits[0])
