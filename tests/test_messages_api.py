"""Anthropic's Messages API against a live `kipp serve`, driven by the official `anthropic`
client and raw HTTP. Oracles: the same conversation through /v1/chat/completions (the text,
with the reasoning inline under reasoning_format "none" and the think block's tokens from its
logprobs) and /tokenize (the prompt's tokens); jsonschema for tool input; the whole message
against the streamed one. The shape is also driven with hand-made events, without a model.
"""

import copy
import http.client
import json
import time
from pathlib import Path

import pytest

from live_server import LiveServer

anthropic = pytest.importorskip("anthropic")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("waitress")

from kipp.engine.requests import Delta, Done, Finished, FinishReason, Request  # noqa: E402
from kipp.http.fields import APIError  # noqa: E402
from kipp.http.messages_shape import MessagesCall, MessageShape, fold  # noqa: E402
from kipp.http.schema import Call  # noqa: E402
from kipp.text.reasoning import Part  # noqa: E402

TINY = "kipp-synthetic/qwen3-tiny"
THINKING = "kipp-synthetic/qwen3-tiny-thinking"
KEY = "test-key"
CLAUDE_CODE = Path(__file__).parent / "data" / "agents" / "claude-messages-request.json"
USER = [{"role": "user", "content": "Name a city."}]
GREEDY = {"temperature": 0}
WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object",
                            "properties": {"city": {"type": "string",
                                                    "enum": ["Paris", "Rome", "Oslo"]},
                                           "days": {"type": "integer", "minimum": 1,
                                                    "maximum": 7}},
                            "required": ["city", "days"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def server(artifacts):
    s = LiveServer(artifacts(TINY), "--api-key", KEY)
    s.headers = {"x-api-key": KEY}
    yield s
    s.stop()


@pytest.fixture(scope="module")
def thinking_server(artifacts):
    s = LiveServer(artifacts(THINKING))
    yield s
    s.stop()


def client_of(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)


def create(server, model=TINY, **body):
    """A whole message and the streamed one's final message, for the same body."""
    client = client_of(server)
    extra = {k: body.pop(k) for k in ("temperature", "top_k", "top_p") if k in body}
    whole = client.messages.create(model=model, **body, extra_body=extra)
    with client.messages.stream(model=model, **body, extra_body=extra) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    return whole, streamed


def blocks(message):
    """A message's content without the random ids."""
    return [{k: v for k, v in b.model_dump(exclude_none=True).items() if k != "id"}
            for b in message.content]


def chat(server, messages, **body):
    status, text, _ = server.post("/v1/chat/completions",
                                  {"model": body.pop("model", TINY), "messages": messages,
                                   **body})
    assert status == 200, text
    return json.loads(text)


def tokenize(server, messages, **body):
    status, text, _ = server.post("/tokenize", {"messages": messages, **body})
    assert status == 200, text
    return json.loads(text)["tokens"]


def count(server, **body):
    status, text, _ = server.post("/v1/messages/count_tokens?beta=true", {"model": TINY,
                                                                         **body})
    assert status == 200, text
    return json.loads(text)["input_tokens"]


def prompt_tokens(usage) -> int:
    return usage.input_tokens + usage.cache_read_input_tokens


def wait_idle(server, timeout=60):
    deadline = time.time() + timeout
    while time.time() < deadline:
        m = server.metrics()
        if (m["kipp_active_sequences"] == 0 and m["kipp_queue_depth"] == 0
                and m['kipp_kv_blocks{state="in_use"}'] == 0):
            return m
        time.sleep(0.2)
    raise AssertionError(f"server not idle: {server.metrics()}")


def test_text_is_chat_completions_text_whole_and_streamed(server):
    system = [{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}]
    whole, streamed = create(server, system=system, messages=USER, max_tokens=10, **GREEDY)
    oracle = chat(server, [{"role": "system", "content": "You are terse."}, *USER],
                  max_tokens=10, temperature=0, chat_template_kwargs={"enable_thinking": False})
    assert whole.id.startswith("msg_") and whole.type == "message" and whole.role == "assistant"
    assert whole.model == TINY
    assert [b.type for b in whole.content] == ["text"]
    assert whole.content[0].text == oracle["choices"][0]["message"]["content"]
    assert blocks(streamed) == blocks(whole)
    reason = {"length": "max_tokens", "stop": "end_turn"}[oracle["choices"][0]["finish_reason"]]
    assert whole.stop_reason == streamed.stop_reason == reason
    completion = oracle["usage"]["completion_tokens"]
    assert whole.usage.output_tokens == streamed.usage.output_tokens == completion
    assert prompt_tokens(whole.usage) == oracle["usage"]["prompt_tokens"]
    assert prompt_tokens(streamed.usage) == oracle["usage"]["prompt_tokens"]
    assert whole.usage.cache_creation_input_tokens == 0


def test_tool_choice_any_gives_a_tool_use_that_fits_its_schema(server):
    whole, streamed = create(server, messages=USER, max_tokens=60, tools=[WEATHER],
                             tool_choice={"type": "any", "disable_parallel_tool_use": True},
                             **GREEDY)
    assert [b.type for b in whole.content] == ["tool_use"]
    use = whole.content[0]
    assert use.id.startswith("toolu_") and use.name == "get_weather"
    jsonschema.validate(use.input, WEATHER["input_schema"])
    assert whole.stop_reason == streamed.stop_reason == "tool_use"
    assert blocks(streamed) == blocks(whole)


def test_a_tool_result_round_trip_renders_as_chat_tool_messages(server):
    first = client_of(server).messages.create(
        model=TINY, messages=USER, max_tokens=60, tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY)
    use = first.content[0]
    history = [*USER, {"role": "assistant", "content": [
                   {"type": "text", "text": "Let me look."},
                   {"type": "tool_use", "id": use.id, "name": use.name, "input": use.input}]},
               {"role": "user", "content": [
                   {"type": "tool_result", "tool_use_id": use.id,
                    "content": [{"type": "text", "text": "Sunny, 21 C"}]},
                   {"type": "text", "text": "And tomorrow?"}]}]
    second, streamed = create(server, messages=history, max_tokens=8, tools=[WEATHER],
                              **GREEDY)
    assert blocks(second) == blocks(streamed) and second.stop_reason == streamed.stop_reason
    openai = [*USER, {"role": "assistant", "content": "Let me look.", "tool_calls": [
                  {"id": use.id, "type": "function",
                   "function": {"name": use.name, "arguments": json.dumps(use.input)}}]},
              {"role": "tool", "tool_call_id": use.id, "content": "Sunny, 21 C"},
              {"role": "user", "content": "And tomorrow?"}]
    function = {"name": WEATHER["name"], "description": WEATHER["description"],
                "parameters": WEATHER["input_schema"]}
    oracle = chat(server, openai, tools=[{"type": "function", "function": function}],
                  max_tokens=8, temperature=0, chat_template_kwargs={"enable_thinking": False})
    text = "".join(b.text for b in second.content if b.type == "text")
    assert text == (oracle["choices"][0]["message"]["content"] or "")
    assert prompt_tokens(second.usage) == oracle["usage"]["prompt_tokens"]


def test_count_tokens_is_the_prompt_the_request_evaluates(server):
    body = {"system": "Be brief.", "messages": USER, "tools": [WEATHER]}
    whole = client_of(server).messages.create(model=TINY, max_tokens=2, **body)
    counted = client_of(server).messages.count_tokens(model=TINY, **body).input_tokens
    assert counted == prompt_tokens(whole.usage) == count(server, **body)
    function = {"name": WEATHER["name"], "description": WEATHER["description"],
                "parameters": WEATHER["input_schema"]}
    rendered = tokenize(server, [{"role": "system", "content": "Be brief."}, *USER],
                        tools=[{"type": "function", "function": function}],
                        chat_template_kwargs={"enable_thinking": False})
    assert counted == len(rendered)


def test_a_stop_sequence_ends_the_reply_and_is_named(server):
    plain = client_of(server).messages.create(model=TINY, messages=USER, max_tokens=12,
                                              extra_body=GREEDY).content[0].text
    middle = next(i for i in range(len(plain) // 2, len(plain)) if not plain[i].isspace())
    stop = plain[middle:middle + 3]
    cut = plain.find(stop)
    assert cut > 0
    whole, streamed = create(server, messages=USER, max_tokens=12, stop_sequences=[stop],
                             **GREEDY)
    for message in (whole, streamed):
        assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
        assert message.content[0].text == plain[:cut]


def test_an_output_format_ends_the_turn_with_json_of_its_schema(server):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    whole, streamed = create(server, messages=USER, max_tokens=30,
                             output_config={"format": {"type": "json_schema",
                                                       "schema": schema}}, **GREEDY)
    assert whole.stop_reason == streamed.stop_reason == "end_turn"
    assert blocks(whole) == blocks(streamed)
    jsonschema.validate(json.loads(whole.content[0].text), schema)


def test_server_tools_are_left_out_and_named_in_a_header(server):
    server_tools = [{"type": "web_search_20250305", "name": "web_search", "max_uses": 3},
                    {"type": "bash_20250124", "name": "bash"}]
    raw = client_of(server).messages.with_raw_response.create(
        model=TINY, messages=USER, max_tokens=2, tools=[WEATHER, *server_tools])
    assert raw.headers["x-kipp-omitted-tools"] == ("web_search (web_search_20250305), "
                                                   "bash (bash_20250124)")
    assert prompt_tokens(raw.parse().usage) == count(server, messages=USER, tools=[WEATHER])
    plain = client_of(server).messages.with_raw_response.create(model=TINY, messages=USER,
                                                                max_tokens=1)
    assert "x-kipp-omitted-tools" not in plain.headers


def _claude_code():
    if not CLAUDE_CODE.exists():
        pytest.skip("no captured Claude Code request")
    return json.loads(CLAUDE_CODE.read_text())


def _stream(server, path, body, headers, stop_after=None):
    """The (event, data) pairs of a streamed response; with `stop_after`, the connection
    closes once that event arrives."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    conn.request("POST", path, json.dumps(body), headers)
    response = conn.getresponse()
    assert response.status == 200, response.read()
    events, name = [], None
    try:
        for raw in response:
            line = raw.decode().rstrip("\n")
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                events.append((name, json.loads(line[6:])))
                if name == stop_after:
                    break
    finally:
        conn.close()
    return events


def test_claude_code_request_is_accepted_and_its_max_tokens_clamped(server):
    """Claude Code 2.1's first request as captured: streamed to ?beta=true, system blocks with
    cache_control, a system message inside messages, adaptive thinking, effort, metadata,
    context_management, defer_loading and max_tokens 32,000 over a ~12k-token prompt."""
    captured = _claude_code()
    body, query = captured["body"], captured["query"]
    headers = {k: v for k, v in captured["headers"].items() if k != "accept-encoding"}
    path = captured["path"] + "?" + "&".join(f"{k}={v}" for k, v in query.items())
    counted = count(server, **{k: v for k, v in body.items() if k != "model"})
    events = _stream(server, path, body, headers, stop_after="ping")
    assert [name for name, _ in events] == ["message_start", "ping"]
    assert events[0][1]["message"]["usage"]["input_tokens"] == counted
    wait_idle(server)  # closing the stream cancelled the request
    status, text, _ = server.post(path, body, headers={"x-api-key": "wrong"})
    assert status == 401
    assert json.loads(text)["error"]["type"] == "authentication_error"


def test_claude_code_request_shortened_runs_through_the_sdk(server):
    """The captured body with its texts cut short and two of its tools (one deferred): the
    beta client streams it to the end and parses every event."""
    body = _claude_code()["body"]
    body = {**body, "max_tokens": 4, "tools": [t for t in body["tools"] if t["name"] in (
        "ToolSearch", "DeferredToolPlaceholder")]}
    body["system"] = [{**b, "text": b["text"][:200]} for b in body["system"]]
    body["messages"] = [{**m, "content": [{**b, "text": b["text"][:200]} for b in m["content"]]}
                        for m in body["messages"]]
    assert {m["role"] for m in body["messages"]} == {"user", "system"}
    body.pop("stream")
    client = client_of(server)
    with client.beta.messages.stream(**body, betas=["claude-code-20250219"]) as stream:
        kinds = [event.type for event in stream]
        message = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"  # the SDK skips ping
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 4
    assert all(b.type in ("thinking", "text") for b in message.content)
    assert all(b.thinking == "" for b in message.content if b.type == "thinking")  # omitted
    shown = count(server, **{**body, "tools": body["tools"][:1]})
    assert prompt_tokens(message.usage) == count(server, **body) == shown  # deferred: unseen


def _bad(body=None, **changes):
    good = {"model": TINY, "max_tokens": 4, "messages": USER}
    out = copy.deepcopy(good if body is None else body)
    for key, value in changes.items():
        if value is _DROP:
            out.pop(key, None)
        else:
            out[key] = value
    return out


_DROP = object()
TOOL_USE = {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
            "input": {"city": "Oslo", "days": 1}}
ROUND = [*USER, {"role": "assistant", "content": [TOOL_USE]}]
IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA"}}


def _result(content, **extra):
    return ROUND + [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": content, **extra}]}]


BAD = [  # (id, path, body, status, the field the message names)
    ("no max_tokens", "", _bad(max_tokens=_DROP), 400, "max_tokens"),
    ("max_tokens string", "", _bad(max_tokens="8"), 400, "max_tokens"),
    ("max_tokens 0", "", _bad(max_tokens=0), 400, "max_tokens"),
    ("unknown field", "", _bad(frequency_penalty=1), 400, "frequency_penalty"),
    ("no model", "", _bad(model=_DROP), 400, "model"),
    ("unknown model", "", _bad(model="claude-opus-4"), 404, "model"),
    ("messages not a list", "", _bad(messages="hi"), 400, "messages"),
    ("no messages", "", _bad(messages=[]), 400, "messages"),
    ("role tool", "", _bad(messages=[{"role": "tool", "content": "x"}]), 400,
     "messages[0].role"),
    ("role a list", "", _bad(messages=[{"role": ["user"], "content": "x"}]), 400,
     "messages[0].role"),
    ("message field", "", _bad(messages=[{"role": "user", "content": "x", "name": "a"}]), 400,
     "messages[0].name"),
    ("content number", "", _bad(messages=[{"role": "user", "content": 5}]), 400,
     "messages[0].content"),
    ("unknown block", "", _bad(messages=[{"role": "user", "content": [{"type": "video"}]}]),
     400, "messages[0].content[0].type"),
    ("image block", "", _bad(messages=[{"role": "user", "content": [IMAGE]}]), 400, "image"),
    ("document block", "", _bad(messages=[{"role": "user", "content": [
        {"type": "document", "source": {"type": "text", "data": "x"}}]}]), 400, "document"),
    ("text without text", "", _bad(messages=[{"role": "user", "content": [{"type": "text"}]}]),
     400, "messages[0].content[0].text"),
    ("block field", "", _bad(messages=[{"role": "user", "content": [
        {"type": "text", "text": "x", "colour": "red"}]}]), 400, "messages[0].content[0].colour"),
    ("tool_use from the user", "", _bad(messages=[{"role": "user", "content": [TOOL_USE]}]),
     400, "messages[0].content[0].type"),
    ("tool_use without id", "", _bad(messages=[*USER, {"role": "assistant", "content": [
        {k: v for k, v in TOOL_USE.items() if k != "id"}]}, *USER]), 400,
     "messages[1].content[0].id"),
    ("tool_use input a list", "", _bad(messages=[*USER, {"role": "assistant", "content": [
        {**TOOL_USE, "input": [1]}]}, *USER]), 400, "messages[1].content[0].input"),
    ("tool_result for an unknown id", "", _bad(messages=[*USER, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_9", "content": "x"}]}]), 400,
     "messages[1].content[0].tool_use_id"),
    ("tool_result with an image", "", _bad(messages=_result([IMAGE])), 400, "image"),
    ("tool_result is_error string", "", _bad(messages=_result("x", is_error="yes")), 400,
     "messages[2].content[0].is_error"),
    ("prefill", "", _bad(messages=ROUND), 400, "messages[1]"),
    ("system number", "", _bad(system=3), 400, "system"),
    ("system image", "", _bad(system=[IMAGE]), 400, "system[0]"),
    ("tool_choice string", "", _bad(tools=[WEATHER], tool_choice="auto"), 400, "tool_choice"),
    ("tool_choice required", "", _bad(tools=[WEATHER], tool_choice={"type": "required"}), 400,
     "tool_choice"),
    ("tool_choice type a list", "", _bad(tools=[WEATHER], tool_choice={"type": ["any"]}), 400,
     "tool_choice"),
    ("tool_choice unknown tool", "", _bad(tools=[WEATHER], tool_choice={"type": "tool",
                                                                        "name": "nope"}),
     400, "tool_choice.name"),
    ("tool_choice any without tools", "", _bad(tool_choice={"type": "any"}), 400,
     "tool_choice"),
    ("tool_choice of a server tool", "", _bad(tools=[{"type": "web_search_20250305",
                                                      "name": "web_search"}],
                                              tool_choice={"type": "tool",
                                                           "name": "web_search"}),
     400, "tool_choice"),
    ("tool without input_schema", "", _bad(tools=[{"name": "f"}]), 400,
     "tools[0].input_schema"),
    ("tool bad name", "", _bad(tools=[{**WEATHER, "name": "get weather"}]), 400,
     "tools[0].name"),
    ("tool bad schema", "", _bad(tools=[{**WEATHER, "input_schema": {
        "type": "object", "properties": 5}}]), 400, "tools[0].input_schema"),
    ("tool in OpenAI's shape", "", _bad(tools=[{"type": "function", "function": {
        "name": "f"}}]), 400, "tools[0].type"),
    ("tools twice", "", _bad(tools=[WEATHER, WEATHER]), 400, "tools[1].name"),
    ("strict tool under auto", "", _bad(tools=[{**WEATHER, "strict": True}]), 400,
     "tools[0].strict"),
    ("thinking budget string", "", _bad(max_tokens=64, thinking={
        "type": "enabled", "budget_tokens": "16"}), 400, "thinking.budget_tokens"),
    ("thinking budget missing", "", _bad(thinking={"type": "enabled"}), 400,
     "thinking.budget_tokens"),
    ("thinking budget over max_tokens", "", _bad(thinking={"type": "enabled",
                                                           "budget_tokens": 4}), 400,
     "thinking.budget_tokens"),
    ("thinking type", "", _bad(thinking={"type": "sometimes"}), 400, "thinking.type"),
    ("thinking type an object", "", _bad(thinking={"type": {}}), 400, "thinking.type"),
    ("thinking a string", "", _bad(thinking="on"), 400, "thinking"),
    ("thinking with a forced tool", "", _bad(max_tokens=64, tools=[WEATHER],
                                             tool_choice={"type": "any"},
                                             thinking={"type": "enabled",
                                                       "budget_tokens": 16}),
     400, "thinking"),
    ("effort", "", _bad(output_config={"effort": "extreme"}), 400, "output_config.effort"),
    ("effort a list", "", _bad(output_config={"effort": ["high"]}), 400,
     "output_config.effort"),
    ("output format", "", _bad(output_config={"format": {"type": "json"}}), 400,
     "output_config.format"),
    ("temperature over 1", "", _bad(temperature=1.5), 400, "temperature"),
    ("top_p 0", "", _bad(top_p=0), 400, "top_p"),
    ("stop_sequences string", "", _bad(stop_sequences="x"), 400, "stop_sequences"),
    ("stream string", "", _bad(stream="yes"), 400, "stream"),
    ("service_tier", "", _bad(service_tier="priority"), 400, "service_tier"),
    ("metadata string", "", _bad(metadata="me"), 400, "metadata"),
    ("container", "", _bad(container="c1"), 400, "container"),
    ("mcp_servers", "", _bad(mcp_servers=[{"type": "url", "url": "http://x", "name": "x"}]),
     400, "mcp_servers"),
    ("prompt past the context", "", _bad(messages=[{"role": "user", "content": "a " * 41000}]),
     400, "messages"),
    ("count_tokens bad block", "/count_tokens", _bad(messages=[{"role": "user", "content": [
        IMAGE]}]), 400, "image"),
    ("count_tokens beta unknown field", "/count_tokens?beta=true", _bad(betas=["x"]), 400,
     "betas"),
    ("unknown path", "/batches", _bad(), 404, None),
    ("body an array", "", [1], 400, None),
]


@pytest.mark.parametrize("path, body, status, field", [b[1:] for b in BAD],
                         ids=[b[0] for b in BAD])
def test_bad_requests_get_anthropic_errors_naming_the_field(server, path, body, status,
                                                            field):
    got, text, _ = server.post("/v1/messages" + path, body, headers={
        "anthropic-version": "2023-06-01"})
    assert got == status, text
    error = json.loads(text)
    assert error["type"] == "error" and set(error) == {"type", "error"}
    kinds = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error"}
    assert error["error"]["type"] == kinds[status]
    assert field is None or field in error["error"]["message"], error


def test_bad_json_methods_and_keys_get_anthropic_errors_too(server):
    for method, raw, headers, status, kind in [
            ("POST", b"{not json", {}, 400, "invalid_request_error"),
            ("GET", None, {}, 405, "invalid_request_error"),
            ("POST", b"{}", {"x-api-key": "wrong"}, 401, "authentication_error")]:
        got, text, _ = server.request(method, "/v1/messages", raw=raw, headers=headers)
        assert got == status and json.loads(text)["error"]["type"] == kind, text
    with pytest.raises(anthropic.BadRequestError) as caught:
        client_of(server).messages.create(model=TINY, messages=USER, max_tokens=4,
                                          thinking={"type": "enabled", "budget_tokens": 9})
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    assert "thinking.budget_tokens" in caught.value.body["error"]["message"]


def test_after_bad_input_the_server_is_idle_and_still_serves(server):
    metrics = wait_idle(server)
    assert metrics['kipp_kv_blocks{state="reserved"}'] == 0
    reply = client_of(server).messages.create(model=TINY, messages=USER, max_tokens=3)
    assert reply.usage.output_tokens == 3 and reply.content[0].type == "text"


def _inline_reasoning(server, budget, max_tokens):
    """The thinking checkpoint's reply with its reasoning inline, and the think block's
    token count (through the closing tag), from chat completions."""
    reply = chat(server, USER, model=THINKING, max_tokens=max_tokens, temperature=0,
                 reasoning_format="none", max_reasoning_tokens=budget, logprobs=True)
    text = reply["choices"][0]["message"]["content"]
    tokens = [t["token"] for t in reply["choices"][0]["logprobs"]["content"]]
    return text, tokens.index("</think>") + 1


@pytest.mark.slow  # CI's longest default checks (with the next, the thinking server's only users)
def test_thinking_with_a_budget_is_the_inline_reasoning_split(thinking_server):
    budget, max_tokens = 20, 32
    inline, think_tokens = _inline_reasoning(thinking_server, budget, max_tokens)
    assert think_tokens <= budget
    reasoning, answer = inline.split("</think>", 1)
    assert reasoning.strip() and answer.strip()
    client = client_of(thinking_server)
    thinking = {"type": "enabled", "budget_tokens": budget}
    whole = client.messages.create(model=THINKING, messages=USER, max_tokens=max_tokens,
                                   thinking=thinking, extra_body=GREEDY)
    with client.messages.stream(model=THINKING, messages=USER, max_tokens=max_tokens,
                                thinking=thinking, extra_body=GREEDY) as stream:
        deltas = {event.delta.type for event in stream if event.type == "content_block_delta"}
        streamed = stream.get_final_message()
    assert deltas == {"thinking_delta", "signature_delta", "text_delta"}
    assert [b.type for b in whole.content] == ["thinking", "text"]
    assert whole.content[0].thinking == reasoning.strip("\n")
    assert whole.content[1].text == answer.lstrip("\n")
    assert whole.content[0].signature
    assert blocks(streamed) == blocks(whole) and streamed.stop_reason == whole.stop_reason


@pytest.mark.slow  # CI's longest default checks
def test_thinking_disabled_omitted_and_adaptive(thinking_server):
    client = client_of(thinking_server)
    ask = dict(model=THINKING, messages=USER, max_tokens=12, extra_body=GREEDY)
    off = client.messages.create(**ask)
    oracle = chat(thinking_server, USER, model=THINKING, max_tokens=12, temperature=0,
                  reasoning_effort="none")
    assert [b.type for b in off.content] == ["text"]
    assert off.content[0].text == oracle["choices"][0]["message"]["content"]
    assert blocks(client.messages.create(**ask, thinking={"type": "disabled"})) == blocks(off)
    thinking = {"type": "enabled", "budget_tokens": 6}
    shown = client.messages.create(**ask, thinking=thinking)
    hidden = client.messages.create(**ask, thinking={**thinking, "display": "omitted"})
    assert hidden.content[0].thinking == "" and shown.content[0].thinking
    assert hidden.content[1:] == shown.content[1:]
    assert hidden.content[0].signature == shown.content[0].signature
    adaptive = client.messages.create(**ask, thinking={"type": "adaptive"},
                                      output_config={"effort": "low"})
    assert [b.type for b in adaptive.content] == ["thinking"]  # 1,024 tokens: all thinking
    assert adaptive.stop_reason == "max_tokens"


# The shape alone: hand-made events, no model.

def _shape(tools=True, **options):
    call = Call("messages", Request(prompt=(1, 2, 3, 4), max_tokens=8), True, False, False,
                tools=tools, prompt_param="messages")
    return MessageShape(MessagesCall(call, **options), TINY, None)


def _events(*texts, reason=FinishReason.STOP, stop=None):
    out = []
    for part, text in texts:
        out.append(Delta(0, text, (), part=part))
    return out + [Finished(0, reason, stop), Done(4, 2, 7, {})]


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


def test_the_stream_folds_into_the_whole_message():
    events = _events((Part.REASONING, "Hm, "), (Part.REASONING, "weather."),
                     (Part.CONTENT, "Checking. "), (Part.CONTENT, CALL[:20]),
                     (Part.CONTENT, CALL[20:]))
    shape = _shape()
    payloads = shape.first_chunks() + [p for e in events for p in shape.chunks(e)]
    assert [p["type"] for p in payloads] == [
        "message_start", "ping",
        "content_block_start", "content_block_delta", "content_block_delta",
        "content_block_delta", "content_block_stop",  # thinking, thinking, signature
        "content_block_start", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop"]
    assert payloads[11]["delta"] == {"type": "input_json_delta",
                                     "partial_json": '{"city": "Oslo"}'}
    message = _shape().response(events)
    folded = fold(payloads)
    for whole in (message, folded):  # the ids are random
        whole.pop("id")
        whole["content"][2].pop("id")
    assert message == folded
    thinking, text, use = message["content"]
    assert thinking["thinking"] == "Hm, weather." and len(thinking["signature"]) == 64
    assert text == {"type": "text", "text": "Checking. "}
    assert use["name"] == "get_weather" and use["input"] == {"city": "Oslo"}
    assert message["stop_reason"] == "tool_use" and message["stop_sequence"] is None
    assert message["usage"] == {"input_tokens": 2, "cache_read_input_tokens": 2,
                                "cache_creation_input_tokens": 0, "output_tokens": 7}
    assert payloads[0]["message"]["usage"]["input_tokens"] == 4  # before the reuse is known


def test_stop_reasons_one_tool_use_and_hidden_thinking():
    def reply(*texts, shape=None, **finish):
        return (shape or _shape()).response(_events(*texts, **finish))

    assert reply((Part.CONTENT, "a"), reason=FinishReason.LENGTH)["stop_reason"] == "max_tokens"
    stopped = reply((Part.CONTENT, "a"), stop="\n\n")
    assert (stopped["stop_reason"], stopped["stop_sequence"]) == ("stop_sequence", "\n\n")
    assert reply((Part.CONTENT, "a"))["stop_reason"] == "end_turn"
    assert reply((Part.CONTENT, CALL), shape=_shape(tools=False))["content"] == [
        {"type": "text", "text": CALL}]  # no tools offered: a call is text
    two = reply((Part.CONTENT, CALL + "\n" + CALL), shape=_shape(one_tool_use=True))
    assert [b["type"] for b in two["content"]] == ["tool_use"]
    hidden = reply((Part.REASONING, "secret"), (Part.CONTENT, "hi"),
                   shape=_shape(hide_thinking=True))
    assert hidden["content"][0]["thinking"] == "" and hidden["content"][1]["text"] == "hi"
    listed = reply((Part.CONTENT, CALL.replace('{"city": "Oslo"}', "[1]")))
    assert [b["type"] for b in listed["content"]] == ["text"]  # input must be an object


def test_errors_mid_stream_are_anthropic_error_events():
    frames = _shape().error_frames(APIError(503, "the server is shutting down"))
    assert frames == ['event: error\ndata: {"type":"error","error":{"type":"overloaded_error",'
                      '"message":"the server is shutting down"}}\n\n']
    assert _shape(omitted_tools=("bash (bash_20250124)",)).headers() == {
        "x-kipp-omitted-tools": "bash (bash_20250124)"}
