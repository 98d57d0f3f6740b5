"""The backend boundary: one small, model-specific contract every Kipp backend implements.

A backend owns its prepared weights, activation scratch and one KV slab of physical 32-position
blocks (K and V, BF16, `[layer][block][32][8 kv heads][128]`). Everything above it (block pool,
sessions, sampling, scheduler, server) is pure Python and only ever passes `EvalItem`s in and
gets float32 logits out; no caller sees a backend array.

    backend = ReferenceBackend(open_artifact("tiny.gguf"), num_blocks=64)
    table = [5, 2]                                     # physical blocks for positions 0..63
    [logits] = backend.eval([EvalItem(tokens=(9707, 11, 1879), start_position=0,
                                      block_table=table)])
    logits.shape                                       # (1, 151936): the last token's row
    [logits] = backend.eval([EvalItem((0,), 3, table)])  # decode: appends position 3

`start_position` must equal the sequence's logical length: positions below it hold that
sequence's KV already, the item's tokens occupy the next positions. Position p lives at
`block_table[p // 32] * 32 + p % 32`, so a scrambled table must give bitwise the logits of the
identity table. A multi-item call may share weight reads between items; its results must equal
isolated calls (bitwise on the reference backend, within the gate tolerance elsewhere).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from kipp.errors import KippError
from kipp.formats.registry import VOCAB_SIZE
from kipp.probe import KernelReport

KV_BLOCK = 32  # positions per physical KV block: position p is row p % 32 of table[p // 32]


def blocks_needed(num_positions: int) -> int:
    """Blocks covering positions [0, num_positions)."""
    return -(-num_positions // KV_BLOCK)


class EvalError(KippError, ValueError):
    """An eval item the backend cannot run; nothing was evaluated or stored."""


@dataclass(frozen=True)
class EvalItem:
    """One sequence's share of an eval call."""

    tokens: tuple[int, ...]
    start_position: int  # == the sequence's logical length before this call
    block_table: tuple[int, ...]  # physical blocks covering [0, start_position + len(tokens))
    logits_rows: int = 1  # logits for the last N tokens: 1 for sampling, more for speculation
    adapter: str | None = None  # a LoRA adapter registered with the backend (add_adapter)

    def __post_init__(self):
        object.__setattr__(self, "tokens", tuple(int(t) for t in self.tokens))
        object.__setattr__(self, "block_table", tuple(int(b) for b in self.block_table))
        if not self.tokens:
            raise EvalError("an eval item needs at least one token")
        if self.start_position < 0:
            raise EvalError(f"start_position {self.start_position} is negative")
        if not 1 <= self.logits_rows <= len(self.tokens):
            raise EvalError(f"logits_rows {self.logits_rows} is outside 1..{len(self.tokens)}")
        end = self.start_position + len(self.tokens)
        if len(self.block_table) * KV_BLOCK < end:
            raise EvalError(f"block table of {len(self.block_table)} blocks covers "
                            f"{len(self.block_table) * KV_BLOCK} positions, item needs {end}")

    @property
    def end_position(self) -> int:
        return self.start_position + len(self.tokens)

    def slots(self, start: int, stop: int) -> np.ndarray:
        """Physical slab rows of positions [start, stop) through the block table."""
        positions = np.arange(start, stop)
        table = np.asarray(self.block_table, np.int64)
        return table[positions // KV_BLOCK] * KV_BLOCK + positions % KV_BLOCK


class Backend(ABC):
    """A Qwen3 implementation behind Kipp's boundary. Subclasses implement `eval`."""

    name: str = "abstract"
    # True when an item's logits are bitwise the same whatever else shares its eval call (the
    # reference's per-row arithmetic). Elsewhere a round's shape can change how a row is
    # reduced, so the scheduler gives each seeded sampled sequence an eval call of its own.
    batch_invariant: bool = False

    # True when the backend applies LoRA adapters (kipp.lora) to the items that name one
    supports_adapters: bool = False

    def __init__(self, num_blocks: int, context_length: int):
        if num_blocks < 1:
            raise EvalError(f"a backend needs at least one KV block, got {num_blocks}")
        self._num_blocks = num_blocks
        self._context_length = context_length
        self.adapters: dict = {}  # name -> kipp.lora.adapter.LoraAdapter

    def add_adapter(self, adapter) -> None:
        """Register a validated LoRA adapter (kipp.lora.adapter) under its name: items naming
        it get W x + s * B (A x) in every projection it targets."""
        if not self.supports_adapters:
            raise EvalError(f"the {self.name} backend does not apply LoRA adapters")
        if adapter.name in self.adapters:
            raise EvalError(f"an adapter named {adapter.name!r} is loaded already")
        entry = getattr(self, "entry", None)
        if entry is not None and adapter.base != entry.id:
            raise EvalError(f"adapter {adapter.name!r} was trained on {adapter.base}, not on "
                            f"{entry.id}")
        self.adapters[adapter.name] = adapter
        self._adapters_changed()

    def remove_adapter(self, name: str) -> None:
        if name not in self.adapters:
            raise EvalError(f"no adapter named {name!r} is loaded")
        del self.adapters[name]
        self._adapters_changed()

    def _adapters_changed(self) -> None:
        """A hook for backends that prepare adapters' weights in their own layout."""

    @property
    def num_blocks(self) -> int:
        """Physical 32-position KV blocks in this backend's slab."""
        return self._num_blocks

    def describe(self) -> str:
        """One line naming the backend and the path it runs (for logs and benchmarks)."""
        return self.name

    def kernel_report(self) -> KernelReport:
        """The kernels this backend probed at load: which run, which fell back to their twins
        and why (kipp.probe). Empty for a backend that runs no kernels."""
        return KernelReport()

    def check(self, items: Sequence[EvalItem]) -> None:
        """Reject, before any work, items this backend cannot run."""
        if not items:
            raise EvalError("eval needs at least one item")
        for item in items:
            if item.adapter is not None and item.adapter not in self.adapters:
                raise EvalError(f"adapter {item.adapter!r} is not loaded (loaded: "
                                f"{', '.join(sorted(self.adapters)) or 'none'})")
            bad = [t for t in item.tokens if not 0 <= t < VOCAB_SIZE]
            if bad:
                raise EvalError(f"token id {bad[0]} is outside the vocabulary 0..{VOCAB_SIZE - 1}")
            if item.end_position > self._context_length:
                raise EvalError(f"position {item.end_position - 1} is past the context length "
                                f"{self._context_length}")
            if item.end_position > self._num_blocks * KV_BLOCK:  # a table repeating a block
                raise EvalError(f"position {item.end_position - 1} is past what the KV slab "
                                f"holds ({self._num_blocks * KV_BLOCK} tokens)")
            used = item.block_table[: blocks_needed(item.end_position)]
            bad = [b for b in used if not 0 <= b < self._num_blocks]
            if bad:
                raise EvalError(f"block id {bad[0]} is outside the KV slab "
                                f"0..{self._num_blocks - 1}")

    # -- one block's KV bytes, for kipp.engine.kv_disk (backends that can set this True) ---------

    supports_kv_io: bool = False

    def kv_identity(self) -> str:
        """Everything besides the artifact and the KV scheme that makes this backend's KV bytes
        differ from another's (its numerics, the slab's byte layout): two backends whose KV can
        differ in the last bit must return different strings."""
        raise NotImplementedError(f"the {self.name} backend does not export KV blocks")

    @property
    def kv_block_bytes(self) -> int:
        """Bytes of one block's payload (every layer's K and V for 32 positions)."""
        raise NotImplementedError(f"the {self.name} backend does not export KV blocks")

    def read_blocks(self, block_ids: Sequence[int]) -> Callable[[], list[bytes]]:
        """Start copying blocks out of the slab; the returned function (called on another
        thread, at most once) gives each block's payload. The copy must not see later evals:
        take it (or dispatch it) now, before this returns."""
        raise NotImplementedError(f"the {self.name} backend does not export KV blocks")

    def write_blocks(self, block_ids: Sequence[int], payloads: Sequence[bytes]) -> None:
        """Store payloads (from read_blocks of a backend with the same kv_identity) into
        blocks; afterwards those positions read exactly as they did where they were saved."""
        raise NotImplementedError(f"the {self.name} backend does not import KV blocks")

    def _read_split_blocks(self, k_cache, v_cache, block_ids: Sequence[int]):
        """read_blocks for a backend whose K and V caches each copy one block's bytes out
        (`block_bytes`) and in (`set_block`): a payload is K's bytes, then V's."""
        payloads = [k_cache.block_bytes(b) + v_cache.block_bytes(b)
                    for b in block_ids]  # copied now: the slab is updated in place
        return lambda: payloads

    def _write_split_blocks(self, k_cache, v_cache, block_ids: Sequence[int],
                            payloads: Sequence[bytes]) -> None:
        half = self.kv_block_bytes // 2
        for b, payload in zip(block_ids, payloads):
            if len(payload) != 2 * half:
                raise EvalError(f"a KV block payload of {len(payload)} bytes, expected "
                                f"{2 * half}")
            k_cache.set_block(b, payload[:half])
            v_cache.set_block(b, payload[half:])

    @abstractmethod
    def eval(self, items: Sequence[EvalItem]) -> list[np.ndarray]:
        """Run every item; return float32 logits [item.logits_rows, 151936] per item."""
