"""What a caller hands the engine and what it gets back: a Request, a Ticket, and its events.

    ticket = scheduler.submit(Request(prompt=ids, max_tokens=64, n=2))
    for event in ticket:          # Delta ..., Finished per choice, then Done (or Failed)
        ...
    ticket.cancel()               # from any thread, any time
"""

from __future__ import annotations

import dataclasses
import queue
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Iterator

from kipp.engine.spec import SpecConfig, SpecStats
from kipp.text.grammar import Grammar, Matcher
from kipp.text.reasoning import Part, Reasoning
from kipp.text.sampling import SamplingParams
from kipp.text.stops import StopPatterns

if TYPE_CHECKING:
    from kipp.engine.session import Session


class FinishReason(str, Enum):
    """Why a choice ended; the value is the APIs' `finish_reason` string."""

    STOP = "stop"  # a stop token, a stop string, or a complete grammar
    LENGTH = "length"  # max_tokens

    __str__ = str.__str__
    __format__ = str.__format__


@dataclass(frozen=True)
class Request:
    """One completion request in token ids; the server and the Python API build it."""

    prompt: tuple[int, ...]
    max_tokens: int
    n: int = 1
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    logprobs: int | None = None  # None: off; k >= 0: the sampled token's logprob + top k
    grammar: Grammar | None = None  # constrained decoding (kipp.text.grammar): a mask per choice
    echo: bool = False  # events start with the prompt (its logprobs too when logprobs is set)
    # Speculative drafts for a greedy request (kipp.engine.spec); None: the scheduler's default.
    spec: SpecConfig | None = None
    # A chat reply's think block: split off as its own part, bounded (kipp.text.reasoning).
    reasoning: Reasoning | None = None
    adapter: str | None = None  # the LoRA adapter it runs under (Model.add_adapter); None: base

    def __post_init__(self):
        object.__setattr__(self, "prompt", tuple(int(t) for t in self.prompt))
        object.__setattr__(self, "stop", tuple(self.stop))


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float | None  # None for an echoed prompt's first token (nothing predicts it)
    top: tuple[tuple[int, float], ...] | None  # (id, logprob), most likely first


@dataclass(frozen=True)
class Delta:
    """New text of one choice; `tokens` are the ids that produced it (with logprobs if asked);
    `part` says whether the text is the reply's reasoning or its answer."""

    choice: int
    text: str
    tokens: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()
    part: Part = Part.CONTENT


@dataclass(frozen=True)
class Finished:
    choice: int
    reason: FinishReason
    stop: str | None = None  # the stop string that ended the choice, if one did


@dataclass(frozen=True)
class Done:
    """The request's last event: token counts, llama.cpp-style timings and decode counts."""

    prompt_tokens: int
    cached_tokens: int  # prompt tokens whose KV was kept or adopted (first choice)
    completion_tokens: int
    timings: dict
    decode_evals: int = 0  # evals after the prompt's, summed over choices
    decode_tokens: int = 0  # tokens picked from those evals' logits (stop tokens included)
    spec: SpecStats | None = None  # drafts verified, for a speculative request


@dataclass(frozen=True)
class Failed:
    """The request ended without finishing; `message` says why, `error` is the exception."""

    message: str
    cancelled: bool = False
    error: BaseException | None = None


Event = Delta | Finished | Done | Failed


def timings(prompt_n: int, cache_n: int, prompt_ms: float, predicted_n: int,
            predicted_ms: float, queue_ms: float) -> dict:
    """llama.cpp's `timings` object: counts, milliseconds and the rates derived from them."""
    return dict(
        prompt_n=prompt_n, cache_n=cache_n, prompt_ms=prompt_ms,
        prompt_per_token_ms=prompt_ms / prompt_n if prompt_n else 0.0,
        prompt_per_second=1000 * prompt_n / prompt_ms if prompt_ms else 0.0,
        predicted_n=predicted_n, predicted_ms=predicted_ms,
        predicted_per_token_ms=predicted_ms / predicted_n if predicted_n else 0.0,
        predicted_per_second=1000 * predicted_n / predicted_ms if predicted_ms else 0.0,
        queue_ms=queue_ms)


class Ticket:
    """The caller's handle on a submitted request: iterate its events, or cancel it."""

    def __init__(self, request: Request, request_id: int, events: queue.Queue | None = None,
                 tag: int | None = None, session: Session | None = None):
        self.request = request
        self.id = request_id
        self.session = session  # borrowed: the caller's open session, left open at the end
        self.submitted_at = time.perf_counter()
        self.first_token_at: float | None = None
        self.cancelled = False
        self.ended = False  # the consumer has received Done or Failed
        self.ended_at: float | None = None
        # A TicketGroup's tickets share its queue and put (tag, event) pairs in it.
        self._events: queue.Queue = queue.Queue() if events is None else events
        self._tag = tag
        self.stops = StopPatterns(request.stop)  # compiled here, on the caller's thread
        self._wake = None  # the scheduler's, once queued
        self.matcher: Matcher | None = None  # the compiled grammar, copied per choice at start

    def cancel(self) -> None:
        """Stop the request at the next step boundary; its blocks go back to the pool."""
        self.cancelled = True
        if self._wake is not None:
            self._wake()

    def get(self, timeout: float | None = None) -> Event:
        """The next event (blocks); raises queue.Empty after `timeout` seconds."""
        return self._seen(self._events.get(timeout=timeout))

    def poll(self) -> Event | None:
        """The next event if one is waiting, else None (a thread-less caller's get)."""
        try:
            return self._seen(self._events.get_nowait())
        except queue.Empty:
            return None

    def _seen(self, event: Event) -> Event:
        if isinstance(event, (Done, Failed)):
            self.ended = True
        return event

    def __iter__(self) -> Iterator[Event]:
        while not self.ended:
            yield self.get()

    def put(self, event: Event) -> None:
        """The engine's side: queue one event for the consumer."""
        if isinstance(event, Delta) and self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        if isinstance(event, (Done, Failed)):
            self.ended_at = time.perf_counter()
        self._events.put(event if self._tag is None else (self._tag, event))


class TicketGroup:
    """The tickets of a batch of prompts, consumed as one: the same interface as a Ticket, one
    event stream in which choice j of prompt i is choice i*n + j, and a single Done (counts
    summed) once every prompt is done. A Failed of any prompt ends the group and cancels the
    others."""

    def __init__(self, tickets: list[Ticket], events: queue.Queue):
        self.tickets = tickets
        self.request = tickets[0].request
        self.n = self.request.n
        self.ended = False
        self._events = events
        self._done: dict[int, Done] = {}

    def cancel(self) -> None:
        for ticket in self.tickets:
            ticket.cancel()

    @property
    def cancelled(self) -> bool:
        return any(t.cancelled for t in self.tickets)

    def get(self, timeout: float | None = None) -> Event:
        """The next event (blocks); raises queue.Empty after `timeout` seconds of silence."""
        while True:
            index, event = self._events.get(timeout=timeout)
            ticket = self.tickets[index]
            if isinstance(event, (Done, Failed)):
                ticket.ended = True
            if self.ended:
                continue  # a cancelled companion's last event after the group ended
            if isinstance(event, Failed):
                self.ended = True
                self.cancel()
                return event
            if isinstance(event, Done):
                self._done[index] = event
                if len(self._done) == len(self.tickets):
                    self.ended = True
                    return merge_done([self._done[i] for i in range(len(self.tickets))])
                continue
            return dataclasses.replace(event, choice=index * self.n + event.choice)

    def __iter__(self) -> Iterator[Event]:
        while not self.ended:
            yield self.get()


def merge_done(dones: list[Done]) -> Done:
    """One Done for a batch of prompts: token counts summed, times of the slowest."""
    if len(dones) == 1:
        return dones[0]
    total = {key: sum(d.timings[key] for d in dones)
             for key in ("prompt_n", "cache_n", "predicted_n")}
    slowest = {key: max(d.timings[key] for d in dones)
               for key in ("prompt_ms", "predicted_ms", "queue_ms")}
    return Done(sum(d.prompt_tokens for d in dones), sum(d.cached_tokens for d in dones),
                sum(d.completion_tokens for d in dones), timings(**total, **slowest),
                sum(d.decode_evals for d in dones), sum(d.decode_tokens for d in dones))


def collect(ticket: Ticket) -> tuple[list[list[int]], list[str], list[str | None], Event]:
    """Drain a ticket: per choice the token ids, the text and the finish reason, and the last
    event (Done or Failed). For tests and simple callers."""
    n = ticket.request.n
    tokens: list[list[int]] = [[] for _ in range(n)]
    texts = [""] * n
    reasons: list[str | None] = [None] * n
    last: Event | None = None
    for event in ticket:
        if isinstance(event, Delta):
            tokens[event.choice].extend(event.tokens)
            texts[event.choice] += event.text
        elif isinstance(event, Finished):
            reasons[event.choice] = event.reason
        last = event
    return tokens, texts, reasons, last
