"""The Responses API's input items as the chat messages Qwen3's template renders: messages,
function and custom tool calls and their outputs, reasoning sent back (kipp.http.responses)."""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Callable

from kipp.http.fields import (
    bad,
)

ENCRYPTED_PREFIX = "kipp-reasoning-v1:"


ROLES = ("user", "assistant", "system", "developer")


_TEXT_PARTS = {"input_text": "text", "output_text": "text", "text": "text",
               "refusal": "refusal"}


class _Conversation:
    """Chat messages built from items: consecutive reasoning, assistant text and calls make one
    assistant turn (Qwen3 writes a turn's reasoning, then its text, then its calls)."""

    def __init__(self):
        self.messages: list[dict] = []
        self.turn: dict | None = None

    def add(self, message: dict) -> None:
        self._close()
        self.messages.append(message)

    def reasoning(self, text: str) -> None:
        if self.turn is not None and (self.turn["content"] or self.turn["tool_calls"]):
            self._close()
        turn = self._open()
        turn["reasoning_content"] = "\n".join(filter(None, (turn.get("reasoning_content"),
                                                            text)))

    def content(self, text: str) -> None:
        if self.turn is not None and self.turn["tool_calls"]:
            self._close()
        self._open()["content"] += text

    def call(self, call_id: str, name: str, arguments: str) -> None:
        self._open()["tool_calls"].append(
            {"id": call_id, "type": "function",
             "function": {"name": name, "arguments": arguments}})

    def finish(self) -> list[dict]:
        self._close()
        return self.messages

    def _open(self) -> dict:
        if self.turn is None:
            self.turn = {"role": "assistant", "content": "", "tool_calls": []}
        return self.turn

    def _close(self) -> None:
        if self.turn is not None:
            if not self.turn["tool_calls"]:
                del self.turn["tool_calls"]
            self.messages.append(self.turn)
            self.turn = None


def input_messages(value, param: str = "input") -> list[dict]:
    """`input` (a string, or a list of items) as OpenAI chat messages; a 400 names the item."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise bad(f"'{param}' must be a string or a non-empty list of input items", param)
    conversation = _Conversation()
    for k, item in enumerate(value):
        where = f"{param}[{k}]"
        if not isinstance(item, dict):
            raise bad(f"'{where}' must be an object", where)
        kind = item.get("type", "message" if "role" in item else None)
        handler = _ITEMS.get(kind)
        if handler is None:
            raise bad(f"'{where}.type' {kind!r} is not an input item Kipp reads ("
                      f"{', '.join(_ITEMS)}; item_reference: send the item itself)",
                      f"{where}.type")
        handler(conversation, item, where)
    return conversation.finish()


def _message_item(conversation: _Conversation, item: dict, where: str) -> None:
    role = item.get("role")
    if role not in ROLES:
        raise bad(f"'{where}.role' must be one of {', '.join(ROLES)}", f"{where}.role")
    if "content" not in item:
        raise bad(f"'{where}.content' is required", f"{where}.content")
    text = _content_text(item["content"], f"{where}.content")
    if role == "assistant":
        conversation.content(text)
    else:
        conversation.add({"role": "system" if role == "developer" else role, "content": text})


def _function_call_item(conversation: _Conversation, item: dict, where: str) -> None:
    call_id, name = _string(item, "call_id", where), _string(item, "name", where)
    arguments = _string(item, "arguments", where) or "{}"
    try:
        json.loads(arguments)
    except ValueError:
        raise bad(f"'{where}.arguments' is not JSON text", f"{where}.arguments") from None
    conversation.call(call_id, name, arguments)


def _custom_call_item(conversation: _Conversation, item: dict, where: str) -> None:
    call_id, name = _string(item, "call_id", where), _string(item, "name", where)
    text = _string(item, "input", where)
    conversation.call(call_id, name, json.dumps({"input": text}, ensure_ascii=False))


def _call_output_item(conversation: _Conversation, item: dict, where: str) -> None:
    call_id = _string(item, "call_id", where)
    if "output" not in item:
        raise bad(f"'{where}.output' is required", f"{where}.output")
    text = _content_text(item["output"], f"{where}.output")
    conversation.add({"role": "tool", "content": text, "tool_call_id": call_id})


def _reasoning_item(conversation: _Conversation, item: dict, where: str) -> None:
    text = _reasoning_text(item, where)
    if text is not None:
        conversation.reasoning(text)


_ITEMS: dict[str, Callable] = {
    "message": _message_item, "function_call": _function_call_item,
    "function_call_output": _call_output_item, "custom_tool_call": _custom_call_item,
    "custom_tool_call_output": _call_output_item, "reasoning": _reasoning_item}


def _string(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if value is None:
        raise bad(f"'{where}.{key}' is required", f"{where}.{key}")
    if not isinstance(value, str):
        raise bad(f"'{where}.{key}' must be a string", f"{where}.{key}")
    return value


def _content_text(content, where: str) -> str:
    """A message's content (a string or text parts) as one string; Kipp reads no images."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"'{where}' must be a string or a list of content parts", where)
    texts = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        key = _TEXT_PARTS.get(kind)
        if key is None:
            reason = ("Kipp's models read text only" if kind in
                      ("input_image", "input_file", "input_audio")
                      else f"it must be one of {', '.join(_TEXT_PARTS)}")
            raise bad(f"'{at}.type' is {kind!r}: {reason}", f"{at}.type", "unsupported_value")
        texts.append(_string(part, key, at))
    return "\n".join(texts)


def _reasoning_text(item: dict, where: str) -> str | None:
    """A reasoning item's text: its content, else Kipp's own encrypted_content, else its
    summary; None when it holds none Kipp can read."""
    content = _parts(item, "content", "reasoning_text", where)
    if content:
        return "\n".join(content)
    decoded = decode_reasoning(item.get("encrypted_content"), where)
    if decoded is not None:
        return decoded
    summary = _parts(item, "summary", "summary_text", where)
    return "\n\n".join(summary) if summary else None


def _parts(item: dict, key: str, kind: str, where: str) -> list[str]:
    parts = item.get(key)
    if parts is None:
        return []
    if not isinstance(parts, list):
        raise bad(f"'{where}.{key}' must be a list", f"{where}.{key}")
    return [_string(p, "text", f"{where}.{key}[{j}]") for j, p in enumerate(parts)
            if isinstance(p, dict) and p.get("type") == kind]


def encode_reasoning(text: str) -> str:
    return ENCRYPTED_PREFIX + base64.b64encode(text.encode("utf-8")).decode("ascii")


def decode_reasoning(value, where: str) -> str | None:
    """The text behind Kipp's encrypted_content; None for none, or another server's."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise bad(f"'{where}.encrypted_content' must be a string", f"{where}.encrypted_content")
    if not value.startswith(ENCRYPTED_PREFIX):
        return None
    try:
        return base64.b64decode(value[len(ENCRYPTED_PREFIX):], validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        raise bad(f"'{where}.encrypted_content' is not a reasoning text Kipp encoded",
                  f"{where}.encrypted_content") from None
