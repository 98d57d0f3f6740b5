"""A running request and its choices: what each step evaluates for them and what it does after.

One invariant instead of phases: a choice's session catches up to its tokens. Until the prompt
is in the session a step evaluates the next prompt chunk; after that it evaluates the pending
(sampled, not yet evaluated) token and, for a speculative choice, a draft behind it. Rows come
back; the choice picks from them and hands each picked token to its ChoiceOutput.

The n choices of one request share their prompt: the first choice evaluates it and publishes its
full blocks, and the others (WAITING until then) adopt them and evaluate only the rest.
"""

from __future__ import annotations

import time
from enum import Enum

import numpy as np

from kipp.engine.draft import ModelDrafter
from kipp.engine.output import ChoiceOutput
from kipp.engine.requests import Delta, Done, FinishReason, Ticket, TokenLogprob, timings
from kipp.engine.session import Session
from kipp.engine.spec import AdaptiveGate, SpecConfig, SpecStats, drafter_key
from kipp.text.grammar import Matcher
from kipp.text.reasoning import ThinkTracker
from kipp.text.sampling import Sampler, logprobs


class ChoiceState(Enum):
    WAITING = "waiting"  # a follower, until the first choice has published the prompt's blocks
    RUNNING = "running"
    DONE = "done"


class Choice:
    """One sequence of a running request."""

    def __init__(self, run: Run, index: int, session: Session, matcher: Matcher | None):
        model, request = run.model, run.request
        self.run, self.index, self.session = run, index, session
        self.sampler = Sampler(request.sampling, choice=index)
        think = None
        if request.reasoning is not None:
            think = ThinkTracker(request.reasoning, run.scheduler.think_tokens, request.prompt)
        self.output = ChoiceOutput(index, model.tokenizer, model.entry.stop_token_ids,
                                   run.ticket.stops, request.max_tokens, request.logprobs,
                                   run.ticket.put, matcher, think)
        # Followers wait for the first choice's prompt blocks, unless the request adopts none
        # (then they prefill at once) or only scores its prompt (max_tokens 0: they never run).
        wait = index and (run.adopts or request.max_tokens == 0)
        self.state = ChoiceState.WAITING if wait else ChoiceState.RUNNING
        self.pending: int | None = None  # the picked token the next step evaluates
        spec = run.spec
        self.drafter = spec.drafter() if spec and spec.drafter else None
        self.model_drafter = None
        if spec and spec.draft_model is not None:
            self.model_drafter = ModelDrafter(spec.draft_model, request.sampling, index,
                                              session.capacity, model.entry.stop_token_ids)
            self.model_drafter.isolated = run.isolated
        self.gate = spec.gate() if spec else None
        self.drafter_key = drafter_key(spec) if spec else None  # its drafting rounds' clock
        if isinstance(self.gate, AdaptiveGate) and self.gate.clock is None:
            # priced by what the scheduler times (a gate given a clock keeps its own)
            self.gate.clock, self.gate.drafter = run.scheduler.clock, self.drafter_key
        self.spec = SpecStats() if spec else None
        self.draft: list[int] = []
        self.draft_q: list[np.ndarray] | None = None  # the distribution of each draft token
        self.draft_source = ""  # the drafter's name
        self.decode_evals = 0

    @property
    def matcher(self) -> Matcher | None:
        return self.output.matcher

    @property
    def in_prompt(self) -> bool:
        return self.pending is None

    def next_tokens(self, chunk: int) -> list[int]:
        """The tokens this step evaluates: the next prompt chunk, or pending + draft (drafted
        by start_draft, and finish_draft for a draft model, before the step)."""
        if self.in_prompt:
            start = self.session.length
            return list(self.run.request.prompt[start:start + chunk])
        return [self.pending] + self.draft

    def start_draft(self, batch: int = 1) -> tuple | None:
        """This step's draft from the choice's drafter, or when it has none and a draft model
        drafts, the (tokens, limit, matcher) to start that model's draft with
        (kipp.engine.draft.draft_many; then finish_draft). `batch`: the choices in this step,
        which the gate prices the verify's rows by."""
        self.draft, self.draft_q, self.draft_source = [], None, ""
        if self.in_prompt or self.gate is None:
            return None
        budget = self._budget(batch)
        if budget <= 0:
            return None
        tokens = self.session.tokens + [self.pending]
        if self.drafter is not None:
            draft = self.drafter.draft(tokens, budget)
            # cutting a deterministic draft at a barred token keeps sampling exact: that
            # token's verify would reject it for sure and draw from p itself
            if draft and self.matcher is not None:
                draft = draft[:self.matcher.valid_prefix(draft)]
            if draft:
                self.draft = draft
                self.draft_source = getattr(self.drafter, "name", "custom")
                return None
        if self.model_drafter is not None:
            return tokens, budget, self.matcher
        return None

    def finish_draft(self) -> None:
        """Take the draft model's draft (every token of it: cutting a sampled draft at a token
        would bias the verify's residual)."""
        drafter = self.model_drafter
        if drafter.tokens:
            self.draft, self.draft_q = list(drafter.tokens), drafter.qs
            self.draft_source = drafter.name

    def rows(self, tokens: list[int]) -> int:
        """Logits rows to ask for `tokens`: every row when scoring the prompt."""
        if self.in_prompt:
            return len(tokens) if self.index == 0 and self.run.scores_prompt else 1
        return 1 + len(self.draft)

    def apply(self, rows: np.ndarray) -> None:
        """Act on this step's logits rows (the session holds the evaluated tokens now)."""
        if self.in_prompt:
            if len(rows) > 1:
                self.run.score_prompt(self, rows)
            if self.session.length < len(self.run.request.prompt):
                return  # more prompt chunks to go
            if self.run.prompt_done(self):
                self._pick(rows[-1])
            return
        self.decode_evals += 1
        if self.draft:
            self._verify(rows)
        else:
            if self.spec is not None:
                self.spec.plain_evals += 1
            self._pick(rows[-1])

    def finish(self, reason: FinishReason) -> None:
        """End the choice from outside its own tokens (the request scores its prompt only)."""
        self.output.finish(reason)
        self.close()

    def close(self) -> None:
        self.state = ChoiceState.DONE
        self.pending = None
        if self.model_drafter is not None:
            self.model_drafter.close()
        if self.index == 0 and self.run.prompt_done_at is None:
            self.run.prompt_done_at = time.perf_counter()

    def _pick(self, logits: np.ndarray, history=None, drafted: int | None = None,
              q: np.ndarray | None = None) -> int:
        """Pick, emit and return the next token; at a drafted position (the draft token and
        the distribution it was drawn from) by the exact speculative rule."""
        think = self.output.think
        token = think.forced() if think is not None else None  # a reasoning budget's closing
        if token is None:
            allowed = None if self.matcher is None else self.matcher.allowed()
            history = self.session.tokens if history is None else history
            if drafted is None:
                token = self.sampler.sample(logits, history, allowed)
            else:
                token = self.sampler.verify(logits, history, allowed, drafted, q)
        before = len(self.output.generated)
        reason = self.output.accept(token, logits)
        self.run.scheduler.counters["generated_tokens"] += len(self.output.generated) - before
        if reason is not None:
            self.close()
        else:
            self.pending = token
        return token

    def _budget(self, batch: int) -> int:
        # The draft must fit the session, and emitting all of it plus the model's own next
        # token must not pass max_tokens.
        room = min(self.session.remaining - 1,
                   self.run.request.max_tokens - len(self.output.generated) - 1)
        think = self.output.think
        free = think.free() if think is not None else None
        if free is not None:  # the draft stops where a reasoning budget's closing starts
            room = min(room, free - 1)
        return min(self.gate.budget(batch), room)

    def _verify(self, rows: np.ndarray) -> None:
        """Accept the draft up to the first row whose pick disagrees, plus that pick; roll the
        rejected draft's KV back. Each pick goes through the output as a plain step's would,
        so stop tokens, stop strings and max_tokens cut in the same place. Greedy, a row's
        pick is its argmax; sampled, a drafted row keeps its draft token or draws from the
        residual (Sampler.verify), which never returns the rejected token."""
        draft, session = self.draft, self.session
        evaluated = session.length  # pending + draft are in the session now
        matched = 0
        for i, row in enumerate(rows):
            # Row i's history is the session's tokens up to and including its own position.
            history = session.tokens[: evaluated - len(draft) + i]
            if i < len(draft):
                q = None if self.draft_q is None else self.draft_q[i]
                token = self._pick(row, history, draft[i], q)
            else:
                token = self._pick(row, history)
            if i == len(draft) or token != draft[i]:
                break
            matched += 1  # a drafted stop token counts: the draft was right
            if self.state is ChoiceState.DONE:
                break
        self.gate.update(len(draft), matched)
        self.spec.record(self.draft_source, len(draft), matched)
        counters = self.run.scheduler.counters
        for suffix in ("", f"_{self.draft_source}"):
            counters[f"spec_drafted{suffix}"] = counters.get(f"spec_drafted{suffix}", 0) + \
                len(draft)
            counters[f"spec_accepted{suffix}"] = counters.get(f"spec_accepted{suffix}", 0) + \
                matched
        keep = evaluated - len(draft) + matched
        if self.state is not ChoiceState.DONE and keep < evaluated:
            session.truncate(keep)


class Run:
    """A request admitted to the batch: its choices, its reservation, its timings."""

    def __init__(self, scheduler, ticket: Ticket):
        self.scheduler, self.ticket = scheduler, ticket
        self.model = scheduler.model
        self.request = request = ticket.request
        self.choices: list[Choice] = []
        self.reservation = None
        self.cached_tokens = 0
        self.admitted_at = time.perf_counter()
        self.prompt_done_at: float | None = None
        # A seeded sampled request on a batch-variant backend runs alone and adopts nothing.
        self.isolated = (not self.model.backend.batch_invariant
                         and request.sampling.seed is not None
                         and not request.sampling.is_greedy)
        self.adopts = not self.isolated  # whether choices adopt published prompt blocks
        self.scores_prompt = request.echo and request.logprobs is not None
        self.prompt_logprobs: list[TokenLogprob] = []  # echo: one per prompt token so far
        # A request's own SpecConfig, else the scheduler's: one (a draft model) for every
        # request, or True: prompt lookup for greedy requests
        self.spec: SpecConfig | None = request.spec
        if self.spec is None and isinstance(scheduler.speculative, SpecConfig):
            self.spec = scheduler.speculative
        elif self.spec is None and scheduler.speculative and request.sampling.is_greedy:
            self.spec = SpecConfig()

    @property
    def live(self) -> list[Choice]:
        return [c for c in self.choices if c.state is not ChoiceState.DONE]

    def start(self, leader: Session, matcher: Matcher | None) -> None:
        """Create the choices: the first on `leader`, the others on new reserved sessions;
        one grammar state per choice, copied before any token."""
        capacity = len(self.request.prompt) + self.request.max_tokens
        leader.reservation = self.reservation
        for i in range(self.request.n):
            session = leader if i == 0 else self.model.session(capacity, self.reservation,
                                                               adapter=leader.adapter)
            copy = matcher if i == 0 or matcher is None else matcher.copy()
            self.choices.append(Choice(self, i, session, copy))

    def prompt_done(self, choice: Choice) -> bool:
        """A choice has its prompt's KV; whether it goes on to pick its first token."""
        if choice.index != 0:
            return True
        self.prompt_done_at = time.perf_counter()
        if self.request.echo:
            self._echo()
        if self.request.max_tokens == 0:  # echo only: the prompt is scored, nothing to add
            for c in self.live:
                c.finish(FinishReason.LENGTH)
            return False
        self._release_followers()
        return True

    def score_prompt(self, choice: Choice, rows: np.ndarray) -> None:
        """Logprobs of the prompt tokens that this prefill chunk's rows predict."""
        prompt = self.request.prompt
        start = choice.session.length - len(rows)  # position of the chunk's first token
        if start == 0:
            self.prompt_logprobs.append(TokenLogprob(prompt[0], None, None))
        targets = prompt[start + 1: start + 1 + len(rows)]  # the last row predicts no prompt
        for row, token in zip(rows, targets):
            lp, top = logprobs(row, token, self.request.logprobs)
            self.prompt_logprobs.append(TokenLogprob(token, lp, tuple(top)))

    def _echo(self) -> None:
        """Every choice's events start with the prompt (and its logprobs when scored)."""
        prompt = self.request.prompt
        text = self.model.tokenizer.decode(list(prompt))
        for choice in self.choices:
            self.ticket.put(Delta(choice.index, text, prompt, tuple(self.prompt_logprobs)))

    def _release_followers(self) -> None:
        """The first choice has the prompt's KV: publish its full blocks, let the others adopt."""
        followers = self.choices[1:]
        if not followers or not self.adopts:
            return  # a request that adopts nothing started its followers at admission
        leader = self.choices[0].session
        self.model.pool.publish(leader.tokens, leader.block_table, salt=leader.salt)
        for follower in followers:
            adopted = follower.session.match_prefix(self.request.prompt)
            self.scheduler.counters["reused_tokens"] += adopted
            follower.state = ChoiceState.RUNNING

    def close(self) -> None:
        """Publish every owned choice's full blocks, release them and the unused reservation;
        a borrowed session stays open, holding what it evaluated."""
        for choice in self.choices:
            if choice.model_drafter is not None:
                choice.model_drafter.close()
            if choice.session is self.ticket.session:
                choice.session.reservation = None
            else:
                choice.session.close(publish=True)
        if self.reservation is not None:
            self.reservation.release()

    def done(self) -> Done:
        """The request's Done event, its timings measured from admission."""
        now = time.perf_counter()
        prompt_done = self.prompt_done_at or now
        completion = sum(len(c.output.generated) for c in self.choices)
        spec = None
        if self.spec is not None:
            spec = SpecStats()
            for c in self.choices:
                spec.add(c.spec)
        return Done(len(self.request.prompt), self.cached_tokens, completion,
                    timings(len(self.request.prompt) - self.cached_tokens, self.cached_tokens,
                            1000 * (prompt_done - self.admitted_at), completion,
                            1000 * (now - prompt_done),
                            1000 * (self.admitted_at - self.ticket.submitted_at)),
                    decode_evals=sum(c.decode_evals for c in self.choices),
                    decode_tokens=sum(max(0, c.output.picked - 1) for c in self.choices),
                    spec=spec)
