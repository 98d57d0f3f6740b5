"""The OpenAI Responses API: POST /v1/responses (streamed and not), GET and DELETE
/v1/responses/{id}, translated onto the one scheduler request (kipp.http.schema.chat_request).

    call = parse_responses(body, server.chat_context(), store)   # or an APIError naming a field
    shape = ResponsesShape(call, server.name, server.token_text, keep=store.put)
    server.answer(call.call, shape, "responses")

Input items become OpenAI chat messages, which kipp.text.chat renders: `instructions` a system
message first, developer messages system ones, `function_call` and `custom_tool_call` items an
assistant's tool calls, their outputs tool messages, and a `reasoning` item the
reasoning_content of the assistant turn that follows it. The reply goes the other way: its think
block becomes a `reasoning` item, Qwen3's <tool_call> blocks `function_call` items, the rest a
`message`. The whole response is the stream's events replayed (ResponsesShape.response), so the
two cannot differ. The Responses API always splits the reasoning off (it has an item for it),
whatever the server's --reasoning-format.

Design choices:
- Custom tools are shown to the model as a function with one string argument, `input` (a
  grammar-formatted tool's description quotes its grammar); a call of one comes back as a
  `custom_tool_call` with that input. Forced by name (tool_choice {"type": "custom"}), the
  whole reply is the input, held to the tool's Lark or regex grammar (kipp.text.grammar), or
  free text for a text-format tool. Unforced, or under "required", the input is any string.
- Namespace tools are flattened into their members (every name must stay unique); a call of a
  member carries its `namespace`.
- Hosted tools (HOSTED_TOOLS: web_search, file_search, code_interpreter, mcp, ...) are not
  shown to the model, and the response says so in a header, `Warning: 299 kipp "tools left
  out: ..."`; the request is served. Every client tolerates a header, and the body keeps
  OpenAI's shape and the client's own `metadata`.
- With include ["reasoning.encrypted_content"] a reasoning item carries its text base64-encoded
  behind ENCRYPTED_PREFIX, so a stateless client (store: false) sends it back and it is
  rendered again. An encoding, not a secret; another server's encrypted content cannot be read
  and is dropped.
- store (default true) keeps the response and its whole conversation in memory
  (kipp.http.response_store, LRU-bounded); previous_response_id renders that conversation
  again before the new input, so the prefix cache reuses the earlier prompt. As at OpenAI,
  instructions and tools are not carried over.

Fields (any other is a 400 naming it). Implemented:
    model, input, instructions, stream, store, previous_response_id, metadata (echoed)
    tools             function, custom, namespace; hosted types left out (the header); any
                      other type a 400
    tool_choice       auto, none, required, {function}, {custom}, {allowed_tools}; forcing a
                      hosted tool is a 400
    parallel_tool_calls  under "required": one call, or one or more
    text.format       text, json_object, json_schema (enforced, strict or not); a forced
                      tool call wins over it (the reply is then a call, not a message)
    max_output_tokens a ceiling: cut to the room the context and the KV pool leave
    temperature, top_p; Kipp's top_k, min_p, penalties, logit_bias and seed
    top_logprobs      with include "message.output_text.logprobs", as at OpenAI
    reasoning.effort  a thinking budget (kipp.text.reasoning.effort_budget)
    max_reasoning_tokens  Kipp's: the budget in tokens, as in chat completions
    include           reasoning.encrypted_content, message.output_text.logprobs
Accepted and ignored, having no meaning here:
    text.verbosity    Qwen3 has no such control
    reasoning.summary, generate_summary   Kipp has no summarizer: summary stays []
    reasoning.context, mode "standard"    Qwen3's template decides which turns keep reasoning
    include (others)  they name items Kipp never makes (web search results, images...)
    user, safety_identifier, service_tier, client_metadata   nothing local uses them
    prompt_cache_key, prompt_cache_retention, prompt_cache_options   the prefix cache is
                      implicit and shared
    max_tool_calls    it bounds hosted tool calls, and none runs here
    truncation        "disabled" or "auto": an input past the context is a 400, never cut
    stream_options    include_obfuscation: nothing is obfuscated
Refused (a 400) unless false or null: background, conversation, prompt, context_management.
"""

from __future__ import annotations

from flask import request

from kipp.http.fields import (
    SAMPLING_FIELDS,
    APIError,
    bad,
    boolean,
    check_fields,
    check_model,
    integer,
    json_body,
    sampling,
)
from kipp.http.response_store import ResponseStore
from kipp.http.responses_input import input_messages
from kipp.http.responses_shape import ENCRYPTED_INCLUDE, ResponsesCall, ResponsesShape
from kipp.http.responses_tools import parse_tools, reply_constraint, text_config
from kipp.http.schema import Call, ChatContext, ChatTurn, chat_request
from kipp.text.reasoning import effort_budget

LOGPROBS_INCLUDE = "message.output_text.logprobs"


INCLUDABLE = frozenset({
    ENCRYPTED_INCLUDE, LOGPROBS_INCLUDE, "file_search_call.results", "web_search_call.results",
    "web_search_call.action.sources", "message.input_image.image_url",
    "computer_call_output.output.image_url", "code_interpreter_call.outputs"})


MAX_TOP_LOGPROBS = 20


MAX_METADATA_KEYS = 16


_IMPLEMENTED = {"model", "input", "instructions", "stream", "tools", "tool_choice",
                "parallel_tool_calls", "text", "max_output_tokens", "top_logprobs", "reasoning",
                "max_reasoning_tokens", "store", "previous_response_id", "include", "metadata",
                "truncation", "stream_options"} | SAMPLING_FIELDS


_IGNORED = {"user": str, "safety_identifier": str, "prompt_cache_key": str,
            "prompt_cache_retention": str, "prompt_cache_options": dict, "client_metadata": dict,
            "service_tier": str, "max_tool_calls": int}


_REFUSED = ("background", "conversation", "prompt", "context_management")


FIELDS = _IMPLEMENTED | set(_IGNORED) | set(_REFUSED)


_SUMMARIES = (None, "auto", "concise", "detailed")


_TYPE_NAMES = {str: "a string", dict: "an object", int: "an integer"}


def parse_responses(body, ctx: ChatContext, store: ResponseStore) -> ResponsesCall:
    """A Responses body as a ResponsesCall, or an APIError naming the body's field."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    check_fields(body, FIELDS, "/v1/responses")
    check_model(body, ctx.served)
    _check_accepted(body)
    stream = boolean(body, "stream", False)
    _check_stream_options(body, stream)
    if "input" not in body:
        raise bad("'input' is required", "input")
    tools = parse_tools(body.get("tools"))
    text, formatted = text_config(body.get("text"))
    constraint = reply_constraint(body, tools, formatted)
    budget, reasoning = _reasoning(body)
    include = _include(body)
    top = integer(body, "top_logprobs", 0, MAX_TOP_LOGPROBS, None)
    logprobs = (top or 0) if LOGPROBS_INCLUDE in include else None
    conversation = _history(body, store) + input_messages(body["input"])
    instructions = _instructions(body)
    turn = ChatTurn(instructions + conversation,
                    tools=[t.shown() for t in constraint.shown] or None,
                    parse_tools=constraint.parse_calls, grammar=constraint.grammar,
                    reasoning_format="auto", reasoning_budget=budget,
                    max_tokens=integer(body, "max_output_tokens", 1, None, None), clamp=True,
                    sampling=sampling(body), logprobs=logprobs, messages_param="input",
                    max_tokens_param="max_output_tokens", reasoning_param="reasoning")
    call = Call("responses", chat_request(turn, ctx), stream, False, logprobs is not None,
                tools=constraint.parse_calls, prompt_param="input",
                max_tokens_param="max_output_tokens")
    keep = boolean(body, "store", True)
    echo = _echo(body, text, reasoning, keep)
    return ResponsesCall(call, echo, constraint, tools, tuple(conversation), keep, include)


def _check_accepted(body: dict) -> None:
    """The fields accepted without effect must still be well-formed; refused ones unset."""
    for name, kind in _IGNORED.items():
        value = body.get(name)
        if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
            raise bad(f"'{name}' must be {_TYPE_NAMES[kind]}", name)
    if body.get("truncation") not in (None, "auto", "disabled"):
        raise bad("'truncation' must be \"auto\" or \"disabled\"", "truncation")
    metadata = body.get("metadata")
    if metadata is not None and (not isinstance(metadata, dict)
                                 or not all(isinstance(v, str) for v in metadata.values())
                                 or len(metadata) > MAX_METADATA_KEYS):
        raise bad(f"'metadata' must be an object of at most {MAX_METADATA_KEYS} string values",
                  "metadata")
    if body.get("background") not in (None, False):
        raise bad("'background' responses are not supported: Kipp answers on the open request",
                  "background", "unsupported_value")
    for name in ("conversation", "prompt", "context_management"):
        if body.get(name) not in (None, [], {}):
            raise bad(f"'{name}' is not supported by Kipp", name, "unsupported_value")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad("'instructions' must be a string", "instructions")


def _check_stream_options(body: dict, stream: bool) -> None:
    options = body.get("stream_options")
    if options is None:
        return
    if not stream:
        raise bad("'stream_options' is only allowed with stream: true", "stream_options")
    if not isinstance(options, dict) or set(options) - {"include_obfuscation"}:
        raise bad("'stream_options' may hold only include_obfuscation", "stream_options")
    boolean(options, "include_obfuscation", False)


def _instructions(body: dict) -> list[dict]:
    text = body.get("instructions")
    return [{"role": "system", "content": text}] if text else []


def _history(body: dict, store: ResponseStore) -> list[dict]:
    """The stored conversation previous_response_id continues, or a 404 naming it."""
    previous = body.get("previous_response_id")
    if previous is None:
        return []
    if not isinstance(previous, str):
        raise bad("'previous_response_id' must be a string", "previous_response_id")
    entry = store.get(previous)
    if entry is None:
        raise APIError(404, f"Previous response with id '{previous}' not found (Kipp keeps "
                            f"stored responses in memory, least recently used out)",
                       "previous_response_id", "previous_response_not_found")
    return list(entry.conversation)


def _include(body: dict) -> frozenset[str]:
    value = body.get("include")
    if value is None:
        return frozenset()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise bad("'include' must be a list of strings", "include")
    for v in value:
        if v not in INCLUDABLE:
            raise bad(f"'include' value {v!r} is not one of {', '.join(sorted(INCLUDABLE))}",
                      "include")
    return frozenset(value)


def _reasoning(body: dict) -> tuple[int | None, dict]:
    """The thinking budget (None: unbounded) and the reasoning settings the response echoes."""
    budget = integer(body, "max_reasoning_tokens", 0, None, None)
    value = body.get("reasoning")
    if value is None:
        return budget, {"effort": None, "summary": None}
    if not isinstance(value, dict):
        raise bad("'reasoning' must be an object", "reasoning")
    for key in value:
        if key not in ("effort", "summary", "generate_summary", "context", "mode"):
            raise bad(f"unsupported field 'reasoning.{key}'", f"reasoning.{key}")
    for key, allowed in (("summary", _SUMMARIES), ("generate_summary", _SUMMARIES),
                         ("context", (None, "auto", "current_turn", "all_turns")),
                         ("mode", (None, "standard"))):
        if value.get(key) not in allowed:
            raise bad(f"'reasoning.{key}' must be one of "
                      f"{', '.join(a for a in allowed if a)}", f"reasoning.{key}")
    effort = value.get("effort")
    if effort is not None:
        if budget is not None:
            raise bad("give either 'max_reasoning_tokens' or 'reasoning.effort', not both",
                      "reasoning.effort")
        if not isinstance(effort, str):
            raise bad("'reasoning.effort' must be a string", "reasoning.effort")
        try:
            budget = effort_budget(effort)
        except ValueError as e:
            raise bad(f"'reasoning.effort': {e}", "reasoning.effort") from None
    summary = value.get("summary") or value.get("generate_summary")
    return budget, {"effort": effort, "summary": summary}


def _echo(body: dict, text: dict, reasoning: dict, store: bool) -> dict:
    """The request's settings as the response object carries them."""
    given = {key: body.get(key) for key in ("instructions", "max_output_tokens",
                                            "previous_response_id", "top_logprobs", "user",
                                            "prompt_cache_key", "safety_identifier")}
    temperature, top_p = body.get("temperature"), body.get("top_p")
    return {**given, "metadata": body.get("metadata") or {},
            "parallel_tool_calls": boolean(body, "parallel_tool_calls", True),
            "reasoning": reasoning, "store": store, "text": text,
            "temperature": 1.0 if temperature is None else temperature,
            "top_p": 1.0 if top_p is None else top_p,
            "tool_choice": body.get("tool_choice") or "auto", "tools": body.get("tools") or [],
            "truncation": body.get("truncation") or "disabled", "background": False,
            "service_tier": "default"}


def register(app, server) -> None:
    """Add the Responses API's routes to `app` (kipp.http.app.Server `server`)."""
    store = ResponseStore()

    @app.post("/v1/responses", endpoint="responses_create")
    def create():
        rc = parse_responses(json_body(), server.chat_context(), store)
        shape = ResponsesShape(rc, server.name, server.token_text,
                               store.put if rc.store else None)
        return server.answer(rc.call, shape, "responses")

    @app.get("/v1/responses/<response_id>", endpoint="responses_get")
    def retrieve(response_id: str):
        if request.args.get("stream") in ("true", "1"):
            raise bad("streaming a stored response again is not supported", "stream")
        entry = store.get(response_id)
        if entry is None:
            raise _not_found(response_id)
        return entry.response

    @app.delete("/v1/responses/<response_id>", endpoint="responses_delete")
    def delete(response_id: str):
        if not store.delete(response_id):
            raise _not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found.", "response_id",
                    "response_not_found")
