"""The engine thread: the one thread that drives ``PagedGenerator`` (``add_request`` / ``step`` /
``abort``), so that the event loop serving HTTP never waits for a step.

Requests reach it through an inbox and leave it through per-request asyncio queues. Between two
steps the thread takes the aborts and the new requests (each ``add_request`` answered on the
request's queue: accepted, or refused with the engine's ``ValueError``), then runs one step while any
request is unfinished, and hands each token to its request's queue with
``loop.call_soon_threadsafe``; with nothing to do it sleeps on a condition. An abort (a client gone,
a stop string matched) is taken before the next step, so its blocks are back in the pool at once.

A step that raises ends the requests of that step only (``PagedGenerator``'s all-or-nothing rule:
its requests are gone from the engine), each with the error; the thread carries on. Only an error
outside a step (a bug) stops the thread; then ``/health`` says so and every request ends.

Before serving, the thread warms the engine up: the prefill graph and a decode graph for every
token count a step can be padded to (up to ``max_batch`` decode tokens, and up to 16 tokens of a
chunked step, which runs in place) are compiled (``/ready`` answers 503 meanwhile).
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass

import mindspore as ms

from ..engine.common import SamplingError
from ..engine.kv_cache import STEP_TOKENS, token_bucket
from .metrics import Metrics

log = logging.getLogger("models.llama.serve")


@dataclass
class Submission:
    """One request for the engine: prompt ids and ``PagedGenerator.add_request``'s settings."""
    prompt: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    eos_ids: tuple[int, ...] | None = None  # None: the model's; (): none (ignore_eos)
    cache_salt: str | None = None           # shares cached blocks only with requests of the same salt


@dataclass
class Event:
    """What a request's queue receives: ``accepted`` once (or the refusal as ``error``), then one
    event per token; the last has ``finished`` (``error`` if it ended in one)."""
    token: int | None = None
    finished: bool = False
    error: Exception | None = None
    accepted: bool = False


class Overloaded(Exception):
    """The waiting queue is full (``max_waiting``): try again later (HTTP 429)."""


class Unavailable(Exception):
    """Not serving: loading, draining or the engine thread died (HTTP 503); ``code`` says which."""

    def __init__(self, message: str, code: str):
        super().__init__(message)
        self.code = code


class RequestStream:
    """A request's side of the engine thread. Its events arrive on ``queue`` (on its event loop)."""

    def __init__(self, submission: Submission, loop: asyncio.AbstractEventLoop, arrival: float):
        self.submission = submission
        self.loop = loop
        self.queue: asyncio.Queue[Event] = asyncio.Queue()  # at most max_tokens + 1 events
        self.arrival = arrival
        self.engine_id: int | None = None
        self.cached_tokens = 0            # prompt tokens its admission found in the prefix cache
        self.prefill_started_at: float | None = None  # the start of the first step computing its prompt
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.done = False                 # the engine holds nothing of it any more

    async def next(self) -> Event:
        return await self.queue.get()


def attention_paths(model) -> dict[str, str]:
    """The attention path of each graph of a paged step (``StepRecord.graph``): the prefill graph runs
    the fused op with ``key_rotated`` ('fused:CPU', or 'unfused' when it fell back: RoPE then runs as
    its own op), the decode graph (decode steps, and chunks of at most 16 tokens) the paged kernel,
    which rotates the query itself (the new keys were rotated by the cache write): it has no fallback."""
    attention = model.model.layers[0].self_attn
    return {"prefill": attention.cached_attention.backend, "decode": f"paged:{ms.get_context('device_target')}"}


def _warm_up_counts(max_batch: int) -> list[int]:
    """Each token count a step of the decode graph is padded to (powers of two): up to 16 for a step
    in place (``STEP_TOKENS``), up to ``max_batch``'s for decode tokens alone."""
    return [1 << i for i in range(max(STEP_TOKENS, token_bucket(max_batch)).bit_length())]


class EngineService:
    """Owns the generator's engine thread. ``submit`` / ``abort`` are called from the event loop;
    they only touch the inbox, under a condition the engine thread never holds during a step."""

    def __init__(self, generator, metrics: Metrics, *, max_waiting: int = 64, warm_up: bool = True,
                 clock=time.monotonic):
        self.generator = generator
        self.metrics = metrics
        self.max_waiting = max_waiting
        self.clock = clock
        self.paths = attention_paths(generator.model)
        self.ready = False
        self.draining = False
        self.error: BaseException | None = None  # what stopped the engine thread
        self.in_flight = 0                       # HTTP generation requests being served (event loop only)
        self._warm = warm_up
        self._cond = threading.Condition()
        self._inbox: list[RequestStream] = []
        self._aborts: list[RequestStream] = []
        self._streams: dict[int, RequestStream] = {}  # engine id -> stream (engine thread only)
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="rfa-engine", daemon=True)

    # ---- the event loop's calls ----
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Ends every request (with an error) and the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    @property
    def waiting(self) -> int:
        """Requests not yet admitted: in the inbox and in the generator's queue."""
        return len(self._inbox) + len(self.generator.waiting)

    @property
    def running(self) -> int:
        return len(self.generator.running)

    def check_serving(self) -> None:
        """Raises ``Unavailable`` unless new requests are taken now."""
        if not self.alive:
            raise Unavailable("the engine stopped; see the server's log", "engine_dead")
        if self.draining:
            raise Unavailable("the server is shutting down and takes no new requests", "draining")
        if not self.ready:
            raise Unavailable("the model is loading (warm-up); retry shortly", "loading")

    def submit(self, submission: Submission, loop: asyncio.AbstractEventLoop) -> RequestStream:
        """Queues a request for the engine thread; ``Overloaded`` when ``max_waiting`` wait already."""
        self.check_serving()
        with self._cond:
            if self.waiting >= self.max_waiting:
                raise Overloaded(f"{self.waiting} requests are waiting (--max-waiting {self.max_waiting})")
            stream = RequestStream(submission, loop, self.clock())
            self._inbox.append(stream)
            self._cond.notify()
        return stream

    def abort(self, stream: RequestStream) -> None:
        """Stops the request at the engine's next turn (its blocks back in the pool); no more events."""
        with self._cond:
            if stream in self._inbox:
                self._inbox.remove(stream)
                stream.done = True
            elif not stream.done:
                self._aborts.append(stream)
                self._cond.notify()

    def start_drain(self) -> None:
        self.draining = True

    def idle(self) -> bool:
        """No HTTP request being served and nothing in the engine: draining may end."""
        return self.in_flight == 0 and not self._inbox and not self.generator.has_unfinished

    # ---- the engine thread ----
    def _run(self) -> None:
        try:
            if self._warm:
                self._warm_up()
            self.ready = True
            while True:
                with self._cond:
                    while not (self._inbox or self._aborts or self._stopping or self.generator.has_unfinished):
                        self._cond.wait()
                    if self._stopping:
                        break
                    inbox, self._inbox = self._inbox, []
                    aborts, self._aborts = self._aborts, []
                for stream in aborts:
                    self._abort(stream)
                for stream in inbox:
                    self._add(stream)
                if self.generator.has_unfinished:
                    self._step()
                self._update_gauges()
        except BaseException as exc:  # noqa: BLE001  a bug: say so on /health, end every request
            self.error = exc
            log.exception("the engine thread stopped")
        finally:
            self._end_all(Unavailable("the server is shutting down", "draining") if self.error is None else
                          Unavailable("the engine stopped; see the server's log", "engine_dead"))

    def _warm_up(self) -> None:
        gen = self.generator
        t0 = time.perf_counter()
        vocab, bos = gen.model.vocab_size, gen.model.config.bos_token_id or 0
        prompt = [bos] + [3 + i % (vocab - 3) for i in range(gen.block_size)]  # past STEP_TOKENS: the prefill graph
        for batch in (1, 2):  # two calls: a model's later PagedGenerator compiles it on its first two (docs/serving.md)
            gen.warm_up([prompt] * batch)
        counts = _warm_up_counts(gen.max_batch)
        for count in counts:  # a prompt of `count` tokens is one step in place; more, decode steps of that many
            gen.warm_up([prompt[:count]] if count <= STEP_TOKENS else [prompt[:1]] * min(count, gen.max_batch))
        log.info("warm-up: %.1f s (the prefill graph, the decode graph for %s tokens)", time.perf_counter() - t0,
                 counts)

    def _add(self, stream: RequestStream) -> None:
        if stream.done:
            return
        s = stream.submission
        try:
            request_id = self.generator.add_request(s.prompt, s.max_tokens, temperature=s.temperature, top_k=s.top_k,
                                                    top_p=s.top_p, seed=s.seed, eos_ids=s.eos_ids,
                                                    cache_salt=s.cache_salt)
        except Exception as exc:  # noqa: BLE001  refused (ValueError) or worse: this request only
            stream.done = True
            self._post(stream, Event(finished=True, error=exc))
            return
        stream.engine_id = request_id
        self._streams[request_id] = stream
        self._post(stream, Event(accepted=True))

    def _abort(self, stream: RequestStream) -> None:
        if stream.engine_id is not None and self._streams.pop(stream.engine_id, None) is not None:
            self.generator.abort(stream.engine_id)
        stream.done = True

    def _step(self) -> None:
        gen, metrics = self.generator, self.metrics
        t0 = self.clock()
        hits0, computed0 = gen.cached_prompt_tokens, gen.prefilled_tokens
        try:
            tokens = gen.step()
        except Exception as exc:  # noqa: BLE001  the step's requests end; the others and the thread carry on
            log.exception("an engine step failed; the requests of that step end with its error")
            alive = {r.id for r in list(gen.running)} | {r.id for r in list(gen.waiting)}
            for request_id, stream in list(self._streams.items()):
                if request_id not in alive:
                    self._end(stream, Event(finished=True, error=exc))
            return
        t1 = self.clock()
        kind, record = gen.last_step, gen.last_record
        if kind:
            metrics.attention_path(kind, self.paths.get(record.graph, gen.model.backend))
        self._note_prompts(record, t0)
        hits, computed = gen.cached_prompt_tokens - hits0, gen.prefilled_tokens - computed0
        if hits or computed:
            metrics.prefix_queries.inc(hits + computed)
            metrics.prefix_hits.inc(hits)
            metrics.prompt_tokens.inc(hits + computed)
        for token in tokens:
            stream = self._streams.get(token.request)
            if stream is None:
                continue
            if token.error is not None:
                if not isinstance(token.error, SamplingError):  # a bug of the sampler: its traceback, here only
                    log.error("drawing request %d's token failed; it ends alone", token.request,
                              exc_info=token.error)
                self._end(stream, Event(finished=True, error=token.error))
                continue
            if stream.first_token_at is None:
                stream.first_token_at = t1
                started = t0 if stream.prefill_started_at is None else stream.prefill_started_at
                metrics.queue.observe(max(0.0, started - stream.arrival))
                metrics.prefill.observe(t1 - started)
                metrics.ttft.observe(t1 - stream.arrival)
            else:
                metrics.itl.observe(t1 - stream.last_token_at)
            stream.last_token_at = t1
            metrics.generation_tokens.inc()
            event = Event(token=token.token, finished=token.finished)
            if token.finished:
                self._end(stream, event)
            else:
                self._post(stream, event)

    def _note_prompts(self, record, started: float) -> None:
        """From the step's record: each admitted request's prefix-cache hit (its usage's cached tokens)
        and when its prompt's first chunk ran (the end of its queue time; with chunked prefill its
        prefill spans several steps, the last one sampling its first token)."""
        if record is None:
            return
        for request_id, cached in record.cached_tokens:
            if (stream := self._streams.get(request_id)) is not None:
                stream.cached_tokens = cached
        for request_id, _ in record.prefill_tokens:
            stream = self._streams.get(request_id)
            if stream is not None and stream.prefill_started_at is None:
                stream.prefill_started_at = started

    def _update_gauges(self) -> None:
        pool = self.generator.pool
        self.metrics.running.set(len(self.generator.running))
        self.metrics.waiting.set(self.waiting)
        self.metrics.kv_usage.set(1.0 - pool.available / pool.usable)

    def _end(self, stream: RequestStream, event: Event) -> None:
        self._streams.pop(stream.engine_id, None)
        stream.done = True
        self._post(stream, event)

    def _end_all(self, error: Exception) -> None:
        with self._cond:
            inbox, self._inbox = self._inbox, []
        for stream in inbox:
            stream.done = True
            self._post(stream, Event(finished=True, error=error))
        for request_id, stream in list(self._streams.items()):
            try:
                self.generator.abort(request_id)
            except Exception:  # noqa: BLE001  ending anyway
                log.exception("abort of request %d failed", request_id)
            self._end(stream, Event(finished=True, error=error))
        try:
            self._update_gauges()
        except Exception:  # noqa: BLE001
            pass

    @staticmethod
    def _post(stream: RequestStream, event: Event) -> None:
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, event)
        except RuntimeError:  # its event loop is closed: nobody is listening
            pass
