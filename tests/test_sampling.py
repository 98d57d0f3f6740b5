"""kipp.text.sampling: exact supports, distributions, penalties, seeds and logprobs on full-size
vocabs.

Expected supports and probabilities are computed here independently, in float64, by plainly
sorting the whole vocab. Logits are never all-zero: either seeded normal * 3 (a realistic
spread), or a few hand-picked values embedded at random ids in a full-size vocab whose other
entries sit ~60 nats lower (mass under 1e-8 even at temperature 2: never drawn, never in a
truncated support).
"""

import math

import numpy as np
import pytest

from kipp.errors import KippError
from kipp.text import sampling
from kipp.text.sampling import (
    VOCAB_SIZE,
    Sampler,
    SamplingError,
    SamplingParams,
    _top_p_mask,
    adjusted_logits,
    log_softmax,
    logprobs,
    sample_greedy,
)

V = VOCAB_SIZE


def spread_logits(seed, scale=3.0):
    return (np.random.default_rng(seed).standard_normal(V) * scale).astype(np.float32)


def embedded(values, seed=0):
    """Full-vocab logits with `values` at distinct random ids -> (logits, ids in value order)."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(V) - 60.0).astype(np.float32)
    ids = rng.choice(V, size=len(values), replace=False)
    x[ids] = np.asarray(values, dtype=np.float32)
    return x, ids


def reference(x, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """{id: probability} of the final sampling distribution, by sorting the whole vocab."""
    z = x.astype(np.float64) / temperature
    order = np.lexsort((np.arange(z.size), -z))  # value descending, ties by lower id
    if top_k:
        order = order[:top_k]
    p = np.exp(z[order] - z[order].max())
    p /= p.sum()
    if top_p < 1.0:
        n = int(np.searchsorted(np.cumsum(p), top_p)) + 1
        order, p = order[:n], p[:n]
    keep = p >= min_p * p.max()
    order, p = order[keep], p[keep]
    return dict(zip(order.tolist(), (p / p.sum()).tolist()))


def draw(params, x, n, recent=()):
    sampler = Sampler(params)
    return np.array([sampler.sample(x, recent) for _ in range(n)])


def assert_matches(draws, expected):
    """Draws lie in the expected support, cover it, and fit its probabilities (chi-square)."""
    ids, counts = np.unique(draws, return_counts=True)
    assert set(ids.tolist()) <= set(expected), set(ids.tolist()) - set(expected)
    assert set(ids.tolist()) == set(expected)
    observed = np.array([counts[ids == i].sum() for i in expected], dtype=np.float64)
    want = np.array(list(expected.values())) * len(draws)
    assert want.min() >= 20, "test design: every expected count should be >= 20"
    chi2 = float(((observed - want) ** 2 / want).sum())
    df = len(expected) - 1
    assert chi2 < df + 5 * math.sqrt(2 * df) + 5, (chi2, observed, want)


VALUES = [3.0, 2.6, 2.2, 2.0, 1.9, 1.0, 0.5]


def test_greedy_is_argmax():
    params = SamplingParams(temperature=0.0)
    assert params.is_greedy
    for seed in range(5):
        x = spread_logits(seed)
        want = int(np.argmax(x.astype(np.float64)))
        assert Sampler(params).sample(x, []) == want
        assert sample_greedy(x) == want


def test_greedy_ties_go_to_the_lowest_id():
    x = spread_logits(1)
    x[[90_000, 7, 151_935]] = 50.0
    assert Sampler(SamplingParams(temperature=0.0)).sample(x, []) == 7
    assert sample_greedy(x) == 7
    # top_k=1 is the same deterministic argmax, and draws no random number
    sampler = Sampler(SamplingParams(top_k=1, seed=3))
    state = sampler.rng.bit_generator.state
    assert SamplingParams(top_k=1).is_greedy
    assert sampler.sample(x, []) == 7
    assert sampler.rng.bit_generator.state == state


def test_tiny_temperature_approaches_greedy():
    x, ids = embedded(VALUES, seed=2)
    for t in (1e-3, 1e-40):  # 1e-40 rounds to float32 zero: must not make NaNs
        assert set(draw(SamplingParams(temperature=t, seed=0), x, 100)) == {ids[0]}


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_scales_the_distribution(temperature):
    x, ids = embedded([2.0, 1.0, 0.5, 0.0], seed=3)
    expected = reference(x, temperature=temperature)
    expected = {i: p for i, p in expected.items() if p > 1e-6}  # drop the background
    assert set(expected) == set(ids.tolist())
    assert_matches(draw(SamplingParams(temperature=temperature, seed=4), x, 1500), expected)


@pytest.mark.parametrize(
    "fields",
    [
        dict(top_k=4),
        dict(top_p=0.7),
        dict(min_p=0.35),  # keeps 2.0 (p ratio 0.37), drops 1.9 (0.33)
        dict(temperature=0.8, top_k=5, top_p=0.9, min_p=0.2),
        dict(temperature=1.5, top_p=0.8, min_p=0.25),
    ],
    ids=["top_k", "top_p", "min_p", "all", "top_p+min_p"],
)
def test_truncation_keeps_exactly_the_support(fields):
    x, _ = embedded(VALUES, seed=5)
    expected = reference(x, **fields)
    assert 2 <= len(expected) < len(VALUES)
    assert_matches(draw(SamplingParams(seed=6, **fields), x, 1500), expected)


def test_top_k_ties_at_the_boundary_keep_the_lowest_ids():
    x, ids = embedded([5.0, 4.0, 4.0, 4.0, 4.0], seed=7)
    tied = sorted(ids[1:].tolist())
    expected = {int(ids[0]), tied[0], tied[1]}
    assert set(reference(x, top_k=3)) == expected
    draws = draw(SamplingParams(top_k=3, seed=8), x, 400)
    assert set(draws.tolist()) == expected


def test_top_p_over_a_spread_vocab_stays_inside_the_support():
    # hundreds of candidates, through the full-vocab (bucketed) top_p path
    x = spread_logits(9)
    expected = reference(x, top_p=0.8)
    assert len(expected) > 500
    draws = draw(SamplingParams(top_p=0.8, seed=10), x, 300)
    assert set(draws.tolist()) <= set(expected)


@pytest.mark.parametrize("floors", ["candidates", "buckets"])
@pytest.mark.parametrize("scale", [0.3, 1.0, 3.0, 8.0])
@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.999])
def test_top_p_mask_equals_a_full_sort(scale, top_p, floors, monkeypatch):
    # Both ways to the cut must equal a plain sort exactly: sorting the few weights above a
    # floor (the peaked scales, 3 and 8) and the value buckets (the flat ones, and every scale
    # with no floor). Rounding logits to 1/8 makes many exact ties, so the tie rule (lower id
    # first) is exercised at the cut.
    if floors == "buckets":
        monkeypatch.setattr(sampling, "_TOP_P_FLOORS", ())
    x = np.round(spread_logits(11, scale) * 8) / 8
    w = np.exp(x - x.max()).astype(np.float32)
    n = w.size
    scratch = np.empty(n), np.empty(n, dtype=np.intp), np.empty(n, dtype=bool)
    keep = _top_p_mask(w, top_p, *scratch)
    order = np.lexsort((np.arange(n), -w))
    cdf = np.cumsum(w[order].astype(np.float64))
    cut = int(np.searchsorted(cdf, top_p * cdf[-1])) + 1
    assert np.array_equal(np.flatnonzero(keep), np.sort(order[:cut]))


@pytest.mark.parametrize("size", [V, 1000])
def test_draw_from_a_distribution_keeps_its_support_and_probabilities(size):
    # Sampler.draw (a draft's token, a verify's residual): whole blocks of zero weight, a lone
    # id in the last, partial block (1000 is not a multiple of the draw's blocks), ids at both
    # ends, three ids in one block; nothing of weight 0 is drawn and the draws fit the weights.
    rng = np.random.default_rng(14)
    ids = np.r_[0, 300, 301, 350, np.sort(rng.choice(np.arange(400, size - 1), 3,
                                                       replace=False)), size - 1]
    p = np.zeros(size)
    p[ids] = rng.random(ids.size) + 0.5
    p /= p.sum()
    sampler = Sampler(SamplingParams(seed=15), vocab_size=size)
    draws = np.array([sampler.draw(p) for _ in range(3000)])
    assert_matches(draws, dict(zip(ids.tolist(), p[ids].tolist())))


def test_top_p_cut_among_weights_tied_at_a_floor():
    # The cut falls inside a run of weights exactly at the first floor: the tied ones at and
    # above it are candidates, and the lower ids among them are kept.
    floor = sampling._TOP_P_FLOORS[0]
    rng = np.random.default_rng(13)
    # the rest below the first floor, and too many above the second to sort
    w = (rng.random(V) * floor / 4).astype(np.float32)
    ids = rng.choice(V, size=301, replace=False)
    w[ids[0]] = 1.0
    w[ids[1:]] = floor
    w[ids[-1]] = 2 * floor  # one above the tie, whatever its id
    n = w.size
    target = (1.0 + 2 * floor + 150 * floor) / w.sum(dtype=np.float64)  # 150 of the tie
    keep = _top_p_mask(w, target - 1e-9, np.empty(n), np.empty(n, dtype=np.intp),
                       np.empty(n, dtype=bool))
    tied = np.sort(ids[1:-1])
    assert np.array_equal(np.flatnonzero(keep), np.sort(np.r_[ids[0], ids[-1], tied[:150]]))


def penalty_case():
    rng = np.random.default_rng(12)
    x = spread_logits(12)
    pool = rng.choice(V, size=20, replace=False)
    x[pool[:10]] = np.abs(x[pool[:10]]) + 0.5  # both signs, for the repetition rule
    x[pool[10:]] = -np.abs(x[pool[10:]]) - 0.5
    old = rng.choice(np.setdiff1d(np.arange(V), pool), size=36, replace=False)
    recent = old.tolist() + rng.choice(pool, size=64).tolist()
    return x, recent


def test_penalties_change_exactly_the_window_tokens_by_the_formula():
    x, recent = penalty_case()
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.7, repetition_penalty=1.3)
    before = x.copy()
    out = adjusted_logits(x, recent, params)
    assert np.array_equal(x, before), "the caller's logits changed"
    window_ids, counts = np.unique(recent[-64:], return_counts=True)
    changed = np.flatnonzero(out != x)
    assert np.array_equal(changed, window_ids)  # the 36 older tokens are untouched
    v = x[window_ids].astype(np.float64)
    want = np.where(v > 0, v / 1.3, v * 1.3) - (counts * 0.5 + 0.7)
    np.testing.assert_allclose(out[window_ids], want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("window", [0, 8])
def test_penalty_window_size(window):
    x, recent = penalty_case()
    params = SamplingParams(presence_penalty=1.0, penalty_window=window)
    changed = np.flatnonzero(adjusted_logits(x, recent, params) != x)
    assert np.array_equal(changed, np.unique(recent[len(recent) - window :] if window else []))


def test_logit_bias_comes_before_the_penalties():
    x, recent = penalty_case()
    t = recent[-1]
    params = SamplingParams(logit_bias={t: 5.0, 3: -2.0}, repetition_penalty=2.0)
    out = adjusted_logits(x, recent, params)
    biased = float(x[t]) + 5.0
    want = biased / 2.0 if biased > 0 else biased * 2.0
    assert out[t] == pytest.approx(want, rel=1e-6)
    assert out[3] == pytest.approx(float(x[3]) - 2.0, rel=1e-6)


def test_logit_bias_forces_and_bans():
    x = spread_logits(13)
    assert set(draw(SamplingParams(logit_bias={4242: 100}, seed=1), x, 100)) == {4242}
    x[777] = 25.0  # dominant: ~1 - 1e-4 of the mass
    banned = SamplingParams(logit_bias={777: -100}, seed=2)
    assert 777 not in set(draw(banned, x, 300).tolist())
    greedy = SamplingParams(temperature=0, logit_bias={777: -100})
    others = x.copy()
    others[777] = -np.inf
    assert Sampler(greedy).sample(x, []) == int(np.argmax(others))


def test_sample_never_writes_the_callers_logits():
    x, recent = penalty_case()
    before = x.copy()
    x.setflags(write=False)  # any write would raise
    params = SamplingParams(
        top_p=0.9, min_p=0.01, frequency_penalty=1, repetition_penalty=1.2, logit_bias={9: 3}
    )
    token = Sampler(params).sample(x, recent)
    assert 0 <= token < len(x) and np.array_equal(x, before)


def run(sampler, x, n=50):
    return [sampler.sample(x, []) for _ in range(n)]


def test_same_seed_repeats_and_different_seeds_differ():
    x = spread_logits(14, scale=1.0)
    params = SamplingParams(top_p=0.95, seed=123)
    assert run(Sampler(params), x) == run(Sampler(params), x)
    assert run(Sampler(params), x) != run(Sampler(SamplingParams(top_p=0.95, seed=124)), x)
    assert run(Sampler(params), x) != run(Sampler(params, choice=1), x)
    assert run(Sampler(SamplingParams()), x) != run(Sampler(SamplingParams()), x)  # OS entropy


def test_samplers_with_one_seed_do_not_share_draws():
    x = spread_logits(15, scale=1.0)
    params = SamplingParams(seed=5)
    alone = run(Sampler(params), x)
    a, b = Sampler(params), Sampler(params)
    interleaved = []
    for _ in range(50):
        interleaved.append(a.sample(x, []))
        b.sample(x, [])
        b.sample(x, [])
    assert interleaved == alone


def reference_log_softmax(x):
    z = x.astype(np.float64)
    return z - (z.max() + np.log(np.exp(z - z.max()).sum()))


def test_logprobs_match_a_float64_reference():
    x = spread_logits(16)
    ref = reference_log_softmax(x)
    lp = log_softmax(x)
    np.testing.assert_allclose(lp, ref, rtol=0, atol=1e-6)
    assert np.exp(lp).sum() == pytest.approx(1.0, abs=1e-6)
    chosen, top = logprobs(x, 1234, top_n=20)
    assert chosen == pytest.approx(ref[1234], abs=1e-6)
    order = np.lexsort((np.arange(V), -ref))[:20]
    assert [i for i, _ in top] == order.tolist()
    np.testing.assert_allclose([v for _, v in top], ref[order], atol=1e-6)
    assert logprobs(x, 1234, top_n=0) == (chosen, [])


def test_logprobs_ties_list_the_lower_id_first():
    x = spread_logits(17)
    x[[500, 20, 90_000]] = 40.0
    x[3] = 39.0
    _, top = logprobs(x, 3, top_n=4)
    assert [i for i, _ in top] == [20, 500, 90_000, 3]
    assert top[0][1] == top[1][1] == top[2][1] > top[3][1]


def test_logprobs_ignore_the_sampling_adjustments():
    # the raw logits give the reported logprob, whatever bias/temperature sampled the token
    x = spread_logits(18)
    assert logprobs(x, 5)[0] == pytest.approx(reference_log_softmax(x)[5], abs=1e-6)


@pytest.mark.parametrize("token_id,top_n", [(-1, 0), (V, 0), (0, 21), (0, -1)])
def test_logprobs_reject_out_of_range(token_id, top_n):
    with pytest.raises(SamplingError):
        logprobs(spread_logits(19), token_id, top_n)


BAD = [
    ("temperature", -0.1),
    ("temperature", float("nan")),
    ("temperature", float("inf")),
    ("temperature", "1"),
    ("top_p", 0.0),
    ("top_p", 1.01),
    ("top_p", float("nan")),
    ("top_k", -1),
    ("top_k", 1.5),
    ("top_k", True),
    ("min_p", -0.01),
    ("min_p", 1.01),
    ("frequency_penalty", -2.01),
    ("frequency_penalty", 2.01),
    ("presence_penalty", -3),
    ("presence_penalty", 2.5),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", float("inf")),
    ("logit_bias", {V: 1.0}),
    ("logit_bias", {-1: 1.0}),
    ("logit_bias", {5: 100.5}),
    ("logit_bias", {5: -101}),
    ("logit_bias", {5: float("nan")}),
    ("logit_bias", {"5": 1.0}),
    ("logit_bias", [(5, 1.0), (5, 2.0)]),
    ("logit_bias", "nope"),
    ("seed", -1),
    ("seed", 2**64),
    ("seed", 1.5),
    ("seed", True),
    ("penalty_window", -1),
    ("penalty_window", 2.0),
]


@pytest.mark.parametrize("field,value", BAD, ids=[f"{f}={v!r}" for f, v in BAD])
def test_out_of_range_fields_are_rejected_by_name(field, value):
    with pytest.raises(SamplingError) as caught:
        SamplingParams(**{field: value})
    assert isinstance(caught.value, KippError) and isinstance(caught.value, ValueError)
    assert field in str(caught.value)


def test_range_edges_are_accepted_and_params_are_hashable():
    edges = SamplingParams(
        temperature=0,
        top_p=1,
        top_k=0,
        min_p=1,
        frequency_penalty=-2,
        presence_penalty=2,
        repetition_penalty=0.01,
        logit_bias={0: -100, V - 1: 100},
        seed=2**64 - 1,
        penalty_window=0,
    )
    assert edges.logit_bias == ((0, -100.0), (V - 1, 100.0))
    assert SamplingParams(logit_bias={3: 1, 2: 1}) == SamplingParams(logit_bias=[(2, 1), (3, 1.0)])
    assert len({SamplingParams(), SamplingParams(), edges}) == 2
    with pytest.raises(AttributeError):
        edges.temperature = 1.0


def test_sampler_rejects_bad_inputs():
    sampler = Sampler(SamplingParams(presence_penalty=1.0))
    x = spread_logits(20)
    with pytest.raises(SamplingError, match="shape"):
        sampler.sample(x[:-1], [])
    with pytest.raises(SamplingError, match="recent_tokens"):
        sampler.sample(x, [1, V])
    bad = x.copy()
    bad[10] = np.nan
    with pytest.raises(SamplingError, match="finite"):
        sampler.sample(bad, [])
    with pytest.raises(SamplingError, match="logit_bias"):
        Sampler(SamplingParams(logit_bias={1000: 1.0}), vocab_size=100)
