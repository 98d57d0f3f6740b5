"""Speculative sampling's rule (kipp.text.sampling.Sampler.verify) keeps plain sampling's
distribution: the token at a drafted position, drafted from q and verified against p, is
distributed as a plain sample from p, for every sampling transform and a grammar's mask.

The logits are the tiny synthetic checkpoints' own for one prompt (target qwen3-tiny; drafts
from the mean of its and qwen3-tiny-base's logits, and the target's logits plus noise). Their
logits are peaked (one designed token far above a flat rest), so the cases sample hot, where
both distributions spread over several tokens. Each case
compares thousands of speculative draws with as many plain ones in a two-sample chi-square; the
test's power is shown by two planted rules it must reject: drawing from p on rejection instead
of the residual max(0, p - q), and accepting every draft token.

End to end, `test_the_next_tokens_with_a_draft_model_are_plain_samples` runs the scheduler: a
thousand seeded requests for a few tokens each with a draft model, as many without, compared
position by position, the same two planted rules rejected.
"""

import numpy as np
import pytest
from scipy.stats import chi2_contingency

from kipp.engine.scheduler import Delta, Request, Scheduler
from kipp.engine.spec import SpecConfig
from kipp.model import load
from kipp.text.sampling import Sampler, SamplingParams
from spec_gates import FixedGate

TINY, BASE = "kipp-synthetic/qwen3-tiny", "kipp-synthetic/qwen3-tiny-base"
DRAWS = 3000
PROMPT = "The cat sat on the mat and the dog"
# A fixed seed per case makes the outcome deterministic; 1e-3 is the false-alarm rate a
# correct rule would have over fresh seeds, per case.
ALPHA = 1e-3
# End to end: the target drafting for itself through a head cut at CUT, whose hot top tokens
# for PROMPT lie on both sides of it; REQUESTS seeded requests of TOKENS tokens each (the first
# from the prompt's logits, most others from verifies)
CUT, REQUESTS, TOKENS = 512, 1000, 4


@pytest.fixture(scope="module")
def logits(models):
    """(prompt ids, target row, the draft model's row) at the prompt's last position."""
    target, draft = models(TINY), models(BASE)
    prompt = target.tokenizer.encode(PROMPT)
    with target.session() as s:
        p = s.eval(prompt)[0]
    with draft.session() as s:
        q = s.eval(prompt)[0]
    return prompt, p, q


def _cases(prompt, p, q):
    top = [int(t) for t in np.argsort(p)[::-1][:40]]
    noisy = p + np.random.default_rng(5).normal(0, 1.0, p.shape).astype(np.float32)
    mixed = (p + q) / 2  # the draft model's logits alone share no top-k token with p's
    allowed = np.zeros(p.shape, dtype=bool)
    allowed[top[::2]] = True  # a grammar admitting every other of the top tokens, and more
    allowed[np.random.default_rng(6).integers(0, p.size, 5000)] = True
    history = prompt + top[:3] + top[:1]
    return {
        "top_k": (dict(temperature=5.0, top_k=12), mixed, None, prompt),
        "top_p": (dict(temperature=3.0, top_p=0.8), noisy, None, prompt),
        "min_p": (dict(temperature=1.5, top_k=64, min_p=0.002), mixed, None,
                  prompt),
        "penalties": (dict(temperature=5.0, top_k=16, repetition_penalty=1.4,
                           presence_penalty=0.5, frequency_penalty=0.3,
                           logit_bias={top[5]: 2.0, top[0]: -1.0}), noisy, None, history),
        "grammar": (dict(temperature=4.0, top_k=30), mixed, allowed, prompt),
        # a draft whose head stops short of the vocabulary (draft_vocab) in the middle of p's
        # top tokens: q is zero past it, so the residual alone yields those tokens
        "cut_head": (dict(temperature=5.0, top_k=12), _cut(mixed, sorted(top[:12])[6]), None,
                     prompt),
        "power": (dict(temperature=5.0, top_k=12), noisy, None, prompt),
    }


def _cut(row, rows):
    out = row.copy()
    out[rows:] = -np.inf
    return out


def planted_residual_is_p(self, logits, recent, allowed, token, draft=None):
    """A planted fault: on rejection, draw from p instead of the residual."""
    p = self.probabilities(logits, recent, allowed)
    q_token = 1.0 if draft is None else float(draft[token])
    if self.rng.random() * q_token < p[token]:
        return int(token)
    return self.draw(p)


def planted_accept_all(self, logits, recent, allowed, token, draft=None):
    """A planted fault: every draft token is kept."""
    return int(token)


def _compare(params, p_row, q_row, allowed, history, verify=Sampler.verify, seed=11):
    """Chi-square p-value of speculative vs plain draws; the acceptance rate."""
    params = SamplingParams(seed=seed, **params)
    plain = Sampler(params, p_row.size)
    target, drafter = Sampler(params, p_row.size, choice=1), Sampler(params, stream=1)
    plain_draws = [plain.sample(p_row, history, allowed) for _ in range(DRAWS)]
    spec_draws, kept = [], 0
    for _ in range(DRAWS):
        q = drafter.probabilities(q_row, history, allowed)
        d = drafter.draw(q)
        token = verify(target, p_row, history, allowed, d, q)
        kept += token == d
        spec_draws.append(token)
    return _chi2(plain_draws, spec_draws), kept / DRAWS


def _chi2(x, y) -> float:
    """The two-sample chi-square p-value of two lists of draws."""
    ids = sorted(set(x) | set(y))
    table = np.array([[draws.count(i) for i in ids] for draws in (x, y)])
    small = table.sum(axis=0) < 10  # pool the rare tokens, so every expected count is >= 5
    if small.any():
        table = np.column_stack([table[:, ~small], table[:, small].sum(axis=1)])
    return chi2_contingency(table).pvalue if table.shape[1] > 1 else 1.0


@pytest.mark.slow
@pytest.mark.parametrize("case", ["top_k", "top_p", "min_p", "penalties", "grammar",
                                  "cut_head"])
def test_speculative_draws_match_plain_draws(logits, case):
    params, draft, allowed, history = _cases(*logits)[case]
    pvalue, acceptance = _compare(params, logits[1], draft, allowed, history)
    print(f"{case}: p-value {pvalue:.3g}, acceptance {acceptance:.2f}")
    assert 0.1 < acceptance < 0.95  # q differs from p: the residual is exercised
    assert pvalue > ALPHA


@pytest.mark.slow
def test_planted_biased_rules_are_rejected(logits):
    """Power: at this case's acceptance (~0.5) each planted rule moves the output
    distribution by a total variation of ~0.15 (drawing from p) and ~0.5 (keeping all)."""
    params, draft, allowed, history = _cases(*logits)["power"]
    for planted in (planted_residual_is_p, planted_accept_all):
        pvalue, _ = _compare(params, logits[1], draft, allowed, history, verify=planted)
        print(f"{planted.__name__}: p-value {pvalue:.3g}")
        assert pvalue < 1e-6


def test_a_deterministic_draft_keeps_the_distribution(logits):
    """q = None (prompt lookup's draft, all mass on its token) is exact too."""
    prompt, p_row, _ = logits
    params = SamplingParams(temperature=5.0, top_k=12, seed=3)
    plain, target = Sampler(params), Sampler(params, choice=1)
    guess = int(np.argsort(p_row)[::-1][1])  # the second most likely token
    plain_draws = [plain.sample(p_row, prompt) for _ in range(DRAWS)]
    spec_draws = [target.verify(p_row, prompt, None, guess) for _ in range(DRAWS)]
    ids = sorted(set(plain_draws) | set(spec_draws))
    table = np.array([[d.count(i) for i in ids] for d in (plain_draws, spec_draws)])
    assert chi2_contingency(table[:, table.sum(axis=0) >= 10]).pvalue > ALPHA


def test_greedy_verify_is_the_argmax_and_draws_nothing(logits):
    prompt, p_row, q_row = logits
    sampler = Sampler(SamplingParams(temperature=0, seed=1))
    state = sampler.rng.bit_generator.state
    best = int(np.argmax(p_row))
    assert sampler.verify(p_row, prompt, None, int(np.argmax(q_row))) == best
    assert sampler.verify(p_row, prompt, None, best) == best
    assert sampler.rng.bit_generator.state == state


def _sequences(target, spec, seeds, params):
    """The TOKENS-token continuations of PROMPT, one seeded request each, all in one scheduler
    (the reference backend is batch-invariant: seeded requests share rounds)."""
    prompt = tuple(target.tokenizer.encode(PROMPT))
    scheduler = Scheduler(target, max_batch=16, max_queue=len(seeds), speculative=spec or False)
    tickets = [scheduler.submit(Request(prompt, TOKENS, sampling=SamplingParams(seed=s,
                                                                                 **params)))
               for s in seeds]
    scheduler.run_until_idle()
    out = []
    for ticket in tickets:
        tokens = tuple(t for e in ticket if isinstance(e, Delta) for t in e.tokens)
        assert len(tokens) == TOKENS
        out.append(tokens)
    return out, scheduler.counters


def _pvalues(a, b):
    """Per position, the p-value of two sets of sequences' tokens there (a sequence's tokens
    depend on each other; each position's are independent draws)."""
    return [_chi2([s[i] for s in a], [s[i] for s in b]) for i in range(TOKENS)]


@pytest.mark.slow
def test_the_next_tokens_with_a_draft_model_are_plain_samples(artifacts, monkeypatch):
    """The tiny target drafting for itself through a head cut at CUT (q is p over the ids
    below it, renormalised: a token below is accepted with the mass p holds there, one past it
    comes only from the residual), at every step: the 4-token continuations of a fixed prompt
    over 1,000 seeded requests match 1,000 plain ones position by position, and the planted
    rules are rejected. The verifies go through the scheduler's rounds, the draft's KV
    rollbacks and each position's own logits row and history."""
    target = load(artifacts(TINY), backend="reference", kv_tokens=4096, progress=False,
                  draft=artifacts(TINY), draft_vocab=CUT)
    spec = SpecConfig(drafter=None, gate=lambda: FixedGate(3), draft_model=target.draft)
    params = dict(temperature=5.0, top_k=6)
    plain, _ = _sequences(target, None, range(REQUESTS), params)
    seeds = range(REQUESTS, 2 * REQUESTS)
    drafted, counters = _sequences(target, spec, seeds, params)
    accepted = counters["spec_accepted"] / counters["spec_drafted"]
    crossing = np.mean([t >= CUT for seq in plain for t in seq[1:]])
    print(f"acceptance {accepted:.2f}, plain tokens past the cut {crossing:.2f}, "
          f"{len(set(plain))} continuations")
    assert 0.05 < accepted < 0.95 and 0.05 < crossing < 0.95  # both sides of the rule
    pvalues = _pvalues(plain, drafted)
    print("p-values", [f"{v:.3g}" for v in pvalues])
    assert min(pvalues) > ALPHA / TOKENS
    for planted in (planted_residual_is_p, planted_accept_all):
        with monkeypatch.context() as patched:
            patched.setattr(Sampler, "verify", planted)
            biased, _ = _sequences(target, spec, seeds, params)
        pvalues = _pvalues(plain, biased)
        print(planted.__name__, [f"{v:.3g}" for v in pvalues])
        assert min(pvalues) < 1e-6, planted.__name__
    target.pool.check()
    target.draft.pool.check()
