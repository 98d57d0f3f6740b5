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

A request with a `grammar` (kipp.text.grammar) is compiled at submit (a grammar that cannot be
enforced is a SchedulerError naming its field) and each choice gets its own matcher: the
sampler picks under its mask and the matcher consumes the emitted token; where the backend
evaluates off the host CPU (kipp.text.grammar.masks_ahead) the next masks of the whole batch are
computed on the grammar worker thread while the next batched eval runs. A choice whose grammar is
complete finishes ("stop") without evaluating a stop token; speculative drafts are cut where the
grammar would reject them.

Seeded sampling is reproducible under load: on a backend whose rows can depend on their batch
companions (`Backend.batch_invariant` False: JAX, MLX) a seeded sampled choice is evaluated in a
backend call of its own every step and computes its own prompt KV (it adopts no published
blocks, whose values depend on how they were evaluated), so its logits, and its text, are those
it gets alone. The reference backend is batch-invariant and batches everything.

`echo` requests score their prompt: the first choice prefills without adopting a prefix and asks
every row's logits, and each choice's events start with one Delta of the prompt's tokens and
their logprobs (the first token has none). With max_tokens 0 nothing is generated.

`submit_many` queues a batch of prompts as one TicketGroup: one event stream in which choice j of
prompt i is choice i*n + j. `drain` stops taking requests, fails the queued ones and gives the
running ones a deadline (graceful shutdown).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np

from kipp.backend import KV_BLOCK, blocks_needed
from kipp.engine.blocks import PoolExhausted
from kipp.engine.session import Session
from kipp.errors import KippError
from kipp.text.grammar import (
    Grammar,
    GrammarError,
    Matcher,
    grammar_tokenizer,
    masks_ahead,
    prefetch,
)
from kipp.text.sampling import Sampler, SamplingParams, logprobs
from kipp.text.stops import StopPatterns, StopStrings
from kipp.text.tokenizer import StreamingDetokenizer

log = logging.getLogger("kipp.engine.scheduler")

MAX_CHOICES = 8
DEFAULT_PREFILL_CHUNK = 128
# A request without max_tokens gets its share of the pool, but at least this many tokens while
# the pool holds it at all (kipp.http's chat default; see Scheduler.default_max_tokens).
MIN_DEFAULT_TOKENS = 256
SHUTDOWN_MESSAGE = "the server is shutting down"


class SchedulerError(KippError, ValueError):
    """A request the scheduler can never run (names the limit it breaks). `param` is the
    request field at fault and `code` a machine-readable reason, when there is one."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


class QueueFull(KippError):
    """The FIFO is at its limit; try again later."""


class ShuttingDown(KippError):
    """The scheduler is draining or stopped: it takes no new requests."""


@dataclass(frozen=True)
class Request:
    """One completion request in token ids; the server builds it from the HTTP body."""

    prompt: tuple[int, ...]
    max_tokens: int
    n: int = 1
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    logprobs: int | None = None  # None: off; k >= 0: the sampled token's logprob + top k
    grammar: Grammar | None = None  # constrained decoding (kipp.text.grammar): a mask per choice
    echo: bool = False  # events start with the prompt (its logprobs too when logprobs is set)

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

    def __init__(self, request: Request, request_id: int, events: queue.Queue | None = None,
                 tag: int | None = None):
        self.request = request
        self.id = request_id
        self.submitted_at = time.perf_counter()
        self.first_token_at: float | None = None
        self.cancelled = False
        self.ended = False  # the consumer has received Done or Failed
        self.ended_at: float | None = None
        # A TicketGroup's tickets share its queue and put (tag, event) pairs in it.
        self._events: queue.Queue = queue.Queue() if events is None else events
        self._tag = tag
        self.stops = StopPatterns(request.stop)  # compiled here, on the caller's thread
        self._scheduler: Scheduler | None = None
        self.matcher: Matcher | None = None  # the compiled grammar, copied per choice at start

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
                    return _merge_done([self._done[i] for i in range(len(self.tickets))])
                continue
            return dataclasses.replace(event, choice=index * self.n + event.choice)

    def __iter__(self) -> Iterator[Event]:
        while not self.ended:
            yield self.get()


def _merge_done(dones: list[Done]) -> Done:
    """One Done for a batch of prompts: token counts summed, times of the slowest."""
    if len(dones) == 1:
        return dones[0]
    t = {key: sum(d.timings[key] for d in dones) for key in ("prompt_n", "cache_n",
                                                             "predicted_n")}
    for key in ("prompt_ms", "predicted_ms", "queue_ms"):
        t[key] = max(d.timings[key] for d in dones)
    t["prompt_per_token_ms"] = t["prompt_ms"] / t["prompt_n"] if t["prompt_n"] else 0.0
    t["prompt_per_second"] = 1000 * t["prompt_n"] / t["prompt_ms"] if t["prompt_ms"] else 0.0
    t["predicted_per_token_ms"] = (t["predicted_ms"] / t["predicted_n"]
                                   if t["predicted_n"] else 0.0)
    t["predicted_per_second"] = (1000 * t["predicted_n"] / t["predicted_ms"]
                                 if t["predicted_ms"] else 0.0)
    return Done(sum(d.prompt_tokens for d in dones), sum(d.cached_tokens for d in dones),
                sum(d.completion_tokens for d in dones), t)


class _Choice:
    """One sequence of a running request."""

    def __init__(self, run: "_Run", index: int, session: Session):
        model, request = run.scheduler.model, run.ticket.request
        self.run, self.index, self.session = run, index, session
        self.sampler = Sampler(request.sampling, choice=index)
        self.detok = StreamingDetokenizer(model.tokenizer)
        self.stops = StopStrings(run.ticket.stops)
        # Followers wait for the first choice's prompt blocks, unless the request adopts none
        # (then they prefill at once) or only scores its prompt (max_tokens 0: they never run).
        wait = index and (run.adopts or request.max_tokens == 0)
        self.state = "waiting" if wait else "prefill"  # -> prefill -> decode -> done
        self.pending: int | None = None  # the sampled token the next step evaluates
        # Greedy choices on a speculative scheduler verify prompt-lookup drafts (kipp.engine.spec).
        self.drafter = self.gate = None
        if run.scheduler.speculative and request.sampling.is_greedy:
            from kipp.engine.spec import AdaptiveGate, PromptLookupDrafter

            self.drafter, self.gate = PromptLookupDrafter(), AdaptiveGate()
        self.matcher: Matcher | None = None  # the grammar's state, for constrained requests
        self.draft: list[int] = []
        self.generated: list[int] = []
        self.held: list[int] = []  # tokens whose text the stop check still holds back
        self.held_logprobs: list[TokenLogprob] = []

    @property
    def scores_prompt(self) -> bool:
        """Whether this step's logits rows score the prompt (echo with logprobs)."""
        return self.state == "prefill" and self.index == 0 and self.run.scores_prompt

    def rows(self, tokens: list[int]) -> int:
        """Logits rows to ask for `tokens`: every row when scoring the prompt."""
        return len(tokens) if self.scores_prompt else 1 + len(self.draft)

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
            if self.draft and self.matcher is not None:  # never verify what the grammar bars
                self.draft = self.draft[:self.matcher.valid_prefix(self.draft)]
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
        request = ticket.request
        # A seeded sampled request on a batch-variant backend runs alone and adopts nothing.
        self.isolated = (not scheduler.model.backend.batch_invariant
                         and request.sampling.seed is not None
                         and not request.sampling.is_greedy)
        self.adopts = not self.isolated  # whether choices adopt published prompt blocks
        self.scores_prompt = request.echo and request.logprobs is not None
        self.prompt_logprobs: list[TokenLogprob] = []  # echo: one per prompt token so far

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
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK, speculative: bool = False,
                 masks_ahead: bool | None = None):
        if max_batch < 1 or max_queue < 1 or prefill_chunk < 1:
            raise SchedulerError("max_batch, max_queue and prefill_chunk must be positive")
        self.model = model
        self.max_batch, self.max_queue, self.prefill_chunk = max_batch, max_queue, prefill_chunk
        self.speculative = speculative  # greedy requests verify prompt-lookup drafts
        # Grammar masks for the next step computed during its eval (None: where it pays).
        self.masks_ahead = _masks_ahead(model) if masks_ahead is None else masks_ahead
        self._prefetch: list[Matcher] = []
        self._fifo: deque[Ticket] = deque()
        self._running: list[_Run] = []
        self._cv = threading.Condition()
        self._ids = iter(range(1, 1 << 62))
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._drain_deadline: float | None = None  # time.monotonic() when draining
        self.counters = dict(requests=0, finished=0, cancelled=0, failed=0, prompt_tokens=0,
                             reused_tokens=0, generated_tokens=0, steps=0, spec_drafted=0,
                             spec_accepted=0, step_seconds=0.0, eval_seconds=0.0)

    # -- caller side (any thread) -------------------------------------------------------------

    def submit(self, request: Request) -> Ticket:
        """Queue a request; raises SchedulerError if it can never run, QueueFull if the FIFO is
        at its limit, ShuttingDown once the scheduler drains or stops."""
        self.validate(request)
        ticket = Ticket(request, next(self._ids))  # compiles the stop strings, off the lock
        ticket.matcher = self._matcher(request)
        self._enqueue([ticket])
        return ticket

    def submit_many(self, requests: Sequence[Request]) -> TicketGroup:
        """Queue a batch of prompts, all or none (see TicketGroup); the same errors as submit,
        and a SchedulerError (param "prompt") for more prompts than the queue holds."""
        if not requests:
            raise SchedulerError("a batch needs at least one request", param="prompt")
        if len(requests) > self.max_queue:
            raise SchedulerError(f"a batch of {len(requests)} prompts is more than the request "
                                 f"queue holds ({self.max_queue})", param="prompt")
        for request in requests:
            self.validate(request)
        events: queue.Queue = queue.Queue()
        tickets = [Ticket(r, next(self._ids), events, i) for i, r in enumerate(requests)]
        for ticket in tickets:
            ticket.matcher = self._matcher(ticket.request)
        self._enqueue(tickets)
        return TicketGroup(tickets, events)

    def _enqueue(self, tickets: list[Ticket]) -> None:
        with self._cv:
            if self._stopping or self._drain_deadline is not None:
                raise ShuttingDown(SHUTDOWN_MESSAGE)
            if len(self._fifo) + len(tickets) > self.max_queue:
                raise QueueFull(f"the request queue is full ({self.max_queue} waiting)")
            for ticket in tickets:
                ticket._scheduler = self
                self._fifo.append(ticket)
            self.counters["requests"] += len(tickets)
            self._cv.notify()

    def validate(self, request: Request) -> None:
        """Raise SchedulerError, naming the field (`param`), for a request that can never run."""
        model = self.model
        if not 1 <= request.n <= min(MAX_CHOICES, self.max_batch):
            raise SchedulerError(f"n must be in 1..{min(MAX_CHOICES, self.max_batch)}, "
                                 f"got {request.n}", param="n")
        if not request.prompt:
            raise SchedulerError("the prompt is empty", param="prompt")
        model.check_tokens(request.prompt)
        low = 0 if request.echo else 1
        if not isinstance(request.max_tokens, int) or request.max_tokens < low:
            raise SchedulerError(f"max_tokens must be an integer >= {low}, got "
                                 f"{request.max_tokens!r}", param="max_tokens")
        self._check_context(request)
        self._check_pool(request)

    def _check_context(self, request: Request) -> None:
        context = self.model.entry.context_length
        prompt = len(request.prompt)
        if prompt > context or (prompt == context and request.max_tokens):
            room = "is longer than" if prompt > context else "leaves no room to generate in"
            raise SchedulerError(f"the prompt ({prompt} tokens) {room} the context length "
                                 f"{context}", param="prompt", code="context_length_exceeded")
        total = prompt + request.max_tokens
        if total > context:
            raise SchedulerError(f"prompt ({prompt} tokens) + max_tokens "
                                 f"({request.max_tokens}) = {total} exceeds the context length "
                                 f"{context}", param="max_tokens",
                                 code="context_length_exceeded")

    def _check_pool(self, request: Request) -> None:
        pool = self.model.pool.num_blocks
        n, prompt = request.n, len(request.prompt)
        worst = n * blocks_needed(prompt + request.max_tokens)
        if worst <= pool:
            return
        least = blocks_needed(prompt + min(request.max_tokens, 1))  # the prompt, one token
        param = "max_tokens" if n * least <= pool else "prompt" if least > pool else "n"
        raise SchedulerError(f"the request needs up to {worst} KV blocks ({n} x (prompt {prompt} "
                             f"+ max_tokens {request.max_tokens} tokens)); the KV pool has "
                             f"{pool} blocks of {KV_BLOCK} tokens", param=param,
                             code="kv_capacity_exceeded")

    def default_max_tokens(self, prompt_tokens: int, n: int, preferred: int) -> int:
        """max_tokens for a request that gives none: `preferred`, cut to the context, to the
        pool (its n choices must fit at once) and to a fair share of the pool, so that
        `max_batch` such sequences run together: num_blocks // max_batch blocks per choice for
        prompt and completion, or at least MIN_DEFAULT_TOKENS of completion beyond a share.
        At least 1 (a prompt that leaves no room then fails validate, naming the prompt)."""
        blocks = self.model.pool.num_blocks
        share = blocks // self.max_batch * KV_BLOCK - prompt_tokens
        fit = blocks // n * KV_BLOCK - prompt_tokens
        room = self.model.entry.context_length - prompt_tokens
        return max(1, min(preferred, room, fit, max(share, MIN_DEFAULT_TOKENS)))

    def _matcher(self, request: Request) -> Matcher | None:
        """The request's grammar compiled for this model's tokenizer (in the caller's thread,
        so a grammar that cannot be enforced is a SchedulerError at submit)."""
        if request.grammar is None:
            return None
        model = self.model
        try:
            return Matcher(grammar_tokenizer(model.tokenizer, model.entry.stop_token_ids),
                           request.grammar)
        except GrammarError as e:
            raise SchedulerError(str(e), param=e.param) from None

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
            self._end(run, Failed(SHUTDOWN_MESSAGE))
        self._running.clear()
        while self._fifo:
            self._fifo.popleft()._put(Failed(SHUTDOWN_MESSAGE))

    def drain(self, timeout: float, wait: bool = True) -> bool:
        """Graceful shutdown, from any thread: take no new requests (ShuttingDown), fail the
        queued ones now, let the running ones finish for up to `timeout` seconds and then end
        them with Failed. With `wait`, returns once nothing is queued or running (True), or
        when the engine thread is not running (False). A later call can only bring the
        deadline closer."""
        with self._cv:
            deadline = time.monotonic() + max(0.0, timeout)
            if self._drain_deadline is None or deadline < self._drain_deadline:
                self._drain_deadline = deadline
            self._cv.notify()
        while wait and (self._fifo or self._running):
            if not self.alive:
                return False
            time.sleep(0.02)
        return True

    @property
    def draining(self) -> bool:
        return self._drain_deadline is not None

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
                    **self._compiles(), **self.counters)

    def _compiles(self) -> dict:
        """Step programs the backend has compiled and their seconds (a compiling backend keeps
        a `compile_log` of (shape, seconds)): a compile inside a step is part of its time."""
        compiled = list(getattr(getattr(self.model, "backend", None), "compile_log", ()))
        return dict(compiles=len(compiled), compile_seconds=sum(s for _, s in compiled))

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
        self._reap_draining()
        self._admit()
        batch = [(c, c.next_tokens(self.prefill_chunk)) for r in self._running for c in r.live
                 if c.state in ("prefill", "decode")]
        if not batch:
            self._finish_ended()  # echo with max_tokens 0 ends without a decode step
            return False
        try:
            evaluating = time.perf_counter()
            results = self._evaluate(batch)
            self.counters["eval_seconds"] += time.perf_counter() - evaluating
        except Exception as e:  # sessions are unchanged (eval_batch); fail only this batch
            log.exception("batched eval failed")
            for run in {id(c.run): c.run for c, _ in batch}.values():
                self._running.remove(run)
                self._end(run, Failed(f"evaluation failed: {e}"))
            return True
        self.counters["steps"] += 1
        for (choice, _), logits in zip(batch, results):
            if choice.state == "done":  # its request failed or closed earlier in this loop
                continue
            try:
                if choice.draft:
                    self._verify(choice, logits)
                else:
                    if len(logits) > 1:
                        self._score_prompt(choice, logits)
                    self._advance(choice, logits[-1])
            except GrammarError as e:  # a grammar that dead-ends: fail only its request
                self._fail_run(choice.run, f"constrained decoding failed: {e}")
        if self._prefetch:  # the next masks, while the next eval runs
            prefetch(self._prefetch)
            self._prefetch = []
        self._finish_ended()
        self.counters["step_seconds"] += time.perf_counter() - started  # the steps counted
        return True

    def _finish_ended(self) -> None:
        for run in [r for r in self._running if not r.live]:
            self._running.remove(run)
            self._finish(run)

    def _evaluate(self, batch: list[tuple[_Choice, list[int]]]) -> list[np.ndarray]:
        """Logits for every (choice, tokens) of a step: one backend call for the batch, plus
        one of its own for each choice of an isolated request (see the module docstring)."""
        shared = [i for i, (c, _) in enumerate(batch) if not c.run.isolated]
        calls = ([shared] if shared else []) + [[i] for i, (c, _) in enumerate(batch)
                                                if c.run.isolated]
        results: list = [None] * len(batch)
        for call in calls:
            items = [(batch[i][0].session, batch[i][1], batch[i][0].rows(batch[i][1]))
                     for i in call]
            for i, logits in zip(call, self.model.eval_batch(items)):
                results[i] = logits
        return results

    def _fail_run(self, run: _Run, message: str) -> None:
        if run in self._running:
            self._running.remove(run)
        for choice in run.choices:
            choice.state = "done"
        self._end(run, Failed(message))

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

    def _reap_draining(self) -> None:
        """While draining: fail what is queued; at the deadline, what still runs."""
        if self._drain_deadline is None:
            return
        with self._cv:
            waiting = list(self._fifo)
            self._fifo.clear()
        for ticket in waiting:
            ticket._put(Failed(SHUTDOWN_MESSAGE))
        if time.monotonic() >= self._drain_deadline:
            for run in list(self._running):
                self._running.remove(run)
                self._end(run, Failed(SHUTDOWN_MESSAGE))

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
        if run.adopts and not run.scores_prompt:  # scoring needs every prompt row's logits
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
        if ticket.matcher is not None:  # one grammar state per choice, copied before any token
            for choice in run.choices:
                choice.matcher = ticket.matcher if choice.index == 0 else ticket.matcher.copy()
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
                if request.echo:
                    self._echo(run)
                if request.max_tokens == 0:  # echo only: the prompt is scored, nothing to add
                    for c in run.live:
                        self._close_choice(c, "length")
                    return
                self._release_followers(run)
        self._sample(choice, logits)

    def _score_prompt(self, choice: _Choice, rows: np.ndarray) -> None:
        """Logprobs of the prompt tokens that this prefill chunk's rows predict."""
        run = choice.run
        prompt = run.ticket.request.prompt
        start = choice.session.length - len(rows)  # position of the chunk's first token
        if start == 0:
            run.prompt_logprobs.append(TokenLogprob(prompt[0], None, None))
        targets = prompt[start + 1: start + 1 + len(rows)]  # the last row predicts no prompt
        for row, token in zip(rows, targets):
            lp, top = logprobs(row, token, run.ticket.request.logprobs)
            run.prompt_logprobs.append(TokenLogprob(token, lp, tuple(top)))

    def _echo(self, run: _Run) -> None:
        """Every choice's events start with the prompt (and its logprobs when scored)."""
        request = run.ticket.request
        text = self.model.tokenizer.decode(list(request.prompt))
        for choice in run.choices:
            run.ticket._put(Delta(choice.index, text, request.prompt,
                                  tuple(run.prompt_logprobs)))

    def _release_followers(self, run: _Run) -> None:
        """The first choice has the prompt's KV: publish its full blocks, let the others adopt."""
        followers = run.choices[1:]
        if not followers or not run.adopts:
            return  # a request that adopts nothing started its followers at admission
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
        allowed = None if choice.matcher is None else choice.matcher.allowed()
        token = choice.sampler.sample(logits, choice.session.tokens if history is None
                                      else history, allowed)
        if token in self.model.entry.stop_token_ids:
            return self._close_choice(choice, "stop")
        if choice.matcher is not None:
            choice.matcher.consume(token)
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
        if choice.matcher is not None:
            if choice.matcher.complete:  # only a stop token may follow: no need to evaluate it
                return self._close_choice(choice, "stop")
            if self.masks_ahead:
                self._prefetch.append(choice.matcher)

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


def _masks_ahead(model) -> bool:
    return masks_ahead(getattr(model, "backend", None))


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

