"""The KV block pool: which physical 32-position blocks of the KV slab each sequence uses.

    session A  table [7, 2, 9]      tokens 0..31 -> block 7, 32..63 -> 2, 64..70 -> 9 (private)
    session B  table [7, 2, 4]      adopted A's published blocks 7 and 2, then its own block 4
    pool       7, 2: in use (ref 2), published   9, 4: in use (ref 1)   the rest: free or cached

A block is free, in use (refcount > 0), or evictable (published, unreferenced, kept in LRU order
until its slot is needed). A full block is published under a key chaining its parent's digest
with its 32 token ids; a hit is trusted only when the tokens and the parent publication match
too, so a matched prefix is verified token by token. A sequence that ends mid-block may publish
that partial last block as a tail: a later prompt continuing the same parent takes it over
privately (`match_tail`) for the tokens they agree on, so a repeated prompt evaluates only its
last token. Shared blocks are full and immutable; the block being appended to is private.
A `salt` (a LoRA adapter's digest) starts the chain: blocks computed under one adapter are
published and matched under its salt only, never adopted by a sequence under another or none.

    table = pool.match_prefix(prompt, max_blocks=(len(prompt) - 1) // KV_BLOCK)
    res = pool.reserve(worst_case_blocks - len(table))   # admission; PoolExhausted = wait
    table += pool.allocate(blocks_needed(len(prompt)) - len(table), reservation=res)
    pool.publish(tokens_with_kv, table, tail=True)       # at finish, before releasing
    pool.release(table, reservation=res); res.release()
"""

from __future__ import annotations

import hashlib
import itertools
import struct
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass
from typing import Callable, Sequence

from kipp.backend import KV_BLOCK
from kipp.errors import KippError


class PoolExhausted(KippError):
    """Not enough free + evictable (unreserved) blocks; the pool was left unchanged."""

    def __init__(self, needed: int, free: int, evictable: int, reserved: int):
        self.needed, self.free, self.evictable, self.reserved = needed, free, evictable, reserved
        super().__init__(
            f"KV pool exhausted: needed {needed} blocks, {free} free + {evictable} evictable"
            f" ({reserved} of those reserved for admitted requests)"
        )


def block_hash(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    """Chained digest of one full block: blake2b(parent digest, token ids as little-endian u32)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"")
    h.update(struct.pack(f"<{len(tokens)}I", *tokens))
    return h.digest()


@dataclass(frozen=True)
class _Published:
    digest: bytes
    tokens: tuple[int, ...]
    parent: int | None  # serial of the publication one block earlier; None for block 0
    serial: int


@dataclass(frozen=True)
class _Tail:
    parent: int | bytes | None  # serial of the full block before it; at position 0 the salt
    tokens: tuple[int, ...]  # 1..31 tokens whose KV the block holds from its first position


class Reservation:
    """Blocks promised to one admitted request; nobody else's allocate or match can take them.

    `remaining` counts down as `allocate(..., reservation=self)` draws from it; `release()`
    hands whatever is left back to the pool (call it when the request ends; idempotent).
    """

    def __init__(self, pool: BlockPool, size: int):
        self.pool, self.size, self.remaining = pool, size, size

    def release(self) -> None:
        self.pool._reserved -= self.remaining
        self.remaining = 0

    def _draw(self, n: int) -> int:
        take = min(n, self.remaining)
        self.remaining -= take
        self.pool._reserved -= take
        return take

    def _credit(self, n: int) -> None:
        give = min(n, self.size - self.remaining)
        self.remaining += give
        self.pool._reserved += give


class BlockPool:
    """Allocation, refcounts, publication, prefix matching and LRU eviction of KV blocks."""

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self._num_blocks = num_blocks
        self._ref = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._lru: OrderedDict[int, None] = OrderedDict()  # evictable blocks, oldest first
        self._meta: dict[int, _Published] = {}  # published block -> what it holds
        self._by_hash: dict[bytes, int] = {}  # digest -> published block
        self._tails: dict[int, _Tail] = {}  # published partial block -> what it holds
        self._tails_by_parent: dict[int | None, set[int]] = {}
        self._children: dict[int | None, set[int]] = {}  # parent serial -> full blocks
        self._serials = itertools.count(1)
        self._reserved = 0
        self.hits = self.hit_tokens = self.published = self.evictions = 0
        self.tail_hits = 0
        # called with [(block, digest, tokens)] of each publish's new full blocks, while they
        # are still held (kipp.engine.kv_disk writes them behind)
        self.on_publish: Callable[[list[tuple[int, bytes, tuple[int, ...]]]], None] | None = None
        # called with (block, parent digest or None, tokens) of a newly published tail
        self.on_tail: Callable[[int, bytes | None, tuple[int, ...]], None] | None = None

    num_blocks = property(lambda self: self._num_blocks)
    num_free = property(lambda self: len(self._free))
    num_evictable = property(lambda self: len(self._lru))
    num_available = property(lambda self: len(self._free) + len(self._lru))
    num_in_use = property(lambda self: self._num_blocks - self.num_available)
    reserved = property(lambda self: self._reserved)

    def can_allocate(self, n: int, reservation: Reservation | None = None) -> bool:
        """Whether `allocate(n, reservation)` would succeed."""
        drawn = min(n, reservation.remaining) if reservation else 0
        return n - drawn <= self._headroom()

    def allocate(self, n: int, reservation: Reservation | None = None) -> list[int]:
        """n fresh private blocks (refcount 1): free ones first, then evict the LRU cached ones.

        Up to `reservation.remaining` blocks come out of the reservation, the rest out of the
        unreserved headroom. Raises PoolExhausted, changing nothing, when they can't be had.
        """
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if reservation is not None and reservation.pool is not self:
            raise ValueError("reservation belongs to another pool")
        if not self.can_allocate(n, reservation):
            raise PoolExhausted(n, self.num_free, self.num_evictable, self._reserved)
        if reservation is not None:
            reservation._draw(n)
        return [self._take() for _ in range(n)]

    def reserve(self, n: int) -> Reservation:
        """Promise n blocks to one request; raises PoolExhausted if the headroom is short."""
        if n < 0:
            raise ValueError(f"cannot reserve {n} blocks")
        if n > self._headroom():
            raise PoolExhausted(n, self.num_free, self.num_evictable, self._reserved)
        self._reserved += n
        return Reservation(self, n)

    def release(self, block_ids: Sequence[int], reservation: Reservation | None = None) -> None:
        """Drop one reference to each block. Private blocks reaching 0 are freed; published ones
        stay cached as evictable. Blocks go in reverse table order, so a sequence's later blocks
        become older in the LRU and are evicted before the prefix they extend. With a reservation,
        blocks that become available are credited back to it (up to its size), e.g. after a
        speculative rollback. Raises ValueError, changing nothing, on an over-release.
        """
        for b, count in Counter(block_ids).items():
            if self._ref[b] < count:
                raise ValueError(f"block {b} released {count}x but has refcount {self._ref[b]}")
        freed = 0
        for b in reversed(block_ids):
            self._ref[b] -= 1
            if self._ref[b] == 0:
                freed += 1
                if b in self._meta or b in self._tails:
                    self._lru[b] = None
                else:
                    self._free.append(b)
        if reservation is not None:
            reservation._credit(freed)

    def publish(self, tokens: Sequence[int], block_table: Sequence[int],
                tail: bool = False, salt: bytes = b"") -> int:
        """Register the sequence's full blocks as cache; returns how many were newly published.

        `tokens` are those whose KV is in the blocks; only the first len(tokens) // 32 blocks
        (the full ones) are published. Where identical content is already published, that copy
        is kept and the sequence's duplicate stays private (freed on its release). With
        `tail`, the partial block after them is published too (only by a sequence that is
        ending: the block must not change afterwards), when the whole chain before it is.
        Call before releasing the blocks: each must still be in use. `salt`: see the module
        docstring (salted blocks are not handed to on_publish / on_tail: the disk tier's keys
        are unsalted).
        """
        full = len(tokens) // KV_BLOCK
        if len(block_table) < full:
            raise ValueError(f"block table has {len(block_table)} blocks, tokens fill {full}")
        digest, parent, new, fresh, tail_entry = salt or None, _root(salt), 0, [], None
        for i in range(full):
            b = block_table[i]
            if self._ref[b] <= 0:
                raise ValueError(f"block {b} is not in use; publish before release")
            chunk = tuple(tokens[i * KV_BLOCK : (i + 1) * KV_BLOCK])
            digest = block_hash(digest, chunk)
            owner = self._by_hash.get(digest)
            if owner is not None and not self._holds(owner, chunk, parent):
                if self._ref[owner] > 0:
                    break  # a live block collides with ours: keep it, publish no further
                self._drop(owner)  # stale (its prefix was evicted) or colliding cache entry
                owner = None
            if owner is None:
                if b in self._meta:
                    break  # already published under another chain; never publish a block twice
                self._meta[b] = _Published(digest, chunk, parent, next(self._serials))
                self._by_hash[digest] = owner = b
                self._children.setdefault(parent, set()).add(b)
                new += 1
                fresh.append((b, digest, chunk))
            parent = self._meta[owner].serial
        else:
            if tail and len(tokens) > full * KV_BLOCK:
                if self._publish_tail(tokens[full * KV_BLOCK:], block_table[full], parent):
                    tail_entry = (block_table[full], digest, tuple(tokens[full * KV_BLOCK:]))
        self.published += new
        if salt:
            return new
        if fresh and self.on_publish is not None:
            self.on_publish(fresh)
        if tail_entry is not None and self.on_tail is not None:  # after the blocks it continues
            self.on_tail(*tail_entry)
        return new

    def _publish_tail(self, tokens: Sequence[int], b: int, parent: int | None) -> bool:
        if self._ref[b] != 1 or b in self._meta or b in self._tails:
            return False  # only a private block of the ending sequence becomes a tail
        entry = _Tail(parent, tuple(tokens))
        siblings = self._tails_by_parent.setdefault(parent, set())
        if any(self._tails[t] == entry for t in siblings):
            return False  # the same tail is cached already; this copy is freed on release
        self._tails[b] = entry
        siblings.add(b)
        return True

    def match_tail(self, tokens: Sequence[int], table: Sequence[int],
                   limit: int, salt: bytes = b"") -> tuple[int | None, int]:
        """Take over a cached block continuing `table` (what match_prefix returned for `tokens`).

        Returns (block, n): of the unreferenced cached blocks whose parent is the table's last
        block, the tail whose tokens agree longest with the tokens after the table, or a full
        block agreeing with all of them (the prompt ends in it), now a private block of the
        caller (refcount 1, out of the cache, its first n positions valid), and n = that
        agreement (capped at `limit`: leave at least one token to evaluate; at most 31);
        (None, 0) when none agrees. Like match_prefix, it only takes unreserved headroom;
        release the block like any allocated one.
        """
        start = len(table) * KV_BLOCK
        parent = self._meta[table[-1]].serial if table else _root(salt)
        rest = tuple(tokens[start:start + min(limit, KV_BLOCK - 1)])
        best, agree = None, 0
        for b in self._tails_by_parent.get(parent, ()):
            n = _common_prefix(self._tails[b].tokens, rest)
            if n > agree and self._ref[b] == 0:
                best, agree = b, n
        for b in self._children.get(parent, ()):
            # A full block may head a longer cached chain: take it only for a prompt that ends
            # in it, agreeing all the way (a repeated prompt), never to save a few tokens.
            if rest and self._ref[b] == 0 and self._meta[b].tokens[:len(rest)] == rest:
                best, agree = b, len(rest)
                break
        if best is None or self._headroom() == 0:
            return None, 0
        del self._lru[best]
        self._unpublish(best)
        self._ref[best] = 1
        self.tail_hits += 1
        self.hit_tokens += agree
        return best, agree

    def match_prefix(self, tokens: Sequence[int], max_blocks: int | None = None,
                     salt: bytes = b"") -> list[int]:
        """Adopt the longest run of published blocks equal to the leading full blocks of tokens.

        Each returned block gets one more reference (release() it later) and becomes most
        recently used. `max_blocks` caps the run (leave at least one token to evaluate).
        Cached blocks are only adopted from unreserved headroom, so a match never eats into
        blocks promised to admitted requests. `salt`: the one the blocks were published under.
        """
        full = len(tokens) // KV_BLOCK
        if max_blocks is not None:
            full = min(full, max_blocks)
        digest, parent, out = salt or None, _root(salt), []
        for i in range(full):
            chunk = tuple(tokens[i * KV_BLOCK : (i + 1) * KV_BLOCK])
            digest = block_hash(digest, chunk)
            b = self._by_hash.get(digest)
            if b is None or not self._holds(b, chunk, parent):
                break
            if self._ref[b] == 0:
                if self._headroom() == 0:
                    break
                del self._lru[b]
            self._ref[b] += 1
            out.append(b)
            parent = self._meta[b].serial
        self.hits += len(out)
        self.hit_tokens += len(out) * KV_BLOCK
        return out

    def stats(self) -> dict[str, int]:
        """Counters and occupancy for /metrics."""
        return dict(hits=self.hits, hit_tokens=self.hit_tokens, tail_hits=self.tail_hits,
                    published=self.published, evictions=self.evictions, free=self.num_free,
                    evictable=self.num_evictable, in_use=self.num_in_use,
                    reserved=self._reserved)

    def check(self) -> None:
        """Assert the pool's invariants (tests call this after every step)."""
        free, lru = set(self._free), set(self._lru)
        assert len(free) == len(self._free), "duplicate block in the free list"
        assert not free & lru, "block both free and evictable"
        for b, ref in enumerate(self._ref):
            assert ref >= 0, f"block {b} has refcount {ref}"
            states = (ref > 0) + (b in free) + (b in lru)
            assert states == 1, f"block {b} is in {states} states, not exactly one"
            published = b in self._meta or b in self._tails
            assert b not in lru or published, f"evictable block {b} is not published"
            assert b not in free or not published, f"free block {b} is still published"
            assert not (b in self._meta and b in self._tails), f"block {b} is full and a tail"
        assert len(self._by_hash) == len(self._meta), "hash map and published blocks disagree"
        for b, meta in self._meta.items():
            assert self._by_hash[meta.digest] == b, f"block {b} not registered under its digest"
            assert len(meta.tokens) == KV_BLOCK, f"published block {b} is not full"
        listed = [b for blocks in self._tails_by_parent.values() for b in blocks]
        assert sorted(listed) == sorted(self._tails), "tail index and tails disagree"
        children = [b for blocks in self._children.values() for b in blocks]
        assert sorted(children) == sorted(self._meta), "child index and full blocks disagree"
        for b, meta in self._meta.items():
            assert b in self._children[meta.parent], f"block {b} under the wrong parent"
        for b, tail in self._tails.items():
            assert 0 < len(tail.tokens) < KV_BLOCK, f"tail block {b} holds {len(tail.tokens)}"
            assert b in self._tails_by_parent[tail.parent], f"tail {b} under the wrong parent"
        assert 0 <= self._reserved <= self.num_available, "reservations exceed available blocks"

    def _headroom(self) -> int:
        return self.num_available - self._reserved

    def _holds(self, b: int, chunk: tuple[int, ...], parent: int | None) -> bool:
        meta = self._meta[b]
        return meta.tokens == chunk and meta.parent == parent

    def _take(self) -> int:
        if self._free:
            b = self._free.popleft()
        else:
            b, _ = self._lru.popitem(last=False)
            self._unpublish(b)
            self.evictions += 1
        self._ref[b] = 1
        return b

    def _drop(self, b: int) -> None:
        """Turn an evictable cached block back into a free one."""
        del self._lru[b]
        self._unpublish(b)
        self._free.append(b)
        self.evictions += 1

    def _unpublish(self, b: int) -> None:
        if b in self._tails:
            parent = self._tails.pop(b).parent
            self._tails_by_parent[parent].discard(b)
            if not self._tails_by_parent[parent]:
                del self._tails_by_parent[parent]
            return
        meta = self._meta.pop(b)
        del self._by_hash[meta.digest]
        self._children[meta.parent].discard(b)
        if not self._children[meta.parent]:
            del self._children[meta.parent]


def _root(salt: bytes) -> bytes | None:
    """The parent key of a chain's first block: None unsalted, else the salt itself."""
    return salt or None


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
