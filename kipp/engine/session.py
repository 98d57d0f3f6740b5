"""Sessions: one sequence's timeline over the shared KV block pool.

A session holds the tokens it has evaluated and its block table. It allocates private blocks
as it grows, can adopt published blocks for a matching prompt prefix (then, privately, a cached
block holding the prompt's next tokens: kipp.engine.blocks' tails), truncates back to a prefix
(speculative rollback) and, when closed, publishes its full blocks and its partial last one so
later sessions can adopt them. Every method either completes or leaves the session exactly as
it was.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np

from kipp.backend import KV_BLOCK, EvalItem, blocks_needed
from kipp.display import count, html_view, text_view
from kipp.engine.blocks import BlockPool, Reservation
from kipp.errors import KippError
from kipp.formats.registry import Checkpoint


class SessionOwner(Protocol):
    """What a session needs of its model (kipp.model.Model): sessions never import the model."""

    entry: Checkpoint
    pool: BlockPool

    def check_tokens(self, tokens: Sequence[int]) -> list[int]: ...

    def eval_batch(self, requests) -> list[np.ndarray]: ...

    def adapter_salt(self, adapter: str | None) -> bytes: ...


class SessionError(KippError, ValueError):
    """A session call with bad arguments; the session is unchanged."""


class Session:
    """One sequence on a model. Use as a context manager, or call close() when done."""

    def __init__(self, model: SessionOwner, capacity: int | None = None,
                 reservation: Reservation | None = None, adapter: str | None = None):
        context = model.entry.context_length
        capacity = context if capacity is None else capacity
        if not 1 <= capacity <= context:
            raise SessionError(f"capacity {capacity} is outside 1..{context}, the context length "
                               f"of {model.entry.id}")
        # the LoRA adapter every eval of this session runs under (None: the base weights);
        # its salt keys the blocks it publishes and adopts (kipp.engine.blocks)
        self.salt = model.adapter_salt(adapter)
        self.adapter = adapter
        self.model = model
        self.capacity = capacity
        self.tokens: list[int] = []
        self.block_table: list[int] = []
        self.shared_blocks = 0  # leading blocks adopted from the pool: full and immutable
        # Blocks promised to this session's request at admission (the scheduler's): growth
        # draws from it and released blocks are credited back, so a running sequence never
        # competes with the headroom that admission hands out.
        self.reservation = reservation
        self.closed = False

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __len__(self) -> int:
        return len(self.tokens)

    def _display_rows(self) -> list[tuple[str, str]]:
        shared = f" ({self.shared_blocks} adopted from the pool)" if self.shared_blocks else ""
        return [("state", "closed" if self.closed else "open"),
                ("adapter", self.adapter or "none (base weights)"),
                ("length", f"{self.length:,} of {self.capacity:,} tokens (capacity)"),
                ("blocks", f"{count(len(self.block_table), 'block')} ({KV_BLOCK} tokens each)"
                           f"{shared}")]

    def __repr__(self) -> str:
        return text_view("kipp.Session", self._display_rows())

    def _repr_html_(self) -> str:
        return html_view("kipp.Session", self._display_rows())

    @property
    def length(self) -> int:
        return len(self.tokens)

    @property
    def remaining(self) -> int:
        return self.capacity - len(self.tokens)

    def item(self, tokens: Sequence[int], logits_rows: int = 1) -> EvalItem:
        """Reserve blocks for `tokens` and describe them as an EvalItem (see Model.eval_batch)."""
        self._check_open()
        tokens = self.model.check_tokens(tokens)
        if len(tokens) > self.remaining:
            raise SessionError(f"{len(tokens)} tokens do not fit: the session holds "
                               f"{self.length} of its capacity {self.capacity}")
        if not 1 <= logits_rows <= len(tokens):
            raise SessionError(f"logits_rows {logits_rows} is outside 1..{len(tokens)}")
        self._grow(self.length + len(tokens))
        return EvalItem(tuple(tokens), self.length, tuple(self.block_table), logits_rows,
                        self.adapter)

    def commit(self, item: EvalItem) -> None:
        """Record an evaluated item's tokens as part of the timeline."""
        self.tokens.extend(item.tokens)

    def abandon(self) -> None:
        """Undo `item` after a failed eval: release blocks past the current length."""
        self._shrink_table(blocks_needed(self.length))

    def eval(self, tokens: Sequence[int], logits_rows: int = 1) -> np.ndarray:
        """Append `tokens` and return float32 logits [logits_rows, 151936] of the last rows."""
        [logits] = self.model.eval_batch([(self, tokens, logits_rows)])
        return logits

    def match_prefix(self, tokens: Sequence[int]) -> int:
        """Adopt published blocks covering a prefix of `tokens`; return the tokens adopted.

        Only on an empty session. The full blocks are shared; a cached block that continues
        them (a finished sequence's last one) is taken over privately for the tokens it agrees
        on (BlockPool.match_tail). At least one token is always left to evaluate, so the caller
        gets logits for the prompt's last token. The caller then evals tokens[adopted:].
        """
        self._check_open()
        if self.tokens:
            raise SessionError("match_prefix needs an empty session")
        tokens = self.model.check_tokens(tokens)
        usable = min(len(tokens) - 1, self.capacity)
        pool = self.model.pool
        blocks = pool.match_prefix(tokens, max_blocks=usable // KV_BLOCK, salt=self.salt)
        # kipp.engine.kv_disk: the blocks after (its keys are unsalted: base sessions only)
        disk = None if self.salt else getattr(self.model, "kv_disk", None)
        if disk is not None and len(blocks) < usable // KV_BLOCK:
            try:
                blocks = disk.extend(tokens, blocks, usable // KV_BLOCK)
            except BaseException:
                pool.release(blocks)
                raise
        self.block_table = list(blocks)
        self.shared_blocks = len(blocks)
        tail, n = pool.match_tail(tokens, blocks, usable - len(blocks) * KV_BLOCK, self.salt)
        if tail is None and disk is not None and len(blocks) == usable // KV_BLOCK:
            try:
                tail, n = disk.tail(tokens, blocks, usable - len(blocks) * KV_BLOCK)
            except BaseException:
                self.block_table, self.shared_blocks = [], 0
                pool.release(blocks)
                raise
        if tail is not None:
            self.block_table.append(tail)
        self.tokens = list(tokens[: len(blocks) * KV_BLOCK + n])
        return len(self.tokens)

    def truncate(self, length: int) -> None:
        """Keep only the first `length` tokens (speculative rollback)."""
        self._check_open()
        if not 0 <= length <= self.length:
            raise SessionError(f"cannot truncate to {length}: the session holds {self.length}")
        kept_shared = length // KV_BLOCK
        if length % KV_BLOCK and kept_shared < self.shared_blocks:
            self._rebuild_partial_shared_block(length)
            return
        self.tokens = self.tokens[:length]
        self._shrink_table(blocks_needed(length))

    def _rebuild_partial_shared_block(self, length: int) -> None:
        """Shared blocks are immutable: re-evaluate the kept part of one in a private block."""
        kept = length // KV_BLOCK
        tail = self.tokens[kept * KV_BLOCK:length]
        self.tokens = self.tokens[: kept * KV_BLOCK]
        self._shrink_table(kept)
        self.eval(tail)

    def reset(self) -> None:
        """Forget every token and release every block (nothing is published)."""
        self._check_open()
        self.tokens = []
        self._shrink_table(0)

    def close(self, publish: bool = True) -> None:
        """Publish the full blocks (so other sessions can adopt them) and release all blocks."""
        if self.closed:
            return
        if publish and self.tokens:
            self.model.pool.publish(self.tokens, self.block_table, tail=True, salt=self.salt)
        self.tokens = []
        self._shrink_table(0)
        self.closed = True

    def _check_open(self) -> None:
        if self.closed:
            raise SessionError("the session is closed")

    def _grow(self, positions: int) -> None:
        need = blocks_needed(positions) - len(self.block_table)
        if need > 0:
            self.block_table.extend(self.model.pool.allocate(need, self.reservation))

    def _shrink_table(self, keep: int) -> None:
        dropped = self.block_table[keep:]
        if dropped:
            self.model.pool.release(dropped, self.reservation)
        del self.block_table[keep:]
        self.shared_blocks = min(self.shared_blocks, keep)
