"""What the two engines share (``contiguous.Generator``, ``paged.PagedGenerator``): their spine
``Engine`` (``stream`` / ``generate`` / ``warm_up`` over each engine's own scheduling, the compile log)
and ``Request`` record, the checks of prompts and sampling settings, sampling itself, the records
they return, the base of their compiled graphs, and the memory they may take.
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops

from ..model import DTYPES, dtype_name

GIB = 2 ** 30
CACHE_MEMORY_FRACTION = 0.8  # of the memory available: the rest for activations, logits and the compiler


def available_memory() -> int:
    """Bytes the machine can still give: MemAvailable (Linux), else its physical memory."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def cache_memory_budget() -> int:
    """The bytes a cache may take by default: ``CACHE_MEMORY_FRACTION`` of the memory available now."""
    return int(CACHE_MEMORY_FRACTION * available_memory())


def is_int(value) -> bool:
    """An integer, Python's or numpy's, and not a bool (which Python counts as one)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _is_real(value) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))


def check_sampling(temperature: float, top_k: int, top_p: float) -> None:
    """Refuses, naming the setting, what ``sample`` cannot honour (NaN, strings, fractional top_k)."""
    if not _is_real(temperature) or not 0 <= temperature <= sys.float_info.max:  # a larger int is no float
        raise ValueError(f"temperature: expected a finite number >= 0, got {temperature!r}")
    if not _is_real(top_p) or not 0 < top_p <= 1:
        raise ValueError(f"top_p: expected a number in (0, 1], got {top_p!r}")
    if not is_int(top_k) or top_k < 0:
        raise ValueError(f"top_k: expected an int >= 0 (0: no cut), got {top_k!r}")


def check_eos(eos_ids, model) -> frozenset:
    """The token ids that end a request: ``eos_ids``, or the model config's when None."""
    if eos_ids is None:
        eos_ids = model.config.eos_token_ids
    elif not isinstance(eos_ids, (list, tuple, set, frozenset)) or any(not is_int(t) for t in eos_ids):
        raise ValueError(f"eos_ids: expected a list of token ids (empty: no EOS), got {eos_ids!r:.80}")
    return frozenset(int(t) for t in eos_ids)


class SamplingError(ValueError):
    """A row of logits no token can be drawn from (NaN, or no finite logit)."""


SAMPLING_EPS = 1e-5  # vLLM's _SAMPLING_EPS: a temperature under it is greedy


def sample(logits: np.ndarray, rng: np.random.Generator, temperature: float = 0.0, top_k: int = 0,
           top_p: float = 1.0) -> np.ndarray:
    """Next token per row of ``logits`` (B, vocab): greedy at a temperature under ``SAMPLING_EPS``
    (vLLM's rule: at 5e-324 every logit over the temperature overflowed, and the NaN probabilities
    failed the draw), else sampled from the temperature-scaled distribution restricted to the top_k
    tokens (0, or a top_k over the vocabulary: no cut) and the smallest prefix of them (by
    probability) holding top_p of the mass; ``top_p=1`` cuts nothing. Any setting ``check_sampling``
    accepts draws a token: each row's maximum is subtracted before the scaling, so nothing
    overflows to NaN (a difference of two huge logits is -inf: that token's probability is 0). A
    row holding NaN or +inf, or only -inf, raises ``SamplingError`` (its argmax would be an
    arbitrary token)."""
    check_sampling(temperature, top_k, top_p)
    logits = np.asarray(logits)
    bad = np.isnan(logits).any(-1) | np.isposinf(logits).any(-1) | ~np.isfinite(logits).any(-1)
    if bad.any():
        raise SamplingError(f"logits: row {int(np.argmax(bad))} holds NaN or +inf, or no finite value; "
                            "no token can be drawn from it")
    if temperature < SAMPLING_EPS:
        return logits.argmax(-1)
    rows = logits.astype(np.float64)
    with np.errstate(over="ignore"):
        rows = (rows - rows.max(-1, keepdims=True)) / temperature  # each row's maximum 0, the others <= 0
    top_k = min(int(top_k), rows.shape[-1])
    out = np.empty(rows.shape[0], np.int64)
    for b, row in enumerate(rows):
        order = np.argsort(-row, kind="stable")
        if top_k:
            order = order[:top_k]
        probs = np.exp(row[order])  # the first is 1: the sum is in [1, vocab]
        probs /= probs.sum()
        keep = len(probs)
        if top_p < 1:  # the float64 sum of the mass may end a few ulps under 1: never search for 1 itself
            keep = min(keep, int(np.searchsorted(np.cumsum(probs), top_p)) + 1)
            probs = probs[:keep] / probs[:keep].sum()
        out[b] = order[rng.choice(keep, p=probs)]
    return out


@dataclass
class Sampling:
    """Sampling settings and the random stream they draw from: one per request of a
    ``PagedGenerator``, one per ``Generator.stream`` (its batch drawn from one stream)."""
    temperature: float
    top_k: int
    top_p: float
    rng: np.random.Generator

    def draw(self, logits: np.ndarray) -> np.ndarray:
        return sample(logits, self.rng, self.temperature, self.top_k, self.top_p)


def check_prompts(model, prompts, max_new_tokens, name: str = "prompts") -> list[int]:
    """Prompts (lists of token ids in the model's vocabulary) and their new-token counts (one int, or
    one per prompt), checked against the model's cos/sin positions; the counts per prompt. Errors
    name ``{name}[i]`` (a single request's call passes ``name='prompt'``, named alone)."""
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts: expected a non-empty list of prompts (lists of token ids)")
    if is_int(max_new_tokens):
        counts = [int(max_new_tokens)] * len(prompts)
    elif isinstance(max_new_tokens, (list, tuple)):
        counts = list(max_new_tokens)
    else:
        counts = None
    if counts is None or len(counts) != len(prompts) or any(not is_int(n) or n < 1 for n in counts):
        raise ValueError(f"max_new_tokens: expected a positive int or one per prompt, got {max_new_tokens!r:.80}")
    counts = [int(n) for n in counts]
    vocab = model.vocab_size
    for i, (prompt, n) in enumerate(zip(prompts, counts)):
        where = name if name == "prompt" else f"{name}[{i}]"
        if not isinstance(prompt, (list, tuple, np.ndarray)):
            raise ValueError(f"{where}: expected a list of token ids, got {type(prompt).__name__}")
        if len(prompt) == 0:
            raise ValueError(f"{where}: empty; every prompt needs at least one token")
        ids = np.asarray(prompt)
        if ids.dtype.kind not in "iu" or ids.ndim != 1 or ids.min() < 0 or ids.max() >= vocab:
            raise ValueError(f"{where}: expected token ids in [0, {vocab}), got {prompt!r:.80}")
        if len(prompt) + n - 1 > model.max_positions:  # the last new token is never cached
            raise ValueError(f"max_new_tokens: {where} ({len(prompt)} tokens) + {n} new tokens need "
                             f"{len(prompt) + n - 1} cached positions, beyond the model's cos/sin cache of "
                             f"{model.max_positions} positions")
    return counts


class CacheGraph(nn.Cell):
    """A graph over the model and one ``KVCache``, compiled once per input signature, in PyNative
    too (``ms.jit``: one graph launch per step, not one dispatch per op); ``compiles`` counts its
    compilations (a constexpr runs only while a graph compiles) and ``compile_log`` says which
    graph compiled for which token count (None: the prefill's dynamic one), in order."""

    def __init__(self, lm, cache):
        super().__init__(auto_prefix=False)  # the model's parameters keep their Hugging Face names
        self.lm, self.cache = lm, cache
        self.compile_log = []
        self.count_compile = ops.constexpr(reuse_result=False)(self._count_compile)

    @property
    def compiles(self) -> int:
        return len(self.compile_log)

    def _count_compile(self, tokens=None):
        self.compile_log.append((type(self).__name__, tokens))
        return True


def dynamic_vector(dtype):
    return Tensor(shape=[None], dtype=dtype)


@dataclass
class Token:
    """One generated token of a ``Generator.stream`` (``request``: the prompt's index) or of a
    ``PagedGenerator.step`` (``request``: the id ``add_request`` returned). A request that ended in
    error yields one last ``Token`` with ``token=None``, ``finished=True`` and the ``error``."""
    request: int
    token: int | None
    finished: bool  # the request's last token (EOS or its max_new_tokens)
    error: Exception | None = None


@dataclass
class Generation:
    tokens: list[list[int]]       # generated ids per prompt (up to and including EOS)
    ttft_s: float                 # prefill + first token of the first prompts admitted
    decode_tokens_per_s: float    # per sequence, over the decode steps
    compile_s: float              # first call of a capacity: compile + warm-up of both graphs, kept out of TTFT
    step_ms: list[tuple[int, float]] = field(default_factory=list)  # (tokens cached in all slots, ms) per decode step


def timed_generation(stream, prompts: int, compile_s: float, cached_tokens) -> Generation:
    """A generator's ``generate``: runs ``stream(on_step)`` to its end, collecting each prompt's
    tokens, the TTFT and every decode call's time with ``cached_tokens()`` at that call."""
    out = [[] for _ in range(prompts)]
    calls = []
    t0 = time.perf_counter()
    ttft = None
    for event in stream(lambda kind, s: calls.append((kind, s, cached_tokens()))):
        out[event.request].append(event.token)
        if ttft is None:
            ttft = time.perf_counter() - t0
    decode = [(cached, s) for kind, s, cached in calls if kind == "decode"]
    decode_s = sum(s for _, s in decode)
    rate = len(decode) / decode_s if decode else 0.0
    return Generation(out, ttft, rate, compile_s, [(c, s * 1e3) for c, s in decode])


def check_cache_dtype(dtype) -> None:
    """A bfloat16 cache Parameter has no CPU kernels to be written or read in a MindSpore 2.10 graph
    (ScatterUpdate, TensorMove): refused here, not inside MindSpore."""
    if dtype == ms.bfloat16 and ms.get_context("device_target") == "CPU":
        raise ValueError("cache_dtype: a bfloat16 KV cache cannot be a graph's Parameter on MindSpore 2.10's CPU "
                         "backend (no bfloat16 ScatterUpdate / TensorMove kernels); use 'float16' (half the bytes "
                         "too) or 'float32'")


@dataclass
class Request:
    """What both engines keep of a request; each engine's record adds its place in the cache."""
    id: int                # the prompt's index in a ``Generator.stream``; ``add_request``'s id
    prompt: list[int]
    max_new_tokens: int
    eos: frozenset
    sampling: Sampling | None  # None: a prefill whose logits are returned, nothing sampled
    pending: int = -1      # the last sampled token, not yet in the cache
    generated: int = 0

    def took(self, token: int) -> bool:
        """``token`` was sampled: it is pending now. Whether the request is finished."""
        self.pending, self.generated = token, self.generated + 1
        return token in self.eos or self.generated >= self.max_new_tokens


class Engine:
    """The spine of both engines. An engine gives ``_steps`` (its scheduler: a generator of
    ``(kind, tokens)``, one per graph call, that frees what it holds when closed), ``_prepare``
    (what a call for these prompts needs first), ``graphs``, ``cached_tokens`` and the warm-up's
    record; this class runs them as ``stream``, ``generate`` and ``warm_up``."""

    graphs: tuple = ()   # the compiled graphs of the current cache
    compile_key = ()     # what prefixes their compile_log entries (the contiguous engine's capacity)

    def __init__(self, model, cache_dtype):
        self.model = model
        self.cache_dtype = DTYPES[dtype_name(cache_dtype)] if cache_dtype is not None else model.cache_dtype
        check_cache_dtype(self.cache_dtype)
        self._earlier_compiles = []  # compile_log of graphs released since (a contiguous cache that grew)

    @property
    def compile_log(self) -> list[tuple]:
        """(graph, token count) of every compilation so far, in order per graph, after the
        ``compile_key`` of its cache; token count None: the prefill's dynamic graph."""
        current = [(*self.compile_key, *entry) for graph in self.graphs for entry in graph.compile_log]
        return self._earlier_compiles + current

    @property
    def compiles(self) -> int:
        """Graphs compiled so far, every cache together."""
        return len(self.compile_log)

    def _check(self, prompts, max_new_tokens) -> list[int]:
        return check_prompts(self.model, prompts, max_new_tokens)

    def stream(self, prompts, max_new_tokens=32, *, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
               seed: int = 0, eos_ids=None, on_step=None):
        """Yields a ``Token`` per generated token (``request``: the prompt's index), as soon as it is
        sampled. ``max_new_tokens`` is one int or one per prompt; a request ends at one of ``eos_ids``
        (default: the config's) or at its ``max_new_tokens``. ``on_step(kind, seconds)`` is told each
        graph call ('prefill' or 'decode', sampling and host time included). A request that cannot
        be sampled raises its error (``SamplingError``: NaN logits); an abandoned or failed stream leaves nothing of its
        own in the cache."""
        counts = self._check(prompts, max_new_tokens)
        check_sampling(temperature, top_k, top_p)
        eos = check_eos(eos_ids, self.model)
        self._prepare(prompts, counts)
        steps = self._steps(prompts, counts, dict(temperature=temperature, top_k=top_k, top_p=top_p), seed, eos)
        try:
            while True:
                t0 = time.perf_counter()
                kind, tokens = next(steps, (None, None))
                if tokens is None:
                    return
                if on_step is not None and kind:
                    on_step(kind, time.perf_counter() - t0)
                for token in tokens:
                    if token.error is not None:
                        raise token.error
                    yield token
        finally:
            steps.close()

    def warm_up(self, prompts, max_new_tokens=2) -> float:
        """Compiles and runs the graphs these prompts take; seconds spent, 0 if they already ran."""
        self._prepare(prompts, self._check(prompts, max_new_tokens))
        if self._warmed_up():
            return 0.0
        t0 = time.perf_counter()
        for _ in self.stream(prompts, 2, eos_ids=()):
            pass
        seconds = time.perf_counter() - t0
        self._record_warm_up(seconds)
        return seconds

    def generate(self, prompts, max_new_tokens=32, *, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 seed: int = 0, eos_ids=None) -> Generation:
        """Every prompt's tokens, with TTFT, the decode rate and per-step times (the warm-up's
        compilation excluded)."""
        counts = self._check(prompts, max_new_tokens)  # before the warm-up writes anything
        check_sampling(temperature, top_k, top_p)
        self._prepare(prompts, counts)  # the whole request's cache: the warm-up compiles its graphs
        compile_s = self.warm_up(prompts)
        return timed_generation(
            lambda on_step: self.stream(prompts, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                        seed=seed, eos_ids=eos_ids, on_step=on_step),
            len(prompts), compile_s, lambda: self.cached_tokens)

    def _warmed_up(self) -> bool:
        return False
