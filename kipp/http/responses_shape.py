"""The Responses API's answer: the response object and its stream of events, each with its
sequence_number; the whole response is the stream's events replayed (kipp.http.responses)."""

from __future__ import annotations

import copy
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from kipp.engine.requests import Delta, Done, Finished
from kipp.http.fields import (
    APIError,
)
from kipp.http.response_store import StoredResponse
from kipp.http.responses_input import encode_reasoning, input_messages
from kipp.http.responses_tools import Constraint, Tool, ToolKind, Tools
from kipp.http.schema import Call
from kipp.http.shape import Shape, TokenText, sse
from kipp.text.chat import ToolCall, ToolCallStream
from kipp.text.reasoning import Part

ENCRYPTED_INCLUDE = "reasoning.encrypted_content"


class ItemStatus(str, Enum):
    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"
    INCOMPLETE = "incomplete"


class OpenItem(Enum):
    """The output item a stream is writing into."""

    NONE = "none"
    REASONING = "reasoning"
    MESSAGE = "message"
    CUSTOM_INPUT = "custom_input"  # a forced custom tool's call: the whole reply is its input


@dataclass(frozen=True)
class ResponsesCall:
    """A parsed Responses request: the scheduler's Call and what the response repeats."""

    call: Call
    echo: dict  # the request's settings, as the response object reports them
    constraint: Constraint
    tools: Tools
    conversation: tuple[dict, ...]  # chat messages before the reply, instructions left out
    store: bool
    include: frozenset[str]


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesShape(Shape):
    """The Responses API's response object and its named stream events (module docstring).
    `keep` receives the finished response with its conversation (the store), if given."""

    def __init__(self, rc: ResponsesCall, served: str, token_text: TokenText,
                 keep: Callable[[StoredResponse], None] | None = None):
        super().__init__(rc.call, served, token_text)
        self.rc, self.keep = rc, keep
        self.id = _item_id("resp")
        self.created_at = int(time.time())
        self.sequence = 0
        self.items: list[dict] = []
        self.open = OpenItem.NONE
        self.text = ""  # the open item's text so far
        self.logprobs: list[dict] = []  # the open message's
        self.held: list = []  # content logprobs whose text has not left yet
        self.calls = ToolCallStream() if rc.constraint.parse_calls else None
        self.reason = None
        self.reasoning_tokens = 0
        self.final: dict | None = None

    def response(self, events) -> dict:
        for event in events:
            self.chunks(event)
        return self.final

    def first_chunks(self) -> list:
        return [self._event("response.created", response=self._response("in_progress")),
                self._event("response.in_progress", response=self._response("in_progress"))]

    def chunks(self, event) -> list:
        if isinstance(event, Delta):
            if event.part is Part.REASONING:
                return self._reasoning(event)
            return self._content(event)
        if isinstance(event, Finished):
            return self._finish(event.reason)
        if isinstance(event, Done):
            return self._done(event)
        return []

    def frame(self, payload: dict) -> str:
        return sse(payload, event=payload["type"])

    def closing_frames(self) -> list[str]:
        return []

    def error_frames(self, error: APIError) -> list[str]:
        """An `error` event, then response.failed with what had been written."""
        failed = self._response("failed", output=copy.deepcopy(self.items))
        failed["error"] = {"code": "server_error", "message": error.message}
        return [self.frame(self._event("error", code=error.code, message=error.message,
                                       param=error.param)),
                self.frame(self._event("response.failed", response=failed))]

    def headers(self) -> dict:
        left_out = self.rc.tools.left_out
        if not left_out:
            return {}
        return {"Warning": f'299 kipp "tools left out (Kipp does not run hosted tools): '
                           f'{", ".join(left_out)}"'}

    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def _response(self, status: str, usage=None, incomplete=None, output=()) -> dict:
        return {"id": self.id, "object": "response", "created_at": self.created_at,
                "status": status, "error": None, "incomplete_details": incomplete,
                "model": self.served, "output": list(output), "usage": usage, **self.rc.echo}

    def _reasoning(self, event: Delta) -> list:
        self.reasoning_tokens += len(event.tokens)  # the think tags' tokens too
        if not event.text:
            return []
        out = []
        if self.open is not OpenItem.REASONING:
            out += self._close(ItemStatus.COMPLETED) + self._open(OpenItem.REASONING)
        self.text += event.text
        out.append(self._event("response.reasoning_text.delta", **self._where(),
                               content_index=0, delta=event.text))
        return out

    def _content(self, event: Delta) -> list:
        out = self._close(ItemStatus.COMPLETED) if self.open is OpenItem.REASONING else []
        if self.rc.constraint.custom is not None:
            return out + self._custom_input(event.text)
        self.held.extend(event.logprobs)
        if self.calls is None:
            return out + self._message_text(event.text)
        for kind, value in self.calls.feed(event.text):
            out += self._piece(kind, value)
        return out

    def _piece(self, kind: str, value) -> list:
        """A piece of ToolCallStream's: text of the message, or a whole call."""
        if kind == "content":
            return self._message_text(value)
        self.held = []
        return self._close(ItemStatus.COMPLETED) + self._call(value)

    def _message_text(self, text: str) -> list:
        if not text:
            return []
        out = []
        if self.open is not OpenItem.MESSAGE:
            out += self._close(ItemStatus.COMPLETED) + self._open(OpenItem.MESSAGE)
        entries = [self._logprob(lp) for lp in self.held] if self.call.logprobs else []
        self.held = []
        self.text += text
        self.logprobs += entries
        out.append(self._event("response.output_text.delta", **self._where(), content_index=0,
                               delta=text, logprobs=entries))
        return out

    def _custom_input(self, text: str) -> list:
        out = self._open(OpenItem.CUSTOM_INPUT) if self.open is OpenItem.NONE else []
        if text:
            self.text += text
            out.append(self._event("response.custom_tool_call_input.delta", **self._where(),
                                   delta=text))
        return out

    def _open(self, kind: OpenItem) -> list:
        if kind is OpenItem.REASONING:
            item = {"id": _item_id("rs"), "type": "reasoning", "summary": [], "content": []}
            part = {"type": "reasoning_text", "text": ""}
        elif kind is OpenItem.MESSAGE:
            item = {"id": _item_id("msg"), "type": "message",
                    "status": ItemStatus.IN_PROGRESS.value, "role": "assistant", "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item, part = self._custom_item(self.rc.constraint.custom, _item_id("call"), ""), None
        self.items.append(item)
        self.open, self.text, self.logprobs = kind, "", []
        out = [self._event("response.output_item.added", output_index=len(self.items) - 1,
                           item=copy.deepcopy(item))]
        if part is not None:
            out.append(self._event("response.content_part.added", **self._where(),
                                   content_index=0, part=part))
        return out

    def _close(self, status: ItemStatus) -> list:
        """End the open item: its .done events, then output_item.done."""
        kind, self.open = self.open, OpenItem.NONE
        if kind is OpenItem.NONE:
            return []
        item, where, text = self.items[-1], self._where(), self.text
        if kind is OpenItem.CUSTOM_INPUT:
            item["input"] = text
            out = [self._event("response.custom_tool_call_input.done", **where, input=text)]
        elif kind is OpenItem.REASONING:
            part = {"type": "reasoning_text", "text": text}
            item["content"] = [part]
            if ENCRYPTED_INCLUDE in self.rc.include:
                item["encrypted_content"] = encode_reasoning(text)
            out = [self._event("response.reasoning_text.done", **where, content_index=0,
                               text=text),
                   self._event("response.content_part.done", **where, content_index=0,
                               part=part)]
        else:
            part = {"type": "output_text", "text": text, "annotations": [],
                    "logprobs": self.logprobs}
            item.update(status=status.value, content=[part])
            out = [self._event("response.output_text.done", **where, content_index=0,
                               text=text, logprobs=self.logprobs),
                   self._event("response.content_part.done", **where, content_index=0,
                               part=part)]
        return out + [self._event("response.output_item.done", output_index=where[
            "output_index"], item=copy.deepcopy(item))]

    def _where(self) -> dict:
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1}

    def _call(self, call: ToolCall) -> list:
        """A whole parsed call as its item's events: a function_call, or a custom tool's."""
        tool = self.rc.tools.named(call.name)
        if tool is not None and tool.kind is ToolKind.CUSTOM:
            item = self._custom_item(tool, call.id, _custom_input(call))
            text, key, kind = item["input"], "input", "response.custom_tool_call_input"
        else:
            item = {"id": _item_id("fc"), "type": "function_call",
                    "status": ItemStatus.COMPLETED.value, "call_id": call.id,
                    "name": call.name, "arguments": call.arguments}
            if tool is not None and tool.namespace:
                item["namespace"] = tool.namespace
            text, key, kind = call.arguments, "arguments", "response.function_call_arguments"
        added = {**item, key: ""}
        if "status" in added:
            added["status"] = ItemStatus.IN_PROGRESS.value
        self.items.append(item)
        where = self._where()
        return [self._event("response.output_item.added", output_index=where["output_index"],
                            item=added),
                self._event(f"{kind}.delta", **where, delta=text),
                self._event(f"{kind}.done", **where, **{key: text}),
                self._event("response.output_item.done", output_index=where["output_index"],
                            item=copy.deepcopy(item))]

    @staticmethod
    def _custom_item(tool: Tool, call_id: str, text: str) -> dict:
        item = {"id": _item_id("ctc"), "type": "custom_tool_call", "call_id": call_id,
                "name": tool.name, "input": text}
        if tool.namespace:
            item["namespace"] = tool.namespace
        return item

    def _finish(self, reason) -> list:
        self.reason = reason
        status = ItemStatus.INCOMPLETE if reason == "length" else ItemStatus.COMPLETED
        out = []
        if self.calls is not None:
            for kind, value in self.calls.flush():
                out += self._piece(kind, value)
        custom = self.rc.constraint.custom
        if custom is not None and status is ItemStatus.COMPLETED and not any(
                item["type"] == "custom_tool_call" for item in self.items):
            out += self._close(status) + self._open(OpenItem.CUSTOM_INPUT)
        out += self._close(status)
        if not self.items:  # nothing said at all: an empty message, as every client expects one
            out += self._open(OpenItem.MESSAGE) + self._close(status)
        return out

    def _done(self, done: Done) -> list:
        usage = {"input_tokens": done.prompt_tokens,
                 "input_tokens_details": {"cached_tokens": done.cached_tokens,
                                          "cache_write_tokens": 0},
                 "output_tokens": done.completion_tokens,
                 "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
                 "total_tokens": done.prompt_tokens + done.completion_tokens}
        incomplete = self.reason == "length"
        self.final = self._response("incomplete" if incomplete else "completed", usage,
                                    {"reason": "max_output_tokens"} if incomplete else None,
                                    copy.deepcopy(self.items))
        if not incomplete:
            self.final["completed_at"] = int(time.time())
        if self.keep is not None:
            reply = input_messages(self.items, "output")
            self.keep(StoredResponse(self.final, self.rc.conversation + tuple(reply)))
        kind = "response.incomplete" if incomplete else "response.completed"
        return [self._event(kind, response=self.final)]

    def _logprob(self, lp) -> dict:
        return {**self._entry(lp.token, lp.logprob),
                "top_logprobs": [self._entry(t, v) for t, v in lp.top or ()]}

    def _entry(self, token: int, value) -> dict:
        return {"token": self.tt.text(token), "bytes": list(self.tt.bytes(token)),
                "logprob": value}


def _custom_input(call: ToolCall) -> str:
    """A custom tool's input from the call the model wrote: {"input": ...}, else the whole
    arguments text."""
    arguments = call.parsed_arguments
    if isinstance(arguments, dict) and isinstance(arguments.get("input"), str):
        return arguments["input"]
    return call.arguments
