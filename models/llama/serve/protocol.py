"""The HTTP API's bodies, in OpenAI's shape (pydantic): the requests of ``/v1/completions`` and
``/v1/chat/completions`` with vLLM's extensions the benchmarks send (``top_k``, ``ignore_eos``,
``stop_token_ids``), and the responses, streamed chunks, usage and model list.

Requests are validated strictly (no "5" for 5, no NaN) and ``parse`` turns any refusal into a 400
naming the field (``param``, e.g. ``messages.0.content``). Parameters this server cannot honour are
refused by name unless they hold their neutral value (``presence_penalty: 0`` passes, ``1.5`` does
not), and ``n`` other than 1 is refused: nothing is silently ignored that changes the output.
Fields OpenAI's clients send that do not change it (``user``, ``metadata``, ...) are ignored.
"""
from __future__ import annotations

import time
import uuid
from typing import Literal

try:
    from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
except ImportError as exc:  # the serve extra: pip install "ms_rope_attention[serve]"
    raise ImportError("models.llama.serve needs the serve extra: pip install 'ms_rope_attention[serve]'") from exc

from .errors import APIError

_STRICT = ConfigDict(strict=True, extra="ignore")
MAX_STOP_STRINGS = 16

# name -> the values that change nothing (any other value is refused, naming the field)
_UNSUPPORTED = {
    "echo": (None, False), "logprobs": (None, False, 0), "top_logprobs": (None, 0), "best_of": (None, 1),
    "suffix": (None, ""), "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
    "repetition_penalty": (None, 1), "logit_bias": (None, {}), "min_tokens": (None, 0), "min_p": (None, 0),
    "prompt_logprobs": (None, 0), "tools": (None, []), "tool_choice": (None, "none", "auto"), "functions": (None, []),
    "function_call": (None, "none", "auto"), "response_format": (None, {"type": "text"}),
    "include_stop_str_in_output": (None, False), "use_beam_search": (None, False), "skip_special_tokens": (None, True),
}


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM's: usage in every chunk


class _GenerationRequest(BaseModel):
    """What both endpoints take besides their prompt. None means the default."""
    model_config = _STRICT
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=-1)            # -1 or 0: no cut (vLLM's -1)
    seed: int | None = Field(None, ge=0, le=2 ** 63 - 1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = False
    user: str | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n):
        if n is not None and n != 1:
            raise ValueError(f"only n=1 is supported, got {n}")
        return n

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop):
        strings = [stop] if isinstance(stop, str) else stop or []
        if len(strings) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(strings)}")
        if any(not s for s in strings):
            raise ValueError("a stop string must not be empty")
        return stop

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and (self.stream_options.include_usage
                                             or self.stream_options.continuous_usage_stats))

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(_GenerationRequest):
    # a text, token ids, or a batch of one of either (batches of more are refused: n=1 only)
    prompt: str | list[int] | list[str] | list[list[int]]


class TextPart(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name; wins over max_tokens


def parse(model: type[BaseModel], data) -> BaseModel:
    """``data`` (a parsed JSON body) as ``model``, or an ``APIError`` 400 naming the first field at fault."""
    if not isinstance(data, dict):
        raise APIError(400, "the body must be a JSON object", code="invalid_body")
    for name, neutral in _UNSUPPORTED.items():
        if name in data and data[name] not in neutral:
            raise APIError(400, f"{name}: not supported by this server (only {neutral[1]!r})", param=name,
                           code="unsupported_parameter")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        error = errors[0]
        path = [part for part in error["loc"] if not _union_member(part)]
        param = ".".join(str(part) for part in path) or None
        message = error["msg"].removeprefix("Value error, ")
        if len(path) < len(error["loc"]):  # a field of several types: say which it takes
            members = dict.fromkeys(str(p) for e in errors for p in e["loc"] if _union_member(p))
            message = f"expected one of: {', '.join(members)}"
        raise APIError(400, f"{param}: {message}" if param else message, param=param,
                       code="missing" if error["type"] == "missing" else "invalid_value") from None


def _union_member(part) -> bool:
    """pydantic names the member of a union it tried in an error's location: 'str', 'list[int]'."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "none") or "[" in part)


# ---- responses ----
class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0   # prompt tokens found in the prefix cache, not computed


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def of(cls, prompt: int, completion: int, cached: int) -> "Usage":
        return cls(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


FinishReason = Literal["stop", "length"] | None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: FinishReason = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    logprobs: None = None
    finish_reason: FinishReason = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: None = None
    finish_reason: FinishReason = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())
