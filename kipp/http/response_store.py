"""The Responses API's stored responses: what `store`, `previous_response_id` and
GET / DELETE /v1/responses/{id} read, held in memory and bounded (least recently used first
out).

    store = ResponseStore(max_entries=1024, max_chars=64 << 20)
    store.put(StoredResponse(response, conversation))
    store.get(response_id)         # the StoredResponse, or None
    store.delete(response_id)      # whether it was there

Each entry keeps the response object (what GET answers) and the whole conversation up to and
including its own reply as chat messages, without the request's instructions (which the
Responses API does not carry over), so that a continuation renders those messages again and
the scheduler's prefix cache finds the earlier prompt. Waitress runs handlers on threads: every
method takes the one lock.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

DEFAULT_MAX_ENTRIES = 1024
# A chain of continuations shares its message dicts, but each entry is charged its whole
# conversation: the bound then holds however the sharing is broken by evictions.
DEFAULT_MAX_CHARS = 64 << 20


@dataclass(frozen=True)
class StoredResponse:
    response: dict  # the response object, as POST answered it
    conversation: tuple[dict, ...]  # chat messages, the reply's own included
    chars: int = field(default=0, compare=False)  # what the entry is charged against the bound

    @property
    def id(self) -> str:
        return self.response["id"]


class ResponseStore:
    """A thread-safe LRU of StoredResponses, bounded by count and by characters of JSON."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES,
                 max_chars: int = DEFAULT_MAX_CHARS):
        if max_entries < 1 or max_chars < 1:
            raise ValueError("a response store holds at least one entry and one character")
        self.max_entries, self.max_chars = max_entries, max_chars
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()

    def put(self, entry: StoredResponse) -> None:
        """Keep `entry` (replacing one of the same id), evicting the least recently used
        entries past the bounds. An entry larger than the whole bound is not kept."""
        chars = _size(entry)
        entry = StoredResponse(entry.response, tuple(entry.conversation), chars)
        with self._lock:
            self._drop(entry.id)
            if chars > self.max_chars:
                return
            self._entries[entry.id] = entry
            self._chars += chars
            while len(self._entries) > self.max_entries or self._chars > self.max_chars:
                self._drop(next(iter(self._entries)))

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is not None:
                self._entries.move_to_end(response_id)
            return entry

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._drop(response_id)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def _drop(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self._chars -= entry.chars
        return True


def _size(entry: StoredResponse) -> int:
    return len(json.dumps(entry.response)) + len(json.dumps(list(entry.conversation)))
