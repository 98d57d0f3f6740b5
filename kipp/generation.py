"""One generation from the Python API: a scheduler request pumped on the caller's thread.

`Model.generate` and `chat` build a kipp.engine Request and submit it to the model's own
thread-less Scheduler; iterating a Generation steps that scheduler until the request's next
event. Every token is therefore made as the server makes it: the same admission, prefix reuse,
sampling, grammar, speculative verification and token-to-text pipeline. Several open
generations of one model step together, batched.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from enum import Enum
from typing import Iterator

from kipp.display import html_view, preview, text_view
from kipp.engine.admission import SchedulerError
from kipp.engine.requests import Delta, Done, Failed, Finished, Request, TokenLogprob
from kipp.engine.session import Session
from kipp.engine.spec import SpecConfig, SpecStats
from kipp.errors import KippError
from kipp.text.reasoning import Part
from kipp.text.sampling import SamplingParams
from kipp.text.stops import StopError


class GenerationError(KippError, ValueError):
    """Bad arguments to generate or chat; nothing was evaluated."""


class GenerationState(Enum):
    NOT_STARTED = "not started"
    RUNNING = "running"
    FINISHED = "finished"
    STOPPED = "stopped"  # closed early
    FAILED = "failed"


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    reused_tokens: int = 0  # prompt tokens whose KV was kept or adopted from the block pool
    completion_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0  # from the prompt's logits to the end
    decode_evals: int = 0
    decode_tokens: int = 0  # tokens picked from decode-eval logits (== decode_evals unless spec)
    finish_reason: str | None = None  # "stop" or "length"
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # with logprobs= only
    spec: SpecStats | None = None  # drafted, accepted, evals: with speculative=True only

    @property
    def prefill_tokens_per_second(self) -> float:
        evaluated = self.prompt_tokens - self.reused_tokens
        return evaluated / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0

    def record(self, done: Done) -> None:
        self.reused_tokens = done.cached_tokens
        self.prefill_seconds = done.timings["prompt_ms"] / 1000
        self.decode_seconds = done.timings["predicted_ms"] / 1000
        self.decode_evals, self.decode_tokens = done.decode_evals, done.decode_tokens
        if done.spec is not None:
            self.spec = done.spec


def request_for(model, prompt: list[int], max_tokens: int, stop, params: SamplingParams,
                speculative: bool | SpecConfig = False, session: Session | None = None,
                grammar=None, logprobs: int | None = None, reasoning=None,
                adapter: str | None = None) -> Request:
    """generate()'s arguments as a scheduler Request, or a GenerationError naming the bad one."""
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise GenerationError(f"max_tokens must be a positive integer, got {max_tokens!r}")
    if session is not None:
        check_session(model, session)  # the room it leaves: the scheduler's check_request
    if adapter is not None and adapter not in model.backend.adapters:
        raise GenerationError(f"adapter {adapter!r} is not loaded (loaded: "
                              f"{', '.join(sorted(model.backend.adapters)) or 'none'})")
    if session is not None and adapter != session.adapter:
        raise GenerationError(f"the session runs under adapter {session.adapter!r}, not "
                              f"{adapter!r}")
    if not isinstance(speculative, (bool, SpecConfig)):
        raise GenerationError(f"speculative must be True, False or a kipp.engine.spec.SpecConfig, "
                              f"got {speculative!r}")
    draft_spec = getattr(model, "draft_spec", None)  # kipp.load(..., draft=...)
    if speculative is True and draft_spec is not None:
        spec = draft_spec
    elif speculative is True:
        if not params.is_greedy:
            raise GenerationError("speculative=True (prompt lookup) is greedy only: set "
                                  "temperature=0 (or top_k=1), or load a draft model "
                                  "(kipp.load(..., draft=...)), which verifies sampling exactly")
        spec = SpecConfig()
    else:
        spec = speculative or None
    if spec is not None and spec.draft_model is not None:
        from kipp.engine.draft import check_draft_model
        from kipp.engine.spec import SpecError

        try:
            check_draft_model(model, spec.draft_model)
        except SpecError as e:
            raise GenerationError(str(e)) from None
    stops = [stop] if isinstance(stop, str) else list(stop or [])  # checked by StopPatterns
    return Request(tuple(prompt), max_tokens, sampling=params, stop=tuple(stops),
                   logprobs=logprobs, grammar=grammar, spec=spec, reasoning=reasoning,
                   adapter=adapter)


def check_session(model, session: Session) -> None:
    if not isinstance(session, Session):
        raise GenerationError(f"session must be a kipp Session (model.session()), "
                              f"got {type(session).__name__}")
    if session.model is not model:
        raise GenerationError("the session belongs to another model")
    if session.closed:
        raise GenerationError("the session is closed")


class Piece(str):
    """A streamed piece of text; `part` says whether it is the reply's reasoning or answer."""

    part: Part

    def __new__(cls, text: str, part: Part = Part.CONTENT):
        piece = super().__new__(cls, text)
        piece.part = part
        return piece


class Generation:
    """One streaming generation: iterate for text pieces (`for`, or `async for` in async code);
    each is a Piece, a str whose `part` says reasoning or answer. `text` holds the answer so
    far, `reasoning` the reasoning (a chat reply split at its think block), and `stats` the
    counts and timings."""

    def __init__(self, model, request: Request, session: Session | None = None):
        self.model = model
        self.max_tokens = request.max_tokens
        self.stats = GenerationStats(prompt_tokens=len(request.prompt),
                                     spec=SpecStats() if request.spec else None)
        self.session = session  # borrowed: left open, holding prompt + reply, for the next call
        self.text = ""
        self.reasoning = ""
        self.state = GenerationState.NOT_STARTED
        self._engine = model.engine
        try:
            self._ticket = self._engine.prepare(request, session)
        except (SchedulerError, StopError) as e:
            raise GenerationError(str(e)) from None

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> Piece:
        if self.state in (GenerationState.FINISHED, GenerationState.STOPPED,
                          GenerationState.FAILED):
            raise StopIteration
        if self.state is GenerationState.NOT_STARTED:
            self.state = GenerationState.RUNNING
            self._enqueue()
        try:
            piece = self._next_piece()
        except BaseException:
            self.state = GenerationState.FAILED
            self._ticket.cancel()
            self._engine.reap()  # its blocks back now; other generations go on
            raise
        if piece is None:
            self.state = GenerationState.FINISHED
            raise StopIteration
        if piece.part is Part.REASONING:
            self.reasoning += piece
        else:
            self.text += piece
        return piece

    def _enqueue(self) -> None:
        try:
            self._engine.enqueue([self._ticket])
        except SchedulerError as e:
            self.state = GenerationState.FAILED
            raise GenerationError(str(e)) from None

    def _next_piece(self) -> Piece | None:
        """Step the engine until this request's next text (None: it has ended)."""
        while True:
            event = self._ticket.poll()
            if event is None:
                progressed = self._engine.step()
                event = self._ticket.poll()
                if event is None and not progressed:  # queued behind blocks nobody frees
                    raise GenerationError("the KV pool has no room for this generation: its "
                                          "blocks are held by open sessions")
                if event is None:
                    continue
            if isinstance(event, Delta):
                self.stats.tokens.extend(event.tokens)
                self.stats.logprobs.extend(event.logprobs)
                self.stats.completion_tokens += len(event.tokens)
                if event.text:
                    return Piece(event.text, event.part)
            elif isinstance(event, Finished):
                self.stats.finish_reason = str(event.reason)
            elif isinstance(event, Done):
                self.stats.record(event)
                return None
            elif isinstance(event, Failed):
                if event.error is not None:
                    raise event.error
                raise GenerationError(event.message)

    def close(self) -> None:
        """Stop early. An owned session publishes its full blocks and frees them at once; a
        borrowed session stays open, holding what was evaluated so far."""
        if self.state is GenerationState.RUNNING:
            self._ticket.cancel()
            self._engine.reap()
        if self.state in (GenerationState.NOT_STARTED, GenerationState.RUNNING):
            self.state = GenerationState.STOPPED

    def __del__(self):
        if getattr(self, "state", None) is GenerationState.RUNNING:
            self._ticket.cancel()  # an abandoned stream: reaped at the engine's next step

    def __aiter__(self) -> Generation:
        return self

    async def __anext__(self) -> Piece:
        """The next piece, from async code. Each step runs on the calling thread (the model is
        not thread-safe, and MLX streams are per thread), so the event loop waits for one
        step at a time and serves its other tasks between them."""
        await asyncio.sleep(0)
        try:
            return next(self)
        except StopIteration:
            raise StopAsyncIteration from None

    def _display_rows(self) -> list[tuple[str, str]]:
        s = self.stats
        state = self.state.value + (f" ({s.finish_reason})" if s.finish_reason else "")
        rows = [("state", state),
                ("tokens", f"{s.prompt_tokens:,} prompt ({s.reused_tokens:,} reused), "
                           f"{s.completion_tokens:,} generated of at most {self.max_tokens:,}"),
                ("speed", f"prefill {s.prefill_tokens_per_second:.1f} tok/s, decode "
                          f"{s.decode_tokens_per_second:.1f} tok/s")]
        if s.spec is not None:
            rows.append(("speculative", f"{s.spec.accepted}/{s.spec.drafted} drafted tokens "
                                        f"accepted in {s.spec.evals} evals"))
        return rows

    def __repr__(self) -> str:
        rows = self._display_rows() + [("text", repr(preview(self.text)))]
        return text_view("kipp.Generation", rows)

    def _repr_html_(self) -> str:
        return html_view("kipp.Generation", self._display_rows(), text=self.text)


def constraint(json_schema=None, regex=None, grammar=None):
    """generate()'s constraint keywords as one kipp.text.grammar.Grammar (None: unconstrained)."""
    from kipp.text import grammar as g

    given = [k for k, v in (("json_schema", json_schema), ("regex", regex),
                            ("grammar", grammar)) if v is not None]
    if len(given) > 1:
        raise GenerationError(f"give at most one of json_schema, regex and grammar, not "
                              f"{' and '.join(given)}")
    if json_schema is not None:
        return g.json_schema_grammar(json_schema)
    if regex is not None:
        return g.regex_grammar(regex)
    if isinstance(grammar, g.Grammar) or grammar is None:
        return grammar
    return g.lark_grammar(grammar)


@dataclass
class ChatReply:
    """A chat() reply: the answer (`content`), the reasoning before it (None when the reply
    had no think block or it was left inline), and the tool calls the model made."""

    content: str | None
    reasoning: str | None = None
    tool_calls: list = field(default_factory=list)
    finish_reason: str | None = None

    @classmethod
    def parse(cls, generation: Generation, tools: bool) -> ChatReply:
        """The reply of a finished chat generation; `tools`: parse its <tool_call> blocks."""
        from kipp.text.chat import parse_tool_calls, reply_finish_reason

        reasoning = generation.reasoning or None
        reason = generation.stats.finish_reason
        if not tools:
            return cls(generation.text, reasoning, [], reason)
        content, calls = parse_tool_calls(generation.text)
        return cls(content, reasoning, calls, reply_finish_reason(reason, calls))

    @property
    def message(self) -> dict:
        """The assistant message to append to the conversation (OpenAI's shape; the chat
        template keeps its reasoning only where Qwen3's would)."""
        message = {"role": "assistant", "content": self.content}
        if self.reasoning is not None:
            message["reasoning_content"] = self.reasoning
        if self.tool_calls:
            message["tool_calls"] = [call.openai() for call in self.tool_calls]
        return message

    def __str__(self) -> str:
        return self.content or ""
