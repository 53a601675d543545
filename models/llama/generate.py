"""Text generation on an in-place KV cache of rotated keys (``kv_cache.KVCache``): prefill through
the fused op (which emits the rotated keys the cache stores), then decode steps that write one new
row per sequence and attend over the cache with ``key_rotated``.

Prefill is one graph per cache capacity for any prompt length and any number of sequences (dynamic
shapes); a decode step is padded to a power-of-two token count (``KVCache.padded_tokens``) and runs
a static graph per capacity and token count. Prompts of different lengths are packed with no
padding, and up to ``slots`` sequences run at once: continuous batching, a finished sequence's slot going to
the next prompt. ``Generator.stream`` yields each token as it is sampled.

    python -m models.llama.generate --checkpoint DIR --prompt "The capital of France is"
    python -m models.llama.generate --model tiny --ids 1,15,27 --max-new-tokens 8
    python -m models.llama.generate --model tiny --ids 1,15,27 --ids 1,15,28 --paged   # serving.py
    python -m ms_rope_attention.distributed.launch --workers 2 -m models.llama.generate \
        --checkpoint DIR --prompt "..." --tensor-parallel 2     # each rank holds half the model
"""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import mindspore as ms
import numpy as np
from mindspore import Tensor

from .cache_views import ContiguousDecode, ContiguousPrefill
from .decoding import (CACHE_MEMORY_FRACTION, GIB, CacheGraph, Generation, Token, available_memory,
                       check_cache_dtype, check_prompts, check_sampling, dynamic_vector, sample,
                       timed_generation)
from .kv_cache import STEP_TOKENS, KVCache, Slots, bucket_capacity, cache_bytes
from .model import DTYPES, LlamaForCausalLM, dtype_name
from .serving import PagedGenerator


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
class _Request:
    index: int
    prompt: list[int]
    max_new_tokens: int
    eos: frozenset
    slot: int = -1
    pending: int = -1      # the last sampled token, not yet in the cache
    generated: int = 0


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


class Generator:
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
        self.model, self.slots_count, self.fixed_capacity = model, slots, capacity
        self.cache_memory_limit = (int(CACHE_MEMORY_FRACTION * available_memory()) if cache_memory_limit is None
                                   else cache_memory_limit)
        self.cache_dtype = DTYPES[dtype_name(cache_dtype)] if cache_dtype is not None else model.cache_dtype
        check_cache_dtype(self.cache_dtype)
        self.cache = self.prefill = self.step = None
        self._earlier_compiles = []  # compile_log of the graphs of smaller capacities, released when the cache grew
        self.slots = Slots(slots)
        self.compile_s = {}  # capacity -> seconds of its first call (compile + warm-up)

    @property
    def capacity(self) -> int:
        return 0 if self.cache is None else self.cache.capacity

    @property
    def compile_log(self) -> list[tuple[int, str, int | None]]:
        """(capacity, graph, token count) of every compilation so far, in order per graph."""
        current = [(self.capacity, *entry) for graph in (self.prefill, self.step) if graph is not None
                   for entry in graph.compile_log]
        return self._earlier_compiles + current

    @property
    def compiles(self) -> int:
        """Graphs compiled so far, all capacities together."""
        return len(self.compile_log)

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

    def _reserve(self, prompts, counts) -> None:
        """The capacity the prompts and their new tokens need (the last new token is never cached)."""
        self.reserve(max(len(p) + n - 1 for p, n in zip(prompts, counts)))

    def _check(self, prompts, max_new_tokens) -> list[int]:
        return check_prompts(self.model, prompts, max_new_tokens)

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

    def stream(self, prompts, max_new_tokens=32, *, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
               seed: int = 0, eos_ids=None, on_step=None):
        """Yields a ``Token`` per generated token, as soon as it is sampled. ``max_new_tokens`` is one
        int or one per prompt; a request ends at one of ``eos_ids`` (default: the config's) or at
        its ``max_new_tokens``. ``on_step(kind, seconds)`` is told each graph call ('prefill' or
        'decode', host time included). Prompts past the slots wait for a free one."""
        counts = self._check(prompts, max_new_tokens)
        self._reserve(prompts, counts)
        check_sampling(temperature, top_k, top_p)
        eos = frozenset(self.model.config.eos_token_ids if eos_ids is None else eos_ids)
        rng = np.random.default_rng(seed)
        waiting = [_Request(i, list(p), n, eos) for i, (p, n) in enumerate(zip(prompts, counts))]
        waiting.reverse()
        active: list[_Request] = []
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
                batches = []
                if joining:
                    t0 = time.perf_counter()
                    logits = self._prefill(joining)
                    batches.append((joining, logits, "prefill", t0))
                elif active:
                    t0 = time.perf_counter()
                    logits = self._append(active, [[r.pending] for r in active])
                    batches.append((list(active), logits, "decode", t0))
                for requests, logits, kind, t0 in batches:
                    tokens = sample(logits, rng, temperature, top_k, top_p)
                    if on_step is not None:
                        on_step(kind, time.perf_counter() - t0)
                    for request, token in zip(requests, tokens):
                        request.pending, request.generated = int(token), request.generated + 1
                        finished = request.pending in request.eos or request.generated >= request.max_new_tokens
                        yield Token(request.index, request.pending, finished)
                        if finished:
                            self.slots.release(request.slot)
                            if request in active:
                                active.remove(request)
                        elif request not in active:
                            active.append(request)
        finally:  # an abandoned or failed stream leaves no slot of its own taken (rows past a length are never read)
            for request in active + joining:
                self.slots.release(request.slot)

    def warm_up(self, prompts, max_new_tokens=2) -> float:
        """Compile and run both graphs of the capacity these prompts need (once per capacity);
        seconds spent, 0 if already done."""
        counts = self._check(prompts, max_new_tokens)
        self._reserve(prompts, counts)
        if self.capacity in self.compile_s:
            return 0.0
        t0 = time.perf_counter()
        for _ in self.stream(prompts, 2, eos_ids=()):
            pass
        self.compile_s[self.capacity] = time.perf_counter() - t0
        return self.compile_s[self.capacity]

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
        requests = [_Request(i, list(p), 1, frozenset(), slot=slot) for (i, p), slot in zip(enumerate(prompts), free)]
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
        request = _Request(0, list(prompt), 1, frozenset(), slot=free[0])
        self.slots.take(request.slot)
        try:
            logits = self._prefill([request])
        except BaseException:
            self.slots.release(request.slot)
            raise
        return Sequence(self, request, logits[0])

    def generate(self, prompts, max_new_tokens=32, *, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 seed: int = 0, eos_ids=None) -> Generation:
        """Every prompt's tokens, with TTFT, the decode rate and per-step times (compile excluded)."""
        counts = self._check(prompts, max_new_tokens)  # before the warm-up writes anything
        check_sampling(temperature, top_k, top_p)
        self._reserve(prompts, counts)  # the whole request's capacity: the warm-up compiles its graphs
        compile_s = self.warm_up(prompts)
        return timed_generation(
            lambda on_step: self.stream(prompts, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                        seed=seed, eos_ids=eos_ids, on_step=on_step),
            len(prompts), compile_s, lambda: int(self.slots.lengths.sum()))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="python -m models.llama.generate")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", help="Hugging Face (config.json) or Meta (params.json) checkpoint directory")
    source.add_argument("--model", help="a preset with random weights (tiny, 7b, 13b, 70b)")
    parser.add_argument("--prompt", action="append", help="prompt text (repeat for a batch); needs a tokenizer")
    parser.add_argument("--ids", action="append", help="prompt as comma-separated token ids (repeatable)")
    parser.add_argument("--layers", type=int, help="with --model: number of layers")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"],
                        help="the activations' dtype")
    parser.add_argument("--weight-dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                        help="the projections' and embedding's: 'auto' keeps a half checkpoint's own precision "
                             "on the CPU (with --model and no checkpoint: --dtype's)")
    parser.add_argument("--backend", default="auto", choices=["auto", "fused", "unfused"])
    parser.add_argument("--mode", default="graph", choices=["graph", "pynative"])
    parser.add_argument("--device", default="CPU")
    parser.add_argument("--tensor-parallel", type=int, default=1, metavar="T",
                        help="under msrun on T ranks: each holds its share of the model (docs/distributed.md)")
    parser.add_argument("--cache-memory-limit", type=float, metavar="GIB",
                        help=f"largest KV cache to allocate (default: {CACHE_MEMORY_FRACTION * 100:.0f}%% of the "
                             "memory available); with --paged, the cache's budget")
    parser.add_argument("--paged", action="store_true",
                        help="a block-paged cache with prefix caching (models/llama/serving.py, docs/serving.md)")
    parser.add_argument("--block-size", type=int, default=16, help="with --paged: positions per block")
    args = parser.parse_args(argv)
    if args.cache_memory_limit is not None and args.cache_memory_limit <= 0:
        parser.error(f"--cache-memory-limit: expected a positive number of GiB, got {args.cache_memory_limit}")
    ms.set_device(args.device)
    mesh = None
    if args.tensor_parallel > 1:
        from mindspore.communication import init

        from ms_rope_attention.distributed import ParallelMesh

        init()  # first: msrun's scheduler runs the script up to init()
        mesh = ParallelMesh.create(tensor=args.tensor_parallel, data=1)
    ms.set_context(mode=ms.GRAPH_MODE if args.mode == "graph" else ms.PYNATIVE_MODE)

    from .config import preset
    from .tokenizer import Tokenizer
    from .weights import load_checkpoint, read_config

    config = read_config(args.checkpoint)[0] if args.checkpoint else preset(args.model)
    tokenizer = Tokenizer.from_directory(args.checkpoint, config.bos_token_id) if args.checkpoint else None
    if args.prompt:
        if tokenizer is None:
            parser.error("--prompt needs a checkpoint with tokenizer.json or tokenizer.model; use --ids")
        prompts = [tokenizer.encode(p) for p in args.prompt]
    elif args.ids:
        prompts = [[int(t) for t in ids.split(",")] for ids in args.ids]
    else:
        parser.error("give --prompt or --ids")
    kwargs = dict(dtype=args.dtype, backend=args.backend, parallel=mesh)
    if args.checkpoint:
        model = load_checkpoint(args.checkpoint, weight_dtype=args.weight_dtype, **kwargs)
    else:
        weight_dtype = None if args.weight_dtype == "auto" else args.weight_dtype
        model = LlamaForCausalLM(config.replace(num_hidden_layers=args.layers) if args.layers else config,
                                 weight_dtype=weight_dtype, **kwargs)
    limit = None if args.cache_memory_limit is None else max(1, int(args.cache_memory_limit * GIB))
    if args.paged:
        generator = PagedGenerator(model, max_cache_bytes=limit, block_size=args.block_size,
                                   max_batch=min(8, len(prompts)))
    else:
        generator = Generator(model, slots=min(8, len(prompts)), cache_memory_limit=limit)
    result = generator.generate(prompts, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                                top_p=args.top_p, seed=args.seed)
    if mesh is not None and mesh.world_rank != 0:
        return  # every rank generated the same tokens; one prints them
    for prompt, tokens in zip(prompts, result.tokens):
        text = tokenizer.decode(tokens) if tokenizer else ""
        print(f"prompt ids {prompt} -> {tokens}" + (f"\n{text}" if text else ""))
    print(f"backend {model.backend}; TTFT {result.ttft_s * 1e3:.1f} ms (compile {result.compile_s:.1f} s "
          f"excluded); decode {result.decode_tokens_per_s:.1f} tokens/s per sequence")


if __name__ == "__main__":
    main()
