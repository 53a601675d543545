"""The response of a generation request, as an ASGI app: a JSON body, or server-sent events
(``data: {chunk}\\n\\n`` ... ``data: [DONE]\\n\\n``) in OpenAI's chunk shapes for completions and chat.

Both race the generation against the client: a task reads the connection's ``receive`` for
``http.disconnect`` while the request waits or streams, and a disconnect cancels the generation and
aborts the request in the engine (its KV blocks go back to the pool before the next step). Each
write has a deadline (``send_timeout``): a client that stops reading fills the socket's buffers,
the write waits, and after that many seconds the request is aborted and the connection closed, so a
stalled reader cannot hold blocks. Events wait in the request's queue meanwhile (at most
``max_tokens`` of them). A failure after the headers went out ends the stream with an error event
in OpenAI's shape, then ``[DONE]``; before them it is an ordinary error response.
"""
from __future__ import annotations

import asyncio
import json
import logging

try:
    from starlette.responses import Response
except ImportError as exc:  # the serve extra
    raise ImportError("models.llama.serve needs the serve extra: pip install 'ms_rope_attention[serve]'") from exc

from .completion import Completion
from .errors import APIError
from .protocol import (ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionResponse, ChatDelta,
                       ChatMessageOut, CompletionChoice, CompletionResponse, new_id, now)

log = logging.getLogger("models.llama.serve")
SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]


class _SendTimeout(Exception):
    pass


class TextFormat:
    """/v1/completions' bodies."""
    prefix = "cmpl"
    chunk_shape = CompletionResponse  # a streamed event's shape, the usage-only event's included

    def __init__(self, model: str):
        self.id, self.created, self.model = new_id(self.prefix), now(), model

    def _body(self, shape, choices: list, usage=None):
        """One body of this request: ``shape`` with its id, creation time and model."""
        return shape(id=self.id, created=self.created, model=self.model, choices=choices, usage=usage)

    def opening(self):
        return None  # no role chunk

    def chunk(self, text: str, finish_reason, usage=None) -> dict:
        return self._body(CompletionResponse, [CompletionChoice(text=text, finish_reason=finish_reason)],
                          usage).model_dump(exclude_none=True)

    def usage_chunk(self, usage) -> dict:
        return self._body(self.chunk_shape, [], usage).model_dump(exclude_none=True)

    def response(self, text: str, finish_reason, usage) -> dict:
        return self._body(CompletionResponse, [CompletionChoice(text=text, finish_reason=finish_reason)],
                          usage).model_dump()


class ChatFormat(TextFormat):
    """/v1/chat/completions' bodies."""
    prefix = "chatcmpl"
    chunk_shape = ChatCompletionChunk

    def opening(self):
        return self._delta(ChatDelta(role="assistant", content=""), None)

    def chunk(self, text: str, finish_reason, usage=None) -> dict:
        return self._delta(ChatDelta(content=text), finish_reason, usage)

    def _delta(self, delta, finish_reason, usage=None) -> dict:
        return self._body(ChatCompletionChunk, [ChatChunkChoice(delta=delta, finish_reason=finish_reason)],
                          usage).model_dump(exclude_none=True)

    def response(self, text: str, finish_reason, usage) -> dict:
        return self._body(ChatCompletionResponse, [ChatChoice(message=ChatMessageOut(content=text),
                                                              finish_reason=finish_reason)], usage).model_dump()


def _json(data) -> bytes:
    return json.dumps(data, separators=(",", ":")).encode()


def _sse(data) -> bytes:
    return b"data: " + (data if isinstance(data, bytes) else _json(data)) + b"\n\n"


class GenerationResponse(Response):
    """ASGI app answering one generation request; counted in the service's ``in_flight`` while it
    runs (a drain waits for it). A starlette ``Response`` only so that FastAPI hands it on as it is:
    it writes its own messages."""

    def __init__(self, completion: Completion, fmt: TextFormat, *, stream: bool, include_usage: bool = False,
                 continuous_usage: bool = False, send_timeout: float = 30.0):
        self.background = None  # FastAPI may set its background tasks here; there are none
        self.completion, self.fmt = completion, fmt
        self.stream, self.include_usage, self.continuous_usage = stream, include_usage, continuous_usage
        self.send_timeout = send_timeout
        self._started = False

    async def __call__(self, scope, receive, send) -> None:
        service = self.completion.service
        service.in_flight += 1
        producer = asyncio.ensure_future(self._produce(send))
        watcher = asyncio.ensure_future(self._watch(receive))
        try:
            await asyncio.wait({producer, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not producer.done():  # the client left: stop generating for it
                producer.cancel()
                await asyncio.gather(producer, return_exceptions=True)
            elif producer.exception() is not None and not isinstance(producer.exception(), _SendTimeout):
                raise producer.exception()
        finally:
            watcher.cancel()
            producer.cancel()
            self.completion.abort()  # a no-op once it ended
            service.in_flight -= 1

    @staticmethod
    async def _watch(receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    async def _send(self, send, message) -> None:
        try:
            await asyncio.wait_for(send(message), self.send_timeout)
        except asyncio.TimeoutError:
            log.warning("a client stopped reading for %.0f s: its request is aborted", self.send_timeout)
            self.completion.abort()
            raise _SendTimeout() from None

    async def _error(self, send, error: APIError) -> None:
        headers = [(b"content-type", b"application/json")]
        headers += [(k.lower().encode(), v.encode()) for k, v in error.headers.items()]
        await self._send(send, {"type": "http.response.start", "status": error.status, "headers": headers})
        await self._send(send, {"type": "http.response.body", "body": error.json()})

    async def _produce(self, send) -> None:
        completion = self.completion
        try:
            await completion.start()
        except APIError as error:
            await self._error(send, error)
            return
        try:
            if self.stream:
                await self._stream(send)
            else:
                text = "".join([piece async for piece, _ in completion.pieces()])
                body = _json(self.fmt.response(text, completion.finish_reason, completion.usage))
                await self._send(send, {"type": "http.response.start", "status": 200,
                                        "headers": [(b"content-type", b"application/json")]})
                await self._send(send, {"type": "http.response.body", "body": body})
        except (_SendTimeout, asyncio.CancelledError):
            raise
        except Exception as exc:  # noqa: BLE001  this request ends; nothing else is touched
            error = exc if isinstance(exc, APIError) else APIError(500, "internal error while generating",
                                                                    code="internal_error")
            if not isinstance(exc, APIError):
                log.exception("a request failed while generating")
            completion.abort("error")
            if not self._started:
                await self._error(send, error)
            else:
                await self._send(send, {"type": "http.response.body", "body": _sse(error.body()) + _sse(b"[DONE]"),
                                        "more_body": False})

    async def _stream(self, send) -> None:
        completion, fmt = self.completion, self.fmt
        await self._send(send, {"type": "http.response.start", "status": 200, "headers": SSE_HEADERS})
        self._started = True
        opening = fmt.opening()
        if opening is not None:
            await self._body(send, opening)
        async for text, finish_reason in completion.pieces():
            await self._body(send, fmt.chunk(text, finish_reason, completion.usage if self.continuous_usage else None))
        if self.include_usage:
            await self._body(send, fmt.usage_chunk(completion.usage))
        await self._send(send, {"type": "http.response.body", "body": _sse(b"[DONE]"), "more_body": False})

    async def _body(self, send, data) -> None:
        await self._send(send, {"type": "http.response.body", "body": _sse(data), "more_body": True})
