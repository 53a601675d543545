"""The HTTP API (FastAPI): ``create_app(service, settings)``.

    POST /v1/completions, /v1/chat/completions   OpenAI's, streamed over SSE with "stream": true
    GET  /v1/models                              the served model (id, owned_by, max_model_len)
    GET  /health                                 200 while the engine thread runs
    GET  /ready                                  200 when it takes requests; 503 while loading, draining, saturated
    GET  /metrics                                Prometheus text (metrics.py)

A generation request is checked in this order, each refusal in OpenAI's error shape (errors.py):
the API key (401, /v1 only), whether the server takes requests (503), the body's size (413) and
arrival (408), its JSON and fields (400 naming the field), the model name (404, compared with the served name only),
the prompt's and completion's lengths (400: context, --max-tokens-limit, cache size), then the queue
(429 with Retry-After). The body is read here (no body parameter), so nothing is parsed before the
key is checked. No CORS middleware: browsers of other origins get no access.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
from contextlib import asynccontextmanager
from dataclasses import dataclass

try:
    from fastapi import APIRouter, Depends, FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response
    from starlette.requests import ClientDisconnect
    from starlette.exceptions import HTTPException as StarletteHTTPException
except ImportError as exc:  # the serve extra
    raise ImportError("models.llama.serve needs the serve extra: pip install 'ms_rope_attention[serve]'") from exc

from .chat_template import ChatTemplate, ChatTemplateError
from .completion import Completion, Limits, plan
from .errors import APIError, bad_request, unavailable
from .metrics import CONTENT_TYPE
from .protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList, now, parse
from .responses import ChatFormat, GenerationResponse, TextFormat
from .scheduler import EngineService, Unavailable

log = logging.getLogger("models.llama.serve")


@dataclass(frozen=True)
class Settings:
    served_model_name: str
    tokenizer: object                      # models.llama.tokenizer.Tokenizer
    chat_template: ChatTemplate
    api_key: str | None = None             # every /v1 route requires "Authorization: Bearer <key>"
    max_body_bytes: int = 4 << 20          # 413 past it
    max_tokens_limit: int | None = None    # 400 past it (None: the model's context)
    send_timeout_s: float = 30.0           # a client that stops reading this long is dropped
    body_timeout_s: float = 30.0           # 408 when a body takes longer to arrive
    retry_after_s: int = 1                 # the 429's Retry-After
    owned_by: str = "ms_rope_attention"


def _error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


async def _read_json(request: Request, limit: int):
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the body is {declared} bytes; this server takes at most {limit}",
                       code="request_too_large")
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise APIError(413, f"the body is more than {limit} bytes, the most this server takes",
                               code="request_too_large")
    except ClientDisconnect:  # nobody reads the answer
        raise APIError(400, "the client disconnected while sending the body", code="client_disconnected") from None
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested too deep for the parser
        raise APIError(400, f"the body is not valid JSON: {exc}", code="invalid_json") from None


def create_app(service: EngineService, settings: Settings) -> FastAPI:
    limits = Limits.of(service.generator, settings.max_tokens_limit)
    tokenizer, template = settings.tokenizer, settings.chat_template
    created = now()

    @asynccontextmanager
    async def lifespan(app):
        service.start()
        try:
            yield
        finally:
            await asyncio.to_thread(service.stop)

    app = FastAPI(title="ms_rope_attention Llama server", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.service, app.state.settings = service, settings

    @app.exception_handler(APIError)
    async def api_error(request, exc: APIError):
        return _error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc: StarletteHTTPException):
        return _error_response(APIError(exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404
                                        else None))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, exc: RequestValidationError):
        error = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in error.get("loc", ())[1:]) or None
        return _error_response(bad_request(f"{param}: {error.get('msg', 'invalid')}", param))

    @app.exception_handler(Exception)
    async def internal_error(request, exc: Exception):
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        return _error_response(APIError(500, "internal server error", code="internal_error"))

    def require_key(request: Request) -> None:
        if settings.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), settings.api_key.encode()):
            raise APIError(401, "missing or incorrect API key: send the header 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    @app.get("/health")
    async def health():
        if not service.alive:
            raise unavailable("the engine stopped; see the server's log", "engine_dead")
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        try:
            service.check_serving()
        except Unavailable as exc:
            raise unavailable(str(exc), exc.code) from None
        if service.waiting >= service.max_waiting:
            raise unavailable(f"{service.waiting} requests are waiting (--max-waiting {service.max_waiting})",
                              "saturated")
        return {"status": "ready"}

    @app.get("/metrics")
    async def metrics():
        return Response(service.metrics.render(), media_type=CONTENT_TYPE)

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_key)])

    @v1.get("/models")
    async def models():
        card = ModelCard(id=settings.served_model_name, created=created, owned_by=settings.owned_by,
                         max_model_len=limits.max_model_len)
        return ModelList(data=[card]).model_dump()

    async def generate(request: Request, kind: type, prompt_ids, max_tokens, prompt_param: str, fmt):
        """Both endpoints after their prompt: limits, submission, the response that serves it."""
        submission = plan(kind, prompt_ids, limits, max_tokens=max_tokens, prompt_param=prompt_param)
        completion = Completion(service, submission, tokenizer.decode, kind.stop_strings, settings.retry_after_s)
        return GenerationResponse(completion, fmt, stream=bool(kind.stream), include_usage=kind.include_usage,
                                  continuous_usage=kind.continuous_usage, send_timeout=settings.send_timeout_s)

    async def encode(text: str, param: str) -> list[int]:
        try:
            return await asyncio.to_thread(tokenizer.encode, text)
        except Exception as exc:  # noqa: BLE001  e.g. a lone surrogate, which JSON allows
            raise bad_request(f"{param}: the text cannot be tokenized ({type(exc).__name__}: {exc})", param) from None

    async def checked(request: Request, model: type):
        try:
            service.check_serving()
        except Unavailable as exc:
            raise unavailable(str(exc), exc.code) from None
        try:
            data = await asyncio.wait_for(_read_json(request, settings.max_body_bytes), settings.body_timeout_s)
        except asyncio.TimeoutError:
            raise APIError(408, f"the body did not arrive within {settings.body_timeout_s:g} s",
                           code="request_timeout") from None
        body = parse(model, data)
        if body.model is not None and body.model != settings.served_model_name:
            raise APIError(404, f"the model '{body.model:.100}' does not exist; this server serves "
                           f"'{settings.served_model_name}'", param="model", code="model_not_found")
        if body.stream_options is not None and not body.stream:
            raise bad_request("stream_options: only with stream=true", "stream_options")
        return body

    @v1.post("/completions")
    async def completions(request: Request):
        body = await checked(request, CompletionRequest)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise bad_request(f"prompt: a batch of {len(prompt)} prompts; this server takes one per request",
                                  "prompt")
            prompt = prompt[0]
        ids = list(prompt) if isinstance(prompt, list) else await encode(prompt, "prompt")
        return await generate(request, body, ids, body.max_tokens, "prompt", TextFormat(settings.served_model_name))

    @v1.post("/chat/completions")
    async def chat_completions(request: Request):
        body = await checked(request, ChatCompletionRequest)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            text = await asyncio.to_thread(template.render, messages)
        except ChatTemplateError as exc:
            raise bad_request(f"messages: {exc}", "messages") from None
        ids = await encode(text, "messages")
        bos = getattr(tokenizer, "bos_id", None)
        if bos is not None and len(ids) > 1 and ids[0] == ids[1] == bos:
            ids = ids[1:]  # the template wrote BOS and the tokenizer added one
        max_tokens = body.max_completion_tokens or body.max_tokens
        return await generate(request, body, ids, max_tokens, "messages", ChatFormat(settings.served_model_name))

    app.include_router(v1)
    return app
