"""Anthropic's Messages API: POST /v1/messages (streamed and not) and
/v1/messages/count_tokens (also under ?beta=true, as Claude Code calls them), translated onto
the one scheduler request (kipp.http.schema.chat_request); errors in Anthropic's shape.

A body becomes a ChatTurn in OpenAI's message shape: `system` and every `role: "system"`
message become system turns (Claude Code sends one inside `messages`), consecutive turns of
one role are joined (as Anthropic joins them), text blocks join with a blank line, `tool_use`
blocks become the assistant's tool calls, `tool_result` blocks tool messages, and `thinking`
sent back the assistant's reasoning (the template keeps it only after the last user query,
which is where Anthropic needs it: inside a tool loop). The reply's think block comes out as a
`thinking` block, its answer as `text`, each Qwen3 <tool_call> as a `tool_use` block with its
arguments parsed; the whole message is folded from the very events a stream sends, so
streamed and whole replies agree.

Thinking: absent or {"type": "disabled"}: no think block (budget 0; Anthropic's default).
{"type": "enabled", "budget_tokens": B}: a block of at most B tokens (kipp.text.reasoning; any
B >= 1, not Anthropic's 1,024 floor). {"type": "adaptive"}: a block bounded by
output_config.effort (EFFORT_NAMES; none given: unbounded). A grammar (a forced tool choice,
an output format) leaves no room to think: adaptive then skips the block, enabled is a 400.
The signature of a thinking block is a digest of its text; signatures sent back are not
checked.

usage is Anthropic's accounting: input_tokens + cache_read_input_tokens is the prompt (what
count_tokens answers), cache_read_input_tokens the part whose KV was reused. message_start is
sent before the engine knows the reuse, so it counts the whole prompt as input_tokens and
message_delta carries the final split (the SDK takes message_delta's totals).

stop_reason: max_tokens at the token limit; stop_sequence (with stop_sequence set) when the
engine reports the stop string that ended the reply (Finished.stop); tool_use when the reply
holds a tool_use block; end_turn otherwise (a stop token, a complete grammar).

Every field of a body, and what Kipp does with it:

    field                   Kipp
    implemented
    model                   one of the served names; another is a 404 that lists them
    messages                user, assistant and system turns of blocks: text, tool_use,
                            tool_result, thinking, redacted_thinking (opaque: dropped); a
                            final assistant turn (prefill) is a 400
    system                  a string or text blocks
    max_tokens              required, >= 1; a ceiling, cut to the room the context and the
                            pool leave (Claude Code asks 32,000 whatever the prompt)
    stop_sequences          at most MAX_STOP_SEQUENCES strings
    temperature, top_p,     sampling; temperature 0..1, Anthropic's range
      top_k
    stream                  Anthropic's server-sent events
    tools                   custom tools (name, description, input_schema) shown to the
                            model; Anthropic-defined tools (a type such as
                            web_search_20250305 or bash_20250124), which Kipp cannot run, are
                            left out and named in the OMITTED_TOOLS_HEADER response header;
                            defer_loading: true tools are shown only where a tool_result's
                            tool_reference names them, as Anthropic loads them
    tool_choice             auto, any, tool {name}, none (the tools are then not shown);
                            disable_parallel_tool_use (under auto: the first tool_use only)
    tools[].strict          under a forced tool_choice (the grammar holds the input to its
                            schema); a 400 under auto or none, where it cannot be guaranteed
    thinking                enabled, disabled, adaptive as above; display "omitted" sends
                            the block with empty text
    output_config           effort (adaptive thinking's budget); format {type: json_schema,
                            schema}, held by a grammar
    accepted and ignored
    metadata                one local user
    context_management      Kipp never edits the context: the client owns it
    cache_control           (top level, blocks, tools) prompt prefixes are reused unasked
    service_tier, speed,    one tier, one speed, one place
      inference_geo
    diagnostics,            no prompt-cache report, no workspaces
      user_profile_id,
      workspace_id
    citations, signature,   on blocks sent back: nothing local reads them
      caller, toolset_name
    eager_input_streaming,  on tools: a tool's input is streamed whole; examples and callers
      input_examples,       belong to Anthropic's server-side tool runner
      allowed_callers
    refused (a 400 naming the field)
    container, mcp_servers  Kipp runs no code container and reaches no MCP server
    image, document,        text models only: the block's type is named
      search_result blocks
    any other field
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from enum import Enum

from kipp.http.fields import (
    MAX_STOP_CHARS,
    bad,
    boolean,
    check_fields,
    check_model,
    integer,
    json_body,
    number,
    sampling,
)
from kipp.http.messages_shape import PATH, MessagesCall, MessageShape
from kipp.http.schema import Call, ChatContext, ChatTurn, chat_request
from kipp.text.reasoning import effort_budget

MAX_STOP_SEQUENCES = 16  # Anthropic documents no limit; the engine's stop check grows with it
JOIN = "\n\n"  # between the text blocks of one turn, and between joined turns
# output_config.effort -> kipp.text.reasoning's effort names ("max" has no bound either)
EFFORT_NAMES = {"low": "low", "medium": "medium", "high": "high", "xhigh": "xhigh",
                "max": "xhigh"}

FIELDS = {"model", "messages", "max_tokens", "system", "stop_sequences", "temperature", "top_p",
          "top_k", "stream", "tools", "tool_choice", "thinking", "output_config", "metadata",
          "context_management", "service_tier", "speed", "inference_geo", "diagnostics",
          "user_profile_id", "workspace_id", "cache_control", "container", "mcp_servers"}
# Accepted and ignored: the JSON type each must have, or the values it may take.
IGNORED = {"metadata": dict, "context_management": dict, "diagnostics": dict,
           "cache_control": dict, "inference_geo": str, "user_profile_id": str,
           "workspace_id": str, "service_tier": ("auto", "standard_only"),
           "speed": ("standard", "fast")}
REFUSED = {"container": "Kipp runs no code execution container",
           "mcp_servers": "Kipp connects to no MCP server; run the MCP tools in the client"}

_CACHE = {"cache_control"}
BLOCK_KEYS = {
    "text": {"type", "text", "citations"} | _CACHE,
    "tool_use": {"type", "id", "name", "input", "caller", "toolset_name"} | _CACHE,
    "tool_result": {"type", "tool_use_id", "content", "is_error", "toolset_name"} | _CACHE,
    "thinking": {"type", "thinking", "signature"},
    "redacted_thinking": {"type", "data"},
    "tool_reference": {"type", "tool_name"} | _CACHE,
}
ROLE_BLOCKS = {"user": ("text", "tool_result"), "system": ("text",),
               "assistant": ("text", "tool_use", "thinking", "redacted_thinking")}
TEXT_ONLY = ("image", "document", "search_result")  # blocks a text model cannot read
TOOL_KEYS = {"type", "name", "description", "input_schema", "strict", "defer_loading",
             "eager_input_streaming", "input_examples", "allowed_callers"} | _CACHE
TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
# Anthropic-defined tools: a dated type (web_search_20250305, bash_20250124, ...) or these.
SERVER_TOOL = re.compile(r"[a-z][a-z0-9_]*_\d{8}")
SERVER_TOOL_TYPES = ("tool_search_tool_bm25", "tool_search_tool_regex", "mcp_toolset")
CHOICE_KEYS = {"auto": {"type", "disable_parallel_tool_use"},
               "any": {"type", "disable_parallel_tool_use"},
               "tool": {"type", "name", "disable_parallel_tool_use"}, "none": {"type"}}
THINKING_KEYS = {"enabled": {"type", "budget_tokens", "display"},
                 "adaptive": {"type", "display"}, "disabled": {"type"}}


@dataclass
class _Tools:
    """A body's tools: those shown to the model, those deferred, those left out."""

    shown: list = field(default_factory=list)  # OpenAI function tools
    deferred: dict = field(default_factory=dict)  # name -> OpenAI function tool
    omitted: list = field(default_factory=list)  # "name (type)"
    strict: str | None = None  # the path of the first strict tool

    def find(self, name: str):
        return next((t for t in self.shown if t["function"]["name"] == name),
                    self.deferred.get(name))


class Thinking(Enum):
    DISABLED = "disabled"
    ENABLED = "enabled"
    ADAPTIVE = "adaptive"


def parse_messages(body, ctx: ChatContext, *, counting: bool = False) -> MessagesCall:
    """A Messages body as a MessagesCall, or an APIError naming the field. `counting`
    (count_tokens): max_tokens may be left out; the prompt is built all the same."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    check_fields(body, FIELDS, PATH)
    check_model(body, ctx.served)
    _check_ignored(body)
    max_tokens = _max_tokens(body, required=not counting)
    tools = _tools(body)
    choice, parallel = _tool_choice(body, tools)
    grammar = _grammar(tools, choice, parallel, _output_format(body))
    if tools.strict and grammar is None:
        raise bad("strict tool input is only guaranteed under a tool_choice of any or tool; "
                  "Kipp does not constrain a reply that may also be text", tools.strict)
    enable, budget, hide = _thinking(body, max_tokens, constrained=grammar is not None)
    messages = _system(body) + _conversation(body.get("messages"), tools)
    offered = choice != "none" and bool(tools.shown or tools.deferred)
    turn = ChatTurn(messages, tools=(tools.shown or None) if choice != "none" else None,
                    parse_tools=offered, grammar=grammar, enable_thinking=enable,
                    reasoning_format="auto", reasoning_budget=budget, max_tokens=max_tokens,
                    clamp=True, sampling=_sampling(body), stop=_stop_sequences(body),
                    reasoning_param="thinking")
    call = Call("messages", chat_request(turn, ctx), boolean(body, "stream", False), False,
                False, tools=offered, prompt_param="messages")
    return MessagesCall(call, tuple(tools.omitted), not parallel, hide)


def _check_ignored(body: dict) -> None:
    for name, kind in IGNORED.items():
        value = body.get(name)
        if value is None:
            continue
        if isinstance(kind, tuple):
            if value not in kind:
                raise bad(f"'{name}' must be one of {', '.join(kind)}, got {value!r}", name)
        elif not isinstance(value, kind):
            raise bad(f"'{name}' must be {_a(kind)}, got {type(value).__name__}", name)
    for name, why in REFUSED.items():
        if body.get(name):
            raise bad(f"'{name}' is not supported: {why}", name, "unsupported_value")


def _a(kind: type) -> str:
    return {dict: "an object", str: "a string"}[kind]


def _max_tokens(body: dict, required: bool) -> int | None:
    if body.get("max_tokens") is None and required:
        raise bad("'max_tokens' is required", "max_tokens")
    return integer(body, "max_tokens", 1, None, None)


def _sampling(body: dict):
    number(body, "temperature", 0.0, 1.0, None)  # Anthropic's range, narrower than OpenAI's
    return sampling({k: body[k] for k in ("temperature", "top_p", "top_k") if k in body})


def _stop_sequences(body: dict) -> tuple[str, ...]:
    stops = body.get("stop_sequences")
    if stops is None:
        return ()
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad("'stop_sequences' must be a list of non-empty strings", "stop_sequences")
    if len(stops) > MAX_STOP_SEQUENCES:
        raise bad(f"'stop_sequences' allows at most {MAX_STOP_SEQUENCES} strings, got "
                  f"{len(stops)}", "stop_sequences")
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise bad(f"a stop sequence is longer than {MAX_STOP_CHARS} characters",
                  "stop_sequences")
    return tuple(stops)


def _system(body: dict) -> list[dict]:
    """The top-level system prompt as the first system turn (none when absent or empty)."""
    system = body.get("system")
    if system is None:
        return []
    text = _text_blocks(system, "system")
    return [{"role": "system", "content": text}] if text else []


def _text_blocks(content, where: str) -> str:
    """A string, or a list of text blocks joined; another block is a 400 naming it."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"'{where}' must be a string or a list of text blocks", where)
    return JOIN.join(_text(block, f"{where}[{j}]", ("text",))
                     for j, block in enumerate(content))


def _block_type(block, where: str, allowed) -> str:
    """The block's type, checked against those allowed here, with its keys."""
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise bad(f"'{where}' must be a content block: an object with a string 'type'", where)
    kind = block["type"]
    if kind in TEXT_ONLY:
        raise bad(f"'{where}.type' is {kind!r}: Kipp serves text models, which read text only",
                  f"{where}.type", "unsupported_content")
    if kind not in allowed:
        raise bad(f"'{where}.type' is {kind!r}; here Kipp accepts {', '.join(allowed)}",
                  f"{where}.type", "unsupported_content")
    unknown = sorted(set(block) - BLOCK_KEYS[kind])
    if unknown:
        raise bad(f"unsupported field '{where}.{unknown[0]}' in a {kind} block",
                  f"{where}.{unknown[0]}")
    return kind


def _kind(obj: dict) -> str | None:
    """The object's "type" when it is a string (a list would not even hash)."""
    kind = obj.get("type")
    return kind if isinstance(kind, str) else None


def _flag(obj: dict, key: str, where: str) -> bool:
    value = obj.get(key)
    if value is not None and not isinstance(value, bool):
        raise bad(f"'{where}.{key}' must be a boolean, got {type(value).__name__}",
                  f"{where}.{key}")
    return bool(value)


def _string(block: dict, key: str, where: str, *, empty: bool = True) -> str:
    value = block.get(key)
    if not isinstance(value, str) or (not empty and not value):
        kind = "string" if empty else "non-empty string"
        raise bad(f"'{where}.{key}' must be a {kind}", f"{where}.{key}")
    return value


def _text(block, where: str, allowed) -> str:
    _block_type(block, where, allowed)
    return _string(block, "text", where)


def _conversation(messages, tools: _Tools) -> list[dict]:
    """Anthropic's messages as OpenAI-shaped turns, consecutive turns of a role joined."""
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list of messages", "messages")
    turns, tool_uses = [], set()
    for i, message in enumerate(messages):
        turns.extend(_turns(message, f"messages[{i}]", tool_uses, tools))
    joined = []
    for turn in turns:
        if joined and turn["role"] == joined[-1]["role"] != "tool":
            joined[-1] = _join(joined[-1], turn)
        else:
            joined.append(turn)
    if joined[-1]["role"] == "assistant":
        last = f"messages[{len(messages) - 1}]"
        raise bad(f"'{last}' is an assistant message: Kipp does not continue a final "
                  f"assistant turn (prefill); end with a user message", last,
                  "prefill_not_supported")
    return joined


def _join(a: dict, b: dict) -> dict:
    out = {**a, "content": JOIN.join(c for c in (a["content"], b["content"]) if c)}
    if "reasoning_content" in b:
        out["reasoning_content"] = JOIN.join(
            r for r in (a.get("reasoning_content"), b["reasoning_content"]) if r)
    if "tool_calls" in b:
        out["tool_calls"] = a.get("tool_calls", []) + b["tool_calls"]
    return out


def _turns(message, where: str, tool_uses: set, tools: _Tools) -> list[dict]:
    if not isinstance(message, dict):
        raise bad(f"'{where}' must be an object with 'role' and 'content'", where)
    unknown = sorted(set(message) - {"role", "content"})
    if unknown:
        raise bad(f"unsupported field '{where}.{unknown[0]}'", f"{where}.{unknown[0]}")
    role = message.get("role")
    if not isinstance(role, str) or role not in ROLE_BLOCKS:
        raise bad(f"'{where}.role' must be user, assistant or system, got {role!r}",
                  f"{where}.role")
    content = message.get("content")
    if isinstance(content, str):
        content = [{"type": "text", "text": content}]
    elif not isinstance(content, list):
        raise bad(f"'{where}.content' must be a string or a list of content blocks",
                  f"{where}.content")
    where = f"{where}.content"
    if role == "system":
        return [{"role": "system", "content": _text_blocks(content, where)}]
    if role == "assistant":
        return [_assistant(content, where, tool_uses)]
    return _user(content, where, tool_uses, tools)


def _assistant(blocks: list, where: str, tool_uses: set) -> dict:
    texts, thoughts, calls = [], [], []
    for j, block in enumerate(blocks):
        path = f"{where}[{j}]"
        kind = _block_type(block, path, ROLE_BLOCKS["assistant"])
        if kind == "text":
            texts.append(_string(block, "text", path))
        elif kind == "thinking":
            thoughts.append(_string(block, "thinking", path))
        elif kind == "tool_use":
            calls.append(_tool_use(block, path, tool_uses))
    turn = {"role": "assistant", "content": JOIN.join(texts)}
    if thoughts:
        turn["reasoning_content"] = JOIN.join(t for t in thoughts if t)
    if calls:
        turn["tool_calls"] = calls
    return turn


def _tool_use(block: dict, where: str, tool_uses: set) -> dict:
    call_id = _string(block, "id", where, empty=False)
    name = _string(block, "name", where, empty=False)
    if not isinstance(block.get("input"), dict):
        raise bad(f"'{where}.input' must be an object", f"{where}.input")
    tool_uses.add(call_id)
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": block["input"]}}


def _user(blocks: list, where: str, tool_uses: set, tools: _Tools) -> list[dict]:
    """Text runs as user turns and each tool_result as a tool turn, in order."""
    turns, texts = [], []
    for j, block in enumerate(blocks):
        path = f"{where}[{j}]"
        if _block_type(block, path, ROLE_BLOCKS["user"]) == "text":
            texts.append(_string(block, "text", path))
            continue
        if texts:
            turns.append({"role": "user", "content": JOIN.join(texts)})
            texts = []
        turns.append(_tool_result(block, path, tool_uses, tools))
    if texts or not turns:
        turns.append({"role": "user", "content": JOIN.join(texts)})
    return turns


def _tool_result(block: dict, where: str, tool_uses: set, tools: _Tools) -> dict:
    call_id = _string(block, "tool_use_id", where, empty=False)
    if call_id not in tool_uses:
        raise bad(f"'{where}.tool_use_id' {call_id!r} answers no tool_use block earlier in "
                  f"the conversation", f"{where}.tool_use_id")
    content = block.get("content")
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    elif isinstance(content, list):
        text = JOIN.join(_result_part(part, f"{where}.content[{k}]", tools)
                         for k, part in enumerate(content))
    else:
        raise bad(f"'{where}.content' must be a string or a list of blocks",
                  f"{where}.content")
    if _flag(block, "is_error", where):
        text = "Error: " + text  # Qwen3's tool responses have no error flag: say it in words
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def _result_part(part, where: str, tools: _Tools) -> str:
    """A tool_result's text block, or a tool_reference as the named tool's definition (the
    way Anthropic loads a deferred tool where a tool search found it)."""
    if _block_type(part, where, ("text", "tool_reference")) == "text":
        return _string(part, "text", where)
    name = _string(part, "tool_name", where)
    tool = tools.find(name)
    if tool is None:
        raise bad(f"'{where}.tool_name' names {name!r}, which is not in tools",
                  f"{where}.tool_name")
    return json.dumps(tool, ensure_ascii=False)


def _tools(body: dict) -> _Tools:
    tools = body.get("tools")
    out = _Tools()
    if tools is None:
        return out
    if not isinstance(tools, list):
        raise bad("'tools' must be a list of tools", "tools")
    for k, tool in enumerate(tools):
        where = f"tools[{k}]"
        if not isinstance(tool, dict):
            raise bad(f"'{where}' must be an object", where)
        kind = tool.get("type")
        if kind not in (None, "custom"):
            out.omitted.append(_server_tool(tool, where))
            continue
        name, function = _function(tool, where)
        if out.find(name) is not None:
            raise bad(f"'{where}.name': two tools are named {name!r}", f"{where}.name")
        entry = {"type": "function", "function": function}
        if _flag(tool, "defer_loading", where):
            out.deferred[name] = entry
        else:
            out.shown.append(entry)
        if _flag(tool, "strict", where) and out.strict is None:
            out.strict = f"{where}.strict"
    return out


def _server_tool(tool: dict, where: str) -> str:
    """An Anthropic-defined tool, which Kipp leaves out: its "name (type)"."""
    kind = tool["type"]
    if not isinstance(kind, str) or not (SERVER_TOOL.fullmatch(kind)
                                         or kind in SERVER_TOOL_TYPES):
        hint = " (OpenAI's shape; Anthropic's tools have name and input_schema)" \
            if kind == "function" else ""
        raise bad(f"'{where}.type' {kind!r} is neither a custom tool nor an Anthropic "
                  f"tool type{hint}", f"{where}.type")
    name = tool.get("name")  # it goes into a header: only a well-formed name
    return f"{name} ({kind})" if isinstance(name, str) and TOOL_NAME.fullmatch(name) else kind


def _function(tool: dict, where: str) -> tuple[str, dict]:
    """A custom tool as OpenAI's function (name, description, parameters)."""
    from kipp.text.grammar import GrammarError, schema_dict

    unknown = sorted(set(tool) - TOOL_KEYS)
    if unknown:
        raise bad(f"unsupported field '{where}.{unknown[0]}'", f"{where}.{unknown[0]}")
    name = tool.get("name")
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise bad(f"'{where}.name' must be 1-64 of a-z, A-Z, 0-9, _ and -; got {name!r}",
                  f"{where}.name")
    function = {"name": name}
    if tool.get("description") is not None:
        function["description"] = _string(tool, "description", where)
    schema = tool.get("input_schema")
    if not isinstance(schema, dict) or schema.get("type") != "object":
        raise bad(f"'{where}.input_schema' must be a JSON Schema of type object",
                  f"{where}.input_schema")
    try:
        function["parameters"] = schema_dict(schema, f"{where}.input_schema")
    except GrammarError as e:
        raise bad(str(e), f"{where}.input_schema") from None
    return name, function


def _tool_choice(body: dict, tools: _Tools) -> tuple[object, bool]:
    """(OpenAI's tool_choice, parallel) of Anthropic's tool_choice."""
    choice = body.get("tool_choice")
    if choice is None:
        return "auto", True
    if not isinstance(choice, dict) or _kind(choice) not in CHOICE_KEYS:
        raise bad("'tool_choice' must be an object whose type is auto, any, tool or none",
                  "tool_choice")
    kind = choice["type"]
    unknown = sorted(set(choice) - CHOICE_KEYS[kind])
    if unknown:
        raise bad(f"unsupported field 'tool_choice.{unknown[0]}' for type {kind!r}",
                  f"tool_choice.{unknown[0]}")
    parallel = not _flag(choice, "disable_parallel_tool_use", "tool_choice")
    if kind in ("auto", "none"):
        return kind, parallel
    if not tools.shown:
        left_out = " (the Anthropic-defined ones are left out)" if tools.omitted else ""
        raise bad(f"tool_choice {kind!r} needs tools{left_out}", "tool_choice")
    if kind == "any":
        return "required", parallel
    name = choice.get("name")
    if not isinstance(name, str) or not any(t["function"]["name"] == name
                                            for t in tools.shown):
        raise bad(f"'tool_choice.name' {name!r} is not one of the tools shown to the model",
                  "tool_choice.name")
    return {"type": "function", "function": {"name": name}}, False


def _output_format(body: dict):
    """output_config (checked); its format's schema, or None."""
    config = body.get("output_config")
    if config is None:
        return None
    if not isinstance(config, dict):
        raise bad("'output_config' must be an object", "output_config")
    unknown = sorted(set(config) - {"effort", "format"})
    if unknown:
        raise bad(f"unsupported field 'output_config.{unknown[0]}'",
                  f"output_config.{unknown[0]}")
    effort = config.get("effort")
    if effort is not None and (not isinstance(effort, str) or effort not in EFFORT_NAMES):
        raise bad(f"'output_config.effort' must be one of {', '.join(EFFORT_NAMES)}, got "
                  f"{effort!r}", "output_config.effort")
    fmt = config.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or set(fmt) != {
            "type", "schema"}:
        raise bad("'output_config.format' must be {\"type\": \"json_schema\", \"schema\": "
                  "...}", "output_config.format")
    return fmt["schema"]


def _grammar(tools: _Tools, choice, parallel: bool, schema):
    """The one grammar the reply is held to: a forced tool call or the output format."""
    from kipp.text import grammar as g

    try:
        forced = None
        if choice not in ("auto", "none"):
            forced = g.tool_choice_grammar(g.function_tools(tools.shown), choice, parallel)
        formatted = None
        if schema is not None:
            formatted = g.json_schema_grammar(schema, "output_config.format.schema")
    except g.GrammarError as e:
        raise bad(str(e), e.param) from None
    if forced is not None and formatted is not None:
        raise bad("a tool_choice of any or tool forces a tool call, so output_config.format "
                  "cannot also hold the reply; give one of them", "output_config.format")
    return forced or formatted


def _thinking(body: dict, max_tokens: int | None, constrained: bool):
    """(enable_thinking, reasoning budget, hide the text) of `thinking` and the effort."""
    thinking = body.get("thinking")
    if thinking is None:
        return False, 0, False
    if not isinstance(thinking, dict) or _kind(thinking) not in THINKING_KEYS:
        raise bad("'thinking' must be an object whose type is enabled, disabled or adaptive",
                  "thinking.type")
    mode = Thinking(thinking["type"])
    unknown = sorted(set(thinking) - THINKING_KEYS[mode.value])
    if unknown:
        raise bad(f"unsupported field 'thinking.{unknown[0]}' for type {mode.value!r}",
                  f"thinking.{unknown[0]}")
    display = thinking.get("display")
    if display not in (None, "summarized", "omitted"):
        raise bad("'thinking.display' must be summarized or omitted", "thinking.display")
    hide = display == "omitted"
    if mode is Thinking.DISABLED:
        return False, 0, False
    if mode is Thinking.ADAPTIVE:
        if constrained:
            return False, 0, hide  # the grammar governs the whole reply: no room to think
        effort = (body.get("output_config") or {}).get("effort")
        return True, None if effort is None else effort_budget(EFFORT_NAMES[effort]), hide
    if thinking.get("budget_tokens") is None:
        raise bad("'thinking.budget_tokens' is required with type enabled",
                  "thinking.budget_tokens")
    name = "thinking.budget_tokens"  # named in full in its errors
    budget = integer({name: thinking["budget_tokens"]}, name, 1, None, None)
    if max_tokens is not None and budget >= max_tokens:
        raise bad(f"'thinking.budget_tokens' ({budget}) must be less than max_tokens "
                  f"({max_tokens})", "thinking.budget_tokens")
    if constrained:
        raise bad("thinking cannot be enabled when tool_choice forces a tool or "
                  "output_config.format holds the reply: the grammar leaves no room to think",
                  "thinking")
    return True, budget, hide


def register(app, server) -> None:
    """Add the Messages API's routes to `app` (kipp.http.app.Server `server`)."""

    def parsed(counting: bool = False) -> MessagesCall:
        return parse_messages(json_body(), server.chat_context(), counting=counting)

    @app.post(PATH)
    def create_message():
        call = parsed()
        return server.answer(call.call, MessageShape(call, server.name, server.token_text),
                             "messages")

    @app.post(PATH + "/count_tokens")
    def count_tokens():
        return {"input_tokens": len(parsed(counting=True).call.request.prompt)}
