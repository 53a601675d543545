"""A request's generated text, piece by piece as its tokens arrive, with its stop strings.

Text is decoded from ids, not token by token: a token may be part of a character (byte-fallback
tokens of a multi-byte UTF-8 sequence) or change how the token before it reads (SentencePiece's
leading space). So each new token decodes a short window of ids ending with it, starting a few
tokens back (the prompt's last ones at first), and the new text is what that window's text adds to
the same window without the new tokens (vLLM's incremental detokenization). Text whose decoding
ends in U+FFFD (an incomplete UTF-8 sequence) waits for the next token.

Stop strings are matched on the text, across token boundaries: a string split over three tokens
stops the request as well as one inside a token. The request stops at the first character that
completes a stop string (the longest one, when several end there), however the text was split into
tokens; the text returned ends before it. Text that could still become the start of a stop string
(at most the longest stop string's length less one character) is held back until the next token
decides; at the end (EOS, the token limit) it is released. Each stop string is followed by a
Knuth-Morris-Pratt matcher fed each new character once, so the work per token is linear in its new
characters (amortized), whatever the stop strings' and the text's lengths.
"""
from __future__ import annotations

from typing import Callable, Sequence

PROMPT_CONTEXT = 5        # prompt tokens the first window starts with (their text is not output)
INCOMPLETE = "\ufffd"     # what a decoder makes of a partial UTF-8 sequence


class _StopMatcher:
    """One stop string's matcher: ``matched`` is the length of the longest prefix of the string the
    text fed so far ends with (Knuth-Morris-Pratt: ``fall[k]`` is the longest proper prefix of
    ``string[:k + 1]`` that is also its suffix)."""

    def __init__(self, string: str):
        self.string, self.matched = string, 0
        self.fall = [0] * len(string)
        k = 0
        for i in range(1, len(string)):
            while k and string[i] != string[k]:
                k = self.fall[k - 1]
            if string[i] == string[k]:
                k += 1
            self.fall[i] = k

    def feed(self, char: str) -> bool:
        """Whether the text now ends with the whole string."""
        string, k = self.string, self.matched
        while k and string[k] != char:
            k = self.fall[k - 1]
        if string[k] == char:
            k += 1
        self.matched = k
        return k == len(string)


class IncrementalDetokenizer:
    """``add(token)`` returns the text ready to send; ``finish()`` the rest. ``stopped`` once a stop
    string matched: ``text`` then ends before it, and further tokens are ignored."""

    def __init__(self, decode: Callable[[list[int]], str], prompt: Sequence[int], stop: Sequence[str] = ()):
        self._decode = decode
        self._ids = [int(t) for t in prompt[-PROMPT_CONTEXT:]]
        self._prefix = 0                  # the window starts here
        self._read = len(self._ids)       # ids up to here are in ``text``
        self.stop = tuple(stop)
        self._matchers = [_StopMatcher(s) for s in self.stop]
        self.text = ""                    # the output so far (what was sent and what is held back)
        self._sent = 0                    # characters of ``text`` handed out
        self.stopped = False

    def add(self, token: int) -> str:
        if self.stopped:
            return ""
        self._ids.append(int(token))
        before = self._decode(self._ids[self._prefix:self._read])
        after = self._decode(self._ids[self._prefix:])
        if len(after) > len(before) and not after.endswith(INCOMPLETE):
            self._append(after[len(before):])
            self._prefix, self._read = self._read, len(self._ids)
        return self._release(final=False)

    def finish(self) -> str:
        """The text still held back (and any partial character, as the decoder renders it)."""
        if not self.stopped and self._read < len(self._ids):
            before = self._decode(self._ids[self._prefix:self._read])
            after = self._decode(self._ids[self._prefix:])
            if len(after) > len(before):
                self._append(after[len(before):])
            self._read = len(self._ids)
        return self._release(final=True)

    def _append(self, new: str) -> None:
        if self._matchers:
            for i, char in enumerate(new):
                ended = [m for m in self._matchers if m.feed(char)]  # every matcher sees every character
                if ended:  # the text ends before the longest string ending here (it may begin in earlier text)
                    text = self.text + new[:i + 1]
                    self.text = text[:len(text) - max(len(m.string) for m in ended)]
                    self.stopped = True
                    return
        self.text += new

    def _release(self, final: bool) -> str:
        end = len(self.text) if final or self.stopped else len(self.text) - self._held()
        end = max(end, self._sent)
        piece, self._sent = self.text[self._sent:end], end
        return piece

    def _held(self) -> int:
        """Characters at the end of the text that begin some stop string (they may complete it)."""
        return max((m.matched for m in self._matchers), default=0)
