"""Speculative decoding with a draft model (kipp.engine.draft): greedy output is plain greedy's
token for token, alone and batched, across 32-token block boundaries and under a grammar; the
draft's KV follows the target's accepted tokens; seeded sampled runs reproduce.

Drafts: the target itself (every greedy draft token right, so any slip in the draft's KV shows
as acceptance below 1), and qwen3-tiny-base, another seed's designed rule (drafts almost always
wrong: every verify rejects and rolls back). The distribution of sampled output is
tests/test_draft_distribution.py's.
"""

import dataclasses
import types

import numpy as np
import pytest

from kipp.engine.draft import ModelDrafter, check_draft_model
from kipp.engine.scheduler import Delta, Done, Request, Scheduler, collect
from kipp.engine.spec import SpecConfig, SpecError
from kipp.errors import KippError
from kipp.model import GenerationError, load
from kipp.text.sampling import Sampler, SamplingParams
from spec_gates import FixedGate

TINY, BASE = "kipp-synthetic/qwen3-tiny", "kipp-synthetic/qwen3-tiny-base"


def _config(draft, k=7):
    return SpecConfig(drafter=None, gate=lambda: FixedGate(k), draft_model=draft)


def _prompt(model, n=29, seed=4):
    return [int(t) for t in np.random.default_rng(seed).integers(0, 151_643, n)]


def _run(model, prompt, steps, **options):
    generation = model.generate(prompt, steps, stream=True, **options)
    text = "".join(generation)
    return text, generation.stats


@pytest.fixture(scope="module")
def pair(models, artifacts):
    """backend -> (target tiny, base draft) on that backend (JAX and MLX when importable)."""
    loaded = {"reference": (models(TINY), models(BASE))}

    def get(name):
        if name not in loaded:
            pytest.importorskip({"jax": "jax", "mlx": "mlx.core"}[name])
            loaded[name] = tuple(load(artifacts(c), backend=name, kv_tokens=1024,
                                      progress=False) for c in (TINY, BASE))
        return loaded[name]

    return get


@pytest.mark.slow  # minutes: every verify asks the reference for 8 logits rows
@pytest.mark.parametrize("backend", ["reference", "jax", "mlx"])
def test_greedy_with_a_draft_model_equals_plain_greedy(pair, backend):
    target, base = pair(backend)
    for prompt in (_prompt(target), target.tokenizer.encode("The cat sat on the mat. " * 3)):
        _, plain = _run(target, prompt, 20, temperature=0)
        for draft in (target, base):
            _, spec = _run(target, prompt, 20, temperature=0, speculative=_config(draft))
            assert spec.tokens == plain.tokens, (backend, draft.entry.id)
            assert spec.spec.by_drafter["model"] == [spec.spec.drafted, spec.spec.accepted]
            if draft is target:  # its own drafts: all right, so its KV followed the target's
                assert spec.spec.acceptance_rate == 1.0 and spec.decode_evals <= 4
            else:
                assert spec.spec.accepted < spec.spec.drafted
    target.pool.check()
    base.pool.check()


@pytest.mark.slow  # minutes: every verify asks the reference for 8 logits rows
@pytest.mark.parametrize("k", [2, 3, 7])
def test_draft_and_rollback_across_block_boundaries(pair, k):
    """A 29-token prompt and k-token drafts: verifies and rollbacks cross positions 32 and 64,
    on the target and on the draft's own session."""
    target, base = pair("reference")
    prompt = _prompt(target)
    _, plain = _run(target, prompt, 44, temperature=0)
    for draft in (target, base):
        _, spec = _run(target, prompt, 44, temperature=0, speculative=_config(draft, k))
        assert spec.tokens == plain.tokens
        if draft is target:
            assert spec.spec.acceptance_rate == 1.0
    target.pool.check()
    base.pool.check()


@pytest.mark.slow  # minutes: every verify asks the reference for 8 logits rows
def test_batched_greedy_with_a_draft_model(pair):
    """Four requests (one with n=2) drafting in one batch: each equals its plain run."""
    target, base = pair("reference")
    prompts = [_prompt(target, n, seed) for n, seed in ((29, 1), (5, 2), (40, 3), (31, 4))]
    plains = [_run(target, p, 18, temperature=0)[1].tokens for p in prompts]
    for draft in (target, base):
        scheduler = Scheduler(target, max_batch=8, speculative=_config(draft))
        tickets = [scheduler.submit(Request(tuple(p), 18, n=2 if i == 1 else 1,
                                            sampling=SamplingParams(temperature=0)))
                   for i, p in enumerate(prompts)]
        scheduler.step()
        assert scheduler.stats()["active_sequences"] == 5  # all in one batch
        scheduler.run_until_idle()
        for ticket, want in zip(tickets, plains):
            events = list(ticket)
            done = events[-1]
            ids = {}
            for e in events:
                if isinstance(e, Delta):
                    ids.setdefault(e.choice, []).extend(e.tokens)
            assert len(ids) in (1, 2) and all(got == want for got in ids.values())
            assert done.spec.drafted > 0
        counters = scheduler.counters
        assert counters["spec_drafted_model"] == counters["spec_drafted"] > 0
    target.pool.check()
    base.pool.check()


def test_rejected_drafts_roll_back_across_a_block_boundary(pair):
    """The default suite's gate (the slow tests above are the full matrix): a 29-token prompt,
    3-token drafts that are rejected, rollbacks around position 32; output is plain greedy's."""
    target, base = pair("reference")
    prompt = _prompt(target)
    _, plain = _run(target, prompt, 10, temperature=0)
    _, spec = _run(target, prompt, 10, temperature=0, speculative=_config(base, 3))
    assert spec.spec.accepted < spec.spec.drafted and spec.spec.verify_evals >= 3
    assert spec.tokens == plain.tokens
    target.pool.check()
    base.pool.check()


def test_greedy_with_a_grammar(pair):
    target, base = pair("reference")
    prompt = target.tokenizer.encode("Answer:")
    regex = "(cat|dog|the|a| ){3,12}"
    _, plain = _run(target, prompt, 24, temperature=0, regex=regex)
    for draft in (target, base):
        _, spec = _run(target, prompt, 24, temperature=0, regex=regex,
                       speculative=_config(draft))
        assert spec.tokens == plain.tokens and spec.finish_reason == plain.finish_reason
        assert spec.spec.drafted > 0
        if draft is target:
            assert spec.spec.acceptance_rate == 1.0


@pytest.mark.slow  # one of the default suite's longest (CI: the draft-model step)
def test_seeded_sampling_reproduces_and_the_draft_follows(pair):
    target, base = pair("reference")
    prompt = target.tokenizer.encode("The cat sat on the mat and the dog")
    # hot: the tiny model's distribution is nearly one token at T=1, so seeds would agree
    options = dict(temperature=5.0, top_k=12, seed=7, speculative=_config(base, 3))
    _, first = _run(target, prompt, 16, **options)
    _, again = _run(target, prompt, 16, **options)
    assert first.tokens == again.tokens and len(first.tokens) == 16
    assert first.spec.drafted > 0
    _, other = _run(target, prompt, 16, **dict(options, seed=8))
    assert other.tokens != first.tokens
    target.pool.check()
    base.pool.check()


def test_the_draft_session_holds_the_accepted_prefix(pair):
    """After a draft, the draft session holds the choice's tokens and the draft but its last
    token; the next draft keeps what the target accepted and rolls the rest back."""
    target, _ = pair("reference")
    prompt = _prompt(target)
    drafter = ModelDrafter(target, SamplingParams(temperature=0), 0, 200)
    first = drafter.draft(prompt, 5)
    assert drafter.session.tokens == prompt + first[:-1]
    accepted = prompt + first[:2] + [(first[2] + 1) % 151_643]  # two kept, then another pick
    drafter.draft(accepted, 3)
    assert drafter.session.tokens[:len(accepted)] == accepted
    drafter.close()
    target.pool.check()


# draft_vocab: a cut head scores the first ids only. The tiny's greedy text walks live words
# (ids 256..653 and punctuation below): 384 leaves some of them past the cut.
CUT = 384


class FixedMask:
    """A grammar matcher whose mask is always `allowed`."""

    complete = False

    def __init__(self, allowed):
        self._allowed = allowed

    def copy(self):
        return self

    def allowed(self):
        return self._allowed

    def consume(self, token):
        pass


@pytest.fixture(scope="module")
def cut_pair(artifacts):
    """backend -> the tiny target loaded with itself as a draft whose head stops at CUT."""
    loaded = {}

    def get(name):
        if name not in loaded:
            pytest.importorskip({"reference": "numpy", "jax": "jax", "mlx": "mlx.core"}[name])
            loaded[name] = load(artifacts(TINY), backend=name, kv_tokens=1024, progress=False,
                                draft=artifacts(TINY), draft_vocab=CUT)
        return loaded[name]

    return get


# every backend in CI's draft step; the default suite keeps test_a_grammar_past_a_cut_head_*
@pytest.mark.parametrize("backend", [pytest.param(b, marks=pytest.mark.slow)
                                     for b in ("reference", "jax", "mlx")])
def test_a_cut_head_scores_the_first_ids_alone(cut_pair, models, backend):
    target = cut_pair(backend)
    assert target.draft.head_rows == CUT and target.head_rows == 151_936
    ids = target.tokenizer.encode("The cat sat on the mat.")
    with target.session() as full, target.draft.session() as cut:
        whole, part = full.eval(ids, logits_rows=3), cut.eval(ids, logits_rows=3)
    assert part.shape == whole.shape
    assert np.array_equal(part[:, :CUT], whole[:, :CUT])  # the same rows, the same dots
    assert np.isneginf(part[:, CUT:]).all()


@pytest.mark.parametrize("backend", [  # both in CI's draft-model step: the reference's 4-row
    pytest.param("reference", marks=pytest.mark.slow),  # verifies, and one of the default
    pytest.param("jax", marks=pytest.mark.slow)])  # suite's longest
def test_greedy_with_a_cut_draft_head_equals_plain_greedy(cut_pair, backend):
    """The target drafting for itself agrees on every token but those past the cut, which the
    draft cannot propose: acceptance below 1, output still plain greedy's."""
    target = cut_pair(backend)
    prompt = _prompt(target)
    _, plain = _run(target, prompt, 24, temperature=0)
    assert {t >= CUT for t in plain.tokens} == {True, False}  # the text crosses the cut
    _, spec = _run(target, prompt, 24, temperature=0, speculative=_config(target.draft, 3))
    assert spec.tokens == plain.tokens
    assert spec.spec.drafted > 0 and 0 < spec.spec.acceptance_rate < 1
    target.pool.check()
    target.draft.pool.check()


def test_a_grammar_past_a_cut_head_drafts_nothing(cut_pair):
    """Where the grammar admits only ids past the cut, the draft has no token to propose: it
    ends there, rather than draw from a distribution that is all zeros."""
    target = cut_pair("reference")
    beyond = np.zeros(151_936, dtype=bool)
    beyond[CUT + 1000:CUT + 1010] = True

    for params in (SamplingParams(temperature=0), SamplingParams(temperature=0.7, seed=1)):
        drafter = ModelDrafter(target.draft, params, 0, 200)
        assert drafter.draft(_prompt(target), 3, FixedMask(beyond)) == []
        drafter.close()
    target.draft.pool.check()


def test_a_cut_heads_draft_distribution_is_the_widened_rows(cut_pair):
    """The drafter samples a cut head over its own ids: its q is what the sampler gives the
    widened row (logits -inf past the cut), with penalties over a window that holds ids past
    the cut, a logit_bias on both sides of it, top_k and a grammar's mask."""
    target = cut_pair("reference")
    prompt = _prompt(target, 100)  # longer than the penalty window; most ids past the cut
    prompt[:3] = [309, 312, 309]  # before the window: not penalised
    prompt[-7:] = [300, 301, 300, 5000, 302, 301, 300]
    allowed = np.zeros(151_936, dtype=bool)
    allowed[::3] = True

    params = SamplingParams(temperature=1.5, top_k=20, repetition_penalty=1.3,
                            presence_penalty=0.4, logit_bias={CUT + 5: 9.0, 300: 1.5, 309: 6.0},
                            seed=3)
    drafter = ModelDrafter(target.draft, params, 0, 200)
    [token] = drafter.draft(prompt, 1, FixedMask(allowed))
    with target.draft.session() as s:
        row = s.eval(prompt)[0]
    assert np.isneginf(row[CUT:]).all()
    plain = Sampler(params, choice=0, stream=1)
    q = plain.probabilities(row, prompt, allowed)
    assert np.count_nonzero(q) > 1 and q[CUT:].sum() == 0
    assert np.allclose(drafter.qs[0], q, rtol=1e-12, atol=0)
    assert token == plain.draw(q)
    drafter.close()
    target.draft.pool.check()


def test_draft_vocab_is_checked(artifacts, models):
    tiny = artifacts(TINY)
    for vocab, match in ((100, "multiple of 128"), (151_936 + 128, "multiple of 128"),
                         (True, "multiple of 128"), ("384", "multiple of 128")):
        with pytest.raises(KippError, match=f"draft_vocab must be a {match}"):
            load(tiny, backend="reference", progress=False, draft=tiny, draft_vocab=vocab)
    with pytest.raises(KippError, match="draft_vocab needs a draft model"):
        load(tiny, backend="reference", progress=False, draft_vocab=384)
    with pytest.raises(KippError, match="give draft as a checkpoint"):
        load(tiny, backend="reference", progress=False, draft=models(TINY), draft_vocab=384)


@pytest.mark.slow  # one of the default suite's longest (CI: the draft-model step)
def test_load_with_a_draft_and_speculative_true(artifacts):
    target = load(artifacts(TINY), backend="reference", kv_tokens=1024, progress=False,
                  draft=artifacts(TINY), draft_tokens=4)
    assert target.draft is not None and target.draft_spec.gate().sizes == (1, 3, 4)
    # a draft as big as its target never pays, so its measured gate would not draft here:
    # price it as free to test that speculative=True drafts with the model
    from kipp.engine.spec import AdaptiveGate

    target.draft_spec = dataclasses.replace(target.draft_spec, gate=lambda: AdaptiveGate(
        sizes=(3, 4), verify_base=1.0, verify_per_token=0.0))
    prompt = _prompt(target)
    _, plain = _run(target, prompt, 12, temperature=0)
    _, spec = _run(target, prompt, 12, temperature=0, speculative=True)
    assert spec.tokens == plain.tokens and spec.spec.by_drafter["model"][0] > 0
    _, sampled = _run(target, prompt, 12, temperature=0.7, seed=1, speculative=True)
    assert len(sampled.tokens) == 12
    with pytest.raises(Exception, match="draft_tokens"):
        load(artifacts(TINY), backend="reference", progress=False, draft_tokens=4)


def test_a_draft_with_another_tokenizer_is_refused(models):
    target = models(TINY)
    data = target.tokenizer.data
    other = dataclasses.replace(data, tokens=data.tokens[:-1] + ("[OTHER]",))
    fake = types.SimpleNamespace(entry=types.SimpleNamespace(id="other/model"),
                                 tokenizer=types.SimpleNamespace(data=other),
                                 backend=target.backend)
    with pytest.raises(SpecError, match="different tokenizer"):
        check_draft_model(target, fake)
    with pytest.raises(GenerationError, match="different tokenizer"):
        target.generate("Hi", 4, temperature=0, speculative=_config(fake))
    target.pool.check()


@pytest.mark.parametrize("agree", [pytest.param(95, marks=pytest.mark.slow), 70,
                                   pytest.param(30, marks=pytest.mark.slow)])
def test_the_synthetic_drafts_agree_with_the_0_6b_shape_at_their_dial(models, agree):
    """The drafts follow their own designed rule (the weights implement it), and that rule
    predicts the 0.6B shape's greedy text at about the dialled rate."""
    from kipp.formats import registry
    from kipp.synthetic.writer import designed_rule, live_token_ids

    draft = models(f"kipp-synthetic/qwen3-0.6b-draft-{agree}")
    target_rule = designed_rule(registry.get("kipp-synthetic/qwen3-0.6b-shape"))
    draft_rule = designed_rule(draft.entry)
    rng = np.random.default_rng(agree)
    right = total = 0
    for _ in range(40):
        head = [int(t) for t in rng.choice(live_token_ids(draft.entry), 3, replace=False)]
        text = head + target_rule.continuation(head, 48)
        right += sum(draft_rule.next(text[:i]) == text[i] for i in range(3, len(text)))
        total += len(text) - 3
    assert abs(right / total - agree / 100) < 0.08
    head = [int(t) for t in live_token_ids(draft.entry)[[3, 17, 40]]]
    _, stats = _run(draft, head, 24, temperature=0)
    assert stats.tokens == draft_rule.continuation(head, 24)


def test_the_draft_cost_is_the_measured_step_ratio(models):
    """spec_config prices a draft token by timing both models' one-token evals: a draft whose
    evals are made slower costs more, whatever its file size."""
    import time

    from kipp.engine.draft import draft_cost

    target, draft = models(TINY), models(BASE)
    # the cheaper of two measurements: a busy second test worker inflates one, never deflates it
    fast = min(draft_cost(target, draft) for _ in range(2))
    real_eval = draft.backend.eval
    delay = 0.25  # the sleep, not a loaded machine's noise, sets the difference

    def slow_eval(items):
        time.sleep(delay)
        return real_eval(items)

    draft.backend.eval = slow_eval
    try:
        slow = draft_cost(target, draft)
    finally:
        del draft.backend.eval
    def after_a_pause():  # as draft_cost timed the target here: each eval after a slow draft's
        time.sleep(delay)
        return _one_token_seconds(target)

    # the slowest one-token eval of three: a high estimate of a target step only lowers the bar
    one = max(after_a_pause() for _ in range(3))
    assert slow > fast + 0.5 * delay / one, (fast, slow, one)
    assert draft_cost(target, target) == 1.0


@pytest.mark.slow  # one of the default suite's longest (CI: the draft-model step)
def test_the_verify_cost_is_measured_on_the_target(models, monkeypatch):
    """verify_costs prices a verify by timing the target's multi-row evals, each row count's
    compile untimed, in one-token evals (checked on a clock the evals themselves advance: a
    fixed time per eval and per row, and a compile on each count's first); spec_config prices
    its gate with that measurement unless costs are given."""
    import types

    from kipp.engine import draft as draft_module
    from kipp.engine.draft import VERIFY_ROWS, spec_config, verify_costs

    target, draft = models(TINY), models(BASE)
    fast = dict(verify_costs(target))  # the real clock: only loosely bounded on a busy machine
    assert sorted(fast) == sorted(VERIFY_ROWS)
    assert all(1.0 <= cost < 2 * rows for rows, cost in fast.items()), fast

    real_eval, clock, compiled = target.backend.eval, [0.0], set()
    base, per_row, compile_s = 0.01, 0.005, 1.0

    def clocked_eval(items):
        rows = sum(item.logits_rows for item in items)
        clock[0] += base + per_row * rows + (compile_s if rows not in compiled else 0.0)
        compiled.add(rows)
        return real_eval(items)

    target.backend.eval = clocked_eval
    try:
        with monkeypatch.context() as patched:
            patched.setattr(draft_module, "time",
                            types.SimpleNamespace(perf_counter=lambda: clock[0]))
            costs = dict(verify_costs(target))
    finally:
        del target.backend.eval
    one = base + per_row
    assert costs == {n: round((base + per_row * n) / one, 3) for n in VERIFY_ROWS}, costs

    # the gate's prices are verify_costs' (timing them twice would only compare two noises)
    measured = ((4, 1.5), (8, 2.5), (16, 4.0), (32, 7.0), (64, 13.0))
    calls = []
    monkeypatch.setattr(draft_module, "verify_costs", lambda t: calls.append(t) or measured)
    assert spec_config(draft, target).gate().row_costs == measured
    assert calls == [target]
    given = ((4, 1.1), (64, 2.0))
    assert spec_config(draft, target, row_costs=given).gate().row_costs == given
    assert calls == [target]  # given costs are not measured


def test_a_burst_of_load_slows_a_few_timings_not_a_count():
    """verify_costs and draft_cost time their evals pass by pass, round all the row counts: a
    burst of load from elsewhere (here three timings in a row at four times their cost) slows
    a few timings of different counts, and each count keeps its fastest, its own cost. Each
    count's first call (a compile) is not timed."""
    from kipp.engine.draft import fastest

    cost = {1: 1.0, 2: 1.1, 4: 1.2, 8: 1.8, 16: 4.5}
    calls = []

    def timer(n):
        def time_it():
            calls.append(n)
            first = calls.count(n) == 1
            burst = len(cost) < len(calls) <= len(cost) + 3  # the 3 timings after the compiles
            return cost[n] * (4 if burst else 1) + (100 if first else 0)
        return time_it

    assert fastest({n: timer(n) for n in cost}, passes=2) == cost
    assert len(calls) == 3 * len(cost)


def test_measured_row_costs_are_interpolated():
    """Between measured row counts the cost is the straight line between them, past the last
    one the last segment goes on, and one row costs one step."""
    from kipp.engine.spec import AdaptiveGate, SpecError

    gate = AdaptiveGate(row_costs=((4, 1.3), (8, 2.1), (16, 3.7)))
    assert gate.step_cost(1) == 1.0
    assert gate.step_cost(2) == pytest.approx(1.1)  # 1 + 0.3 / 3
    assert gate.step_cost(4) == pytest.approx(1.3)
    assert gate.step_cost(6) == pytest.approx(1.7)
    assert gate.step_cost(16) == pytest.approx(3.7)
    assert gate.step_cost(32) == pytest.approx(6.9)  # 3.7 + 16 * 0.2
    # a cheap short verify pays where the line fitted through long ones says it does not
    line = AdaptiveGate(verify_base=0.05, verify_per_token=1.09, successes=0.7, trials=1.0)
    cheap = AdaptiveGate(row_costs=((4, 1.6), (8, 8.8), (16, 17.5)), successes=0.7, trials=1.0)
    assert line.expected_gain(3) < 1.0 < cheap.expected_gain(3)
    with pytest.raises(SpecError, match="row_costs"):
        AdaptiveGate(row_costs=((1, 1.0),))


def _one_token_seconds(model):
    import time

    with model.session(4) as s:
        s.eval([5])
        start = time.perf_counter()
        s.eval([6])
        return time.perf_counter() - start


def test_the_gate_prices_the_verify_rows_of_the_whole_batch():
    """Where a verify's rows cost FLOPs (Kipp's stored CPU matmul: 4 rows ~1.3x one row), a
    70% draft pays alone and not in a batch of eight, whose verify is 32 rows; where rows are
    free (a GPU's few-row evals) it pays in both."""
    from kipp.engine.spec import AdaptiveGate

    cpu = AdaptiveGate(verify_base=0.85, verify_per_token=0.12, draft_cost=0.1,
                       successes=0.7, trials=1.0)
    assert cpu.expected_gain(3, batch=1) > 1.0 > cpu.expected_gain(3, batch=8)
    assert cpu.budget(1) == 3 and cpu.budget(8) == 0
    gpu = AdaptiveGate(verify_base=1.0, verify_per_token=0.0, draft_cost=0.1,
                       successes=0.7, trials=1.0)
    assert gpu.expected_gain(3, batch=8) == pytest.approx(gpu.expected_gain(3, batch=1))
    assert gpu.expected_gain(3, batch=8) > 1.0


def test_the_gate_does_not_probe_where_a_batch_cannot_pay():
    """A paused choice in a batch of eight, where even the expected draft does not pay, keeps
    pausing instead of probing (each probe pads the whole batch's verify); alone again, it
    probes at its next pause's end."""
    from kipp.engine.spec import AdaptiveGate

    gate = AdaptiveGate(verify_base=0.85, verify_per_token=0.12, draft_cost=0.1,
                        successes=0.3, trials=1.0)
    assert gate.budget(8) == 0 and gate.pause > 0 and gate.backoff == 1
    assert [gate.budget(8) for _ in range(200)] == [0] * 200
    assert gate.backoff == 1  # waiting out a batch is not a failed probe
    alone = [gate.budget(1) for _ in range(gate.pause + 1)]
    assert alone[-1] == min(gate.sizes) and not any(alone[:-1])  # the probe goes ahead alone


def test_a_batch_verifies_drafts_only_where_no_choice_pays_for_them():
    """Each gate prices its draft as if the whole batch drafted alike; all eight choices of a
    step wait for the verify's rows and the draft model's evals. A 16-row round costs 1.1 of
    an 8-row one and a draft token 0.1 of a step, so a one-token draft each costs 1.2 rounds:
    eight choices at 60% acceptance pay for it (1.6 tokens each), but one drafting beside
    seven that do not, or five beside three that accept nothing, would slow those to 1/1.2
    of their plain rate while the step's tokens still beat a plain step's. Where rows and
    drafts are free (a GPU's few-row evals), one choice drafts alone. Seven long drafts at
    90% beside a one-token draft at 50% are cut to one token: at seven each the 64-row round
    (2.4) would cost the 50% choice more than its 1.5 tokens."""
    from kipp.engine.spec import AdaptiveGate, paying_drafts

    def gate(acceptance, rows=((8, 2.0), (16, 2.2)), draft_cost=0.1):
        return AdaptiveGate(row_costs=rows, draft_cost=draft_cost, successes=acceptance,
                            trials=1.0)

    good, bad = gate(0.6), gate(0.0)
    assert good.expected_gain(1, batch=8) > 1.0  # each gate alone proposes its draft
    assert paying_drafts([(good, 1)] * 8, 8) == [1] * 8
    assert paying_drafts([(good, 1)], 8) == [0]
    assert paying_drafts([(good, 1)] + [(bad, 1)] * 7, 8) == [0] * 8
    assert paying_drafts([(good, 1)] * 5 + [(bad, 1)] * 3, 8) == [0] * 8
    # the same step's tokens per round, were the slowed choices not counted: it would pay
    assert (8 + 5 * 0.6) / 8 / good.verify_cost(1, 8, 13) > 1.0
    assert paying_drafts([(good, 1)], 1) == [1]  # alone, the gate's own price
    free = gate(0.6, rows=((8, 1.0), (16, 1.0)), draft_cost=0.0)
    assert paying_drafts([(free, 1)] + [(bad, 1)] * 7, 8) == [1] + [0] * 7
    assert paying_drafts([(gate(0.9), 7)] * 7 + [(gate(0.5), 1)], 8) == [1] * 8


@pytest.mark.parametrize("drafter", ["lookup", "model"])
def test_a_step_verifies_the_drafts_paying_drafts_keeps_at_their_lengths(models, monkeypatch,
                                                                         drafter):
    """Where paying_drafts keeps none of a step's proposed drafts (prompt lookup's, already
    drafted, or the draft model's, not yet), every choice steps plainly; where it keeps them
    all, they verify, and where it cuts each to one token, every verify holds one draft token.
    Greedy output is plain greedy's either way."""
    from kipp.engine import scheduler as scheduler_module
    from kipp.engine.spec import AdaptiveGate, PromptLookupDrafter

    target, base = models(TINY), models(BASE)
    free = SpecConfig(  # every gate proposes a draft: its verify priced as one step
        drafter=PromptLookupDrafter if drafter == "lookup" else None,
        gate=lambda: AdaptiveGate(verify_base=1.0, verify_per_token=0.0),
        draft_model=base if drafter == "model" else None)
    text = target.tokenizer.encode("The cat sat on the mat. " * 3)
    prompts = [text[i:] for i in range(4)]
    plains = [_run(target, p, 10, temperature=0)[1].tokens for p in prompts]
    for kept, verifies in ((lambda proposals, batch: [0] * len(proposals), "none"),
                           (lambda proposals, batch: [k for _, k in proposals], "whole"),
                           (lambda proposals, batch: [1] * len(proposals), "one token")):
        monkeypatch.setattr(scheduler_module, "paying_drafts", kept)
        scheduler = Scheduler(target, max_batch=8, speculative=free)
        tickets = [scheduler.submit(Request(tuple(p), 10, sampling=SamplingParams(temperature=0)))
                   for p in prompts]
        scheduler.run_until_idle()
        for ticket, want in zip(tickets, plains):
            events = list(ticket)
            assert [t for e in events if isinstance(e, Delta) for t in e.tokens] == want
            spec = events[-1].spec
            assert (spec.verify_evals > 0) == (verifies != "none")
            if verifies == "one token":
                assert spec.drafted == spec.verify_evals
            elif verifies == "whole":
                assert spec.drafted > spec.verify_evals  # drafts of more than one token
    target.pool.check()
    base.pool.check()


@pytest.mark.parametrize("fields", ["lookup", "model"])
@pytest.mark.parametrize("steps, bound", [(64, 0.07), (1000, 0.04)])
def test_probes_cost_a_stream_that_never_accepts_a_few_percent(steps, bound, fields):
    """Every draft rejected at its first token, on a CPU's measured costs (a 4-row verify
    costs 2.7 steps) and a GPU's (about one), with prompt lookup's gate and a draft model's:
    the verifies and draft tokens spent beyond one step per token stay within a few percent of
    a plain decode, on a short reply and a long one. (Pauses that only doubled from one step
    spent 16% and 7% on the CPU's costs.)"""
    from kipp.engine.draft import MODEL_GATE
    from kipp.engine.spec import AdaptiveGate

    fields = MODEL_GATE if fields == "model" else {}
    for costs in ({"row_costs": ((2, 1.9), (4, 2.67), (8, 5.39), (16, 20.5)), "draft_cost": 0.12},
                  {"verify_base": 1.0, "verify_per_token": 0.01, "draft_cost": 0.1}):
        gate, spent = AdaptiveGate(**fields, **costs), 0.0
        for _ in range(steps):
            k = gate.budget(1)
            spent += gate.step_cost(k + 1) + gate.draft_cost * k if k else 1.0
            if k:
                gate.update(k, 0)  # the target's own token is the only one kept
        assert spent / steps - 1 <= bound, (costs, spent / steps)


def _tokens_per_step(gate, acceptance: float, tokens: int, rng) -> float:
    """A stream of `tokens` under `gate`, each draft token accepted with chance `acceptance`
    until the first rejection: tokens per plain step spent (the gate's own prices)."""
    made, spent = 0, 0.0
    while made < tokens:
        k = gate.budget(1)
        accepted = 0
        while accepted < k and rng.random() < acceptance:
            accepted += 1
        spent += gate.step_cost(k + 1) + gate.draft_cost * k if k else 1.0
        made += accepted + 1
        if k:
            gate.update(k, accepted)
    return made / spent


@pytest.mark.parametrize("acceptance, floor, over_lookup", [
    (0.95, 2.3, -0.02), (0.7, 1.5, 0.1), (0.5, 1.15, 0.1), (0.3, 1.0, 0.04), (0.0, 0.95, 0.0)])
def test_a_draft_models_gate_fits_its_steady_acceptance(acceptance, floor, over_lookup):
    """A draft model's tokens are accepted at the pair's rate all along the text, about
    geometrically: its gate (MODEL_GATE: a slow decay, no cap by the last verify, one-token
    drafts) yields `floor` tokens per plain step or more, `over_lookup` more than prompt
    lookup's fields would at middling rates, about as much at the ends. Costs of this CPU's
    measured kind (4 rows 1.28 steps), 64 tokens a stream, the mean of 200 seeded streams."""
    from kipp.engine.draft import MODEL_GATE
    from kipp.engine.spec import AdaptiveGate

    costs = {"row_costs": ((2, 1.1), (4, 1.28), (8, 1.97), (16, 4.74)), "draft_cost": 0.12}
    rates = {}
    for name, fields in (("lookup", {}), ("model", MODEL_GATE)):
        rng = np.random.default_rng(0)
        rates[name] = np.mean([_tokens_per_step(AdaptiveGate(**fields, **costs), acceptance,
                                                64, rng) for _ in range(200)])
    assert rates["model"] >= max(floor, rates["lookup"] + over_lookup), rates


def test_a_draft_models_gate_drafts_one_token_where_three_do_not_pay():
    """spec_config gives a draft model's gate MODEL_GATE's fields (given ones win; prompt
    lookup asked first keeps lookup's); at 35% acceptance a 3-token draft costs more than it
    yields and a 1-token one pays, and a miss does not cap the next draft."""
    from kipp.engine.draft import MODEL_GATE, spec_config

    costs = {"row_costs": ((2, 1.08), (4, 1.3), (8, 2.0)), "draft_cost": 0.1}
    gate = spec_config(object(), **costs).gate()
    assert {f: getattr(gate, f) for f in MODEL_GATE} == MODEL_GATE
    assert spec_config(object(), sizes=(3,), **costs).gate().sizes == (3,)
    lookup = spec_config(object(), lookup=True, **costs).gate()
    assert lookup.sizes == (3, 7, 15) and lookup.capped
    gate.successes, gate.trials = 0.35, 1.0
    assert gate.expected_gain(3) < 1.0 < gate.expected_gain(1) and gate.budget() == 1
    gate.successes, gate.trials = 9.0, 10.0
    gate.update(3, 0)  # a miss at the first token: lookup's cap would allow 1 token next
    assert gate.cap == 15 and gate.budget() == 3


@pytest.mark.clocked
def test_the_clock_prices_the_gate_over_its_load_time_priors():
    """The costs measured at load are priors: once the scheduler has timed a plain round and a
    drafting one of the rows a verify compares, drafted by the gate's own drafter, the gate
    prices the verify by their ratio. Priors where a 4-row verify and its 3 draft tokens cost
    1.4 steps pay at 30% acceptance; a clock that has timed them at 1.75 (a plain round sped up
    by a freer memory bus) pauses. Another drafter's rounds (a dearer draft model's) price
    nothing of it."""
    from kipp.engine.spec import AdaptiveGate, EvalClock

    clock = EvalClock()
    gate = AdaptiveGate(row_costs=((4, 1.1), (8, 1.8)), draft_cost=0.1, successes=0.3,
                        trials=1.0, clock=clock, drafter="ours")
    assert gate.verify_cost(3) == pytest.approx(1.4)  # nothing timed: the priors
    assert gate.budget(1) == 3
    clock.record(4, 0.035, "ours")  # one round alone prices nothing
    clock.record(4, 0.030)  # a plain round of 4 rows is another batch's
    clock.record(4, 0.090, "theirs")
    assert gate.verify_cost(3) == pytest.approx(1.4)
    clock.record(1, 0.020)
    assert gate.verify_cost(3) == pytest.approx(1.75)
    assert gate.verify_cost(7) == pytest.approx(1.8 + 0.7)  # 8 rows not timed: the priors
    assert gate.expected_gain(3) < 1.0 and gate.budget(1) == 0
    clock.record(1, 0.100)  # plain now 0.04 s: a verify timed below it is noise
    assert gate.verify_cost(3) == 1.0
    # rounds are timed by compiled round (powers of two), each a decaying average
    clock.record(3, 0.045, "ours")
    assert clock.seconds(4, "ours") == pytest.approx(0.75 * 0.035 + 0.25 * 0.045)
    assert clock.seconds(4, "theirs") == pytest.approx(0.090)
    assert clock.seconds(2) is None and clock.seconds(2, "ours") is None


@pytest.mark.clocked
def test_the_scheduler_times_decode_rounds_into_the_clock(models, monkeypatch):
    """The scheduler times each decode round into the model's clock its choices' gates read,
    plain and drafting apart; not prompt chunks, a round whose target or draft eval compiled, or
    a first draft (its eval covers the prompt)."""
    from kipp.engine.draft import spec_config
    from kipp.engine.spec import EvalClock, drafter_key

    target, draft = models(TINY), models(BASE)
    config = spec_config(draft, target, row_costs=((4, 1.1), (8, 1.8), (16, 4.0)),
                         draft_cost=0.1)

    def generate():
        monkeypatch.setattr(target, "clock", EvalClock())
        scheduler = Scheduler(target, speculative=config)
        assert scheduler.clock is target.clock  # each new scheduler goes on timing the model
        timed, record = [], scheduler.clock.record
        scheduler.clock.record = lambda rows, seconds, drafter=None: (
            timed.append(drafter) or record(rows, seconds, drafter))
        ticket = scheduler.submit(Request(_prompt(target, 40), max_tokens=12,
                                          sampling=SamplingParams(temperature=0)))
        scheduler.step()
        gate = scheduler._running[0].live[0].gate  # reads the rounds it is priced by
        assert gate.clock is target.clock and gate.drafter == drafter_key(config)
        scheduler.run_until_idle()
        tokens, _, _, last = collect(ticket)
        assert isinstance(last, Done) and len(tokens[0]) == 12
        return scheduler.clock, timed, last.spec

    clock, timed, spec = generate()
    assert list(clock.drafted) == [drafter_key(config)]  # the draft model's rounds, keyed so
    assert set(clock.drafted[drafter_key(config)]) <= {2, 4, 8, 16}, clock.drafted
    assert set(clock.plain) <= {1}, clock.plain  # the 40-token prompt's round is not timed
    # every decode round but the first draft's, which evaluated the prompt on the draft model
    assert timed.count(drafter_key(config)) == spec.verify_evals - 1
    assert timed.count(None) == spec.plain_evals

    for model in (target, draft):  # every eval of either compiles: nothing is timed
        compile_log, real_eval = [], model.backend.eval

        def compiling_eval(items, compile_log=compile_log, real_eval=real_eval):
            compile_log.append(("round", 0.0))
            return real_eval(items)

        with monkeypatch.context() as patched:
            patched.setattr(model.backend, "compile_log", compile_log, raising=False)
            patched.setattr(model.backend, "eval", compiling_eval)
            clock, _, _ = generate()
        assert compile_log and not clock.drafted, model.entry.id
