"""Speculative decoding (kipp.engine.spec): the emitted tokens are exactly plain greedy decoding's.

The synthetic checkpoints' greedy tokens follow a designed rule of the last three tokens
(kipp.synthetic.writer.designed_rule), so a "copy" prompt holding a stretch of designed text and
ending with its first three tokens is the case where prompt-lookup drafts are right, a
"code-like" one holding it in edited pieces makes them partly right, and repetitive text and
random ids leave them wrong or absent. Injected drafters that are always right or always wrong pin
the verification and rollback logic; a scripted one rolls back to positions 31, 32 and 33.
"""

import numpy as np
import pytest

from kipp import gates
from kipp.cli import main as cli_main
from kipp.engine.spec import AdaptiveGate, PromptLookupDrafter, SpecConfig
from kipp.formats.registry import IM_END_ID
from kipp.model import GenerationError, load
from kipp.synthetic.writer import designed_rule, live_token_ids
from spec_gates import FixedGate

TINY = "kipp-synthetic/qwen3-tiny"
STEPS = 16


def _chain(model, start: int, n: int) -> list[int]:
    """n tokens of the model's designed greedy text, from three live tokens picked by `start`."""
    live = live_token_ids(model.entry)
    head = [int(live[(start + 7 * i) % len(live)]) for i in range(3)]
    return (head + designed_rule(model.entry).continuation(head, n))[:n]


def _prompts(model) -> dict[str, list[int]]:
    rng = np.random.default_rng(9)
    chain = _chain(model, 1000, 60)
    noise = [int(t) for t in rng.integers(0, 151_643, 12)]
    # code-like: the continuation in pieces of 2-4 tokens, each followed by an edit, as code
    # repeats identifiers and idioms with changes
    pieces = [t for i in range(0, 40, 4) for t in chain[i:i + 2 + i % 3] + [noise[i % 12]]]
    return {
        "copy": noise + chain[:48] + noise[:3] + chain[:3],  # the continuation is in the prompt
        "code-like": noise[:4] + pieces + chain[:3],
        "repetitive": model.tokenizer.encode("The cat sat on the mat. " * 6),
        "random": [int(t) for t in rng.integers(0, 151_643, 40)],
    }


_PLAIN = {}  # plain greedy runs, shared by the tests: (model, prompt, steps, options) -> run


def _generate(model, prompt, steps=STEPS, **options):
    key = (id(model), tuple(prompt), steps, repr(sorted(options.items())))
    if "speculative" not in options and key in _PLAIN:
        return _PLAIN[key]
    generation = model.generate(prompt, steps, stream=True, temperature=0, **options)
    text = "".join(generation)
    if "speculative" not in options:
        _PLAIN[key] = text, generation.stats
    return text, generation.stats


class OracleDrafter:
    """Drafts the true continuation (right) or the true tokens plus one (always wrong)."""

    def __init__(self, prompt_len, truth, wrong=False):
        self.prompt_len, self.truth, self.wrong = prompt_len, truth, wrong

    def draft(self, tokens, limit):
        done = len(tokens) - self.prompt_len
        guess = self.truth[done:done + limit]
        return [(t + 1) % 151_643 for t in guess] if self.wrong else list(guess)


@pytest.fixture(scope="module")
def backend_models(models, artifacts):
    """backend name -> the tiny model on it (JAX and MLX loaded once, when importable)."""
    loaded = {"reference": models(TINY)}

    def get(name):
        if name not in loaded:
            pytest.importorskip({"jax": "jax", "mlx": "mlx.core"}[name])
            loaded[name] = load(artifacts(TINY), backend=name, kv_tokens=1024, progress=False)
        return loaded[name]

    return get


# the reference's verifies and the JAX backend's compiles are the slowest; CI's longest-checks
# step runs them, MLX stays in the default suite
@pytest.mark.parametrize("backend", [pytest.param("reference", marks=pytest.mark.slow),
                                     pytest.param("jax", marks=pytest.mark.slow), "mlx"])
def test_speculative_equals_plain_greedy(backend_models, backend):
    model = backend_models(backend)
    for name, prompt in _prompts(model).items():
        text, plain = _generate(model, prompt)
        spec_text, spec = _generate(model, prompt, speculative=True)
        assert spec.tokens == plain.tokens, name
        assert spec_text == text and spec.finish_reason == plain.finish_reason == "length"
        assert spec.completion_tokens == plain.completion_tokens == STEPS
        assert spec.decode_tokens == plain.decode_tokens == plain.decode_evals == STEPS - 1
        assert spec.decode_evals == spec.spec.evals
        if len(prompt) > 32:
            assert spec.reused_tokens > 0, name  # the plain run published the prompt's blocks
        print(f"{backend} {name}: {spec.spec}")
        if name == "copy":
            assert spec.spec.acceptance_rate > 0.9 and spec.decode_evals <= 4
        if name == "code-like":  # drafts partly right: verification rejects and rolls back
            assert 0 < spec.spec.accepted < spec.spec.drafted
    model.pool.check()


def test_always_right_drafter(models):
    model = models(TINY)
    prompt = _prompts(model)["random"]
    _, plain = _generate(model, prompt)
    right = SpecConfig(drafter=lambda: OracleDrafter(len(prompt), plain.tokens),
                       gate=lambda: FixedGate(7))
    _, spec = _generate(model, prompt, speculative=right)
    assert spec.tokens == plain.tokens
    assert spec.spec.acceptance_rate == 1.0 and spec.spec.plain_evals == 0
    assert spec.decode_evals == -(-(STEPS - 1) // 8)  # 8 tokens per verify
    assert spec.spec.drafted == STEPS - 1 - spec.decode_evals  # never drafts past max_tokens


@pytest.mark.parametrize("gated", [pytest.param(True, marks=pytest.mark.slow),  # CI: longest
                                   False])
def test_always_wrong_drafter(models, gated):
    model = models(TINY)
    prompt = _prompts(model)["repetitive"]
    _, plain = _generate(model, prompt)
    wrong = SpecConfig(drafter=lambda: OracleDrafter(len(prompt), plain.tokens, wrong=True),
                       gate=AdaptiveGate if gated else lambda: FixedGate(3))
    _, spec = _generate(model, prompt, speculative=wrong)
    assert spec.tokens == plain.tokens
    assert spec.spec.accepted == 0 and spec.decode_evals == plain.decode_evals
    if gated:  # backoff 1, 2, 4, 8 steps between probes: few verifies in 15 steps
        assert spec.spec.verify_evals <= 4 and spec.spec.plain_evals >= 11
    else:  # every step verifies but the last, which has no room for a draft
        assert spec.spec.verify_evals == STEPS - 2 and spec.spec.plain_evals == 1


class ScriptedDrafter:
    """First draft: `right` true tokens, then wrong ones, 7 in all; then no drafts. Records
    the session's length and block count when asked for the second draft."""

    def __init__(self, session, prompt_len, truth, right):
        self.session, self.prompt_len, self.truth, self.right = session, prompt_len, truth, right
        self.calls, self.seen = 0, None

    def draft(self, tokens, limit):
        self.calls += 1
        if self.calls == 2:
            self.seen = (self.session.length, len(self.session.block_table))
        if self.calls > 1:
            return []
        done = len(tokens) - self.prompt_len
        guess = list(self.truth[done:done + 7])
        return guess[:self.right] + [(t + 1) % 151_643 for t in guess[self.right:]]


@pytest.mark.parametrize("right,blocks", [(1, 1), (2, 1), (3, 2)])
def test_rollback_across_a_block_boundary(models, right, blocks):
    """A 29-token prompt: the first verify writes positions 29..36 over the block boundary,
    accepts `right` draft tokens and rolls back to 31, 32 or 33 tokens."""
    model = models(TINY)
    prompt = _prompts(model)["random"][:29]
    _, plain = _generate(model, prompt, steps=12)
    with model.session() as session:
        session.eval(prompt[:-1])  # a borrowed session: the step evaluates the last token
        drafter = ScriptedDrafter(session, len(prompt), plain.tokens, right)
        config = SpecConfig(drafter=lambda: drafter, gate=lambda: FixedGate(7))
        generation = model.generate(prompt, 12, stream=True, temperature=0, session=session,
                                    speculative=config)
        "".join(generation)
        assert drafter.seen == (30 + right, blocks)
    assert generation.stats.tokens == plain.tokens
    assert generation.stats.spec.accepted == right and generation.stats.spec.drafted == 7
    model.pool.check()


def test_rollback_into_an_adopted_shared_block(models):
    """Truncating into a published (shared, immutable) block rebuilds it privately; a verify
    eval after it equals a fresh session's logits bitwise (reference backend)."""
    model = models(TINY)
    tokens = _prompts(model)["copy"] + _chain(model, 7, 20)
    with model.session() as first:
        first.eval(tokens)  # published at close
    with model.session() as fresh:
        want = fresh.eval(tokens[:48], logits_rows=8)
    with model.session() as s:
        adopted = s.match_prefix(tokens)  # two full blocks and the cached tail (kipp.engine.blocks)
        s.eval(tokens[adopted:])
        assert adopted == len(tokens) - 1 and s.shared_blocks >= 2
        s.truncate(40)  # inside shared block 1
        assert s.shared_blocks == 1 and s.length == 40
        got = s.eval(tokens[40:48], logits_rows=8)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    model.pool.check()


@pytest.mark.slow  # CI's longest-checks step
def test_stop_string_and_max_tokens_cut_where_plain_does(models):
    model = models(TINY)
    prompt = _prompts(model)["copy"]
    full, _ = _generate(model, prompt)
    stop = full[len(full) // 2: len(full) // 2 + 4]
    text, plain = _generate(model, prompt, stop=[stop])
    spec_text, spec = _generate(model, prompt, stop=[stop], speculative=True)
    assert spec_text == text == full[:full.index(stop)]
    assert spec.tokens == plain.tokens and spec.finish_reason == "stop"
    assert spec.spec.drafted > 0
    for steps in (1, 2, 9):
        _, plain = _generate(model, prompt, steps=steps)
        _, spec = _generate(model, prompt, steps=steps, speculative=True)
        assert spec.tokens == plain.tokens and spec.completion_tokens == steps
        assert spec.spec.drafted <= max(0, steps - 2)  # room: max_tokens - emitted - 1


def test_stop_token_cuts_a_draft(models):
    """A logit bias makes <|im_end|> the greedy pick at step j (where its gap to the chain
    token dips below every earlier gap): plain decoding stops there, and speculation
    stops there too, whether a prompt-lookup draft runs past it or an oracle drafts it."""
    model = models(TINY)
    prompt = _prompts(model)["copy"]
    _, free = _generate(model, prompt)
    logits = gates.all_position_logits(model, prompt + free.tokens)[len(prompt) - 1:-1]
    gaps = logits[np.arange(STEPS), free.tokens] - logits[:, IM_END_ID]
    # The designed rule's margins are nearly equal, so the first gap may be the smallest: the
    # prompt then takes the first s greedy tokens, so that a later gap dips below all before it.
    s = next(s for s in range(STEPS - 2)
             if any(gaps[i] < gaps[s:i].min() for i in range(s + 1, STEPS - 1)))
    prompt, gaps = prompt + free.tokens[:s], gaps[s:]
    _, free = _generate(model, prompt)
    j = [i for i in range(1, len(gaps)) if gaps[i] < gaps[:i].min()][-1]
    options = dict(logit_bias={IM_END_ID: float(gaps[j] + gaps[:j].min()) / 2})
    _, plain = _generate(model, prompt, **options)
    assert plain.finish_reason == "stop" and plain.tokens == free.tokens[:j]
    _, spec = _generate(model, prompt, speculative=True, **options)
    assert spec.tokens == plain.tokens and spec.finish_reason == "stop"
    assert spec.spec.drafted > j  # the prompt-lookup draft ran past the stop token
    truth = plain.tokens + [IM_END_ID] + free.tokens[j:]
    oracle = SpecConfig(drafter=lambda: OracleDrafter(len(prompt), truth),
                        gate=lambda: FixedGate(15))
    _, spec = _generate(model, prompt, speculative=oracle, **options)
    assert spec.tokens == plain.tokens and spec.completion_tokens == j
    assert spec.spec.verify_evals == 1 and spec.spec.accepted >= j  # <|im_end|> was drafted


def test_penalties_are_applied_with_each_rows_history(models):
    model = models(TINY)
    prompt = _prompts(model)["copy"]
    _, unpenalized = _generate(model, prompt)
    options = dict(repetition_penalty=20.0, logit_bias={11: 2.0})
    _, plain = _generate(model, prompt, **options)
    _, spec = _generate(model, prompt, speculative=True, **options)
    assert plain.tokens != unpenalized.tokens  # the penalties change the output ...
    assert spec.tokens == plain.tokens  # ... and speculation follows them exactly


def test_sampling_is_refused():
    class FakeModel:
        class entry:
            context_length = 100

    from kipp.generation import request_for
    from kipp.text.sampling import SamplingParams

    with pytest.raises(GenerationError, match="greedy only"):
        request_for(FakeModel, [1, 2], 4, None, SamplingParams(temperature=0.7), speculative=True)
    with pytest.raises(GenerationError, match="SpecConfig"):
        request_for(FakeModel, [1, 2], 4, None, SamplingParams(temperature=0), speculative="yes")


def test_prompt_lookup_drafter_matches_a_brute_force_search():
    def brute(tokens, limit, sizes):
        for n in sizes:
            for end in range(len(tokens) - 1, n - 1, -1):
                if len(tokens) > n and tokens[end - n:end] == tokens[-n:]:
                    return tokens[end:end + limit]
        return []

    rng = np.random.default_rng(3)
    drafter = PromptLookupDrafter(max_ngram=3, min_ngram=1)
    tokens = []
    for _ in range(300):  # one growing sequence over a small alphabet: many matches
        tokens.append(int(rng.integers(0, 6)))
        limit = int(rng.integers(1, 9))
        assert drafter.draft(tokens, limit) == brute(tokens, limit, (3, 2, 1))
    assert drafter.draft([1, 2, 3, 9, 1, 2], 4) == [3, 9, 1, 2]  # a shorter sequence rebuilds
    assert PromptLookupDrafter(3, 2).draft([5, 6, 7, 8], 4) == []


def test_adaptive_gate_backs_off_and_recovers():
    gate = AdaptiveGate()
    assert gate.budget() in gate.sizes  # the prior tries drafting at once
    pauses = []
    for _ in range(200):  # every draft rejected at its first token
        k = gate.budget()
        if k:
            gate.update(k, 0)
        pauses.append(k == 0)
    assert sum(pauses) >= 190 and gate.backoff == gate.max_pause
    for _ in range(40):  # then every draft accepted: back to the longest drafts
        k = gate.budget()
        if k:
            gate.update(k, k)
    assert gate.budget() == max(gate.sizes) and gate.backoff == 1


def test_cli_run_spec_and_kv_scheme(artifacts, capsys):
    path = str(artifacts(TINY))
    assert cli_main(["run", path, "--prompt", "Hello Hello Hello", "--max-tokens", "8",
                     "--temperature", "0", "--backend", "reference", "--spec",
                     "--kv-scheme", "q8_0"]) == 0
    captured = capsys.readouterr()
    want = load(path, backend="reference", kv_scheme="q8_0", progress=False).generate(
        "Hello Hello Hello", max_tokens=8, temperature=0)
    assert captured.out.strip() == want.strip()
    assert "spec:" in captured.err and "q8_0 KV" in captured.err
    assert cli_main(["run", path, "--prompt", "Hi", "--spec", "--backend", "reference"]) == 1
    assert "greedy only" in capsys.readouterr().err
