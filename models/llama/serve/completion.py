"""One request's life between the HTTP API and the engine thread: its limits checked
(``plan``), then its tokens turned into text pieces with a finish reason (``Completion``).

``plan`` refuses, before anything is queued, what could never run: a prompt and ``max_tokens``
past the model's context (``context_length_exceeded``), past ``--max-tokens-limit``, or needing more
KV blocks than the whole cache has; ``check_text`` refuses, before it is tokenized, a prompt text
too long for the context at ``MAX_CHARS_PER_TOKEN`` characters a token. A ``top_k`` of the whole
vocabulary or more is no cut (so no sampling setting the API takes can make the engine refuse a
row). A ``Completion`` submits the request (429 when the queue is full, 503 when the server does not
take requests), then yields its text as the engine's tokens arrive, through the incremental
detokenizer (stop strings across tokens, incomplete characters held back). The token that ended a
request (EOS, ``stop_token_ids``) is counted but not shown; a stop string ends the request in the
engine at once. Its usage reports the prompt's prefix-cache hit only when asked
(``--enable-prompt-tokens-details``: it tells whether another client sent the same prompt prefix,
unless their ``cache_salt`` differ). Every request ends exactly once, with a reason
counted in ``vllm:request_success_total``: stop, length, abort (the client left) or error.
"""
from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from ..engine.block_pool import blocks_for
from ..engine.common import SamplingError
from .detokenizer import IncrementalDetokenizer
from .errors import APIError, bad_request
from .protocol import Usage
from .scheduler import EngineService, Overloaded, Submission, Unavailable

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens of /v1/completions
# Llama tokenizers average 3-5 characters a token on text and code; a text longer than the context at 32
# characters a token cannot fit it, and is refused before tokenizing (a text of long runs of one character,
# which tokenizers pack tighter, is refused with it).
MAX_CHARS_PER_TOKEN = 32


@dataclass(frozen=True)
class Limits:
    """What a request is checked against: the model's and the server's bounds."""
    max_model_len: int       # prompt + completion tokens
    max_tokens_limit: int    # --max-tokens-limit
    block_size: int
    cache_blocks: int        # blocks one request may hold at most (the whole pool)
    vocab_size: int
    eos_ids: tuple[int, ...]  # the model's

    @property
    def max_prompt_chars(self) -> int:
        return self.max_model_len * MAX_CHARS_PER_TOKEN

    @classmethod
    def of(cls, generator, max_tokens_limit: int | None) -> "Limits":
        model = generator.model
        return cls(model.max_positions, max_tokens_limit or model.max_positions, generator.block_size,
                   generator.pool.usable, model.vocab_size, tuple(model.config.eos_token_ids))


def _too_long(limits: Limits, prompt_param: str, asked: str, param: str | None = None) -> APIError:
    """OpenAI's context_length_exceeded (its message's words), naming the prompt or ``param``."""
    return APIError(400, f"This model's maximum context length is {limits.max_model_len} tokens. However, you "
                    f"requested {asked}. Please reduce the length of the {prompt_param} or completion.",
                    param=param or prompt_param, code="context_length_exceeded")


def check_text(length: int, limits: Limits, prompt_param: str) -> None:
    """A prompt text of ``length`` characters, before it is tokenized: refused when it cannot fit."""
    if length > limits.max_prompt_chars:
        raise _too_long(limits, prompt_param, f"a text of {length} characters in the {prompt_param} (this server "
                        f"tokenizes at most {limits.max_prompt_chars}, {MAX_CHARS_PER_TOKEN} a token of the context)")


def plan(request, prompt: list[int], limits: Limits, *, max_tokens: int | None, prompt_param: str) -> Submission:
    """The engine's request for ``request`` (a validated protocol request) and its prompt ids."""
    if not prompt:
        raise bad_request("the prompt is empty", prompt_param)
    if len(prompt) >= limits.max_model_len:  # before looking at each id
        raise _too_long(limits, prompt_param, f"{len(prompt)} tokens in the {prompt_param} and at least one in the "
                        "completion")
    if min(prompt) < 0 or max(prompt) >= limits.vocab_size:
        raise bad_request(f"token ids must be in [0, {limits.vocab_size})", prompt_param)
    if max_tokens is not None and max_tokens > limits.max_tokens_limit:
        raise bad_request(f"max_tokens: {max_tokens} is more than this server allows ({limits.max_tokens_limit})",
                          "max_tokens")
    room = limits.max_model_len - len(prompt)
    if max_tokens is None:  # OpenAI's defaults, within what is left of the context
        max_tokens = min(limits.max_tokens_limit, room,
                         room if prompt_param == "messages" else DEFAULT_COMPLETION_TOKENS)
    if len(prompt) + max_tokens > limits.max_model_len:
        raise _too_long(limits, prompt_param, f"{len(prompt) + max_tokens} tokens ({len(prompt)} in the "
                        f"{prompt_param}, {max_tokens} in the completion)", "max_tokens")
    need = blocks_for(len(prompt) + max_tokens - 1, limits.block_size)
    if need > limits.cache_blocks:
        raise bad_request(f"{len(prompt)} prompt tokens + {max_tokens} new tokens need {need} KV cache blocks of "
                          f"{limits.block_size} positions; this server's cache holds {limits.cache_blocks}",
                          "max_tokens", code="exceeds_kv_cache")
    stop_ids = tuple(dict.fromkeys(request.stop_token_ids or ()))
    if stop_ids and (min(stop_ids) < 0 or max(stop_ids) >= limits.vocab_size):
        raise bad_request(f"token ids must be in [0, {limits.vocab_size})", "stop_token_ids")
    eos = (() if request.ignore_eos else limits.eos_ids) + stop_ids
    top_k = request.top_k or 0
    return Submission(prompt=list(prompt), max_tokens=max_tokens,
                      temperature=1.0 if request.temperature is None else request.temperature,
                      top_k=0 if not 0 < top_k < limits.vocab_size else top_k,
                      top_p=1.0 if request.top_p is None else request.top_p,
                      seed=secrets.randbits(63) if request.seed is None else request.seed,
                      eos_ids=tuple(dict.fromkeys(eos)), cache_salt=request.cache_salt)


class Completion:
    """``start()`` submits and waits for the engine to take the request; ``pieces()`` then yields
    ``(text, finish_reason)``, finish_reason set on the last; ``abort()`` ends it early."""

    def __init__(self, service: EngineService, submission: Submission, decode: Callable[[list[int]], str],
                 stop: tuple[str, ...] = (), retry_after_s: int = 1, report_cached_tokens: bool = False):
        self.service, self.submission = service, submission
        self.report_cached_tokens = report_cached_tokens  # usage's prompt_tokens_details (another client's
        # prompt shows in it: --enable-prompt-tokens-details)
        self.detokenizer = IncrementalDetokenizer(decode, submission.prompt, stop)
        self.end_ids = frozenset(submission.eos_ids)
        self.retry_after_s = retry_after_s
        self.stream = None
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.ended: str | None = None  # the reason it ended with, once

    async def start(self) -> None:
        try:
            self.stream = self.service.submit(self.submission, asyncio.get_running_loop())
        except Overloaded as exc:
            raise APIError(429, f"the server is busy: {exc}; retry later", code="queue_full",
                           headers={"Retry-After": str(self.retry_after_s)}) from None
        except Unavailable as exc:
            raise APIError(503, str(exc), code=exc.code) from None
        event = await self.stream.next()
        if event.error is not None:
            self._end("error")
            if isinstance(event.error, ValueError):  # the engine refused it (checked above; a race)
                raise bad_request(f"refused by the engine: {event.error}", None, code="rejected")
            if isinstance(event.error, Unavailable):  # it stopped before taking the request
                raise APIError(503, str(event.error), code=event.error.code)
            raise APIError(500, "the engine failed to take the request", code="engine_error")

    async def pieces(self) -> AsyncIterator[tuple[str, str | None]]:
        detok = self.detokenizer
        while self.finish_reason is None:
            event = await self.stream.next()
            if event.error is not None:
                self._end("error")
                raise APIError(500, f"generation failed: {_reason(event.error)}", code="engine_error")
            self.completion_tokens += 1
            if event.finished and event.token in self.end_ids:
                text, self.finish_reason = detok.finish(), "stop"
            else:
                text = detok.add(event.token)
                if detok.stopped:
                    self.finish_reason = "stop"
                    if not event.finished:
                        self.service.abort(self.stream)
                elif event.finished:
                    text, self.finish_reason = text + detok.finish(), "length"
            if self.finish_reason is not None:
                self._end(self.finish_reason)
            if text or self.finish_reason is not None:
                yield text, self.finish_reason

    def abort(self, reason: str = "abort") -> None:
        """The client left (or stopped reading; ``reason='error'``: its handling failed): the engine
        drops the request before its next step. A no-op once it ended."""
        if self.ended is None and self.stream is not None:
            self.service.abort(self.stream)
            self._end(reason)

    @property
    def usage(self) -> Usage:
        cached = self.stream.cached_tokens if self.stream is not None else 0
        return Usage.of(len(self.submission.prompt), self.completion_tokens,
                        cached if self.report_cached_tokens else None)

    def _end(self, reason: str) -> None:
        if self.ended is None:
            self.ended = reason
            self.service.metrics.finished(reason, self.service.clock() - self.stream.arrival)


def _reason(error: Exception) -> str:
    """What a client is told of the engine error that ended its request: the engine's own words only where
    they are meant for it (the exception of a failed step may quote internals; the server's log has it)."""
    if isinstance(error, SamplingError):  # the model's fault (no parameter the API takes makes one)
        return "the model's output for this request could not be sampled (NaN or +inf logits, or none finite)"
    if isinstance(error, Unavailable):
        return str(error)
    return "the engine failed this request (the server's log says why)"
