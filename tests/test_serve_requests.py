"""The server's request handling without a server (issue 64): the request models' fields against
OpenAI's and vLLM's, and the detokenizer's stop strings against a reference. The server-level
checks (caps, Content-Type, Host, the key before routing, cached tokens and cache_salt) are in
tests/test_serve.py, on its module's server.
"""
import pytest

pytest.importorskip("fastapi")  # the serve extra; make test installs it
from hypothesis import given, settings, strategies as st  # noqa: E402

from models.llama.serve.app import LOOPBACK_HOSTS, allowed_hosts  # noqa: E402
from models.llama.serve.detokenizer import IncrementalDetokenizer  # noqa: E402
from models.llama.serve.errors import APIError  # noqa: E402
from models.llama.serve.protocol import ChatCompletionRequest, CompletionRequest, parse  # noqa: E402

# The request fields of openai 3.63.0's CompletionCreateParamsBase and chat.CompletionCreateParamsBase
# (.venv), and of vLLM's CompletionRequest and ChatCompletionRequest (vllm/entrypoints/openai/protocol.py at
# ec3b890, with the guided_* fields and best_of of its earlier versions, which clients still send).
OPENAI_COMPLETION = {"model", "prompt", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens",
                     "n", "presence_penalty", "seed", "stop", "stream", "stream_options", "suffix", "temperature",
                     "top_p", "user"}
OPENAI_CHAT = {"messages", "model", "audio", "frequency_penalty", "function_call", "functions", "logit_bias",
               "logprobs", "max_completion_tokens", "max_tokens", "metadata", "modalities", "moderation", "n",
               "parallel_tool_calls", "prediction", "presence_penalty", "prompt_cache_key", "prompt_cache_options",
               "prompt_cache_retention", "reasoning_effort", "response_format", "safety_identifier", "seed",
               "service_tier", "stop", "store", "stream", "stream_options", "temperature", "tool_choice", "tools",
               "top_logprobs", "top_p", "user", "verbosity", "web_search_options"}
VLLM_SAMPLING = {"use_beam_search", "top_k", "min_p", "repetition_penalty", "length_penalty", "stop_token_ids",
                 "include_stop_str_in_output", "ignore_eos", "min_tokens", "skip_special_tokens",
                 "spaces_between_special_tokens", "truncate_prompt_tokens", "prompt_logprobs", "allowed_token_ids",
                 "response_format", "structured_outputs", "priority", "request_id", "logits_processors",
                 "return_tokens_as_token_ids", "return_token_ids", "cache_salt", "kv_transfer_params", "vllm_xargs",
                 "best_of", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structural_tag",
                 "guided_decoding_backend", "guided_whitespace_pattern"}
VLLM_COMPLETION = OPENAI_COMPLETION | VLLM_SAMPLING | {"prompt_embeds", "add_special_tokens"}
VLLM_CHAT = (OPENAI_CHAT | VLLM_SAMPLING | {"bad_words", "echo", "add_generation_prompt", "continue_final_message",
                                            "add_special_tokens", "documents", "chat_template",
                                            "chat_template_kwargs", "mm_processor_kwargs", "include_reasoning"})
EVERY_FIELD = OPENAI_COMPLETION | OPENAI_CHAT | VLLM_COMPLETION | VLLM_CHAT | {"guided_future", "temprature"}

HONOURED = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "n", "stream",
            "stream_options", "ignore_eos", "cache_salt"}
HARMLESS = {"user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key",
            "prompt_cache_retention", "prompt_cache_options", "request_id"}
ENDPOINTS = {  # model, a valid body, what it honours, what it accepts as changing nothing
    "completions": (CompletionRequest, {"prompt": "w1"}, HONOURED | {"prompt"}, HARMLESS),
    "chat": (ChatCompletionRequest, {"messages": [{"role": "user", "content": "w1"}]},
             HONOURED | {"messages", "max_completion_tokens", "add_generation_prompt"},
             HARMLESS | {"parallel_tool_calls", "prediction"}),
}


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_every_field_is_honoured_harmless_or_refused_by_name(endpoint):
    """Issue 64 F5: vLLM's guided_json, bad_words, chat_template, ... were accepted and ignored
    (extra="ignore"). Each field of OpenAI's and vLLM's requests (and two that exist nowhere), sent
    with a value that changes the output, is honoured (validated, and used), accepted because it
    changes nothing here, or refused with 400 naming it: never silently ignored."""
    model, base, honoured, harmless = ENDPOINTS[endpoint]
    seen = {}
    for name in sorted(EVERY_FIELD):
        try:
            parse(model, {**base, name: {"probe": 1}})
            seen[name] = "accepted"
        except APIError as error:
            assert error.status == 400 and error.param.split(".")[0] == name, (name, error.message)
            seen[name] = "refused" if error.code == "unsupported_parameter" and error.param == name else "checked"
            if seen[name] == "refused":
                assert error.message.startswith(f"{name}: not supported by this server"), error.message
    assert {n for n, kind in seen.items() if kind == "accepted"} == harmless
    assert {n for n, kind in seen.items() if kind == "checked"} <= honoured
    assert {n for n, kind in seen.items() if kind == "refused"} == EVERY_FIELD - honoured - harmless


def test_a_loopback_server_answers_loopback_names_only():
    """Issue 64 F6 (DNS rebinding): the Host names a server answers, from its bind address unless
    --allowed-hosts names them."""
    for bind in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        assert allowed_hosts(bind) == LOOPBACK_HOSTS == ("127.0.0.1", "localhost", "[::1]")
    for bind in ("0.0.0.0", "::", "192.168.1.5", "myhost.example"):
        assert allowed_hosts(bind) is None  # any host: the operator names them with --allowed-hosts
    assert allowed_hosts("0.0.0.0", ["api.example"]) == ("api.example",)
    assert allowed_hosts("127.0.0.1", ["api.example", "*"]) is None


# ---- stop strings ----
def _pieces_decode(pieces):
    return lambda ids: "".join(pieces[i] for i in ids)


def _reference(text: str, stops) -> tuple[str, bool]:
    """The output for the whole text: it ends before the stop string completed first (the longest
    of those completing at that character)."""
    for end in range(1, len(text) + 1):
        ended = [s for s in stops if text[:end].endswith(s)]
        if ended:
            return text[:end - max(map(len, ended))], True
    return text, False


def _held_reference(text: str, stops) -> int:
    return max((k for s in stops for k in range(min(len(s) - 1, len(text)) + 1) if text.endswith(s[:k])), default=0)


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(st.text("abc", min_size=1, max_size=4), min_size=1, max_size=25),
       stops=st.lists(st.text("abc", min_size=1, max_size=6), min_size=1, max_size=4))
def test_stop_strings_match_a_reference(pieces, stops):
    """Tokens of 1-4 characters over a small alphabet (overlapping stop strings are common): after
    each token the text handed out is the text so far less what could begin a stop string, and the
    whole output ends before the first stop string to complete, however the tokens split it."""
    vocab = ["p"] + pieces
    detok = IncrementalDetokenizer(_pieces_decode(vocab), [0], stop=stops)
    sent, text = "", ""
    for token in range(1, len(vocab)):
        sent += detok.add(token)
        text += vocab[token]
        if detok.stopped:
            break
        assert sent == text[:len(text) - _held_reference(text, stops)], (text, stops)
    sent += detok.finish()
    expected, stopped = _reference(text, stops)
    assert (sent, detok.stopped) == (expected, stopped)


class _CountingStr(str):
    """A stop string that counts the characters (and slices) read from it."""
    reads = 0

    def __getitem__(self, key):
        _CountingStr.reads += 1
        return str.__getitem__(self, key)


def test_stop_string_work_per_token_is_bounded():
    """Issue 64 F7: after each token the held-back text was found by slicing each stop string's every
    prefix (16 of 240 KB took 4 requests from 1.6 s to 6.7 s). Now a stop string's characters are read
    a bounded number of times each once (its matcher's table: at most 6 here) and about twice per
    character of text: 300 one-character tokens against 4 stop strings of 1000 characters, two that
    never begin to match and two that nearly match all along (the table's worst case), read at most
    4 x (6 x 1000 + 2 x 300) characters; the slicing read 2 x 300^2 / 2 more for the first two."""
    _CountingStr.reads = 0
    stops = [_CountingStr(s) for s in ("q" * 1000, "r" * 1000, "a" * 999 + "b", "a" * 998 + "bb")]
    detok = IncrementalDetokenizer(_pieces_decode(["p", "a"]), [0], stop=stops)
    for _ in range(300):
        detok.add(1)
    assert not detok.stopped and _CountingStr.reads <= 4 * (6 * 1000 + 2 * 300), _CountingStr.reads
