"""Greedy self-speculative decoding: prompt-lookup drafts, verified in one multi-row eval.

    model.generate(prompt, 256, temperature=0, speculative=True)   # same text, fewer evals

A drafter proposes the tokens that followed the latest earlier occurrence of the sequence's
last n tokens. The scheduler evaluates the pending token and the draft in one eval with a
logits row per token, and a choice accepts the draft up to its first disagreement plus the
model's own pick there (kipp.engine.choices.Choice._verify), rolling the rejected KV back with
`Session.truncate`. Every accepted token is the greedy pick after its true prefix, so the output
is plain greedy's; penalties and logit bias see each row's own history. Sampled requests are
not speculated: a sampled token cannot be verified against a draft without changing the
distribution. A verify eval costs more than a one-token eval, so `AdaptiveGate` drafts only
while the acceptance it has seen pays for it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Protocol, Sequence

from kipp.engine.rounds import bucket_size
from kipp.errors import KippError


class SpecError(KippError, ValueError):
    """A speculative-decoding setting out of range."""


class Drafter(Protocol):
    def draft(self, tokens: Sequence[int], limit: int) -> list[int]:
        """Up to `limit` tokens guessed to follow `tokens` (the whole sequence so far)."""


class PromptLookupDrafter:
    """Drafts the continuation of the latest earlier occurrence of the sequence's suffix.

    Suffixes of max_ngram down to min_ngram tokens are tried, longest first. An index of every
    n-gram's latest end position is extended as the sequence grows, so a draft costs O(new
    tokens), not O(sequence). One drafter serves one growing sequence; a sequence that is not
    an extension of the last one (shorter) rebuilds the index.
    """

    name = "lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise SpecError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.sizes = range(max_ngram, min_ngram - 1, -1)
        self._ends: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}
        self._indexed = 0  # n-grams ending at positions < this are in the index

    def draft(self, tokens: Sequence[int], limit: int) -> list[int]:
        length = len(tokens)
        if length < self._indexed:
            self._ends = {n: {} for n in self.sizes}
            self._indexed = 0
        self._index(tokens, length)
        for n in self.sizes:
            end = self._ends[n].get(tuple(tokens[length - n:])) if length > n else None
            if end is not None:
                return [int(t) for t in tokens[end:min(end + limit, length)]]
        return []

    def _index(self, tokens: Sequence[int], length: int) -> None:
        """Index n-grams ending at positions [indexed, length): all but the current suffix."""
        for end in range(max(self._indexed, 1), length):
            for n in self.sizes:
                if end >= n:
                    self._ends[n][tuple(tokens[end - n:end])] = end
        self._indexed = max(self._indexed, length)


def compile_count(model) -> int:
    """Programs the model's backend has compiled (a compiling backend's `compile_log`): an
    eval during which it grew timed a compile, not the eval."""
    return len(getattr(getattr(model, "backend", None), "compile_log", ()))


LOOKUP = "lookup"  # the clock's key for rounds whose drafts cost no model evals (drafter_key)


@dataclass
class EvalClock:
    """What decode rounds cost on this machine now: per row count (bucket_size: compiled
    rounds' sizes), a decaying average of the seconds the scheduler timed a round, from
    planning it to applying its rows, kept apart for plain rounds and for rounds that verified
    drafts, per drafter (drafter_key): a drafting round's time includes the drafting, a draft
    model's evals and the sampling of its tokens, which another draft model does not cost.

    A gate prices a verify from it once it has timed both rounds it compares. What a round
    costs moves with the machine's state, not only its kind: where other tenants share the
    memory bus, a plain round (bandwidth-bound) slows down and a several-row verify (bound by
    arithmetic) does not, so costs measured once at load misprice drafting for minutes."""

    decay: float = 0.75  # weight of the past at each timed round
    plain: dict[int, float] = field(default_factory=dict)
    drafted: dict[Hashable, dict[int, float]] = field(default_factory=dict)

    def record(self, rows: int, seconds: float, drafter: Hashable | None = None) -> None:
        """A decode round of `rows` token rows took `seconds`; `drafter`: the drafter_key of
        the drafts it verified, None for a plain round."""
        if rows < 1 or not seconds > 0:
            return
        table = self.plain if drafter is None else self.drafted.setdefault(drafter, {})
        key = bucket_size(rows)
        old = table.get(key)
        table[key] = seconds if old is None else self.decay * old + (1 - self.decay) * seconds

    def seconds(self, rows: int, drafter: Hashable | None = None) -> float | None:
        table = self.plain if drafter is None else self.drafted.get(drafter, {})
        return table.get(bucket_size(rows))


@dataclass
class AdaptiveGate:
    """How many draft tokens to verify next (0: a plain step), from the acceptance so far.

    The chance that a draft token is accepted, p, is a decaying average over verified draft
    tokens (each accepted one a success, the first rejected one a failure). A draft of k tokens
    then yields E(k) = (1 - p^(k+1)) / (1 - p) tokens for an eval costing `step_cost(k + 1)`
    plain steps (the line `verify_base + verify_per_token * rows`, or the measured `row_costs`
    interpolated); the gate takes the k in `sizes` with the best ratio when it beats 1 (plain
    decoding), else it pauses drafting for `backoff` steps, then probes with the shortest draft;
    a failed probe doubles the pause (up to max_pause), a paying draft resets it. A pause is
    also long enough that the probe ending it, if it fares as the acceptance so far predicts,
    wastes at most `probe_overhead` of the steps since the last one: where a verify costs
    several steps (a CPU pays each row's FLOPs) doubling from one would spend a short reply's
    time on failed probes. In a batch where even a successful probe would not pay, the probe
    waits for another pause instead. Acceptance is rarely geometric (a copied run ends at an
    edit, however long the draft), so k is also capped by the last verify: one size up after a
    fully accepted draft, else the shortest size that would have held what was accepted. Sizes
    are one less than a power of two, so a verify fills its compiled round (kipp.cuda.rounds
    buckets token counts by powers of two).
    The default costs are those of XLA's CPU (a 4-row eval ~2x a 1-row one, 16 rows ~2.8x);
    a draft model's gate gets this machine's measured costs instead (kipp.engine.draft): evals
    of a few row counts, since rows cost a step function of compiled rounds, not a line. With a
    `clock` (the scheduler's EvalClock) those are priors: once the clock has timed a plain round
    and a drafting one by the gate's `drafter` of the rows compared, their ratio is the
    verify's cost, drafting and the Python between the evals included.
    """

    sizes: tuple[int, ...] = (3, 7, 15)
    verify_base: float = 1.7
    verify_per_token: float = 0.07
    draft_cost: float = 0.0  # a drafted token's own cost in plain steps (a draft model's evals)
    row_costs: tuple[tuple[int, float], ...] = ()  # measured (rows, cost); replaces the line
    clock: EvalClock | None = None  # rounds timed as they run (the scheduler's); beats priors
    drafter: Hashable = LOOKUP  # whose drafting rounds on the clock price it (drafter_key)
    decay: float = 0.5  # weight of the past at each verify: acceptance follows the text quickly
    max_pause: int = 32
    probe_overhead: float = 0.03  # what probing may cost a stream whose drafts do not pay
    successes: float = 3.0  # prior: p = 0.75, so a new sequence tries drafting at once
    trials: float = 4.0
    capped: bool = True  # k capped by the last verify's outcome (prompt lookup's runs)
    cap: int = field(default=7, init=False)  # longest draft the last verify supports
    pause: int = field(default=0, init=False)
    backoff: int = field(default=1, init=False)
    probing: bool = field(default=False, init=False)
    batch: int = field(default=1, init=False)  # choices in the last budget's step

    def __post_init__(self):
        if not self.sizes or min(self.sizes) < 1:
            raise SpecError(f"draft sizes must be positive, got {self.sizes}")
        if (self.verify_base <= 0 or self.verify_per_token < 0 or self.draft_cost < 0
                or not 0 <= self.decay < 1):
            raise SpecError("verify and draft costs must be positive and decay within [0, 1)")
        if not 0 < self.probe_overhead <= 1:
            raise SpecError(f"probe_overhead must be within (0, 1], got {self.probe_overhead}")
        if not self.capped:
            self.cap = max(self.sizes)
        rows = [r for r, _ in self.row_costs]
        if (any(r < 2 for r in rows) or len(set(rows)) != len(rows)
                or any(c <= 0 for _, c in self.row_costs)):
            raise SpecError(f"row_costs must be distinct row counts above 1 with positive "
                            f"costs, got {self.row_costs}")

    @property
    def acceptance(self) -> float:
        return self.successes / self.trials

    def step_cost(self, rows: int) -> float:
        """An eval of `rows` token rows in one-row steps (the verify cost model): measured
        points interpolated, and past the last one extended along the last segment."""
        if rows <= 1:
            return 1.0
        if not self.row_costs:
            return self.verify_base + self.verify_per_token * rows
        points = [(1, 1.0), *sorted(self.row_costs)]
        for (r0, c0), (r1, c1) in zip(points, points[1:]):
            if rows <= r1:
                break
        return c0 + (c1 - c0) * (rows - r0) / (r1 - r0)

    def verify_cost(self, k: int, batch: int = 1, rows: int | None = None) -> float:
        """A round verifying drafts of up to k tokens, in plain rounds of a `batch`-choice step:
        the clock's timed rounds where it has both, else the priors (step_cost, draft_cost),
        each at its compiled round's rows (bucket_size) as the clock times them. `rows`: the
        round's token rows, batch * (k + 1) where every choice drafts k."""
        rows = batch * (k + 1) if rows is None else rows
        if self.clock is not None:
            seconds = self.clock.seconds(rows, self.drafter)
            plain = self.clock.seconds(batch)
            if seconds is not None and plain is not None:
                return max(1.0, seconds / plain)  # a verify never costs less: a dip is noise
        return (self.step_cost(bucket_size(rows)) / self.step_cost(bucket_size(batch))
                + self.draft_cost * k)

    def expected_gain(self, k: int, batch: int = 1) -> float:
        """Expected tokens per plain-step cost of verifying a k-token draft (plain: 1.0), in a
        step of `batch` choices that draft alike: the verify's rows are the batch's times k + 1,
        so drafting that pays alone (a few rows cost about one) may not pay in a full batch."""
        return self.expected_tokens(k) / self.verify_cost(k, batch)

    def expected_tokens(self, k: int) -> float:
        """Tokens a verify of a k-token draft yields at the acceptance so far, E(k)."""
        p = min(self.acceptance, 1 - 1e-9)
        return (1 - p ** (k + 1)) / (1 - p)

    def budget(self, batch: int = 1) -> int:
        """Draft tokens to verify this step; 0 means a plain step. Call once per step;
        `batch`: the choices in the step (expected_gain)."""
        self.batch = max(1, batch)
        if self.pause > 0:
            self.pause -= 1
            self.probing = self.pause == 0
            return 0
        if self.probing:
            if self.batch > 1 and self.expected_gain(min(self.sizes), self.batch) <= 1.0:
                # a probe cannot pay in this batch even if it succeeds, and it costs every
                # choice (the verify pads the batch's rows): wait for the batch to shrink
                self._pause()
                return 0
            return min(self.sizes)
        best = max([k for k in self.sizes if k <= self.cap] or [min(self.sizes)],
                   key=lambda k: self.expected_gain(k, self.batch))
        if self.expected_gain(best, self.batch) > 1.0:
            return best
        self._pause()
        return 0

    def update(self, drafted: int, accepted: int) -> None:
        """Record a verified draft: `accepted` of its `drafted` tokens matched."""
        missed = int(accepted < drafted)
        self.successes = self.decay * self.successes + accepted
        self.trials = self.decay * self.trials + accepted + missed
        larger = [k for k in self.sizes if k > drafted]
        holding = [k for k in self.sizes if k > accepted]
        if not self.capped:
            self.cap = max(self.sizes)
        elif missed:
            self.cap = min(holding, default=max(self.sizes))
        else:
            self.cap = min(larger, default=max(self.sizes))
        if max(self.expected_gain(k, self.batch) for k in self.sizes) > 1.0:
            self.backoff, self.probing = 1, False
        elif self.probing:
            self.probing = False
            self.backoff = min(2 * self.backoff, self.max_pause)
            self._pause()

    def _pause(self) -> None:
        k = min(self.sizes)
        waste = self.verify_cost(k, self.batch) - self.expected_tokens(k)
        self.pause = max(self.backoff, math.ceil(max(0.0, waste) / self.probe_overhead))


TOLERATED_SLOWDOWN = 0.03  # how much slower than its plain step a choice may step for drafts


def paying_drafts(proposals: Sequence[tuple[AdaptiveGate, int]], batch: int,
                  tolerance: float = TOLERATED_SLOWDOWN) -> list[int]:
    """How many tokens of each of a step's proposed drafts, [(gate, draft length)], to verify;
    all 0 means a plain step for every choice.

    Each gate prices its draft as if every choice of the step drafted alike (expected_gain).
    All `batch` choices wait for the verify's rows and the draft model's evals, so a round
    that costs c plain rounds slows a choice that does not draft, or drafts and gains fewer
    than c tokens, to 1/c of its plain rate. A step verifies drafts only where no choice of
    it steps more than `tolerance` slower than plainly: a low-acceptance stream must not pay
    for the others' drafts. Among the drafts that keep that, at every cap on their length (a
    shorter verify costs less), the ones kept are those with the most tokens per plain
    round's cost, if that beats a plain step: in order of expected tokens, the first j yield
    batch - j + E_1 + ... + E_j tokens in a round of batch + k_1 + ... + k_j rows."""
    best, best_gain = [0] * len(proposals), 1.0
    for cap in sorted({k for _, k in proposals}):
        capped = [min(k, cap) for _, k in proposals]
        tokens = [gate.expected_tokens(k) for (gate, _), k in zip(proposals, capped)]
        order = sorted(range(len(proposals)), key=lambda i: tokens[i], reverse=True)
        extra = rows = longest = 0
        for j, i in enumerate(order, 1):
            extra += tokens[i] - 1
            rows += capped[i]
            longest = max(longest, capped[i])
            cost = proposals[i][0].verify_cost(longest, batch, batch + rows)
            slowest = tokens[i] if j == batch else 1.0  # the fewest tokens a choice gains
            gain = (batch + extra) / batch / cost
            if gain > best_gain and slowest / cost >= 1 - tolerance:
                kept = set(order[:j])
                best_gain = gain
                best = [k if n in kept else 0 for n, k in enumerate(capped)]
    return best


@dataclass(frozen=True)
class SpecConfig:
    """What `generate(..., speculative=SpecConfig(...))` drafts and gates with; each generation
    calls the factories for its own (stateful) drafter and gate. `speculative=True` is
    SpecConfig(): prompt-lookup drafts, the CPU-calibrated adaptive gate.

    `draft_model` (a kipp Model sharing the target's tokenizer) drafts by sampling it
    (kipp.engine.draft, whose `spec_config` checks the pair and sets the gate's draft cost);
    with a `drafter` too, that one is asked first and the model drafts
    when it has nothing. A SpecConfig verifies sampled requests too, exactly
    (kipp.text.sampling.Sampler.verify); `speculative=True` stays greedy only."""

    drafter: Callable[[], Drafter] | None = PromptLookupDrafter
    gate: Callable[[], AdaptiveGate] = AdaptiveGate
    draft_model: Any = None


def drafter_key(spec: SpecConfig) -> Hashable:
    """What drafts for `spec`, as the EvalClock keys its drafting rounds: the draft model (by
    identity: two loads of one checkpoint, a cut head and a whole one, cost differently), or
    LOOKUP where no model drafts."""
    return LOOKUP if spec.draft_model is None else ("model", id(spec.draft_model))


@dataclass
class SpecStats:
    drafted: int = 0  # draft tokens verified
    accepted: int = 0  # of those, accepted
    verify_evals: int = 0  # evals that verified a draft
    plain_evals: int = 0  # one-token evals (no draft available or the gate said no)
    by_drafter: dict = field(default_factory=dict)  # drafter name -> [drafted, accepted]

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def evals(self) -> int:
        return self.verify_evals + self.plain_evals

    def record(self, drafter: str, drafted: int, accepted: int) -> None:
        self.verify_evals += 1
        self.drafted += drafted
        self.accepted += accepted
        counts = self.by_drafter.setdefault(drafter, [0, 0])
        counts[0] += drafted
        counts[1] += accepted

    def add(self, other: SpecStats) -> None:
        for key in ("drafted", "accepted", "verify_evals", "plain_evals"):
            setattr(self, key, getattr(self, key) + getattr(other, key))
        for name, (drafted, accepted) in other.by_drafter.items():
            counts = self.by_drafter.setdefault(name, [0, 0])
            counts[0] += drafted
            counts[1] += accepted
