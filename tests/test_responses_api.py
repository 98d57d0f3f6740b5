"""The OpenAI Responses API (kipp.http.responses) as clients use it: the `openai` package's
responses.create and responses.stream and the `openai-agents` runner against a live
`kipp serve`, raw bodies over HTTP (a table of malformed ones, Codex's captured request), and the
translation's pieces in-process.

Oracles: chat completions on the same server (the same messages render the same prompt, so a
greedy reply must be the same text); /tokenize of the chat messages a Responses input must
become (its token count is the response's input_tokens); jsonschema for call arguments and
structured output; the openai package's pydantic models, which every response and stream event
must validate against; the tokenizer for reasoning budgets.
"""

import asyncio
import json
import re
import threading
import urllib.request
from pathlib import Path
from typing import Literal

import pytest

from live_server import LiveServer

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pydantic = pytest.importorskip("pydantic")
pytest.importorskip("waitress")

from openai.types.responses import Response, ResponseStreamEvent

from kipp.http.response_store import ResponseStore, StoredResponse
from kipp.http.responses import parse_responses
from kipp.http.responses_input import ENCRYPTED_PREFIX, encode_reasoning, input_messages
from kipp.http.responses_shape import ResponsesShape
from kipp.http.responses_tools import parse_tools

TINY = "kipp-synthetic/qwen3-tiny"
THINKING = "kipp-synthetic/qwen3-tiny-thinking"
CODEX = Path(__file__).parent / "data" / "agents" / "codex-responses-request.json"
EVENTS = pydantic.TypeAdapter(ResponseStreamEvent)
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
           "required": ["city"], "additionalProperties": False}
WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "The weather.",
                "parameters": WEATHER, "strict": True}
# The same tool as kipp shows it to the template (chat shape, in this key order).
WEATHER_CHAT = {"type": "function", "function": {"name": "get_weather",
                                                 "description": "The weather.",
                                                 "parameters": WEATHER}}
IM_END = 151645  # <|im_end|>
LONG_INSTRUCTIONS = "You are a terse assistant for a weather desk. " * 12  # > 3 KV blocks


@pytest.fixture(scope="module")
def server(artifacts):
    s = LiveServer(artifacts(TINY), "--kv-tokens", "8192", "--max-batch", "4")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def create(client, **body):
    """responses.create, its raw JSON validated against the openai package's Response."""
    raw = client.responses.with_raw_response.create(model=TINY, **body)
    payload = json.loads(raw.text)
    Response.model_validate(payload)
    return raw.parse(), payload


def stream_events(server, body) -> tuple[list[dict], dict]:
    """A streamed POST /v1/responses read raw: every event validated, `event:` equal to its
    type, sequence numbers 0, 1, 2, ...; the events and the response headers."""
    req = urllib.request.Request(server.url + "/v1/responses", method="POST",
                                 data=json.dumps({"stream": True, **body}).encode(),
                                 headers={"Content-Type": "application/json"})
    events, name = [], None
    with urllib.request.urlopen(req, timeout=300) as response:
        headers = dict(response.headers)
        for line in response:
            line = line.decode().rstrip("\n")
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                event = json.loads(line[6:])
                assert event["type"] == name
                EVENTS.validate_python(event)
                events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events, headers


def joined(events, kind: str, key: str = "delta") -> str:
    return "".join(e[key] for e in events if e["type"] == kind)


def tokens(server, messages, tools=None, model=TINY, *, closed=False) -> int:
    """How many tokens `messages` (chat shape) render to, with the generation prompt (and an
    empty think block after it when `closed`: a grammar-constrained reply's prompt)."""
    body = {"model": model, "messages": messages}
    if closed:
        body["chat_template_kwargs"] = {"enable_thinking": False}
    if tools:
        body["tools"] = tools
    status, text, _ = server.post("/tokenize", body)
    assert status == 200, text
    return json.loads(text)["count"]


def chat_text(client, messages, max_tokens, **extra):
    reply = client.chat.completions.create(model=extra.pop("model", TINY), messages=messages,
                                           max_tokens=max_tokens, temperature=0, **extra)
    return reply.choices[0].message.content, reply.usage


def test_text_whole_and_streamed_match_chat(server, client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    expected, usage = chat_text(client, messages, 8)
    r, _ = create(client, instructions="Be brief.", input="Hi!", max_output_tokens=8,
                  temperature=0, metadata={"run": "t1"})
    assert r.output_text == expected
    assert r.usage.input_tokens == usage.prompt_tokens == tokens(server, messages)
    assert r.usage.output_tokens == usage.completion_tokens
    assert r.metadata == {"run": "t1"} and r.status in ("completed", "incomplete")
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"

    events, _ = stream_events(server, {"model": TINY, "instructions": "Be brief.",
                                       "input": "Hi!", "max_output_tokens": 8,
                                       "temperature": 0})
    kinds = [e["type"] for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", f"response.{r.status}"]
    assert joined(events, "response.output_text.delta") == expected
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == expected

    # Logprobs, asked as OpenAI asks for them: the include turns them on, top_logprobs counts.
    chat = client.chat.completions.create(model=TINY, messages=messages, max_tokens=8,
                                          temperature=0, logprobs=True, top_logprobs=2)
    with_logprobs, _ = create(client, instructions="Be brief.", input="Hi!", max_output_tokens=8,
                              temperature=0, top_logprobs=2,
                              include=["message.output_text.logprobs"])
    entries = with_logprobs.output[0].content[0].logprobs
    assert [(e.token, e.logprob, [t.token for t in e.top_logprobs]) for e in entries] == [
        (c.token, c.logprob, [t.token for t in c.top_logprobs])
        for c in chat.choices[0].logprobs.content]

    # The SDK's stream helper (get_final_response wants response.completed, so read events).
    with client.responses.stream(model=TINY, instructions="Be brief.", input="Hi!",
                                 max_output_tokens=8, temperature=0) as stream:
        last = list(stream)[-1]
    assert last.type == f"response.{r.status}" and last.response.output_text == expected


def test_forced_function_call_and_its_output_round_trip(server, client):
    question = [{"role": "user", "content": "Weather in Paris?"}]
    r, _ = create(client, input="Weather in Paris?", tools=[WEATHER_TOOL],
                  tool_choice={"type": "function", "name": "get_weather"},
                  max_output_tokens=40, temperature=0)
    [call] = r.output
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    assert r.usage.input_tokens == tokens(server, question, [WEATHER_CHAT], closed=True)

    events, _ = stream_events(server, {"model": TINY, "input": "Weather in Paris?",
                                       "tools": [WEATHER_TOOL], "max_output_tokens": 40,
                                       "temperature": 0,
                                       "tool_choice": {"type": "function",
                                                       "name": "get_weather"}})
    assert joined(events, "response.function_call_arguments.delta") == call.arguments
    assert [e["arguments"] for e in events
            if e["type"] == "response.function_call_arguments.done"] == [call.arguments]

    history = [{"role": "user", "content": "Weather in Paris?"}, call.model_dump(),
               {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
    after, _ = create(client, input=history, tools=[WEATHER_TOOL], max_output_tokens=6,
                      temperature=0)
    as_chat = question + [
        {"role": "assistant", "content": "",
         "tool_calls": [{"id": call.call_id, "type": "function",
                         "function": {"name": "get_weather", "arguments": call.arguments}}]},
        {"role": "tool", "content": "sunny"}]
    assert after.usage.input_tokens == tokens(server, as_chat, [WEATHER_CHAT])
    assert after.status in ("completed", "incomplete")


class Answer(pydantic.BaseModel):
    ok: bool
    color: Literal["red", "green"]


def test_text_format_json_schema_is_enforced(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                               "color": {"enum": ["red", "green"]}},
              "required": ["ok", "color"], "additionalProperties": False}
    r, _ = create(client, input="Answer in JSON.", max_output_tokens=40, temperature=0.7,
                  extra_body={"seed": 3}, text={"format": {"type": "json_schema", "name": "answer",
                                           "schema": schema, "strict": True}})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema" and r.text.format.name == "answer"

    # The SDK's structured helpers: a pydantic model as the format, parsed back.
    with client.responses.stream(model=TINY, input="Answer in JSON.", max_output_tokens=40,
                                 text_format=Answer) as stream:
        parsed = stream.get_final_response().output_parsed
    assert isinstance(parsed, Answer)


def test_custom_tools_grammar_and_free_input(server, client):
    lark = 'start: "add " NUM " " NUM\nNUM: /[0-9]{1,3}/'
    calc = {"type": "custom", "name": "calc", "description": "Adds.",
            "format": {"type": "grammar", "syntax": "lark", "definition": lark}}
    word = {"type": "custom", "name": "word",
            "format": {"type": "grammar", "syntax": "regex", "definition": "[a-z]{2,6}"}}
    r, _ = create(client, input="Add two numbers.", tools=[calc, word],
                  tool_choice={"type": "custom", "name": "calc"}, max_output_tokens=20)
    [call] = r.output
    assert call.type == "custom_tool_call" and call.name == "calc"
    assert re.fullmatch(r"add [0-9]{1,3} [0-9]{1,3}", call.input)

    events, _ = stream_events(server, {"model": TINY, "input": "A word.", "tools": [calc, word],
                                       "tool_choice": {"type": "custom", "name": "word"},
                                       "max_output_tokens": 20})
    [done] = [e for e in events if e["type"] == "response.custom_tool_call_input.done"]
    assert re.fullmatch(r"[a-z]{2,6}", done["input"])
    assert joined(events, "response.custom_tool_call_input.delta") == done["input"]



def test_previous_response_id_reuses_the_prefix_then_get_and_delete(server, client):
    first, first_json = create(client, instructions=LONG_INSTRUCTIONS, input="Tell me.",
                               max_output_tokens=6, temperature=0)
    second, _ = create(client, instructions=LONG_INSTRUCTIONS, input="And more.",
                       previous_response_id=first.id, max_output_tokens=6, temperature=0)
    conversation = [{"role": "system", "content": LONG_INSTRUCTIONS},
                    {"role": "user", "content": "Tell me."},
                    {"role": "assistant", "content": first.output_text},
                    {"role": "user", "content": "And more."}]
    # The first prompt is a prefix of the second: all of it is adopted (its partial last
    # block too, and the reply's tokens where the rendering writes them again).
    cached = second.usage.input_tokens_details.cached_tokens
    assert cached >= first.usage.input_tokens - 1, (cached, first.usage.input_tokens)
    assert second.usage.input_tokens == tokens(server, conversation)

    status, text, _ = server.get(f"/v1/responses/{first.id}")
    assert status == 200 and json.loads(text) == first_json
    status, text, _ = server.request("DELETE", f"/v1/responses/{first.id}")
    assert status == 200 and json.loads(text) == {"id": first.id, "object": "response",
                                                  "deleted": True}
    for method in ("GET", "DELETE"):
        status, text, _ = server.request(method, f"/v1/responses/{first.id}")
        assert status == 404 and json.loads(text)["error"]["param"] == "response_id"
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=TINY, input="x", previous_response_id=first.id)
    assert e.value.body["param"] == "previous_response_id"

    unstored, _ = create(client, input="x", max_output_tokens=2, store=False)
    assert server.get(f"/v1/responses/{unstored.id}")[0] == 404


def test_codex_request_is_accepted(models):
    """Codex CLI's captured request parses and renders in full (the live run is in
    test_codex_request_streams, slow): the hosted web_search left out and said so, the
    namespace flattened, its reasoning settings, cache key and client metadata accepted."""
    from kipp.http.schema import ChatContext
    from kipp.http.shape import TokenText

    if not CODEX.exists():
        pytest.skip("tests/data/agents/codex-responses-request.json is not captured")
    body = json.loads(CODEX.read_text())["body"]
    model = models(TINY)
    ctx = ChatContext((TINY,), model.tokenizer, "qwen3", lambda *_, **__: 8)
    rc = parse_responses(body, ctx, ResponseStore())
    names = {tool.name: tool.namespace for tool in rc.tools.tools}
    assert names["spawn_agent"] == "multi_agent_v1" and names["exec_command"] is None
    assert rc.tools.left_out == ("web_search",) and rc.call.stream and not rc.store
    assert len(rc.call.request.prompt) > 8000  # ~21k characters of input, ~18k of tools
    shape = ResponsesShape(rc, TINY, TokenText(model.tokenizer))
    assert "web_search" in shape.headers()["Warning"]


@pytest.mark.slow
def test_codex_request_streams(artifacts):
    """The captured Codex request, streamed whole against a live server (the JAX backend
    prefills its ~8k-token prompt in seconds; the reference backend takes minutes)."""
    if not CODEX.exists():
        pytest.skip("tests/data/agents/codex-responses-request.json is not captured")
    body = json.loads(CODEX.read_text())["body"]
    s = LiveServer(artifacts(TINY), "--backend", "jax", "--kv-tokens", "16384",
                   "--max-output-tokens", "8")
    try:
        events, headers = stream_events(s, body)
    finally:
        s.stop()
    assert "web_search" in headers["Warning"]
    assert events[-1]["type"] in ("response.completed", "response.incomplete")
    assert events[-1]["response"]["usage"]["input_tokens"] > 8000


class Forecast(pydantic.BaseModel):
    sky: Literal["sunny", "cloudy"]


def _agent_run(server, model: str, **agent):
    """An openai-agents run whose first turn is forced to call get_weather (Kipp's grammar
    writes the call); agents then resets tool_choice to auto for the answer."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    calls = []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Oslo"]) -> str:  # an enum: the call is short
        """The weather in a city."""
        calls.append(city)
        return "sunny"

    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    settings = agents.ModelSettings(tool_choice="get_weather", max_tokens=40, temperature=0,
                                    **agent.pop("settings", {}))
    agent = agents.Agent(name="weather", instructions="Answer with the weather.",
                         tools=[get_weather], model=getattr(agents, model)(TINY, client),
                         model_settings=settings, **agent)
    result = asyncio.run(agents.Runner.run(agent, "Weather in Paris?", max_turns=3))
    assert len(calls) == 1 and calls[0] in ("Paris", "Oslo")
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"]
    assert len(result.raw_responses) == 2
    return result, kinds[2:]


def test_openai_agents_runner_on_the_responses_model(server):
    """The answer is structured (output_type): its json_schema format completes the second
    turn, where random weights would write to max_output_tokens, a reply agents refuses
    (ModelBehaviorError on response.incomplete). The first turn sends the format beside the
    forced tool_choice, and the call wins."""
    result, rest = _agent_run(server, "OpenAIResponsesModel", output_type=Forecast)
    assert rest == ["message_output_item"] and isinstance(result.final_output, Forecast)


def test_openai_agents_runner_on_the_chat_completions_model(server):
    """Kipp's chat completions refuse a response_format beside a forced tool_choice, so the
    answer is text, and a bias on <|im_end|> ends it (random weights never stop on their
    own): the final output is the model's empty reply."""
    result, rest = _agent_run(server, "OpenAIChatCompletionsModel",
                              settings={"extra_body": {"logit_bias": {str(IM_END): 100}}})
    assert rest == [] and result.final_output == ""  # agents makes no item of empty text


BAD = [  # (body fields, the param the 4xx names)
    ({"input": 3}, "input"),
    ({"input": []}, "input"),
    ({}, "input"),
    ({"input": "x", "n": 2}, "n"),
    ({"input": "x", "frobnicate": True}, "frobnicate"),
    ({"input": "x", "model": "gpt-4o"}, "model"),
    ({"input": "x", "max_output_tokens": "8"}, "max_output_tokens"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "temperature": 3}, "temperature"),
    ({"input": "x", "top_logprobs": 50}, "top_logprobs"),
    ({"input": "x", "stream": "yes"}, "stream"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "conversation": "conv_1"}, "conversation"),
    ({"input": "x", "truncation": "middle"}, "truncation"),
    ({"input": "x", "metadata": {"a": 1}}, "metadata"),
    ({"input": "x", "include": ["everything"]}, "include"),
    ({"input": "x", "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"input": "x", "reasoning": {"effort": "low"}, "max_reasoning_tokens": 3},
     "reasoning.effort"),
    ({"input": "x", "tools": {"type": "function"}}, "tools"),
    ({"input": "x", "tools": [{"type": "teleport"}]}, "tools[0].type"),
    ({"input": "x", "tools": [{"type": "function", "name": "bad name"}]}, "tools[0].name"),
    ({"input": "x", "tools": [{"type": "function", "name": "f", "parameters": {"type": 5}}]},
     "tools[0].parameters"),
    ({"input": "x", "tools": [{"type": "custom", "name": "c", "format": {
        "type": "grammar", "syntax": "lark", "definition": "start: (("}}]},
     "tools[0].format.definition"),
    ({"input": "x", "tools": [{"type": "custom", "name": "c", "format": {
        "type": "grammar", "syntax": "ebnf", "definition": "x"}}]}, "tools[0].format.syntax"),
    ({"input": "x", "tools": [{"type": "namespace", "name": "ns", "tools": [
        {"type": "web_search"}]}]}, "tools[0].tools[0].type"),
    ({"input": "x", "tools": [WEATHER_TOOL, WEATHER_TOOL]}, "tools"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice"),
    ({"input": "x", "tools": [WEATHER_TOOL], "tool_choice": {"type": "function",
                                                             "name": "get_time"}},
     "tool_choice"),
    ({"input": "x", "tools": [WEATHER_TOOL], "tool_choice": {"type": "custom",
                                                             "name": "get_weather"}},
     "tool_choice"),
    ({"input": "x", "tools": [WEATHER_TOOL, {"type": "web_search"}],
      "tool_choice": {"type": "web_search"}}, "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a",
                                        "schema": {"type": "nope"}}}}, "text.format"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format"),
    ({"input": "x", "text": {"verbosity": "loud"}}, "text.verbosity"),
    ({"input": "x", "previous_response_id": "resp_unknown"}, "previous_response_id"),
    ({"input": [{"type": "message", "role": "user"}]}, "input[0].content"),
    ({"input": [{"type": "message", "role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"type": "function_call_output", "output": "ok"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call", "call_id": "c", "arguments": "{}"}]},
     "input[0].name"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]},
     "input[0].arguments"),
    ({"input": [{"type": "custom_tool_call", "call_id": "c", "name": "f"}]}, "input[0].input"),
    ({"input": [{"type": "reasoning", "summary": [],
                 "encrypted_content": ENCRYPTED_PREFIX + "%%%"}]},
     "input[0].encrypted_content"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": ["hello"]}, "input[0]"),
]


@pytest.mark.parametrize("fields, param", BAD, ids=[p for _, p in BAD])
def test_bad_request_names_its_field(server, fields, param):
    status, text, _ = server.post("/v1/responses", {"model": TINY, **fields})
    assert 400 <= status < 500, text
    error = json.loads(text)["error"]
    assert error["param"] == param, error
    assert error["message"] and error["type"] == "invalid_request_error"


def test_after_bad_requests_the_server_is_idle_and_serves(server, client):
    status, text, _ = server.post("/v1/responses", raw=b"{not json")
    assert status == 400 and json.loads(text)["error"]["code"] == "invalid_json"
    metrics = server.metrics()
    assert metrics["kipp_active_sequences"] == 0
    assert metrics['kipp_kv_blocks{state="in_use"}'] == 0
    assert metrics["kipp_queue_depth"] == 0
    r, _ = create(client, input="Still there?", max_output_tokens=4)
    assert r.usage.output_tokens >= 1
    # max_output_tokens is a ceiling, never an error for being large (a bias ends it at once).
    r, _ = create(client, input="Hi", max_output_tokens=10**9,
                  extra_body={"logit_bias": {str(IM_END): 100}})
    assert r.status == "completed" and r.max_output_tokens == 10**9


def test_input_items_become_chat_messages():
    items = [
        {"type": "message", "role": "developer", "content": [
            {"type": "input_text", "text": "Rules."}]},
        {"role": "user", "content": "Add 2 and 3, then note it."},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "encrypted_content": encode_reasoning("I should add.")},
        {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a": 2}'},
        {"type": "custom_tool_call", "call_id": "c2", "name": "note", "input": "2+3"},
        {"type": "function_call_output", "call_id": "c1", "output": "5"},
        {"type": "custom_tool_call_output", "call_id": "c2",
         "output": [{"type": "input_text", "text": "noted"}]},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Done."}]},
        {"type": "message", "role": "assistant", "status": "completed", "id": "msg_1",
         "content": [{"type": "output_text", "text": "5.", "annotations": []}]},
        # another server's encrypted reasoning: nothing Kipp can read, so no turn at all
        {"type": "reasoning", "summary": [], "encrypted_content": "gAAAA-another-servers"},
        {"role": "user", "content": "Thanks."},
    ]
    assert input_messages(items) == [
        {"role": "system", "content": "Rules."},
        {"role": "user", "content": "Add 2 and 3, then note it."},
        {"role": "assistant", "content": "", "reasoning_content": "I should add.",
         "tool_calls": [
             {"id": "c1", "type": "function", "function": {"name": "add",
                                                           "arguments": '{"a": 2}'}},
             {"id": "c2", "type": "function", "function": {"name": "note",
                                                           "arguments": '{"input": "2+3"}'}}]},
        {"role": "tool", "content": "5", "tool_call_id": "c1"},
        {"role": "tool", "content": "noted", "tool_call_id": "c2"},
        {"role": "assistant", "content": "5.", "reasoning_content": "Done."},
        {"role": "user", "content": "Thanks."},
    ]
    assert input_messages("Hi") == [{"role": "user", "content": "Hi"}]


def test_tools_flatten_namespaces_and_leave_hosted_ones_out():
    tools = parse_tools([
        WEATHER_TOOL, {"type": "web_search"}, {"type": "mcp", "server_label": "x"},
        {"type": "namespace", "name": "agents", "description": "Sub-agents.", "tools": [
            {"type": "function", "name": "spawn", "parameters": {"type": "object"}},
            {"type": "custom", "name": "patch"}]},
        {"type": "web_search"}])
    assert [(t.name, t.kind.value, t.namespace) for t in tools.tools] == [
        ("get_weather", "function", None), ("spawn", "function", "agents"),
        ("patch", "custom", "agents")]
    assert tools.left_out == ("web_search", "mcp")
    assert tools.tools[2].shown()["function"]["parameters"]["properties"] == {
        "input": {"type": "string"}}


def test_allowed_tools_show_only_their_subset(models):
    from kipp.http.schema import ChatContext

    model = models(TINY)
    ctx = ChatContext((TINY,), model.tokenizer, "qwen3", lambda *_, **__: 8)
    other = {**WEATHER_TOOL, "name": "get_time"}
    for mode in ("auto", "required"):
        rc = parse_responses({"model": TINY, "input": "x", "tools": [WEATHER_TOOL, other,
                                                                      {"type": "web_search"}],
                              "tool_choice": {"type": "allowed_tools", "mode": mode, "tools": [
                                  {"type": "function", "name": "get_time"},
                                  {"type": "web_search"}]}}, ctx, ResponseStore())
        assert [t.name for t in rc.constraint.shown] == ["get_time"]
        assert (rc.constraint.grammar is not None) == (mode == "required")


def _without_ids(value):
    """`value` without the random ids and times that differ between two shapes."""
    if isinstance(value, dict):
        return {k: _without_ids(v) for k, v in value.items()
                if k not in ("id", "item_id", "call_id", "created_at", "completed_at",
                             "sequence_number")}
    if isinstance(value, list):
        return [_without_ids(v) for v in value]
    return value


def test_a_reply_with_calls_becomes_items_streamed_and_whole(models):
    """ResponsesShape over scripted engine events: the think block a reasoning item (its text
    encoded when asked), Qwen3's <tool_call> blocks a function_call (with its namespace) and a
    custom_tool_call, streamed events that validate and end in the same response as the whole
    one, and the conversation the store keeps."""
    from kipp.engine.requests import Delta, Done, Finished, FinishReason
    from kipp.http.fields import APIError
    from kipp.http.responses_input import decode_reasoning
    from kipp.http.schema import ChatContext
    from kipp.http.shape import TokenText
    from kipp.text.reasoning import Part

    model = models(TINY)
    ctx = ChatContext((TINY,), model.tokenizer, "qwen3", lambda *_, **__: 64)
    body = {"model": TINY, "input": "Go.", "include": ["reasoning.encrypted_content"],
            "tools": [{"type": "namespace", "name": "desk", "description": "Desk tools.",
                       "tools": [WEATHER_TOOL]}, {"type": "custom", "name": "note"}]}
    rc = parse_responses(body, ctx, ResponseStore())
    weather = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    note = '{"name": "note", "arguments": {"input": "hi"}}'
    events = [Delta(0, "Let me think.", (1, 2), part=Part.REASONING), Delta(0, "", (3,),
                                                                            part=Part.REASONING),
              Delta(0, "Sure.", (4,)), Delta(0, f"<tool_call>\n{weather}\n</tool", (5,)),
              Delta(0, f"_call>\n<tool_call>\n{note}\n</tool_call>", (6,)),
              Finished(0, FinishReason.STOP), Done(10, 0, 6, {})]
    kept = []
    streamed = ResponsesShape(rc, TINY, TokenText(model.tokenizer), kept.append)
    payloads = streamed.first_chunks() + [p for e in events for p in streamed.chunks(e)]
    for payload in payloads:
        EVENTS.validate_python(payload)
    assert [p["sequence_number"] for p in payloads] == list(range(len(payloads)))
    final = payloads[-1]["response"]
    Response.model_validate(final)
    whole = ResponsesShape(rc, TINY, TokenText(model.tokenizer)).response(events)
    assert _without_ids(whole) == _without_ids(final)

    reasoning, message, function, custom = final["output"]
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "Let me think."}]
    assert decode_reasoning(reasoning["encrypted_content"], "x") == "Let me think."
    assert message["content"][0]["text"] == "Sure."
    assert (function["name"], function["namespace"], function["arguments"]) == (
        "get_weather", "desk", '{"city": "Oslo"}')
    assert (custom["type"], custom["name"], custom["input"]) == ("custom_tool_call", "note", "hi")
    assert final["usage"]["output_tokens_details"]["reasoning_tokens"] == 3
    [entry] = kept
    failed = ResponsesShape(rc, TINY, TokenText(model.tokenizer))
    failed.chunks(events[2])
    frames = failed.error_frames(APIError(500, "the engine stopped", type="server_error"))
    error, end = [json.loads(f.split("data: ", 1)[1]) for f in frames]
    EVENTS.validate_python(error)
    EVENTS.validate_python(end)
    assert end["type"] == "response.failed" and end["response"]["output"][0]["type"] == "message"
    assert entry.response is final and list(entry.conversation) == [
        {"role": "user", "content": "Go."},
        {"role": "assistant", "content": "Sure.", "reasoning_content": "Let me think.",
         "tool_calls": [
             {"id": function["call_id"], "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
             {"id": custom["call_id"], "type": "function",
              "function": {"name": "note", "arguments": '{"input": "hi"}'}}]}]


def test_store_is_a_bounded_thread_safe_lru():
    store = ResponseStore(max_entries=3, max_chars=10_000)

    def entry(i, text="x"):
        return StoredResponse({"id": f"resp_{i}"}, ({"role": "user", "content": text},))

    for i in range(3):
        store.put(entry(i))
    assert store.get("resp_0") is not None  # now the most recently used
    store.put(entry(3))
    assert store.get("resp_1") is None and len(store) == 3
    store.put(entry(4, "y" * 9_920))  # over the character bound with any other: they go
    assert [store.get(f"resp_{i}") is not None for i in (0, 2, 3, 4)] == [
        False, False, False, True]
    store.put(entry(5, "z" * 20_000))  # larger than the whole bound: not kept
    assert store.get("resp_5") is None and store.delete("resp_4") and len(store) == 0

    threads = [threading.Thread(target=lambda k=k: [store.put(entry(f"{k}-{i}"))
                                                    for i in range(200)]) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(store) == 3 and store._chars == sum(e.chars for e in store._entries.values())


@pytest.fixture(scope="module")
def thinking(artifacts):
    s = LiveServer(artifacts(THINKING), "--kv-tokens", "4096", "--max-batch", "4")
    yield s
    s.stop()


def _split_inline(text: str) -> tuple[str, str]:
    """The oracle: an inline reply (its prompt opened the block) cut at </think>."""
    reasoning, _, answer = text.partition("</think>")
    return reasoning.strip("\n"), answer.lstrip("\n")


@pytest.mark.slow  # CI's longest-checks step; tests/test_reasoning.py splits the same text
def test_reasoning_item_and_message_equal_the_inline_reply(thinking):
    client = thinking.client()
    body = {"input": "Say something long.", "max_output_tokens": 20, "temperature": 0}
    inline, _ = chat_text(client, [{"role": "user", "content": "Say something long."}], 20,
                          model=THINKING,
                          extra_body={"reasoning_format": "none", "max_reasoning_tokens": 10})
    reasoning, answer = _split_inline(inline)
    assert answer  # the budget closed the block, so both parts are there

    r, raw = create_on(client, THINKING, extra_body={"max_reasoning_tokens": 10}, **body)
    assert [item.type for item in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == reasoning and r.output_text == answer
    assert 0 < r.usage.output_tokens_details.reasoning_tokens <= 10

    events, _ = stream_events(thinking, {"model": THINKING, "max_reasoning_tokens": 10, **body})
    assert joined(events, "response.reasoning_text.delta") == reasoning
    assert joined(events, "response.output_text.delta") == answer
    assert events[-1]["response"]["usage"] == raw["usage"]


def create_on(client, model, **body):
    raw = client.responses.with_raw_response.create(model=model, **body)
    Response.model_validate(json.loads(raw.text))
    return raw.parse(), json.loads(raw.text)


def test_reasoning_effort_sets_the_thinking_budget(models):
    """reasoning.effort as the engine's budget (kipp.text.reasoning.EFFORT_BUDGETS; the live
    bound is checked with max_reasoning_tokens above and, at "minimal", in the slow test
    below); "none" closes the think block in the prompt."""
    from kipp.http.schema import ChatContext
    from kipp.text.chat import EMPTY_THINK

    model = models(TINY)
    ctx = ChatContext((TINY,), model.tokenizer, "qwen3", lambda *_, **__: 8)
    budgets = {}
    for effort in ("none", "minimal", "low", "medium", "high", "xhigh", "max"):
        rc = parse_responses({"model": TINY, "input": "x", "reasoning": {"effort": effort}},
                             ctx, ResponseStore())
        budgets[effort] = rc.call.request.reasoning.budget
        if effort == "none":
            assert model.tokenizer.decode(list(rc.call.request.prompt)).endswith(EMPTY_THINK)
    assert budgets == {"none": 0, "minimal": 256, "low": 1024, "medium": 4096, "high": 16384,
                       "xhigh": None, "max": None}


def test_reasoning_effort_none_thinks_not(thinking):
    r, _ = create_on(thinking.client(), THINKING, input="Quick.", max_output_tokens=4,
                     reasoning={"effort": "none"})
    assert [item.type for item in r.output] == ["message"]
    assert r.usage.output_tokens_details.reasoning_tokens == 0


@pytest.mark.slow
def test_reasoning_effort_minimal_bounds_a_live_reply(thinking, models):
    """280 tokens past a 256-token budget: the engine closes the block, the answer follows."""
    tokenizer = models(THINKING).tokenizer
    r, _ = create_on(thinking.client(), THINKING, input="Think hard.", max_output_tokens=280,
                     temperature=0, reasoning={"effort": "minimal", "summary": "auto"})
    [reasoning, message] = r.output
    assert reasoning.type == "reasoning" and reasoning.summary == []
    assert len(tokenizer.encode(reasoning.content[0].text)) <= 256
    assert r.usage.output_tokens_details.reasoning_tokens <= 256
    assert message.content[0].text


def test_encrypted_reasoning_round_trips(thinking):
    client = thinking.client()
    r, _ = create_on(client, THINKING, input="Weather in Oslo?", tools=[WEATHER_TOOL],
                     include=["reasoning.encrypted_content"], store=False,
                     max_output_tokens=6, temperature=0)
    [item] = r.output
    assert item.type == "reasoning" and item.encrypted_content.startswith(ENCRYPTED_PREFIX)
    text = item.content[0].text
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather",
            "arguments": '{"city": "Oslo"}'}
    sent = [{"role": "user", "content": "Weather in Oslo?"},
            {"type": "reasoning", "id": item.id, "summary": [],
             "encrypted_content": item.encrypted_content},
            call, {"type": "function_call_output", "call_id": "call_1", "output": "cold"}]
    after, _ = create_on(client, THINKING, input=sent, tools=[WEATHER_TOOL],
                         max_output_tokens=2)
    as_chat = [{"role": "user", "content": "Weather in Oslo?"},
               {"role": "assistant", "content": "", "reasoning_content": text,
                "tool_calls": [{"id": "call_1", "type": "function",
                                "function": {"name": "get_weather",
                                             "arguments": '{"city": "Oslo"}'}}]},
               {"role": "tool", "content": "cold"}]
    assert after.usage.input_tokens == tokens(thinking, as_chat, [WEATHER_CHAT], THINKING)
    del as_chat[1]["reasoning_content"]
    assert after.usage.input_tokens > tokens(thinking, as_chat, [WEATHER_CHAT], THINKING)
