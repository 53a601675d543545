"""The HTTP API's bodies, in OpenAI's shape (pydantic): the requests of ``/v1/completions`` and
``/v1/chat/completions`` with vLLM's extensions this server honours (``top_k``, ``ignore_eos``,
``stop_token_ids``, ``cache_salt``), and the responses, streamed chunks, usage and model list.

Requests are validated strictly (no "5" for 5, no NaN) and ``parse`` turns any refusal into a 400
naming the field (``param``, e.g. ``messages.0.content``). Every field a request model declares is
one of three kinds: honoured; accepted because it changes nothing here (``user``, ``metadata``,
``store``, ...); or one this server cannot honour, declared with the values that change
nothing (``presence_penalty: 0`` passes, ``1.5`` is refused by name, ``unsupported_parameter``). A
field not declared (a vLLM or OpenAI extension added later, a typo) is refused by name too: nothing
is silently ignored. Sizes are capped before anything costly: ``MAX_MESSAGES`` messages (and text
parts a message), ``MAX_STOP_STRINGS`` stop strings of ``MAX_STOP_CHARS`` characters, and a batch of
prompts is refused before its members are validated. ``parse_json`` lets other threads run between
the JSON objects it makes (the C parser otherwise holds the GIL for a whole body).
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal

try:
    from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator
    from pydantic_core import PydanticCustomError
except ImportError as exc:  # the serve extra: pip install "ms_rope_attention[serve]"
    raise ImportError("models.llama.serve needs the serve extra: pip install 'ms_rope_attention[serve]'") from exc

from .errors import APIError

_STRICT = ConfigDict(strict=True, extra="forbid")
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024     # a stop string's length: the detokenizer holds back up to this many characters less one
MAX_MESSAGES = 2048       # messages of a chat, and text parts of a message (each is rendered, then tokenized)


def _only(*values):
    """A field this server cannot honour: absent, null or one of ``values`` (they change nothing) passes;
    any other value is refused by name (``unsupported_parameter``)."""
    def check(value):
        if value is not None and value not in values:
            only = f" (only {' or '.join(json.dumps(v) for v in values)})" if values else ""
            raise PydanticCustomError("unsupported_parameter", "not supported by this server{only}", {"only": only})
        return value
    return Annotated[Any, AfterValidator(check)]


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM's: usage in every chunk
    include_obfuscation: _only(False) = None     # OpenAI's padding of streamed chunks: none here


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
    cache_salt: str | None = Field(None, min_length=1)  # vLLM's: shares cached blocks only within a salt

    # accepted, their values not looked at: they change nothing this server returns (who asks, storage,
    # billing, cache routing, a request id of the client's)
    user: Any = None
    metadata: Any = None
    store: Any = None
    service_tier: Any = None
    safety_identifier: Any = None
    prompt_cache_key: Any = None
    prompt_cache_retention: Any = None
    prompt_cache_options: Any = None
    request_id: Any = None

    # not honoured: only the values that change nothing pass (OpenAI's, then vLLM's)
    logprobs: _only(False, 0) = None
    top_logprobs: _only(0) = None
    presence_penalty: _only(0) = None
    frequency_penalty: _only(0) = None
    logit_bias: _only({}) = None
    response_format: _only({"type": "text"}) = None
    repetition_penalty: _only(1) = None
    min_p: _only(0) = None
    min_tokens: _only(0) = None
    use_beam_search: _only(False) = None
    length_penalty: _only(1) = None
    include_stop_str_in_output: _only(False) = None
    skip_special_tokens: _only(True) = None
    spaces_between_special_tokens: _only(True) = None
    truncate_prompt_tokens: _only() = None
    prompt_logprobs: _only(0) = None
    allowed_token_ids: _only() = None
    bad_words: _only([]) = None
    structured_outputs: _only() = None
    guided_json: _only() = None
    guided_regex: _only() = None
    guided_choice: _only() = None
    guided_grammar: _only() = None
    structural_tag: _only() = None
    guided_decoding_backend: _only() = None
    guided_whitespace_pattern: _only() = None
    logits_processors: _only([]) = None
    return_tokens_as_token_ids: _only(False) = None
    return_token_ids: _only(False) = None
    priority: _only(0) = None
    kv_transfer_params: _only() = None
    vllm_xargs: _only({}) = None
    mm_processor_kwargs: _only({}) = None

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
        if any(len(s) > MAX_STOP_CHARS for s in strings):
            raise ValueError(f"a stop string may be at most {MAX_STOP_CHARS} characters, got "
                             f"{max(len(s) for s in strings)}")
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
    # a text or token ids; a batch of one of either is taken as that one (n=1 only: a larger batch is refused)
    prompt: str | list[int]
    best_of: _only(1) = None
    echo: _only(False) = None
    suffix: _only("") = None
    add_special_tokens: _only(True) = None   # the tokenizer adds BOS, as vLLM's default here
    prompt_embeds: _only() = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, prompt):
        """Before its members are validated: a batch of many could be large, and is refused anyway."""
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ValueError(f"a batch of {len(prompt)} prompts; this server takes one per request")
            return prompt[0]
        return prompt


class TextPart(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[TextPart], Field(max_length=MAX_MESSAGES)] | None = None
    name: str | None = None               # given to the chat template, as tool_call_id
    tool_call_id: str | None = None
    tool_calls: _only([]) = None          # an earlier answer's tool calls: this server renders none
    function_call: _only() = None
    refusal: _only() = None
    audio: _only() = None
    annotations: _only([]) = None
    reasoning_content: _only() = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    def for_template(self) -> dict:
        """The message as a chat template reads it."""
        fields = {"name": self.name, "tool_call_id": self.tool_call_id}
        return {"role": self.role, "content": self.text(), **{k: v for k, v in fields.items() if v is not None}}


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name; wins over max_tokens
    add_generation_prompt: bool | None = True  # vLLM's: false renders the messages without the assistant's turn
    parallel_tool_calls: Any = None  # accepted: there are no tools
    prediction: Any = None           # accepted: a latency hint; the answer is the same
    tools: _only([]) = None
    tool_choice: _only("none", "auto") = None
    functions: _only([]) = None
    function_call: _only("none", "auto") = None
    modalities: _only(["text"]) = None
    audio: _only() = None
    reasoning_effort: _only() = None
    verbosity: _only() = None
    web_search_options: _only() = None
    moderation: _only() = None
    echo: _only(False) = None
    continue_final_message: _only(False) = None
    add_special_tokens: _only(False) = None  # the template writes BOS (a second one is dropped)
    documents: _only([]) = None
    chat_template: _only() = None
    chat_template_kwargs: _only({}) = None
    include_reasoning: _only(True) = None


YIELD_EVERY_OBJECTS = 256  # the JSON parser hands the GIL over after this many objects (~0.2 ms of parsing)


class _Yielding:
    """json's hook for every object it makes, which hands the GIL to any thread waiting for it every
    ``YIELD_EVERY_OBJECTS`` objects. The C parser otherwise holds it for a whole body (~0.1 s for 100k
    objects), and a hook alone lets the interpreter switch only every 5 ms (``sys.getswitchinterval``):
    a request on the event loop, which needs the GIL dozens of times before its first token, then waits
    5 ms each time; here it waits a fraction of a millisecond."""

    def __init__(self):
        self.objects = 0

    def __call__(self, obj: dict) -> dict:
        self.objects += 1
        if self.objects % YIELD_EVERY_OBJECTS == 0:
            time.sleep(0)  # releases the GIL: a waiting thread takes it
        return obj


def parse_json(model: type[BaseModel], body: bytes) -> BaseModel:
    """A request body (JSON) as ``model``, or an ``APIError`` 400 (``invalid_json``, or naming the field)."""
    try:
        data = json.loads(body, object_hook=_Yielding())
    except (ValueError, RecursionError) as exc:  # RecursionError: nested too deep for the parser
        raise APIError(400, f"the body is not valid JSON: {exc}", code="invalid_json") from None
    return parse(model, data)


def parse(model: type[BaseModel], data) -> BaseModel:
    """``data`` (a parsed JSON body) as ``model``, or an ``APIError`` 400 naming the first field at fault."""
    if not isinstance(data, dict):
        raise APIError(400, "the body must be a JSON object", code="invalid_body")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_input=False)
        error = next((e for e in errors if e["type"] == "too_long"), errors[0])  # a cap, even in a union
        path = [part for part in error["loc"] if not _union_member(part)]
        param = ".".join(str(part) for part in path) or None
        message, code = error["msg"].removeprefix("Value error, "), "invalid_value"
        if error["type"] in ("extra_forbidden", "unsupported_parameter"):
            message, code = ("not supported by this server" if error["type"] == "extra_forbidden" else message,
                             "unsupported_parameter")
        elif error["type"] == "too_long":
            message = f"at most {error['ctx']['max_length']} items, got {error['ctx'].get('actual_length')}"
        elif len(path) < len(error["loc"]):  # a field of several types: say which it takes
            members = dict.fromkeys(str(p) for e in errors for p in e["loc"] if _union_member(p))
            message = f"expected one of: {', '.join(members)}"
        raise APIError(400, f"{param}: {message}" if param else message, param=param,
                       code="missing" if error["type"] == "missing" else code) from None


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
    prompt_tokens_details: PromptTokensDetails | None = None  # --enable-prompt-tokens-details (vLLM's null)

    @classmethod
    def of(cls, prompt: int, completion: int, cached: int | None = None) -> "Usage":
        """``cached``: the prompt's prefix-cache hit, reported only when given."""
        details = None if cached is None else PromptTokensDetails(cached_tokens=cached)
        return cls(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                   prompt_tokens_details=details)


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
