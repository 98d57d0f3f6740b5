"""Scheduler events in OpenAI's shapes: whole responses and stream chunks, for chat completions
(ChatShape) and for legacy completions (CompletionShape).

    shape = shape_for(call, served, token_text)
    shape.response(events)        # the whole response object
    shape.chunks(event)           # the chunk objects one event becomes, when streaming

Choice i*n + j is prompt i's choice j. When a chat request offers tools, each choice's text goes
through kipp.text.chat.ToolCallStream: content deltas as they come, a `delta.tool_calls` chunk
per call once its <tool_call> block closes.
"""

from __future__ import annotations

import time
import uuid
from abc import ABC, abstractmethod

from kipp.engine.requests import Delta, Done, Finished
from kipp.http.schema import Call
from kipp.text.chat import ToolCallStream, parse_tool_calls, reply_finish_reason


class TokenText:
    """Token ids as the strings and bytes that logprobs report."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def bytes(self, token: int) -> bytes:
        return self.tokenizer.decode_bytes([token])

    def text(self, token: int) -> str:
        return self.bytes(token).decode("utf-8", errors="replace")


class Shape(ABC):
    """What both endpoints' objects share: ids, usage, the chunk envelope, event collection."""

    prefix = object_name = chunk_object = ""

    def __init__(self, call: Call, served: str, token_text: TokenText):
        self.call, self.served, self.tt = call, served, token_text
        self.id = self.prefix + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.n = len(call.requests) * call.request.n  # choice i*n + j: prompt i's choice j

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
    def _choice(self, i: int, text: str, logprobs, reason) -> dict:
        """One choice of the whole response."""

    def response(self, events) -> dict:
        n = self.n
        texts, lps, reasons = [""] * n, [[] for _ in range(n)], [None] * n
        done = None
        for event in events:
            if isinstance(event, Delta):
                texts[event.choice] += event.text
                lps[event.choice].extend(event.logprobs)
            elif isinstance(event, Finished):
                reasons[event.choice] = event.reason
            elif isinstance(event, Done):
                done = event
        choices = [self._choice(i, texts[i], self._logprobs(i, lps[i]), reasons[i])
                   for i in range(n)]
        return {"id": self.id, "object": self.object_name, "created": self.created,
                "model": self.served, "choices": choices, "usage": self._usage(done),
                "timings": done.timings}

    def first_chunks(self) -> list:
        return []

    def chunks(self, event) -> list:
        if isinstance(event, Done) and self.call.include_usage:
            return [self._chunk([], usage=self._usage(event), timings=event.timings)]
        return []


class CompletionShape(Shape):
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

    def _choice(self, i: int, text: str, logprobs, reason) -> dict:
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


class ChatShape(Shape):
    """/v1/chat/completions: assistant messages, chat logprobs, tool calls parsed from text."""

    prefix, object_name, chunk_object = "chatcmpl-", "chat.completion", "chat.completion.chunk"

    def __init__(self, call: Call, served: str, token_text: TokenText):
        super().__init__(call, served, token_text)
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

    def _choice(self, i: int, text: str, logprobs, reason) -> dict:
        message = {"role": "assistant", "content": text}
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
