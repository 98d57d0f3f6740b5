"""The KV block pool: allocation, refcounts, publication, matching, eviction, reservations."""

import random

import pytest

from kipp.backend import KV_BLOCK, blocks_needed
from kipp.engine import blocks
from kipp.engine.blocks import BlockPool, PoolExhausted


def seq(n_blocks, start=0, extra=0):
    """Token ids filling n_blocks full blocks plus `extra` tokens, starting at `start`."""
    return list(range(start, start + n_blocks * KV_BLOCK + extra))


def snapshot(pool):
    return (pool.num_free, pool.num_evictable, pool.num_in_use, pool.reserved,
            list(pool._free), list(pool._lru), list(pool._ref), dict(pool._meta), pool.stats())


def finish(pool, tokens, table):
    """What a session does when its sequence ends: publish, then release."""
    pool.publish(tokens, table)
    pool.release(table)
    pool.check()


def test_allocate_release_cycle():
    pool = BlockPool(8)
    a = pool.allocate(3)
    b = pool.allocate(5)
    assert len(set(a + b)) == 8 and pool.num_in_use == 8 and pool.num_free == 0
    assert not pool.can_allocate(1) and pool.can_allocate(0)
    pool.check()
    pool.release(a)
    assert pool.num_free == 3 and pool.num_in_use == 5
    pool.release(b)
    assert pool.num_free == 8 and pool.num_available == 8 and pool.num_in_use == 0
    pool.check()
    with pytest.raises(ValueError):
        pool.release(b)
    pool.check()


def test_blocks_needed():
    assert [blocks_needed(n) for n in (0, 1, 32, 33, 64)] == [0, 1, 1, 2, 2]


def test_publish_then_match_shares_prefix_and_stops_at_difference():
    pool = BlockPool(16)
    tokens = seq(4, extra=5)
    table = pool.allocate(5)
    assert pool.publish(tokens, table) == 4  # the partial fifth block is not published
    pool.release(table)
    pool.check()
    assert pool.num_evictable == 4 and pool.num_free == 12

    other = tokens[: 2 * KV_BLOCK] + [9999] + tokens[2 * KV_BLOCK + 1 :]
    got = pool.match_prefix(other)
    assert got == table[:2]
    assert pool.hits == 2 and pool.hit_tokens == 64
    assert pool.num_in_use == 2 and pool.num_evictable == 2
    pool.check()

    # A whole-prefix match: all four full blocks, never the partial fifth.
    again = pool.match_prefix(tokens + [1, 2, 3])
    assert again == table[:4]
    assert [pool._ref[b] for b in table] == [2, 2, 1, 1, 0]
    pool.release(got)
    pool.release(again)
    pool.check()
    assert pool.num_evictable == 4 and pool.num_in_use == 0


def test_partial_block_never_published_or_matched():
    pool = BlockPool(4)
    table = pool.allocate(2)
    assert pool.publish(seq(1, extra=31), table) == 1
    pool.release(table)
    assert pool.num_evictable == 1 and pool.num_free == 3
    assert pool.match_prefix(seq(1, extra=31)) == [table[0]]
    assert pool.match_prefix(seq(0, extra=31)) == []
    pool.check()


def test_first_block_must_match():
    pool = BlockPool(4)
    table = pool.allocate(2)
    finish(pool, seq(2), table)
    assert pool.match_prefix(seq(2, start=1)) == []
    # Same second block behind a different first block: the chain differs, so no match.
    shifted = [7] * KV_BLOCK + seq(2)[KV_BLOCK:]
    assert pool.match_prefix(shifted) == []


def test_two_adopters_share_refcounts():
    pool = BlockPool(8)
    tokens = seq(2, extra=1)
    table = pool.allocate(3)
    finish(pool, tokens, table)

    a = pool.match_prefix(tokens) + pool.allocate(1)
    b = pool.match_prefix(tokens) + pool.allocate(1)
    assert a[:2] == b[:2] == table[:2] and a[2] != b[2]
    assert [pool._ref[x] for x in a[:2]] == [2, 2]
    pool.check()
    pool.release(a)
    assert [pool._ref[x] for x in b[:2]] == [1, 1] and pool.num_in_use == 3
    pool.check()
    pool.release(b)
    assert pool.num_in_use == 0 and pool.num_evictable == 2
    pool.check()


def test_republishing_identical_content_keeps_one_copy():
    pool = BlockPool(8)
    tokens = seq(2)
    first, second = pool.allocate(2), pool.allocate(2)
    assert pool.publish(tokens, first) == 2
    assert pool.publish(tokens, second) == 0  # duplicates stay private
    pool.release(first)
    pool.release(second)
    pool.check()
    assert pool.num_evictable == 2 and pool.num_free == 6
    assert pool.match_prefix(tokens) == first

    # An adopter that extends the prefix publishes only its new block, chained to the shared ones.
    pool.release(first)
    longer = seq(3)
    table = pool.match_prefix(longer) + pool.allocate(1)
    assert pool.publish(longer, table) == 1
    assert pool.published == 3
    pool.release(table)
    assert pool.match_prefix(longer) == table
    pool.check()


def test_hash_collision_never_returns_wrong_tokens(monkeypatch):
    monkeypatch.setattr(blocks, "block_hash", lambda parent, tokens: b"same")
    pool = BlockPool(8)
    a = seq(2)
    table = pool.allocate(2)
    assert pool.publish(a, table) == 1  # block 1 collides with block 0 (in use): not published
    pool.check()
    assert pool.match_prefix(seq(2, start=1)) == []
    assert pool.match_prefix(a) == table[:1]
    # The second block's lookup lands on block 0 (same digest), whose tokens differ: stop.
    assert pool._ref[table[0]] == 2
    pool.release(table[:1])
    pool.release(table)
    pool.check()

    # A colliding sequence finishing while the old entry is only cached replaces it.
    b = seq(1, start=500)
    other = pool.allocate(1)
    assert pool.publish(b, other) == 1
    pool.release(other)
    pool.check()
    assert pool.match_prefix(a) == []
    assert pool.match_prefix(b) == other


def test_collision_with_same_tokens_but_other_parent(monkeypatch):
    """Equal tokens under a different prefix must not match: the parent link is checked."""
    first_token = lambda parent, tokens: tokens[0].to_bytes(4, "little")  # noqa: E731
    monkeypatch.setattr(blocks, "block_hash", first_token)
    pool = BlockPool(8)
    x, y = [1] * KV_BLOCK, [2] * KV_BLOCK
    table = pool.allocate(2)
    finish(pool, x + y, table)
    z = [3] * KV_BLOCK
    assert pool.match_prefix(z + y) == []  # y's digest hits, but only behind x
    got = pool.match_prefix(x + y)
    assert got == table
    pool.release(got)
    pool.check()


def test_lru_eviction_order():
    pool = BlockPool(4)
    t1, t2 = seq(1, start=0), seq(1, start=1000)
    a, b = pool.allocate(1), pool.allocate(1)
    pool.publish(t1, a)
    pool.publish(t2, b)
    pool.release(a)
    pool.release(b)  # LRU: a (older), b
    pool.release(pool.match_prefix(t1))  # touching a makes b the oldest
    assert list(pool._lru) == [b[0], a[0]]

    fresh = pool.allocate(2)  # the two never-used free blocks come first
    assert pool.evictions == 0 and set(fresh).isdisjoint(a + b)
    assert pool.allocate(1) == b and pool.evictions == 1
    assert pool.match_prefix(t2) == []  # b was unpublished when evicted
    assert pool.allocate(1) == a and pool.evictions == 2
    assert pool.num_evictable == 0
    pool.check()


def test_release_in_reverse_order_evicts_tail_first():
    pool = BlockPool(3)
    table = pool.allocate(3)
    finish(pool, seq(3), table)
    assert pool.allocate(1) == [table[2]]
    assert pool.match_prefix(seq(3)) == table[:2]
    pool.check()


def test_in_use_blocks_never_evicted():
    pool = BlockPool(4)
    table = pool.allocate(2)
    pool.publish(seq(2), table)  # published, still referenced
    got = pool.allocate(2)
    assert set(got).isdisjoint(table)
    with pytest.raises(PoolExhausted):
        pool.allocate(1)
    assert pool.num_evictable == 0 and pool.evictions == 0
    pool.check()


def test_exhaustion_leaves_pool_unchanged():
    pool = BlockPool(6)
    table = pool.allocate(3)
    finish(pool, seq(3), table)
    held = pool.allocate(2)
    res = pool.reserve(1)
    pool.check()
    before = snapshot(pool)
    with pytest.raises(PoolExhausted) as err:
        pool.allocate(4)
    msg = str(err.value)
    assert "needed 4" in msg and "1 free + 3 evictable" in msg and "1 of those reserved" in msg
    with pytest.raises(PoolExhausted):
        pool.reserve(4)
    assert snapshot(pool) == before
    pool.check()
    assert pool.can_allocate(3) and pool.can_allocate(4, reservation=res)
    pool.release(held)
    res.release()
    pool.check()


def test_max_blocks_caps_match():
    pool = BlockPool(8)
    tokens = seq(4)
    table = pool.allocate(4)
    finish(pool, tokens, table)
    assert pool.match_prefix(tokens, max_blocks=(len(tokens) - 1) // KV_BLOCK) == table[:3]
    assert pool.match_prefix(tokens, max_blocks=0) == []
    pool.check()


def test_reservations_are_not_given_to_others():
    pool = BlockPool(6)
    res = pool.reserve(4)
    assert pool.reserved == 4 and pool.can_allocate(2) and not pool.can_allocate(3)
    with pytest.raises(PoolExhausted):
        pool.reserve(3)
    other = pool.allocate(2)
    with pytest.raises(PoolExhausted):
        pool.allocate(1)

    mine = pool.allocate(3, reservation=res)
    assert res.remaining == 1 and pool.reserved == 1
    pool.check()
    # Over-asking draws the rest from headroom, which is empty here.
    with pytest.raises(PoolExhausted):
        pool.allocate(2, reservation=res)
    mine += pool.allocate(1, reservation=res)
    assert res.remaining == 0 and pool.reserved == 0 and pool.num_available == 0

    # A rollback releasing own blocks credits the reservation back (never beyond its size).
    pool.release(mine[-2:], reservation=res)
    assert res.remaining == 2 and pool.reserved == 2 and not pool.can_allocate(1)
    pool.check()
    res.release()
    res.release()
    assert pool.reserved == 0 and pool.can_allocate(2)
    pool.release(mine[:-2])
    pool.release(other)
    pool.check()
    assert pool.num_free == 6


def test_match_does_not_adopt_reserved_cache():
    pool = BlockPool(2)
    table = pool.allocate(2)
    finish(pool, seq(2), table)
    res = pool.reserve(1)
    assert pool.match_prefix(seq(2)) == table[:1]  # the second would eat the reservation
    pool.check()
    assert pool.allocate(1, reservation=res) == [table[1]]
    pool.check()


def test_publish_requires_live_blocks_and_full_table():
    pool = BlockPool(4)
    table = pool.allocate(1)
    with pytest.raises(ValueError):
        pool.publish(seq(2), table)
    pool.release(table)
    with pytest.raises(ValueError):
        pool.publish(seq(1), table)
    pool.check()


def finish_with_tail(pool, tokens, table):
    """What a closing session does: publish full blocks and the partial last one, release."""
    pool.publish(tokens, table, tail=True)
    pool.release(table)
    pool.check()


def adopt(pool, tokens, limit=None):
    """A session's match_prefix: full blocks, then a tail; (table, adopted tokens)."""
    usable = len(tokens) - 1
    table = pool.match_prefix(tokens, max_blocks=usable // KV_BLOCK)
    tail, n = pool.match_tail(tokens, table, usable - len(table) * KV_BLOCK
                              if limit is None else limit)
    pool.check()
    return table + ([tail] if tail is not None else []), len(table) * KV_BLOCK + n


def test_tail_is_adopted_privately_and_leaves_one_token():
    pool = BlockPool(8)
    tokens = seq(2, extra=10)
    table = pool.allocate(3)
    finish_with_tail(pool, tokens, table)
    assert pool.num_evictable == 3 and pool.stats()["tail_hits"] == 0

    got, adopted = adopt(pool, tokens)
    assert got == table and adopted == len(tokens) - 1  # the last token is left to evaluate
    assert [pool._ref[b] for b in got] == [1, 1, 1] and table[2] not in pool._lru
    assert pool.stats()["tail_hits"] == 1 and pool.hit_tokens == 2 * KV_BLOCK + 9
    # Private: a second adopter finds the full blocks only.
    other, n = adopt(pool, tokens)
    assert other == table[:2] and n == 2 * KV_BLOCK
    pool.release(other)
    # Released without publishing, the old tail is an ordinary private block: freed.
    pool.release(got)
    pool.check()
    assert pool.num_evictable == 2 and pool.num_free == 6
    assert adopt(pool, tokens)[1] == 2 * KV_BLOCK


def test_tail_agreement_and_limit():
    pool = BlockPool(8)
    tokens = seq(1, extra=20)
    first = pool.allocate(2)
    finish_with_tail(pool, tokens, first)
    longer = tokens[:KV_BLOCK + 12] + [999] + tokens[KV_BLOCK + 13:]
    got, n = adopt(pool, longer)
    assert got == first and n == KV_BLOCK + 12  # only the 12 tokens that agree
    pool.release(got)
    pool.check()

    # Later sequences share the first block and leave tails of their own.
    table = first[:1] + pool.allocate(1)
    pool._ref[first[0]] += 1
    finish_with_tail(pool, tokens, table)
    got, n = adopt(pool, tokens, limit=5)
    assert got == table and n == KV_BLOCK + 5
    pool.release(got)
    table = pool.match_prefix(tokens) + pool.allocate(1)
    finish_with_tail(pool, tokens, table)
    # Nothing in common past the full block, or no room left: no tail taken.
    assert adopt(pool, tokens[:KV_BLOCK] + [999] * 20) == (table[:1], KV_BLOCK)
    pool.release(table[:1])
    assert adopt(pool, tokens, limit=0) == (table[:1], KV_BLOCK)
    pool.release(table[:1])
    pool.check()


def test_tail_needs_its_exact_parent_chain():
    pool = BlockPool(8)
    tokens = seq(2, extra=4)
    table = pool.allocate(3)
    finish_with_tail(pool, tokens, table)
    # Same tail tokens after a different second block: another chain, no tail.
    other = tokens[:KV_BLOCK] + [7] * KV_BLOCK + tokens[2 * KV_BLOCK:]
    got, n = adopt(pool, other)
    assert got == table[:1] and n == KV_BLOCK
    pool.release(got)
    # A prompt shorter than one block has a root tail (parent None).
    short = pool.allocate(1)
    finish_with_tail(pool, seq(0, extra=9, start=500), short)
    assert adopt(pool, seq(0, extra=9, start=500)) == (short, 8)
    pool.check()


def test_tail_rules_on_publish():
    pool = BlockPool(8)
    tokens = seq(1, extra=3)
    # Not the ending sequence's private block (shared by two): not published as a tail.
    table = pool.allocate(2)
    pool._ref[table[1]] += 1
    pool.publish(tokens, table, tail=True)
    assert table[1] not in pool._tails
    pool._ref[table[1]] -= 1
    pool.release(table)
    pool.check()
    # The same tail twice: one copy is cached, the duplicate freed on release.
    a, b = pool.match_prefix(tokens) + pool.allocate(1), pool.match_prefix(tokens) + \
        pool.allocate(1)
    pool.publish(tokens, a, tail=True)
    pool.publish(tokens, b, tail=True)
    pool.release(a)
    pool.release(b)
    pool.check()
    assert a[1] in pool._tails and b[1] not in pool._tails and b[1] in pool._free
    # Publishing a chain that breaks off (a live colliding block) publishes no tail.
    assert pool.stats()["tail_hits"] == 0


def test_an_unreferenced_full_block_is_taken_over_for_the_tokens_that_agree():
    """A finished sequence whose generated tokens filled its prompt's last block left it full:
    the same prompt again takes that block over privately (out of the cache) for the prompt's
    tokens in it; a prompt of exactly two blocks keeps its last token to evaluate."""
    pool = BlockPool(8)
    finished = seq(2)  # a 52-token prompt and 12 generated tokens
    table = pool.allocate(2)
    finish_with_tail(pool, finished, table)
    prompt = finished[:KV_BLOCK + 20]
    got, n = adopt(pool, prompt)
    assert got == table and n == len(prompt) - 1
    assert table[1] not in pool._meta and pool._ref[table[1]] == 1  # no longer cached
    pool.release(got)
    pool.check()
    assert pool.num_free == 7 and adopt(pool, prompt) == (table[:1], KV_BLOCK)
    pool.release(table[:1])
    # A prompt that leaves the full block's tokens early does not break the cached chain.
    table = pool.match_prefix(finished) + pool.allocate(1)
    finish_with_tail(pool, finished, table)
    early = finished[:KV_BLOCK + 5] + [999] * 10
    assert adopt(pool, early) == (table[:1], KV_BLOCK) and table[1] in pool._meta
    pool.release(table[:1])
    pool.check()

    got, n = adopt(pool, finished)  # 64 tokens: one full block shared, 31 of the next taken
    assert got == table and n == 2 * KV_BLOCK - 1
    # A block someone still uses is never taken.
    other, m = adopt(pool, finished)
    assert other == table[:1] and m == KV_BLOCK
    pool.release(other)
    pool.release(got)
    pool.check()


def test_tails_are_evicted_before_their_prefix():
    pool = BlockPool(3)
    table = pool.allocate(3)
    finish_with_tail(pool, seq(2, extra=5), table)
    assert list(pool._lru) == [table[2], table[1], table[0]]
    assert pool.allocate(1) == [table[2]] and table[2] not in pool._tails
    pool.check()
    assert adopt(pool, seq(2, extra=5))[1] == 2 * KV_BLOCK


def test_hash_is_stable():
    h0 = blocks.block_hash(None, list(range(KV_BLOCK)))
    assert h0 == blocks.block_hash(None, tuple(range(KV_BLOCK)))
    assert h0.hex() == blocks.block_hash(b"", range(KV_BLOCK)).hex()
    assert blocks.block_hash(h0, [0] * KV_BLOCK) != blocks.block_hash(None, [0] * KV_BLOCK)


@pytest.mark.parametrize("seed", range(5))
def test_random_stress(seed, monkeypatch):
    if seed == 4:  # one run with a weak hash so collisions happen constantly
        monkeypatch.setattr(blocks, "block_hash", lambda parent, tokens: bytes([sum(tokens) % 3]))
    rng = random.Random(seed)
    pool = BlockPool(24)
    prefixes = [[rng.randrange(4) for _ in range(3 * KV_BLOCK)] for _ in range(3)]
    live = []  # (tokens, table, reservation)
    holds = {}  # block -> the token at each of its positions (what its KV was computed for)

    def content(tokens, table, adopted):
        # Every adopted position must hold exactly the prompt's token there.
        for p in range(adopted):
            assert holds[table[p // KV_BLOCK]][p % KV_BLOCK] == tokens[p]

    for _ in range(600):
        if live and (rng.random() < 0.4 or pool.num_available - pool.reserved < 4):
            tokens, table, res = live.pop(rng.randrange(len(live)))
            if rng.random() < 0.8:
                pool.publish(tokens, table, tail=rng.random() < 0.7)
            pool.release(table, reservation=res)
            res.release()
        else:
            tokens = rng.choice(prefixes)[: rng.randrange(3 * KV_BLOCK)]
            tokens += [rng.randrange(4) for _ in range(rng.randrange(1, 3 * KV_BLOCK))]
            need = blocks_needed(len(tokens))
            usable = len(tokens) - 1
            table = pool.match_prefix(tokens, max_blocks=usable // KV_BLOCK)
            tail, n = pool.match_tail(tokens, table, usable - len(table) * KV_BLOCK)
            adopted = len(table) * KV_BLOCK + n
            table += [tail] if tail is not None else []
            content(tokens, table, adopted)
            try:
                res = pool.reserve(need - len(table))
            except PoolExhausted:
                pool.release(table)
                pool.check()
                continue
            while len(table) < need:  # grow a block or two at a time, like prefill chunks
                table += pool.allocate(min(rng.randrange(1, 3), need - len(table)), reservation=res)
            assert res.remaining == 0 and len(set(table)) == len(table)
            for p in range(adopted, len(tokens)):  # "evaluate" the rest: write its KV
                holds.setdefault(table[p // KV_BLOCK], [None] * KV_BLOCK)[p % KV_BLOCK] = \
                    tokens[p]
            live.append((tokens, table, res))
        pool.check()

    for tokens, table, res in live:
        pool.publish(tokens, table)
        pool.release(table)
        res.release()
    pool.check()
    assert pool.num_in_use == 0 and pool.reserved == 0
    assert pool.num_free + pool.num_evictable == pool.num_blocks
    assert pool.hits > 0 and pool.published > 0 and (seed == 4 or pool.tail_hits > 0)


def test_misuse_is_rejected():
    with pytest.raises(ValueError):
        BlockPool(0)
    pool, other = BlockPool(4), BlockPool(4)
    with pytest.raises(ValueError):
        pool.allocate(-1)
    with pytest.raises(ValueError):
        pool.reserve(-1)
    with pytest.raises(ValueError):
        pool.allocate(1, reservation=other.reserve(1))
    # A published block is immutable: republishing it under other content publishes nothing.
    table = pool.allocate(1)
    assert pool.publish(seq(1), table) == 1
    assert pool.publish(seq(1, start=7), table) == 0
    assert pool.match_prefix(seq(1, start=7)) == []
    pool.release(table)
    pool.check()


def test_on_publish_reports_only_new_full_blocks():
    """The disk tier's hook (kipp.engine.kv_disk): each publish's newly published full blocks,
    with their chained digests and tokens, while still held; a duplicate or tail is not."""
    pool = BlockPool(8)
    seen = []
    pool.on_publish = seen.append
    tokens = seq(2, extra=5)
    table = pool.allocate(3)
    pool.publish(tokens, table, tail=True)
    d0 = blocks.block_hash(None, tokens[:KV_BLOCK])
    d1 = blocks.block_hash(d0, tokens[KV_BLOCK:2 * KV_BLOCK])
    assert seen == [[(table[0], d0, tuple(tokens[:KV_BLOCK])),
                     (table[1], d1, tuple(tokens[KV_BLOCK:2 * KV_BLOCK]))]]
    assert all(pool._ref[b] == 1 for b, _, _ in seen[0])  # still held when reported
    pool.release(table)
    other = pool.allocate(3)
    pool.publish(tokens, other)  # the same content is published already: nothing new
    assert len(seen) == 1
    pool.release(other)
    pool.check()
