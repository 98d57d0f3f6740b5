"""Continuous batching: the one engine loop that turns requests into batched eval steps.

No HTTP and no backend arrays here: the scheduler speaks token ids, sessions and the block pool,
so it runs on every backend. The server runs it on an engine thread; the Python API pumps the
same scheduler on the caller's thread, one `step()` at a time.

    scheduler = Scheduler(model, max_batch=8).start()      # or call scheduler.step() yourself
    ticket = scheduler.submit(Request(prompt=ids, max_tokens=64, n=2,
                                      sampling=SamplingParams(temperature=0.7, seed=1)))
    for event in ticket:                                   # Delta, Finished ..., then Done
        ...

A step is plan, evaluate, apply: reap cancellations, admit from a strict FIFO while the active
choices fit `max_batch` and the head's worst case can be reserved (kipp.engine.admission), then
one `Model.eval_batch` of every running choice's next tokens (kipp.engine.choices), then each
choice picks from its rows. Finished and cancelled requests publish their full blocks (the pool
is the prefix cache) and give their reservation back.

A request with a grammar is compiled at submit, each choice gets its own matcher, and where the
backend evaluates off the host CPU the next masks are computed on the grammar worker thread
while the next eval runs. Seeded sampling is reproducible under load: on a backend whose rows
can depend on their batch companions (`Backend.batch_invariant` False) a seeded sampled request
is evaluated in a backend call of its own and adopts no published blocks.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections import deque
from typing import Sequence

import numpy as np

from kipp.engine import admission
from kipp.engine.admission import MAX_CHOICES, SchedulerError
from kipp.engine.choices import Choice, ChoiceState, Run
from kipp.engine.draft import draft_many
from kipp.engine.requests import (  # noqa: F401  (the engine's request API, re-exported)
    Delta,
    Done,
    Event,
    Failed,
    Finished,
    FinishReason,
    Request,
    Ticket,
    TicketGroup,
    TokenLogprob,
    collect,
)
from kipp.engine.session import Session
from kipp.engine.spec import AdaptiveGate, EvalClock, compile_count, paying_drafts
from kipp.errors import KippError
from kipp.text.grammar import GrammarError, Matcher, grammar_tokenizer, masks_ahead, prefetch
from kipp.text.reasoning import ThinkTokens, think_tokens

log = logging.getLogger("kipp.engine.scheduler")

DEFAULT_PREFILL_CHUNK = 128
SHUTDOWN_MESSAGE = "the server is shutting down"


class QueueFull(KippError):
    """The FIFO is at its limit; try again later."""


class ShuttingDown(KippError):
    """The scheduler is draining or stopped: it takes no new requests."""


class Scheduler:
    """The engine loop over one Model. Only one thread (the engine's, or a pumping caller's)
    steps it; submit, cancel and drain are safe from any thread."""

    def __init__(self, model, max_batch: int = MAX_CHOICES, max_queue: int = 64,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK, speculative=False,
                 masks_ahead: bool | None = None):
        if max_batch < 1 or max_queue < 1 or prefill_chunk < 1:
            raise SchedulerError("max_batch, max_queue and prefill_chunk must be positive")
        self.model = model
        self.max_batch, self.max_queue, self.prefill_chunk = max_batch, max_queue, prefill_chunk
        # True: greedy requests verify prompt-lookup drafts; a SpecConfig: every request
        # drafts with it (a draft model: kipp.engine.draft)
        self.speculative = speculative
        # Grammar masks for the next step computed during its eval (None: where it pays).
        self.masks_ahead = (masks_ahead_for(model) if masks_ahead is None else masks_ahead)
        self._prefetch: list[Matcher] = []
        self._fifo: deque[Ticket] = deque()
        self._running: list[Run] = []
        self._borrowed: set[int] = set()  # ids of the sessions queued or running tickets borrow
        self._cv = threading.Condition()
        self._ids = iter(range(1, 1 << 62))
        self._thread: threading.Thread | None = None
        self._calls: deque = deque()  # call_on_engine's functions, run between steps
        self._stopping = False
        self._drain_deadline: float | None = None  # time.monotonic() when draining
        self.counters = dict(requests=0, finished=0, cancelled=0, failed=0, prompt_tokens=0,
                             reused_tokens=0, generated_tokens=0, steps=0, spec_drafted=0,
                             spec_accepted=0, step_seconds=0.0, eval_seconds=0.0)
        # decode rounds timed as they run, the spec gates' prices: the model's, so every
        # scheduler on it (and each new one) prices by what the model's rounds cost here
        self.clock = getattr(model, "clock", None) or EvalClock()

    # -- caller side (any thread) -------------------------------------------------------------

    def submit(self, request: Request, session: Session | None = None) -> Ticket:
        """Queue a request; raises SchedulerError if it can never run, QueueFull if the FIFO is
        at its limit, ShuttingDown once the scheduler drains or stops. With a borrowed
        `session` (one choice) the request continues it and leaves it open at the end."""
        ticket = self.prepare(request, session)
        self.enqueue([ticket])
        return ticket

    def prepare(self, request: Request, session: Session | None = None) -> Ticket:
        """Check a request and compile what it needs (stop strings, grammar), queueing
        nothing: `enqueue` the ticket to run it."""
        self.validate(request, session)
        ticket = Ticket(request, next(self._ids), session=session)
        ticket.matcher = self._matcher(request)
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
        self.enqueue(tickets)
        return TicketGroup(tickets, events)

    def enqueue(self, tickets: list[Ticket]) -> None:
        with self._cv:
            if self._stopping or self._drain_deadline is not None:
                raise ShuttingDown(SHUTDOWN_MESSAGE)
            if len(self._fifo) + len(tickets) > self.max_queue:
                raise QueueFull(f"the request queue is full ({self.max_queue} waiting)")
            borrowed = [id(t.session) for t in tickets if t.session is not None]
            if any(b in self._borrowed for b in borrowed):
                raise SchedulerError("the session is in use by another generation; finish or "
                                     "close that one first", param="session")
            self._borrowed.update(borrowed)
            for ticket in tickets:
                ticket._wake = self._wake
                self._fifo.append(ticket)
            self.counters["requests"] += len(tickets)
            self._cv.notify()

    def validate(self, request: Request, session: Session | None = None) -> None:
        """Raise SchedulerError, naming the field (`param`), for a request that can never run."""
        admission.check_request(self.model, request, self.max_batch, session)
        adapters = getattr(self.model.backend, "adapters", {})
        if request.adapter is not None and request.adapter not in adapters:
            raise SchedulerError(f"adapter {request.adapter!r} is not loaded (loaded: "
                                 f"{', '.join(sorted(adapters)) or 'none'})", param="model")
        if session is not None and session.adapter != request.adapter:
            raise SchedulerError(f"the session runs under adapter {session.adapter!r}, the "
                                 f"request under {request.adapter!r}", param="model")
        if request.reasoning is not None and self.think_tokens is None:
            raise SchedulerError("this model's vocabulary has no single-token <think> tags, so "
                                 "its reasoning cannot be split or bounded", param="reasoning")

    @functools.cached_property
    def think_tokens(self) -> ThinkTokens | None:
        """The model's think tags (kipp.text.reasoning), for requests with `reasoning`."""
        return think_tokens(self.model.tokenizer)

    def default_max_tokens(self, prompt_tokens: int, n: int, preferred: int) -> int:
        """max_tokens for a request that gives none (kipp.engine.admission)."""
        return admission.default_max_tokens(self.model, self.max_batch, prompt_tokens, n,
                                            preferred)

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

    def start(self) -> Scheduler:
        """Run the engine loop on its own thread."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="kipp-engine", daemon=True)
            self._thread.start()
        return self

    def call_on_engine(self, fn):
        """fn() on the engine thread between two steps (here when no engine thread runs),
        for what must not change under a running eval (LoRA adapters loaded at run time).
        Returns its result or raises its exception."""
        if self._thread is None:
            return fn()
        done, box = threading.Event(), {}

        def call():
            try:
                box["value"] = fn()
            except BaseException as e:  # handed to the caller's thread
                box["error"] = e
            finally:
                done.set()
        with self._cv:
            self._calls.append(call)
            self._cv.notify()
        done.wait()
        if "error" in box:
            raise box["error"]
        return box["value"]

    def uses_adapter(self, name: str) -> bool:
        """Whether a queued or running request runs under adapter `name`."""
        with self._cv:
            if any(t.request.adapter == name for t in self._fifo):
                return True
        return any(run.request.adapter == name for run in list(self._running))

    def _run_calls(self) -> None:
        while True:
            with self._cv:
                if not self._calls:
                    return
                call = self._calls.popleft()
            call()

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
            self._end_queued(self._fifo.popleft(), Failed(SHUTDOWN_MESSAGE))

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

    @property
    def idle(self) -> bool:
        return not self._fifo and not self._running

    def __enter__(self) -> Scheduler:
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
                    disk=_disk_stats(self.model), **self._compiles(), **self.counters)

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
                while (not self._stopping and not self._fifo and not self._running
                       and not self._calls):
                    self._cv.wait()
                stopping = self._stopping
            self._run_calls()  # also when stopping: a caller waits on each
            if stopping:
                return
            try:
                self.step()
            except Exception:  # a bug in the loop itself: fail what is running, keep serving
                log.exception("scheduler step failed")
                for run in self._running:
                    self._end(run, Failed("internal error in the engine step"))
                self._running.clear()

    def step(self) -> bool:
        """One step: reap, admit, evaluate every running choice's next tokens, apply the rows.
        Returns whether anything was evaluated."""
        started = time.perf_counter()
        self.reap()
        self._admit()
        planning, compiles = time.perf_counter(), compile_count(self.model)
        batch, timed = self._plan()
        if not batch:
            self._finish_ended()  # echo with max_tokens 0 ends without a decode step
            return False
        # a decode round in one eval call (an isolated choice's own call beside others' would
        # time two rounds as one)
        timed = (timed and all(not c.in_prompt for c, _ in batch)
                 and (len(batch) == 1 or not any(c.run.isolated for c, _ in batch)))
        try:
            evaluating = time.perf_counter()
            results = self._evaluate(batch)
            self.counters["eval_seconds"] += time.perf_counter() - evaluating
        except Exception as e:  # sessions are unchanged (eval_batch); fail only this batch
            log.exception("batched eval failed")
            for run in {id(c.run): c.run for c, _ in batch}.values():
                self._running.remove(run)
                self._end(run, Failed(f"evaluation failed: {e}", error=e))
            return True
        self.counters["steps"] += 1
        self._apply(batch, results)
        drafters = {c.drafter_key for c, _ in batch if c.draft}
        if timed and compile_count(self.model) == compiles and len(drafters) <= 1:
            # a round two drafters shared costs what neither's alone does: not timed
            self.clock.record(sum(len(tokens) for _, tokens in batch),
                              time.perf_counter() - planning, next(iter(drafters), None))
        self._finish_ended()
        self.counters["step_seconds"] += time.perf_counter() - started  # the steps counted
        return True

    def _plan(self) -> tuple[list[tuple[Choice, list[int]]], bool]:
        """The step's (choice, tokens), and whether its drafting was ordinary enough for the
        step's time to price the gates (draft_many)."""
        running = [c for r in self._running for c in r.live if c.state is ChoiceState.RUNNING]
        drafting = [(c, start) for c in running
                    if (start := c.start_draft(len(running))) is not None]
        if len(running) > 1:
            drafting = self._paying(running, drafting)
        ordinary = True
        if drafting:  # draft models draft in lockstep: one draft eval per position
            ordinary = draft_many([c.model_drafter for c, _ in drafting],
                                  [s for _, s in drafting])
            for c, _ in drafting:
                c.finish_draft()
        return [(c, c.next_tokens(self.prefill_chunk)) for c in running], ordinary

    @staticmethod
    def _paying(running: list[Choice], drafting: list[tuple]) -> list[tuple]:
        """The drafts of a step that pay for the rows every choice waits on (paying_drafts),
        each cut to the length it pays at; the other choices step plainly. `drafting`: the
        draft model's starts (tokens, limit, matcher); a prompt lookup's draft is already in
        its choice's `draft`. A gate that prices nothing (not an AdaptiveGate) keeps its
        choice's draft."""
        starts = {id(c): start for c, start in drafting}
        proposed = [(c, len(c.draft) or starts[id(c)][1]) for c in running
                    if (c.draft or id(c) in starts) and isinstance(c.gate, AdaptiveGate)]
        if not proposed:
            return drafting
        lengths = paying_drafts([(c.gate, k) for c, k in proposed], len(running))
        for (c, _), k in zip(proposed, lengths):
            if c.draft:
                c.draft = c.draft[:k]
                if not k:
                    c.draft_source = ""
            elif k:
                tokens, limit, matcher = starts[id(c)]
                starts[id(c)] = (tokens, min(limit, k), matcher)
            else:
                del starts[id(c)]
        return [(c, starts[id(c)]) for c, _ in drafting if id(c) in starts]

    def _evaluate(self, batch: list[tuple[Choice, list[int]]]) -> list[np.ndarray]:
        """Logits for every (choice, tokens) of a step: one backend call for the batch, plus
        one of its own for each choice of an isolated request (module docstring)."""
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

    def _apply(self, batch: list[tuple[Choice, list[int]]], results: list[np.ndarray]) -> None:
        for (choice, _), rows in zip(batch, results):
            if choice.state is ChoiceState.DONE:  # its request failed or closed in this loop
                continue
            try:
                choice.apply(rows)
            except GrammarError as e:  # a grammar that dead-ends: fail only its request
                self._fail_run(choice.run, f"constrained decoding failed: {e}", e)
                continue
            if (self.masks_ahead and choice.matcher is not None
                    and choice.state is ChoiceState.RUNNING):
                self._prefetch.append(choice.matcher)
        if self._prefetch:  # the next masks, while the next eval runs
            prefetch(self._prefetch)
            self._prefetch = []

    def _finish_ended(self) -> None:
        for run in [r for r in self._running if not r.live]:
            self._running.remove(run)
            self.counters["finished"] += 1
            self._end(run, run.done())

    def _fail_run(self, run: Run, message: str, error: BaseException | None = None) -> None:
        if run in self._running:
            self._running.remove(run)
        for choice in run.choices:
            choice.state = ChoiceState.DONE
        self._end(run, Failed(message, error=error))

    def run_until_idle(self, max_steps: int = 1_000_000) -> None:
        """Step until nothing is queued or running (tests drive the scheduler without a thread)."""
        for _ in range(max_steps):
            if self.idle:
                return
            self.step()
        raise SchedulerError(f"still busy after {max_steps} steps")

    def reap(self) -> None:
        """End what was cancelled, and while draining what is queued (at the deadline, what
        still runs): their blocks go back to the pool now."""
        with self._cv:
            cancelled = [t for t in self._fifo if t.cancelled]
            for ticket in cancelled:
                self._fifo.remove(ticket)
            draining = []
            if self._drain_deadline is not None:  # a draining scheduler runs nothing queued
                draining = list(self._fifo)
                self._fifo.clear()
        for ticket in cancelled:
            self.counters["cancelled"] += 1
            self._end_queued(ticket, Failed("cancelled", cancelled=True))
        for ticket in draining:
            self._end_queued(ticket, Failed(SHUTDOWN_MESSAGE))
        for run in [r for r in self._running if r.ticket.cancelled]:
            self._running.remove(run)
            self.counters["cancelled"] += 1
            self._end(run, Failed("cancelled", cancelled=True))
        if self._drain_deadline is not None and time.monotonic() >= self._drain_deadline:
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

    def _try_start(self, ticket: Ticket) -> Run | None:
        """Keep or adopt the prompt's prefix and reserve the worst case, or change nothing."""
        request, model = ticket.request, self.model
        run = Run(self, ticket)
        borrowed = ticket.session is not None
        leader = ticket.session if borrowed else model.session(
            len(request.prompt) + request.max_tokens, adapter=request.adapter)
        had_tokens = borrowed and bool(leader.tokens)
        # scoring a prompt needs every prompt row's logits, so it adopts nothing
        run.cached_tokens = admission.keep_prefix(leader, request.prompt,
                                                  adopt=run.adopts and not run.scores_prompt)
        run.reservation = admission.reserve(model, request, leader)
        if run.reservation is None:
            if not borrowed:
                leader.close(publish=False)
            elif not (had_tokens and run.cached_tokens):
                leader.reset()  # give back what was adopted; a kept prefix stays
            return None
        run.start(leader, ticket.matcher)
        self.counters["prompt_tokens"] += len(request.prompt)
        self.counters["reused_tokens"] += run.cached_tokens
        return run

    def _end(self, run: Run, event: Event) -> None:
        try:
            run.close()
        except Exception:
            log.exception("closing request %d failed", run.ticket.id)
        if isinstance(event, Failed) and not event.cancelled:
            self.counters["failed"] += 1
        self._end_queued(run.ticket, event)

    def _end_queued(self, ticket: Ticket, event: Event) -> None:
        if ticket.session is not None:
            self._borrowed.discard(id(ticket.session))
        ticket.put(event)


def _disk_stats(model) -> dict | None:
    """The KV disk tier's counters (kipp.engine.kv_disk), None without one."""
    disk = getattr(model, "kv_disk", None)
    return None if disk is None else disk.stats()


def masks_ahead_for(model) -> bool:
    return masks_ahead(getattr(model, "backend", None))
