"""Faults above the backend: the block pool, sampling, speculative rollback, the scheduler.

Each is planted by wrapping one method or function of Kipp's pure-Python core, so the bug is
exactly the one described and everything else runs as shipped.
"""

from __future__ import annotations

from faults import Fault, register
from kipp.engine import blocks, choices, session
from kipp.text import sampling


def _plant_release_leak(patch):
    original = blocks.BlockPool.release

    def release(self, block_ids, reservation=None):
        before = set(self._free)
        original(self, block_ids, reservation)
        for b in set(self._free) - before:  # freed private blocks never return to the free list
            self._free.remove(b)

    patch.setattr(blocks.BlockPool, "release", release)


def _plant_adoption_without_reference(patch):
    original = blocks.BlockPool.match_prefix

    def match_prefix(self, tokens, max_blocks=None):
        out = original(self, tokens, max_blocks)
        for b in out:  # the adopter holds the blocks without counting a reference
            self._ref[b] -= 1
        return out

    patch.setattr(blocks.BlockPool, "match_prefix", match_prefix)


def _plant_top_k_plus_one(patch):
    original = sampling._top_k_ids
    patch.setattr(sampling, "_top_k_ids", lambda x, k: original(x, min(k + 1, x.size)))


def _plant_penalty_window_short(patch):
    original = sampling._window
    patch.setattr(sampling, "_window",
                  lambda recent, size, vocab: original(list(recent)[:-1], size, vocab))


def _plant_rollback_keeps_one(patch):
    original = session.Session.truncate

    def truncate(self, length):
        original(self, min(length + 1, self.length))  # one rejected token's KV survives

    patch.setattr(session.Session, "truncate", truncate)


def _plant_scheduler_feeds_previous(patch):
    original = choices.Choice.next_tokens

    def next_tokens(self, chunk):
        out = original(self, chunk)
        if not self.in_prompt and self.session.tokens:
            out[0] = self.session.tokens[-1]  # re-feeds the last evaluated token
        return out

    patch.setattr(choices.Choice, "next_tokens", next_tokens)


_POOL = "block pool: invariants, no leaked blocks"

for fault in (
    Fault("pool-release-leaks-private-blocks", "block pool", "kipp.engine.blocks.BlockPool.release",
          "a private block whose last reference goes is not returned to the free list",
          _plant_release_leak, (_POOL,)),
    Fault("pool-adoption-takes-no-reference", "block pool",
          "kipp.engine.blocks.BlockPool.match_prefix",
          "adopted prefix blocks are handed out without a reference count",
          _plant_adoption_without_reference, (_POOL,)),
    Fault("top-k-keeps-k-plus-one", "sampling", "kipp.text.sampling._top_k_ids",
          "top_k keeps one candidate too many",
          _plant_top_k_plus_one, ("sampling: kept set and penalties vs a sorting oracle",)),
    Fault("penalty-window-misses-last-token", "sampling", "kipp.text.sampling._window",
          "the penalties' window leaves out the most recent token",
          _plant_penalty_window_short,
          ("sampling: kept set and penalties vs a sorting oracle",)),
    Fault("spec-rollback-keeps-a-rejected-token", "speculation",
          "kipp.engine.session.Session.truncate",
          "rolling back after a rejected draft keeps one rejected token's KV",
          _plant_rollback_keeps_one, ("speculative greedy = plain greedy",)),
    Fault("scheduler-refeeds-previous-token", "scheduler",
          "kipp.engine.choices.Choice.next_tokens",
          "a decode step evaluates the last evaluated token again, not the sampled one",
          _plant_scheduler_feeds_previous, ("scheduler: concurrent greedy = designed rule",)),
):
    register(fault)
