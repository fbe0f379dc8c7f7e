"""Streamed tokens to streamed text, cut at the first stop string (on the host).

`TextAssembler.add(token_id)` decodes the answer so far and returns the text that is safe to
send: text that could still grow into a stop string, and an unfinished UTF-8 character
(decoded as U+FFFD), are held back. When a stop string appears, the text is cut before it,
`stopped` is set and nothing more is returned (the server then cancels the request, as
OpenAI ends a completion at its stop). `finish()` returns what was held back once the
tokens end.

Example (the tiny byte-level tokenizer: one token per byte):
    >>> from jaxgen.models import tiny_tokenizer
    >>> tok = tiny_tokenizer()
    >>> text = TextAssembler(tok, stops=["END"])
    >>> [text.add(t) for t in tok.encode("ab EN")]
    ['a', 'b', ' ', '', '']
    >>> text.add(tok.encode("D")[0]), text.stopped, text.text
    ('', True, 'ab ')
"""
from __future__ import annotations

REPLACEMENT = "\ufffd"  # what an unfinished UTF-8 sequence decodes to


class TextAssembler:
    """Incremental detokenization with stop strings. tokenizer: jaxgen's Tokenizer (decode
    with skip_special_tokens). stops: strings that end the text (not included)."""

    def __init__(self, tokenizer, stops=()):
        self.tokenizer, self.stops = tokenizer, [s for s in stops if s]
        self.ids: list = []
        self.sent = 0  # characters of the decoded text already returned
        self.stopped = False
        self._text = ""

    @property
    def text(self) -> str:
        """The answer's text so far (cut before the stop string once one appeared)."""
        return self._text

    def _held(self, text: str) -> int:
        """How many trailing characters may still become a stop string or a character."""
        held = len(text) - len(text.rstrip(REPLACEMENT))
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:size]):
                    held = max(held, size)
                    break
        return held

    def add(self, token_id: int) -> str:
        """The new text that is safe to send after `token_id` ('' once stopped)."""
        if self.stopped:
            return ""
        self.ids.append(int(token_id))
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        start = max(self.sent - max((len(s) for s in self.stops), default=0), 0)
        hits = [i for i in (text.find(stop, start) for stop in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            text = text[:min(hits)]
            self._text = text
            return self._take(text, len(text))
        self._text = text
        return self._take(text, len(text) - self._held(text))

    def finish(self) -> str:
        """The held-back text, once no token follows."""
        return self._take(self._text, len(self._text))

    def _take(self, text: str, end: int) -> str:
        if end <= self.sent:
            return ""
        piece, self.sent = text[self.sent:end], end
        return piece


__all__ = ["TextAssembler"]
