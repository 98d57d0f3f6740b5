"""The Responses API's tools as the model sees them, and the grammar a tool choice or text
format holds the reply to (kipp.http.responses parses the rest of a body)."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from enum import Enum

from kipp.http.fields import (
    bad,
    boolean,
)
from kipp.text import grammar as g

HOSTED_TOOLS = frozenset({
    "web_search", "web_search_2025_08_26", "web_search_preview",
    "web_search_preview_2025_03_11", "file_search", "code_interpreter", "computer",
    "computer_use_preview", "image_generation", "mcp", "local_shell", "shell", "apply_patch",
    "tool_search", "programmatic_tool_calling"})


_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


_NO_PARAMETERS = {"type": "object", "properties": {}}


_CUSTOM_PARAMETERS = {"type": "object", "properties": {"input": {"type": "string"}},
                      "required": ["input"], "additionalProperties": False}


class ToolKind(str, Enum):
    FUNCTION = "function"
    CUSTOM = "custom"


@dataclass(frozen=True)
class Tool:
    """A tool the model is shown, always as a function (a custom tool: one string `input`)."""

    name: str
    kind: ToolKind
    parameters: dict
    description: str | None = None
    namespace: str | None = None
    grammar: g.Grammar | None = None  # a custom tool's input format; None: any text

    def shown(self) -> dict:
        """The OpenAI chat tool the template prints."""
        function = {"name": self.name}
        if self.description:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class Tools:
    tools: tuple[Tool, ...] = ()
    left_out: tuple[str, ...] = ()  # hosted tool types, not shown to the model

    def named(self, name: str) -> Tool | None:
        return next((t for t in self.tools if t.name == name), None)


@dataclass(frozen=True)
class Constraint:
    """What the tool choice and text format make of the reply."""

    grammar: g.Grammar | None
    shown: tuple[Tool, ...]  # the tools the model sees
    parse_calls: bool  # split <tool_call> blocks out of the reply
    custom: Tool | None = None  # a forced custom tool: the whole reply is its input


def parse_tools(value) -> Tools:
    """`tools` flattened (namespaces into their members), hosted tools set aside."""
    if value is None:
        return Tools()
    if not isinstance(value, list):
        raise bad("'tools' must be a list of tools", "tools")
    found, left_out = [], []
    for k, tool in enumerate(value):
        where = f"tools[{k}]"
        kind = _kind(tool, where)
        if kind in HOSTED_TOOLS:
            left_out.append(kind)
        elif kind == "namespace":
            found.extend(_namespace(tool, where))
        else:
            found.append(_tool(tool, where))
    names = set()
    for tool in found:
        if tool.name in names:
            raise bad(f"two tools are named '{tool.name}' (namespaces are flattened: their "
                      f"members' names must be unique too)", "tools")
        names.add(tool.name)
    return Tools(tuple(found), tuple(dict.fromkeys(left_out)))


def _kind(item, where: str) -> str:
    if not isinstance(item, dict):
        raise bad(f"'{where}' must be an object", where)
    kind = item.get("type")
    if not isinstance(kind, str):
        raise bad(f"'{where}.type' is required", f"{where}.type")
    return kind


def _namespace(tool: dict, where: str) -> list[Tool]:
    namespace = _name(tool, where)
    members = tool.get("tools")
    if not isinstance(members, list) or not members:
        raise bad(f"'{where}.tools' must be a non-empty list of tools", f"{where}.tools")
    return [_tool(member, f"{where}.tools[{j}]", namespace) for j, member in enumerate(members)]


def _tool(tool: dict, where: str, namespace: str | None = None) -> Tool:
    kind = _kind(tool, where)
    if kind not in ("function", "custom"):
        allowed = "function, custom" + ("" if namespace else ", namespace or a hosted tool")
        raise bad(f"'{where}.type' {kind!r} is not a tool type Kipp knows ({allowed})",
                  f"{where}.type", "unsupported_value")
    name = _name(tool, where)
    description = tool.get("description")
    if description is not None and not isinstance(description, str):
        raise bad(f"'{where}.description' must be a string", f"{where}.description")
    if kind == "function":
        if tool.get("strict") not in (None, True, False):
            raise bad(f"'{where}.strict' must be a boolean", f"{where}.strict")
        parameters = tool.get("parameters")
        schema = _schema(_NO_PARAMETERS if parameters is None else parameters,
                         f"{where}.parameters")
        return Tool(name, ToolKind.FUNCTION, schema, description, namespace)
    grammar, note = _custom_format(tool.get("format"), f"{where}.format")
    return Tool(name, ToolKind.CUSTOM, _CUSTOM_PARAMETERS, ((description or "") + note) or None,
                namespace, grammar)


def _name(tool: dict, where: str) -> str:
    name = tool.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise bad(f"'{where}.name' must be 1-64 of a-z, A-Z, 0-9, _, - and .; got {name!r}",
                  f"{where}.name")
    return name


def _schema(schema, param: str) -> dict:
    try:
        return g.schema_dict(schema, param)
    except g.GrammarError as e:
        raise bad(str(e), param) from None


def _custom_format(fmt, where: str) -> tuple[g.Grammar | None, str]:
    """A custom tool's grammar (None for free text) and what its description adds."""
    if fmt is None or fmt == {"type": "text"}:
        return None, ""
    if not isinstance(fmt, dict) or fmt.get("type") != "grammar":
        raise bad(f"'{where}' must be {{\"type\": \"text\"}} or {{\"type\": \"grammar\", "
                  f"\"syntax\": \"lark\" or \"regex\", \"definition\": ...}}", where)
    syntax, definition = fmt.get("syntax"), fmt.get("definition")
    param = f"{where}.definition"
    makers = {"lark": g.lark_grammar, "regex": g.regex_grammar}
    if syntax not in makers:
        raise bad(f"'{where}.syntax' must be \"lark\" or \"regex\"", f"{where}.syntax")
    try:
        grammar = makers[syntax](definition, param)
    except g.GrammarError as e:
        raise bad(str(e), param) from None
    return grammar, f"\n\nThe input follows this {syntax} grammar:\n{definition}"


def text_config(value) -> tuple[dict, g.Grammar | None]:
    """`text` as the response echoes it, and the grammar of its format."""
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise bad("'text' must be an object", "text")
    for key in value:
        if key not in ("format", "verbosity"):
            raise bad(f"unsupported field 'text.{key}'", f"text.{key}")
    verbosity = value.get("verbosity")
    if verbosity not in (None, "low", "medium", "high"):
        raise bad("'text.verbosity' must be low, medium or high", "text.verbosity")
    fmt = value.get("format") or {"type": "text"}
    if not isinstance(fmt, dict):
        raise bad("'text.format' must be an object", "text.format")
    if fmt.get("type") == "json_schema":
        chat = {"type": "json_schema",
                "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
    else:
        chat = fmt
    try:
        grammar = g.response_format_grammar(chat, "text.format")
    except g.GrammarError as e:
        raise bad(str(e).replace("text.format.json_schema", "text.format"),
                  "text.format") from None
    return {"format": fmt, "verbosity": verbosity or "medium"}, grammar


def reply_constraint(body: dict, tools: Tools, formatted: g.Grammar | None) -> Constraint:
    """The tool choice's grammar, else the text format's. A forced call wins: text.format
    shapes a message, and a reply that must be a call has none (agents send both when a
    structured final answer follows a forced tool)."""
    forced = _tool_choice(body.get("tool_choice"), tools,
                          boolean(body, "parallel_tool_calls", True))
    if formatted is None or forced.grammar is not None or forced.custom is not None:
        return forced
    return replace(forced, grammar=formatted)


def _tool_choice(choice, tools: Tools, parallel: bool) -> Constraint:
    shown = tools.tools
    if choice in (None, "auto", "none"):
        return Constraint(None, shown, bool(shown) and choice != "none")
    if not shown:
        raise bad(f"'tool_choice' {choice!r} needs tools Kipp can run", "tool_choice")
    if choice == "required":
        return Constraint(_calls_grammar(shown, None, parallel), shown, True)
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind in ("function", "custom"):
        name = choice.get("name")
        tool = tools.named(name) if isinstance(name, str) else None
        if tool is None or tool.kind.value != kind:
            raise bad(f"'tool_choice' names {kind} tool {name!r}, which is not in tools",
                      "tool_choice")
        if tool.kind is ToolKind.FUNCTION:
            return Constraint(_calls_grammar(shown, tool.name, parallel), shown, True)
        return Constraint(tool.grammar, shown, False, tool)
    if kind == "allowed_tools":
        return _allowed_tools(choice, tools, parallel)
    if kind in HOSTED_TOOLS:
        raise bad(f"'tool_choice' forces the hosted tool {kind!r}, which Kipp does not run",
                  "tool_choice", "unsupported_value")
    raise bad("'tool_choice' must be \"auto\", \"none\", \"required\", {\"type\": \"function\" "
              "or \"custom\", \"name\": ...} or {\"type\": \"allowed_tools\", ...}",
              "tool_choice")


def _allowed_tools(choice: dict, tools: Tools, parallel: bool) -> Constraint:
    """Only the allowed tools are shown; mode "required" forces a call of one of them."""
    mode, entries = choice.get("mode"), choice.get("tools")
    if mode not in ("auto", "required") or not isinstance(entries, list) or not entries:
        raise bad("'tool_choice' allowed_tools needs a mode (\"auto\" or \"required\") and a "
                  "non-empty list of tools", "tool_choice")
    subset = []
    for entry in entries:
        kind = entry.get("type") if isinstance(entry, dict) else None
        if kind in HOSTED_TOOLS:
            continue
        tool = tools.named(entry.get("name")) if kind in ("function", "custom") else None
        if tool is None or tool.kind.value != kind:
            raise bad(f"'tool_choice' allows {entry!r}, which is not in tools", "tool_choice")
        subset.append(tool)
    if not subset and mode == "required":
        raise bad("'tool_choice' requires a call of allowed tools Kipp does not run",
                  "tool_choice")
    grammar = _calls_grammar(subset, None, parallel) if mode == "required" else None
    return Constraint(grammar, tuple(subset), bool(subset))


def _calls_grammar(tools, name: str | None, parallel: bool) -> g.Grammar:
    functions = [g.FunctionTool(t.name, t.parameters) for t in tools]
    try:
        return g.tool_call_grammar(functions, name=name, parallel=parallel, param="tool_choice")
    except g.GrammarError as e:
        raise bad(str(e), "tool_choice") from None
