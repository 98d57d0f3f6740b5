"""The one place JaxBackend turns eval items into device arrays: buckets and padding.

Rounds are planned by the core (kipp.engine.rounds.plan_rounds: one piece of each item per round, at
most `max_tokens` tokens), so one compiled step reads the weights once for every sequence in it.

Every array dimension is padded to a power-of-two bucket (tokens, sequences, queries per
sequence, blocks per sequence, logits rows), so a server run compiles a small bounded set of
programs: at most log2 of each limit. Steady decode of one sequence changes bucket only when its
context crosses a power of two of 32-position blocks; with Kipp's CPU attention never, its block
tables all being the pool's width (fixed_table_width).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np

from kipp.backend import KV_BLOCK, EvalItem, blocks_needed
from kipp.engine.rounds import (  # noqa: F401  (the core's planner and buckets, re-exported)
    Piece,
    bucket_size,
    plan_rounds,
)


@dataclass(frozen=True, order=True)
class Bucket:
    """The static shape of one compiled step."""

    tokens: int  # T: token rows of the round
    seqs: int  # S: sequences (pieces)
    queries: int  # Tq: query slots per sequence (the longest piece)
    blocks: int  # B: block-table width per sequence
    rows: int  # R: logits rows

    def __str__(self) -> str:
        return (f"T={self.tokens} S={self.seqs} Tq={self.queries} B={self.blocks} "
                f"R={self.rows}")


class RoundArrays(NamedTuple):
    """int32 inputs of one step (see forward.step)."""

    tokens: np.ndarray  # [T] token ids (0 for padding)
    positions: np.ndarray  # [T] positions (0 for padding)
    slots: np.ndarray  # [T] slab row block * 32 + offset to store K/V; padding: past the end
    query_index: np.ndarray  # [S, Tq] token row of each (sequence, query) slot
    query_pos: np.ndarray  # [S, Tq] position of that query; -1 for padding
    token_query: np.ndarray  # [T] flat (sequence * Tq + query) slot of each token row
    block_tables: np.ndarray  # [S, B] physical blocks (0 past a table's end: never visible)
    logit_rows: np.ndarray  # [R] token rows whose logits the step returns
    adapter_slots: np.ndarray  # [T] each token row's index into adapter_active; -1: the base
    adapter_active: np.ndarray  # [N] stacked LoRA slots the round reads (N 0: none, else a
    #                             power of two, padded by repeating the first)


def pack_round(items: Sequence[EvalItem], pieces: Sequence[Piece], num_blocks: int,
               adapter_slots: dict | None = None, table_width: int | None = None,
               ) -> tuple[Bucket, RoundArrays, list[tuple[int, int]]]:
    """The bucket, padded arrays and logits destinations [(item, row in its output)].
    `adapter_slots`: LoRA adapter name -> its slot in the step's stacked adapter weights; the
    round's adapters' slots go in adapter_active (kipp.lora.apply.round_adapters' order).
    `table_width`: every round's block tables this wide (B), whatever its context, for a step
    whose attention reads only the positions its queries see (`fixed_table_width`)."""
    n_tokens = sum(p.stop - p.start for p in pieces)
    dests, rows = [], []
    for p in pieces:
        item = items[p.item]
        first_row = len(item.tokens) - item.logits_rows
        for t in range(max(p.start, first_row), p.stop):
            dests.append((p.item, t - first_row))
    longest = max(p.stop - p.start for p in pieces)
    blocks = max(blocks_needed(items[p.item].start_position + p.stop) for p in pieces)
    if table_width is not None:
        if blocks > table_width:
            raise ValueError(f"a round needs {blocks} blocks, past its table width "
                             f"{table_width}")
        blocks = table_width
    bucket = Bucket(bucket_size(n_tokens), bucket_size(len(pieces)), bucket_size(longest),
                    bucket_size(blocks), bucket_size(max(1, len(dests))))
    a = _empty_arrays(bucket, num_blocks)
    names = list(dict.fromkeys(items[p.item].adapter for p in pieces
                               if items[p.item].adapter is not None))
    if names:
        active = [adapter_slots[n] for n in names]
        active += active[:1] * (bucket_size(len(active)) - len(active))
        a = a._replace(adapter_active=np.asarray(active, np.int32))
    row = 0
    for s, p in enumerate(pieces):
        item = items[p.item]
        n = p.stop - p.start
        positions = np.arange(item.start_position + p.start, item.start_position + p.stop)
        table = np.asarray(item.block_table[: blocks_needed(item.start_position + p.stop)])
        a.tokens[row:row + n] = item.tokens[p.start:p.stop]
        a.positions[row:row + n] = positions
        a.slots[row:row + n] = item.slots(item.start_position + p.start,
                                          item.start_position + p.stop)
        a.query_index[s, :n] = np.arange(row, row + n)
        a.query_pos[s, :n] = positions
        a.token_query[row:row + n] = s * bucket.queries + np.arange(n)
        a.block_tables[s, :len(table)] = table
        if item.adapter is not None:
            a.adapter_slots[row:row + n] = names.index(item.adapter)
        first_row = len(item.tokens) - item.logits_rows
        for t in range(max(p.start, first_row), p.stop):
            rows.append(row + t - p.start)
        row += n
    a.logit_rows[:len(rows)] = rows
    return bucket, a, dests


def fixed_table_width(num_blocks: int) -> int:
    """The block-table width of every round on a step whose attention reads a sequence's
    positions up to its queries' and no further (Kipp's CPU attention): the pool's, bucketed.
    Its steps then differ only in their token shapes, so a decode whose context crosses a power
    of two of blocks runs the program it has, where a width per context compiles one (a stall
    of most of a second on a CPU, and a few MiB resident for each program)."""
    return bucket_size(num_blocks)


def placeholder_arrays(b: Bucket, num_blocks: int) -> RoundArrays:
    """Arrays of bucket `b` that evaluate nothing (every slot dropped): for compiling ahead."""
    return _empty_arrays(b, num_blocks)


def _empty_arrays(b: Bucket, num_blocks: int) -> RoundArrays:
    i32 = np.int32
    return RoundArrays(
        tokens=np.zeros(b.tokens, i32),
        positions=np.zeros(b.tokens, i32),
        slots=np.full(b.tokens, num_blocks * KV_BLOCK, i32),  # out of range: the store drops it
        query_index=np.zeros((b.seqs, b.queries), i32),
        query_pos=np.full((b.seqs, b.queries), -1, i32),
        token_query=np.zeros(b.tokens, i32),
        block_tables=np.zeros((b.seqs, b.blocks), i32),
        logit_rows=np.zeros(b.rows, i32),
        adapter_slots=np.full(b.tokens, -1, i32),
        adapter_active=np.zeros(0, i32),
    )
