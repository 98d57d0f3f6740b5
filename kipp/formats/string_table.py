"""StringTable: a read-only sequence of strings kept as one UTF-8 blob and their end offsets.

A vocabulary and its merges are about 300,000 short strings, and as Python objects they take
about 22 MiB (a str's header is 49 to 74 bytes; Qwen3's texts average 9 and 10 bytes). As one
blob they take the bytes of the text and eight bytes of offset a string, and every string is
decoded when it is read.
GGUF string arrays (kipp.formats.gguf) and the tokenizer's data (kipp.text.vocab) hold them so.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from operator import index

import numpy as np

_CONTINUATION_MASK, _CONTINUATION = 0xC0, 0x80  # UTF-8 bytes 10xxxxxx


class StringTable(Sequence):
    """Strings i = blob[ends[i - 1]:ends[i]] (ends[-1] == len(blob)), decoded on read. Equal to
    any sequence of the same strings; hashable, as a tuple of strings is."""

    __slots__ = ("_blob", "_ends", "_hash")

    def __init__(self, blob: bytes, ends: np.ndarray):
        """`blob` must be valid UTF-8 cut at character boundaries by `ends` (ascending, the last
        len(blob)); `bad_utf8` says which string breaks that. Use `of` from strings."""
        ends = np.asarray(ends, np.int64)
        if ends.ndim != 1 or (len(ends) and ends[-1] != len(blob)) or (not len(ends) and blob):
            raise ValueError("a StringTable's offsets must end at the blob's length")
        if np.any(np.diff(ends, prepend=0) < 0):
            raise ValueError("a StringTable's offsets must not decrease")
        self._blob = bytes(blob)
        self._ends = ends
        self._hash = None

    @classmethod
    def of(cls, strings: Iterable[str]) -> "StringTable":
        if isinstance(strings, StringTable):
            return strings
        encoded = []
        for s in strings:
            if not isinstance(s, str):
                raise TypeError(f"a StringTable holds str, not {type(s).__name__}")
            encoded.append(s.encode("utf-8"))
        ends = np.cumsum([len(e) for e in encoded], dtype=np.int64)
        return cls(b"".join(encoded), ends)

    def __len__(self) -> int:
        return len(self._ends)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return tuple(self[j] for j in range(*i.indices(len(self))))
        i = index(i)
        n = len(self._ends)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"string {i} is outside a table of {n}")
        start = int(self._ends[i - 1]) if i else 0
        return self._blob[start:int(self._ends[i])].decode("utf-8")

    def __iter__(self) -> Iterator[str]:
        # one decode, then slices of the text: a character ends where its byte offset less the
        # continuation bytes before it says
        text = self._blob.decode("utf-8")
        raw = np.frombuffer(self._blob, np.uint8)
        continuations = np.cumsum((raw & _CONTINUATION_MASK) == _CONTINUATION, dtype=np.int64)
        ends = self._ends - np.concatenate(([0], continuations))[self._ends]
        start = 0
        for end in ends.tolist():
            yield text[start:end]
            start = end

    def __eq__(self, other) -> bool:
        if isinstance(other, StringTable):
            return self._blob == other._blob and np.array_equal(self._ends, other._ends)
        if isinstance(other, (tuple, list)):
            return len(other) == len(self) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __hash__(self) -> int:
        # the tuple's own hash: a table equals the tuple of its strings, so must hash as it
        if self._hash is None:
            self._hash = hash(tuple(self))
        return self._hash

    def __repr__(self) -> str:
        shown = ", ".join(repr(s) for s in self[:3])
        return f"StringTable([{shown}{', ...' if len(self) > 3 else ''}], {len(self)} strings)"


def bad_utf8(blob: bytes, ends: np.ndarray) -> tuple[int, str] | None:
    """(index, reason) of a string of a would-be table that is not valid UTF-8 on its own, or
    None. The blob is decoded once; a string then is valid exactly when the blob is and
    no string starts inside another's character (on a continuation byte)."""
    ends = np.asarray(ends, np.int64)
    starts = np.concatenate(([0], ends[:-1])) if len(ends) else ends
    try:
        bytes(blob).decode("utf-8")
    except UnicodeDecodeError as e:
        return int(np.searchsorted(ends, e.start, side="right")), e.reason
    raw = np.frombuffer(blob, np.uint8)
    first_bytes = raw[np.minimum(starts, max(len(raw) - 1, 0))] if len(raw) else starts
    cut = np.flatnonzero((starts < ends) &
                         ((first_bytes & _CONTINUATION_MASK) == _CONTINUATION))
    if len(cut):
        return int(cut[0]), "starts inside a character"
    return None
