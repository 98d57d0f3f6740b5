"""The designed next-token rule that a synthetic checkpoint's weights implement.

For LIVE tokens (N_LIVE common text pieces, `live_token_ids`) and a seeded successor cycle pi
through them (`successor`), the designed next token after t_0 .. t_p is

    pi(t_{p-2})             if p >= 2, t_{p-2} is live and t_{p-1} != t_{p-2}     (main)
    pi^21(t_p)              else, if t_p is live (21 steps along pi)             (fallback)
    fallback(cluster(t_p))  else: every other token belongs to one of a few clusters

Greedy text therefore runs three interleaved walks along pi, and the main case needs attention
two positions back through the KV cache (kipp.synthetic.circuit builds the weights that do it).
Every draw comes from a (seed, name) stream (`rng`), so the rule is a function of the entry.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from kipp.formats.registry import Checkpoint
from kipp.synthetic.layout import Dims

N_LIVE = 64  # live tokens: a Hadamard code each in CODE (64 dims)
FALLBACK_STEP = N_LIVE // 3  # the fallback predicts this many steps along pi
PUNCTUATION = (".", ",", "\u010a", ":", "(", ")", "!", "?")  # live pieces besides words


def rng(entry: Checkpoint, name: str) -> np.random.Generator:
    """The (seed, name) random stream of a synthetic entry."""
    import hashlib

    words = np.frombuffer(hashlib.sha256(name.encode()).digest()[:16], dtype="<u4")
    return np.random.default_rng(np.random.SeedSequence([entry.synthetic.seed,
                                                         *words.tolist()]))


@lru_cache(maxsize=1)
def _vocab() -> dict[str, int]:
    from kipp.text.tokenizer_files import tokenizer_json_bytes

    return json.loads(tokenizer_json_bytes())["model"]["vocab"]


@lru_cache(maxsize=1)
def _live_token_ids() -> np.ndarray:
    import re

    vocab = _vocab()
    words = sorted(i for piece, i in vocab.items() if re.fullmatch(r"\u0120[a-z]{2,}", piece))
    ids = np.array(words[:N_LIVE - len(PUNCTUATION)] + [vocab[p] for p in PUNCTUATION])
    ids.flags.writeable = False
    return ids


def live_token_ids(entry: Checkpoint | None = None) -> np.ndarray:
    """The N_LIVE live tokens: the most frequent lower-case words (BPE ids follow merge
    order) and common punctuation, so greedy text reads as words. Same for every entry."""
    return _live_token_ids()


def successor(entry: Checkpoint) -> np.ndarray:
    """pi, as indices into live_token_ids: one random cycle through every live token."""
    order = rng(entry, "successor").permutation(N_LIVE)
    pi = np.empty_like(order)
    pi[order] = np.roll(order, -1)
    disagree = entry.synthetic.disagree if entry.synthetic is not None else 0.0
    if disagree:  # a draft: move some successors (no longer one cycle; the circuit is a table)
        r = rng(entry, "disagree")
        moved = r.choice(N_LIVE, round(disagree * N_LIVE), replace=False)
        pi[moved] = (pi[moved] + r.integers(1, N_LIVE, moved.size)) % N_LIVE
    return pi


def fallback_successor(entry: Checkpoint) -> np.ndarray:
    """The fallback's map on live indices: FALLBACK_STEP steps along pi. Greedy text starts
    with fallback steps, so its three walks along pi begin FALLBACK_STEP apart and stay
    distinct for about N_LIVE tokens (one step apart they would repeat each token thrice)."""
    pi = successor(entry)
    out = np.arange(N_LIVE)
    for _ in range(FALLBACK_STEP):
        out = pi[out]
    return out


@lru_cache(maxsize=None)
def token_clusters(entry: Checkpoint, matrix: str = "model.embed_tokens.weight") -> np.ndarray:
    """The cluster of every row of token matrix `matrix` (used by non-live, non-padding rows);
    drawn once per matrix (its rows are made a chunk at a time)."""
    from kipp.formats.registry import VOCAB_SIZE

    out = rng(entry, matrix + "/clusters").integers(0, Dims(entry.hidden).clusters, VOCAB_SIZE)
    out.flags.writeable = False
    return out


def cluster_fallback(entry: Checkpoint) -> np.ndarray:
    """The live token (index) each cluster's fallback predicts."""
    return rng(entry, "cluster-fallback").integers(0, N_LIVE, Dims(entry.hidden).clusters)


@dataclass(frozen=True)
class Rule:
    """The designed next-token rule of one entry, as lookup tables (module docstring)."""

    live: np.ndarray  # [vocab] bool
    index: np.ndarray  # [vocab] live index (or -1)
    ids: np.ndarray  # live index -> token id
    pi: np.ndarray  # live index -> live index
    fallback: np.ndarray  # live index -> live index (FALLBACK_STEP steps along pi)
    cluster_next: np.ndarray  # [vocab] token id predicted by the fallback of its cluster

    def next(self, tokens) -> int:
        """The designed greedy token after `tokens` (token ids, at least one)."""
        p = len(tokens) - 1
        if p >= 2:
            a, b = int(tokens[p - 2]), int(tokens[p - 1])
            if self.live[a] and a != b:
                return int(self.ids[self.pi[self.index[a]]])
        t = int(tokens[p])
        if self.live[t]:
            return int(self.ids[self.fallback[self.index[t]]])
        return int(self.cluster_next[t])

    def main_fires(self, tokens) -> bool:
        p = len(tokens) - 1
        return p >= 2 and bool(self.live[tokens[p - 2]]) and tokens[p - 2] != tokens[p - 1]

    def continuation(self, tokens, n: int) -> list[int]:
        """n designed greedy tokens after `tokens`."""
        seq = [int(t) for t in tokens]
        for _ in range(n):
            seq.append(self.next(seq))
        return seq[len(tokens):]


@lru_cache(maxsize=None)
def rule(entry: Checkpoint) -> Rule:
    """The designed next-token rule of a synthetic entry."""
    from kipp.formats.registry import VOCAB_SIZE

    ids = live_token_ids(entry)
    live = np.zeros(VOCAB_SIZE, bool)
    live[ids] = True
    index = np.full(VOCAB_SIZE, -1)
    index[ids] = np.arange(N_LIVE)
    cluster_next = ids[cluster_fallback(entry)[token_clusters(entry)]]
    return Rule(live, index, ids, successor(entry), fallback_successor(entry), cluster_next)
