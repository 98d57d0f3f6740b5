"""Token to text, once for every caller: what happens to a choice's token after it is picked.

    output = ChoiceOutput(index, tokenizer, stop_ids, patterns, max_tokens, logprobs, put)
    reason = output.accept(token, logits)     # None: go on; else the choice has finished

In order: a stop id ends the choice without text; the grammar consumes the token; its logprob
is recorded; the detokenizer turns it into text, held back while it could still become a stop
string; a stop string, max_tokens or a complete grammar ends the choice, and whatever text is
held back is flushed. Text leaves as Delta events carrying the token ids (and logprobs) that
made it, so a stop string's own tokens are never reported.

With a ThinkTracker (a chat request that splits its reasoning) the think tags make no text,
the reasoning leaves as Part.REASONING deltas without the newlines at its edges, and only the
answer goes through the stop strings: they apply to the answer.
"""

from __future__ import annotations

from typing import Callable, Collection

import numpy as np

from kipp.engine.requests import Delta, Event, Finished, FinishReason, TokenLogprob
from kipp.text.grammar import Matcher
from kipp.text.reasoning import EdgeTrim, Part, ThinkState, ThinkTracker
from kipp.text.sampling import logprobs
from kipp.text.stops import StopPatterns, StopStrings
from kipp.text.tokenizer import StreamingDetokenizer


class ChoiceOutput:
    """One choice's emitted tokens, text and end (module docstring)."""

    def __init__(self, index: int, tokenizer, stop_ids: Collection[int], stops: StopPatterns,
                 max_tokens: int, top_logprobs: int | None, put: Callable[[Event], None],
                 matcher: Matcher | None = None, think: ThinkTracker | None = None):
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
        self.think = think
        self.split = think is not None and think.reasoning.split
        self.part = Part.CONTENT
        self._edges = {Part.REASONING: EdgeTrim(trailing=True),
                       Part.CONTENT: EdgeTrim(trailing=False)} if self.split else None

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
        part = self.think.see(token) if self.think is not None else Part.CONTENT
        if self.split and part is not Part.CONTENT:
            stopped = self._reasoning(token, part)
        else:
            text = self.detok.push(token)
            if self.split:
                self.part = Part.CONTENT
                text = self._edges[Part.CONTENT].feed(text)
            text, stopped = self.stops.feed(text)
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

    def _reasoning(self, token: int, part: Part | None) -> bool:
        """A reasoning token (part REASONING) or a think tag (None): its text, if any, goes out
        as reasoning; a tag ends the held text's part. Never a stop."""
        if part is Part.REASONING:
            self.part = Part.REASONING
            text = self._edges[Part.REASONING].feed(self.detok.push(token))
            if text:
                self._emit(text)
            return False
        tail = self.detok.flush()  # a tag: the text before it is complete
        text = self._edges[self.part].feed(tail) if tail else ""
        if self.think.state is ThinkState.INSIDE:
            self.part = Part.REASONING  # the open tag belongs to the reasoning it starts
        if text or self._held:
            self._emit(text)
        return False

    def finish(self, reason: FinishReason) -> FinishReason:
        """End the choice: flush the held-back text and report why."""
        if not self.stops.stopped:
            tail = self.detok.flush()
            if self.split:
                tail = self._edges[self.part].feed(tail) if tail else ""
            if self.part is Part.CONTENT:
                tail = self.stops.flush(tail)
            if tail or self._held:
                self._emit(tail)
        self.reason = reason
        self._put(Finished(self.index, reason, self.stops.hit))
        return reason

    def _emit(self, text: str) -> None:
        self._put(Delta(self.index, text, tuple(self._held), tuple(self._held_logprobs),
                        self.part))
        self._held, self._held_logprobs = [], []
