"""Round planning, shared by every batched backend: how an eval call's items become rounds.

An eval call runs as rounds. A round holds at most one contiguous piece of each item (a prefill
chunk or a decode token), `max_tokens` tokens in all, so one step reads the weights once for
every sequence in it. A piece's tokens must follow its item's earlier pieces, so an item longer
than the budget continues in the next round. Each backend turns a round's pieces into its own
arrays (kipp.cuda.rounds pads them into shape buckets; kipp.apple.backend packs them as-is).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from kipp.backend import EvalItem


def bucket_size(n: int) -> int:
    """The power of two at or above n (n >= 1): the token counts a compiled round is padded to
    (kipp.cuda.rounds), and the row counts the speculation gates time (kipp.engine.spec)."""
    return 1 << max(0, n - 1).bit_length()


@dataclass(frozen=True)
class Piece:
    item: int  # index into the eval call's items
    start: int  # first token of the item in this piece
    stop: int


def plan_rounds(items: Sequence[EvalItem], max_tokens: int) -> list[list[Piece]]:
    """Split items into rounds of at most `max_tokens` tokens, one piece per item per round."""
    done = [0] * len(items)
    rounds = []
    while any(d < len(item.tokens) for d, item in zip(done, items)):
        budget, pieces = max_tokens, []
        # shortest remainder first: decode tokens never wait behind a long prefill
        order = sorted(range(len(items)), key=lambda i: len(items[i].tokens) - done[i])
        for i in order:
            item = items[i]
            take = min(len(item.tokens) - done[i], budget)
            if take > 0:
                pieces.append(Piece(i, done[i], done[i] + take))
                done[i] += take
                budget -= take
        rounds.append(pieces)
    return rounds
