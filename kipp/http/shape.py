"""Scheduler events in an API's shapes: whole responses and stream chunks. Here OpenAI's chat
completions (ChatShape) and legacy completions (CompletionShape); kipp.http.responses and
kipp.http.messages subclass Shape for the Responses and Messages APIs.

    shape = shape_for(call, served, token_text)
    shape.response(events)        # the whole response object
    shape.first_chunks()          # the payloads a stream opens with
    shape.chunks(event)           # the payloads one event becomes, when streaming
    shape.frame(payload)          # one payload as server-sent-event text
    shape.closing_frames()        # what ends a stream that finished
    shape.error_frames(api_error) # what ends a stream that failed

With a request that splits its reasoning, a chat message carries the think block's text as
`reasoning_content` and again as `reasoning` (the names different clients read), and a stream
sends it in `delta.reasoning_content` / `delta.reasoning` before the answer's `delta.content`.

Choice i*n + j is prompt i's choice j. When a chat request offers tools, each choice's text goes
through kipp.text.chat.ToolCallStream: content deltas as they come, a `delta.tool_calls` chunk
per call once its <tool_call> block closes.
"""

from __future__ import annotations

import json
import time
import uuid
from abc import ABC, abstractmethod

from kipp.engine.requests import Delta, Done, Finished
from kipp.http.schema import APIError, Call
from kipp.text.chat import ToolCallStream, parse_tool_calls, reply_finish_reason
from kipp.text.reasoning import Part


class OpenAIErrors:
    """OpenAI's error object (chat, completions, Responses and the rest of the server)."""

    @staticmethod
    def body(e: APIError) -> dict:
        return e.body()


# Each API's errors in its own shape: the first prefix that matches the path picks it.
_ERROR_SHAPES: list[tuple[str, object]] = []


def error_shape(path: str):
    """The error shape of the API `path` belongs to (OpenAI's unless one registered it)."""
    return next((s for prefix, s in _ERROR_SHAPES if path.startswith(prefix)), OpenAIErrors)


def error_prefixes() -> tuple[str, ...]:
    """The path prefixes whose API registered an error shape of its own."""
    return tuple(prefix for prefix, _ in _ERROR_SHAPES)


def error_shape_for(prefix: str):
    """Register an API's error shape (an object with `body(APIError) -> dict`) for its paths."""
    def register(shape):
        _ERROR_SHAPES.append((prefix, shape))
        return shape
    return register


def sse(payload: dict, event: str | None = None) -> str:
    """One server-sent event: `event:` line when the API names its events, then the data."""
    data = json.dumps(payload, separators=(",", ":"))
    return (f"event: {event}\n" if event else "") + f"data: {data}\n\n"


class TokenText:
    """Token ids as the strings and bytes that logprobs report."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def bytes(self, token: int) -> bytes:
        return self.tokenizer.decode_bytes([token])

    def text(self, token: int) -> str:
        return self.bytes(token).decode("utf-8", errors="replace")


class Shape(ABC):
    """An API's response shape: what the generic answer path (kipp.http.app.Server.answer)
    asks of every API. Framing defaults to OpenAI's (data-only events, then [DONE])."""

    def __init__(self, call: Call, served: str, token_text: TokenText):
        self.call, self.served, self.tt = call, served, token_text
        self.n = len(call.requests) * call.request.n  # choice i*n + j: prompt i's choice j

    @abstractmethod
    def response(self, events) -> dict:
        """The whole response object, from every event of the request."""

    def first_chunks(self) -> list:
        """The payloads a stream opens with."""
        return []

    @abstractmethod
    def chunks(self, event) -> list:
        """The payloads one event becomes, when streaming."""

    def frame(self, payload: dict) -> str:
        return sse(payload)

    def closing_frames(self) -> list[str]:
        return ["data: [DONE]\n\n"]

    def error_frames(self, error: APIError) -> list[str]:
        """A failed stream's end: OpenAI's error object as a data event, then [DONE]."""
        return [sse(error.body()), "data: [DONE]\n\n"]

    def headers(self) -> dict:
        """Extra response headers (a warning about what was left out, say)."""
        return {}


class OpenAIShape(Shape):
    """What chat completions and completions share: ids, usage, the chunk envelope."""

    prefix = object_name = chunk_object = ""

    def __init__(self, call: Call, served: str, token_text: TokenText):
        super().__init__(call, served, token_text)
        self.id = self.prefix + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    def _usage(self, done: Done) -> dict:
        return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
                "total_tokens": done.prompt_tokens + done.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": done.cached_tokens}}

    def _chunk(self, choices: list, **extra) -> dict:
        chunk = {"id": self.id, "object": self.chunk_object, "created": self.created,
                 "model": self.served, "choices": choices}
        if self.call.include_usage:
            chunk["usage"] = None
        chunk.update(extra)
        return chunk

    @abstractmethod
    def _logprobs(self, choice: int, lps):
        """The choice's logprobs in the endpoint's shape (None when not asked for)."""

    @abstractmethod
    def _choice(self, i: int, text: str, logprobs, reason, reasoning: str = "") -> dict:
        """One choice of the whole response (`reasoning`: its think block's text, if split)."""

    def response(self, events) -> dict:
        n = self.n
        texts, lps, reasons = [""] * n, [[] for _ in range(n)], [None] * n
        thoughts = [""] * n
        done = None
        for event in events:
            if isinstance(event, Delta):
                if event.part is Part.REASONING:
                    thoughts[event.choice] += event.text
                else:
                    texts[event.choice] += event.text
                lps[event.choice].extend(event.logprobs)
            elif isinstance(event, Finished):
                reasons[event.choice] = event.reason
            elif isinstance(event, Done):
                done = event
        choices = [self._choice(i, texts[i], self._logprobs(i, lps[i]), reasons[i], thoughts[i])
                   for i in range(n)]
        return {"id": self.id, "object": self.object_name, "created": self.created,
                "model": self.served, "choices": choices, "usage": self._usage(done),
                "timings": done.timings}

    def chunks(self, event) -> list:
        if isinstance(event, Done) and self.call.include_usage:
            return [self._chunk([], usage=self._usage(event), timings=event.timings)]
        return []


class CompletionShape(OpenAIShape):
    """/v1/completions: `text` choices, legacy logprobs with text offsets."""

    prefix, object_name, chunk_object = "cmpl-", "text_completion", "text_completion"

    def __init__(self, call: Call, served: str, token_text: TokenText):
        super().__init__(call, served, token_text)
        self.text_offsets = [0] * self.n

    def _logprobs(self, choice: int, lps):
        if not self.call.logprobs:
            return None
        tokens, offsets = [], []
        for lp in lps:
            text = self.tt.text(lp.token)
            tokens.append(text)
            offsets.append(self.text_offsets[choice])
            self.text_offsets[choice] += len(text)
        # An echoed prompt's first token has no logprob and no alternatives: null, as OpenAI.
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps],
                "top_logprobs": [None if lp.top is None else
                                 {self.tt.text(t): v for t, v in lp.top} for lp in lps],
                "text_offset": offsets}

    def _choice(self, i: int, text: str, logprobs, reason, reasoning: str = "") -> dict:
        return {"index": i, "logprobs": logprobs, "finish_reason": reason, "text": text}

    def chunks(self, event) -> list:
        if isinstance(event, Delta):
            return [self._chunk([{"index": event.choice, "text": event.text,
                                  "logprobs": self._logprobs(event.choice, event.logprobs),
                                  "finish_reason": None}])]
        if isinstance(event, Finished):
            return [self._chunk([{"index": event.choice, "text": "", "logprobs": None,
                                  "finish_reason": event.reason}])]
        return super().chunks(event)


class ChatShape(OpenAIShape):
    """/v1/chat/completions: assistant messages, chat logprobs, tool calls parsed from text."""

    prefix, object_name, chunk_object = "chatcmpl-", "chat.completion", "chat.completion.chunk"

    def __init__(self, call: Call, served: str, token_text: TokenText):
        super().__init__(call, served, token_text)
        reasoning = call.request.reasoning
        self.split = reasoning is not None and reasoning.split
        # with tools: each choice's text split into content and tool calls as it streams
        self.tool_streams = [ToolCallStream() for _ in range(self.n)] if call.tools else None
        self.tool_calls = [0] * self.n  # calls streamed so far, per choice
        self.held_logprobs = [[] for _ in range(self.n)]

    def _entry(self, token: int, value) -> dict:
        return {"token": self.tt.text(token), "logprob": value,
                "bytes": list(self.tt.bytes(token))}

    def _logprobs(self, choice: int, lps):
        if not self.call.logprobs:
            return None
        return {"content": [{**self._entry(lp.token, lp.logprob),
                             "top_logprobs": [self._entry(t, v) for t, v in lp.top]}
                            for lp in lps]}

    def _choice(self, i: int, text: str, logprobs, reason, reasoning: str = "") -> dict:
        message = {"role": "assistant", "content": text}
        if self.split:
            message["reasoning_content"] = message["reasoning"] = reasoning or None
        if self.call.tools:
            message["content"], calls = parse_tool_calls(text)
            if calls:
                message["tool_calls"] = [call.openai() for call in calls]
            reason = reply_finish_reason(reason, calls)
        return {"index": i, "logprobs": logprobs, "finish_reason": reason, "message": message}

    def first_chunks(self) -> list:
        return [self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}])
                for i in range(self.n)]

    def chunks(self, event) -> list:
        if isinstance(event, Delta) and event.part is Part.REASONING:
            delta = {"reasoning_content": event.text, "reasoning": event.text}
            return [self._chunk([{"index": event.choice, "delta": delta,
                                  "logprobs": self._logprobs(event.choice, event.logprobs),
                                  "finish_reason": None}])]
        if self.tool_streams is not None and isinstance(event, (Delta, Finished)):
            return self._tool_chunks(event)
        if isinstance(event, Delta):
            return [self._chunk([{"index": event.choice, "delta": {"content": event.text},
                                  "logprobs": self._logprobs(event.choice, event.logprobs),
                                  "finish_reason": None}])]
        if isinstance(event, Finished):
            return [self._chunk([{"index": event.choice, "delta": {}, "logprobs": None,
                                  "finish_reason": event.reason}])]
        return super().chunks(event)

    def _tool_chunks(self, event) -> list:
        """Content deltas, and a `delta.tool_calls` chunk (index, id, name and whole
        arguments) per call once its block has closed."""
        i = event.choice
        stream = self.tool_streams[i]
        if isinstance(event, Delta):
            self.held_logprobs[i].extend(event.logprobs)
            pieces = stream.feed(event.text)
        else:
            pieces = stream.flush()
        chunks = []
        for kind, value in pieces:
            if kind == "content":
                delta = {"content": value}
            else:
                delta = {"tool_calls": [value.openai(self.tool_calls[i])]}
                self.tool_calls[i] += 1
            logprobs = self._logprobs(i, self.held_logprobs[i])
            self.held_logprobs[i] = []
            chunks.append(self._chunk([{"index": i, "delta": delta, "logprobs": logprobs,
                                        "finish_reason": None}]))
        if isinstance(event, Finished):
            reason = reply_finish_reason(event.reason, range(self.tool_calls[i]))
            chunks.append(self._chunk([{"index": i, "delta": {}, "logprobs": None,
                                        "finish_reason": reason}]))
        return chunks


def shape_for(call: Call, served: str, token_text: TokenText) -> Shape:
    return (ChatShape if call.endpoint == "chat" else CompletionShape)(call, served, token_text)
