"""The OpenAI surface in-process: Flask's test client over a started scheduler (reference backend),
and the scheduler driven step by step. What evaluation clients need (echo with prompt logprobs,
batched prompts), what hostile clients send (deep JSON, odd prompts and biases), the default
pool against the default chat, the drain, and seeded sampling on a batch-variant backend.

Oracles: Session.eval rows and kipp.text.sampling.logprobs for prompt scores, Model.generate and
single-prompt requests for batched ones, the same request alone for a seeded one under load.
"""

import json
import threading
import time

import numpy as np
import pytest

pytest.importorskip("flask")
pytest.importorskip("prometheus_client")

from kipp.backend import KV_BLOCK  # noqa: E402
from kipp.engine.scheduler import Done, Failed, Request, Scheduler, ShuttingDown, collect  # noqa: E402
from kipp.formats.registry import IM_END_ID  # noqa: E402
from kipp.http.app import MAX_JSON_DEPTH, create_app  # noqa: E402
from kipp.http.fields import MAX_STOP_CHARS  # noqa: E402
from kipp.model import load  # noqa: E402
from kipp.text.sampling import SamplingParams, logprobs  # noqa: E402

TINY = "kipp-synthetic/qwen3-tiny"
END_NOW = {str(IM_END_ID): 100}  # a bias that ends every choice at its first token
CONTEXT = 40960  # the tiny instruct checkpoint's context length (the instruct family's)
CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def model(artifacts):
    # A 4,096-token pool (128 blocks) under the 40,960-token context: the pool, not the
    # context, is what runs out first here.
    return load(artifacts(TINY), backend="reference", kv_tokens=4096, progress=False)


@pytest.fixture(scope="module")
def served(model):
    scheduler = Scheduler(model).start()
    yield create_app(model, scheduler).test_client(), scheduler
    scheduler.stop()


def post(client, path, **body):
    r = client.post(path, json={"model": TINY, **body})
    return r.status_code, r.json


def sse(client, **body):
    r = client.post("/v1/completions", json={"model": TINY, "stream": True, **body})
    assert r.status_code == 200
    chunks = [json.loads(line[6:]) for line in r.data.decode().splitlines()
              if line.startswith("data: {")]
    assert r.data.decode().rstrip().endswith("data: [DONE]")
    return chunks


def prompt_scores(model, ids, top_n):
    """(logprob, top) of every prompt token after the first, from one Session.eval of all rows."""
    with model.session(len(ids)) as s:
        rows = s.eval(ids, len(ids))
    return [logprobs(rows[i], ids[i + 1], top_n) for i in range(len(ids) - 1)]


def text_of(model, token):
    return model.tokenizer.decode_bytes([token]).decode("utf-8", errors="replace")


# -- 9. echo with logprobs: the legacy completions shape, scored from multi-row logits

def test_echo_scores_the_prompt_like_session_eval(served, model):
    client, _ = served
    text = "Kipp scores every prompt token for evaluation harnesses. " * 12  # > 128 tokens
    ids = model.tokenizer.encode(text)
    assert len(ids) > 128  # crosses a prefill chunk
    status, r = post(client, "/v1/completions", prompt=text, max_tokens=0, echo=True,
                     logprobs=3)
    assert status == 200, r
    choice = r["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"] == model.tokenizer.decode(ids) and choice["finish_reason"] == "length"
    assert lp["tokens"] == [text_of(model, t) for t in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    expected = prompt_scores(model, ids, 3)
    assert lp["token_logprobs"][1:] == [e[0] for e in expected]  # bitwise: same rows, same math
    for got, (_, top) in zip(lp["top_logprobs"][1:], expected):
        assert got == {text_of(model, t): v for t, v in top}
    offsets = np.cumsum([0] + [len(t) for t in lp["tokens"][:-1]]).tolist()
    assert lp["text_offset"] == offsets
    assert r["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0,
                          "total_tokens": len(ids), "prompt_tokens_details": {
                              "cached_tokens": 0}}


def test_echo_with_generation_and_n_and_stream(served, model):
    client, _ = served
    prompt = [9707, 11, 1879, 13, 576, 3974]
    _, plain = post(client, "/v1/completions", prompt=prompt, max_tokens=4, temperature=0,
                    logprobs=1)
    status, r = post(client, "/v1/completions", prompt=prompt, max_tokens=4, temperature=0,
                     logprobs=1, echo=True, n=2)
    assert status == 200
    prompt_text = model.tokenizer.decode(prompt)
    for choice in r["choices"]:
        assert choice["text"] == prompt_text + plain["choices"][0]["text"]
        lp = choice["logprobs"]
        assert lp["token_logprobs"][:len(prompt)] == [None] + [
            e[0] for e in prompt_scores(model, prompt, 1)]
        assert lp["token_logprobs"][len(prompt):] == plain["choices"][0]["logprobs"][
            "token_logprobs"]
        assert lp["text_offset"][len(prompt)] == len(prompt_text)
    assert r["usage"]["completion_tokens"] == 8
    chunks = sse(client, prompt=prompt, max_tokens=4, temperature=0, echo=True)
    assert chunks[0]["choices"][0]["text"] == prompt_text  # the prompt comes first
    assert "".join(c["choices"][0]["text"] for c in chunks) == r["choices"][0]["text"]


def test_echo_ignores_the_prefix_cache_and_max_tokens_zero_needs_echo(served, model):
    client, scheduler = served
    text = "A prompt seen twice: the second time its blocks are in the pool. " * 8
    first = post(client, "/v1/completions", prompt=text, max_tokens=0, echo=True, logprobs=0)[1]
    again = post(client, "/v1/completions", prompt=text, max_tokens=0, echo=True, logprobs=0)[1]
    assert first["choices"][0]["logprobs"] == again["choices"][0]["logprobs"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    status, r = post(client, "/v1/completions", prompt=text, max_tokens=0)
    assert status == 400 and r["error"]["param"] == "max_tokens"


# -- 10. batched prompts: one request per prompt, choices indexed i*n + j

def test_batched_prompts_index_choices_i_times_n_plus_j(served, model):
    client, _ = served
    texts = ["Batched prompt one", "And the second prompt of the batch"]
    singles = [post(client, "/v1/completions", prompt=t, max_tokens=5, n=2, temperature=0.9,
                    seed=4, logprobs=1)[1] for t in texts]
    status, r = post(client, "/v1/completions", prompt=texts, max_tokens=5, n=2,
                     temperature=0.9, seed=4, logprobs=1)
    assert status == 200
    assert [c["index"] for c in r["choices"]] == [0, 1, 2, 3]
    for i, single in enumerate(singles):
        for j in range(2):
            got, want = r["choices"][i * 2 + j], single["choices"][j]
            assert (got["text"], got["logprobs"]) == (want["text"], want["logprobs"])
    assert r["usage"]["prompt_tokens"] == sum(s["usage"]["prompt_tokens"] for s in singles)
    assert r["usage"]["completion_tokens"] == 20
    assert r["timings"]["predicted_n"] == 20
    # Token-id lists, streamed: every chunk carries its global index.
    ids = [model.tokenizer.encode(t) for t in texts]
    chunks = sse(client, prompt=ids, max_tokens=5, n=2, temperature=0.9, seed=4,
                 stream_options={"include_usage": True})
    streamed = ["", "", "", ""]
    for c in chunks:
        for choice in c["choices"]:
            streamed[choice["index"]] += choice["text"]
    assert streamed == [c["text"] for c in r["choices"]]
    assert chunks[-1]["usage"]["completion_tokens"] == 20


def test_a_batch_is_all_or_nothing(served, model):
    client, scheduler = served
    before = scheduler.counters["requests"]
    status, r = post(client, "/v1/completions", prompt=["fine", [1, 2], "x"], max_tokens=2)
    assert status == 400 and r["error"]["param"] == "prompt"
    status, r = post(client, "/v1/completions", prompt=[[1] * 3, [1] * 10], max_tokens=CONTEXT - 6)
    assert status == 400 and r["error"]["param"] == "max_tokens"
    assert scheduler.counters["requests"] == before  # nothing was queued


# -- 3. the default pool holds the default chat

class Gated(Scheduler):
    """A scheduler whose engine thread takes a step only when the test lets it, and records how
    many requests run after each admission."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.gate = threading.Semaphore(0)
        self.admitted: list[int] = []

    def step(self):
        self.gate.acquire()
        return super().step()

    def _admit(self):
        super()._admit()
        self.admitted.append(len(self._running))


def test_default_chat_fits_the_default_pool(model):
    """n: 4 without max_tokens was a 400 ("needs up to 132 KV blocks"), and 8 default chats
    ran 3 at a time: the default max_tokens is now the request's share of the pool."""
    scheduler = Gated(model).start()
    client = create_app(model, scheduler).test_client()
    messages = [{"role": "user", "content": "How many blocks does a chat reserve?"}]
    results = []

    def chat(n):
        results.append(post(client, CHAT, messages=messages, n=n, logit_bias=END_NOW))

    try:
        threads = [threading.Thread(target=chat, args=(1,)) for _ in range(8)]
        for t in threads:
            t.start()
        _wait(lambda: len(scheduler._fifo) == 8)
        scheduler.gate.release()
        _wait(lambda: scheduler.admitted)
        assert scheduler.admitted[0] == 8, "eight default chats should run together"
        scheduler.gate.release(10_000)
        for t in threads:
            t.join(60)
        four = post(client, CHAT, messages=messages, n=4, logit_bias=END_NOW)
    finally:
        scheduler.gate.release(10_000)
        scheduler.stop()
    assert [status for status, _ in results] == [200] * 8, results
    assert four[0] == 200 and len(four[1]["choices"]) == 4, four


def _wait(condition, timeout=30):
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, "timed out"
        time.sleep(0.01)


def test_default_max_tokens_is_a_share_of_the_pool(model):
    scheduler = Scheduler(model, max_batch=8)
    blocks = model.pool.num_blocks  # 128
    share = blocks // 8 * KV_BLOCK
    assert scheduler.default_max_tokens(20, 1, 1024) == share - 20
    assert scheduler.default_max_tokens(20, 1, 100) == 100
    assert scheduler.default_max_tokens(share + 10, 1, 1024) == 256  # a floor past the share
    # n choices must fit the pool at once; a prompt that fills the context leaves 1 (a 400).
    assert scheduler.default_max_tokens(400, 8, 1024) == blocks // 8 * KV_BLOCK - 400
    assert scheduler.default_max_tokens(model.entry.context_length, 1, 1024) == 1


# -- 4, 5, 7: hostile input gets a 400 naming the field; metrics stay bounded

def nested(depth):
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("raw", [nested(100_000), nested(MAX_JSON_DEPTH + 1),
                                 '{"model": "m", "user": ' + nested(900) + "}"])
def test_deeply_nested_json_is_a_400(served, raw):
    client, _ = served
    r = client.post("/v1/completions", data=raw, content_type="application/json")
    assert r.status_code == 400, r.data[:200]
    assert r.json["error"]["code"] == "invalid_json" and "deep" in r.json["error"]["message"]


def test_json_within_the_depth_limit_gets_the_usual_errors(served):
    client, _ = served
    status, r = post(client, "/v1/completions", prompt="x", user=json.loads(nested(60)))
    assert status == 400 and r["error"]["param"] == "user"


def test_metrics_label_values_do_not_grow_with_paths(served):
    client, _ = served
    for name in ("a", "b/c", "x" * 50, TINY):
        client.get(f"/v1/models/{name}")
    text = client.get("/metrics").data.decode()
    paths = {line.split('path="')[1].split('"')[0] for line in text.splitlines()
             if line.startswith("kipp_http_responses_total")}
    assert "/v1/models/<path:name>" in paths
    assert not any(p.startswith("/v1/models/") and "<" not in p for p in paths), paths


PARAMS = [
    # (path, body, param, words in the message)
    ("/v1/completions", {"prompt": "x", "logit_bias": {"999999": 5}}, "logit_bias",
     "outside the vocabulary"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"1": 5, "01": -5}}, "logit_bias",
     "twice"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"-1": 5}}, "logit_bias", "token id"),
    ("/v1/completions", {"prompt": [1.0, 2.5]}, "prompt", "float"),
    ("/v1/completions", {"prompt": ["a", 1]}, "prompt", "prompt[1]"),
    ("/v1/completions", {"prompt": [[1, 2], []]}, "prompt", "prompt[1]' is empty"),
    ("/v1/completions", {"prompt": [5] * CONTEXT}, "prompt", "no room"),
    ("/v1/completions", {"prompt": [5] * (CONTEXT + 1), "echo": True, "max_tokens": 0},
     "prompt", "longer than the context"),
    ("/v1/completions", {"prompt": [5] * 100, "max_tokens": CONTEXT - 50}, "max_tokens",
     "exceeds the context"),
    ("/v1/completions", {"prompt": "x", "n": 8, "max_tokens": 1000}, "max_tokens",
     "KV blocks"),
    ("/v1/completions", {"prompt": "x", "stop": ["y" * (MAX_STOP_CHARS + 1)]}, "stop",
     "characters"),
    (CHAT, {"messages": MESSAGES, "max_completion_tokens": CONTEXT}, "max_completion_tokens",
     f"max_completion_tokens ({CONTEXT})"),
    (CHAT, {"messages": MESSAGES, "max_completion_tokens": 1000, "n": 8},
     "max_completion_tokens", "KV blocks"),
    (CHAT, {"messages": [{"role": "user", "content": "hi " * (CONTEXT + 10)}]}, "messages",
     "longer than the context"),
    (CHAT, {"messages": MESSAGES, "logit_bias": {"151936": 1}}, "logit_bias", "vocabulary"),
]


@pytest.mark.parametrize("path,body,param,words", PARAMS,
                         ids=[f"{i}-{json.dumps(b)[:50]}" for i, (_, b, _, _) in
                              enumerate(PARAMS)])
def test_errors_name_the_field(served, path, body, param, words):
    client, _ = served
    status, r = post(client, path, **body)
    assert status == 400, r
    assert r["error"]["param"] == param and words in r["error"]["message"], r


def test_a_long_stop_string_is_accepted_and_matched(served, model):
    client, _ = served
    _, plain = post(client, "/v1/completions", prompt="Stop strings", max_tokens=12,
                    temperature=0)
    text = plain["choices"][0]["text"]
    never = "\u2603" * 100_000  # 100 k characters that the model does not write
    stop = text[4:8] + "\u2603" * 50_000  # does not match either: only its head does
    for stops in ([never], [never, stop], [never, text[4:8]]):
        status, r = post(client, "/v1/completions", prompt="Stop strings", max_tokens=12,
                         temperature=0, stop=stops)
        assert status == 200
        cut = text[: text.index(text[4:8])] if text[4:8] in stops else text
        assert r["choices"][0]["text"] == cut


# -- 6. the drain: no new requests, queued ones end now, running ones by the deadline

def test_drain_ends_queued_now_and_running_by_the_deadline(model):
    scheduler = Scheduler(model, max_batch=1)
    running = scheduler.submit(Request(prompt=(1, 2, 3), max_tokens=3000))
    queued = scheduler.submit(Request(prompt=(4, 5), max_tokens=4))
    scheduler.step()
    assert scheduler._running and scheduler._fifo
    scheduler.drain(60, wait=False)
    assert scheduler.draining
    with pytest.raises(ShuttingDown):
        scheduler.submit(Request(prompt=(1,), max_tokens=1))
    scheduler.step()
    assert not scheduler._fifo and isinstance(collect(queued)[3], Failed)
    assert scheduler._running  # before its deadline a running request goes on
    scheduler.drain(0, wait=False)  # a second signal: the deadline is now
    scheduler.step()
    last = collect(running)[3]
    assert isinstance(last, Failed) and "shutting down" in last.message
    assert model.pool.num_in_use == 0 and model.pool.reserved == 0


def test_a_draining_server_answers_503(model):
    scheduler = Scheduler(model).start()
    client = create_app(model, scheduler).test_client()
    assert client.get("/health").status_code == 200
    assert scheduler.drain(5)
    r = client.get("/health")
    assert r.status_code == 503 and r.json["error"]["code"] == "shutting_down"
    status, r = post(client, "/v1/completions", prompt="late", max_tokens=2)
    assert status == 503 and r["error"]["code"] == "shutting_down"
    scheduler.stop()


# -- 8. seeded sampling does not depend on the batch, where the backend's rows would

class BatchVariant:
    """The reference backend with logits that depend on the call's other items (as a batched
    round on JAX or MLX can): a tiny offset per companion."""

    batch_invariant = False

    def __init__(self, backend):
        self.inner = backend

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def eval(self, items):
        return [logits + np.float32(1e-3) * (len(items) - 1)
                for logits in self.inner.eval(items)]


def seen_logits(monkeypatch, seed):
    """Record the logits every sampler of `seed` receives."""
    import kipp.engine.choices

    seen = []
    real = kipp.engine.choices.Sampler

    class Recording(real):
        def sample(self, logits, recent_tokens=(), allowed=None):
            if self.params.seed == seed:
                seen.append(np.array(logits, copy=True))
            return super().sample(logits, recent_tokens, allowed)

    monkeypatch.setattr(kipp.engine.choices, "Sampler", Recording)
    return seen


def run_seeded(model, companions, seed=111):
    scheduler = Scheduler(model)
    text = "Seeded sampling must give the same text under load. " * 3
    seeded = Request(prompt=model.tokenizer.encode(text), max_tokens=12, n=2,
                     sampling=SamplingParams(temperature=1.0, seed=seed))
    others = [Request(prompt=model.tokenizer.encode(f"companion {i} " * (i + 1)),
                      max_tokens=14, sampling=SamplingParams(temperature=1.0, seed=i))
              for i in range(companions)]
    tickets = [scheduler.submit(r) for r in others[:2] + [seeded] + others[2:]]
    scheduler.run_until_idle()
    tokens, _, _, done = collect(tickets[min(2, companions)])
    assert isinstance(done, Done)
    return tokens, done


@pytest.mark.slow  # CI's longest default checks
def test_seeded_sampling_does_not_depend_on_batch_companions(artifacts, monkeypatch):
    model = load(artifacts(TINY), backend="reference", kv_tokens=2048, progress=False)
    model.backend = BatchVariant(model.backend)
    seen = seen_logits(monkeypatch, 111)
    alone, _ = run_seeded(model, 0)
    logits_alone = list(seen)
    seen.clear()
    # The same prompt's blocks are now published: a seeded request must not adopt them.
    loaded, done = run_seeded(model, 5)
    assert done.cached_tokens == 0
    assert len(seen) == len(logits_alone)
    assert all((a == b).all() for a, b in zip(seen, logits_alone)), \
        "a seeded choice's logits changed with its batch companions"
    assert loaded == alone
    assert model.backend.inner.batch_invariant  # the reference batches seeded requests


@pytest.mark.slow
def test_seeded_sampling_under_load_on_jax(artifacts, monkeypatch):
    """The JAX backend's batched rounds are not batch-invariant (on the CPU here a row moves by
    ~1e-5 with companions beside it): a seeded request still sees bitwise its lone logits."""
    pytest.importorskip("jax")
    model = load(artifacts(TINY), backend="jax", kv_tokens=2048, progress=False)
    assert not model.backend.batch_invariant
    seen = seen_logits(monkeypatch, 111)
    alone, _ = run_seeded(model, 0)
    logits_alone = list(seen)
    seen.clear()
    loaded, _ = run_seeded(model, 5)
    assert len(seen) == len(logits_alone)
    assert all((a == b).all() for a, b in zip(seen, logits_alone))
    assert loaded == alone
