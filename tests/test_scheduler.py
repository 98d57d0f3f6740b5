"""The scheduler, driven step by step in-process on the reference backend (no thread, no HTTP).

The oracle is a plain loop over one fresh Session and a Sampler (`isolated`), written here apart
from the engine. Batched, chunked, prefix-adopting scheduling must give bitwise the same tokens
for the same seed on the reference backend. Model.generate drives the same scheduler, and a test
here shows both give the same tokens and logprobs.
"""

import pytest

from kipp.backend import KV_BLOCK
from kipp.engine.scheduler import (
    Delta,
    Done,
    Failed,
    QueueFull,
    Request,
    Scheduler,
    SchedulerError,
    collect,
)
from kipp.formats.registry import IM_END_ID
from kipp.model import load
from kipp.synthetic.writer import designed_rule, live_token_ids
from kipp.text.sampling import Sampler, SamplingParams

TINY = "kipp-synthetic/qwen3-tiny"


@pytest.fixture(scope="module")
def model(artifacts):
    return load(artifacts(TINY), backend="reference", kv_tokens=4096, progress=False)


def prompts(model):
    texts = ["Hello there", "The quick brown fox jumps over the lazy dog. " * 6, "1 2 3 4",
             "def add(a, b):\n    return a + b\n" * 3]
    return [model.tokenizer.encode(t) for t in texts]


def isolated(model, prompt, max_tokens, **sampling):
    """(tokens, text, finish reason) of one sequence alone: eval, sample, repeat."""
    sampler = Sampler(SamplingParams(**sampling))
    tokens, reason = [], "length"
    with model.session() as session:
        logits = session.eval(prompt)[0]
        while len(tokens) < max_tokens:
            token = sampler.sample(logits, session.tokens)
            if token in model.entry.stop_token_ids:
                reason = "stop"
                break
            tokens.append(token)
            if len(tokens) < max_tokens:
                logits = session.eval([token])[0]
    return tokens, model.tokenizer.decode(tokens), reason


def drive(scheduler, check_pool=True):
    """run_until_idle, checking the pool's invariants after every step."""
    pool = scheduler.model.pool
    for _ in range(100_000):
        if not scheduler._fifo and not scheduler._running:
            break
        scheduler.step()
        if check_pool:
            pool.check()
    assert pool.num_in_use == 0 and pool.reserved == 0


def test_batched_chunked_equals_isolated(model):
    ps = prompts(model)
    expected = [isolated(model, p, 12, temperature=1.0, seed=10 + i) for i, p in enumerate(ps)]
    scheduler = Scheduler(model, prefill_chunk=13)  # chunks cross 32-token block boundaries
    tickets = [scheduler.submit(Request(prompt=p, max_tokens=12,
                                        sampling=SamplingParams(temperature=1.0, seed=10 + i)))
               for i, p in enumerate(ps)]
    drive(scheduler)
    for ticket, (tokens, text, reason) in zip(tickets, expected):
        got_tokens, got_texts, reasons, done = collect(ticket)
        assert isinstance(done, Done)
        assert got_tokens[0] == tokens and got_texts[0] == text and reasons[0] == reason
        assert done.completion_tokens == len(tokens)


def test_n_choices_share_the_prompt_and_sample_independently(model):
    prompt = prompts(model)[1]  # 70+ tokens: two full blocks to share
    scheduler = Scheduler(model)
    ticket = scheduler.submit(Request(prompt=prompt, max_tokens=10, n=3,
                                      sampling=SamplingParams(temperature=2.0, seed=5)))
    drive(scheduler)
    tokens, texts, reasons, done = collect(ticket)
    # Choice 0 is the isolated stream of the seed; the others are their own streams.
    assert tokens[0] == isolated(model, prompt, 10, temperature=2.0, seed=5)[0]
    assert reasons == ["length"] * 3 and done.completion_tokens == 30
    assert len({tuple(t) for t in tokens}) > 1, "choices drew identical samples"
    shared = (len(prompt) - 1) // KV_BLOCK * KV_BLOCK
    assert scheduler.counters["reused_tokens"] >= 2 * shared  # both followers adopted


def test_finished_request_prefix_is_adopted(model):
    long_prompt = model.tokenizer.encode("Kipp serves the Qwen3 family. " * 30)
    scheduler = Scheduler(model)
    first = scheduler.submit(Request(prompt=long_prompt, max_tokens=4))
    drive(scheduler)
    first_done = collect(first)[3]
    second = scheduler.submit(Request(prompt=long_prompt + [11, 12], max_tokens=4))
    drive(scheduler)
    _, _, _, done = collect(second)
    assert first_done.cached_tokens == 0
    # The full blocks, then the first request's tail (its prompt's last partial block and the
    # tokens it generated there) for the prompt tokens it agrees on: the whole first prompt.
    assert len(long_prompt) % KV_BLOCK + 3 < KV_BLOCK
    assert done.cached_tokens == len(long_prompt)
    assert done.timings["cache_n"] == done.cached_tokens
    assert done.timings["prompt_n"] == len(long_prompt) + 2 - done.cached_tokens
    greedy = scheduler.submit(Request(prompt=long_prompt + [11, 12], max_tokens=6,
                                      sampling=SamplingParams(temperature=0)))
    drive(scheduler)
    assert collect(greedy)[0][0] == isolated(model, long_prompt + [11, 12], 6,
                                             temperature=0)[0]


def test_repeated_prompt_evaluates_only_its_last_token(model):
    """The same prompt again adopts everything but its last token (full blocks and the cached
    tail), evaluates one token in one step, and gives the isolated run's tokens."""
    prompt = model.tokenizer.encode("A prompt that ends inside a block. " * 9)
    assert len(prompt) % KV_BLOCK
    scheduler = Scheduler(model, prefill_chunk=16)
    scheduler.submit(Request(prompt=prompt, max_tokens=1))
    drive(scheduler)
    steps = scheduler.counters["steps"]
    ticket = scheduler.submit(Request(prompt=prompt, max_tokens=5,
                                      sampling=SamplingParams(temperature=0)))
    drive(scheduler)
    tokens, _, _, done = collect(ticket)
    assert done.cached_tokens == len(prompt) - 1 and done.timings["prompt_n"] == 1
    assert scheduler.counters["steps"] - steps == 5  # one step per token, the first included
    assert tokens[0] == isolated(model, prompt, 5, temperature=0)[0]


@pytest.mark.slow  # one of the default suite's longest (CI: 'longest default checks')
def test_pool_pressure_delays_admission_and_every_request_completes(artifacts):
    small = load(artifacts(TINY), backend="reference", kv_tokens=8 * KV_BLOCK,
                 progress=False)
    ps = [small.tokenizer.encode(f"request number {i} " * (i + 2)) for i in range(5)]
    expected = [isolated(small, p, 40, temperature=0)[0] for p in ps]
    scheduler = Scheduler(small, prefill_chunk=32)
    tickets = [scheduler.submit(Request(prompt=p, max_tokens=40,
                                        sampling=SamplingParams(temperature=0))) for p in ps]
    peak_running = 0
    while scheduler._fifo or scheduler._running:
        scheduler.step()
        small.pool.check()
        peak_running = max(peak_running, len(scheduler._running))
        assert small.pool.num_in_use <= small.pool.num_blocks
    assert peak_running < len(ps), "the small pool should have held some requests back"
    for ticket, tokens in zip(tickets, expected):
        assert collect(ticket)[0][0] == tokens
    assert small.pool.num_in_use == 0 and small.pool.reserved == 0


def test_cancel_frees_blocks_and_leaves_others_intact(model):
    ps = prompts(model)
    scheduler = Scheduler(model)
    keep = scheduler.submit(Request(prompt=ps[0], max_tokens=16,
                                    sampling=SamplingParams(temperature=1.0, seed=3)))
    doomed = scheduler.submit(Request(prompt=ps[3], max_tokens=200, n=2))
    queued_and_cancelled = scheduler.submit(Request(prompt=ps[2], max_tokens=4))
    queued_and_cancelled.cancel()
    for _ in range(5):
        scheduler.step()
    assert doomed.first_token_at is not None
    in_use_before = model.pool.num_in_use
    doomed.cancel()
    scheduler.step()
    assert model.pool.num_in_use < in_use_before
    drive(scheduler)
    last = collect(doomed)[3]
    assert isinstance(last, Failed) and last.cancelled
    assert isinstance(collect(queued_and_cancelled)[3], Failed)
    assert collect(keep)[0][0] == isolated(model, ps[0], 16, temperature=1.0, seed=3)[0]
    assert scheduler.counters["cancelled"] == 2


def test_stop_token_and_stop_string(model):
    prompt = prompts(model)[0]
    scheduler = Scheduler(model)
    # A bias that makes <|im_end|> certain: the choice stops at once, with no text.
    forced = scheduler.submit(Request(prompt=prompt, max_tokens=8,
                                      sampling=SamplingParams(logit_bias={IM_END_ID: 100})))
    drive(scheduler)
    tokens, texts, reasons, done = collect(forced)
    assert tokens == [[]] and texts == [""] and reasons == ["stop"]
    assert done.completion_tokens == 0
    _, text, _ = isolated(model, prompt, 12, temperature=0)
    stop = text[len(text) // 2: len(text) // 2 + 3]
    ticket = scheduler.submit(Request(prompt=prompt, max_tokens=12, stop=(stop,),
                                      sampling=SamplingParams(temperature=0)))
    drive(scheduler)
    _, texts, reasons, _ = collect(ticket)
    assert texts[0] == text[: text.index(stop)] and reasons == ["stop"]


def test_logprobs_come_from_the_raw_logits(model):
    prompt = prompts(model)[0]
    scheduler = Scheduler(model)
    ticket = scheduler.submit(Request(prompt=prompt, max_tokens=3, logprobs=3,
                                      sampling=SamplingParams(temperature=0)))
    drive(scheduler)
    deltas = [e for e in ticket if isinstance(e, Delta)]
    lps = [lp for d in deltas for lp in d.logprobs]
    assert [lp.token for lp in lps] == [t for d in deltas for t in d.tokens]
    with model.session() as s:
        logits = s.eval(prompt)[0]
    from kipp.text.sampling import log_softmax

    ref = log_softmax(logits)
    assert lps[0].token == int(ref.argmax())
    assert lps[0].logprob == pytest.approx(ref.max(), abs=1e-6)
    assert [t for t, _ in lps[0].top] == list(ref.argsort()[::-1][:3])


def test_rejections_name_the_limit(model):
    scheduler = Scheduler(model, max_queue=2)
    context = model.entry.context_length
    with pytest.raises(SchedulerError, match="n must be") as e:
        scheduler.submit(Request(prompt=(1, 2), max_tokens=4, n=9))
    assert (e.value.param, e.value.code) == ("n", None)
    with pytest.raises(SchedulerError, match="exceeds the context length") as e:
        scheduler.submit(Request(prompt=(1, 2), max_tokens=context))
    assert (e.value.param, e.value.code) == ("max_tokens", "context_length_exceeded")
    with pytest.raises(SchedulerError, match="KV blocks") as e:
        scheduler.submit(Request(prompt=(1, 2), max_tokens=context // 2, n=8))
    assert (e.value.param, e.value.code) == ("max_tokens", "kv_capacity_exceeded")
    with pytest.raises(SchedulerError, match="max_tokens") as e:
        scheduler.submit(Request(prompt=(1, 2), max_tokens=0))
    assert e.value.param == "max_tokens"
    scheduler.submit(Request(prompt=(1, 2), max_tokens=1))
    scheduler.submit(Request(prompt=(1, 2), max_tokens=1))
    with pytest.raises(QueueFull):
        scheduler.submit(Request(prompt=(1, 2), max_tokens=1))
    drive(scheduler)


def test_a_failing_eval_fails_its_batch_and_the_engine_keeps_serving(model, monkeypatch):
    scheduler = Scheduler(model)
    ticket = scheduler.submit(Request(prompt=prompts(model)[0], max_tokens=4))
    real = model.backend.eval
    monkeypatch.setattr(model.backend, "eval", lambda items: (_ for _ in ()).throw(
        RuntimeError("device lost")))
    drive(scheduler)
    last = collect(ticket)[3]
    assert isinstance(last, Failed) and "device lost" in last.message
    monkeypatch.setattr(model.backend, "eval", real)
    ticket = scheduler.submit(Request(prompt=prompts(model)[0], max_tokens=4,
                                      sampling=SamplingParams(temperature=0)))
    drive(scheduler)
    assert collect(ticket)[0][0] == isolated(model, prompts(model)[0], 4, temperature=0)[0]


def test_engine_thread(model):
    with Scheduler(model) as scheduler:
        tickets = [scheduler.submit(Request(prompt=p, max_tokens=5,
                                            sampling=SamplingParams(temperature=0)))
                   for p in prompts(model)]
        results = [collect(t) for t in tickets]
    for p, (tokens, _, _, done) in zip(prompts(model), results):
        assert isinstance(done, Done)
        assert tokens[0] == isolated(model, p, 5, temperature=0)[0]
    assert model.pool.num_in_use == 0


@pytest.mark.slow  # CI's longest default checks
def test_speculative_scheduler_emits_plain_greedy_tokens(model):
    """Greedy choices verify prompt-lookup drafts inside the batched step; sampled ones in the
    same batch decode plainly. Every stream equals its isolated plain generation."""
    repetitive = model.tokenizer.encode("alpha beta gamma delta " * 12)
    ps = [prompts(model)[0], repetitive]
    greedy = [isolated(model, p, 24, temperature=0)[0] for p in ps]
    # Designed text, then its first three tokens again: the synthetic model's greedy next
    # token is a rule of the last three (kipp.synthetic.writer.designed_rule), so it follows the
    # same text from there and the drafter's copy of it is accepted.
    live = live_token_ids(model.entry)
    head = [int(live[i]) for i in (3, 10, 17)]
    chain = head + designed_rule(model.entry).continuation(head, 30) + head
    ps.append(chain)
    greedy.append(isolated(model, chain, 24, temperature=0)[0])
    sampled = isolated(model, ps[1], 12, temperature=1.0, seed=9)[0]
    scheduler = Scheduler(model, speculative=True, prefill_chunk=64)
    tickets = [scheduler.submit(Request(prompt=p, max_tokens=24,
                                        sampling=SamplingParams(temperature=0))) for p in ps]
    other = scheduler.submit(Request(prompt=ps[1], max_tokens=12,
                                     sampling=SamplingParams(temperature=1.0, seed=9)))
    stopped = scheduler.submit(Request(prompt=chain, max_tokens=24, stop=(
        model.tokenizer.decode(greedy[-1][5:7]),), sampling=SamplingParams(temperature=0)))
    drive(scheduler)
    for ticket, expected in zip(tickets, greedy):
        tokens, _, reasons, done = collect(ticket)
        assert tokens[0] == expected and reasons == ["length"]
        assert done.completion_tokens == 24
    assert collect(other)[0][0] == sampled
    text = collect(stopped)[1][0]
    full = model.tokenizer.decode(greedy[-1])
    assert text == full[: full.index(model.tokenizer.decode(greedy[-1][5:7]))]
    assert scheduler.counters["spec_accepted"] > 0, "no draft was ever accepted"


def test_step_counters_time_the_engine_and_count_compiles(model, monkeypatch):
    """stats(): the step time covers the backend's eval time, and the compiles a backend logs
    (JaxBackend.compile_log) are counted with their seconds; a backend with no log counts 0."""
    scheduler = Scheduler(model)
    assert scheduler.stats()["compiles"] == 0 and scheduler.stats()["compile_seconds"] == 0
    scheduler.submit(Request(prompt=prompts(model)[0], max_tokens=3))
    drive(scheduler)
    s = scheduler.stats()
    assert s["steps"] >= 3 and s["step_seconds"] >= s["eval_seconds"] > 0
    monkeypatch.setattr(model.backend, "compile_log", [("T=1", 1.5), ("T=16", 2.0)],
                        raising=False)
    s = scheduler.stats()
    assert s["compiles"] == 2 and s["compile_seconds"] == pytest.approx(3.5)


@pytest.mark.parametrize("case", ["greedy", pytest.param("seeded", marks=pytest.mark.slow),
                                  "grammar", "seeded-grammar",
                                  pytest.param("speculative", marks=pytest.mark.slow)])
def test_the_python_api_and_the_scheduler_make_the_same_tokens(model, case):
    """Model.generate pumps the model's own scheduler; a Request on another Scheduler over the
    same model gives the same tokens and logprobs, bitwise (both adopt the published prompt)."""
    from kipp.engine.spec import SpecConfig

    options = {"greedy": dict(temperature=0), "seeded": dict(temperature=0.9, seed=4),
               "speculative": dict(temperature=0), "grammar": dict(temperature=0),
               "seeded-grammar": dict(temperature=0.9, seed=4)}[case]
    grammar = None
    if "grammar" in case:
        pytest.importorskip("llguidance")
        from kipp.text.grammar import regex_grammar

        grammar = regex_grammar(r"[a-z ]{4,40}\.")
    prompt = prompts(model)[1]
    speculative = case == "speculative"
    model.generate(prompt, 1, temperature=0)  # publishes the prompt: both runs adopt it
    generation = model.generate(prompt, 20, stream=True, logprobs=3, speculative=speculative,
                                grammar=grammar, **options)
    text = "".join(generation)
    scheduler = Scheduler(model)
    ticket = scheduler.submit(Request(prompt=prompt, max_tokens=20, logprobs=3, grammar=grammar,
                                      sampling=SamplingParams(**options),
                                      spec=SpecConfig() if speculative else None))
    lps = []
    drive(scheduler)
    events = list(ticket)
    for event in events:
        if isinstance(event, Delta):
            lps.extend(event.logprobs)
    tokens = [t for e in events if isinstance(e, Delta) for t in e.tokens]
    assert tokens == generation.stats.tokens and len(tokens) > 3
    assert "".join(e.text for e in events if isinstance(e, Delta)) == text
    assert lps == generation.stats.logprobs and len(lps) == len(tokens)
    done = events[-1]
    assert isinstance(done, Done) and done.cached_tokens == len(prompt) - 1
    assert generation.stats.reused_tokens == len(prompt) - 1
    if speculative:
        assert done.spec.drafted > 0 and done.spec == generation.stats.spec
