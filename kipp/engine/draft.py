"""A draft model as a drafter: a small model of the same family guesses the next tokens.

    model = kipp.load("Qwen/Qwen3-8B", draft="Qwen/Qwen3-0.6B")
    model.generate(prompt, 256, temperature=0.7, speculative=True)   # the same distribution

Each choice gets a ModelDrafter with a session of its own on the draft model. Before a step the
drafter brings that session up to the choice's tokens (keeping the prefix they share, so the
draft's KV follows the target's accepted tokens and rejected ones are rolled back), then draws
up to k tokens one draft eval at a time, with the choice's own sampling settings on a separate
RNG stream and the grammar's mask, and keeps each distribution q it drew from: the target's
verify (kipp.text.sampling.Sampler.verify) needs q to keep the output exactly plain sampling's.
`draft_many` steps every choice's drafter in lockstep, one draft-model eval per draft position
for the whole batch.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections import defaultdict
from typing import Sequence

import numpy as np

from kipp.engine.spec import (AdaptiveGate, PromptLookupDrafter, SpecConfig, SpecError,
                              compile_count)
from kipp.formats.registry import VOCAB_SIZE
from kipp.text.grammar import GrammarError, Matcher
from kipp.text.sampling import Sampler, SamplingParams

log = logging.getLogger("kipp.engine.draft")


def check_draft_model(target, draft) -> None:
    """A SpecError unless `draft` can draft for `target`: same vocabulary, same tokenizer."""
    if draft is target:
        return
    # the ids and their BPE must agree; the chat template and end token may differ (a base
    # model drafting for an instruct one), as the target's stop ids end the text
    a, b = draft.tokenizer.data, target.tokenizer.data
    if (a.tokens, a.token_types, a.merges) != (b.tokens, b.token_types, b.merges):
        raise SpecError(f"draft model {draft.entry.id} has a different tokenizer from "
                        f"{target.entry.id}: a draft must share the target's vocabulary and "
                        f"merges exactly")
    if type(draft.backend) is not type(target.backend):
        raise SpecError(f"draft model {draft.entry.id} runs on {draft.backend.describe()}, the "
                        f"target on {target.backend.describe()}: load both on one backend")


# A draft model's gate (AdaptiveGate's fields). The pair's acceptance is steady over a text,
# where prompt lookup's comes in runs that end at an edit: a slow decay estimates it, no cap by
# the last verify, and a prior as hopeful as lookup's but half as heavy, so a pair that
# disagrees stops sooner. A one-token draft (a verify of two rows) pays at acceptances where
# three tokens do not: two rows cost about one even where four cost a CPU a good deal more.
MODEL_GATE = {"sizes": (1, 3, 7, 15), "decay": 0.9, "successes": 1.5, "trials": 2.0,
              "capped": False}

# the verifies of one stream's drafts (the model gate's sizes plus the pending token) and of a
# few streams' together: where rows come nearly free up to a tile (AMX's 16 x rows), the
# next tile's cost is a step no line through the smaller counts predicts; larger verifies extend
# the 32-to-64 segment
VERIFY_ROWS = (2, 4, 8, 16, 32, 64)


def spec_config(draft_model, target=None, lookup: bool = False, **gate) -> SpecConfig:
    """Draft with `draft_model` (prompt lookup first with `lookup`), gated by an AdaptiveGate
    priced by this machine's measured costs when the `target` is given (and checked against
    it): a draft token's (draft_cost) and the target's verify (verify_costs). `gate` overrides
    AdaptiveGate's fields; a cost given there is not measured."""
    if target is not None:
        check_draft_model(target, draft_model)
        if "draft_cost" not in gate:
            gate["draft_cost"] = draft_cost(target, draft_model)
        if not {"verify_base", "verify_per_token", "row_costs"} & gate.keys():
            gate["row_costs"] = verify_costs(target)
    if not lookup:  # lookup asked first keeps lookup's fields: its drafts come in runs
        gate = {**MODEL_GATE, **gate}
    return SpecConfig(drafter=PromptLookupDrafter if lookup else None,
                      gate=functools.partial(AdaptiveGate, **gate), draft_model=draft_model)


def draft_cost(target, draft, passes: int = 3) -> float:
    """A draft token's cost in target steps, measured: the ratio of the two models' fastest
    one-token evals. The weights' size ratio alone misses what every eval pays besides reading
    the weights (the head over the vocabulary, dispatch, the host's share), which is most of a
    draft model a hundred times smaller than its target."""
    if draft is target:
        return 1.0
    with _EvalTimer(target, 1) as timed_target, _EvalTimer(draft, 1) as timed_draft:
        best = fastest({"target": timed_target, "draft": timed_draft}, passes)
    return best["draft"] / best["target"]


def verify_costs(target, rows: tuple[int, ...] = VERIFY_ROWS,
                 passes: int = 3) -> tuple[tuple[int, float], ...]:
    """((rows, cost), ...): an eval of each of `rows` token rows with every row's logits, in
    one-token evals, timed on the target (AdaptiveGate.row_costs). Measured, not a backend's
    constant: whether a few rows cost about one row's depends on the machine (a GPU reads the
    weights once for all; a CPU pays each row's FLOPs) and on the compiled round each count
    falls in. A count never costs less than a smaller one: a dip is timing noise."""
    counts = (1, *sorted(rows))
    with _EvalTimer(target, max(counts)) as timed:
        best = fastest({n: functools.partial(timed, n) for n in counts}, passes)
    costs, floor = [], 1.0
    for n in sorted(rows):
        floor = max(floor, best[n] / best[1])
        costs.append((n, round(floor, 3)))
    return tuple(costs)


def fastest(timers: dict, passes: int) -> dict:
    """Each timer's fastest of `passes` timings, after one untimed call each (a compile). Each
    pass goes round all the timers: a burst of load from elsewhere slows the few timings it
    overlaps, whichever timers' they are, where one timer's repeats run back to back could all
    fall in one burst and price that count alone at several times its cost."""
    for timer in timers.values():
        timer()
    best = {key: float("inf") for key in timers}
    for _ in range(passes):
        for key, timer in timers.items():
            best[key] = min(best[key], timer())
    return best


class _EvalTimer:
    """Times evals of n random ids (every row's logits) on one scratch session, each from
    position 0 (the session truncated between them), so each count runs its first eval's
    compiled program: a deeper position could fall in another block-table bucket and time a
    compile. Nothing is published."""

    def __init__(self, model, capacity: int):
        self.model, self.capacity = model, capacity
        self.rng = np.random.default_rng(0)

    def __enter__(self):
        self.session = self.model.session(self.capacity)
        return self

    def __exit__(self, *exc):
        self.session.close(publish=False)

    def __call__(self, rows: int = 1) -> float:
        ids = [int(t) for t in self.rng.integers(1, 100_000, rows)]
        self.session.truncate(0)
        start = time.perf_counter()
        self.session.eval(ids, logits_rows=rows)
        return time.perf_counter() - start


class ModelDrafter:
    """Drafts for one choice by sampling the draft model (module docstring)."""

    name = "model"

    def __init__(self, model, params: SamplingParams, choice: int, capacity: int,
                 stop_ids: Sequence[int] = ()):
        self.model = model
        # a cut head (draft_vocab) drafts over its own ids: its q is 0 past them, and the
        # widened row's -inf tail costs the transforms (top_k's partition above all) many times
        # the cut row's work
        self.head = model.head_rows
        self.sampler = Sampler(_within(params, self.head), self.head, choice=choice, stream=1)
        self.params = params
        self.greedy = params.is_greedy
        self.capacity = min(capacity, model.entry.context_length)
        self.stop_ids = frozenset(stop_ids)
        self.session = None
        self.isolated = False  # set by the choice: evaluate alone (a seeded batch-variant run)
        self.failed = False  # the draft pool ran out or an eval failed: no more drafts
        self.first = False  # the current draft opened the session (its eval covers the prompt)
        self._reset_draft()

    def _reset_draft(self) -> None:
        self.tokens: list[int] = []  # the draft so far
        self.qs: list[np.ndarray] | None = None  # the distribution each draft token came from
        self._base: list[int] = []
        self._limit = 0
        self._matcher: Matcher | None = None
        self.feed: list[int] | None = None  # tokens the next draft eval appends

    def begin(self, tokens: Sequence[int], limit: int, matcher: Matcher | None) -> bool:
        """Start a draft of up to `limit` tokens after `tokens`; True when a draft eval is due."""
        self._reset_draft()
        if self.failed or limit < 1:
            return False
        self._base, self._limit = list(tokens), limit
        self._matcher = matcher.copy() if matcher is not None else None
        self.qs = None if self.greedy else []
        try:
            self.feed = self._sync()
        except Exception as e:  # the draft pool is full: plain steps from here on
            self._fail(e)
            return False
        return True

    def advance(self, rows: np.ndarray) -> bool:
        """Draw the next draft token from the draft eval's row; True when another eval is due."""
        history = self._recent(self._base + self.tokens)
        allowed = self._matcher.allowed() if self._matcher is not None else None
        if allowed is not None:
            allowed = allowed[:self.head]
            if not allowed.any():  # the grammar admits only ids past a cut head
                self.feed = None
                return False
        row = rows[-1][:self.head]
        if self.greedy:
            token = self.sampler.sample(row, history, allowed)
        else:
            q = self.sampler.probabilities(row, history, allowed)
            token = self.sampler.draw(q)
            self.qs.append(np.pad(q, (0, VOCAB_SIZE - q.size)))  # verify's q: the vocab
        self.tokens.append(token)
        if self._matcher is not None and token not in self.stop_ids:
            try:
                self._matcher.consume(token)
            except GrammarError:  # cannot happen under the mask; stop drafting here
                self.feed = None
                return False
        more = (len(self.tokens) < self._limit and token not in self.stop_ids
                and len(self._base) + len(self.tokens) < self.capacity
                and not (self._matcher is not None and self._matcher.complete))
        self.feed = [token] if more else None
        return more

    def _recent(self, history: list[int]) -> Sequence[int]:
        """The ids the penalties count: a cut head's sampler knows only the ids below the cut,
        and the others' logits are -inf whatever they count (the window taken first)."""
        if self.head == VOCAB_SIZE or not self.params.has_penalties:
            return history
        return [t for t in history[-self.params.penalty_window:] if t < self.head]

    def draft(self, tokens: Sequence[int], limit: int, matcher: Matcher | None = None
              ) -> list[int]:
        """The draft for one choice alone (draft_many does the batch)."""
        draft_many([self], [(tokens, limit, matcher)])
        return self.tokens

    def close(self) -> None:
        if self.session is not None:
            self.session.close(publish=True)
            self.session = None

    def _sync(self) -> list[int]:
        """Keep the session's prefix shared with the base; the tokens still to evaluate."""
        base = self._base
        self.first = self.session is None  # this draft's eval covers the prompt
        if self.first:
            self.session = self.model.session(self.capacity)
            self.session.match_prefix(base)
        have = self.session.tokens
        keep = 0
        limit = min(len(have), len(base) - 1)  # at least one token to evaluate, for its row
        while keep < limit and have[keep] == base[keep]:
            keep += 1
        if keep < len(have):
            self.session.truncate(keep)
        return base[keep:]

    def _fail(self, error: BaseException) -> None:
        log.warning("draft model %s stops drafting: %s", self.model.entry.id, error)
        self.failed = True
        self._reset_draft()
        if self.session is not None:
            self.session.reset()


def _within(params: SamplingParams, head: int) -> SamplingParams:
    """`params` for a sampler over the first `head` ids: the logit_bias of ids past them goes
    (their q is 0 whatever the bias)."""
    if all(token < head for token, _ in params.logit_bias):
        return params
    return dataclasses.replace(params, logit_bias=tuple(
        (token, bias) for token, bias in params.logit_bias if token < head))


def draft_many(drafters: Sequence[ModelDrafter],
               starts: Sequence[tuple[Sequence[int], int, Matcher | None]]) -> bool:
    """Draft for every drafter (each its (tokens, limit, matcher)) in lockstep: each draft
    position is one draft-model eval over every drafter still drafting (an isolated one alone).
    A drafter whose eval fails drafts nothing, now or later; the others go on. Returns whether
    the drafts cost what an ordinary draft does (the round's time prices the gates,
    kipp.engine.spec.EvalClock): no eval compiled, and none was a drafter's first (which
    evaluates the whole prompt). A draft after a pause catches up over the steps it paused for:
    that is a cost of drafting, so it is timed."""
    active = [d for d, (tokens, limit, matcher) in zip(drafters, starts)
              if d.begin(tokens, limit, matcher)]
    ordinary = not any(d.first for d in active)
    while active:
        calls = defaultdict(list)
        for d in active:
            calls[(id(d.model), id(d) if d.isolated else 0)].append(d)
        active = []
        for group in calls.values():
            model = group[0].model
            compiles = compile_count(model)
            try:
                results = model.eval_batch([(d.session, d.feed, 1) for d in group])
            except Exception as e:  # sessions are unchanged (eval_batch)
                for d in group:
                    d._fail(e)
                ordinary = False
                continue
            ordinary = ordinary and compile_count(model) == compiles
            active += [d for d, rows in zip(group, results) if d.advance(rows)]
    return ordinary
