"""Qwen3 ChatML: the upstream chat templates of tokenizer_config.json, written out in Python.

render() gives the same text as transformers' apply_chat_template(..., tokenize=False) with the
Qwen3 template (tests/test_chat.py compares them), including tool definitions, tool calls, tool
results and the reasoning rules: an assistant turn after the last real user query keeps its
<think> block; earlier ones lose it. `template="qwen3-thinking-2507"` renders the
Qwen3-4B-Thinking-2507 template instead (the same turns; its generation prompt always opens a
think block). `template_name` maps a checkpoint's template text to one of these, or refuses it.

The model's side of a tool call is parsed back here too: `parse_tool_calls` splits Qwen3's
`<tool_call>{"name": ..., "arguments": ...}</tool_call>` blocks out of generated text, and
`ToolCallStream` does the same on streamed text.

Usage:
    require_chat_template(checkpoint)  # base checkpoints have no template
    prompt = render([{"role": "user", "content": "Hi"}], enable_thinking=False)
    content, calls = parse_tool_calls(generated_text)
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kipp.errors import KippError
from kipp.text.tokenizer_files import thinking_2507_template, tokenizer_config

ROLES = ("system", "user", "assistant", "tool")
EMPTY_THINK = "<think>\n\n</think>\n\n"
OPEN_THINK = "<think>\n"
TEMPLATES = ("qwen3", "qwen3-thinking-2507")  # what render(template=...) can render
# Registry entries whose upstream template is not the hybrid Qwen3 one. Instruct-2507's exact
# text could not be verified offline (data/chat-templates/PROVENANCE.md): no renderer for it.
ENTRY_TEMPLATES = {"Qwen/Qwen3-4B-Thinking-2507": "qwen3-thinking-2507",
                   "kipp-synthetic/qwen3-tiny-thinking": "qwen3-thinking-2507",
                   "Qwen/Qwen3-4B-Instruct-2507": "qwen3-instruct-2507"}
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
# transformers (>= 5) reads a message's reasoning under these names, first non-None wins.
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")

_TOOLS_INTRO = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_TOOLS_OUTRO = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
)


class ChatError(KippError):
    """A conversation the Qwen3 chat template cannot render, or a checkpoint without one."""


@dataclass(frozen=True)
class _ToolCall:
    name: str
    arguments: str  # already JSON text


@dataclass(frozen=True)
class _Message:
    role: str
    content: str
    reasoning: str | None = None  # None: not given, so it is parsed out of <think> in content
    tool_calls: tuple[_ToolCall, ...] = ()


def render(messages, add_generation_prompt: bool = True, enable_thinking: bool = True,
           tools: Sequence[Mapping] | None = None, template: str = "qwen3") -> str:
    """The ChatML prompt for messages, as the Qwen3 chat template renders it.

    messages: dicts with "role" (system, user, assistant, tool) and "content" (str); assistant
    messages may carry "reasoning_content" and "tool_calls" ([{"function": {"name", "arguments"}}]).
    enable_thinking=False appends the empty think block after the generation prompt, which is
    how Qwen3 is told to answer without reasoning. tools: JSON-schema dicts, shown in the system
    turn. template: one of TEMPLATES ("qwen3-thinking-2507" ignores enable_thinking, as its
    upstream template does).
    """
    if not isinstance(enable_thinking, bool) or not isinstance(add_generation_prompt, bool):
        raise ChatError("add_generation_prompt and enable_thinking must be booleans")
    if template not in TEMPLATES:
        raise ChatError(f"unknown chat template {template!r}; kipp.text.chat renders "
                        f"{', '.join(TEMPLATES)}")
    parsed = _parse_messages(messages)
    parts = [_system_header(parsed, _parse_tools(tools))]
    last_query = _last_query_index(parsed)
    for i, message in enumerate(parsed):
        parts.append(_render_message(parsed, i, last_query))
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
        if template == "qwen3-thinking-2507":
            parts.append(OPEN_THINK)
        elif not enable_thinking:
            parts.append(EMPTY_THINK)
    return "".join(parts)


def close_reasoning(prompt: str, template: str = "qwen3") -> str:
    """The prompt with an empty, closed think block after the generation prompt: the answer
    starts at once. Constrained requests use it, since their grammar governs the answer, not
    free reasoning (hybrid: what enable_thinking=False renders; Thinking-2507: its opened
    block closed empty)."""
    if prompt.endswith(EMPTY_THINK):
        return prompt
    if prompt.endswith("<|im_start|>assistant\n" + OPEN_THINK):
        return prompt + "\n</think>\n\n"
    if template == "qwen3" and prompt.endswith("<|im_start|>assistant\n"):
        return prompt + EMPTY_THINK
    return prompt


def reply_prompt(messages, *, tools=None, template: str = "qwen3", enable_thinking: bool = True,
                 constrained: bool = False, reasoning_budget: int | None = None) -> str:
    """The prompt of an assistant reply to `messages`: rendered, and with the think block
    closed empty when the reply may not think (a grammar governs it, or a budget of 0)."""
    text = render(messages, add_generation_prompt=True, enable_thinking=enable_thinking,
                  tools=tools, template=template)
    if constrained or reasoning_budget == 0:
        text = close_reasoning(text, template)
    return text


def template_name(chat_template: str | None) -> str:
    """Which of TEMPLATES a checkpoint's template text is; ChatError if none (a template
    kipp.text.chat does not render must not be approximated)."""
    if chat_template is None:
        raise ChatError("this checkpoint has no chat template (a base checkpoint): it takes "
                        "plain text prompts, not chat messages")
    if chat_template == qwen3_chat_template():
        return "qwen3"
    if chat_template == thinking_2507_template():
        return "qwen3-thinking-2507"
    raise ChatError("this checkpoint's chat template is not one kipp.text.chat renders (the hybrid "
                    "Qwen3 template or Qwen3-4B-Thinking-2507's); see "
                    "kipp/data/chat-templates/PROVENANCE.md")


def require_chat_template(source) -> None:
    """Raise ChatError unless render() applies to source (a registry Checkpoint or TokenizerData).

    Base checkpoints have no chat template; a TokenizerData must carry exactly the upstream
    Qwen3 template, since render() implements that template and no other.
    """
    if hasattr(source, "has_chat_template"):
        if not source.has_chat_template:
            raise ChatError(f"{source.id} is a base checkpoint: it has no chat template, so it "
                            "takes plain text prompts, not chat messages")
        return
    template = getattr(source, "chat_template", None)
    if template is None:
        raise ChatError("this tokenizer has no chat template (a base checkpoint): it takes plain "
                        "text prompts, not chat messages")
    template_name(template)


def qwen3_chat_template() -> str:
    """The upstream Qwen3 template string (from the tokenizer_config.json Kipp ships)."""
    return tokenizer_config("instruct")["chat_template"]


def _parse_messages(messages) -> list[_Message]:
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise ChatError("messages must be a list of {'role': ..., 'content': ...} dicts")
    if not messages:
        raise ChatError("messages is empty")
    return [_parse_message(m, i) for i, m in enumerate(messages)]


def _parse_message(message, index: int) -> _Message:
    where = f"messages[{index}]"
    if not isinstance(message, Mapping):
        raise ChatError(f"{where} must be a dict, not {type(message).__name__}")
    role = message.get("role")
    if role not in ROLES:
        raise ChatError(f"{where}: role {role!r} is not one of {', '.join(ROLES)}")
    calls = message.get("tool_calls")
    if calls is not None and role != "assistant":
        raise ChatError(f"{where}: only assistant messages carry tool_calls")
    content = message.get("content")
    if content is None and role == "assistant" and calls:
        content = ""  # OpenAI clients send null content beside tool calls
    if not isinstance(content, str):
        raise ChatError(f"{where}: content must be a string, not {type(content).__name__}")
    reasoning = next((message[k] for k in _REASONING_KEYS if message.get(k) is not None), None)
    if reasoning is not None and (role != "assistant" or not isinstance(reasoning, str)):
        raise ChatError(f"{where}: reasoning_content must be a string on an assistant message")
    return _Message(role, content, reasoning, _parse_tool_calls(calls or [], where))


def _parse_tool_calls(calls, where: str) -> tuple[_ToolCall, ...]:
    if not isinstance(calls, Sequence) or isinstance(calls, (str, bytes)):
        raise ChatError(f"{where}: tool_calls must be a list")
    parsed = []
    for k, call in enumerate(calls):
        # The template accepts {"function": {...}} (OpenAI) or the function dict itself.
        function = call.get("function") if isinstance(call, Mapping) else None
        function = function or call
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise ChatError(f"{where}.tool_calls[{k}] needs a function with a string name")
        arguments = function.get("arguments")
        if not isinstance(arguments, (str, Mapping)):
            raise ChatError(f"{where}.tool_calls[{k}]: arguments must be a JSON string or dict")
        if not isinstance(arguments, str):
            arguments = _to_json(arguments, f"{where}.tool_calls[{k}].arguments")
        parsed.append(_ToolCall(function["name"], arguments))
    return tuple(parsed)


def _parse_tools(tools) -> list[str]:
    """Each tool as the template prints it (transformers' tojson: json.dumps, non-ASCII kept)."""
    if tools is None:
        return []
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        raise ChatError("tools must be a list of JSON-schema dicts")
    for k, tool in enumerate(tools):
        if not isinstance(tool, Mapping):
            raise ChatError(f"tools[{k}] must be a JSON-schema dict, not {type(tool).__name__}")
    return [_to_json(tool, f"tools[{k}]") for k, tool in enumerate(tools)]


def _to_json(value, where: str) -> str:
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError) as error:
        raise ChatError(f"{where} is not JSON-serialisable: {error}") from None


def _system_header(messages: list[_Message], tools: list[str]) -> str:
    """The first system message, merged with the tool definitions when there are tools."""
    system = messages[0].content if messages[0].role == "system" else None
    if not tools:
        return "" if system is None else f"<|im_start|>system\n{system}<|im_end|>\n"
    prefix = "" if system is None else system + "\n\n"
    listed = "".join("\n" + tool for tool in tools)
    return "<|im_start|>system\n" + prefix + _TOOLS_INTRO + listed + _TOOLS_OUTRO


def _last_query_index(messages: list[_Message]) -> int:
    """The last user message that is not a wrapped tool response (else the last message)."""
    for i in range(len(messages) - 1, -1, -1):
        content = messages[i].content
        wrapped = content.startswith("<tool_response>") and content.endswith("</tool_response>")
        if messages[i].role == "user" and not wrapped:
            return i
    return len(messages) - 1


def _render_message(messages: list[_Message], i: int, last_query: int) -> str:
    message = messages[i]
    if message.role == "user" or (message.role == "system" and i > 0):
        return f"<|im_start|>{message.role}\n{message.content}<|im_end|>\n"
    if message.role == "assistant":
        return _render_assistant(message, after_query=i > last_query, last=i == len(messages) - 1)
    if message.role == "tool":
        return _render_tool(messages, i)
    return ""  # the first system message went into the header


def _render_assistant(message: _Message, after_query: bool, last: bool) -> str:
    content, reasoning = _split_reasoning(message)
    if after_query and (last or reasoning):
        reasoning = reasoning.strip("\n")
        text = f"<|im_start|>assistant\n<think>\n{reasoning}\n</think>\n\n" + content.lstrip("\n")
    else:
        text = "<|im_start|>assistant\n" + content
    for k, call in enumerate(message.tool_calls):
        if k > 0 or content:  # uses the content before lstrip, as the template does
            text += "\n"
        body = f'{{"name": "{call.name}", "arguments": {call.arguments}}}'
        text += f"<tool_call>\n{body}\n</tool_call>"
    return text + "<|im_end|>\n"


def _split_reasoning(message: _Message) -> tuple[str, str]:
    """(content, reasoning): given reasoning wins; else the text before the first </think>
    (after its last <think>) is reasoning and the text after the last </think> is content."""
    if message.reasoning is not None:
        return message.content, message.reasoning
    content = message.content
    if "</think>" not in content:
        return content, ""
    pieces = content.split("</think>")
    reasoning = pieces[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
    return pieces[-1].lstrip("\n"), reasoning


def _render_tool(messages: list[_Message], i: int) -> str:
    """Consecutive tool results share one user turn, each wrapped in <tool_response>."""
    first = i == 0 or messages[i - 1].role != "tool"
    last = i == len(messages) - 1 or messages[i + 1].role != "tool"
    text = f"\n<tool_response>\n{messages[i].content}\n</tool_response>"
    return ("<|im_start|>user" if first else "") + text + ("<|im_end|>\n" if last else "")


def entry_template(checkpoint_id: str) -> str:
    """The template a registry entry ships upstream (a name; not all of them have a renderer)."""
    return ENTRY_TEMPLATES.get(checkpoint_id, "qwen3")


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: OpenAI's shape (`arguments` is JSON text)."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    @property
    def parsed_arguments(self):
        return json.loads(self.arguments)

    def openai(self, index: int | None = None) -> dict:
        """The OpenAI tool_calls entry (with its `index` for a stream chunk)."""
        call = {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def _tool_call(body: str) -> ToolCall | None:
    """A <tool_call> block's body as a ToolCall, or None when it is not a valid call."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):
        try:
            json.loads(arguments)
        except ValueError:
            return None
        return ToolCall(value["name"], arguments)
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


class ToolCallStream:
    """Splits streamed model text into content and tool calls.

    feed(text) and flush() return pieces: ("content", str) or ("tool_call", ToolCall). Text that
    could be the start of a <tool_call> block is held back until it is decided; a block whose
    body is not a valid call stays content; blank text next to a call is dropped.
    """

    def __init__(self):
        self.pending = ""
        self.calls = 0

    def feed(self, text: str) -> list[tuple[str, object]]:
        self.pending += text
        out: list[tuple[str, object]] = []
        while True:
            start = self.pending.find(TOOL_CALL_OPEN)
            if start < 0:
                break
            end = self.pending.find(TOOL_CALL_CLOSE, start)
            if end < 0:
                self._content(self.pending[:start], out, next_is_call=True)
                self.pending = self.pending[start:]
                return out
            block_end = end + len(TOOL_CALL_CLOSE)
            call = _tool_call(self.pending[start + len(TOOL_CALL_OPEN):end])
            self._content(self.pending[:start], out, next_is_call=call is not None)
            if call is None:
                out.append(("content", self.pending[start:block_end]))
            else:
                out.append(("tool_call", call))
                self.calls += 1
            self.pending = self.pending[block_end:]
        hold = max((k for k in range(1, len(TOOL_CALL_OPEN))
                    if self.pending.endswith(TOOL_CALL_OPEN[:k])), default=0)
        if self.calls and not self.pending[:len(self.pending) - hold].strip():
            return out  # blank text after a call: wait to see whether another call follows
        self._content(self.pending[:len(self.pending) - hold], out)
        self.pending = self.pending[len(self.pending) - hold:]
        return out

    def flush(self) -> list[tuple[str, object]]:
        """The end of the text: whatever is held is content (blank text after a call is not)."""
        out: list[tuple[str, object]] = []
        self._content(self.pending, out)
        self.pending = ""
        return out

    def _content(self, text: str, out: list, next_is_call: bool = False) -> None:
        """Emit text as content, unless it is blank and next to a call."""
        if text and (text.strip() or not (next_is_call or self.calls)):
            out.append(("content", text))


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole generated text. content is None when there are calls and
    no other text, as OpenAI answers."""
    stream = ToolCallStream()
    pieces = stream.feed(text) + stream.flush()
    content = "".join(value for kind, value in pieces if kind == "content")
    calls = [value for kind, value in pieces if kind == "tool_call"]
    if calls and not content.strip():
        return None, calls
    return content, calls


def reply_finish_reason(reason: str | None, calls: Sequence) -> str | None:
    """A reply that ended on its own ("stop") with tool calls in it finished to call them."""
    return "tool_calls" if calls and reason == "stop" else reason


def chat_grammar(response_format, tools, tool_choice, parallel_tool_calls: bool = True, *,
                 bare_schema: bool = False):
    """The one grammar a chat reply is held to: a forced tool call (tool_choice "required" or
    a named function) or a response format (kipp.text.grammar; a GrammarError names the field).
    With both, the forced call wins, as in OpenAI's API: the reply is the call, and the format
    would hold a content the reply does not have (it is still checked). `bare_schema` also
    takes a plain JSON Schema as the response format."""
    from kipp.text import grammar as g

    if tools is None and tool_choice not in (None, "none"):
        raise g.GrammarError(f"'tool_choice' {tool_choice!r} needs 'tools'", "tool_choice")
    forced = None
    if tools is not None:
        forced = g.tool_choice_grammar(g.function_tools(tools), tool_choice, parallel_tool_calls)
    formatted = g.response_format_grammar(response_format, bare_schema=bare_schema)
    return forced if forced is not None else formatted
