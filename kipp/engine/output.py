"""Token to text, once for every caller: what happens to a choice's token after it is picked.

    output = ChoiceOutput(index, tokenizer, stop_ids, patterns, max_tokens, logprobs, put)
    reason = output.accept(token, logits)     # None: go on; else the choice has finished

In order: a stop id ends the choice without text; the grammar consumes the token; its logprob
is recorded; the detokenizer turns it into text, held back while it could still become a stop
string; a stop string, max_tokens or a complete grammar ends the choice, and whatever text is
held back is flushed. Text leaves as Delta events carrying the token ids (and logprobs) that
made it, so a stop string's own tokens are never reported.
"""

from __future__ import annotations

from typing import Callable, Collection

import numpy as np

from kipp.engine.requests import Delta, Event, Finished, FinishReason, TokenLogprob
from kipp.text.grammar import Matcher
from kipp.text.sampling import logprobs
from kipp.text.stops import StopPatterns, StopStrings
from kipp.text.tokenizer import StreamingDetokenizer


class ChoiceOutput:
    """One choice's emitted tokens, text and end (module docstring)."""

    def __init__(self, index: int, tokenizer, stop_ids: Collection[int], stops: StopPatterns,
                 max_tokens: int, top_logprobs: int | None, put: Callable[[Event], None],
                 matcher: Matcher | None = None):
        self.index = index
        self.stop_ids = stop_ids
        self.max_tokens = max_tokens
        self.top_logprobs = top_logprobs
        self.matcher = matcher
        self._put = put
        self.detok = StreamingDetokenizer(tokenizer)
        self.stops = StopStrings(stops)
        self.generated: list[int] = []
        self.picked = 0  # tokens accepted, stop tokens included
        self.reason: FinishReason | None = None
        self._held: list[int] = []  # tokens whose text the stop check still holds back
        self._held_logprobs: list[TokenLogprob] = []

    def accept(self, token: int, logits: np.ndarray) -> FinishReason | None:
        """Take one picked token (from `logits`); the reason if the choice ends with it."""
        self.picked += 1
        if token in self.stop_ids:
            return self.finish(FinishReason.STOP)
        if self.matcher is not None:
            self.matcher.consume(token)
        self.generated.append(token)
        self._held.append(token)
        if self.top_logprobs is not None:
            lp, top = logprobs(logits, token, self.top_logprobs)
            self._held_logprobs.append(TokenLogprob(token, lp, tuple(top)))
        text, stopped = self.stops.feed(self.detok.push(token))
        if text:
            self._emit(text)
        if stopped:
            self._held, self._held_logprobs = [], []  # they became the stop string
            return self.finish(FinishReason.STOP)
        if len(self.generated) == self.max_tokens:
            return self.finish(FinishReason.LENGTH)
        if self.matcher is not None and self.matcher.complete:
            return self.finish(FinishReason.STOP)  # only a stop token could follow
        return None

    def finish(self, reason: FinishReason) -> FinishReason:
        """End the choice: flush the held-back text and report why."""
        if not self.stops.stopped:
            tail = self.stops.flush(self.detok.flush())
            if tail or self._held:
                self._emit(tail)
        self.reason = reason
        self._put(Finished(self.index, reason))
        return reason

    def _emit(self, text: str) -> None:
        self._put(Delta(self.index, text, tuple(self._held), tuple(self._held_logprobs)))
        self._held, self._held_logprobs = [], []
