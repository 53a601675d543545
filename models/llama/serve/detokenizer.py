"""A request's generated text, piece by piece as its tokens arrive, with its stop strings.

Text is decoded from ids, not token by token: a token may be part of a character (byte-fallback
tokens of a multi-byte UTF-8 sequence) or change how the token before it reads (SentencePiece's
leading space). So each new token decodes a short window of ids ending with it, starting a few
tokens back (the prompt's last ones at first), and the new text is what that window's text adds to
the same window without the new tokens (vLLM's incremental detokenization). Text whose decoding
ends in U+FFFD (an incomplete UTF-8 sequence) waits for the next token.

Stop strings are matched on the text, across token boundaries: a string split over three tokens
stops the request as well as one inside a token. The text returned ends before the stop string.
Text that could still become the start of a stop string is held back until the next token
decides; at the end (EOS, the token limit) it is released.
"""
from __future__ import annotations

from typing import Callable, Sequence

PROMPT_CONTEXT = 5        # prompt tokens the first window starts with (their text is not output)
INCOMPLETE = "\ufffd"     # what a decoder makes of a partial UTF-8 sequence


class IncrementalDetokenizer:
    """``add(token)`` returns the text ready to send; ``finish()`` the rest. ``stopped`` once a stop
    string matched: ``text`` then ends before it, and further tokens are ignored."""

    def __init__(self, decode: Callable[[list[int]], str], prompt: Sequence[int], stop: Sequence[str] = ()):
        self._decode = decode
        self._ids = [int(t) for t in prompt[-PROMPT_CONTEXT:]]
        self._prefix = 0                  # the window starts here
        self._read = len(self._ids)       # ids up to here are in ``text``
        self.stop = tuple(stop)
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
        start = len(self.text)
        self.text += new
        hits = [i for i in (self.text.find(s, max(0, start - len(s) + 1)) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            self.stopped = True

    def _release(self, final: bool) -> str:
        end = len(self.text) if final or self.stopped else len(self.text) - self._held()
        end = max(end, self._sent)
        piece, self._sent = self.text[self._sent:end], end
        return piece

    def _held(self) -> int:
        """Characters at the end of the text that begin some stop string (they may complete it)."""
        longest = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text)), longest, -1):
                if self.text.endswith(s[:k]):
                    longest = k
                    break
        return longest
