"""A request's answer as text while it grows: stop strings and what is safe to stream.

Between chunks the slot engine hands each request its new token ids; the whole answer is
decoded again (a piece ending inside a multi-byte character decodes differently once the
character is complete, so text is only ever extended, never re-sent) and searched for the
stop strings. The last len(longest stop) - 1 characters are held back until the answer
ends: they might be the start of a stop string that the next chunk completes.
"""

from __future__ import annotations


class AnswerText:
    """Incremental text of one answer. `update(ids)` -> (new text to send, stopped)."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tok, self.stop = tokenizer, tuple(stop)
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""  # the answer so far (cut before a stop string once one is found)
        self.sent = ""  # the prefix of it streamed out
        self.stop_at_token: int | None = None  # tokens kept when a stop string ended it

    def _find_stop(self, text: str) -> int | None:
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def update(self, ids: list[int], final: bool = False) -> tuple[str, bool]:
        """The answer is now `ids` (final: it ended) -> (text to stream now, a stop string
        was found: the answer ends here)."""
        text = self.tok.decode(ids)
        cut = self._find_stop(text)
        if cut is not None:
            text = text[:cut]
            self.stop_at_token = self._tokens_for(ids, cut)
        self.text = text
        ready = text if (final or cut is not None) else text[:max(len(text) - self.hold, 0)]
        delta = ""
        if ready.startswith(self.sent) and len(ready) > len(self.sent):
            delta, self.sent = ready[len(self.sent):], ready
        return delta, cut is not None

    def _tokens_for(self, ids: list[int], chars: int) -> int:
        """The fewest leading tokens whose text reaches `chars` characters (the token that
        completes the text before the stop string)."""
        for n in range(len(ids) + 1):
            if len(self.tok.decode(ids[:n])) >= chars:
                return n
        return len(ids)
