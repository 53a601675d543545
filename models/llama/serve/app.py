"""The HTTP API (FastAPI): ``create_app(service, settings)``.

    POST /v1/completions, /v1/chat/completions   OpenAI's, streamed over SSE with "stream": true
    GET  /v1/models                              the served model (id, owned_by, max_model_len)
    GET  /health                                 200 while the engine thread runs
    GET  /ready                                  200 when it takes requests; 503 while loading, draining, saturated
    GET  /metrics                                Prometheus text (metrics.py)

A generation request is checked in this order, each refusal in OpenAI's error shape (errors.py):
the Host header (421 unless one of --allowed-hosts: loopback names when bound to loopback, so a
DNS-rebinding page is not answered), the API key (401 with ``WWW-Authenticate: Bearer`` on any path
under /v1, known or not, before routing), the route (404, 405), whether the server takes requests
(503), the Content-Type (415 unless ``application/json``: a page of another origin can POST only
text/plain, a form or no type without a preflight), a place among the requests being prepared (429
with Retry-After past --max-preparing, before the body is read), the body's size (413) and arrival
(408), its JSON and fields (400 naming the field; bodies over ``PARSE_IN_THREAD_BYTES`` are parsed and
validated by ``_Parser``, off the event loop), the model name (404, compared with the served
name only), the prompt text's length (400, before the template and the tokenizer run), the prompt's
and completion's lengths (400: context, --max-tokens-limit, cache size), then the queue (429 with
Retry-After). A request holds its place among those being prepared from before its body is read
until it is queued or refused, so reading, parsing, rendering and tokenizing run for at most
--max-preparing requests at once. The body is read here (no body parameter), so nothing is parsed
before the key is checked. No CORS middleware: browsers of other origins get no access.
"""
from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass

try:
    from fastapi import APIRouter, FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response
    from starlette.datastructures import Headers
    from starlette.exceptions import HTTPException as StarletteHTTPException
    from starlette.middleware.trustedhost import TrustedHostMiddleware
    from starlette.requests import ClientDisconnect
except ImportError as exc:  # the serve extra
    raise ImportError("models.llama.serve needs the serve extra: pip install 'ms_rope_attention[serve]'") from exc

from .chat_template import ChatTemplate, ChatTemplateError
from .completion import Completion, Limits, check_text, plan
from .errors import APIError, bad_request, unavailable
from .metrics import CONTENT_TYPE
from .protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList, now, parse_json
from .responses import ChatFormat, GenerationResponse, TextFormat
from .scheduler import EngineService, Unavailable

log = logging.getLogger("models.llama.serve")
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]")  # the Host names of a loopback server (any port)
PARSE_IN_THREAD_BYTES = 64 << 10  # a larger body is parsed off the event loop (json.loads holds it ~25 ms a MiB)


@dataclass(frozen=True)
class Settings:
    served_model_name: str
    tokenizer: object                      # models.llama.tokenizer.Tokenizer
    chat_template: ChatTemplate
    api_key: str | None = None             # every /v1 path requires "Authorization: Bearer <key>"
    max_body_bytes: int = 4 << 20          # 413 past it
    max_tokens_limit: int | None = None    # 400 past it (None: the model's context)
    send_timeout_s: float = 30.0           # a client that stops reading this long is dropped
    body_timeout_s: float = 30.0           # 408 when a body takes longer to arrive
    retry_after_s: int = 1                 # the 429's Retry-After
    owned_by: str = "ms_rope_attention"
    max_preparing: int = 64                # requests read, parsed and tokenized at once; 429 past it
    allowed_hosts: tuple[str, ...] | None = LOOPBACK_HOSTS  # Host names answered (None: any); 421 otherwise
    enable_prompt_tokens_details: bool = False  # usage.prompt_tokens_details.cached_tokens: off, as vLLM's


def allowed_hosts(bind: str, given: list[str] | None = None) -> tuple[str, ...] | None:
    """``Settings.allowed_hosts`` from --allowed-hosts (``given``; '*' among them: any) and the bind
    address: by default loopback names for a server bound to loopback, else any host."""
    if given:
        return None if "*" in given else tuple(given)
    try:
        loopback = bind == "localhost" or ipaddress.ip_address(bind).is_loopback
    except ValueError:  # a host name
        loopback = False
    return LOOPBACK_HOSTS if loopback else None


def _error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def _require_json(request: Request) -> None:
    media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media_type != "application/json":
        raise APIError(415, f"the body must be JSON, sent with 'Content-Type: application/json' (got "
                       f"{media_type or 'none'!r:.100})", code="unsupported_media_type")


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the body is {declared} bytes; this server takes at most {limit}",
                       code="request_too_large")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"the body is more than {limit} bytes, the most this server takes",
                               code="request_too_large")
    except ClientDisconnect:  # nobody reads the answer
        raise APIError(400, "the client disconnected while sending the body", code="client_disconnected") from None
    return b"".join(chunks)


class _Preparing:
    """The requests between their headers and the queue (their bodies read, parsed, rendered,
    tokenized): at most ``limit`` at once; one more is refused at once, before its body is read."""

    def __init__(self, limit: int, retry_after_s: int):
        self.limit, self.retry_after_s, self.count = limit, retry_after_s, 0  # the event loop's only

    @contextmanager
    def place(self):
        if self.count >= self.limit:
            raise APIError(429, f"the server is busy: {self.count} requests are being read and tokenized "
                           f"(--max-preparing {self.limit}); retry later", code="too_many_preparing",
                           headers={"Retry-After": str(self.retry_after_s)})
        self.count += 1
        try:
            yield
        finally:
            self.count -= 1


class _Parser:
    """Parses and validates large bodies in a thread of its own, one at a time, resting after each as
    long as it took. The JSON parser holds the GIL throughout (up to ~0.15 s for 4 MiB), and the event
    loop and the engine thread need it many times per request: so large bodies take at most half of it,
    and a body's objects are materialised one body at a time."""

    def __init__(self):
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="rfa-parse")

    def _paced(self, model: type, raw: bytes):
        started = time.perf_counter()
        try:
            return parse_json(model, raw)
        finally:
            time.sleep(time.perf_counter() - started)  # the GIL free meanwhile; this body's answer waits too

    async def parse(self, model: type, raw: bytes):
        return await asyncio.get_running_loop().run_in_executor(self._thread, self._paced, model, raw)

    def close(self) -> None:
        self._thread.shutdown(wait=False)


class _KeyCheck:
    """ASGI middleware: every path under /v1 needs the key, a route or not, so a 404 tells nobody
    without it which routes exist."""

    def __init__(self, app, api_key: str):
        self.app, self.key = app, api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            scheme, _, token = Headers(scope=scope).get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.key):
                error = APIError(401, "missing or incorrect API key: send the header 'Authorization: Bearer <key>'",
                                 code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                await _error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _HostCheck:
    """ASGI middleware: answers only the Host names in ``allowed`` (a DNS-rebinding page sends its own
    name). starlette's TrustedHostMiddleware decides; its plain-text refusal is replaced by a 421 in
    OpenAI's error shape."""

    def __init__(self, app, allowed: tuple[str, ...]):
        self.app, self.allowed = app, allowed
        self._check = TrustedHostMiddleware(self._allowed, allowed_hosts=list(allowed), www_redirect=False)

    async def _allowed(self, scope, receive, send):
        await self.app(scope, receive, scope.pop("rfa.send"))

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def refuse(message):  # only the check's own answer comes here
            if message["type"] == "http.response.start":
                host = Headers(scope=scope).get("host", "")
                await _error_response(APIError(421, f"this server does not answer for the host {host!r:.100} "
                                               f"(--allowed-hosts: {', '.join(self.allowed)})",
                                               code="host_not_allowed"))(scope, receive, send)
        scope["rfa.send"] = send
        await self._check(scope, receive, refuse)


def create_app(service: EngineService, settings: Settings) -> FastAPI:
    limits = Limits.of(service.generator, settings.max_tokens_limit)
    tokenizer, template = settings.tokenizer, settings.chat_template
    created = now()
    preparing = _Preparing(settings.max_preparing, settings.retry_after_s)
    parser = _Parser()

    @asynccontextmanager
    async def lifespan(app):
        service.start()
        try:
            yield
        finally:
            parser.close()
            await asyncio.to_thread(service.stop)

    app = FastAPI(title="ms_rope_attention Llama server", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.service, app.state.settings = service, settings
    if settings.api_key is not None:
        app.add_middleware(_KeyCheck, api_key=settings.api_key)
    if settings.allowed_hosts is not None:
        app.add_middleware(_HostCheck, allowed=tuple(settings.allowed_hosts))  # the outermost: first

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

    v1 = APIRouter(prefix="/v1")

    @v1.get("/models")
    async def models():
        card = ModelCard(id=settings.served_model_name, created=created, owned_by=settings.owned_by,
                         max_model_len=limits.max_model_len)
        return ModelList(data=[card]).model_dump()

    async def generate(request: Request, kind: type, prompt_ids, max_tokens, prompt_param: str, fmt):
        """Both endpoints after their prompt: limits, submission, the response that serves it."""
        submission = plan(kind, prompt_ids, limits, max_tokens=max_tokens, prompt_param=prompt_param)
        completion = Completion(service, submission, tokenizer.decode, kind.stop_strings, settings.retry_after_s,
                                report_cached_tokens=settings.enable_prompt_tokens_details)
        return GenerationResponse(completion, fmt, stream=bool(kind.stream), include_usage=kind.include_usage,
                                  continuous_usage=kind.continuous_usage, send_timeout=settings.send_timeout_s)

    async def encode(text: str, param: str) -> list[int]:
        try:
            return await asyncio.to_thread(tokenizer.encode, text)
        except Exception:  # noqa: BLE001  e.g. a lone surrogate, which JSON allows; the tokenizer's words stay here
            raise bad_request(f"{param}: the text cannot be tokenized (it holds a lone surrogate or other text the "
                              "tokenizer refuses)", param) from None

    @asynccontextmanager
    async def prepared(request: Request, model: type):
        """The request's body as ``model``, checked in the module docstring's order; the request holds
        a place among those being prepared until the block ends."""
        try:
            service.check_serving()
        except Unavailable as exc:
            raise unavailable(str(exc), exc.code) from None
        _require_json(request)
        with preparing.place():
            try:
                raw = await asyncio.wait_for(_read_body(request, settings.max_body_bytes), settings.body_timeout_s)
            except asyncio.TimeoutError:
                raise APIError(408, f"the body did not arrive within {settings.body_timeout_s:g} s",
                               code="request_timeout") from None
            if len(raw) > PARSE_IN_THREAD_BYTES:
                body = await parser.parse(model, raw)
            else:
                body = parse_json(model, raw)
            del raw  # not held while the prompt is rendered and tokenized
            if body.model is not None and body.model != settings.served_model_name:
                raise APIError(404, f"the model '{body.model:.100}' does not exist; this server serves "
                               f"'{settings.served_model_name}'", param="model", code="model_not_found")
            if body.stream_options is not None and not body.stream:
                raise bad_request("stream_options: only with stream=true", "stream_options")
            yield body

    @v1.post("/completions")
    async def completions(request: Request):
        async with prepared(request, CompletionRequest) as body:
            if isinstance(body.prompt, str):
                check_text(len(body.prompt), limits, "prompt")
                ids = await encode(body.prompt, "prompt")
            else:
                ids = body.prompt
            return await generate(request, body, ids, body.max_tokens, "prompt",
                                  TextFormat(settings.served_model_name))

    @v1.post("/chat/completions")
    async def chat_completions(request: Request):
        async with prepared(request, ChatCompletionRequest) as body:
            messages = [m.for_template() for m in body.messages]
            check_text(sum(len(m["content"]) for m in messages), limits, "messages")
            try:
                text = await asyncio.to_thread(template.render, messages, body.add_generation_prompt is not False)
            except ChatTemplateError as exc:
                raise bad_request(f"messages: {exc}", "messages") from None
            ids = await encode(text, "messages")
            bos = getattr(tokenizer, "bos_id", None)
            if bos is not None and len(ids) > 1 and ids[0] == ids[1] == bos:
                ids = ids[1:]  # the template wrote BOS and the tokenizer added one
            max_tokens = body.max_completion_tokens or body.max_tokens
            return await generate(request, body, ids, max_tokens, "messages",
                                  ChatFormat(settings.served_model_name))

    app.include_router(v1)
    return app
