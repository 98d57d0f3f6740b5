"""Stop strings: cut generated text at the first stop string, holding back what could become one.

    patterns = StopPatterns(["\\n\\n", "User:"])      # compiled once per request, shared
    stops = StopStrings(patterns)                     # one per sequence
    text, stopped = stops.feed(detokenized_piece)    # text is safe to emit now
    tail = stops.flush()                              # at the end: whatever was held back

Streamed text is held back while its end could still start a stop string, and released as soon
as it cannot. The check runs per token on the engine thread, so its cost must not grow with the
stop strings: each is compiled once (a Knuth-Morris-Pratt failure table), each sequence keeps per
stop string how many of its characters the text ends with (amortised O(1) per character), and
held-back text stays in the pieces it arrived in, so a release copies only what it releases.

The cut is at the stop string that ends first in the text (the longest one if several end at
the same character), so the result does not depend on how the text was split into pieces.
"""

from __future__ import annotations

from array import array
from collections import deque
from typing import Sequence

from kipp.errors import KippError


class StopError(KippError, ValueError):
    """Stop strings that are not a list of non-empty strings."""


def _failure(stop: str) -> array:
    """KMP failure table: f[i] = length of the longest proper prefix of stop[:i+1] that is also
    its suffix."""
    f = array("i", [0]) * len(stop)
    k = 0
    for i in range(1, len(stop)):
        k = f[i] = _step(stop, f, k, stop[i])
    return f


def _step(stop: str, table: array, q: int, c: str) -> int:
    """The matched length after character c, from q matched (StopStrings._advance inlines this:
    it runs per character of every token)."""
    while q and stop[q] != c:
        q = table[q - 1]
    return q + 1 if stop[q] == c else q


class StopPatterns:
    """Stop strings compiled for matching; immutable, so one request's choices share them."""

    def __init__(self, stops: Sequence[str]):
        stops = list(stops)
        for s in stops:
            if not isinstance(s, str) or not s:
                raise StopError("stop strings must be non-empty strings")
        self.stops = tuple(stops)
        self.tables = tuple(_failure(s) for s in self.stops)

    def __len__(self) -> int:
        return len(self.stops)


class StopStrings:
    """Holds back streamed text while it could still become a stop string (one sequence)."""

    def __init__(self, stops: "StopPatterns | Sequence[str]"):
        self.patterns = stops if isinstance(stops, StopPatterns) else StopPatterns(stops)
        self.matched = [0] * len(self.patterns)  # per stop: characters the text ends with
        self._held: deque[str] = deque()  # text not yet emitted, in the pieces it came in
        self._held_len = 0
        self.stopped = False

    @property
    def pending(self) -> str:
        """The text held back now."""
        return "".join(self._held)

    @property
    def hit(self) -> str | None:
        """The stop string that ended the text (the longest, when several end together)."""
        if not self.stopped:
            return None
        return max((s for s, q in zip(self.patterns.stops, self.matched) if q == len(s)),
                   key=len)

    def feed(self, text: str) -> tuple[str, bool]:
        """Return (text safe to emit now, whether a stop string was reached)."""
        if not self.patterns.stops:
            return text, False
        if not text:
            return "", False
        end = self._advance(text)
        if end is not None:  # a stop string ends at text[end - 1]: emit what precedes it
            length = max(len(s) for s, q in zip(self.patterns.stops, self.matched)
                         if q == len(s))
            emit = (self.pending + text[:end])[: self._held_len + end - length]
            self._held.clear()
            self._held_len, self.stopped = 0, True
            return emit, True
        self._held.append(text)
        self._held_len += len(text)
        return self._release(self._held_len - max(self.matched)), False

    def flush(self, text: str = "") -> str:
        """Everything still held back (after feeding `text`): the sequence has ended."""
        emit, stopped = self.feed(text)
        if stopped:
            return emit
        emit += self.pending
        self._held.clear()
        self._held_len = 0
        return emit

    def _advance(self, text: str) -> int | None:
        """Run the matchers over text; the index just past the first stop string's end, if
        one ends in it (self.matched then says which)."""
        after = []
        for stop, table, q in zip(self.patterns.stops, self.patterns.tables, self.matched):
            n = len(stop)
            for i, c in enumerate(text):
                while q and stop[q] != c:
                    q = table[q - 1]
                if stop[q] == c:
                    q += 1
                    if q == n:
                        return self._stop_at(text, i + 1)
            after.append(q)
        self.matched = after
        return None

    def _stop_at(self, text: str, limit: int) -> int:
        """Some stop string ends within text[:limit]: rerun every matcher on that prefix from
        the saved state, character by character, to find the first end (ties: all recorded)."""
        stops, tables = self.patterns.stops, self.patterns.tables
        states = list(self.matched)
        for i in range(limit):
            c = text[i]
            hit = False
            for j, (stop, table) in enumerate(zip(stops, tables)):
                states[j] = q = _step(stop, table, states[j], c)
                hit = hit or q == len(stop)
            if hit:
                self.matched = states
                return i + 1
        raise AssertionError("a stop string ended but the rerun found none")  # unreachable

    def _release(self, count: int) -> str:
        """Pop `count` characters from the front of the held text."""
        out = []
        while count > 0:
            piece = self._held[0]
            if len(piece) <= count:
                out.append(self._held.popleft())
                count -= len(piece)
            else:
                out.append(piece[:count])
                self._held[0] = piece[count:]
                count = 0
        released = "".join(out)
        self._held_len -= len(released)
        return released
