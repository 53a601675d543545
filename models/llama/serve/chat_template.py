"""Chat messages to a prompt: the checkpoint's own chat template, rendered as transformers renders it
but without transformers.

The template is ``chat_template.jinja`` in the checkpoint directory, else ``chat_template`` in its
``tokenizer_config.json`` (a string, or a list of named templates: the one named "default"); a
checkpoint with neither gets Llama 2's ``[INST]`` template. It runs in jinja2's
``ImmutableSandboxedEnvironment`` (no attribute of a Python object beyond the safe ones, no mutation
of the messages) with transformers' settings and helpers: ``trim_blocks``, ``lstrip_blocks``, the
``loopcontrols`` extension, ``raise_exception``, ``strftime_now`` and the ``tojson`` filter. A
template that refuses the messages (``raise_exception``: roles that do not alternate) is the
client's error: ``ChatTemplateError``, a 400.
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

try:
    from jinja2 import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment
except ImportError as exc:  # the serve extra
    raise ImportError("models.llama.serve needs the serve extra: pip install 'ms_rope_attention[serve]'") from exc

# meta-llama/Llama-2-7b-chat-hf's tokenizer_config.json chat_template
LLAMA2_CHAT_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}"
    "{% endfor %}")


class ChatTemplateError(ValueError):
    """The template refused the messages, or failed on them."""


def _raise_exception(message):
    raise ChatTemplateError(str(message))


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _token_text(token) -> str | None:
    """tokenizer_config.json writes a special token as its text or as an AddedToken's dict."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "<s>", eos_token: str = "</s>", name: str = "llama2"):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self._template = env.from_string(source)  # a syntax error raises here, at start-up
        self.bos_token, self.eos_token, self.name = bos_token, eos_token, name

    @classmethod
    def from_directory(cls, directory: str | Path | None) -> "ChatTemplate":
        """The checkpoint's template (see the module's docstring), or Llama 2's."""
        config = {}
        if directory is not None and (Path(directory) / "tokenizer_config.json").is_file():
            config = json.loads((Path(directory) / "tokenizer_config.json").read_text())
        tokens = dict(bos_token=_token_text(config.get("bos_token")) or "<s>",
                      eos_token=_token_text(config.get("eos_token")) or "</s>")
        if directory is not None and (Path(directory) / "chat_template.jinja").is_file():
            return cls((Path(directory) / "chat_template.jinja").read_text(), **tokens, name="chat_template.jinja")
        source = config.get("chat_template")
        if isinstance(source, list):  # [{"name": ..., "template": ...}, ...]
            source = next((t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"),
                          None)
        if isinstance(source, str):
            return cls(source, **tokens, name="tokenizer_config.json")
        return cls(LLAMA2_CHAT_TEMPLATE, **tokens)

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token, eos_token=self.eos_token)
        except ChatTemplateError:
            raise
        except (TemplateError, TypeError, ValueError, KeyError, AttributeError) as exc:
            raise ChatTemplateError(f"the chat template failed on these messages: {exc}") from None
