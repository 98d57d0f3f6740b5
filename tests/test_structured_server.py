"""Structured output and tool calling through `kipp serve`, driven by the openai client and
LangChain, as users drive it. Every output is checked with `jsonschema` or pydantic (never by
the grammar that made it); the round trip (call, tool result, answer) is checked against
transformers' rendering of the same conversation.

The default suite serves the tiny checkpoint on the jax backend (the fastest here); the same
tests run on the reference and mlx backends under the `slow` marker.
"""

from __future__ import annotations

import copy
import json

import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pydantic = pytest.importorskip("pydantic")
pytest.importorskip("llguidance")
pytest.importorskip("waitress")

from test_server import Server  # noqa: E402
from test_structured import SCHEMAS, closed  # noqa: E402

from kipp.formats.artifact import open_artifact  # noqa: E402
from kipp.model import load  # noqa: E402
from kipp.text import grammar as g  # noqa: E402
from kipp.text.tokenizer import Tokenizer  # noqa: E402

TINY = "kipp-synthetic/qwen3-tiny"
USER = {"role": "user", "content": "What is the weather in Oslo?"}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": closed({"type": "object", "required": ["city", "unit"], "properties": {
        "city": {"type": "string", "maxLength": 10},
        "unit": {"enum": ["celsius", "fahrenheit"]}}})}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": closed({"type": "object", "required": ["a", "b"], "properties": {
        "a": {"type": "integer", "minimum": -99, "maximum": 99},
        "b": {"type": "integer", "minimum": -99, "maximum": 99}}})}}
TOOLS = [WEATHER, ADD]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


class Reading(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=10)
    celsius: int = pydantic.Field(ge=-40, le=50)
    windy: bool


BACKENDS = ["jax", pytest.param("reference", marks=pytest.mark.slow),
            pytest.param("mlx", marks=pytest.mark.slow)]


@pytest.fixture(scope="module", params=BACKENDS)
def server(request, artifacts):
    pytest.importorskip({"jax": "jax", "mlx": "mlx.core"}.get(request.param, "numpy"))
    s = Server(artifacts(TINY), "--backend", request.param, "--kv-tokens", "8192")
    s.backend = request.param
    yield s
    s.stop()


def schema_format(name, schema):
    return {"type": "json_schema",
            "json_schema": {"name": name.replace(" ", "_"), "schema": schema, "strict": True}}


@pytest.mark.parametrize("name", [  # the longest reply: CI's longest default checks
    pytest.param(n, marks=pytest.mark.slow) if n == "nested objects" else n for n in SCHEMAS])
def test_schema_table_through_the_openai_client(server, name):
    client, schema = server.client(), SCHEMAS[name]
    fmt = schema_format(name, schema)
    sampled = client.chat.completions.create(model=TINY, messages=[USER], response_format=fmt,
                                             max_tokens=128, temperature=1.0, seed=11, n=3,
                                             presence_penalty=0.5)
    greedy = list(client.chat.completions.create(  # streamed
        model=TINY, messages=[USER], response_format=fmt, max_tokens=128, temperature=0,
        stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in greedy if c.choices)
    jsonschema.validate(json.loads(text), schema)
    assert [c.choices[0].finish_reason for c in greedy if c.choices][-1] == "stop"
    for choice in sampled.choices:
        jsonschema.validate(json.loads(choice.message.content), schema)
        assert choice.finish_reason == "stop"
    completion = client.completions.create(model=TINY, prompt="Record:", max_tokens=128,
                                           temperature=0.9, seed=13,
                                           extra_body={"response_format": fmt})
    jsonschema.validate(json.loads(completion.choices[0].text), schema)
    assert completion.choices[0].finish_reason == "stop"


def test_openai_parse_with_a_pydantic_model(server):
    client = server.client()
    parsers = [client.chat.completions.parse]
    if hasattr(getattr(client, "beta", None), "chat"):
        parsers.append(client.beta.chat.completions.parse)
    for parse in parsers:
        r = parse(model=TINY, messages=[USER], response_format=Reading, max_tokens=96,
                  temperature=0.7, seed=3)
        assert isinstance(r.choices[0].message.parsed, Reading)
        assert r.choices[0].finish_reason == "stop"


def test_json_object_mode_is_json_syntax(server, artifacts):
    r = server.client().chat.completions.create(
        model=TINY, messages=[USER], response_format={"type": "json_object"}, max_tokens=48,
        temperature=0.6, seed=2, n=2)
    tokenizer = Tokenizer(open_artifact(artifacts(TINY)).tokenizer_data())
    for choice in r.choices:
        text = choice.message.content
        assert text.startswith("{")
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(text), dict)
        else:  # a weak model may leave a string open at max_tokens: still a grammar prefix
            matcher = g.Matcher(g.grammar_tokenizer(tokenizer, (151645, 151643)),
                                g.json_object_grammar())
            for token in tokenizer.encode(text):
                matcher.consume(token)


def _check_calls(calls, only=None):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert only is None or call.function.name == only
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


def test_a_forced_tool_call_wins_over_a_response_format(server):
    """As in OpenAI's API: with tool_choice forcing a call, the reply is the call and the
    response_format (which would hold the content) constrains nothing."""
    r = server.client().chat.completions.create(
        model=TINY, messages=[USER], tools=TOOLS, parallel_tool_calls=False,
        tool_choice={"type": "function", "function": {"name": "add"}},
        response_format={"type": "json_object"}, max_tokens=96, temperature=0.8, seed=5)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    _check_calls(c.message.tool_calls, "add")


@pytest.mark.parametrize("choice, only", [
    ("required", None), ({"type": "function", "function": {"name": "add"}}, "add")])
def test_forced_tool_calls_through_the_openai_client(server, choice, only):
    client = server.client()
    r = client.chat.completions.create(model=TINY, messages=[USER], tools=TOOLS,
                                       tool_choice=choice, parallel_tool_calls=False,
                                       max_tokens=96, temperature=0.8, seed=5, n=2)
    for c in r.choices:
        assert c.finish_reason == "tool_calls" and c.message.content is None
        assert len(c.message.tool_calls) == 1
        _check_calls(c.message.tool_calls, only)
    chunks = list(client.chat.completions.create(
        model=TINY, messages=[USER], tools=TOOLS, tool_choice=choice, max_tokens=100,
        temperature=0.8, seed=6, stream=True))
    deltas = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert [d.index for d in deltas] == list(range(len(deltas))) and deltas
    _check_calls([openai.types.chat.ChatCompletionMessageToolCall(
        id=d.id, type="function", function={"name": d.function.name,
                                            "arguments": d.function.arguments})
        for d in deltas], only)
    reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    assert reason == ("tool_calls" if only else reason) and reason in ("tool_calls", "length")
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    # only a call cut off by max_tokens comes back as text (it is not a valid call)
    assert not content or (reason == "length" and content.startswith("<tool_call>"))


def test_round_trip_renders_as_transformers(server):
    """Call, tool result, answer: the answer's prompt is the conversation as transformers
    renders it. Greedy text is a function of the prompt, so the chat answer must equal a raw
    completion of transformers' text, token for token."""
    transformers = pytest.importorskip("transformers")
    client = server.client()
    system = {"role": "system", "content": "You are a weather bot."}
    r = client.chat.completions.create(model=TINY, messages=[system, USER], tools=TOOLS,
                                       tool_choice={"type": "function",
                                                    "function": {"name": "get_weather"}},
                                       max_tokens=96, temperature=0)
    call = r.choices[0].message
    assert call.content is None and call.tool_calls[0].function.name == "get_weather"
    messages = [system, USER, call.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.tool_calls[0].id,
                 "content": '{"celsius": 21, "windy": false}'}]
    answer = client.chat.completions.create(model=TINY, messages=messages, tools=TOOLS,
                                            max_tokens=12, temperature=0, logprobs=True)
    hf = _hf_tokenizer(transformers)
    # The upstream template needs a string content beside tool calls (OpenAI sends null).
    upstream = copy.deepcopy(messages)
    upstream[2]["content"] = ""
    text = hf.apply_chat_template(upstream, tools=TOOLS, tokenize=False,
                                  add_generation_prompt=True)
    from kipp.text.chat import render

    assert render(messages, tools=TOOLS) == text
    raw = client.completions.create(model=TINY, prompt=text, max_tokens=12, temperature=0,
                                    logprobs=0)
    assert answer.usage.prompt_tokens == raw.usage.prompt_tokens == len(hf.encode(text))
    assert answer.choices[0].message.content == raw.choices[0].text
    assert [t.token for t in answer.choices[0].logprobs.content] == raw.choices[0].logprobs.tokens


def _hf_tokenizer(transformers):
    import pathlib
    import tempfile

    from kipp.text.tokenizer_files import tokenizer_config, tokenizer_json_bytes

    folder = pathlib.Path(tempfile.mkdtemp())
    (folder / "tokenizer.json").write_bytes(tokenizer_json_bytes())
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config("instruct")))
    return transformers.AutoTokenizer.from_pretrained(str(folder))


def test_langchain_structured_output_and_bind_tools(server):
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(model=TINY, base_url=server.url + "/v1", api_key="unused",
                                      temperature=0.7, seed=8, max_tokens=96, max_retries=0)
    # response_format, then a named tool call (strict: LangChain closes the parameters' objects;
    # open ones let a weak model add keys until max_tokens)
    for method in ("json_schema", "function_calling"):
        reading = llm.with_structured_output(Reading, method=method, strict=True).invoke(
            "Weather in Oslo?")
        assert isinstance(reading, Reading), method
    schema = {**SCHEMAS["enums"], "title": "pick"}  # LangChain names the format by its title
    raw = llm.with_structured_output(schema, method="json_schema").invoke("Pick one")
    jsonschema.validate(raw, schema)
    for choice, only in (("required", None), ("add", "add")):
        message = llm.bind_tools(TOOLS, tool_choice=choice, parallel_tool_calls=False).invoke(
            "What is 2 + 3?")
        assert len(message.tool_calls) == 1
        call = message.tool_calls[0]
        assert only is None or call["name"] == only
        jsonschema.validate(call["args"], PARAMETERS[call["name"]])


BAD = [
    ({"response_format": schema_format("x", {"type": "object", "properties": {
        "a": {"type": "strin"}}})}, "response_format", "properties/a/type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
     "response_format", "name"),
    ({"response_format": {"type": "xml"}}, "response_format", "must be"),
    ({"tool_choice": "required"}, "tool_choice", "needs 'tools'"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "not in tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "must be"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": 7}}}}}]}, "tools",
     r"tools\[0\].function.parameters"),
    ({"tools": [{"type": "retrieval"}]}, "tools", "type"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "xml"}},
     "response_format", "must be"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls", "boolean"),
]


@pytest.mark.parametrize("extra, param, match", BAD, ids=[b[1] + "-" + b[2] for b in BAD])
def test_bad_constraints_are_400s_naming_the_field(server, extra, param, match):
    status, text, _ = server.post("/v1/chat/completions",
                                  {"model": TINY, "messages": [USER], **extra})
    assert status == 400, text
    error = json.loads(text)["error"]
    assert error["param"] == param
    assert __import__("re").search(match, error["message"]), error["message"]
    assert server.get("/health")[0] == 200


def test_the_oracle_agrees_with_the_server_on_a_constrained_greedy_reply(server, artifacts):
    """Tokens through the server equal Model.generate on the same prompt and grammar."""
    schema = SCHEMAS["required and optional"]
    r = server.client().completions.create(model=TINY, prompt="Record:", max_tokens=64,
                                           temperature=0, extra_body={
                                               "response_format": schema_format("r", schema)})
    model = load(artifacts(TINY), backend=server.backend, kv_tokens=2048, progress=False)
    assert r.choices[0].text == model.generate("Record:", 64, temperature=0, json_schema=schema)
