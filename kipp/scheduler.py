"""Continuous batching: one engine thread turns a FIFO of requests into batched eval steps.

No HTTP and no backend arrays here: the scheduler speaks token ids, sessions and the block pool,
so it runs on every backend and the server above it only parses, enqueues and streams.

    scheduler = Scheduler(model, max_batch=8)
    scheduler.start()                                   # the engine thread
    ticket = scheduler.submit(Request(prompt=ids, max_tokens=64, n=2,
                                      sampling=SamplingParams(temperature=0.7, seed=1)))
    for event in ticket:                                # Delta, Finished ..., then Done
        ...
    ticket.cancel()                                     # from any thread, any time

Admission (strict FIFO, so nothing starves): the head request is admitted while the active
choices plus its n fit `max_batch` and its worst-case KV blocks can be reserved: the blocks of
prompt + max_tokens per choice, less the published prefix its first choice adopts. Reservations
are held by the request until it ends, so pool pressure delays admission and never takes a block
from a running sequence. A request that could never fit is rejected at submit.

Each step evaluates, in one `Model.eval_batch`, one prefill chunk or one decode token for every
active choice, then samples. The n choices of one request share their prompt: the first choice
prefills it, publishes its full prompt blocks, and the others adopt them and evaluate only the
rest. Finished and cancelled requests publish their full blocks (the pool is the prefix cache)
and give their reservation back; a cancellation is applied at the next step boundary and
touches no other request.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from kipp.blocks import PoolExhausted, blocks_needed
from kipp.errors import KippError
from kipp.model import StopStrings
from kipp.sampling import Sampler, SamplingParams, logprobs
from kipp.session import Session
from kipp.tokenizer import StreamingDetokenizer

log = logging.getLogger("kipp.scheduler")

MAX_CHOICES = 8
DEFAULT_PREFILL_CHUNK = 128


class SchedulerError(KippError, ValueError):
    """A request the scheduler can never run (names the limit it breaks). `param` is the
    request field at fault and `code` a machine-readable reason, when there is one."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


class QueueFull(KippError):
    """The FIFO is at its limit; try again later."""


@dataclass(frozen=True)
class Request:
    """One completion request in token ids; the server builds it from the HTTP body."""

    prompt: tuple[int, ...]
    max_tokens: int
    n: int = 1
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    logprobs: int | None = None  # None: off; k >= 0: the sampled token's logprob + top k

    def __post_init__(self):
        object.__setattr__(self, "prompt", tuple(int(t) for t in self.prompt))
        object.__setattr__(self, "stop", tuple(self.stop))


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (id, logprob), most likely first


@dataclass(frozen=True)
class Delta:
    """New text of one choice; `tokens` are the ids that produced it (with logprobs if asked)."""

    choice: int
    text: str
    tokens: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Finished:
    choice: int
    reason: str  # "stop" or "length"


@dataclass(frozen=True)
class Done:
    """The request's last event: token counts and llama.cpp-style timings."""

    prompt_tokens: int
    cached_tokens: int  # prompt tokens whose KV came from the block pool (first choice)
    completion_tokens: int
    timings: dict


@dataclass(frozen=True)
class Failed:
    """The request ended without finishing; `message` says why."""

    message: str
    cancelled: bool = False


Event = Delta | Finished | Done | Failed


class Ticket:
    """The caller's handle on a submitted request: iterate its events, or cancel it."""

    def __init__(self, request: Request, request_id: int):
        self.request = request
        self.id = request_id
        self.submitted_at = time.perf_counter()
        self.first_token_at: float | None = None
        self.cancelled = False
        self.ended = False  # the consumer has received Done or Failed
        self.ended_at: float | None = None
        self._events: queue.Queue = queue.Queue()
        self._scheduler: Scheduler | None = None

    def cancel(self) -> None:
        """Stop the request at the next step boundary; its blocks go back to the pool."""
        self.cancelled = True
        if self._scheduler is not None:
            self._scheduler._wake()

    def get(self, timeout: float | None = None) -> Event:
        """The next event (blocks); raises queue.Empty after `timeout` seconds."""
        event = self._events.get(timeout=timeout)
        if isinstance(event, (Done, Failed)):
            self.ended = True
        return event

    def __iter__(self) -> Iterator[Event]:
        while not self.ended:
            yield self.get()

    def _put(self, event: Event) -> None:
        if isinstance(event, Delta) and self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        if isinstance(event, (Done, Failed)):
            self.ended_at = time.perf_counter()
        self._events.put(event)


class _Choice:
    """One sequence of a running request."""

    def __init__(self, run: "_Run", index: int, session: Session):
        model, request = run.scheduler.model, run.ticket.request
        self.run, self.index, self.session = run, index, session
        self.sampler = Sampler(request.sampling, choice=index)
        self.detok = StreamingDetokenizer(model.tokenizer)
        self.stops = StopStrings(list(request.stop))
        self.state = "waiting" if index else "prefill"  # -> prefill -> decode -> done
        self.pending: int | None = None  # the sampled token the next step evaluates
        # Greedy choices on a speculative scheduler verify prompt-lookup drafts (kipp.spec).
        self.drafter = self.gate = None
        if run.scheduler.speculative and request.sampling.is_greedy:
            from kipp.spec import AdaptiveGate, PromptLookupDrafter

            self.drafter, self.gate = PromptLookupDrafter(), AdaptiveGate()
        self.draft: list[int] = []
        self.generated: list[int] = []
        self.held: list[int] = []  # tokens whose text the stop check still holds back
        self.held_logprobs: list[TokenLogprob] = []

    def next_tokens(self, chunk: int) -> list[int]:
        if self.state == "prefill":
            prompt = self.run.ticket.request.prompt
            return list(prompt[self.session.length: self.session.length + chunk])
        self.draft = []
        if self.drafter is not None:
            # Room: the draft's tokens must fit the session, and emitting all of them plus
            # the model's own next token must not pass max_tokens.
            room = min(self.session.remaining - 1,
                       self.run.ticket.request.max_tokens - len(self.generated) - 1)
            budget = min(self.gate.budget(), room)
            if budget > 0:
                self.draft = self.drafter.draft(self.session.tokens + [self.pending], budget)
        return [self.pending] + self.draft


class _Run:
    """A request admitted to the batch: its choices and its block reservation."""

    def __init__(self, scheduler: "Scheduler", ticket: Ticket):
        self.scheduler, self.ticket = scheduler, ticket
        self.choices: list[_Choice] = []
        self.reservation = None
        self.cached_tokens = 0
        self.completion_tokens = 0
        self.admitted_at = time.perf_counter()
        self.prompt_done_at: float | None = None

    @property
    def live(self) -> list[_Choice]:
        return [c for c in self.choices if c.state != "done"]

    def close(self) -> None:
        """Publish every choice's full blocks, release them and the unused reservation."""
        for choice in self.choices:
            choice.session.close(publish=True)
        if self.reservation is not None:
            self.reservation.release()


class Scheduler:
    """The engine loop over one Model. Only the engine thread touches the model."""

    def __init__(self, model, max_batch: int = MAX_CHOICES, max_queue: int = 64,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK, speculative: bool = False):
        if max_batch < 1 or max_queue < 1 or prefill_chunk < 1:
            raise SchedulerError("max_batch, max_queue and prefill_chunk must be positive")
        self.model = model
        self.max_batch, self.max_queue, self.prefill_chunk = max_batch, max_queue, prefill_chunk
        self.speculative = speculative  # greedy requests verify prompt-lookup drafts
        self._fifo: deque[Ticket] = deque()
        self._running: list[_Run] = []
        self._cv = threading.Condition()
        self._ids = iter(range(1, 1 << 62))
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.counters = dict(requests=0, finished=0, cancelled=0, failed=0, prompt_tokens=0,
                             reused_tokens=0, generated_tokens=0, steps=0, spec_drafted=0,
                             spec_accepted=0, step_seconds=0.0, eval_seconds=0.0)

    # -- caller side (any thread) -------------------------------------------------------------

    def submit(self, request: Request) -> Ticket:
        """Queue a request; raises SchedulerError if it can never run, QueueFull if the FIFO is
        at its limit."""
        self.validate(request)
        with self._cv:
            if self._stopping:
                raise SchedulerError("the scheduler is shutting down")
            if len(self._fifo) >= self.max_queue:
                raise QueueFull(f"the request queue is full ({self.max_queue} waiting)")
            ticket = Ticket(request, next(self._ids))
            ticket._scheduler = self
            self._fifo.append(ticket)
            self.counters["requests"] += 1
            self._cv.notify()
        return ticket

    def validate(self, request: Request) -> None:
        model = self.model
        context = model.entry.context_length
        if not 1 <= request.n <= min(MAX_CHOICES, self.max_batch):
            raise SchedulerError(f"n must be in 1..{min(MAX_CHOICES, self.max_batch)}, "
                                 f"got {request.n}", param="n")
        if not request.prompt:
            raise SchedulerError("the prompt is empty")
        model.check_tokens(request.prompt)
        if not isinstance(request.max_tokens, int) or request.max_tokens < 1:
            raise SchedulerError(f"max_tokens must be a positive integer, got "
                                 f"{request.max_tokens!r}", param="max_tokens")
        total = len(request.prompt) + request.max_tokens
        if total > context:
            raise SchedulerError(f"prompt ({len(request.prompt)} tokens) + max_tokens "
                                 f"({request.max_tokens}) = {total} exceeds the context length "
                                 f"{context}", param="max_tokens",
                                 code="context_length_exceeded")
        worst = request.n * blocks_needed(total)
        if worst > model.pool.num_blocks:
            raise SchedulerError(f"the request needs up to {worst} KV blocks, the pool has "
                                 f"{model.pool.num_blocks}")

    def start(self) -> "Scheduler":
        """Run the engine loop on its own thread."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="kipp-engine", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the engine thread; queued and running requests end with Failed."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        for run in self._running:
            self._end(run, Failed("the server is shutting down"))
        self._running.clear()
        while self._fifo:
            self._fifo.popleft()._put(Failed("the server is shutting down"))

    def __enter__(self) -> "Scheduler":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stats(self) -> dict:
        """Queue, batch and pool figures for /metrics (read without locking: a snapshot)."""
        return dict(queue_depth=len(self._fifo), active_requests=len(self._running),
                    active_sequences=sum(len(r.live) for r in list(self._running)),
                    pool=self.model.pool.stats(), pool_blocks=self.model.pool.num_blocks,
                    **self.counters)

    # -- engine side ---------------------------------------------------------------------------

    def _wake(self) -> None:
        with self._cv:
            self._cv.notify()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._stopping and not self._fifo and not self._running:
                    self._cv.wait()
                if self._stopping:
                    return
            try:
                self.step()
            except Exception:  # a bug in the loop itself: fail what is running, keep serving
                log.exception("scheduler step failed")
                for run in self._running:
                    self._end(run, Failed("internal error in the engine step"))
                self._running.clear()

    def step(self) -> bool:
        """One scheduler step: reap cancellations, admit, run one batched eval, sample.
        Returns whether anything was evaluated. Called by the engine thread (or a test)."""
        started = time.perf_counter()
        self._reap_cancelled()
        self._admit()
        batch = [(c, c.next_tokens(self.prefill_chunk)) for r in self._running for c in r.live
                 if c.state in ("prefill", "decode")]
        if not batch:
            return False
        try:
            evaluating = time.perf_counter()
            results = self.model.eval_batch([(c.session, tokens, 1 + len(c.draft))
                                             for c, tokens in batch])
            self.counters["eval_seconds"] += time.perf_counter() - evaluating
        except Exception as e:  # sessions are unchanged (eval_batch); fail only this batch
            log.exception("batched eval failed")
            for run in {id(c.run): c.run for c, _ in batch}.values():
                self._running.remove(run)
                self._end(run, Failed(f"evaluation failed: {e}"))
            return True
        self.counters["steps"] += 1
        for (choice, _), logits in zip(batch, results):
            if choice.draft:
                self._verify(choice, logits)
            else:
                self._advance(choice, logits[0])
        for run in [r for r in self._running if not r.live]:
            self._running.remove(run)
            self._finish(run)
        self.counters["step_seconds"] += time.perf_counter() - started  # the steps counted
        return True

    def run_until_idle(self, max_steps: int = 1_000_000) -> None:
        """Step until nothing is queued or running (tests drive the scheduler without a thread)."""
        for _ in range(max_steps):
            if not self._fifo and not self._running:
                return
            self.step()
        raise SchedulerError(f"still busy after {max_steps} steps")

    def _reap_cancelled(self) -> None:
        with self._cv:
            waiting = [t for t in self._fifo if t.cancelled]
            for ticket in waiting:
                self._fifo.remove(ticket)
        for ticket in waiting:
            self.counters["cancelled"] += 1
            ticket._put(Failed("cancelled", cancelled=True))
        for run in [r for r in self._running if r.ticket.cancelled]:
            self._running.remove(run)
            self.counters["cancelled"] += 1
            self._end(run, Failed("cancelled", cancelled=True))

    def _admit(self) -> None:
        active = sum(len(r.live) for r in self._running)
        while True:
            with self._cv:
                if not self._fifo:
                    return
                ticket = self._fifo[0]
                if active + ticket.request.n > self.max_batch:
                    return
                run = self._try_start(ticket)
                if run is None:
                    return  # pool pressure: the head waits for running requests to finish
                self._fifo.popleft()
            self._running.append(run)
            active += ticket.request.n

    def _try_start(self, ticket: Ticket) -> _Run | None:
        """Adopt the prompt's published prefix and reserve the worst case, or change nothing."""
        request, model = ticket.request, self.model
        capacity = len(request.prompt) + request.max_tokens
        run = _Run(self, ticket)
        leader = model.session(capacity)
        run.cached_tokens = leader.match_prefix(request.prompt)
        # Followers adopt the leader's prompt blocks once it has evaluated them, but a follower
        # may find fewer (evicted, or a live duplicate), so it is reserved in full. The
        # leader's adopted blocks (shared ones and a cached tail) come from the cache.
        worst = request.n * blocks_needed(capacity) - len(leader.block_table)
        try:
            run.reservation = model.pool.reserve(worst)
        except PoolExhausted:
            leader.close(publish=False)
            return None
        leader.reservation = run.reservation
        run.choices.append(_Choice(run, 0, leader))
        for i in range(1, request.n):
            run.choices.append(_Choice(run, i, model.session(capacity, run.reservation)))
        self.counters["prompt_tokens"] += len(request.prompt)
        self.counters["reused_tokens"] += run.cached_tokens
        return run

    def _advance(self, choice: _Choice, logits: np.ndarray) -> None:
        run = choice.run
        request = run.ticket.request
        if choice.state == "prefill":
            if choice.session.length < len(request.prompt):
                return  # more prompt chunks to go
            choice.state = "decode"
            if choice.index == 0:
                run.prompt_done_at = time.perf_counter()
                self._release_followers(run)
        self._sample(choice, logits)

    def _release_followers(self, run: _Run) -> None:
        """The first choice has the prompt's KV: publish its full blocks, let the others adopt."""
        followers = run.choices[1:]
        if not followers:
            return
        leader = run.choices[0].session
        self.model.pool.publish(leader.tokens, leader.block_table)
        for follower in followers:
            adopted = follower.session.match_prefix(run.ticket.request.prompt)
            self.counters["reused_tokens"] += adopted
            follower.state = "prefill"

    def _verify(self, choice: _Choice, rows: np.ndarray) -> None:
        """Accept the draft up to the first row whose greedy token disagrees, plus that token;
        roll the rejected draft's KV back. Each accepted token is emitted as a plain step
        would, so stop tokens, stop strings and max_tokens cut in the same place."""
        draft, session = choice.draft, choice.session
        evaluated = session.length  # pending + draft are in the session now
        matched = 0
        for i, row in enumerate(rows):
            # Row i's history is the session's tokens up to and including its own position.
            history = session.tokens[: evaluated - len(draft) + i]
            self._sample(choice, row, history)
            if choice.state == "done" or i == len(draft) or choice.pending != draft[i]:
                break
            matched += 1
        choice.gate.update(len(draft), matched)
        self.counters["spec_drafted"] += len(draft)
        self.counters["spec_accepted"] += matched
        keep = evaluated - len(draft) + matched
        if choice.state != "done" and keep < evaluated:
            session.truncate(keep)

    def _sample(self, choice: _Choice, logits: np.ndarray, history=None) -> None:
        run = choice.run
        request = run.ticket.request
        token = choice.sampler.sample(logits, choice.session.tokens if history is None
                                      else history)
        if token in self.model.entry.stop_token_ids:
            return self._close_choice(choice, "stop")
        choice.generated.append(token)
        run.completion_tokens += 1
        self.counters["generated_tokens"] += 1
        choice.held.append(token)
        if request.logprobs is not None:
            lp, top = logprobs(logits, token, request.logprobs)
            choice.held_logprobs.append(TokenLogprob(token, lp, tuple(top)))
        text, stopped = choice.stops.feed(choice.detok.push(token))
        if text:
            self._emit(choice, text)
        if stopped:
            choice.held, choice.held_logprobs = [], []  # they became the stop string
            return self._close_choice(choice, "stop")
        if len(choice.generated) == request.max_tokens:
            return self._close_choice(choice, "length")
        choice.pending = token

    def _emit(self, choice: _Choice, text: str) -> None:
        choice.run.ticket._put(Delta(choice.index, text, tuple(choice.held),
                                     tuple(choice.held_logprobs)))
        choice.held, choice.held_logprobs = [], []

    def _close_choice(self, choice: _Choice, reason: str) -> None:
        if not choice.stops.stopped:
            tail = choice.stops.flush(choice.detok.flush())
            if tail or choice.held:
                self._emit(choice, tail)
        choice.state = "done"
        choice.pending = None
        choice.run.ticket._put(Finished(choice.index, reason))
        if choice.index == 0 and choice.run.prompt_done_at is None:
            choice.run.prompt_done_at = time.perf_counter()

    def _finish(self, run: _Run) -> None:
        now = time.perf_counter()
        prompt_n = len(run.ticket.request.prompt) - run.cached_tokens
        prompt_ms = 1000 * ((run.prompt_done_at or now) - run.admitted_at)
        predicted_ms = 1000 * (now - (run.prompt_done_at or now))
        timings = dict(
            prompt_n=prompt_n, cache_n=run.cached_tokens, prompt_ms=prompt_ms,
            prompt_per_token_ms=prompt_ms / prompt_n if prompt_n else 0.0,
            prompt_per_second=1000 * prompt_n / prompt_ms if prompt_ms else 0.0,
            predicted_n=run.completion_tokens, predicted_ms=predicted_ms,
            predicted_per_token_ms=predicted_ms / run.completion_tokens
            if run.completion_tokens else 0.0,
            predicted_per_second=1000 * run.completion_tokens / predicted_ms
            if predicted_ms else 0.0,
            queue_ms=1000 * (run.admitted_at - run.ticket.submitted_at),
        )
        self.counters["finished"] += 1
        self._end(run, Done(len(run.ticket.request.prompt), run.cached_tokens,
                            run.completion_tokens, timings))

    def _end(self, run: _Run, event: Event) -> None:
        try:
            run.close()
        except Exception:
            log.exception("closing request %d failed", run.ticket.id)
        if isinstance(event, Failed) and not event.cancelled:
            self.counters["failed"] += 1
        run.ticket._put(event)


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

