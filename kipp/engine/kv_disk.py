"""The KV disk tier bound to a model: a prefix survives restarts and outgrows the RAM pool.

    tier = kv_files.DiskTier(folder, namespace, block_bytes, limit_bytes)
    disk = KVDisk(tier, backend, pool)     # hooks pool.publish: new blocks are written behind
    table = disk.extend(tokens, table, limit)   # after pool.match_prefix: blocks from disk
    block, n = disk.tail(tokens, table, limit)  # then the cached partial block, if any

The files themselves (format, checks, writer, eviction) are kipp.engine.kv_files. A repeated
prompt after a restart evaluates only its last token, as it would in RAM: its full blocks and
its tail come from disk.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
from typing import Sequence

from kipp.backend import KV_BLOCK
from kipp.engine.blocks import block_hash
from kipp.engine.kv_files import READ_AHEAD, DiskTier

log = logging.getLogger("kipp.kv_disk")


@functools.cache
def _ahead() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kipp-kv-ahead")


class KVDisk:
    """The tier bound to one model's backend and pool: writes what the pool publishes, and
    restores a prompt's next blocks before prefill."""

    def __init__(self, tier: DiskTier, backend, pool):
        self.tier, self.backend, self.pool = tier, backend, pool
        self.restored_tokens = 0
        pool.on_publish = self._published
        pool.on_tail = self._tail_published

    def _tail_published(self, block: int, parent: bytes | None, tokens: tuple[int, ...]):
        """A finished sequence's partial last block: written under its parent's tail name,
        so a repeated prompt after a restart evaluates only its last token, as in RAM."""
        if self.tier.limit < self.tier.file_bytes or self.tier.tail_tokens(parent) == tokens:
            return  # no room, or this very tail is there already (a repeated prompt's)
        if not self.tier.admits(1):
            return
        try:
            fetch = self.backend.read_blocks([block])
        except Exception as e:
            log.warning("KV tail not written: %s", e)
            self.tier.counters["write_errors"] += 1
            return
        self.tier.submit([(parent or b"", tokens)], fetch)

    def _published(self, entries: list[tuple[int, bytes, tuple[int, ...]]]) -> None:
        """New pool publications (block, digest, tokens): their KV is read off the backend
        now (an async gather where the backend can) and written by the writer thread."""
        new = [e for e in entries if not self.tier.has(e[1])]
        if not new:
            return
        if self.tier.limit < self.tier.file_bytes or not self.tier.admits(len(new)):
            return
        try:
            fetch = self.backend.read_blocks([b for b, _, _ in new])
        except Exception as e:
            log.warning("KV blocks not written: %s", e)
            self.tier.counters["write_errors"] += len(new)
            return
        self.tier.submit([(d, t) for _, d, t in new], fetch)

    def extend(self, tokens: Sequence[int], table: list[int], limit: int) -> list[int]:
        """`table` (the pool's match for `tokens`) extended by the next blocks found on disk,
        up to `limit` blocks: allocated, filled and published in the pool, held by the caller.
        Leaves the pool unchanged (returns `table`) when nothing can be restored."""
        room = self.pool.num_available - self.pool.reserved
        stop = min(limit, len(table) + room)
        if stop <= len(table):
            return table
        new: list[int] = []

        def read(at: int):
            return self.tier.read_run(tokens, at, min(stop, at + READ_AHEAD))

        pending = _ahead().submit(read, len(table))
        try:
            # READ_AHEAD blocks at a time: the next run is read and checked on another thread
            # while the backend imports this one (a single-threaded copy on a CPU backend)
            for at in range(len(table), stop, READ_AHEAD):
                payloads, pending = pending.result(), None
                whole = len(payloads) == min(stop - at, READ_AHEAD)
                if whole and at + READ_AHEAD < stop:
                    pending = _ahead().submit(read, at + READ_AHEAD)
                if payloads:
                    blocks = self.pool.allocate(len(payloads))
                    new += blocks
                    self.backend.write_blocks(blocks, payloads)
                if not whole:
                    break
            if not new:
                return table
            full = list(table) + new
            self.pool.publish(tokens[:len(full) * KV_BLOCK], full)
        except BaseException:
            if pending is not None and not pending.cancel():
                concurrent.futures.wait([pending])  # no read left running behind the caller
            self.pool.release(new)
            raise
        self.restored_tokens += len(new) * KV_BLOCK
        return full

    def tail(self, tokens: Sequence[int], table: list[int], limit: int) -> tuple[int | None, int]:
        """After `table` (every full block of the prompt it can hold), the cached partial block
        on disk that continues it, as BlockPool.match_tail: (a private block of the caller,
        the n <= limit tokens it agrees on), or (None, 0)."""
        parent = None
        for i in range(len(table)):
            parent = block_hash(parent, tokens[i * KV_BLOCK:(i + 1) * KV_BLOCK])
        start = len(table) * KV_BLOCK
        want = tuple(tokens[start:start + min(limit, KV_BLOCK - 1)])
        if not want or self.pool.num_available - self.pool.reserved < 1:
            return None, 0
        found = self.tier.read_tail(parent)
        if found is None:
            return None, 0
        payload, have = found
        n = 0
        for x, y in zip(have, want):
            if x != y:
                break
            n += 1
        if not n:
            return None, 0
        [block] = self.pool.allocate(1)
        try:
            self.backend.write_blocks([block], [payload])
        except BaseException:
            self.pool.release([block])
            raise
        self.restored_tokens += n
        return block, n

    def stats(self) -> dict:
        return dict(self.tier.stats(), restored_tokens=self.restored_tokens)

    def describe(self) -> str:
        s = self.tier.stats()
        return (f"{s['files']:,} blocks, {s['used_bytes'] / 2**20:,.1f} of "
                f"{s['limit_bytes'] / 2**20:,.0f} MiB in {self.tier.root}")
