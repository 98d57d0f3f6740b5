"""Anthropic's Messages API, the answer side: a parsed call (MessagesCall), the message and its
stream of events (MessageShape), and Anthropic's error object (MessagesErrors, registered for
every path under /v1/messages). kipp.http.messages parses the bodies."""

from __future__ import annotations

import hashlib
import json
import uuid
from dataclasses import dataclass
from enum import Enum

from kipp.engine.requests import Delta, Done, Finished, FinishReason
from kipp.http.fields import APIError
from kipp.http.schema import Call
from kipp.http.shape import Shape, error_shape_for, sse
from kipp.text.chat import ToolCallStream
from kipp.text.reasoning import Part

PATH = "/v1/messages"
OMITTED_TOOLS_HEADER = "x-kipp-omitted-tools"
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large",
               429: "rate_limit_error", 500: "api_error", 503: "overloaded_error",
               529: "overloaded_error"}


@error_shape_for(PATH)
class MessagesErrors:
    """Anthropic's error object: {"type": "error", "error": {"type", "message"}}; the message
    names the field, since Anthropic's error has no param."""

    @staticmethod
    def body(e: APIError) -> dict:
        kind = ERROR_TYPES.get(e.status)
        if kind is None:
            kind = "invalid_request_error" if 400 <= e.status < 500 else "api_error"
        message = e.message
        if e.param and e.param not in message:
            message = f"{e.param}: {message}"
        return {"type": "error", "error": {"type": kind, "message": message}}


@dataclass(frozen=True)
class MessagesCall:
    """A parsed Messages body: the Call, and what the reply's shape needs besides."""

    call: Call
    omitted_tools: tuple[str, ...] = ()  # Anthropic-defined tools left out, "name (type)"
    one_tool_use: bool = False  # disable_parallel_tool_use: at most one tool_use block
    hide_thinking: bool = False  # thinking.display "omitted"


class Block(str, Enum):
    """The content block a stream has open."""

    THINKING = "thinking"
    TEXT = "text"
    TOOL_USE = "tool_use"


class StopReason(str, Enum):
    END_TURN = "end_turn"
    MAX_TOKENS = "max_tokens"
    STOP_SEQUENCE = "stop_sequence"
    TOOL_USE = "tool_use"


# The delta type -> the block key it extends (input_json_delta's JSON is parsed at the end).
DELTA_KEYS = {"text_delta": "text", "thinking_delta": "thinking",
              "signature_delta": "signature"}


def _usage(prompt_tokens: int, cached: int, output_tokens: int) -> dict:
    return {"input_tokens": prompt_tokens - cached, "output_tokens": output_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


def _signature(thinking: str) -> str:
    # Clients send thinking back with its signature and some drop a block without one; Kipp
    # checks none, so a digest of the text serves.
    return hashlib.sha256(thinking.encode()).hexdigest()


class MessageShape(Shape):
    """Anthropic's message and its stream: message_start, ping, per block a start, deltas
    and a stop, then message_delta and message_stop. The whole message is these events
    folded, so both agree."""

    def __init__(self, parsed: MessagesCall, served: str, token_text):
        super().__init__(parsed.call, served, token_text)
        self.parsed = parsed
        self.id = "msg_" + uuid.uuid4().hex[:24]
        self.tool_stream = ToolCallStream() if parsed.call.tools else None
        self.open: Block | None = None
        self.index = 0  # the open block's, or the next one's
        self.thought = ""  # the open thinking block's text, for its signature
        self.tool_uses = 0
        self.stop: tuple[StopReason | None, str | None] = (None, None)

    def headers(self) -> dict:
        if not self.parsed.omitted_tools:
            return {}
        return {OMITTED_TOOLS_HEADER: ", ".join(self.parsed.omitted_tools)}

    def frame(self, payload: dict) -> str:
        return sse(payload, event=payload["type"])

    def closing_frames(self) -> list[str]:
        return []

    def error_frames(self, error: APIError) -> list[str]:
        return [sse(MessagesErrors.body(error), event="error")]

    def response(self, events) -> dict:
        payloads = self.first_chunks()
        for event in events:
            payloads.extend(self.chunks(event))
        return fold(payloads)

    def first_chunks(self) -> list:
        message = {"id": self.id, "type": "message", "role": "assistant",
                   "model": self.served, "content": [], "stop_reason": None,
                   "stop_sequence": None, "usage": _usage(len(self.call.request.prompt), 0, 0)}
        return [{"type": "message_start", "message": message}, {"type": "ping"}]

    def chunks(self, event) -> list:
        if isinstance(event, Delta):
            if event.part is Part.REASONING:
                return self._thinking(event.text)
            if self.tool_stream is None:
                return self._text(event.text)
            return self._pieces(self.tool_stream.feed(event.text))
        if isinstance(event, Finished):
            out = self._pieces(self.tool_stream.flush()) if self.tool_stream else []
            self.stop = self._stop_reason(event)
            return out + self._close()
        if isinstance(event, Done):
            reason, sequence = self.stop
            usage = _usage(event.prompt_tokens, event.cached_tokens, event.completion_tokens)
            return [{"type": "message_delta", "usage": usage,
                     "delta": {"stop_reason": reason and reason.value,
                               "stop_sequence": sequence}},
                    {"type": "message_stop"}]
        return []

    def _stop_reason(self, event: Finished) -> tuple[StopReason, str | None]:
        if event.reason == FinishReason.LENGTH:
            return StopReason.MAX_TOKENS, None
        if event.stop is not None:
            return StopReason.STOP_SEQUENCE, event.stop
        return (StopReason.TOOL_USE if self.tool_uses else StopReason.END_TURN), None

    def _delta(self, delta: dict) -> dict:
        return {"type": "content_block_delta", "index": self.index, "delta": delta}

    def _start(self, kind: Block, block: dict) -> list:
        out = self._close()
        self.open = kind
        return out + [{"type": "content_block_start", "index": self.index,
                       "content_block": block}]

    def _close(self) -> list:
        if self.open is None:
            return []
        out = []
        if self.open is Block.THINKING:
            out.append(self._delta({"type": "signature_delta",
                                    "signature": _signature(self.thought)}))
            self.thought = ""
        out.append({"type": "content_block_stop", "index": self.index})
        self.open, self.index = None, self.index + 1
        return out

    def _thinking(self, text: str) -> list:
        if not text:
            return []
        out = []
        if self.open is not Block.THINKING:
            out = self._start(Block.THINKING, {"type": "thinking", "thinking": "",
                                               "signature": ""})
        self.thought += text
        if not self.parsed.hide_thinking:
            out.append(self._delta({"type": "thinking_delta", "thinking": text}))
        return out

    def _text(self, text: str) -> list:
        if not text:
            return []
        out = [] if self.open is Block.TEXT else self._start(Block.TEXT,
                                                             {"type": "text", "text": ""})
        return out + [self._delta({"type": "text_delta", "text": text})]

    def _pieces(self, pieces) -> list:
        out = []
        for kind, value in pieces:
            out.extend(self._text(value) if kind == "content" else self._tool_use(value))
        return out

    def _tool_use(self, call) -> list:
        """A parsed call as a tool_use block (the arguments in one input_json_delta)."""
        arguments = json.loads(call.arguments)
        if not isinstance(arguments, dict):  # tool input is an object: keep the call as text
            body = json.dumps({"name": call.name, "arguments": arguments}, ensure_ascii=False)
            return self._text(f"<tool_call>\n{body}\n</tool_call>")
        if self.parsed.one_tool_use and self.tool_uses:
            return []  # disable_parallel_tool_use under auto: the first call only
        self.tool_uses += 1
        block = {"type": "tool_use", "id": "toolu_" + uuid.uuid4().hex[:24], "name": call.name,
                 "input": {}}
        out = self._start(Block.TOOL_USE, block)
        out.append(self._delta({"type": "input_json_delta", "partial_json": call.arguments}))
        return out + self._close()


def fold(payloads: list) -> dict:
    """The whole message that a stream's payloads describe."""
    message, inputs = None, {}
    for payload in payloads:
        kind = payload["type"]
        if kind == "message_start":
            message = {**payload["message"], "content": []}
        elif kind == "content_block_start":
            message["content"].append(dict(payload["content_block"]))
        elif kind == "content_block_delta":
            index, delta = payload["index"], payload["delta"]
            if delta["type"] == "input_json_delta":
                inputs[index] = inputs.get(index, "") + delta["partial_json"]
            else:
                key = DELTA_KEYS[delta["type"]]
                message["content"][index][key] += delta[key]
        elif kind == "message_delta":
            message.update(payload["delta"])
            message["usage"] = {**message["usage"], **payload["usage"]}
    for index, text in inputs.items():
        message["content"][index]["input"] = json.loads(text)
    return message
