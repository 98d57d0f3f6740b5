"""Constrained decoding (kipp.text.grammar) from the sampler up to the Python API and the scheduler.

The synthetic checkpoints know no language, so only the grammar can make their output parse:
every output here is checked with `jsonschema` (an independent validator), and one test shows
the same prompts unconstrained do not produce valid JSON (the check can fail). The server and
its clients (openai, LangChain) are in tests/test_structured_server.py.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import kipp.engine.scheduler

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

from kipp.engine.scheduler import Request, Scheduler, collect  # noqa: E402
from kipp.model import GenerationError, load  # noqa: E402
from kipp.text import grammar as g  # noqa: E402
from kipp.text.chat import ToolCallStream, parse_tool_calls  # noqa: E402
from kipp.text.sampling import Sampler, SamplingError, SamplingParams, logprobs  # noqa: E402

TINY = "kipp-synthetic/qwen3-tiny"


def closed(schema: dict) -> dict:
    """OpenAI strict style: every object closed (no free extra keys)."""
    return {**schema, "additionalProperties": False}


SCHEMAS = {
    "nested objects": closed({
        "type": "object", "required": ["user", "ok"],
        "properties": {"ok": {"type": "boolean"}, "user": closed({
            "type": "object", "required": ["id", "address"],
            "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9999},
                           "address": closed({
                "type": "object", "required": ["zip"],
                "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}})}})}}),
    "array with bounds": closed({
        "type": "object", "required": ["items"],
        "properties": {"items": {"type": "array", "minItems": 2, "maxItems": 4,
                                 "items": {"type": "integer", "minimum": -5, "maximum": 5}}}}),
    "enums": closed({
        "type": "object", "required": ["color", "size"],
        "properties": {"color": {"enum": ["red", "green", "blue"]},
                       "size": {"type": "string", "enum": ["S", "M", "L"]}}}),
    "numbers with ranges": closed({
        "type": "object", "required": ["score", "ratio", "count"],
        # A float's fraction digits are bounded only by a step (multipleOf): without one a
        # weak model may write 0.6666... up to max_tokens (a valid number, never closed).
        "properties": {"score": {"type": "number", "minimum": 0, "maximum": 10,
                                 "multipleOf": 0.5},
                       "ratio": {"type": "number", "exclusiveMinimum": 0,
                                 "exclusiveMaximum": 1, "multipleOf": 0.25},
                       "count": {"type": "integer", "minimum": 100, "maximum": 999}}}),
    "strings with patterns and maxLength": closed({
        "type": "object", "required": ["code", "note"],
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
                       "note": {"type": "string", "maxLength": 6}}}),
    "anyOf": closed({
        "type": "object", "required": ["value"],
        "properties": {"value": {"anyOf": [
            {"type": "integer", "minimum": 0, "maximum": 9},
            {"type": "string", "maxLength": 4},
            closed({"type": "object", "required": ["x"],
                    "properties": {"x": {"type": "boolean"}}})]}}}),
    "required and optional": closed({
        "type": "object", "required": ["id"],
        "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 99},
                       "label": {"type": "string", "maxLength": 5},
                       "flag": {"type": "boolean"}}}),
}
PROMPT = "Fill in the record:"


def check(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema)


# -- grammars ------------------------------------------------------------------------------


@pytest.mark.parametrize("build, param, match", [
    (lambda: g.json_schema_grammar({"type": "strin"}), "json_schema", "not a valid JSON Schema"),
    (lambda: g.json_schema_grammar({"properties": {"a": {"minimum": "x"}}}), "json_schema",
     r"at properties/a/minimum"),
    (lambda: g.json_schema_grammar("{not json"), "json_schema", "not valid JSON"),
    (lambda: g.json_schema_grammar([1]), "json_schema", "JSON Schema object"),
    (lambda: g.regex_grammar("(unclosed"), "regex", "cannot enforce"),
    (lambda: g.lark_grammar("start: missing_rule"), "grammar", "cannot enforce"),
    (lambda: g.response_format_grammar({"type": "json"}), "response_format", "must be"),
    (lambda: g.response_format_grammar({"type": "json_schema", "json_schema": {"name": "n"}}),
     "response_format", "schema is required"),
    (lambda: g.response_format_grammar({"type": "json_schema", "json_schema": {
        "name": "n", "schema": {"type": 3}}}), "response_format",
     "response_format.json_schema.schema is not a valid JSON Schema"),
    (lambda: g.function_tools([{"type": "function", "function": {"name": "a b"}}]), "tools",
     "name must be"),
    (lambda: g.function_tools([{"type": "function", "function": {
        "name": "f", "parameters": {"type": "objekt"}}}]), "tools.function.parameters",
     r"tools\[0\]\.function\.parameters is not a valid JSON Schema"),
    (lambda: g.tool_choice_grammar(g.function_tools([{"type": "function", "function": {
        "name": "f"}}]), {"type": "function", "function": {"name": "g"}}), "tool_choice",
     "not in tools"),
    (lambda: g.tool_choice_grammar(None, "required"), "tool_choice", "needs tools"),
])
def test_bad_constraints_name_their_field(build, param, match):
    with pytest.raises(g.GrammarError, match=match) as error:
        build()
    assert error.value.param.startswith(param.split(".")[0])


def test_pydantic_models_are_accepted_as_schemas():
    pydantic = pytest.importorskip("pydantic")

    class Point(pydantic.BaseModel):
        x: int
        y: int = 0

    assert g.schema_dict(Point) == {**Point.model_json_schema(), "additionalProperties": False}
    assert g.response_format_grammar(Point, bare_schema=True).kind == "json_schema"
    with pytest.raises(g.GrammarError):  # the server takes OpenAI's shape only
        g.response_format_grammar(Point)


# -- the sampler's mask step --------------------------------------------------------------


def _logits(seed=0, n=1000):
    return np.random.default_rng(seed).normal(0, 3, n).astype(np.float32)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=1),
    SamplingParams(temperature=0.7, top_k=5, seed=2), SamplingParams(temperature=1, top_p=0.5,
                                                                     seed=3),
    SamplingParams(temperature=1, min_p=0.2, seed=4, repetition_penalty=1.3,
                   logit_bias={7: 5.0})])
def test_mask_restricts_every_sampling_path(params):
    x = _logits()
    allowed = np.zeros(x.size, dtype=bool)
    allowed[[3, 500, 999]] = True
    sampler = Sampler(params, vocab_size=x.size)
    picks = {sampler.sample(x, [3, 3, 500], allowed) for _ in range(200)}
    assert picks <= {3, 500, 999}
    before = x.copy()
    sampler.sample(x, [], allowed)
    assert np.array_equal(x, before)  # the caller's logits are never written


def test_greedy_under_a_mask_is_the_best_allowed_and_logprobs_stay_raw():
    x = _logits(1)
    allowed = np.zeros(x.size, dtype=bool)
    allowed[::7] = True
    token = Sampler(SamplingParams(temperature=0), vocab_size=x.size).sample(x, [], allowed)
    assert token == int(np.flatnonzero(allowed)[np.argmax(x[allowed])])
    assert token != int(np.argmax(x)) or allowed[np.argmax(x)]
    lp, _ = logprobs(x, token)
    shifted = x - x.max()
    assert lp == pytest.approx(shifted[token] - np.log(np.exp(shifted).sum()), abs=1e-5)


def test_a_mask_that_allows_nothing_is_an_error():
    with pytest.raises(SamplingError, match="allows no token"):
        Sampler(SamplingParams(temperature=0), vocab_size=10).sample(
            _logits(n=10), [], np.zeros(10, dtype=bool))


# -- tool calls out of generated text -----------------------------------------------------

CALL_A = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
CALL_B = '<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 1}"}\n</tool_call>'
TOOL_TEXTS = [
    ("plain text", "Hello there.", "Hello there.", []),
    ("one call", CALL_A, None, [("get_weather", {"city": "Oslo"})]),
    ("two calls", CALL_A + "\n" + CALL_B, None,
     [("get_weather", {"city": "Oslo"}), ("add", {"a": 1})]),
    ("text then a call", "Let me check.\n" + CALL_A, "Let me check.\n",
     [("get_weather", {"city": "Oslo"})]),
    ("think block then a call", "<think>\nhm\n</think>\n\n" + CALL_A,
     "<think>\nhm\n</think>\n\n", [("get_weather", {"city": "Oslo"})]),
    ("invalid body stays content", "<tool_call>\n{oops}\n</tool_call>",
     "<tool_call>\n{oops}\n</tool_call>", []),
    ("unterminated block stays content", "x <tool_call>\n{\"name\"",
     "x <tool_call>\n{\"name\"", []),
    ("a lone '<'", "a < b", "a < b", []),
]


@pytest.mark.parametrize("name, text, content, calls", TOOL_TEXTS,
                         ids=[t[0] for t in TOOL_TEXTS])
def test_tool_calls_parse_whole_and_streamed(name, text, content, calls):
    got_content, got_calls = parse_tool_calls(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
    for step in (1, 3, 7):  # streamed in pieces: the same content and calls
        stream, pieces = ToolCallStream(), []
        for i in range(0, len(text), step):
            pieces += stream.feed(text[i:i + step])
        pieces += stream.flush()
        assert "".join(v for k, v in pieces if k == "content") == (content or "")
        assert [v.name for k, v in pieces if k == "tool_call"] == [c[0] for c in calls]


# -- whole generations on the tiny checkpoint ---------------------------------------------


@pytest.fixture(scope="module")
def jax_model(artifacts):
    pytest.importorskip("jax")
    return load(artifacts(TINY), backend="jax", kv_tokens=4096, progress=False)


def test_unconstrained_output_is_not_json(models):
    """The planted fault: without the grammar the same generations do not parse."""
    model = models(TINY)
    text = model.generate(PROMPT, 24, temperature=0)
    with pytest.raises(ValueError):
        json.loads(text)


def assert_schema_table(model, name):
    """Every generation of the table, greedy and sampled, validates and ends with "stop"."""
    schema = SCHEMAS[name]
    for sampling in (dict(temperature=0), dict(temperature=1.0, seed=5),
                     dict(temperature=0.8, top_p=0.9, presence_penalty=1.0, seed=6)):
        generation = model.generate(PROMPT, 128, json_schema=schema, stream=True, **sampling)
        check("".join(generation), schema)
        assert generation.stats.finish_reason == "stop", sampling


@pytest.mark.parametrize("name", SCHEMAS)
def test_schema_table_jax_greedy_and_sampled(jax_model, name):
    assert_schema_table(jax_model, name)


@pytest.fixture(scope="module")
def mlx_model(artifacts):
    pytest.importorskip("mlx.core")
    return load(artifacts(TINY), backend="mlx", kv_tokens=4096, progress=False)


@pytest.mark.slow
@pytest.mark.parametrize("name", SCHEMAS)
def test_schema_table_mlx_greedy_and_sampled(mlx_model, name):
    assert_schema_table(mlx_model, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", SCHEMAS)
def test_schema_table_reference_greedy_and_sampled(models, name):
    assert_schema_table(models(TINY), name)


def test_regex_and_lark_grammars(jax_model):
    text = jax_model.generate(PROMPT, 32, temperature=1.0, seed=3, regex=r"[a-c]{2,5}-[0-9]{3}")
    assert __import__("re").fullmatch(r"[a-c]{2,5}-[0-9]{3}", text)
    lark = 'start: "answer: " ("yes" | "no") "."'
    assert jax_model.generate(PROMPT, 16, temperature=0.9, seed=1, grammar=lark) in (
        "answer: yes.", "answer: no.")
    with pytest.raises(GenerationError, match="at most one"):
        jax_model.generate(PROMPT, 8, json_schema={}, regex="a")


def test_speculation_verifies_drafts_against_the_grammar(jax_model):
    """Greedy + speculative emits exactly the plain greedy constrained tokens; repetitive JSON
    gives the drafter material, and every draft token the grammar bars is rejected."""
    schema = {"type": "object", "properties": {"xs": {"type": "array", "maxItems": 12,
                                                      "items": {"enum": ["ab", "cd"]}}},
              "required": ["xs"], "additionalProperties": False}
    prompt = 'a b c a b c {"xs": ["ab", "cd", "ab", "cd"]} {"xs": ["ab", "cd", "ab"'
    plain = jax_model.generate(prompt, 80, temperature=0, json_schema=schema, stream=True)
    text = "".join(plain)
    spec = jax_model.generate(prompt, 80, temperature=0, json_schema=schema, stream=True,
                              speculative=True)
    assert "".join(spec) == text and spec.stats.tokens == plain.stats.tokens
    check(text, schema)
    assert spec.stats.spec.drafted > 0


def test_chat_with_tools_returns_parsed_calls(jax_model):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": closed({
        "type": "object", "required": ["city"],
        "properties": {"city": {"type": "string", "maxLength": 8}}})}},
             {"type": "function", "function": {"name": "add", "parameters": closed({
                 "type": "object", "required": ["a", "b"],
                 "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}})}}]
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    for choice in ("required", {"type": "function", "function": {"name": "add"}}):
        reply = jax_model.chat(messages, 96, temperature=0.7, seed=2, tools=tools,
                               tool_choice=choice, parallel_tool_calls=False)
        assert reply.finish_reason == "tool_calls" and reply.content is None
        assert len(reply.tool_calls) == 1
        call = reply.tool_calls[0]
        assert choice == "required" or call.name == "add"
        schema = next(t["function"]["parameters"] for t in tools
                      if t["function"]["name"] == call.name)
        jsonschema.validate(call.parsed_arguments, schema)
        assert reply.message["tool_calls"][0]["function"]["name"] == call.name



def test_chat_response_formats(jax_model):
    pydantic = pytest.importorskip("pydantic")

    class Reading(pydantic.BaseModel):
        city: str = pydantic.Field(max_length=8)
        celsius: int = pydantic.Field(ge=-40, le=50)

    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    for fmt in (Reading, {"type": "json_schema", "json_schema": {
            "name": "reading", "schema": closed(Reading.model_json_schema()),
            "strict": True}}):
        text = jax_model.chat(messages, 64, temperature=0.5, seed=4, response_format=fmt).content
        Reading.model_validate_json(text)
    # JSON mode bounds nothing but the syntax: a weak model may not close its strings within
    # max_tokens, so the check is that the text is a JSON object or a prefix the grammar admits
    text = jax_model.chat(messages, 48, temperature=0,
                          response_format={"type": "json_object"}).content
    matcher = g.Matcher(g.grammar_tokenizer(jax_model.tokenizer, jax_model.entry.stop_token_ids),
                        g.json_object_grammar())
    for token in jax_model.tokenizer.encode(text):
        matcher.consume(token)
    assert text.startswith("{")


# -- the scheduler: n > 1, penalties, logprobs, prefix reuse, speculation -------------------


def test_scheduler_choices_each_follow_the_grammar(jax_model):
    schema = SCHEMAS["enums"]
    prompt = tuple(jax_model.tokenizer.encode(PROMPT * 10))  # spans whole 32-token blocks
    assert len(prompt) > 32
    grammar = g.json_schema_grammar(schema)
    scheduler = Scheduler(jax_model, max_batch=8, masks_ahead=True)  # the accelerator path
    first = scheduler.submit(Request(prompt, 64, n=3, grammar=grammar, logprobs=2,
                                     sampling=SamplingParams(temperature=1.2, seed=9,
                                                             frequency_penalty=0.5)))
    plain = scheduler.submit(Request(prompt, 8, sampling=SamplingParams(temperature=0)))
    scheduler.run_until_idle()
    tokens, texts, reasons, done = collect(first)
    for text in texts:
        check(text, schema)
    assert reasons == ["stop"] * 3 and done.completion_tokens == sum(map(len, tokens))
    second = scheduler.submit(Request(prompt, 64, n=1, grammar=grammar,
                                      sampling=SamplingParams(temperature=0)))
    scheduler.run_until_idle()
    _, texts2, reasons2, done2 = collect(second)
    check(texts2[0], schema)
    assert reasons2 == ["stop"] and done2.cached_tokens > 0  # prefix reuse still applies
    assert collect(plain)[2] == ["length"]  # an unconstrained neighbour is untouched
    # greedy in the scheduler equals greedy through generate()
    assert texts2[0] == jax_model.generate(list(prompt), 64, temperature=0, json_schema=schema)


def test_speculative_scheduler_matches_plain(jax_model):
    schema = {"type": "object", "properties": {"xs": {"type": "array", "maxItems": 10,
                                                      "items": {"enum": ["ab", "cd"]}}},
              "required": ["xs"], "additionalProperties": False}
    prompt = tuple(jax_model.tokenizer.encode('{"xs": ["ab", "cd", "ab", "cd"]} {"xs": ["ab"'))
    grammar = g.json_schema_grammar(schema)
    outputs = []
    for speculative in (False, True):
        scheduler = Scheduler(jax_model, speculative=speculative)
        ticket = scheduler.submit(Request(prompt, 64, grammar=grammar,
                                          sampling=SamplingParams(temperature=0)))
        scheduler.run_until_idle()
        outputs.append(collect(ticket)[:3])
        drafted = scheduler.counters["spec_drafted"]
    assert outputs[0] == outputs[1]
    check(outputs[0][1][0], schema)
    assert drafted > 0


def test_masks_ahead_only_where_the_backend_leaves_the_host_free(jax_model, monkeypatch):
    from types import SimpleNamespace as NS

    assert g.masks_ahead(NS(device=NS(platform="gpu")))  # JAX on a GPU
    assert g.masks_ahead(NS(device="gpu"))  # MLX on Metal
    assert not g.masks_ahead(NS(device=NS(platform="cpu")))
    assert not g.masks_ahead(NS(device="cpu")) and not g.masks_ahead(object())  # reference
    assert not Scheduler(jax_model).masks_ahead  # jax on this CPU
    # Generation with the masks computed ahead emits the same tokens as computed on demand
    schema = SCHEMAS["strings with patterns and maxLength"]
    plain = jax_model.generate(PROMPT, 64, temperature=0.9, seed=4, json_schema=schema,
                               stream=True)
    text = "".join(plain)
    monkeypatch.setattr(jax_model.engine, "masks_ahead", True)
    prefetched = []
    real = g.prefetch
    monkeypatch.setattr(kipp.engine.scheduler, "prefetch",
                        lambda matchers: prefetched.append(len(matchers)) or real(matchers))
    ahead = jax_model.generate(PROMPT, 64, temperature=0.9, seed=4, json_schema=schema,
                               stream=True)
    assert "".join(ahead) == text and prefetched
    check(text, schema)


def test_a_grammar_that_cannot_compile_is_refused_at_submit(jax_model):
    from kipp.engine.scheduler import SchedulerError

    scheduler = Scheduler(jax_model)
    bad = g.Grammar("lark", '{"grammars": [{"lark_grammar": "start: nope"}]}', "grammar")
    with pytest.raises(SchedulerError) as error:
        scheduler.submit(Request((1, 2, 3), 4, grammar=bad))
    assert error.value.param == "grammar"
